"""stageplan.planning.search: the peers' rules (uniform, parameters) against DeepSpeed, the batch pricer
(SplitCosts) against evaluate, a given split scored against the optimum, the tie-break among equal-bottleneck
splits and the step objective."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import SCHEDULE_CASES, assert_one_line_error, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

import stageplan.comparison as comparison
import stageplan.tuning as tuning
from stageplan import LayerProfile, Profile
from stageplan.errors import StageplanError
from stageplan.formats.plan import Plan
from stageplan.planning import search
from stageplan.planning import search as split_search
from stageplan.planning.costs import Device, LayerArrays, evaluate, make_options
from stageplan.planning.planner import plan
from stageplan.planning.search import SplitCosts, partition_balanced, partition_uniform, peer_splits
from stageplan.report import plan_table

from .test_costs import _tie
from .test_planner import MS, NOTE, lm_profile, quiet_plan, xyz


def ds_partition_uniform(num_items: int, num_parts: int) -> list[int]:
    parts = [0] * (num_parts + 1)
    if num_items <= num_parts:
        for p in range(num_parts + 1):
            parts[p] = min(p, num_items)
        return parts
    chunksize = num_items // num_parts
    residual = num_items - (chunksize * num_parts)
    arr = np.arange(0, (num_parts + 1) * chunksize, chunksize)
    for i in range(residual):
        arr[i + 1 :] += 1
    return arr.tolist()


def ds_partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    n = len(weights)
    m = num_parts
    if n <= m:
        return ds_partition_uniform(n, m)
    dp_max = np.full((n + 1, m + 1), np.inf)
    dp_min = np.full((n + 1, m + 1), np.inf)
    dp_cost = np.full((n + 1, m + 1), np.inf)
    position = np.zeros((n + 1, m + 1), dtype=int)
    prefix_sum = np.zeros(n + 1)
    prefix_sum[1:] = np.cumsum(weights)
    dp_max[0, 0] = 0
    dp_cost[0, 0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                max_sum = max(dp_max[k, j - 1], prefix_sum[i] - prefix_sum[k])
                min_sum = min(dp_min[k, j - 1], prefix_sum[i] - prefix_sum[k])
                cost = max_sum - min_sum
                if dp_cost[i, j] >= cost:
                    dp_cost[i, j] = cost
                    dp_max[i, j] = max_sum
                    dp_min[i, j] = min_sum
                    position[i, j] = k
    parts = [n]
    for i in reversed(range(1, m + 1)):
        parts.append(position[parts[-1], i])
    parts.reverse()
    return [int(x) for x in parts]


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 60), st.integers(1, 12))
def test_partition_uniform_matches_deepspeed(n: int, p: int) -> None:
    assert partition_uniform(n, p) == tuple(ds_partition_uniform(n, p))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 6).map(float) | st.floats(0, 10, allow_nan=False), min_size=1, max_size=9),
    st.integers(1, 6),
)
def test_partition_balanced_matches_deepspeed(weights: list[float], p: int) -> None:
    assert partition_balanced(weights, p) == tuple(ds_partition_balanced(weights, p))


def test_partition_balanced_integer_weights_and_examples() -> None:
    assert partition_balanced([1, 1, 1, 1, 4], 2) == (0, 4, 5)
    assert partition_balanced([5, 1, 1, 1, 1, 1], 3) == tuple(ds_partition_balanced([5, 1, 1, 1, 1, 1], 3))
    assert partition_balanced([3, 4], 5) == (0, 1, 2, 2, 2, 2)
    assert partition_uniform(10, 4) == (0, 3, 6, 8, 10)
    assert partition_uniform(3, 5) == (0, 1, 2, 3, 3, 3)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: partition_uniform(4, 0), r"num_parts \(0\) must be at least 1"),
        (lambda: partition_uniform(-1, 2), r"num_items must be an integer >= 0, got -1"),
        (lambda: partition_balanced([1, float("nan")], 2),
         r"weights\[1\] is nan; every weight must be finite"),
        (lambda: partition_balanced([[1, 2]], 2), r"weights must be one-dimensional .* got shape \(1, 2\)"),
        (lambda: partition_balanced([1, 2], 0), r"num_parts \(0\) must be at least 1"),
    ],
)
def test_baseline_errors(call: object, match: str) -> None:
    with pytest.raises(StageplanError, match=match):
        call()  # type: ignore[operator]


ROOT = Path(__file__).resolve().parents[2]


# the same model in an older profile, kept as a fixed file: its GPipe p = 4 split is one the tie-break moves
GPT_2611 = ROOT / "tests" / "data" / "old-format" / "gpt-12l-v16k.json"


E, t, L, m = "E", "t", "L", "m"


def test_a_given_split_is_scored_against_the_optimal_plan(tmp_path: Path) -> None:
    # layers 1,2,2,2,2,3 (fwd + bwd) on 2 ranks: (0, 3, 6) and (0, 4, 6) both have the optimal bottleneck 7;
    # only the first fits 700 bytes (rank 0 holds 2 microbatches in flight: 2 x 300, not 2 x 400)
    prof = lm_profile([1.0, 2, 2, 2, 2, 3], act=[100] * 6)
    opt = plan(prof, 2, num_microbatches=4, optimizer="none", memory_limit=700)
    given = plan(prof, 2, num_microbatches=4, optimizer="none", boundaries=[0, 2, 6], memory_limit=700)
    v = given.versus_optimal
    assert v["optimal_boundaries"] == [0, 3, 6] == list(opt.boundaries)
    assert given.bottleneck_s == pytest.approx(9.0) and v["optimal_bottleneck_s"] == pytest.approx(7.0)
    assert v["bottleneck_ratio"] == pytest.approx(9.0 / 7.0)
    assert v["step_ratio"] == pytest.approx(given.predicted_step_s / v["optimal_predicted_step_s"])
    # 1F1B, m = 4: rank 0 holds 2 microbatches of 2 layers, rank 1 one of 4: 400 bytes each
    assert v["rank_memory_bytes"] == [400.0, 400.0] and v["memory_limit_bytes"] == [700, 700]
    assert v["memory_headroom_bytes"] == [300.0, 300.0]
    # without the limit the tie-break takes (0, 4, 6)
    free = plan(prof, 2, num_microbatches=4, optimizer="none")
    assert free.boundaries == (0, 4, 6) and free.predicted_step_s < opt.predicted_step_s
    same = plan(prof, 2, num_microbatches=4, optimizer="none", boundaries=list(free.boundaries))
    assert same.versus_optimal["bottleneck_ratio"] == 1.0 and same.versus_optimal["step_ratio"] == 1.0
    assert same.versus_optimal["memory_headroom_bytes"] == [None, None]  # no limit: the need alone
    assert opt.versus_optimal == {} and given.tie_break == {}
    table = plan_table(given)
    assert "given split (--boundaries [0, 2, 6]) against the optimal plan under the same options:" in table
    assert (
        f"optimal boundaries {v['optimal_boundaries']}; bottleneck 9000.000 vs 7000.000 ms = 1.286x" in table
    )
    assert "headroom MiB" in table
    given.save(tmp_path / "given.json")
    assert Plan.load(tmp_path / "given.json") == given  # the evidence survives the JSON round trip


def test_a_given_split_over_the_limit_is_compared_with_the_plan_that_fits() -> None:
    prof = lm_profile([1.0] * 8, act=[100] * 8)  # 1F1B, m = 4, p = 2: stage 0 holds 2 microbatches
    given = plan(prof, 2, num_microbatches=4, optimizer="none", boundaries=[0, 4, 8], memory_limit=700)
    v = given.versus_optimal
    assert v["optimal_boundaries"] == [0, 3, 8] and v["memory_headroom_bytes"] == [-100.0, 300.0]
    assert v["bottleneck_ratio"] < 1  # the price of fitting, said in the table
    assert "does not fit in memory (negative headroom below) and the optimal plan does" in plan_table(given)
    tight = plan(prof, 2, num_microbatches=4, optimizer="none", boundaries=[0, 4, 8], memory_limit=550)
    assert tight.versus_optimal["optimal_boundaries"] is None
    assert "smallest limit that admits a plan is" in tight.versus_optimal["optimal_infeasible"]
    assert "no split fits the memory limits, so there is no optimal plan to compare with" in plan_table(tight)


@pytest.mark.parametrize(("schedule", "p", "m", "v"), SCHEDULE_CASES)
def test_split_costs_price_splits_as_evaluate_does(schedule: str, p: int, m: int, v: int) -> None:
    rng = np.random.default_rng(7)
    n = 11
    layers = tuple(LayerProfile(f"l{i}", float(a), float(b), int(c), int(o), int(w)) for i, (a, b, c, o, w) in
                   enumerate(zip(rng.lognormal(0, 1, n), rng.lognormal(0, 1, n), rng.integers(0, 100, n),
                                 rng.integers(1, 100, n), rng.integers(0, 50, n))))
    prof = Profile(layers)
    for bandwidth, recompute, action in ((None, False, 0.0), (40.0, True, 0.0), (40.0, False, 0.3),
                                         (40.0, True, 0.3)):
        opts = make_options(prof, p, num_microbatches=m, schedule=schedule, virtual_stages=v,
                            bandwidth_bytes_per_s=bandwidth, recompute=recompute, boundary_latency_s=0.25,
                            action_s=action)
        arr = LayerArrays.of(prof, m)
        costs = SplitCosts(arr, opts)
        S = opts.num_chunks
        splits = np.array(
            [[0, *sorted(rng.choice(np.arange(1, n), S - 1, replace=False)), n] for _ in range(12)])
        f, b, c, mem = costs.split(splits)
        steps, loads = costs.steps(f, b, c), costs.rank_time(f, b, c)
        for row, cuts in enumerate(splits):
            ev = evaluate(arr, cuts, opts)
            assert steps[row] == pytest.approx(ev.predicted_step_s, rel=1e-12)
            assert loads[row] == pytest.approx(ev.rank_time_s, rel=1e-12)
            # exact for interleaved ranks too: their activations
            # at the peak over their order, as evaluate counts
            assert mem[row] == pytest.approx(ev.rank_memory_bytes, rel=1e-12)


@pytest.mark.parametrize(("schedule", "p", "m", "v"), [("1F1B", 3, 600, 1), ("GPipe", 2, 301, 1),
                                                      ("Interleaved1F1B", 2, 256, 2),
                                                       ("ZBVZeroBubble", 2, 200, 2)])
def test_split_costs_price_long_steps_as_evaluate_does(schedule: str, p: int, m: int, v: int) -> None:
    """The step graph's levels now come from one topological pass (they took one relaxation round per level,
    each over every node: m = 8192 planned in 14.5 s, against 1.7 s now); at hundreds of microbatches the
    batch pricer still prices every split as evaluate's own simulation does."""
    rng = np.random.default_rng(11)
    n = 9
    layers = tuple(LayerProfile(f"l{i}", float(a), float(b), 10, 10, 10)
                   for i, (a, b) in enumerate(zip(rng.lognormal(0, 1, n), rng.lognormal(0, 1, n))))
    prof = Profile(layers)
    opts = make_options(prof, p, num_microbatches=m, schedule=schedule, virtual_stages=v,
                        bandwidth_bytes_per_s=40.0, boundary_latency_s=0.25)
    arr = LayerArrays.of(prof, m)
    costs = SplitCosts(arr, opts)
    S = opts.num_chunks
    splits = np.array([[0, *sorted(rng.choice(np.arange(1, n), S - 1, replace=False)), n] for _ in range(4)])
    f, b, c, _mem = costs.split(splits)
    steps = costs.steps(f, b, c)
    for row, cuts in enumerate(splits):
        assert steps[row] == pytest.approx(evaluate(arr, cuts, opts).predicted_step_s, rel=1e-12)


