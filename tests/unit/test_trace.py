"""Chrome trace-event JSON of a plan's predicted step and a run's measured one: the events are the simulator's
(or the report's) timeline, one to one, in microseconds, on a compute and a transfer track per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stageplan import plan
from stageplan.formats.trace import KIND_NAMES, chrome_trace

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "profiles" / "cpu" / "gpt.json"


def _complete(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


@pytest.mark.parametrize(("schedule", "v"), [("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)])
def test_a_plans_trace_is_its_simulated_timeline(schedule: str, v: int) -> None:
    pl = plan(GPT, 2, num_microbatches=4, schedule=schedule, virtual_stages=v, bandwidth="1GB/s")
    sim = pl.simulate()
    events = _complete(pl.chrome_trace())
    assert len(events) == len(sim.timeline) > 0
    for got, want in zip(sorted(events, key=lambda e: (e["ts"], e["tid"])),
                         sorted(sim.timeline,
                                key=lambda e: (e.start_s, e.rank + (10_000 if e.kind in "AG" else 0)))):
        assert got["args"] == {"rank": want.rank, "stage": want.stage, "microbatch": want.microbatch,
                               "kind": want.kind}
        assert got["ts"] == pytest.approx(want.start_s * 1e6) and got["dur"] == pytest.approx(
            (want.end_s - want.start_s) * 1e6)
        assert got["cat"] == KIND_NAMES[want.kind]
        # compute on the rank's own track, transfers on its receive track
        assert got["tid"] == want.rank + (10_000 if want.kind in ("A", "G") else 0)
    kinds = {e["args"]["kind"] for e in events}
    assert {"F", "A", "G", "O"} <= kinds  # with a bandwidth, the transfers are there; every rank steps
    assert ("W" in kinds) == (schedule == "ZBVZeroBubble")
    # the last event ends at the simulated step
    assert max(e["ts"] + e["dur"] for e in events) == pytest.approx(sim.step_s * 1e6)


def test_a_runs_trace_is_its_timeline() -> None:
    rows = [{"rank": 0, "stage": 0, "microbatch": 0, "kind": "F", "start_s": 0.0, "end_s": 0.004},
            {"rank": 1, "stage": 1, "microbatch": 0, "kind": "A", "start_s": 0.004, "end_s": 0.005},
            {"rank": 1, "stage": 0, "microbatch": -1, "kind": "T", "start_s": 0.006, "end_s": 0.0065}]
    trace = chrome_trace(rows, title="measured")
    events = _complete(trace)
    assert [(e["tid"], e["ts"], e["dur"], e["name"]) for e in events] == [
        (0, 0.0, 4000.0, "forward mb0 stage0"),
        (10_001, 4000.0, pytest.approx(1000.0), "activation transfer mb0 stage1"),
        (1, 6000.0, pytest.approx(500.0), "tied-gradient sync")]
    names = {(e["tid"], e["args"].get("name")) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {(0, "rank 0"), (1, "rank 1"), (10_001, "rank 1 receives")}
    json.dumps(trace)  # plain JSON


def test_cli_show_writes_a_trace_and_refuses_a_profile(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import assert_one_line_error, run_cli

    out = tmp_path / "plan.json"
    plan(GPT, 2, num_microbatches=4).save(out)
    code, _, err = run_cli(["show", str(out), "--trace", str(tmp_path / "trace.json")], capsys)
    assert code == 0, err
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace["otherData"]["source"] == "plan" and _complete(trace)
    code, _, err = run_cli(["show", str(GPT), "--trace", str(tmp_path / "t2.json")], capsys)
    assert_one_line_error(code, err,
                          r"--trace draws a step's timeline, and .* is a profile with none; give a plan")
    assert not (tmp_path / "t2.json").exists()
