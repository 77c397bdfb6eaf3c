"""stageplan.comparison: compare runs each distinct plan in turns and pairs the speed-ups, runs nothing when
every method agrees, and refuses a profile among the files it writes (the runs are stand-ins)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
from conftest import run_cli

from stageplan import RunReport
from stageplan.comparison import compare, in_turns, median_run, paired_speedup
from stageplan.formats.plan import Plan
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.running import launch


def test_compare_runs_nothing_when_every_method_agrees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("identical plans were run"))
    same = Profile(tuple(LayerProfile(str(i), 1.0, 1.0, 0, 0, 4) for i in range(4)),
                   {"batch_size": 8, "microbatch_size": 2})
    same.save(tmp_path / "same.json")
    result = compare("workloads:faulty", 2, profile=tmp_path / "same.json", output_dir=tmp_path / "cmp")
    assert result["identical"] and all("measured_step_s" not in r for r in result["methods"].values())
    code, out, _ = run_cli(["show", str(tmp_path / "cmp" / "compare.json")], capsys)
    assert code == 0 and "nothing to compare" in out


# the machine's speed factor in each turn: every plan of a turn runs at it
SPEEDS = [1.0, 2.0, 1.3]


def _report(step_s: float, predicted_s: float) -> RunReport:
    return RunReport(measured_step_s=step_s, predicted_step_s=predicted_s, measured_step_iqr_s=0.0,
                     samples_per_s=1.0, measured_bubble_fraction=0.0, predicted_bubble_fraction=0.0,
                     ranks=({"measured_peak_activation_bytes": 0},), losses=(), plan={}, run_options={})


def test_compare_runs_each_distinct_plan_in_turns_and_pairs_the_speedups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each run measures its plan's predicted step times the turn's speed. In turns, each method's median run
    is its predicted step times the median speed, and the speed-up of runs side by side is exactly the
    predicted one, however much the machine moved between turns."""
    import stageplan.running.launch

    calls: list[tuple[int, ...]] = []
    distinct = 2  # optimal and uniform differ; parameters splits as uniform does (every layer holds 4 bytes)

    def fake_run(model: str, pl: Plan, **_: Any) -> RunReport:
        turn = len(calls) // distinct
        calls.append(pl.boundaries)
        return _report(pl.predicted_step_s * SPEEDS[turn], pl.predicted_step_s)

    monkeypatch.setattr(stageplan.running.launch, "run", fake_run)
    skewed = Profile(tuple(LayerProfile(str(i), 1e-3 * (1 + 3 * i), 1e-3, 0, 8, 4) for i in range(4)),
                     {"batch_size": 8, "microbatch_size": 4, "model": "workloads:faulty"})
    result = compare("workloads:faulty", 2, profile=skewed, num_microbatches=2, runs=3)
    rows = result["methods"]
    opt, uni = rows["optimal"], rows["uniform"]
    assert opt["boundaries"] != uni["boundaries"] and rows["parameters"]["same_run_as"] == "uniform"
    assert calls == [tuple(opt["boundaries"]), tuple(uni["boundaries"])] * 3  # A B A B A B
    assert result["runs"] == 3
    for row in (opt, uni):
        assert row["measured_steps_s"] == pytest.approx([row["predicted_step_s"] * s for s in SPEEDS])
        assert row["measured_step_s"] == pytest.approx(row["predicted_step_s"] * statistics.median(SPEEDS))
    assert opt["speedup_over_uniform"] == pytest.approx(uni["predicted_step_s"] / opt["predicted_step_s"])
    assert uni["speedup_over_uniform"] == pytest.approx(1.0)


def test_in_turns_median_run_and_paired_speedup() -> None:
    order: list[str] = []

    def measure(item: str) -> RunReport:
        order.append(item)
        return _report(float(len(order)), 1.0)

    a, b, c = in_turns(["a", "b", "c"], 2, measure)
    assert [r.measured_step_s for r in b] == [2.0, 5.0]
    assert order == ["a", "b", "c", "a", "b", "c"]
    assert [r.measured_step_s for r in a] == [1.0, 4.0] and [r.measured_step_s for r in c] == [3.0, 6.0]
    # an even count: the lower of the two middle runs, a run that happened
    assert median_run([_report(s, 1.0) for s in (4.0, 1.0, 3.0, 2.0)]).measured_step_s == 2.0
    assert paired_speedup(c, a) == pytest.approx(statistics.median([3.0 / 1.0, 6.0 / 4.0]))
    assert paired_speedup([_report(1.0, 1.0)], [_report(0.0, 1.0)]) is None


def test_a_profile_among_the_files_compare_or_tune_write_is_refused(tmp_path: Path) -> None:
    from stageplan import StageplanError
    from stageplan.comparison import compare
    from stageplan.formats.profile import LayerProfile, Profile
    from stageplan.tuning import tune

    prof = Profile(tuple(LayerProfile(str(i), 1e-3, 1e-3, 0, 8, 4) for i in range(4)),
                   {"batch_size": 8, "microbatch_size": 4, "model": "workloads:faulty"})
    for fn, name in ((compare, "compare.json"), (compare, "plan_optimal.json"), (tune, "plan.json")):
        prof.save(tmp_path / name)
        before = (tmp_path / name).read_text()
        with pytest.raises(StageplanError,
                           match=rf"--profile '.*{name}' is one of the files this command writes"):
            fn("workloads:faulty", 2, profile=tmp_path / name, output_dir=tmp_path)
        assert (tmp_path / name).read_text() == before
