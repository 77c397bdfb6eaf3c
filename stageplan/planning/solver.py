"""Exact min-max partitioning of per-layer costs into contiguous pipeline stages, under memory limits.

numpy only: ``import stageplan.planning.solver`` loads
no scipy (the interleaved MILP lives in ``milp.py``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NoReturn, cast

import numpy as np
from numpy.typing import ArrayLike

from stageplan.errors import InfeasiblePlanError, StageplanError
from stageplan.planning.partition import (
    INF,
    FloatArray,
    Instance,
    ProbeResult,
    fast_applies,
    lex_smallest,
    max_time,
    max_util,
    run_probe,
    stage_mems,
    stage_times,
)
from stageplan.units import format_bytes, format_limits

__all__ = ["TIE_REL", "Solution", "lower_bound", "solve"]

# Two bottlenecks (or two memory utilisations, or two steps) within this relative distance count as equal: two
# sums of the same costs in another order differ by float rounding. The tie-breaking rules then decide, here
# and in the split search and the interleaved solver; bisection also stops once its bracket is this narrow.
TIE_REL = 1e-12





# --------------------------------------------------------------------------------------------------
# Input validation (errors state the rule, the values and the remedy)
# --------------------------------------------------------------------------------------------------


def shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + (",)" if len(shape) == 1 else ")")


def _index_text(name: str, index: tuple[int, ...]) -> str:
    return f"{name}[{', '.join(str(int(i)) for i in index)}]"


def _as_float_array(name: str, value: ArrayLike) -> FloatArray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise StageplanError(f"{name} must be numeric, got {value!r}; pass numbers ({exc})") from exc
    return arr


def _check_finite_nonneg(name: str, arr: FloatArray, unit: str, remedy: str) -> None:
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise StageplanError(
            f"{_index_text(name, index)} is {float(arr[index])!r}; every value must be a finite number >= 0 "
            f"({unit}); {remedy}"
        )


def validate_costs(costs: ArrayLike) -> FloatArray:
    arr = _as_float_array("costs", costs)
    if arr.ndim != 1:
        raise StageplanError(
            f"costs must be one-dimensional (one time per layer), got shape {shape_text(arr.shape)}; "
            "pass a flat sequence of per-layer times"
        )
    if arr.size == 0:
        raise StageplanError("costs is empty; profile at least one layer before planning")
    _check_finite_nonneg("costs", arr, "seconds", "re-profile that layer")
    return arr


def validate_count(name: str, value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise StageplanError(f"{name} must be an integer, got {value!r}; pass a whole number of {what}")
    count = int(value)
    if count < 1:
        raise StageplanError(f"{name} ({count}) must be at least 1; pass a positive number of {what}")
    return count


def validate_speeds(name: str, speeds: ArrayLike | None, count: int, what: str) -> FloatArray:
    if speeds is None:
        return np.ones(count)
    arr = _as_float_array(name, speeds)
    if arr.shape != (count,):
        raise StageplanError(
            f"{name} has shape {shape_text(arr.shape)}; expected {shape_text((count,))} "
            f"(one relative speed per {what}); pass one value per {what}"
        )
    bad = ~np.isfinite(arr) | (arr <= 0)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise StageplanError(
            f"{name}[{k}] is {float(arr[k])!r}; every speed must be finite and > 0; "
            "pass relative throughputs such as 1.0 (reference device) or 0.5 (half as fast)"
        )
    return arr


def validate_rows(
    name: str, value: ArrayLike, rows: int, num_layers: int, row_what: str, *, view: bool = False
) -> FloatArray:
    """Accept shape (L,) (same for every row) or (rows, L); return (rows, L), finite and >= 0.

    With view=True an (L,) input comes back as a read-only broadcast view (row stride 0), not a copy.
    """
    arr = _as_float_array(name, value)
    if arr.shape not in ((num_layers,), (rows, num_layers)):
        raise StageplanError(
            f"{name} has shape {shape_text(arr.shape)}; expected {shape_text((num_layers,))} "
            f"(one value per layer) or {shape_text((rows, num_layers))} (one row per {row_what})"
        )
    unit = "seconds" if name == "boundary_costs" else "bytes"
    _check_finite_nonneg(name, arr, unit, "check the cost model that produced it")
    if view and arr.ndim == 1:
        return np.broadcast_to(arr, (rows, num_layers))
    return np.ascontiguousarray(np.broadcast_to(arr, (rows, num_layers)), dtype=np.float64)


def validate_limits(limits: ArrayLike, count: int, what: str) -> FloatArray:
    arr = _as_float_array("memory_limit_bytes", limits)
    scalar = arr.ndim == 0
    if scalar:
        arr = np.full(count, float(arr))
    elif arr.shape != (count,):
        raise StageplanError(
            f"memory_limit_bytes has shape {shape_text(arr.shape)}; expected a scalar or "
            f"{shape_text((count,))} (one limit per {what})"
        )
    bad = np.isnan(arr) | (arr <= 0)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        name = "memory_limit_bytes" if scalar else f"memory_limit_bytes[{k}]"
        raise StageplanError(
            f"{name} is {float(arr[k])!r}; every limit must be > 0 bytes; "
            "pass the usable device memory (inf means no limit)"
        )
    return arr


def lower_bound(costs: ArrayLike, speeds: ArrayLike | None = None) -> float:
    """The bound no partition can beat: ``max(total / sum(speeds), largest layer / fastest speed)``.

    The stage holding the largest layer takes at least that layer's time on the fastest device, and the
    slowest stage takes at least the average work per unit of speed (seconds, like ``costs``). This is the
    one place the formula lives: the solver, the interleaved MILP and the plan's evidence all call it.

    >>> lower_bound([1, 2, 3, 4, 5, 6], [1, 1])
    10.5
    """
    c = np.asarray(costs, dtype=np.float64)
    s = np.ones(1) if speeds is None else np.asarray(speeds, dtype=np.float64)
    return max(math.fsum(c.tolist()) / float(s.sum()), float(c.max()) / float(s.max()))


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Solution:
    """An optimal contiguous partition of L layers into p stages.

    ``boundaries`` is ``(0, b1, ..., L)``; stage k holds layers ``[b_k, b_{k+1})``. ``stage_costs``
    are stage times in the unit of ``costs`` (seconds), ``stage_memory`` stage memory in bytes
    (``None`` when no memory was given), ``bottleneck == max(stage_costs)`` and ``lower_bound`` is
    ``max(sum(costs) / sum(speeds), max(costs) / max(speeds))``, a bound no partition can beat.
    """

    boundaries: tuple[int, ...]
    bottleneck: float
    stage_costs: tuple[float, ...]
    stage_memory: tuple[float, ...] | None
    lower_bound: float


# --------------------------------------------------------------------------------------------------
# Bisection on a real threshold with snapping
# --------------------------------------------------------------------------------------------------


def _minimise(
    lo: float,
    hi: float,
    best: list[int],
    probe: Callable[[float], ProbeResult],
    next_of: Callable[[ProbeResult], float],
    value: Callable[[list[int]], float],
    try_lo_first: bool,
) -> tuple[float, list[int]]:
    """Smallest threshold admitting a partition, to within TIE_REL; hi must be admissible (by best).

    A feasible probe snaps hi down to the actual value of the partition it found; an infeasible
    probe lifts lo to its next event (the next candidate value), or to the probe point itself.

    Probe points: the optimum is usually much nearer one end of the bracket than bisection assumes,
    so the probes first gallop from that end, at relative distances 1/64, 1/32, ... (never past the
    bisection point), until a probe lands on the other side; then they bisect. With try_lo_first
    that end is lo (a load-balance bound or a relaxed optimum, often attained, so lo itself is
    probed first; hi is then often the first probe's partition, far off); otherwise it is hi (the
    utilisation of the time-optimal partition found, when lo is a weak bound).
    """
    from_lo = first = try_lo_first
    galloping = True
    gap = 1.0 / 64
    while hi > lo and hi - lo > TIE_REL * hi:
        if lo > 0 and hi > 4 * lo:
            mid = math.sqrt(lo * hi)  # far apart: bisect in log space
        else:
            mid = lo + (hi - lo) / 2
        if first:
            mid = lo
            first = False
        elif galloping:
            near = lo * (1 + gap) if from_lo else hi * (1 - gap)
            if (lo < near < mid) if from_lo else (mid < near < hi):
                mid = near
            gap *= 2
        result = probe(mid)
        if result.feasible:
            assert result.bounds is not None
            best = result.bounds
            hi = min(hi, value(best))
            galloping = galloping and not from_lo
        else:
            nxt = next_of(result)
            lo = max(lo, mid, nxt if math.isfinite(nxt) else mid)
            galloping = galloping and from_lo
    return hi, best


# --------------------------------------------------------------------------------------------------
# solve
# --------------------------------------------------------------------------------------------------


def solve(
    costs: ArrayLike,
    num_stages: int,
    *,
    stage_speeds: ArrayLike | None = None,
    boundary_costs: ArrayLike | None = None,
    memory_bytes: ArrayLike | None = None,
    memory_start_bytes: ArrayLike | None = None,
    memory_end_bytes: ArrayLike | None = None,
    memory_limit_bytes: ArrayLike | None = None,
    tie_break: bool = True,
    min_limit: bool = True,
) -> Solution:
    """Split layers into ``num_stages`` contiguous non-empty stages minimising the largest stage time.

    Stage k over layers ``[i, j)`` takes ``sum(costs[i:j]) / stage_speeds[k]`` plus, when ``j < L``,
    ``boundary_costs[k, j-1]`` (the communication after its last layer; rows may be shared, shape
    ``(L,)``). Its memory is ``sum(memory_bytes[k, i:j]) + memory_start_bytes[k, i] +
    memory_end_bytes[k, j-1]`` (each ``(L,)`` or ``(p, L)``), and must not exceed
    ``memory_limit_bytes`` (a scalar or one limit per stage).

    The bottleneck is minimised exactly (bisection on the bottleneck over reachable-set feasibility
    probes, stopped at 1e-12 relative; each infeasible probe lifts the lower end to the next value
    at which any stage could grow). Without start terms a probe costs O(p log L) when no stage gets
    cheaper as its end grows (always without boundary and end terms; with them, when no term falls
    by more than the next layer's own time or memory, as with 1F1B rows and boundary buffers), and
    O(pL) numpy otherwise; with start terms it costs O(pL log L). Ties are broken deterministically: among
    partitions whose bottleneck is within 1e-12 (relative) of the optimum, the one with the smallest maximum
    memory utilisation ``max_k memory_k / limit_k`` (``max_k memory_k`` without limits; again within 1e-12
    relative) wins, then the lexicographically smallest ``boundaries``. ``tie_break=False`` skips both
    tie-breaks and returns the first optimal split the bisection found (still deterministic): for callers that
    need the bottleneck and a split that fits, such as the layout search.

    Raises ``StageplanError`` on invalid input and ``InfeasiblePlanError`` (with
    ``min_memory_limit_bytes``, the smallest uniform limit that admits a plan) when no partition
    fits the limits; ``min_limit=False`` raises it without that limit (None), skipping the bisection that
    finds it: for callers that ask only whether any split fits, such as the layout search.

    >>> solve([1, 2, 3, 4, 5, 6], 2).boundaries
    (0, 4, 6)
    >>> solve([1, 2, 3, 4, 5, 6], 2).stage_costs
    (10.0, 11.0)
    """
    c, p, speeds, bcosts = _validated_times(costs, num_stages, stage_speeds, boundary_costs)
    memory, start, end, limits = _validated_memory(
        c.size, p, memory_bytes, memory_start_bytes, memory_end_bytes, memory_limit_bytes
    )
    inst = build_instance(c, p, speeds, bcosts, memory, start, end, limits)

    first = run_probe(inst, INF, INF)
    if not first.feasible:
        assert limits is not None
        if not min_limit:
            raise InfeasiblePlanError(f"no partition of {c.size} layers into {p} stages fits "
                                      f"{format_limits(limits, 'stage')}")
        _raise_infeasible(inst, limits)
    assert first.bounds is not None

    # Boundary and end terms force the O(pL) probes when a stage can get cheaper as its end grows (see
    # _monotone_in_end). Dropping them relaxes the problem (every term is >= 0), and the relaxed optimum,
    # found with the fast probes, is a lower bound that is usually attained: starting the exact search
    # there (probed first) typically leaves one or two O(pL) probes instead of ~20.
    relaxed: Instance | None = None
    if start is None and (bcosts is not None or end is not None) and not fast_applies(inst, INF, INF):
        relaxed = build_instance(c, p, speeds, None, memory, None, None, limits)

    # 1. the optimal bottleneck
    best_time, best = _least_time(inst, relaxed, first.bounds)
    if not tie_break:
        return _solution(inst, best)
    time_cap = best_time + TIE_REL * best_time
    util_cap = INF
    # 2. among (near-)optimal partitions, the smallest peak memory utilisation
    if inst.has_memory:
        best_util, best = _least_util(inst, relaxed, time_cap, best)
        util_cap = best_util + TIE_REL * best_util
    # 3. among those, the lexicographically smallest boundaries
    bounds = lex_smallest(inst, time_cap, util_cap) or best
    return _solution(inst, bounds)


def fits_memory(num_layers: int, num_stages: int, *, memory_bytes: ArrayLike,
                memory_start_bytes: ArrayLike | None = None, memory_end_bytes: ArrayLike | None = None,
                memory_limit_bytes: ArrayLike) -> bool:
    """Whether any split of ``num_layers`` layers into ``num_stages`` stages fits the memory limits (the terms
    as in :func:`solve`): one reachable-set probe, without the bisection :func:`solve` runs to name the
    smallest limit when none fits.

    >>> fits_memory(4, 2, memory_bytes=[3, 1, 1, 3], memory_limit_bytes=4)
    True
    >>> fits_memory(4, 2, memory_bytes=[3, 1, 1, 3], memory_limit_bytes=3)
    False
    """
    c, p, _, _ = _validated_times(np.zeros(int(num_layers)), num_stages, None, None)
    memory, start, end, limits = _validated_memory(c.size, p, memory_bytes, memory_start_bytes,
                                                   memory_end_bytes, memory_limit_bytes)
    inst = build_instance(c, p, np.ones(p), None, memory, start, end, limits)
    return bool(run_probe(inst, INF, INF).feasible)


def _validated_times(
    costs: ArrayLike, num_stages: int, stage_speeds: ArrayLike | None, boundary_costs: ArrayLike | None
) -> tuple[FloatArray, int, FloatArray, FloatArray | None]:
    """solve's time inputs, checked in order: costs (L,),
    the stage count (1..L), speeds (p,), boundary rows."""
    c = validate_costs(costs)
    num_layers = c.size
    p = validate_count("num_stages", num_stages, "pipeline stages")
    if p > num_layers:
        raise StageplanError(
            f"num_stages ({p}) exceeds the number of layers ({num_layers}); "
            "use fewer stages or profile at a finer granularity"
        )
    speeds = validate_speeds("stage_speeds", stage_speeds, p, "stage")
    bcosts = None if boundary_costs is None else validate_rows("boundary_costs", boundary_costs, p,
                                                               num_layers, "stage", view=True)
    return c, p, speeds, bcosts


def _validated_memory(
    num_layers: int,
    p: int,
    memory_bytes: ArrayLike | None,
    memory_start_bytes: ArrayLike | None,
    memory_end_bytes: ArrayLike | None,
    memory_limit_bytes: ArrayLike | None,
) -> tuple[FloatArray | None, FloatArray | None, FloatArray | None, FloatArray | None]:
    """solve's memory inputs as (p, L) rows (broadcast views for shared rows) and (p,) limits; all None
    without memory_bytes, where a start, end or limit given alone is an error."""
    memory = start = end = limits = None
    if memory_bytes is None:
        for name, given in (
            ("memory_limit_bytes", memory_limit_bytes),
            ("memory_start_bytes", memory_start_bytes),
            ("memory_end_bytes", memory_end_bytes),
        ):
            if given is not None:
                raise StageplanError(
                    f"{name} is given but memory_bytes is None; pass per-layer memory_bytes "
                    f"(shape ({num_layers},) or ({p}, {num_layers})) or drop {name}"
                )
    else:
        memory = validate_rows("memory_bytes", memory_bytes, p, num_layers, "stage", view=True)
        if memory_start_bytes is not None:
            start = validate_rows("memory_start_bytes", memory_start_bytes, p, num_layers, "stage", view=True)
        if memory_end_bytes is not None:
            end = validate_rows("memory_end_bytes", memory_end_bytes, p, num_layers, "stage", view=True)
        if memory_limit_bytes is not None:
            limits = validate_limits(memory_limit_bytes, p, "stage")
    return memory, start, end, limits


def _least_time(inst: Instance, relaxed: Instance | None, first: list[int]) -> tuple[float, list[int]]:
    """The optimal bottleneck and a partition attaining it, searched up from the relaxed optimum when there is
    a relaxation (``first``: the partition of the first, unbounded probe)."""
    time_lo = inst.time_lower
    if relaxed is not None:
        r_first = run_probe(relaxed, INF, INF)
        assert r_first.bounds is not None  # a relaxation of a feasible instance is feasible
        r_time, _ = _minimise(relaxed.time_lower, max_time(relaxed, r_first.bounds), r_first.bounds,
                              lambda t: run_probe(relaxed, t, INF), lambda r: r.next_time,
                              lambda b: max_time(relaxed, b), try_lo_first=True)
        time_lo = max(time_lo, r_time * (1.0 - TIE_REL))
    return _minimise(
        time_lo,
        max_time(inst, first),
        first,
        lambda t: run_probe(inst, t, INF),
        lambda r: r.next_time,
        lambda b: max_time(inst, b),
        try_lo_first=True,
    )


def _least_util(inst: Instance, relaxed: Instance | None, time_cap: float,
                best: list[int]) -> tuple[float, list[int]]:
    """Among partitions within ``time_cap``, the smallest peak memory utilisation and a partition attaining it
    (``best``: one within the cap), searched up from the relaxed optimum when the relaxation has memory."""
    util_lo = inst.util_lower
    if relaxed is not None and relaxed.has_memory:
        r_probe = run_probe(relaxed, time_cap, INF, time_events=False)
        if r_probe.feasible and r_probe.bounds is not None:
            r_util, _ = _minimise(relaxed.util_lower, max_util(relaxed, r_probe.bounds), r_probe.bounds,
                                  lambda u: run_probe(relaxed, time_cap, u, time_events=False),
                                  lambda r: r.next_util, lambda b: max_util(relaxed, b), try_lo_first=False)
            util_lo = max(util_lo, r_util * (1.0 - TIE_REL))
    return _minimise(
        util_lo,
        max_util(inst, best),
        best,
        lambda u: run_probe(inst, time_cap, u, time_events=False),
        lambda r: r.next_util,
        lambda b: max_util(inst, b),
        try_lo_first=relaxed is not None,
    )


def _solution(inst: Instance, bounds: list[int]) -> Solution:
    """The Solution for ``bounds``: its stage times and memory, as the instance evaluates them."""
    stage_costs = tuple(float(x) for x in stage_times(inst, bounds))
    stage_memory = tuple(float(x) for x in stage_mems(inst, bounds)) if inst.has_memory else None
    return Solution(
        boundaries=tuple(int(b) for b in bounds),
        bottleneck=max(stage_costs),
        stage_costs=stage_costs,
        stage_memory=stage_memory,
        lower_bound=inst.time_lower,
    )


def _min_peak_memory(inst: Instance) -> float:
    """min over partitions of max_k memory_k: the same min-max machinery with memory as the cost."""
    free = replace(
        inst,
        cap=np.full(inst.num_stages, INF),
        cap_list=[INF] * inst.num_stages,
        div=np.ones(inst.num_stages),
        div_list=[1.0] * inst.num_stages,
    )
    assert free.mem_prefix is not None
    free = replace(free, util_lower=float(min_layer_rows(free.mem_prefix).max()))
    first = run_probe(free, INF, INF)
    assert first.bounds is not None
    peak, _ = _minimise(
        free.util_lower,
        max_util(free, first.bounds),
        first.bounds,
        lambda u: run_probe(free, INF, u),
        lambda r: r.next_util,
        lambda b: max_util(free, b),
        try_lo_first=True,
    )
    return peak


def _raise_infeasible(inst: Instance, limits: FloatArray) -> NoReturn:
    assert inst.mem_prefix is not None
    L, p = inst.num_layers, inst.num_stages
    needed = _min_peak_memory(inst)
    # what a layer needs wherever it sits: its own row, plus the first layer's start term and the last layer's
    # end term (another layer's start or end terms go with it only where it opens or closes a stage, which it
    # need not: the send buffer of layer 0 had blamed layer 0 where a split with it inside a stage fits)
    single = np.array(np.diff(inst.mem_prefix, axis=1))
    if inst.mem_start is not None:
        single[:, 0] += inst.mem_start[:, 0]
    if inst.mem_end is not None:
        single[:, L - 1] += inst.mem_end[:, L]
    too_big = np.all(single > limits[:, None], axis=0)
    limit_text = format_limits(limits, "stage")
    if too_big.any():
        layer = int(np.argmax(too_big))
        layer_bytes = float(single[:, layer].min())
        message = (
            f"layer {layer} alone needs {format_bytes(layer_bytes)} ({layer_bytes:.0f} bytes) on any stage, "
            f"more than {limit_text}, so no partition of {L} layers into {p} stages fits; the smallest "
            f"limit that admits a plan is {format_bytes(needed)}; raise the limit, or use recomputation / "
            "a schedule with fewer microbatches in flight, or split that layer"
        )
    else:
        message = (
            f"no partition of {L} layers into {p} stages fits {limit_text}; the smallest limit that "
            f"admits a plan is {format_bytes(needed)}; raise the limit, add stages, or use recomputation "
            "/ a schedule with fewer microbatches in flight"
        )
    raise InfeasiblePlanError(message, min_memory_limit_bytes=needed)


def build_instance(
    costs: FloatArray,
    num_stages: int,
    speeds: FloatArray,
    boundary_costs: FloatArray | None,
    memory: FloatArray | None,
    start: FloatArray | None,
    end: FloatArray | None,
    limits: FloatArray | None,
) -> Instance:
    num_layers = costs.size
    p = num_stages
    prefix = np.zeros(num_layers + 1)
    np.cumsum(costs, out=prefix[1:])
    boundary = None
    if boundary_costs is not None and np.any(_distinct_rows(boundary_costs)[:, :-1] > 0):
        # last layer's entry unused
        boundary = _padded(boundary_costs[:, : num_layers - 1], 1, num_layers + 1)
    mem_prefix = mem_start = mem_end = layer_min = None
    cap = np.full(p, INF)
    div = np.ones(p)
    util_lower = 0.0
    if memory is not None:
        mem_prefix = np.zeros((p, num_layers + 1))
        np.cumsum(memory, axis=1, out=mem_prefix[:, 1:])
        if start is not None and np.any(_distinct_rows(start) > 0):
            mem_start = _padded(start, 0, num_layers + 1)
        if end is not None and np.any(_distinct_rows(end) > 0):
            mem_end = _padded(end, 1, num_layers + 1)
        if limits is not None:
            cap = limits.copy()
            div = limits.copy()
        # Every layer sits on some stage, so the best utilisation is at least this (start and end
        # terms only apply to a stage's first and last layer, so they are left out). With one limit
        # for all stages, dividing after the minimum gives the same floats.
        layer_min = min_layer_rows(mem_prefix)
        if np.all(div == div[0]):
            util_lower = float((layer_min / div[0]).max())
        else:
            util_lower = float(min_layer_rows(mem_prefix, div).max())
    monotone = _monotone_in_end(prefix, speeds, boundary, mem_prefix, layer_min, mem_end)
    time_lower = lower_bound(costs, speeds)
    return Instance(
        num_layers=num_layers,
        num_stages=p,
        prefix=prefix,
        prefix_list=prefix.tolist(),
        speeds=speeds,
        speeds_list=speeds.tolist(),
        boundary=boundary,
        mem_prefix=mem_prefix,
        mem_prefix_rows=_float_rows(mem_prefix),
        mem_start=mem_start,
        mem_end=mem_end,
        cap=cap,
        cap_list=cap.tolist(),
        div=div,
        div_list=div.tolist(),
        time_lower=time_lower,
        util_lower=util_lower,
        monotone_in_end=monotone,
        boundary_rows=_float_rows(boundary),
        mem_end_rows=_float_rows(mem_end),
    )


def min_layer_rows(mem_prefix: FloatArray, div: FloatArray | None = None) -> FloatArray:
    """min over stages k of (M[k, j+1] - M[k, j]) / div[k] (the canonical one-layer memory, or its
    utilisation), per layer j. Computed on blocks of 8 rows: a whole (p, L) difference array would
    be a fresh allocation each call, and faulting its pages in costs more than the arithmetic."""
    out: FloatArray | None = None
    for lo in range(0, mem_prefix.shape[0], 8):
        block = np.diff(mem_prefix[lo : lo + 8], axis=1)
        if div is not None:
            block /= div[lo : lo + 8, None]
        low = block.min(axis=0)
        out = low if out is None else np.minimum(out, low, out=out)
    assert out is not None
    return out


def _distinct_rows(rows: FloatArray) -> FloatArray:
    """rows, or its first row alone (as (1, n)) when it is a broadcast view (row stride 0)."""
    return rows[:1] if rows.strides[0] == 0 else rows


def _padded(rows: FloatArray, first: int, width: int) -> FloatArray:
    """(p, width) zeros with rows written from column `first`. A broadcast input gives a broadcast
    (read-only) result: a fresh (64, 1001) float64 array is ~130 page faults (0.5 MB), paid
    again by every probe."""
    p, n = rows.shape
    if rows.strides[0] == 0:
        row = np.zeros(width)
        row[first : first + n] = rows[0]
        return np.broadcast_to(row, (p, width))
    out = np.zeros((p, width))
    out[:, first : first + n] = rows
    return out


def _float_rows(arr: FloatArray | None) -> list[Sequence[float]] | None:
    """The rows of a float64 array (each row contiguous; a broadcast view is fine) as memoryviews:
    indexing one gives a Python float (what bisect and the pure-Python probes need) at about 1.5x the
    cost of a list, while making them takes about 10 us where arr.tolist() takes about 1 ms at
    (64, 1001), a sizeable part of a solve."""
    if arr is None:
        return None
    assert arr.dtype == np.float64 and arr.strides[-1] == arr.itemsize  # each row contiguous
    return [cast("Sequence[float]", memoryview(row)) for row in arr]


def _monotone_in_end(
    prefix: FloatArray,
    speeds: FloatArray,
    boundary: FloatArray | None,
    mem_prefix: FloatArray | None,
    layer_min: FloatArray | None,
    mem_end: FloatArray | None,
) -> bool:
    """Whether time_k(i, j) and mem_k(i, j), as the canonical float expressions evaluate them, never
    fall when the end j grows by one, for every stage k < p-1 and start i < j. Stage k < p-1 ends in
    [k+1, L-(p-1-k)], so only pairs (j, j+1) with 1 <= j <= L-2 are checked (a few more than each
    stage needs); the last stage always ends at L and needs no check.

    Without boundary and end terms this always holds (prefix sums of values >= 0 never fall, and
    IEEE rounding is monotone). With them, pair (j, j+1) is safe when the j-dependent term does not
    fall there, or when layer j's own cost exceeds the fall by a margin that covers rounding:
    fl(M[k, j] - M[k, i]) is within 2**-53 * M[k, L] of the exact difference, fl(fl(P[j] - P[i]) / s)
    within about 2**-52 * P[L] / s, and the check itself is rounded, so 8 eps * (largest operand)
    is ample. A failed check only costs speed: the numpy probes, which need no such property, are
    used instead.
    """
    p = speeds.size
    num_layers = prefix.size - 1
    if p == 1 or num_layers < 3:
        return True
    eps = float(np.finfo(np.float64).eps)
    inner = slice(1, num_layers - 1)  # pairs (j, j+1), j = 1 .. L-2
    if boundary is not None:
        term = _one_row_if_shared(boundary[: p - 1, 1:num_layers])  # B[k, j] for j = 1 .. L-1
        s = speeds[: p - 1]
        # the fastest stage's layer time is the smallest: one row serves every stage
        own = np.diff(prefix)[inner] / s.max()
        margin = 8 * eps * (prefix[-1] / s.min() + float(term.max()))
        if not _rises_enough(term, own, margin):
            return False
    if mem_end is not None:
        assert mem_prefix is not None and layer_min is not None
        term = _one_row_if_shared(mem_end[: p - 1, 1:num_layers])
        margin = 8 * eps * (float(mem_prefix[: p - 1, -1].max()) + float(term.max()))
        # a term shared by all stages is checked once, against the smallest one-layer memory
        own = layer_min[inner] if term.ndim == 1 else np.diff(mem_prefix[: p - 1], axis=1)[:, inner]
        if not _rises_enough(term, own, margin):
            return False
    return True


def _one_row_if_shared(rows: FloatArray) -> FloatArray:
    """rows[0] when every row equals it (an (L,) input, broadcast or copied), else rows."""
    return rows[0] if rows.strides[0] == 0 or bool(np.all(rows == rows[0])) else rows


def _rises_enough(term: FloatArray, own: FloatArray, margin: float) -> bool:
    """term: the j-dependent term at ends j = 1 .. n+1, (n+1,) or one row per stage; own: the cost
    of layer j, (n,) (a lower bound for every stage) or one row per stage. True when at every pair
    (j, j+1) the term rises, or own + (its fall) >= margin."""
    fall = np.diff(term, axis=-1)
    return bool(np.all((fall >= 0) | (own + fall >= margin)))
