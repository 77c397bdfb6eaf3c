"""The optimal method's objective: the least bottleneck (default) or the lowest predicted step (--objective step).

Oracles: a hand-computed timeline (closed form), and every split of small models priced by ``evaluate`` (the event
simulator the search's batch pricer is checked against)."""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_error, run_cli

import stageplan.comparison as comparison
import stageplan.tuning as tuning
from stageplan import Device, LayerProfile, Profile, plan
from stageplan.errors import SchemaError, StageplanError
from stageplan.formats.plan import Plan
from stageplan.planning import search as split_search
from stageplan.planning.costs import LayerArrays, evaluate, make_options
from stageplan.planning.search import partition_balanced, partition_uniform

MS = 1e-3


def quiet_plan(*args, **kwargs) -> Plan:  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan(*args, **kwargs)


def xyz(opt_ms: float) -> Profile:
    """Three layers of 1 ms forward; backward 1, 1 and 1.2 ms; only the middle layer's optimizer step costs time."""
    rows = [("x", 1.0, 1.0, 0.0), ("y", 1.0, 1.0, opt_ms), ("z", 1.0, 1.2, 0.0)]
    return Profile(tuple(LayerProfile(n, f * MS, b * MS, 0, 0, 0, optimizer_s={"adam": o * MS}) for n, f, b, o in rows))


@pytest.mark.parametrize("opt_ms", [3.0, 0.5, 0.05, 0.0])
def test_closed_form_the_least_bottleneck_is_not_the_fastest_step(opt_ms: float) -> None:
    """GPipe, 2 ranks, one microbatch, the timeline by hand:
    [0, 2, 3]: rank 0 runs x, y forward (0-2), rank 1 z (2-3) and its backward (3-4.2), rank 0 backward (4.2-6.2), then
    rank 0's optimizer (y): step 6.2 + O; bottleneck max(4, 2.2) = 4 ms, the least.
    [0, 1, 3]: rank 0 x (0-1), rank 1 y, z forward (1-3) and backward (3-5.2), rank 0 backward (5.2-6.2); rank 1's
    optimizer (y) runs from 5.2: step max(6.2, 5.2 + O); bottleneck 4.2 ms."""
    prof = xyz(opt_ms)
    least = quiet_plan(prof, 2, num_microbatches=1, schedule="GPipe")
    fastest = quiet_plan(prof, 2, num_microbatches=1, schedule="GPipe", objective="step")
    assert least.boundaries == (0, 2, 3)
    assert least.bottleneck_s == pytest.approx(4.0 * MS) and least.predicted_step_s == pytest.approx((6.2 + opt_ms) * MS)
    other = max(6.2, 5.2 + opt_ms) * MS
    search = least.step_search
    assert search["objective"] == "bottleneck" and search["exhaustive"]
    assert search["from_boundaries"] == [0, 2, 3]
    if opt_ms == 0.0:  # a tie: the least-bottleneck split stays
        assert fastest.boundaries == (0, 2, 3) and search["to_boundaries"] == [0, 2, 3]
        assert not any("objective step" in n or "larger bottleneck" in n for n in [*least.notes, *fastest.notes])
        return
    assert fastest.boundaries == (0, 1, 3) and search["to_boundaries"] == [0, 1, 3]
    assert fastest.predicted_step_s == pytest.approx(other) and fastest.bottleneck_s == pytest.approx(4.2 * MS)
    assert search["to_step_s"] == pytest.approx(other) and search["to_bottleneck_s"] == pytest.approx(4.2 * MS)
    assert fastest.cost_options["objective"] == "step" and least.cost_options["objective"] == "bottleneck"
    assert fastest.step_search["objective"] == "step"
    note = next(n for n in fastest.notes if n.startswith("objective step"))
    assert f"predicted step {(6.2 + opt_ms):.3f} -> {other * 1e3:.3f} ms" in note and "[0, 2, 3]" in note
    # the default names the faster split only when it is at least 1% faster (0.05 ms: 6.25 -> 6.2, 0.8%)
    named = [n for n in least.notes if n.startswith("a split with a larger bottleneck predicts a faster step")]
    if other / ((6.2 + opt_ms) * MS) <= 0.99:
        assert len(named) == 1 and "[0, 1, 3]" in named[0] and "--objective step" in named[0]
    else:
        assert not named