def test_tie_break_keeps_the_solvers_split_when_it_fits_only_at_the_exact_peak() -> None:
    """The solver holds an interleaved rank to its exact activation peak; the tie-break used to list splits by
    the sum of each chunk's peak, so the solver's split (19 MiB on rank 0 by evaluate, 21 by that sum) fell
    out of the list and a slower split with the same bottleneck was taken: 49 -> 53 ms."""
    MiB = 2**20
    # fwd ms, bwd ms, act MiB, param MiB
    rows = [(3, 2, 3, 2), (1, 3, 0, 0), (2, 1, 1, 1), (1, 3, 1, 2), (2, 3, 2, 2)]
    prof = Profile(tuple(LayerProfile(f"l{i}", f * 1e-3, b * 1e-3, a * MiB, 0, w * MiB)
                         for i, (f, b, a, w) in enumerate(rows)))
    kw = dict(num_microbatches=4, schedule="Interleaved1F1B", virtual_stages=2, optimizer="none")
    pl = plan(prof, 2, memory_limit=19 * MiB, **kw)
    opts = make_options(prof, 2, memory_limit_bytes=19 * MiB, **kw)
    arr = LayerArrays.of(prof, 4)
    scored = [evaluate(arr, (0, *cuts, 5), opts) for cuts in itertools.combinations(range(1, 5), 3)]
    fitting = [ev for ev in scored if max(ev.rank_memory_bytes) <= 19 * MiB]
    best = min(ev.bottleneck_s for ev in fitting)
    fastest = min(ev.predicted_step_s for ev in fitting if ev.bottleneck_s <= best * (1 + 1e-12))
    assert pl.boundaries == (0, 1, 2, 4, 5)
    assert pl.predicted_step_s == pytest.approx(fastest) == pytest.approx(0.049)
    assert pl.tie_break["to_step_s"] <= pl.tie_break["from_step_s"]


