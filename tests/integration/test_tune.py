"""tune end to end: its rounds, the final plan and the uniform reference, each run by ranks."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from conftest import run_cli

import stageplan
from stageplan import Profile, RunReport
from stageplan.formats.plan import Plan

SMALL = ["--set", "n_layer=4", "--set", "d_model=64", "--set", "n_head=2", "--set", "seq_len=16",
         "--set", "vocab_size=4096", "--set", "batch_size=8"]


def test_tune_writes_its_rounds_the_final_plan_and_the_uniform_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(["tune", "gpt", *SMALL, "--stages", "2", "--microbatches", "4", "--rounds", "2",
                              "--steps", "2", "--warmup", "1", "--processes", "2", "--runs", "2",
                              "-o", str(tmp_path / "new")], capsys)
    assert code == 0, err
    tmp_path = tmp_path / "new"  # a folder tune creates
    result = json.loads((tmp_path / "tune.json").read_text())
    assert result["schema"] == "stageplan.tune/1"
    assert 1 <= len(result["rounds"]) <= 2
    final = Plan.load(tmp_path / "plan.json")
    assert list(final.boundaries) == result["final"]["boundaries"]
    # the calibrated profile the final plan came from
    # (re-planning it gives that plan) and the median fresh runs
    calibrated = Profile.load(tmp_path / "profile.json")
    assert calibrated.digest() == final.profile_digest and "calibration" in calibrated.meta
    assert stageplan.plan(calibrated, 2, num_microbatches=4).boundaries == final.boundaries
    for name in ("final", "uniform"):
        rep = RunReport.load(tmp_path / f"run_{name}.json")
        assert list(rep.plan["boundaries"]) == result[name]["boundaries"]
        assert rep.measured_step_s in result[name]["measured_steps_s"]
    assert f"{tmp_path}/run_uniform.json" in out
    # the first profile was the median of two fresh processes, and the plan says so
    assert (
        final.profile_meta["processes"]["count"] == 2 and len(final.profile_meta["processes"]["digests"]) == 2
    )
    for row in [*result["rounds"], result["final"], result["uniform"]]:
        assert row["measured_step_s"] > 0 and row["predicted_step_s"] > 0
        assert row["error"] == pytest.approx(row["measured_step_s"] / row["predicted_step_s"] - 1)
    assert result["uniform"]["boundaries"] == [0, 3, 6]
    # a round stops the loop when re-planning keeps the split: only the last round may keep it
    bounds = [r["boundaries"] for r in result["rounds"]]
    assert all(a != b for a, b in zip(bounds, bounds[1:]))
    # --runs 2: the final plan and uniform twice each, in turns; medians, and the median of the paired gains
    final_steps, uniform_steps = result["final"]["measured_steps_s"], result["uniform"]["measured_steps_s"]
    assert len(final_steps) == len(uniform_steps) == 2 and result["runs"] == 2
    assert result["final"]["measured_step_s"] == pytest.approx(statistics.median(final_steps))
    assert result["final_over_uniform_measured"] == pytest.approx(
        statistics.median(u / f for u, f in zip(uniform_steps, final_steps)))
    # each round once: on stderr as it ends (without --quiet the table does not print them again)
    assert "round 1:" not in out and "final / uniform measured" in out and err.count("tune round 1:") == 1
    # each round's plan ran twice too, its median run calibrated
    assert all(len(r["measured_steps_s"]) == 2 for r in result["rounds"])
    assert "the median of 2 fresh runs, the two plans in turns" in out
    # two errors: the final plan on the split calibrated on (repeatability), and every other split it ran
    # priced from the calibrated profile against that split's own runs (prediction)
    assert result["calibrated_on"] == bounds[-1]
    others = [r for r in [result["uniform"], *result["rounds"][:-1]] if r["boundaries"] != bounds[-1]]
    if result["final"]["boundaries"] == bounds[-1]:
        assert result["repeatability_error"] == result["final"]["error"] and "repeatability (" in out
    else:
        others.insert(0, result["final"])
    assert [e["boundaries"] for e in result["prediction_errors"]] == [r["boundaries"] for r in others]
    for e, r in zip(result["prediction_errors"], others):
        priced = stageplan.plan(calibrated, 2, num_microbatches=4, boundaries=r["boundaries"])
        assert e["predicted_step_s"] == pytest.approx(priced.predicted_step_s)
        assert e["measured_step_s"] == r["measured_step_s"]
    if others:
        assert result["prediction_error_worst"] == pytest.approx(max(abs(e["error"]) for e in
                                                                     result["prediction_errors"]))
        assert "prediction (other splits, priced from the calibrated profile): median" in out
