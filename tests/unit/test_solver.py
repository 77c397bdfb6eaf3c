"""Tests for stageplan.planning.solver: every answer is checked against brute force over all partitions."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stageplan.errors import InfeasiblePlanError, StageplanError
from stageplan.planning import partition, solver
from stageplan.planning.solver import Solution, solve

TIE = 1e-12


Rows = list[list[float]]


def all_boundaries(num_layers: int, parts: int) -> list[tuple[int, ...]]:
    return [(0, *cuts, num_layers) for cuts in itertools.combinations(range(1, num_layers), parts - 1)]


def rows_of(value: Sequence[float] | Rows | None, p: int, num_layers: int, fill: float = 0.0) -> Rows:
    if value is None:
        return [[fill] * num_layers for _ in range(p)]
    if len(value) and isinstance(value[0], (list, tuple)):
        return [list(map(float, r)) for r in value]  # type: ignore[arg-type]
    return [list(map(float, value)) for _ in range(p)]  # type: ignore[arg-type]


def stage_time(costs: Sequence[float], k: int, i: int, j: int, speeds: Sequence[float], bc: Rows) -> float:
    t = sum(costs[i:j]) / speeds[k]
    if j < len(costs):
        t = t + bc[k][j - 1]
    return t


def stage_mem(mem: Rows, start: Rows, end: Rows, k: int, i: int, j: int) -> float:
    return sum(mem[k][i:j]) + start[k][i] + end[k][j - 1]


def brute(
    costs: Sequence[float],
    p: int,
    *,
    speeds: Sequence[float] | None = None,
    bc: Sequence[float] | Rows | None = None,
    mem: Sequence[float] | Rows | None = None,
    start: Sequence[float] | Rows | None = None,
    end: Sequence[float] | Rows | None = None,
    limit: float | Sequence[float] | None = None,
) -> tuple[tuple[int, ...] | None, float | None]:
    """(the partition the documented rule picks or None when
    infeasible, min over partitions of peak memory)."""
    L = len(costs)
    sp = list(speeds) if speeds is not None else [1.0] * p
    bcr = rows_of(bc, p, L)
    has_mem = mem is not None
    memr, startr, endr = rows_of(mem, p, L), rows_of(start, p, L), rows_of(end, p, L)
    lims = [math.inf] * p if limit is None else ([float(limit)] * p if np.ndim(limit) == 0 else list(limit))  # type: ignore[arg-type]
    rows = []
    peak_min = math.inf
    for b in all_boundaries(L, p):
        times = [stage_time(costs, k, b[k], b[k + 1], sp, bcr) for k in range(p)]
        mems = [stage_mem(memr, startr, endr, k, b[k], b[k + 1]) for k in range(p)] if has_mem else []
        if has_mem:
            peak_min = min(peak_min, max(mems))
        if has_mem and any(m > lim for m, lim in zip(mems, lims)):
            continue
        if not has_mem:
            util = 0.0
        elif limit is None:
            util = max(mems)
        else:
            util = max(m / lim for m, lim in zip(mems, lims))
        rows.append((max(times), util, b))
    if not rows:
        return None, (peak_min if has_mem else None)
    opt = min(r[0] for r in rows)
    rows = [r for r in rows if r[0] <= opt + TIE * opt]
    umin = min(r[1] for r in rows)
    rows = [r for r in rows if r[1] <= umin + TIE * umin]
    return min(r[2] for r in rows), (peak_min if has_mem else None)


def check_solution(
    sol: Solution,
    costs: Sequence[float],
    p: int,
    *,
    speeds: Sequence[float] | None = None,
    bc: Sequence[float] | Rows | None = None,
    mem: Sequence[float] | Rows | None = None,
    start: Sequence[float] | Rows | None = None,
    end: Sequence[float] | Rows | None = None,
    limit: float | Sequence[float] | None = None,
) -> None:
    """Invariants, with stage costs and memory recomputed independently of the solver."""
    L = len(costs)
    b = sol.boundaries
    assert len(b) == p + 1 and b[0] == 0 and b[-1] == L
    assert all(x < y for x, y in itertools.pairwise(b)), "never an empty stage"
    sp = list(speeds) if speeds is not None else [1.0] * p
    bcr = rows_of(bc, p, L)
    times = [stage_time(costs, k, b[k], b[k + 1], sp, bcr) for k in range(p)]
    assert sol.stage_costs == pytest.approx(times, rel=1e-12, abs=1e-12)
    assert sol.bottleneck == max(sol.stage_costs)
    lb = max(sum(costs) / sum(sp), max(costs) / max(sp))
    assert sol.lower_bound == pytest.approx(lb, rel=1e-12)
    assert sol.lower_bound <= sol.bottleneck * (1 + 1e-12)
    if mem is None:
        assert sol.stage_memory is None
    else:
        memr, startr, endr = rows_of(mem, p, L), rows_of(start, p, L), rows_of(end, p, L)
        mems = [stage_mem(memr, startr, endr, k, b[k], b[k + 1]) for k in range(p)]
        assert sol.stage_memory == pytest.approx(mems, rel=1e-12, abs=1e-9)
        if limit is not None:
            lims = [float(limit)] * p if np.ndim(limit) == 0 else list(limit)  # type: ignore[arg-type]
            assert all(m <= lim for m, lim in zip(mems, lims))


def check_against_brute(costs: Sequence[float], p: int, **kw: object) -> Solution | None:
    expected, peak = brute(costs, p, **kw)  # type: ignore[arg-type]
    args = {
        "stage_speeds": kw.get("speeds"),
        "boundary_costs": kw.get("bc"),
        "memory_bytes": kw.get("mem"),
        "memory_start_bytes": kw.get("start"),
        "memory_end_bytes": kw.get("end"),
        "memory_limit_bytes": kw.get("limit"),
    }
    if expected is None:
        with pytest.raises(InfeasiblePlanError, match="smallest limit that admits a plan") as info:
            solve(costs, p, **args)  # type: ignore[arg-type]
        assert info.value.min_memory_limit_bytes == pytest.approx(peak, rel=1e-12)
        return None
    sol = solve(costs, p, **args)  # type: ignore[arg-type]
    check_solution(sol, costs, p, **kw)  # type: ignore[arg-type]
    # integer-valued data: every sum is exact, so the oracle's choice is unambiguous
    assert sol.boundaries == expected
    return sol


small = st.integers(0, 12).map(float)


@st.composite
def instance(draw: st.DrawFn, max_layers: int = 8) -> tuple[list[float], int]:
    L = draw(st.integers(1, max_layers))
    costs = draw(st.lists(small, min_size=L, max_size=L))
    p = draw(st.integers(1, L))
    return costs, p


def rows_strategy(
    draw: Callable[..., Any], p: int, L: int, values: st.SearchStrategy[float]
) -> list[float] | Rows:
    if draw(st.booleans()):
        return draw(st.lists(values, min_size=L, max_size=L))
    return [draw(st.lists(values, min_size=L, max_size=L)) for _ in range(p)]


@settings(max_examples=250, deadline=None)
@given(instance())
def test_plain_matches_brute_force(case: tuple[list[float], int]) -> None:
    costs, p = case
    check_against_brute(costs, p)


@settings(max_examples=250, deadline=None)
@given(st.data())
def test_memory_caps_match_brute_force(data: st.DataObject) -> None:
    costs, p = data.draw(instance())
    L = len(costs)
    mem = data.draw(st.lists(st.integers(0, 20).map(float), min_size=L, max_size=L))
    total = max(sum(mem), 1.0)
    if data.draw(st.booleans()):
        limit: float | list[float] = data.draw(st.integers(1, int(total)).map(float))
    else:
        limit = data.draw(st.lists(st.integers(1, int(total)).map(float), min_size=p, max_size=p))
    check_against_brute(costs, p, mem=mem, limit=limit)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_speeds_and_stage_memory_rows_match_brute_force(data: st.DataObject) -> None:
    costs, p = data.draw(instance())
    L = len(costs)
    speeds = data.draw(st.lists(st.sampled_from([0.5, 0.75, 1.0, 1.5, 2.0, 3.0]), min_size=p, max_size=p))
    mem = rows_strategy(data.draw, p, L, st.integers(0, 15).map(float))
    limit = data.draw(st.none() | st.integers(1, 60).map(float))
    check_against_brute(costs, p, speeds=speeds, mem=mem, limit=limit)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_boundary_costs_match_brute_force(data: st.DataObject) -> None:
    costs, p = data.draw(instance())
    L = len(costs)
    bc = rows_strategy(data.draw, p, L, st.integers(0, 10).map(float))
    speeds = data.draw(st.none() | st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=p, max_size=p))
    check_against_brute(costs, p, speeds=speeds, bc=bc)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_memory_start_and_end_terms_match_brute_force(data: st.DataObject) -> None:
    costs, p = data.draw(instance())
    L = len(costs)
    mem = rows_strategy(data.draw, p, L, st.integers(0, 10).map(float))
    start = rows_strategy(data.draw, p, L, st.integers(0, 12).map(float))
    end = data.draw(st.none() | st.lists(st.integers(0, 6).map(float), min_size=L, max_size=L))
    bc = data.draw(st.none() | st.lists(st.integers(0, 5).map(float), min_size=L, max_size=L))
    limit = data.draw(st.none() | st.integers(1, 80).map(float))
    check_against_brute(costs, p, mem=mem, start=start, end=end, bc=bc, limit=limit)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_larger_random_float_instances_match_brute_force_bottleneck(data: st.DataObject) -> None:
    """Real-valued costs (rounded sums): the bottleneck still equals brute force to 1e-9."""
    L = data.draw(st.integers(6, 12))
    p = data.draw(st.integers(2, min(5, L)))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    costs = rng.lognormal(0.0, 1.0, L).tolist()
    speeds = rng.uniform(0.5, 2.0, p).tolist()
    sol = solve(costs, p, stage_speeds=speeds)
    best = min(
        max(math.fsum(costs[b[k] : b[k + 1]]) / speeds[k] for k in range(p)) for b in all_boundaries(L, p)
    )
    assert sol.bottleneck == pytest.approx(best, rel=1e-9)
    check_solution(sol, costs, p, speeds=speeds)


def dp_bottleneck(
    costs: np.ndarray, p: int, speeds: np.ndarray, bc: np.ndarray, mem: np.ndarray,
    start: np.ndarray, end: np.ndarray, limit: np.ndarray,
) -> float:
    """O(L^2 p) min-max DP over all (i, j) pairs with every term: an oracle for larger L."""
    L = costs.size
    P = np.concatenate([[0.0], np.cumsum(costs)])
    i, j = np.meshgrid(np.arange(L + 1), np.arange(L + 1), indexing="ij")
    best = np.full(L + 1, np.inf)
    best[0] = 0.0
    for k in range(p):
        M = np.concatenate([[0.0], np.cumsum(mem[k])])
        t = (P[j] - P[i]) / speeds[k] + np.where(j < L, bc[k][np.clip(j - 1, 0, L - 1)], 0.0)
        m = M[j] - M[i] + start[k][np.clip(i, 0, L - 1)] + end[k][np.clip(j - 1, 0, L - 1)]
        t = np.where((i < j) & (m <= limit[k]), t, np.inf)
        best = np.min(np.maximum(best[:, None], t), axis=0)
    return float(best[L])


@pytest.mark.parametrize("seed", range(12))
def test_larger_instances_match_dp_and_every_probe_path(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """L up to 60: the bottleneck equals an O(L^2 p) DP, and forcing the O(pL) reachable-set probes
    or the start-term probes (instead of the O(p log L) interval probes) changes nothing."""
    rng = np.random.default_rng(seed)
    L = int(rng.integers(20, 61))
    p = int(rng.integers(2, 9))
    costs = rng.integers(1, 40, L).astype(float)
    speeds = rng.choice([0.5, 1.0, 2.0], p)
    mem = rng.integers(1, 30, (p, L)).astype(float)
    zeros = np.zeros((p, L))
    peak = float(mem.sum(axis=1).max())
    limit = np.full(p, float(rng.integers(int(peak / p) + 30, int(peak))))
    ref = dp_bottleneck(costs, p, speeds, zeros, mem, zeros, zeros, limit)
    fast = solve(costs, p, stage_speeds=speeds, memory_bytes=mem, memory_limit_bytes=limit)
    assert fast.bottleneck == ref

    monkeypatch.setattr(solver, "fast_applies", lambda *args: False)
    monkeypatch.setattr(partition, "fast_applies", lambda *args: False)
    assert solve(costs, p, stage_speeds=speeds, memory_bytes=mem, memory_limit_bytes=limit) == fast
    build = solver.build_instance

    def with_start_terms(*args: object) -> object:
        inst = build(*args)  # type: ignore[arg-type]
        return solver.replace(inst, mem_start=np.zeros((inst.num_stages, inst.num_layers + 1)))

    monkeypatch.setattr(solver, "build_instance", with_start_terms)
    assert solve(costs, p, stage_speeds=speeds, memory_bytes=mem, memory_limit_bytes=limit) == fast
    monkeypatch.undo()

    # every term at once, against the DP
    bc = rng.integers(0, 20, (p, L)).astype(float)
    start = rng.integers(0, 20, L).astype(float)
    end = rng.integers(0, 20, (p, L)).astype(float)
    full = solve(costs, p, stage_speeds=speeds, boundary_costs=bc, memory_bytes=mem,
                 memory_start_bytes=start, memory_end_bytes=end, memory_limit_bytes=limit + 40)
    check_solution(full, costs.tolist(), p, speeds=speeds.tolist(), bc=bc.tolist(), mem=mem.tolist(),
                   start=start.tolist(), end=end.tolist(), limit=(limit + 40).tolist())
    starts = np.broadcast_to(start, (p, L))
    assert full.bottleneck == dp_bottleneck(costs, p, speeds, bc, mem, starts, end, limit + 40)


def test_general_paths_forced() -> None:
    """Exercise the monotone and start-term probes on instances where the fast path cannot apply."""
    rng = np.random.default_rng(11)
    for _ in range(30):
        L = int(rng.integers(5, 9))
        p = int(rng.integers(2, min(L, 4) + 1))
        costs = rng.integers(0, 9, L).astype(float).tolist()
        mem = rng.integers(0, 9, (p, L)).astype(float).tolist()
        start = rng.integers(0, 9, (p, L)).astype(float).tolist()
        end = rng.integers(0, 9, L).astype(float).tolist()
        bc = rng.integers(0, 9, (p, L)).astype(float).tolist()
        check_against_brute(costs, p, mem=mem, start=start, end=end, bc=bc)
        check_against_brute(costs, p, mem=mem, end=end, bc=bc, limit=25.0)


def solve_args(kw: dict[str, Any]) -> dict[str, Any]:
    return {
        "stage_speeds": kw.get("speeds"),
        "boundary_costs": kw.get("bc"),
        "memory_bytes": kw.get("mem"),
        "memory_start_bytes": kw.get("start"),
        "memory_end_bytes": kw.get("end"),
        "memory_limit_bytes": kw.get("limit"),
    }


def solve_or_min_limit(costs: Sequence[float], p: int, **kw: Any) -> Solution | float | None:
    """The solution, or the smallest limit reported when infeasible."""
    try:
        return solve(costs, p, **solve_args(kw))
    except InfeasiblePlanError as exc:
        return exc.min_memory_limit_bytes


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_end_and_boundary_terms_without_start_match_brute_force(data: st.DataObject) -> None:
    """The planner's shape: memory rows per stage, end terms (boundary buffers), boundary costs, no
    start terms. Small end terms keep every stage monotone in its end (greedy probes), larger ones
    do not (numpy probes); either way the answer is brute force's and that of the numpy path forced."""
    costs, p = data.draw(instance())
    L = len(costs)
    low = data.draw(st.sampled_from([0, 3]))
    mem = rows_strategy(data.draw, p, L, st.integers(low, 12).map(float))
    end_max = data.draw(st.sampled_from([1, 3, 10]))
    end = rows_strategy(data.draw, p, L, st.integers(0, end_max).map(float))
    bc = data.draw(st.none() | st.lists(st.integers(0, 3).map(float), min_size=L, max_size=L))
    speeds = data.draw(st.none() | st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=p, max_size=p))
    limit = data.draw(st.none() | st.integers(1, 60).map(float))
    kw: dict[str, Any] = {"speeds": speeds, "bc": bc, "mem": mem, "end": end, "limit": limit}
    check_against_brute(costs, p, **kw)
    fast = solve_or_min_limit(costs, p, **kw)
    with patch.object(solver, "fast_applies", lambda *args: False), \
            patch.object(partition, "fast_applies", lambda *args: False):
        assert solve_or_min_limit(costs, p, **kw) == fast