def brute_force_tie_break(prof: Profile, p: int, m: int, schedule: str, v: int, start: tuple[int, ...],
                          **kw) -> tuple[tuple[int, ...], float]:  # type: ignore[no-untyped-def]
    """Every split with the optimal bottleneck that fits: the lowest simulated step, then the solver's split,
    then the lexicographically smallest (evaluate as the oracle)."""
    arr = LayerArrays.of(prof, m)
    opts = make_options(prof, p, num_microbatches=m, schedule=schedule, virtual_stages=v, **kw)
    n = len(prof)
    cap = evaluate(arr, start, opts).bottleneck_s * (1 + 1e-9)
    rows = []
    for cuts in itertools.combinations(range(1, n), p * v - 1):
        b = (0, *cuts, n)
        ev = evaluate(arr, b, opts)
        if ev.bottleneck_s <= cap and not any("over its limit" in x for x in ev.notes):
            rows.append((b, ev.predicted_step_s))
    low = min(s for _, s in rows)
    tied = [b for b, s in rows if s <= low * (1 + 1e-9)]
    return (start if start in tied else min(tied)), low


def test_the_tie_break_finds_the_lowest_step_among_equal_bottleneck_splits() -> None:
    moved = 0
    for seed in range(8):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(5, 10))
        # few distinct costs, so that many splits share the optimal bottleneck
        times = [float(x) for x in rng.choice([1.0, 2.0, 3.0], n)]
        prof = lm_profile(times, [int(x) for x in rng.integers(0, 100, n)])
        for schedule, p, m, v, kw in (
            ("GPipe", 3, 4, 1, {}),
            ("1F1B", 2, 4, 1, {"bandwidth_bytes_per_s": 1e3}),
            ("1F1B", 3, 3, 1, {"memory_limit_bytes": 400.0}),
            ("Interleaved1F1B", 2, 4, 2, {}),
            ("1F1B", 3, 6, 1, {"devices": [Device(1.0), Device(0.5), Device(2.0)]}),
        ):
            if p * v > n:
                continue
            try:
                pl = quiet_plan(prof, p, num_microbatches=m, schedule=schedule, virtual_stages=v,
                                memory_limit=kw.get("memory_limit_bytes"),
                                bandwidth=kw.get("bandwidth_bytes_per_s"), devices=kw.get("devices"))
            except StageplanError:
                continue  # no split fits the limit
            tie = pl.tie_break
            assert tie["exhaustive"] and tie["to_boundaries"] == list(pl.boundaries)
            best, low = brute_force_tie_break(prof, p, m, schedule, v, tuple(tie["from_boundaries"]), **kw)
            assert pl.boundaries == best, (seed, schedule, p, times)
            assert pl.predicted_step_s == pytest.approx(low, rel=1e-9)
            assert pl.predicted_step_s <= tie["from_step_s"] * (1 + 1e-12)
            moved += tuple(pl.boundaries) != tuple(tie["from_boundaries"])
    # not all trivial: the tie-break changed the solver's split in 11 of these cases when written
    assert moved >= 5


