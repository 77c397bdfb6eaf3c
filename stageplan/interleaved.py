"""Interleaved (virtual-stage) planning: p*v contiguous chunks, chunk c on rank c % p, as a MILP (scipy/HiGHS)
with a local-search incumbent and a proven bound (no torch)."""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
from numpy.typing import ArrayLike
from scipy import optimize, sparse

from stageplan.errors import InfeasiblePlanError, StageplanError
from stageplan.solver import (
    _INF,
    FloatArray,
    IntArray,
    _validate_costs,
    _validate_count,
    _validate_limits,
    _validate_rows,
    _validate_speeds,
    lower_bound,
    solve,
)
from stageplan.units import format_bytes, format_limits

__all__ = ["InterleavedSolution", "solve_interleaved"]


@dataclass(frozen=True)
class InterleavedSolution:
    """A partition of L layers into p*v contiguous chunks, chunk c running on rank ``c % p``.

    ``rank_loads[r]`` is the summed cost of rank r's chunks divided by its speed,
    ``bottleneck == max(rank_loads)``. ``lower_bound`` is a proven lower bound on the optimal
    bottleneck (equal to ``bottleneck`` when ``optimal``). ``chunk_memory`` holds bytes per chunk.
    """

    boundaries: tuple[int, ...]
    rank_loads: tuple[float, ...]
    bottleneck: float
    lower_bound: float
    optimal: bool
    chunk_memory: tuple[float, ...] | None


@dataclass(frozen=True)
class _MilpResult:
    bounds: list[int] | None
    optimal: bool
    infeasible: bool
    dual_bound: float  # in the unscaled unit of the objective (time or bytes); -inf when unknown