@pytest.mark.parametrize("seed", range(8))
def test_planner_shaped_instances_use_the_greedy_path_and_match_dp(seed: int) -> None:
    """L up to 80, 1F1B-like rows and boundary buffers that fall by less than a layer's memory: the
    greedy probes settle every probe, and the answer equals the O(L^2 p) DP and the numpy path."""
    rng = np.random.default_rng(100 + seed)
    L = int(rng.integers(30, 81))
    p = int(rng.integers(2, 9))
    costs = rng.integers(3, 40, L).astype(float)  # boundary costs fall by at most 2
    act = rng.integers(1, 10, L).astype(float)
    mem = rng.integers(5, 30, L)[None, :] + np.minimum(p - np.arange(p), 2 * p)[:, None] * act[None, :]
    end = rng.integers(0, 5, L).astype(float)
    end[-1] = 0.0
    bc = rng.integers(0, 3, L).astype(float)
    zeros = np.zeros((p, L))
    peak = float(mem.sum(axis=1).max())
    limit = np.full(p, float(rng.integers(int(peak / p) + 60, int(peak))))
    inst = solver.build_instance(costs, p, np.ones(p), np.broadcast_to(bc, (p, L)), mem, None,
                                  np.broadcast_to(end, (p, L)), limit)
    assert inst.monotone_in_end
    settled = []
    greedy = partition._probe_fast

    def counted(*args: Any) -> Any:
        result = greedy(*args)
        settled.append(result is not None)
        return result

    with patch.object(partition, "_probe_fast", counted):
        sol = solve(costs, p, boundary_costs=bc, memory_bytes=mem, memory_end_bytes=end,
                    memory_limit_bytes=limit)
    assert settled and all(settled)
    check_solution(sol, costs.tolist(), p, bc=bc.tolist(), mem=mem.tolist(), end=end.tolist(),
                   limit=limit.tolist())
    ends = np.broadcast_to(end, (p, L))
    assert sol.bottleneck == dp_bottleneck(costs, p, np.ones(p), np.broadcast_to(bc, (p, L)), mem, zeros,
                                           ends, limit)
    with patch.object(solver, "fast_applies", lambda *args: False), \
            patch.object(partition, "fast_applies", lambda *args: False):
        assert solve(costs, p, boundary_costs=bc, memory_bytes=mem, memory_end_bytes=end,
                     memory_limit_bytes=limit) == sol