def brute_force(prof: Profile, p: int, m: int, schedule: str, v: int, **kw) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Over every split that fits in memory: the least bottleneck and the lowest simulated step (evaluate)."""
    arr = LayerArrays.of(prof, m)
    opts = make_options(prof, p, num_microbatches=m, schedule=schedule, virtual_stages=v, **kw)
    n = len(prof)
    scored = [evaluate(arr, (0, *cuts, n), opts) for cuts in itertools.combinations(range(1, n), p * v - 1)]
    fitting = [ev for ev in scored if not any("over its limit" in x for x in ev.notes)]
    return min(ev.bottleneck_s for ev in fitting), min(ev.predicted_step_s for ev in fitting)


def random_profile(rng: np.random.Generator, n: int) -> Profile:
    f = rng.lognormal(0, 0.6, n) * MS
    b = f * rng.uniform(1.2, 2.5, n)
    opt = rng.choice([0.0, 0.0, 1.0, 4.0], n) * MS  # a few layers with a heavy optimizer step, as an LM head's
    act = rng.integers(0, 100, n)
    out = rng.integers(0, 200, n)
    return Profile(tuple(LayerProfile(f"l{i}", float(f[i]), float(b[i]), int(act[i]), int(out[i]), 10,
                                      optimizer_s={"adam": float(opt[i])}) for i in range(n)))


CASES = (("GPipe", 3, 4, 1, {}), ("1F1B", 2, 4, 1, {"bandwidth_bytes_per_s": 1e5}),
         ("1F1B", 3, 3, 1, {"memory_limit_bytes": 600.0}), ("Interleaved1F1B", 2, 4, 2, {}),
         ("1F1B", 3, 6, 1, {"devices": [Device(1.0), Device(0.5), Device(2.0)]}))


def test_the_step_objective_finds_the_lowest_step_of_every_split() -> None:
    moved = 0
    for seed in range(8):
        rng = np.random.default_rng(seed)
        prof = random_profile(rng, int(rng.integers(5, 10)))
        for schedule, p, m, v, kw in CASES:
            if p * v > len(prof):
                continue
            args = dict(num_microbatches=m, schedule=schedule, virtual_stages=v, memory_limit=kw.get("memory_limit_bytes"),
                        bandwidth=kw.get("bandwidth_bytes_per_s"), devices=kw.get("devices"))
            try:
                least = quiet_plan(prof, p, **args)
            except StageplanError:
                continue  # no split fits the limit
            fastest = quiet_plan(prof, p, objective="step", **args)
            bottleneck, step = brute_force(prof, p, m, schedule, v, **kw)
            # the default keeps the least bottleneck; both find the lowest step of all the splits that fit
            assert least.bottleneck_s == pytest.approx(bottleneck, rel=1e-9), (seed, schedule)
            assert fastest.predicted_step_s == pytest.approx(step, rel=1e-9), (seed, schedule, p)
            assert least.step_search["to_step_s"] == pytest.approx(step, rel=1e-9)
            assert least.step_search["exhaustive"] and fastest.step_search["exhaustive"]
            assert list(fastest.boundaries) == least.step_search["to_boundaries"]
            assert fastest.predicted_step_s <= least.predicted_step_s * (1 + 1e-12)
            assert max(fastest.rank_memory_bytes) <= (kw.get("memory_limit_bytes") or np.inf)
            moved += fastest.boundaries != least.boundaries
    assert moved >= 5, moved  # not all trivial: the objectives chose different splits in 11 of these cases when written


def test_the_descents_never_end_slower_than_their_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Too many splits to list: descents from the least-bottleneck split, the uniform and the parameter-balanced
    ones. The result is no slower than any of the three (each scored as a given split)."""
    monkeypatch.setattr(split_search, "_TIE_SPLITS", 1)
    rng = np.random.default_rng(5)
    prof = random_profile(rng, 40)
    kw = dict(num_microbatches=12, schedule="1F1B")
    pl = quiet_plan(prof, 6, objective="step", **kw)
    search = pl.step_search
    assert not search["exhaustive"] and search["splits_evaluated"] > 3
    seeds = [search["from_boundaries"], list(partition_uniform(40, 6)),
             list(partition_balanced([lp.param_bytes for lp in prof.layers], 6))]
    for seed in seeds:
        assert pl.predicted_step_s <= quiet_plan(prof, 6, boundaries=seed, **kw).predicted_step_s * (1 + 1e-12)
    assert pl.predicted_step_s == pytest.approx(search["to_step_s"], rel=1e-9)
    assert search["splits_evaluated"] <= max(1, split_search._TIE_WORK // (2 * 6 * 12))


def test_an_interleaved_rank_sum_hides_unbalanced_chunks() -> None:
    """Interleaved ranks are balanced on the sum of their chunks, and the sum hides how the chunks are cut: two
    ranks x 2 chunks over twelve layers of 1 ms (f 0.4, b 0.6), 4 microbatches. Every split below puts 6 layers on
    each rank (chunks 0 and 2 on rank 0), and their steps span 26.4 to 33.0 ms. Both objectives end at the lowest
    step of every split (brute force)."""
    prof = Profile(tuple(LayerProfile(f"l{i}", 0.4 * MS, 0.6 * MS, 0, 0, 0) for i in range(12)))
    kw = dict(num_microbatches=4, schedule="Interleaved1F1B", virtual_stages=2)
    splits = ([0, 3, 6, 9, 12], [0, 2, 6, 10, 12], [0, 5, 6, 7, 12])
    scored = [quiet_plan(prof, 2, boundaries=b, **kw) for b in splits]
    assert all(pl.bottleneck_s == pytest.approx(6 * MS) for pl in scored)
    assert [round(pl.predicted_step_s * 1e3, 6) for pl in scored] == [27.0, 26.4, 33.0]
    low = brute_force(prof, 2, 4, "Interleaved1F1B", 2)[1]
    for objective in ("bottleneck", "step"):
        assert quiet_plan(prof, 2, objective=objective, **kw).predicted_step_s == pytest.approx(low)
    assert low <= 26.4 * MS * (1 + 1e-12)


def test_a_given_split_is_scored_against_the_objectives_optimum() -> None:
    prof = xyz(3.0)
    given = quiet_plan(prof, 2, num_microbatches=1, schedule="GPipe", boundaries=[0, 2, 3], objective="step")
    assert given.versus_optimal["optimal_boundaries"] == [0, 1, 3]
    assert given.versus_optimal["step_ratio"] == pytest.approx(9.2 / 8.2)
    assert given.cost_options["objective"] == "step" and given.step_search == {}
    default = quiet_plan(prof, 2, num_microbatches=1, schedule="GPipe", boundaries=[0, 2, 3])
    assert default.versus_optimal["optimal_boundaries"] == [0, 2, 3] and default.versus_optimal["step_ratio"] == 1.0


def test_objective_refusals_in_the_api() -> None:
    prof = xyz(1.0)
    with pytest.raises(StageplanError, match=r"objective 'fastest' is unknown; use bottleneck .* or step"):
        plan(prof, 2, objective="fastest")
    for method in ("uniform", "parameters"):
        with pytest.raises(StageplanError, match=rf"objective 'step' chooses among splits, but method '{method}' fixes"):
            plan(prof, 2, method=method, objective="step")
    for fn in (tuning.tune, comparison.compare):
        with pytest.raises(StageplanError, match=r"objective 'Step' is unknown"):
            fn("gpt", 2, objective="Step")  # refused before anything is profiled


def test_the_plan_file_keeps_the_search(tmp_path: Path) -> None:
    pl = quiet_plan(xyz(3.0), 2, num_microbatches=1, schedule="GPipe", objective="step")
    again = Plan.from_json(json.loads(json.dumps(pl.to_json())))
    assert again.step_search == pl.step_search and again.cost_options["objective"] == "step"
    older = {k: v for k, v in pl.to_json().items() if k != "step_search"}  # plans written before the search
    assert Plan.from_json(older).step_search == {}
    with pytest.raises(SchemaError, match=r"step_search must be an object"):
        Plan.from_json({**pl.to_json(), "step_search": 5})


def test_cli_objective(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    xyz(3.0).save(path)
    out_path = tmp_path / "plan.json"
    code, out, err = run_cli(["plan", str(path), "--stages", "2", "--microbatches", "1", "--schedule", "GPipe",
                              "--objective", "step", "--compare", "-o", str(out_path)], capsys)
    assert code == 0, err
    assert "optimal plan (objective step), GPipe" in out and "boundaries [0, 1, 3]" in out
    saved = Plan.load(out_path)
    assert saved.boundaries == (0, 1, 3) and saved.cost_options["objective"] == "step"
    code, out, _ = run_cli(["show", str(out_path)], capsys)
    assert code == 0 and "(objective step)" in out and "note: objective step:" in out
    code, out, _ = run_cli(["plan", str(path), "--stages", "2", "--microbatches", "1", "--schedule", "GPipe"], capsys)
    assert "boundaries [0, 2, 3]" in out and "note: a split with a larger bottleneck predicts a faster step" in out
    before = out_path.read_bytes()
    for extra, pattern in ((["--objective", "speed"], r"objective 'speed' is unknown"),
                           (["--objective", "step", "--method", "uniform"], r"method 'uniform' fixes the split")):
        code, _, err = run_cli(["plan", str(path), "--stages", "2", "--microbatches", "1", "--schedule", "GPipe",
                                *extra, "-o", str(out_path)], capsys)
        assert_one_line_error(code, err, pattern)
    assert out_path.read_bytes() == before  # nothing half-written over the plan
    for cmd in ("tune", "compare"):
        code, _, err = run_cli([cmd, "gpt", "--stages", "2", "--objective", "nope", "-o", str(tmp_path / cmd)], capsys)
        assert_one_line_error(code, err, r"objective 'nope' is unknown")
        assert not (tmp_path / cmd).exists()


def test_tune_plans_every_round_for_its_objective(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake runs (known steps, calibration the identity): tune's rounds and final plan are the step objective's
    plan of the profile; the uniform reference is the uniform split."""
    from types import SimpleNamespace

    import stageplan.running.launch

    ran: list[Plan] = []

    def fake_run(model: str, pl: Plan, **_: object) -> object:
        ran.append(pl)
        return SimpleNamespace(measured_step_s=0.1)

    monkeypatch.setattr(stageplan.running.launch, "run", fake_run)
    monkeypatch.setattr(tuning, "calibrate", lambda prof, rep: prof)
    prof = Profile.load(Path(__file__).resolve().parents[1] / "profiles" / "cpu" / "gpt.json")
    result = tuning.tune("gpt", 2, profile=prof, rounds=2, objective="step")
    want = quiet_plan(prof, 2, objective="step")
    assert result["final"]["boundaries"] == list(want.boundaries) and result["objective"] == "step"
    assert [pl.cost_options.get("objective") for pl in ran] == ["step", "step", None]  # round 1, final, uniform
    assert ran[-1].method == "uniform"