def _interleaved_milp(
    costs: FloatArray,
    p: int,
    v: int,
    speeds: FloatArray,
    memory: FloatArray | None,
    limits: FloatArray | None,
    objective: str,
    upper: float,
    lower: float,
    time_limit_s: float,
) -> _MilpResult:
    """Solve with HiGHS. u[l, c] = 1 iff layer l sits in chunk >= c (c = 1..C-1): a staircase,
    non-decreasing in l, rising by at most one per layer, so every chunk is non-empty and contiguous.
    With S_c = sum_l w_l u[l, c] (S_0 = total, S_C = 0), chunk c costs S_c - S_{c+1}."""
    L = costs.size
    C = p * v
    nc = C - 1
    nu = L * nc
    z = nu  # the objective variable: bottleneck (time) or peak rank memory (memory)
    ls, cs = np.meshgrid(np.arange(L), np.arange(1, C), indexing="ij")

    def var(layer: IntArray, chunk: IntArray) -> IntArray:
        return layer * nc + (chunk - 1)

    lb = np.zeros(nu + 1)
    ub = np.ones(nu + 1)
    ub[var(ls, cs)[ls < cs]] = 0.0  # layer l is in chunk <= l
    lb[var(ls, cs)[cs <= ls - (L - C)]] = 1.0  # ... and in chunk >= C - L + l
    rows: list[IntArray] = []
    cols: list[IntArray] = []
    vals: list[FloatArray] = []
    row_lo: list[float] = []
    row_hi: list[float] = []
    n_rows = 0

    def add(r: IntArray, cidx: IntArray, val: FloatArray) -> None:
        rows.append(r)
        cols.append(cidx)
        vals.append(val)

    # u[l, c] >= u[l-1, c]
    ll2, cc2 = np.meshgrid(np.arange(1, L), np.arange(1, C), indexing="ij")
    ll, cc = ll2.ravel(), cc2.ravel()
    r = n_rows + np.arange(ll.size)
    add(r, var(ll, cc), np.ones(ll.size))
    add(r, var(ll - 1, cc), -np.ones(ll.size))
    row_lo += [0.0] * ll.size
    row_hi += [_INF] * ll.size
    n_rows += ll.size
    # u[l, c] <= u[l-1, c-1]
    ll2, cc2 = np.meshgrid(np.arange(1, L), np.arange(2, C), indexing="ij")
    ll, cc = ll2.ravel(), cc2.ravel()
    r = n_rows + np.arange(ll.size)
    add(r, var(ll - 1, cc - 1), np.ones(ll.size))
    add(r, var(ll, cc), -np.ones(ll.size))
    row_lo += [0.0] * ll.size
    row_hi += [_INF] * ll.size
    n_rows += ll.size

    layers = np.arange(L)

    def add_rank_rows(weights: FloatArray, rhs: FloatArray, z_coef: FloatArray) -> None:
        """sum over rank r's chunks of their weight + z_coef[r] * z <= rhs[r]; weights is (C, L)."""
        nonlocal n_rows
        for rank in range(p):
            const = 0.0
            for chunk in range(rank, C, p):
                # + sum_l weights[chunk, l] * u[l, chunk]   (u[., 0] = 1)
                if chunk == 0:
                    const += float(weights[0].sum())
                else:
                    add(np.full(L, n_rows), var(layers, np.full(L, chunk)), weights[chunk])
                # - sum_l weights[chunk, l] * u[l, chunk+1]   (u[., C] = 0)
                if chunk + 1 <= C - 1:
                    add(np.full(L, n_rows), var(layers, np.full(L, chunk + 1)), -weights[chunk])
            add(np.array([n_rows]), np.array([z]), np.array([z_coef[rank]]))
            row_lo.append(-_INF)
            row_hi.append(float(rhs[rank]) - const)
            n_rows += 1

    time_scale = lower if lower > 0 else 1.0
    mem_scale = 1.0
    if memory is not None:
        mem_scale = max(float(memory.sum(axis=1).max()) / p, 1e-300)
    if objective == "time":
        add_rank_rows(np.broadcast_to(costs / time_scale, (C, L)), np.zeros(p), -speeds)
        if memory is not None and limits is not None:
            finite = np.where(np.isfinite(limits), limits / mem_scale, 1e300)
            add_rank_rows(memory / mem_scale, finite, np.zeros(p))
        lb[z] = lower / time_scale
        ub[z] = upper / time_scale * (1 + 1e-9) if math.isfinite(upper) else _INF
        scale = time_scale
    else:
        assert memory is not None
        add_rank_rows(memory / mem_scale, np.zeros(p), -np.ones(p))
        lb[z] = 0.0
        ub[z] = _INF
        scale = mem_scale
    a = sparse.csr_array(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n_rows, nu + 1)
    )
    objective_vec = np.zeros(nu + 1)
    objective_vec[z] = 1.0
    integrality = np.ones(nu + 1)
    integrality[z] = 0
    with warnings.catch_warnings():
        # mip_abs_gap is passed to HiGHS verbatim; scipy warns that it does not know it
        warnings.simplefilter("ignore", RuntimeWarning)
        res = optimize.milp(
            objective_vec,
            integrality=integrality,
            bounds=optimize.Bounds(lb, ub),
            constraints=optimize.LinearConstraint(a, np.asarray(row_lo), np.asarray(row_hi)),
            options={"time_limit": float(time_limit_s), "mip_rel_gap": 1e-9, "mip_abs_gap": 1e-9},
        )
    dual = res.get("mip_dual_bound")
    dual_bound = float(dual) * scale if dual is not None and np.isfinite(dual) else -_INF
    bounds = None
    if res.x is not None:
        u = np.rint(res.x[:nu]).reshape(L, nc)
        inner = (L - u.sum(axis=0)).astype(np.int64).tolist()
        cand = [0, *inner, L]
        if all(b1 < b2 for b1, b2 in itertools.pairwise(cand)):
            bounds = cand
    return _MilpResult(bounds, res.status == 0 and bounds is not None, res.status == 2, dual_bound)