def test_monotone_in_end_certificate() -> None:
    """An end term that falls by more than the next layer's memory breaks monotonicity in the end;
    the last stage, whose end is fixed, is not checked."""
    costs = np.ones(4)
    mem = np.array([[5.0, 1.0, 5.0, 5.0]] * 2)

    def certified(end: list[float], bc: list[float] | None = None) -> bool:
        bcosts = None if bc is None else np.array([bc] * 2)
        inst = solver.build_instance(costs, 2, np.ones(2), bcosts, mem, None, np.array([end] * 2), None)
        return inst.monotone_in_end

    assert certified([0.0, 3.0, 2.5, 0.0])  # falls by 0.5 <= layer 2's 5 bytes
    assert not certified([3.0, 0.0, 0.0, 0.0])  # [0, 1) needs 8 bytes, [0, 2) only 6
    assert certified([0.0, 0.0, 0.0, 9.0])  # only the last stage ends at L
    assert not certified([0.0] * 4, bc=[0.0, 5.0, 0.0, 0.0])  # [0, 2) takes 7 s, [0, 3) only 3 s


def test_documented_example() -> None:
    sol = solve([1, 2, 3, 4, 5, 6], 2)
    assert sol.boundaries == (0, 4, 6)
    assert sol.stage_costs == (10.0, 11.0)
    assert sol.bottleneck == 11.0
    assert sol.lower_bound == 10.5
    assert sol.stage_memory is None


