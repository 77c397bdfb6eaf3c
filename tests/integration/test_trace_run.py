"""The Perfetto trace of a real 2-rank run: valid trace-event
JSON whose events are the RunReport's timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_a_two_rank_runs_trace_matches_its_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import run_cli

    opts = ["--set", "n_layer=2", "--set", "vocab_size=512", "--set", "seq_len=32"]
    assert run_cli(["profile", "gpt", *opts, "--warmup", "1", "--repeats", "2", "--quiet",
                    "-o", str(tmp_path / "p.json")], capsys)[0] == 0
    assert run_cli(["plan", str(tmp_path / "p.json"), "--stages", "2", "--microbatches", "4",
                    "-o", str(tmp_path / "plan.json")], capsys)[0] == 0
    code, _, err = run_cli(["run", "gpt", *opts, "--plan", str(tmp_path / "plan.json"), "--steps", "2",
                            "--warmup", "1", "-o", str(tmp_path / "run.json")], capsys)
    assert code == 0, err
    code, _, err = run_cli(["show", str(tmp_path / "run.json"), "--trace", str(tmp_path / "trace.json")],
                           capsys)
    assert code == 0, err
    trace = json.loads((tmp_path / "trace.json").read_text())
    report = json.loads((tmp_path / "run.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(report["timeline"]) > 0
    got = sorted((e["args"]["rank"], e["args"]["stage"], e["args"]["microbatch"], e["args"]["kind"],
                  round(e["ts"], 3), round(e["dur"], 3)) for e in events)
    want = sorted((r["rank"], r["stage"], r["microbatch"], r["kind"], round(r["start_s"] * 1e6, 3),
                   round((r["end_s"] - r["start_s"]) * 1e6, 3)) for r in report["timeline"])
    assert got == want
    assert {e["args"]["rank"] for e in events} == {0, 1} and {"F", "B"} <= {e["args"]["kind"] for e in events}
    assert trace["otherData"]["source"] == "run" and trace["displayTimeUnit"] == "ms"