def _rank_loads(costs: FloatArray, p: int, speeds: FloatArray, bounds: list[int]) -> tuple[float, ...]:
    prefix = np.zeros(costs.size + 1)
    np.cumsum(costs, out=prefix[1:])
    b = np.asarray(bounds)
    chunk = prefix[b[1:]] - prefix[b[:-1]]
    return tuple(math.fsum(chunk[r::p].tolist()) / float(speeds[r]) for r in range(p))


def _chunk_memory(memory: FloatArray, bounds: list[int]) -> FloatArray:
    prefix = np.zeros((memory.shape[0], memory.shape[1] + 1))
    np.cumsum(memory, axis=1, out=prefix[:, 1:])
    b = np.asarray(bounds)
    ks = np.arange(memory.shape[0])
    return np.asarray(prefix[ks, b[1:]] - prefix[ks, b[:-1]])


def _rank_memory(memory: FloatArray, p: int, bounds: list[int]) -> FloatArray:
    chunk = _chunk_memory(memory, bounds)
    return np.array([math.fsum(chunk[r::p].tolist()) for r in range(p)])


def solve_interleaved(
    costs: ArrayLike,
    num_ranks: int,
    virtual_stages: int,
    *,
    rank_speeds: ArrayLike | None = None,
    memory_bytes: ArrayLike | None = None,
    memory_limit_bytes: ArrayLike | None = None,
    time_limit_s: float = 2.0,
) -> InterleavedSolution:
    """Split layers into ``p*v`` contiguous non-empty chunks, chunk c on rank ``c % p``, minimising
    the largest rank load (the summed cost of a rank's chunks divided by its speed).

    ``memory_bytes`` is ``(L,)`` or ``(p*v, L)`` (one row per chunk); a rank's memory is the sum of
    its chunks' and must fit ``memory_limit_bytes`` (scalar or one per rank). ``v == 1`` is the
    contiguous problem and is solved exactly by :func:`solve`. Otherwise a MILP is solved with
    HiGHS (scipy.optimize.milp) within ``time_limit_s``: ``optimal`` is True when HiGHS proves it
    (gap 1e-9 of the objective scaled by the trivial bound); else the best plan found is returned
    with ``lower_bound`` = the proven dual bound. Among optimal plans the one HiGHS returns is kept
    (not canonical; repeatable when HiGHS finishes within the time limit). Each MILP (the plan,
    and on infeasibility the smallest limit) gets ``time_limit_s``.

    >>> solve_interleaved([1, 1, 1, 1], 2, 2).rank_loads
    (2.0, 2.0)
    """
    c = _validate_costs(costs)
    L = c.size
    p = _validate_count("num_ranks", num_ranks, "pipeline ranks")
    v = _validate_count("virtual_stages", virtual_stages, "virtual stages per rank")
    C = p * v
    if L < C:
        raise StageplanError(
            f"interleaved needs at least p*v = {C} layers, the profile has {L}; "
            "lower virtual_stages or profile at a finer granularity"
        )
    speeds = _validate_speeds("rank_speeds", rank_speeds, p, "rank")
    memory = limits = None
    if memory_bytes is None:
        if memory_limit_bytes is not None:
            raise StageplanError(
                f"memory_limit_bytes is given but memory_bytes is None; pass per-layer memory_bytes "
                f"(shape ({L},) or ({C}, {L})) or drop memory_limit_bytes"
            )
    else:
        memory = _validate_rows("memory_bytes", memory_bytes, C, L, "chunk")
        if memory_limit_bytes is not None:
            limits = _validate_limits(memory_limit_bytes, p, "rank")
    if (
        isinstance(time_limit_s, bool)
        or not isinstance(time_limit_s, (int, float))
        or not (time_limit_s > 0)
        or math.isnan(time_limit_s)
    ):
        raise StageplanError(f"time_limit_s must be a number > 0, got {time_limit_s!r}; pass seconds, e.g. 2.0")

    if v == 1:
        sol = solve(c, p, stage_speeds=speeds, memory_bytes=memory, memory_limit_bytes=limits)
        return InterleavedSolution(
            boundaries=sol.boundaries,
            rank_loads=sol.stage_costs,
            bottleneck=sol.bottleneck,
            lower_bound=sol.bottleneck,
            optimal=True,
            chunk_memory=sol.stage_memory,
        )
    return _solve_interleaved_milp(c, p, v, speeds, memory, limits, float(time_limit_s))