def test_one_stage_per_layer() -> None:
    sol = solve([3, 1, 2], 3)
    assert sol.boundaries == (0, 1, 2, 3)
    assert sol.bottleneck == 3.0


def test_single_stage() -> None:
    sol = solve([3, 1, 2], 1, memory_bytes=[1, 2, 3])
    assert sol.boundaries == (0, 3)
    assert sol.stage_costs == (6.0,)
    assert sol.stage_memory == (6.0,)


def test_single_layer() -> None:
    assert solve([5.0], 1).boundaries == (0, 1)


def test_zero_costs_tie_break_is_lexicographic() -> None:
    # every partition has bottleneck 0: the lexicographically smallest wins
    assert solve([0, 0, 0, 0, 0], 3).boundaries == (0, 1, 2, 5)


def test_tie_break_prefers_lower_memory_then_lexicographic() -> None:
    costs = [1, 1, 1, 1]
    # bottleneck 2 for (0,1,3,4)? no: the optimum is 2 with (0, 2, 4) only for p=2; use p=3:
    # partitions with bottleneck 2: (0,1,2,4), (0,1,3,4), (0,2,3,4)
    assert solve(costs, 3).boundaries == (0, 1, 2, 4)
    # memory heavy on the last layers: the peak is smallest when the last stage is a single layer
    sol = solve(costs, 3, memory_bytes=[1, 1, 5, 5])
    assert sol.boundaries == (0, 2, 3, 4)
    assert sol.stage_memory == (2.0, 5.0, 5.0)
    # with per-stage limits, utilisation (memory / limit) decides
    sol = solve(costs, 3, memory_bytes=[1, 1, 1, 1], memory_limit_bytes=[1, 4, 4])
    assert sol.boundaries == (0, 1, 2, 4)
    sol = solve(costs, 3, memory_bytes=[1, 1, 1, 1], memory_limit_bytes=[4, 4, 1])
    assert sol.boundaries == (0, 1, 3, 4)


