"""stageplan.tuning: tune's refusals, and its rounds with stand-in runs: each round's plan run k times and
calibrated from the median run, the objective and the order reaching every round."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli

import stageplan.tuning as tuning
from stageplan import Profile
from stageplan.errors import StageplanError
from stageplan.formats.plan import Plan

from .test_planner import quiet_plan


def test_tune_plans_every_round_for_its_objective(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake runs (known steps, calibration the identity): tune's rounds and final plan are the step
    objective's plan of the profile; the uniform reference is the uniform split."""
    from types import SimpleNamespace

    import stageplan.running.launch

    ran: list[Plan] = []

    def fake_run(model: str, pl: Plan, **_: object) -> object:
        ran.append(pl)
        return SimpleNamespace(measured_step_s=0.1, meta={}, ranks=[])

    monkeypatch.setattr(stageplan.running.launch, "run", fake_run)
    monkeypatch.setattr(tuning, "calibrate", lambda prof, rep: prof)
    prof = Profile.load(Path(__file__).resolve().parents[2] / "profiles" / "cpu" / "gpt.json")
    result = tuning.tune("gpt", 2, profile=prof, rounds=2, objective="step")
    want = quiet_plan(prof, 2, objective="step")
    assert result["final"]["boundaries"] == list(want.boundaries) and result["objective"] == "step"
    # round 1, final, uniform
    assert [pl.cost_options.get("objective") for pl in ran] == ["step", "step", None]
    assert ran[-1].method == "uniform"