def _solve_interleaved_milp(
    c: FloatArray,
    p: int,
    v: int,
    speeds: FloatArray,
    memory: FloatArray | None,
    limits: FloatArray | None,
    time_limit_s: float,
) -> InterleavedSolution:
    L = c.size
    C = p * v
    trivial = lower_bound(c, speeds)

    def fits(bounds: list[int]) -> bool:
        if memory is None or limits is None:
            return True
        return bool(np.all(_rank_memory(memory, p, bounds) <= limits))

    # incumbent: the contiguous optimum over p*v stages with the ranks' speeds (memory ignored, or
    # each chunk held to 1/v of its rank's limit), improved by local search; it bounds the MILP
    starts = [list(solve(c, C, stage_speeds=np.tile(speeds, v)).boundaries)]
    if memory is not None and limits is not None:
        with contextlib.suppress(InfeasiblePlanError):
            chunk_limits = np.tile(limits / v, v)
            sol = solve(c, C, stage_speeds=np.tile(speeds, v), memory_bytes=memory, memory_limit_bytes=chunk_limits)
            starts.append(list(sol.boundaries))
    heur: list[int] = []
    upper = _INF
    time_rows = np.broadcast_to(c, (C, L))
    for start in starts:
        if not fits(start):
            assert memory is not None
            start = _improve_interleaved(memory, p, np.ones(p), None, None, start)  # repair memory
        if fits(start):
            cand = _improve_interleaved(time_rows, p, speeds, memory, limits, start)
            load = max(_rank_loads(c, p, speeds, cand))
            if load < upper:
                heur, upper = cand, load
    heur_ok = bool(heur)

    result = _interleaved_milp(c, p, v, speeds, memory, limits, "time", upper, trivial, time_limit_s)
    if result.infeasible and not heur_ok:
        _raise_interleaved_infeasible(c, p, v, memory, limits, time_limit_s)
    candidates: list[tuple[float, int, list[int], bool]] = []
    if result.bounds is not None and fits(result.bounds):
        candidates.append((max(_rank_loads(c, p, speeds, result.bounds)), 0, result.bounds, result.optimal))
    if heur_ok:
        candidates.append((max(_rank_loads(c, p, speeds, heur)), 1, heur, False))
    if not candidates:
        raise StageplanError(
            f"no interleaved plan of {L} layers into {p} ranks x {v} virtual stages was found within "
            f"time_limit_s={time_limit_s:g}, and infeasibility was not proven either; raise time_limit_s"
        )
    bottleneck, _, bounds, optimal = min(candidates, key=lambda t: (t[0], t[1]))
    loads = _rank_loads(c, p, speeds, bounds)
    lower = bottleneck if optimal else min(bottleneck, max(trivial, result.dual_bound))
    return InterleavedSolution(
        boundaries=tuple(int(b) for b in bounds),
        rank_loads=loads,
        bottleneck=max(loads),
        lower_bound=lower,
        optimal=optimal,
        chunk_memory=None if memory is None else tuple(float(x) for x in _chunk_memory(memory, bounds)),
    )