def test_deterministic() -> None:
    rng = np.random.default_rng(3)
    costs = rng.integers(1, 5, 40).astype(float)
    mem = rng.integers(1, 5, 40).astype(float)
    first = solve(costs, 6, memory_bytes=mem)
    for _ in range(3):
        assert solve(costs.copy(), 6, memory_bytes=mem.copy()) == first


def test_memory_limit_binds() -> None:
    # without memory the balanced split is (0, 2, 4); memory forces a lopsided one
    sol = solve([1, 1, 1, 1], 2, memory_bytes=[10, 1, 1, 1], memory_limit_bytes=10)
    assert sol.boundaries == (0, 1, 4)
    assert sol.stage_memory == (10.0, 3.0)


def test_stage_dependent_memory_rows_1f1b() -> None:
    # 1F1B: stage k holds min(p - k, m) microbatches of activations, so stage 0 gets fewer layers
    p, L = 4, 16
    act = [[min(p - k, 8) * 1.0] * L for k in range(p)]
    sol = check_against_brute([1.0] * L, p, mem=act, limit=12.0)
    assert sol is not None
    assert sol.boundaries == (0, 2, 6, 11, 16)  # bottleneck 5; stage 1 sits at its limit either way


def test_infeasible_message_and_min_limit() -> None:
    mem = [2.0 * 2**30] * 8
    with pytest.raises(
        InfeasiblePlanError,
        match=r"no partition of 8 layers into 2 stages fits the memory limit of 4\.00 GiB per stage; "
        r"the smallest limit that admits a plan is 8\.00 GiB; raise the limit, add stages",
    ) as info:
        solve(np.ones(8), 2, memory_bytes=mem, memory_limit_bytes=4 * 2**30)
    assert info.value.min_memory_limit_bytes == 8 * 2**30