def test_the_tie_break_on_a_stored_profile_says_what_it_gained() -> None:
    pl = plan(Profile.load(GPT_2611), 4, num_microbatches=8, schedule="GPipe")
    tie = pl.tie_break
    assert tie["from_boundaries"] == [0, 1, 5, 13, 14] and list(pl.boundaries) == [0, 1, 6, 13, 14]
    assert tie["to_step_s"] < tie["from_step_s"] and tie["exhaustive"]
    note = next(n for n in pl.notes if n.startswith("tie-break among equal-bottleneck splits"))
    assert f"predicted step {tie['from_step_s'] * 1e3:.3f} ms -> {pl.predicted_step_s * 1e3:.3f} ms" in note
    # no gain: the solver's split stays, and no note
    same = plan(Profile.load(GPT_2611), 2, num_microbatches=4)
    assert same.tie_break["from_boundaries"] == same.tie_break["to_boundaries"] == list(same.boundaries)
    assert not any(n.startswith("tie-break") for n in same.notes)


def test_the_descent_keeps_the_bottleneck_and_never_raises_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(search, "_TIE_SPLITS", 1)  # too many splits to list: the descent runs
    rng = np.random.default_rng(3)
    prof = lm_profile([float(x) for x in rng.choice([1.0, 2.0], 40)])
    pl = plan(prof, 6, num_microbatches=12, schedule="GPipe")
    tie = pl.tie_break
    assert not tie["exhaustive"] and tie["splits_evaluated"] > 1
    start = plan(prof, 6, num_microbatches=12, schedule="GPipe", boundaries=tie["from_boundaries"])
    assert pl.bottleneck_s <= start.bottleneck_s * (1 + 1e-12)
    assert pl.predicted_step_s <= start.predicted_step_s * (1 + 1e-12)


