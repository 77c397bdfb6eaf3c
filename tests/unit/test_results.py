"""benchmarks/results.py: make bench's records and the tables of docs/accuracy.md regenerated from them, on
synthetic records whose medians, ranges and counts are worked out by hand. No torch, no stageplan."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    # benchmarks/ is not a package; load its generator by path, as make bench runs it
    spec = importlib.util.spec_from_file_location("bench_results", ROOT / "benchmarks" / "results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_results"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


results = _load()

START = {"date": "2026-12-06T08:00:00+00:00", "commit": "abc1234", "dirty": False, "cpu_model": "Test CPU",
         "cpus": 2, "load_average": [1.5, 1.0, 0.5], "torch": "2.0", "python": "3.11"}


def _write(directory: Path, date: str, executor: dict[str, float | None], cpu: str = "Test CPU") -> Path:
    return results.record({"executor": executor}, start={**START, "date": date, "cpu_model": cpu},
                          wall_s=600.0, directory=directory)


def test_a_record_holds_the_host_and_every_figure(tmp_path: Path) -> None:
    path = _write(tmp_path, "2026-12-06T08:00:00+00:00", {"step_median": 0.064, "runs": 24})
    rec = json.loads(path.read_text())
    assert path.name == "2026-12-06T080000Z-abc1234.json"
    assert rec["schema"] == "stageplan.bench/1" and rec["sections"] == {"executor": {"step_median": 0.064,
                                                                                      "runs": 24}}
    assert rec["cpu_model"] == "Test CPU" and rec["load_average"] == [1.5, 1.0, 0.5]
    assert len(rec["load_average_end"]) == 3 and rec["wall_s"] == 600.0
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    host = results.host()
    assert {"date", "commit", "cpu_model", "cpus", "load_average", "torch", "python"} <= set(host)
    with pytest.raises(results.RecordError, match=r"figure executor\.step_median is '6\.4%'; a record holds "
                                                  r"numbers \(or null\)"):
        results.record({"executor": {"step_median": "6.4%"}}, start=START, wall_s=1.0, directory=tmp_path)


def test_a_row_gives_the_median_range_worst_and_count_over_the_records(tmp_path: Path) -> None:
    """Step errors 0.05, 0.30, 0.10 and one record without the figure: median 10.0%, range 5.0-30.0%, worst
    30.0%; within 15% in 2 of 3. A gain (worst = the least) 1.10, 1.30, 0.95: median 1.10x, worst 0.95x, at
    least 1.00x in 2 of 3. One record alone is said to be one run."""
    for day, step, gain in (("01", 0.05, 1.10), ("02", 0.30, 1.30), ("03", 0.10, 0.95)):
        _write(tmp_path, f"2026-12-{day}T08:00:00+00:00", {"step_median": step, "gain": gain})
    _write(tmp_path, "2026-12-04T08:00:00+00:00", {"gain": None})
    records = results.load_records(tmp_path)
    assert [r["date"][:10] for r in records] == ["2026-12-01", "2026-12-02", "2026-12-03", "2026-12-04"]
    step = results.Row("step", "executor", "step_median", goal=0.15)
    assert step.cell(records) == ("median 10.0% over 3 runs (5.0%–30.0%); worst 30.0%; within 15.0% in 2 "
                                  "of 3")
    gain = results.Row("gain", "executor", "gain", results.times, goal=1.0, worst="min")
    assert gain.cell(records) == ("median 1.10× over 3 runs (0.95×–1.30×); worst 0.95×; at least 1.00× in "
                                  "2 of 3")
    assert step.cell(records[:1]) == "5.0% (one run; within 15.0% in 1 of 1)"
    assert step.cell(records[3:]) == "not measured yet"
    assert results.hosts(records) == "Test CPU, 2026-12-01 to 2026-12-04"


def test_regenerate_rewrites_only_the_marked_tables(tmp_path: Path) -> None:
    """The hand text outside the markers stays byte for byte; each block holds its table over all records;
    the runs table has one line per record with its host and load."""
    runs = tmp_path / "results"
    _write(runs, "2026-12-01T08:00:00+00:00", {"step_median": 0.05}, cpu="CPU A")
    _write(runs, "2026-12-02T08:00:00+00:00", {"step_median": 0.07}, cpu="CPU B")
    doc = tmp_path / "accuracy.md"
    hand = "# Accuracy\n\nwritten by hand\n"
    doc.write_text(f"{hand}<!-- begin: steps -->\nold table\n<!-- end: steps -->\nbetween\n"
                   "<!-- begin: runs -->\n<!-- end: runs -->\nafter\n")
    steps = [results.Row("step error, median |x - 1|", "executor", "step_median", goal=0.10)]
    tables = {"steps": steps, "runs": None}
    out = results.regenerate(doc, runs, tables)
    assert out == doc.read_text()
    assert out.startswith(hand) and "old table" not in out
    assert "\nbetween\n" in out and out.endswith("after\n")
    assert ("| step error, median \\|x - 1\\| | median 6.0% over 2 runs (5.0%–7.0%); worst 7.0%; "
            "within 10.0% in 2 of 2 | `make bench` | CPU A; CPU B, 2026-12-01 to 2026-12-02 |") in out
    assert "| 2026-12-01 08:00 | abc1234 | CPU A | 2 | 1.50 / " in out
    assert results.regenerate(doc, runs, tables) == out  # the same records give the same document


def test_regenerate_refuses_blocks_and_tables_out_of_step(tmp_path: Path) -> None:
    doc = tmp_path / "accuracy.md"
    doc.write_text("<!-- begin: stray -->\n<!-- end: stray -->\n")
    with pytest.raises(results.RecordError, match=r"blocks \['stray'\] have no table, tables \['runs'\] have "
                                                  r"no block; add the markers or the table"):
        results.regenerate(doc, tmp_path, {"runs": None})
    (tmp_path / "old.json").write_text(json.dumps({"schema": "stageplan.bench/0"}))
    with pytest.raises(results.RecordError, match=r"old\.json has schema 'stageplan\.bench/0', this "
                                                  r"generator reads 'stageplan\.bench/1'"):
        results.load_records(tmp_path)


def test_the_document_and_the_generator_agree() -> None:
    """docs/accuracy.md has a block for every table of the generator and no other, and the committed tables
    are what the committed records give (the generator was run after the last record)."""
    doc = (ROOT / "docs" / "accuracy.md").read_text(encoding="utf-8")
    names = [m.group("name") for m in results.BLOCK.finditer(doc)]
    assert sorted(names) == sorted(results.TABLES)
    records = results.load_records()
    for m in results.BLOCK.finditer(doc):
        rows = results.TABLES[m.group("name")]
        want = results.runs_table(records) if rows is None else results.table(rows, records)
        assert m.group("body") == want + "\n", f"docs/accuracy.md's {m.group('name')} table is stale: run " \
                                               "python benchmarks/results.py --regenerate"