def _improve_interleaved(
    values: FloatArray,
    p: int,
    div: FloatArray,
    guard_rows: FloatArray | None,
    guard_limits: FloatArray | None,
    bounds: list[int],
) -> list[int]:
    """Local search over chunk boundaries: move one layer across a boundary whenever that lowers the
    larger load of the two ranks involved (rank load = sum of its chunks' values[c] / div[rank]),
    keeping every rank within guard_limits on guard_rows when given. The sorted load vector falls
    with every move, so it stops; the result is a heuristic incumbent, not a proof."""
    C = values.shape[0]
    if p == 1:
        return bounds
    b = list(bounds)
    vp = np.zeros((C, values.shape[1] + 1))
    np.cumsum(values, axis=1, out=vp[:, 1:])
    V = vp.tolist()
    d = div.tolist()
    cost = [V[i][b[i + 1]] - V[i][b[i]] for i in range(C)]
    load = [math.fsum(cost[r::p]) for r in range(p)]
    guarded = guard_rows is not None and guard_limits is not None
    M: list[list[float]] = []
    lim: list[float] = []
    cmem: list[float] = []
    rmem: list[float] = []
    if guard_rows is not None and guard_limits is not None:
        mp = np.zeros((C, guard_rows.shape[1] + 1))
        np.cumsum(guard_rows, axis=1, out=mp[:, 1:])
        M = mp.tolist()
        lim = guard_limits.tolist()
        cmem = [M[i][b[i + 1]] - M[i][b[i]] for i in range(C)]
        rmem = [math.fsum(cmem[r::p]) for r in range(p)]
    improved = True
    while improved:
        improved = False
        for ci in range(1, C):
            ra, rb = (ci - 1) % p, ci % p
            for nb in (b[ci] + 1, b[ci] - 1):
                if not b[ci - 1] < nb < b[ci + 1]:
                    continue
                ca = V[ci - 1][nb] - V[ci - 1][b[ci - 1]]
                cb = V[ci][b[ci + 1]] - V[ci][nb]
                la = load[ra] - cost[ci - 1] + ca
                lb = load[rb] - cost[ci] + cb
                if max(la / d[ra], lb / d[rb]) >= max(load[ra] / d[ra], load[rb] / d[rb]) * (1 - 1e-12):
                    continue
                if guarded:
                    ma = M[ci - 1][nb] - M[ci - 1][b[ci - 1]]
                    mb = M[ci][b[ci + 1]] - M[ci][nb]
                    na = rmem[ra] - cmem[ci - 1] + ma
                    nm = rmem[rb] - cmem[ci] + mb
                    if na > lim[ra] or nm > lim[rb]:
                        continue
                    rmem[ra], rmem[rb], cmem[ci - 1], cmem[ci] = na, nm, ma, mb
                load[ra], load[rb], cost[ci - 1], cost[ci] = la, lb, ca, cb
                b[ci] = nb
                improved = True
                break
    if guard_rows is not None and guard_limits is not None and not np.all(
        _rank_memory(guard_rows, p, b) <= guard_limits
    ):
        return bounds  # incremental sums drifted past a limit: keep the start
    return b


def _raise_interleaved_infeasible(
    c: FloatArray, p: int, v: int, memory: FloatArray | None, limits: FloatArray | None, time_limit_s: float
) -> NoReturn:
    assert memory is not None and limits is not None
    L = c.size
    res = _interleaved_milp(c, p, v, np.ones(p), memory, None, "memory", _INF, 0.0, time_limit_s)
    needed = float(_rank_memory(memory, p, res.bounds).max()) if res.optimal and res.bounds else None
    tail = (
        f"the smallest limit that admits a plan is {format_bytes(needed)}"
        if needed is not None
        else f"the smallest limit that admits a plan was not found within time_limit_s={time_limit_s:g}"
    )
    raise InfeasiblePlanError(
        f"no partition of {L} layers into {p * v} chunks ({p} ranks x {v} virtual stages) fits "
        f"{format_limits(limits, 'rank')}; {tail}; raise the limit, add ranks, use fewer virtual stages, "
        "or use recomputation / a schedule with fewer microbatches in flight",
        min_memory_limit_bytes=needed,
    )