def test_the_tie_break_work_is_bounded_at_a_thousand_layers() -> None:
    rng = np.random.default_rng(0)
    times = rng.lognormal(0, 0.5, 1000) * 1e-3
    prof = Profile(tuple(LayerProfile(f"b.{i}", float(x) * 0.4, float(x) * 0.6, 100, 10, 50) for i,
                         x in enumerate(times)))
    pl = plan(prof, 64, num_microbatches=128)
    assert pl.tie_break["splits_evaluated"] <= max(1, search._TIE_WORK // (2 * 64 * 128))
    assert pl.predicted_step_s <= pl.tie_break["from_step_s"] * (1 + 1e-12)


@pytest.mark.parametrize("opt_ms", [3.0, 0.5, 0.05, 0.0])
def test_closed_form_the_least_bottleneck_is_not_the_fastest_step(opt_ms: float) -> None:
    """GPipe, 2 ranks, one microbatch, the timeline by hand:
    [0, 2, 3]: rank 0 runs x, y forward (0-2), rank 1 z (2-3) and its backward (3-4.2), rank 0 backward
    (4.2-6.2), then rank 0's optimizer (y): step 6.2 + O; bottleneck max(4, 2.2) = 4 ms, the least.
    [0, 1, 3]: rank 0 x (0-1), rank 1 y, z forward (1-3) and backward (3-5.2), rank 0 backward (5.2-6.2); rank
    1's optimizer (y) runs from 5.2: step max(6.2, 5.2 + O); bottleneck 4.2 ms."""
    prof = xyz(opt_ms)
    least = quiet_plan(prof, 2, num_microbatches=1, schedule="GPipe")
    fastest = quiet_plan(prof, 2, num_microbatches=1, schedule="GPipe", objective="step")
    assert least.boundaries == (0, 2, 3)
    assert least.bottleneck_s == pytest.approx(4.0 * MS) and least.predicted_step_s == pytest.approx(
        (6.2 + opt_ms) * MS
    )
    other = max(6.2, 5.2 + opt_ms) * MS
    search = least.step_search
    assert search["objective"] == "bottleneck" and search["exhaustive"]
    assert search["from_boundaries"] == [0, 2, 3]
    if opt_ms == 0.0:  # a tie: the least-bottleneck split stays
        assert fastest.boundaries == (0, 2, 3) and search["to_boundaries"] == [0, 2, 3]
        assert not any("objective step" in n or "larger bottleneck" in n
                       for n in [*least.notes, *fastest.notes])
        return
    assert fastest.boundaries == (0, 1, 3) and search["to_boundaries"] == [0, 1, 3]
    assert fastest.predicted_step_s == pytest.approx(other) and fastest.bottleneck_s == pytest.approx(4.2
                                                                                                      * MS)
    assert search["to_step_s"] == pytest.approx(other) and search["to_bottleneck_s"] == pytest.approx(4.2
                                                                                                      * MS)
    assert fastest.cost_options["objective"] == "step" and least.cost_options["objective"] == "bottleneck"
    assert fastest.step_search["objective"] == "step"
    note = next(n for n in fastest.notes if n.startswith("objective step"))
    assert f"predicted step {(6.2 + opt_ms):.3f} -> {other * 1e3:.3f} ms" in note and "[0, 2, 3]" in note
    # the default names the faster split only when it is at least 1% faster (0.05 ms: 6.25 -> 6.2, 0.8%)
    named = [n for n in least.notes
             if n.startswith("a split with a larger bottleneck predicts a faster step")]
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
    # a few layers with a heavy optimizer step, as an LM head's
    opt = rng.choice([0.0, 0.0, 1.0, 4.0], n) * MS
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
            args = dict(num_microbatches=m, schedule=schedule, virtual_stages=v,
                        memory_limit=kw.get("memory_limit_bytes"),
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
    # not all trivial: the objectives chose different splits in 11 of these cases when written
    assert moved >= 5, moved


def test_the_descents_never_end_slower_than_their_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Too many splits to list: descents from the least-bottleneck split, the uniform and the
    parameter-balanced ones. The result is no slower than any of the three (each scored as a given split)."""
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
        assert pl.predicted_step_s <= quiet_plan(prof, 6, boundaries=seed, **kw).predicted_step_s * (1
                                                                                                     + 1e-12)
    assert pl.predicted_step_s == pytest.approx(search["to_step_s"], rel=1e-9)
    assert search["splits_evaluated"] <= max(1, split_search._TIE_WORK // (2 * 6 * 12))


def test_an_interleaved_rank_sum_hides_unbalanced_chunks() -> None:
    """Interleaved ranks are balanced on the sum of their chunks, and the sum hides how the chunks are cut:
    two ranks x 2 chunks over twelve layers of 1 ms (f 0.4, b 0.6), 4 microbatches. Every split below puts 6
    layers on each rank (chunks 0 and 2 on rank 0), and their steps span 26.4 to 33.0 ms. Both objectives end
    at the lowest step of every split (brute force)."""
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
    assert (
        default.versus_optimal["optimal_boundaries"] == [0, 2, 3]
        and default.versus_optimal["step_ratio"] == 1.0
    )


def test_objective_refusals_in_the_api() -> None:
    prof = xyz(1.0)
    with pytest.raises(StageplanError, match=r"objective 'fastest' is unknown; use bottleneck .* or step"):
        plan(prof, 2, objective="fastest")
    for method in ("uniform", "parameters"):
        with pytest.raises(StageplanError,
                           match=rf"objective 'step' chooses among splits, but method '{method}' fixes"):
            plan(prof, 2, method=method, objective="step")
    for fn in (tuning.tune, comparison.compare):
        with pytest.raises(StageplanError, match=r"objective 'Step' is unknown"):
            fn("gpt", 2, objective="Step")  # refused before anything is profiled


def test_cli_objective(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    xyz(3.0).save(path)
    out_path = tmp_path / "plan.json"
    code, out, err = run_cli(["plan", str(path), "--stages", "2", "--microbatches", "1", "--schedule",
                              "GPipe", "--objective", "step", "--compare", "-o", str(out_path)], capsys)
    assert code == 0, err
    assert "optimal plan (objective step), GPipe" in out and "boundaries [0, 1, 3]" in out
    saved = Plan.load(out_path)
    assert saved.boundaries == (0, 1, 3) and saved.cost_options["objective"] == "step"
    code, out, _ = run_cli(["show", str(out_path)], capsys)
    assert code == 0 and "(objective step)" in out and "note: objective step:" in out
    code, out, _ = run_cli(["plan", str(path), "--stages", "2", "--microbatches", "1", "--schedule", "GPipe"],
                           capsys)
    assert (
        "boundaries [0, 2, 3]" in out
        and "note: a split with a larger bottleneck predicts a faster step" in out
    )
    before = out_path.read_bytes()
    for extra, pattern in ((["--objective", "speed"], r"objective 'speed' is unknown"),
                           (["--objective", "step", "--method", "uniform"],
                            r"method 'uniform' fixes the split")):
        code, _, err = run_cli(["plan", str(path), "--stages", "2", "--microbatches", "1", "--schedule",
                                "GPipe", *extra, "-o", str(out_path)], capsys)
        assert_one_line_error(code, err, pattern)
    assert out_path.read_bytes() == before  # nothing half-written over the plan
    for cmd in ("tune", "compare"):
        code, _, err = run_cli(
            [cmd, "gpt", "--stages", "2", "--objective", "nope", "-o", str(tmp_path / cmd)], capsys)
        assert_one_line_error(code, err, r"objective 'nope' is unknown")
        assert not (tmp_path / cmd).exists()


def _levels_by_relaxation(deps: np.ndarray) -> np.ndarray | None:
    """The oracle: every node's level raised to one past its deepest dependency's until nothing moves (at most
    N + 1 rounds in a DAG), as the step graph computed it before its single topological pass."""
    n = deps.shape[1]
    level = np.zeros(n + 1, dtype=np.int64)
    level[n] = -1
    for _ in range(n + 2):
        new = level[deps].max(axis=0) + 1
        if np.array_equal(new, level[:n]):
            return level[:n]
        level[:n] = new
    return None


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 4), st.randoms(use_true_random=False), st.booleans())
def test_step_graph_levels_equal_relaxation(n: int, k: int, rnd: Any, cycle: bool) -> None:
    """Random DAGs (each node's dependencies drawn from the nodes before it in a shuffled order, "none" = n
    mixed in, repeats allowed) get the levels of the relaxation; with one edge turned back into a cycle, both
    say so."""
    from stageplan.planning.search import _group_by, _longest_path_levels

    order = list(range(n))
    rnd.shuffle(order)
    deps = np.full((k, n), n)
    for pos, node in enumerate(order):
        for row in range(k):
            if pos and rnd.random() < 0.7:
                deps[row, node] = order[rnd.randrange(pos)]
    if cycle and n > 1:
        first, last = order[0], order[-1]
        # last depends, through some chain or directly, on nothing that reaches first...
        deps[0, first] = last
        deps[0, last] = first  # ...and now first and last depend on each other
    want, got = _levels_by_relaxation(deps), _longest_path_levels(deps)
    if want is None:
        assert got is None
        return
    assert got is not None and got.tolist() == want.tolist()
    depth = int(want.max()) + 1
    assert [g.tolist() for g in _group_by(got, depth)] == [np.flatnonzero(want == lv).tolist()
                                                           for lv in range(depth)]


@pytest.mark.parametrize(("schedule", "p", "m", "v"), SCHEDULE_CASES)
def test_split_costs_price_the_optimizer_step_as_evaluate_does(schedule: str, p: int, m: int, v: int) -> None:
    rng = np.random.default_rng(11)
    n = 11
    layers = tuple(LayerProfile(f"l{i}", float(a), float(b), 0, 1, 4,
                                optimizer_s={"adam": float(o), "sgd": float(o) / 3})
                   for i, (a, b, o) in enumerate(zip(rng.lognormal(0, 1, n), rng.lognormal(0, 1, n),
                                                     rng.lognormal(1, 1, n))))
    prof = Profile(layers)
    devices = [Device(speed=1.0 + r) for r in range(p)]
    for optimizer in ("adam", "sgd", "none"):
        opts = make_options(prof, p, num_microbatches=m, schedule=schedule, virtual_stages=v,
                            optimizer=optimizer,
                            devices=devices, bandwidth_bytes_per_s=40.0, boundary_latency_s=0.25)
        arr = LayerArrays.of(prof, m)
        costs = SplitCosts(arr, opts)
        splits = np.array([[0, *sorted(rng.choice(np.arange(1, n), opts.num_chunks - 1, replace=False)), n]
                           for _ in range(12)])
        f, b, c, _ = costs.split(splits)
        steps = costs.steps(f, b, c, costs.optimizer(splits))
        for row, cuts in enumerate(splits):
            ev = evaluate(arr, cuts, opts)
            assert steps[row] == pytest.approx(ev.predicted_step_s, rel=1e-12, abs=0)
            opt = [sum(layers[k].optimizer_s[optimizer] for k in range(st.first_layer, st.end_layer))  # type: ignore[index]
                   / devices[st.rank].speed if optimizer != "none" else 0.0 for st in ev.stages]
            assert [st.optimizer_s for st in ev.stages] == pytest.approx(opt, rel=1e-12)
            assert NOTE not in ev.notes


@pytest.mark.parametrize(("schedule", "p", "m", "v"), SCHEDULE_CASES)
def test_split_costs_price_the_tied_sync_as_evaluate_does(schedule: str, p: int, m: int, v: int) -> None:
    rng = np.random.default_rng(5)
    n = 11
    layers = tuple(LayerProfile(f"l{i}", float(a), float(b), 0, 1, 4, optimizer_s={"adam": float(o)})
                   for i, (a, b, o)
                   in enumerate(zip(rng.lognormal(0, 1, n), rng.lognormal(0, 1, n), rng.lognormal(0, 1, n))))
    prof = Profile(layers, {"tied": [_tie(0, n - 1, nbytes=40), _tie(2, 3, 7, nbytes=15)]})
    opts = make_options(prof, p, num_microbatches=m, schedule=schedule, virtual_stages=v,
                        bandwidth_bytes_per_s=10.0,
                        boundary_latency_s=0.25, link_latency_s=0.25,
                        devices=[Device(speed=1.0 + r) for r in range(p)])
    arr = LayerArrays.of(prof, m)
    costs = SplitCosts(arr, opts)
    splits = np.array([[0, *sorted(rng.choice(np.arange(1, n), opts.num_chunks - 1, replace=False)), n]
                       for _ in range(16)])
    f, b, c, _ = costs.split(splits)
    steps, tied = costs.split_steps(splits, f, b, c), costs.tied_sync(splits)
    assert tied.max() > 0
    for row, cuts in enumerate(splits):
        ev = evaluate(arr, cuts, opts)
        assert steps[row] == pytest.approx(ev.predicted_step_s, rel=1e-12, abs=0)
        assert tied[row] == ev.tied_sync_s


# -- the peers' default splits -----------------------------------------------------------------------------
def _llm(blocks: int) -> tuple[list[str], list[str]]:
    named = [f"model.layers.{i}" for i in range(blocks)]
    return ["model.embed_tokens", *named, "model.norm+lm_head"], named


def _sizes(b: tuple[int, ...]) -> list[int]:
    return [y - x for x, y in zip(b, b[1:])]


def test_peer_splits_of_a_llama2_70b_like_profile_on_16_stages() -> None:
    """Hand-computed: 80 blocks on 16 stages. Megatron: 80 / 16 = 5 blocks each, E with the first, L with the
    last. Its account_for_* variants count E and/or L as a block: 81 and 82 do not divide by 16, which
    Megatron refuses. torchtitan: 80 + 2 = 82 effective = 5 x 16 + 2, so stages 0 and 1 take 6 effective;
    stage 0 is E + 5 blocks, stage 1 six blocks, stages 2-14 five, the last 5 - 1 = 4 blocks + L."""
    names, named = _llm(80)
    got = peer_splits(names, named, 16)
    assert got["megatron"] == (0, 6, *range(11, 77, 5), 82)
    assert _sizes(got["megatron"]) == [6] + [5] * 14 + [6]
    assert got["megatron+E"] == "Megatron needs 80 blocks + E = 81 divisible by 16 stages"
    assert got["megatron+L"] == "Megatron needs 80 blocks + L = 81 divisible by 16 stages"
    assert got["megatron+E+L"] == "Megatron needs 80 blocks + E + L = 82 divisible by 16 stages"
    assert _sizes(got["torchtitan"]) == [1 + 5, 6] + [5] * 13 + [4 + 1]


def test_megatrons_account_for_variants_where_they_divide() -> None:
    """79 blocks + E = 80 = 5 x 16: the first stage holds E and 4 blocks, every other 5, L with the last;
    79 + L likewise mirrored; 78 + E + L = 80: E + 4 blocks first, 4 blocks + L last."""
    names, named = _llm(79)
    got = peer_splits(names, named, 16)
    assert _sizes(got["megatron+E"]) == [1 + 4] + [5] * 14 + [5 + 1]
    assert _sizes(got["megatron+L"]) == [1 + 5] + [5] * 14 + [4 + 1]
    assert got["megatron"] == "Megatron needs 79 blocks = 79 divisible by 16 stages"
    names, named = _llm(78)
    assert _sizes(peer_splits(names, named, 16)["megatron+E+L"]) == [1 + 4] + [5] * 14 + [4 + 1]


def test_peer_splits_without_an_embedding_or_head_say_so() -> None:
    names = [f"layer{i}" for i in range(8)]  # every layer a block (a convnet's profile names no blocks)
    got = peer_splits(names, names, 4)
    assert got["megatron"] == (0, 2, 4, 6, 8)
    assert got["megatron+E"] == "the profile has no embedding layer apart from the blocks"
    assert got["megatron+E+L"] == "the profile has no embedding or head layer apart from the blocks"
    assert got["torchtitan"] == "the profile has no embedding and head apart from the blocks"


@pytest.mark.parametrize(("options", "offered", "not_offered"), [
    ({}, ["raise the limit (--memory-limit)", "add ranks (--stages)", "recompute activations (--recompute)"],
     ["--schedule 1F1B"]),
    ({"recompute": True}, ["raise the limit (--memory-limit)", "add ranks (--stages)"],
     ["--recompute", "recomputation"]),
    ({"recompute": True, "schedule": "GPipe"}, ["--schedule 1F1B"], ["--recompute", "recomputation"]),
])
def test_a_memory_remedy_offers_only_what_is_not_already_set(options: dict[str, Any], offered: list[str],
                                                             not_offered: list[str]) -> None:
    """The class of the 70B trial's "or use recomputation" with --recompute on: every remedy names what is
    not set yet."""
    from stageplan.errors import InfeasiblePlanError

    from .test_planner import make_profile

    prof = make_profile([1.0] * 6, act=[2**20] * 6, params=[2**20] * 6)
    with pytest.raises(InfeasiblePlanError, match=r"smallest limit that admits a plan is") as err:
        plan(prof, 2, num_microbatches=4, memory_limit=6 * 2**20, **options)
    text = str(err.value)
    assert all(o in text for o in offered), text
    assert not any(o in text for o in not_offered), text


def test_auto_schedules_memory_remedy_offers_recompute_only_when_it_is_off() -> None:
    from stageplan.errors import InfeasiblePlanError

    from .test_planner import make_profile

    prof = make_profile([1.0] * 6, act=[2**20] * 6, params=[2**20] * 6)
    for recompute in (False, True):
        for method in ("optimal", "uniform"):  # the solver's refusal, and the planner's over its candidates
            raise_it = r"raise (the limit \(--memory-limit\)|--memory-limit)"
            with pytest.raises(InfeasiblePlanError, match=raise_it) as err:
                plan(prof, 2, memory_limit=6 * 2**20, schedule="auto", recompute=recompute, method=method)
            assert ("--recompute" in str(err.value)) == (not recompute), str(err.value)