def test_tune_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["tune", "gpt", "--stages", "2", "--rounds", "0", "-o", str(tmp_path)], capsys)
    assert_one_line_error(code, err, r"rounds must be an integer >= 1, got 0")
    code, _, err = run_cli(["tune", "gpt", "--stages", "2", "-o", "/proc/tune"], capsys)
    assert_one_line_error(code, err, r"cannot write")
    code, _, err = run_cli(["tune", "gpt", "--stages", "2", "--processes", "0", "-o", str(tmp_path / "t")],
                           capsys)
    assert_one_line_error(code, err, r"processes must be an integer >= 1, got 0; e\.g\. --processes 3")
    prof = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu" / "gpt.json")
    # tuning again from the calibrated profile a tune wrote, into the same folder, would overwrite it
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "profile.json").write_bytes(Path(prof).read_bytes())
    code, _, err = run_cli(["tune", "gpt", "--stages", "2", "--profile",
                            str(tmp_path / "again" / "profile.json"), "-o", str(tmp_path / "again")], capsys)
    assert_one_line_error(code, err, r"is one of the files this command writes into")
    code, _, err = run_cli(["compare", "gpt", "--stages", "2", "--processes", "2", "--profile", prof], capsys)
    assert_one_line_error(code, err, r"--processes 2 profiles the model in fresh processes, and --profile "
                                     r"gives the profile to start from; drop one of them")
    # refused before a profile is taken (it was refused only by the first run, after a 7 s profile)
    from stageplan.profiling import profiler

    def no_profile(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("profiled for input that should have been refused")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(profiler, "profile_model", no_profile)
        for cmd in ("tune", "compare"):
            code, _, err = run_cli([cmd, "gpt", "--set", "n_layer=2", "--stages", "2", "--microbatches", "3",
                                    "-o", str(tmp_path / "t")], capsys)
            assert_one_line_error(code, err, r"the batch of 8 does not divide into the plan's 3 "
                                             r"microbatches.* or plan with one of \[1, 2, 4, 8\] "
                                             r"microbatches")
    assert not (tmp_path / "t").exists()


def test_tune_runs_each_rounds_plan_k_times_and_calibrates_from_the_median_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--runs K: a round's plan runs K times back to back and calibrate gets the run whose step is the median;
    the final and uniform plans then run K times each in turns (fake runs of known step, the calibration
    recorded)."""
    from types import SimpleNamespace

    import stageplan.running.launch
    import stageplan.tuning

    steps = iter([0.30, 0.20, 0.10, 0.21, 0.25, 0.22, 0.26, 0.19, 0.24])
    ran: list[tuple[tuple[int, ...], object]] = []
    calibrated: list[object] = []

    def fake_run(model: str, pl: Plan, **_: object) -> object:
        rep = SimpleNamespace(measured_step_s=next(steps), meta={}, ranks=[])
        ran.append((pl.boundaries, rep))
        return rep

    def fake_calibrate(prof: object, rep: object) -> object:
        calibrated.append(rep)
        return prof  # the plan does not move: the loop stops after one round

    monkeypatch.setattr(stageplan.running.launch, "run", fake_run)
    monkeypatch.setattr(stageplan.tuning, "calibrate", fake_calibrate)
    prof = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu" / "gpt.json")
    result = stageplan.tuning.tune("gpt", 2, profile=prof, rounds=3, runs=3)
    assert len(ran) == 3 + 2 * 3
    first, final, uniform = result["rounds"][0], result["final"], result["uniform"]
    assert len(result["rounds"]) == 1 and first["measured_steps_s"] == [0.30, 0.20, 0.10]
    # the median run, neither the first nor the last
    assert first["measured_step_s"] == 0.20 and calibrated == [ran[1][1]]
    assert {b for b, _ in ran[:3]} == {tuple(first["boundaries"])}
    # then in turns: final, uniform, final, ...
    assert [b for b, _ in ran[3:]] == [tuple(final["boundaries"]), tuple(uniform["boundaries"])] * 3
    assert final["measured_steps_s"] == [0.21, 0.22, 0.19] and uniform["measured_steps_s"] == [0.25, 0.26,
                                                                                               0.24]
    assert result["final_over_uniform_measured"] == pytest.approx(
        statistics.median([0.25 / 0.21, 0.26 / 0.22, 0.24 / 0.19]))


def test_compare_and_tune_profile_in_the_order_given(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """--order reaches the profile compare and tune take, in this process and in fresh ones (the profiler and
    the runs are stand-ins that record what they were asked: a stored profile, fixed steps)."""
    from types import SimpleNamespace

    import stageplan.comparison as comparison
    import stageplan.profiling.profiler
    import stageplan.running.launch
    import stageplan.tuning as tuning
    from stageplan import Profile

    stored = Profile.load(Path(__file__).resolve().parents[2] / "profiles" / "cpu" / "gpt.json")
    asked: list[object] = []

    def fake_profile(*_: object, **kw: object) -> Profile:
        asked.append(kw.get("order"))
        return stored

    monkeypatch.setattr(stageplan.profiling.profiler, "profile_model", fake_profile)
    monkeypatch.setattr(stageplan.running.launch, "profile_in_processes", fake_profile)
    monkeypatch.setattr(stageplan.running.launch, "run",
                        lambda *a, **k: SimpleNamespace(measured_step_s=0.1, meta={}, ranks=[]))
    monkeypatch.setattr(tuning, "calibrate", lambda prof, rep: prof)
    monkeypatch.setattr(comparison, "_compare_runs", lambda *a, **k: None)
    tuning.tune("gpt", 2, rounds=1, order="layer")
    tuning.tune("gpt", 2, rounds=1, order="stage", processes=2)
    assert comparison.compare("gpt", 2, order="layer", objective="step")["objective"] == "step"
    tuning.tune("gpt", 2, rounds=1)
    # None: profile_model's default (stage where the model fits)
    assert asked == ["layer", "stage", "layer", None]
    # refused before any profile: an unknown order, and an order with a profile to start from
    with pytest.raises(StageplanError, match=r"order must be one of stage, layer, got 'chain'"):
        tuning.tune("gpt", 2, order="chain")
    prof = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu" / "gpt.json")
    for cmd in ("tune", "compare"):
        code, _, err = run_cli([cmd, "gpt", "--stages", "2", "--order", "layer", "--profile", prof,
                                "-o", str(tmp_path / cmd)], capsys)
        assert_one_line_error(code, err, rf"--order layer sets how the profile {cmd} takes times its layers, "
                                         r"and --profile gives the profile to start from; drop one of them")
        assert not (tmp_path / cmd).exists()
    assert len(asked) == 4


def _one_microbatch_profile(times: list[float]) -> Profile:
    """Layers whose forward and backward each take ``times[i]`` seconds, with no parameters, activations or
    outputs: at one GPipe microbatch with nothing priced on the crossings, a step is every layer's forward
    and backward one after the other, 2 * sum(times), whatever the split."""
    from stageplan import LayerProfile

    return Profile(tuple(LayerProfile(f"l{i}", t, t, 0, 0, 0) for i, t in enumerate(times)))


def test_tune_reports_repeatability_and_prediction_on_the_splits_it_was_not_fit_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Round 1 plans [1, 1, 1, 5] s layers (least bottleneck: [0, 3, 4]); calibration turns the profile into
    [5, 1, 1, 1] (least bottleneck [0, 1, 4]), round 2 runs that and the plan stays: the final profile was fit
    to round 2's run. Every split's predicted step from it is 2 * 8 = 16 s (one GPipe microbatch, see
    _one_microbatch_profile). Fake runs: round 1 20 s, round 2 17 s, the final plan's fresh run 16.8 s, the
    uniform split [0, 2, 4] 18 s. Repeatability 16.8 / 16 - 1 = +5%; prediction: uniform 18 / 16 - 1 =
    +12.5%, round 1 20 / 16 - 1 = +25%; median 18.75%, worst 25%."""
    from types import SimpleNamespace

    import stageplan.running.launch

    before, after = _one_microbatch_profile([1, 1, 1, 5]), _one_microbatch_profile([5, 1, 1, 1])
    steps = {(0, 3, 4): iter([20.0]), (0, 1, 4): iter([17.0, 16.8]), (0, 2, 4): iter([18.0])}
    monkeypatch.setattr(stageplan.running.launch, "run",
                        lambda model, pl, **_: SimpleNamespace(measured_step_s=next(steps[pl.boundaries]),
                                                               meta={},
                                                                        ranks=[0, 1]))
    monkeypatch.setattr(tuning, "calibrate", lambda prof, rep: after)
    result = tuning.tune("gpt", 2, profile=before, num_microbatches=1, schedule="GPipe",
                         rounds=3)
    assert [r["boundaries"] for r in result["rounds"]] == [[0, 3, 4], [0, 1, 4]]
    assert result["calibrated_on"] == [0, 1, 4] and result["final"]["boundaries"] == [0, 1, 4]
    assert result["repeatability_error"] == pytest.approx(0.05)
    assert [(e["split"], e["boundaries"]) for e in result["prediction_errors"]] == [
        ("uniform", [0, 2, 4]), ("round 1", [0, 3, 4])]
    assert [e["predicted_step_s"] for e in result["prediction_errors"]] == pytest.approx([16.0, 16.0])
    assert [e["error"] for e in result["prediction_errors"]] == pytest.approx([0.125, 0.25])
    assert result["prediction_error_median"] == pytest.approx(0.1875)
    assert result["prediction_error_worst"] == pytest.approx(0.25)


def test_tune_judges_a_final_plan_that_moved_after_the_last_calibration_as_a_prediction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With rounds=1 the plan moves after the only calibration (to [0, 1, 4], as above), so the final plan
    was not run before: its fresh run (17.6 s against 16 s, +10%) is a prediction, and there is no
    repeatability figure; the uniform split (16 s, 0%) is judged beside it: median 5%, worst 10%."""
    from types import SimpleNamespace

    import stageplan.running.launch

    steps = {(0, 3, 4): iter([20.0]), (0, 1, 4): iter([17.6]), (0, 2, 4): iter([16.0])}
    monkeypatch.setattr(stageplan.running.launch, "run",
                        lambda model, pl, **_: SimpleNamespace(measured_step_s=next(steps[pl.boundaries]),
                                                               meta={},
                                                                        ranks=[0, 1]))
    monkeypatch.setattr(tuning, "calibrate", lambda prof, rep: _one_microbatch_profile([5, 1, 1, 1]))
    result = tuning.tune("gpt", 2, profile=_one_microbatch_profile([1, 1, 1, 5]), num_microbatches=1,
                         schedule="GPipe", rounds=1)
    assert result["calibrated_on"] == [0, 3, 4] and result["repeatability_error"] is None
    assert [(e["split"], e["error"]) for e in result["prediction_errors"]] == [
        ("final", pytest.approx(0.1)), ("uniform", pytest.approx(0.0))]
    assert result["prediction_error_median"] == pytest.approx(0.05)
    assert result["prediction_error_worst"] == pytest.approx(0.1)