def test_infeasible_single_layer_message() -> None:
    mem = [1.0, 5.0 * 2**30, 1.0]
    with pytest.raises(
        InfeasiblePlanError,
        match=r"layer 1 alone needs 5\.00 GiB \(5368709120 bytes\) on any stage, more than the memory "
        r"limit of 2\.00 GiB per stage",
    ) as info:
        solve([1, 1, 1], 2, memory_bytes=mem, memory_limit_bytes=2 * 2**30)
    assert info.value.min_memory_limit_bytes == 5.0 * 2**30 + 1.0


def test_infeasible_names_the_layer_that_fits_nowhere_not_one_whose_buffer_it_need_not_carry() -> None:
    """Layer 0's send buffer (an end term) goes with it only where it closes a stage; with layer 1 beside it,
    it fits: the layer to blame is layer 2, whose own 600 B fit no stage of 500 B."""
    with pytest.raises(
        InfeasiblePlanError, match=r"layer 2 alone needs 600 B \(600 bytes\) on any stage"
    ) as info:
        solve([1, 1, 1], 2, memory_bytes=[10, 10, 600], memory_end_bytes=[2000, 0, 0], memory_limit_bytes=500)
    assert info.value.min_memory_limit_bytes == 600.0
    with pytest.raises(InfeasiblePlanError, match=r"layer 0 alone needs 1\.95 KiB"):
        # the first layer opens stage 0
        solve([1, 1, 1], 2, memory_bytes=[0, 10, 10], memory_start_bytes=[2000, 0, 0], memory_limit_bytes=500)


