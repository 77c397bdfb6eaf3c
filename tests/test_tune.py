"""stageplan tune: the profile -> plan -> run -> calibrate -> re-plan loop, on 2 local ranks (slow)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli

import stageplan
from stageplan import Profile, RunReport
from stageplan.formats.plan import Plan

SMALL = ["--set", "n_layer=4", "--set", "d_model=64", "--set", "n_head=2", "--set", "seq_len=16",
         "--set", "vocab_size=4096", "--set", "batch_size=8"]


@pytest.mark.slow
def test_tune_writes_its_rounds_the_final_plan_and_the_uniform_reference(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
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
    # the calibrated profile the final plan came from (re-planning it gives that plan) and the median fresh runs
    calibrated = Profile.load(tmp_path / "profile.json")
    assert calibrated.digest() == final.profile_digest and "calibration" in calibrated.meta
    assert stageplan.plan(calibrated, 2, num_microbatches=4).boundaries == final.boundaries
    for name in ("final", "uniform"):
        rep = RunReport.load(tmp_path / f"run_{name}.json")
        assert list(rep.plan["boundaries"]) == result[name]["boundaries"]
        assert rep.measured_step_s in result[name]["measured_steps_s"]
    assert f"{tmp_path}/run_uniform.json" in out
    # the first profile was the median of two fresh processes, and the plan says so
    assert final.profile_meta["processes"]["count"] == 2 and len(final.profile_meta["processes"]["digests"]) == 2
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
    assert "round 1:" in out and "final / uniform measured" in out and "tune round 1" in err
    # each round's plan ran twice too, its median run calibrated
    assert all(len(r["measured_steps_s"]) == 2 for r in result["rounds"]) and "(the median of 2 runs)" in out
    assert "the median of 2 fresh runs, the two plans in turns" in out


def test_tune_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["tune", "gpt", "--stages", "2", "--rounds", "0", "-o", str(tmp_path)], capsys)
    assert_one_line_error(code, err, r"rounds must be an integer >= 1, got 0")
    code, _, err = run_cli(["tune", "gpt", "--stages", "2", "-o", "/proc/tune"], capsys)
    assert_one_line_error(code, err, r"cannot write")
    code, _, err = run_cli(["tune", "gpt", "--stages", "2", "--processes", "0", "-o", str(tmp_path / "t")], capsys)
    assert_one_line_error(code, err, r"processes must be an integer >= 1, got 0; e\.g\. --processes 3")
    prof = str(Path(__file__).resolve().parents[1] / "profiles" / "cpu" / "gpt.json")
    # tuning again from the calibrated profile a tune wrote, into the same folder, would overwrite it
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "profile.json").write_bytes(Path(prof).read_bytes())
    code, _, err = run_cli(["tune", "gpt", "--stages", "2", "--profile", str(tmp_path / "again" / "profile.json"),
                            "-o", str(tmp_path / "again")], capsys)
    assert_one_line_error(code, err, r"is one of the files this command writes into")
    code, _, err = run_cli(["compare", "gpt", "--stages", "2", "--processes", "2", "--profile", prof], capsys)
    assert_one_line_error(code, err, r"--processes 2 profiles the model in fresh processes, and --profile gives the "
                                     r"profile to start from; drop one of them")
    # refused before a profile is taken (it was refused only by the first run, after a 7 s profile)
    from stageplan.profiling import profiler

    def no_profile(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("profiled for input that should have been refused")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(profiler, "profile_model", no_profile)
        for cmd in ("tune", "compare"):
            code, _, err = run_cli([cmd, "gpt", "--set", "n_layer=2", "--stages", "2", "--microbatches", "3",
                                    "-o", str(tmp_path / "t")], capsys)
            assert_one_line_error(code, err, r"the batch of 8 does not divide into the plan's 3 microbatches.* or plan "
                                             r"with one of \[1, 2, 4, 8\] microbatches")
    assert not (tmp_path / "t").exists()


def test_tune_runs_each_rounds_plan_k_times_and_calibrates_from_the_median_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """--runs K: a round's plan runs K times back to back and calibrate gets the run whose step is the median; the
    final and uniform plans then run K times each in turns (fake runs of known step, the calibration recorded)."""
    from types import SimpleNamespace

    import stageplan.running.launch
    import stageplan.tuning

    steps = iter([0.30, 0.20, 0.10, 0.21, 0.25, 0.22, 0.26, 0.19, 0.24])
    ran: list[tuple[tuple[int, ...], object]] = []
    calibrated: list[object] = []

    def fake_run(model: str, pl: Plan, **_: object) -> object:
        rep = SimpleNamespace(measured_step_s=next(steps))
        ran.append((pl.boundaries, rep))
        return rep

    def fake_calibrate(prof: object, rep: object) -> object:
        calibrated.append(rep)
        return prof  # the plan does not move: the loop stops after one round

    monkeypatch.setattr(stageplan.running.launch, "run", fake_run)
    monkeypatch.setattr(stageplan.tuning, "calibrate", fake_calibrate)
    prof = str(Path(__file__).resolve().parents[1] / "profiles" / "cpu" / "gpt.json")
    result = stageplan.tuning.tune("gpt", 2, profile=prof, rounds=3, runs=3)
    assert len(ran) == 3 + 2 * 3
    first, final, uniform = result["rounds"][0], result["final"], result["uniform"]
    assert len(result["rounds"]) == 1 and first["measured_steps_s"] == [0.30, 0.20, 0.10]
    assert first["measured_step_s"] == 0.20 and calibrated == [ran[1][1]]  # the median run, neither the first nor the last
    assert {b for b, _ in ran[:3]} == {tuple(first["boundaries"])}
    # then in turns: final, uniform, final, ...
    assert [b for b, _ in ran[3:]] == [tuple(final["boundaries"]), tuple(uniform["boundaries"])] * 3
    assert final["measured_steps_s"] == [0.21, 0.22, 0.19] and uniform["measured_steps_s"] == [0.25, 0.26, 0.24]
    assert result["final_over_uniform_measured"] == pytest.approx(statistics.median([0.25 / 0.21, 0.26 / 0.22, 0.24 / 0.19]))