def test_infeasible_vector_limits_are_listed() -> None:
    with pytest.raises(
        InfeasiblePlanError, match=r"fits the per-stage memory limits \[2, 3\] B; the smallest limit"
    ):
        solve([1, 1, 1], 2, memory_bytes=[2, 2, 2], memory_limit_bytes=[2, 3])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"costs": [], "num_stages": 1}, r"costs is empty; profile at least one layer"),
        ({"costs": [[1, 2]], "num_stages": 1}, r"costs must be one-dimensional .* got shape \(1, 2\)"),
        ({"costs": ["a"], "num_stages": 1}, r"costs must be numeric"),
        ({"costs": [1, float("nan")], "num_stages": 1},
         r"costs\[1\] is nan; every value must be a finite number >= 0 \(seconds\); re-profile"),
        ({"costs": [1, -1], "num_stages": 1},
         r"costs\[1\] is -1\.0; every value must be a finite number >= 0"),
        ({"costs": [1, float("inf")], "num_stages": 1}, r"costs\[1\] is inf"),
        ({"costs": [1] * 8, "num_stages": 9}, r"num_stages \(9\) exceeds the number of layers \(8\); use "
                                              r"fewer stages or profile at a finer granularity"),
        ({"costs": [1], "num_stages": 0}, r"num_stages \(0\) must be at least 1"),
        ({"costs": [1], "num_stages": 1.5}, r"num_stages must be an integer, got 1\.5"),
        ({"costs": [1], "num_stages": True}, r"num_stages must be an integer, got True"),
        ({"costs": [1, 1], "num_stages": 2, "stage_speeds": [1]},
         r"stage_speeds has shape \(1,\); expected \(2,\) \(one relative speed per stage\)"),
        ({"costs": [1, 1], "num_stages": 2, "stage_speeds": [1, 0]},
         r"stage_speeds\[1\] is 0\.0; every speed must be finite and > 0"),
        ({"costs": [1, 1], "num_stages": 2, "boundary_costs": [1, 1, 1]},
         r"boundary_costs has shape \(3,\); expected \(2,\) \(one value per layer\) or \(2, 2\) \(one row "
         r"per stage\)"),
        ({"costs": [1, 1], "num_stages": 2, "boundary_costs": [1, -2]},
         r"boundary_costs\[1\] is -2\.0; every value must be a finite number >= 0 \(seconds\)"),
        ({"costs": [1, 1], "num_stages": 1, "memory_bytes": [1, float("nan")]},
         r"memory_bytes\[1\] is nan; every value must be a finite number >= 0 \(bytes\)"),
        ({"costs": [1, 1], "num_stages": 1, "memory_bytes": [1, -1]}, r"memory_bytes\[1\] is -1\.0"),
        ({"costs": [1, 1], "num_stages": 2, "memory_bytes": [[1, 1]]},
         r"memory_bytes has shape \(1, 2\); expected \(2,\) \(one value per layer\) or \(2, 2\) \(one row "
         r"per stage\)"),
        ({"costs": [1, 1], "num_stages": 1, "memory_bytes": [1, 1], "memory_start_bytes": [1]},
         r"memory_start_bytes has shape \(1,\)"),
        ({"costs": [1, 1], "num_stages": 1, "memory_bytes": [1, 1], "memory_end_bytes": [-1, 0]},
         r"memory_end_bytes\[0\] is -1\.0"),
        ({"costs": [1, 1], "num_stages": 1, "memory_limit_bytes": 5},
         r"memory_limit_bytes is given but memory_bytes is None; pass per-layer memory_bytes"),
        ({"costs": [1, 1], "num_stages": 1, "memory_start_bytes": [1, 1]},
         r"memory_start_bytes is given but memory_bytes is None"),
        ({"costs": [1, 1], "num_stages": 1, "memory_end_bytes": [1, 1]},
         r"memory_end_bytes is given but memory_bytes is None"),
        ({"costs": [1, 1], "num_stages": 2, "memory_bytes": [1, 1], "memory_limit_bytes": [1, 2, 3]},
         r"memory_limit_bytes has shape \(3,\); expected a scalar or \(2,\) \(one limit per stage\)"),
        ({"costs": [1, 1], "num_stages": 2, "memory_bytes": [1, 1], "memory_limit_bytes": 0},
         r"memory_limit_bytes is 0\.0; every limit must be > 0 bytes"),
        ({"costs": [1, 1], "num_stages": 2, "memory_bytes": [1, 1], "memory_limit_bytes": [1, float("nan")]},
         r"memory_limit_bytes\[1\] is nan"),
    ],
)
def test_solve_errors(kwargs: dict[str, object], match: str) -> None:
    costs = kwargs.pop("costs")
    p = kwargs.pop("num_stages")
    with pytest.raises(StageplanError, match=match):
        solve(costs, p, **kwargs)  # type: ignore[arg-type]


def test_infinite_limit_means_no_limit() -> None:
    sol = solve([1, 1, 1, 1], 2, memory_bytes=[5, 1, 1, 1], memory_limit_bytes=[math.inf, math.inf])
    assert sol.boundaries == (0, 2, 4)


def test_without_the_tie_breaks_the_bottleneck_is_the_same_and_the_split_fits() -> None:
    """solve(tie_break=False), which the layout search calls, skips only the tie-breaks: its bottleneck equals
    the full solve's and brute force's, and its split keeps to the limits."""
    rng = np.random.default_rng(7)
    for _ in range(40):
        L, p = int(rng.integers(3, 9)), int(rng.integers(1, 4))
        p = min(p, L)
        costs = rng.random(L).round(2) + 0.01
        mem = rng.random(L).round(2)
        limit = float(mem.sum()) / p * 1.6
        want, _ = brute(list(costs), p, mem=list(mem), limit=limit)
        if want is None:
            continue
        fast = solve(costs, p, memory_bytes=mem, memory_limit_bytes=limit, tie_break=False)
        full = solve(costs, p, memory_bytes=mem, memory_limit_bytes=limit)
        assert fast.bottleneck == pytest.approx(full.bottleneck, rel=1e-9)
        b = fast.boundaries
        assert all(sum(mem[b[k]:b[k + 1]]) <= limit * (1 + 1e-9) for k in range(p))
