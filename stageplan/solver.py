"""Exact min-max partitioning of per-layer costs into contiguous pipeline stages, under memory limits.

numpy only: ``import stageplan.solver`` loads no scipy (the interleaved MILP lives in ``interleaved.py``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NoReturn, cast

import numpy as np
from numpy.typing import ArrayLike, NDArray

from stageplan.errors import InfeasiblePlanError, StageplanError
from stageplan.units import format_bytes, format_limits

__all__ = ["Solution", "lower_bound", "solve"]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]

# Two bottlenecks (or two memory utilisations) within this relative distance count as equal: the
# tie-breaking rules below then decide. Bisection also stops once its bracket is this narrow.
_TIE_REL = 1e-12
_INF = math.inf


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
# Input validation (errors state the rule, the values and the remedy)
# --------------------------------------------------------------------------------------------------


def _shape_text(shape: tuple[int, ...]) -> str:
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


def _validate_costs(costs: ArrayLike) -> FloatArray:
    arr = _as_float_array("costs", costs)
    if arr.ndim != 1:
        raise StageplanError(
            f"costs must be one-dimensional (one time per layer), got shape {_shape_text(arr.shape)}; "
            "pass a flat sequence of per-layer times"
        )
    if arr.size == 0:
        raise StageplanError("costs is empty; profile at least one layer before planning")
    _check_finite_nonneg("costs", arr, "seconds", "re-profile that layer")
    return arr


def _validate_count(name: str, value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise StageplanError(f"{name} must be an integer, got {value!r}; pass a whole number of {what}")
    count = int(value)
    if count < 1:
        raise StageplanError(f"{name} ({count}) must be at least 1; pass a positive number of {what}")
    return count


def _validate_speeds(name: str, speeds: ArrayLike | None, count: int, what: str) -> FloatArray:
    if speeds is None:
        return np.ones(count)
    arr = _as_float_array(name, speeds)
    if arr.shape != (count,):
        raise StageplanError(
            f"{name} has shape {_shape_text(arr.shape)}; expected {_shape_text((count,))} "
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


def _validate_rows(
    name: str, value: ArrayLike, rows: int, num_layers: int, row_what: str, *, view: bool = False
) -> FloatArray:
    """Accept shape (L,) (same for every row) or (rows, L); return (rows, L), finite and >= 0.

    With view=True an (L,) input comes back as a read-only broadcast view (row stride 0), not a copy.
    """
    arr = _as_float_array(name, value)
    if arr.shape not in ((num_layers,), (rows, num_layers)):
        raise StageplanError(
            f"{name} has shape {_shape_text(arr.shape)}; expected {_shape_text((num_layers,))} "
            f"(one value per layer) or {_shape_text((rows, num_layers))} (one row per {row_what})"
        )
    unit = "seconds" if name == "boundary_costs" else "bytes"
    _check_finite_nonneg(name, arr, unit, "check the cost model that produced it")
    if view and arr.ndim == 1:
        return np.broadcast_to(arr, (rows, num_layers))
    return np.ascontiguousarray(np.broadcast_to(arr, (rows, num_layers)), dtype=np.float64)


def _validate_limits(limits: ArrayLike, count: int, what: str) -> FloatArray:
    arr = _as_float_array("memory_limit_bytes", limits)
    scalar = arr.ndim == 0
    if scalar:
        arr = np.full(count, float(arr))
    elif arr.shape != (count,):
        raise StageplanError(
            f"memory_limit_bytes has shape {_shape_text(arr.shape)}; expected a scalar or "
            f"{_shape_text((count,))} (one limit per {what})"
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
# The normalised problem
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Instance:
    """Validated arrays in the layout the algorithms use; positions run over 0..L (boundaries).

    Canonical float expressions (used by every code path, so that feasibility never depends on
    which path evaluated it):
      time_k(i, j) = (P[j] - P[i]) / speed_k + boundary[k, j]
      mem_k(i, j)  = ((M[k, j] - M[k, i]) + start[k, i]) + end[k, j]
    A stage is acceptable under thresholds (T, U) when time <= T, mem <= cap_k and
    mem / div_k <= U (U is the memory utilisation; div_k is the limit, or 1 without limits).
    Terms that are all zero are stored as None (adding 0.0 changes no float).
    """

    num_layers: int
    num_stages: int
    prefix: FloatArray  # (L+1,) prefix sums of costs
    prefix_list: list[float]
    speeds: FloatArray  # (p,)
    speeds_list: list[float]
    # boundary, mem_start and mem_end are read-only broadcast views when given as one (L,) row
    boundary: FloatArray | None  # (p, L+1): boundary[k, j] charged to stage k ending at j < L
    mem_prefix: FloatArray | None  # (p, L+1) prefix sums of memory_bytes rows
    mem_prefix_rows: list[Sequence[float]] | None  # its rows as _float_rows gives them
    mem_start: FloatArray | None  # (p, L+1): start[k, i] = memory_start_bytes[k, i]
    mem_end: FloatArray | None  # (p, L+1): end[k, j] = memory_end_bytes[k, j-1]
    cap: FloatArray  # (p,) hard limits (inf when none)
    cap_list: list[float]
    div: FloatArray  # (p,) utilisation divisors
    div_list: list[float]
    time_lower: float
    util_lower: float
    # True when every stage but the last, whose end is fixed at L, gets no cheaper as its end j grows
    # (certified with a rounding margin by _monotone_in_end); the greedy probes rely on it
    monotone_in_end: bool
    boundary_rows: list[Sequence[float]] | None  # rows of boundary (_float_rows)
    mem_end_rows: list[Sequence[float]] | None  # rows of mem_end (_float_rows)

    @property
    def has_memory(self) -> bool:
        return self.mem_prefix is not None


def _build_instance(
    costs: FloatArray,
    num_stages: int,
    speeds: FloatArray,
    boundary_costs: FloatArray | None,
    memory: FloatArray | None,
    start: FloatArray | None,
    end: FloatArray | None,
    limits: FloatArray | None,
) -> _Instance:
    num_layers = costs.size
    p = num_stages
    prefix = np.zeros(num_layers + 1)
    np.cumsum(costs, out=prefix[1:])
    boundary = None
    if boundary_costs is not None and np.any(_distinct_rows(boundary_costs)[:, :-1] > 0):
        boundary = _padded(boundary_costs[:, : num_layers - 1], 1, num_layers + 1)  # last layer's entry unused
    mem_prefix = mem_start = mem_end = layer_min = None
    cap = np.full(p, _INF)
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
        layer_min = _layer_min(mem_prefix)
        if np.all(div == div[0]):
            util_lower = float((layer_min / div[0]).max())
        else:
            util_lower = float(_layer_min(mem_prefix, div).max())
    monotone = _monotone_in_end(prefix, speeds, boundary, mem_prefix, layer_min, mem_end)
    time_lower = lower_bound(costs, speeds)
    return _Instance(
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


def _layer_min(mem_prefix: FloatArray, div: FloatArray | None = None) -> FloatArray:
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
    (read-only) result: a fresh (64, 1001) array is ~130 page faults, ~0.3 ms here, three probes."""
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


def _times(inst: _Instance, k: int, i: IntArray | int, j: IntArray | int) -> FloatArray:
    t = (inst.prefix[j] - inst.prefix[i]) / inst.speeds_list[k]
    if inst.boundary is not None:
        t = t + inst.boundary[k, j]
    return np.asarray(t)


def _mems(inst: _Instance, k: int, i: IntArray | int, j: IntArray | int) -> FloatArray:
    assert inst.mem_prefix is not None
    row = inst.mem_prefix[k]
    m = row[j] - row[i]
    if inst.mem_start is not None:
        m = m + inst.mem_start[k, i]
    if inst.mem_end is not None:
        m = m + inst.mem_end[k, j]
    return np.asarray(m)


def _mem_ok(inst: _Instance, k: int, m: FloatArray, util: float) -> BoolArray:
    return (m <= inst.cap_list[k]) & (m / inst.div_list[k] <= util)


def _stage_times(inst: _Instance, bounds: list[int]) -> FloatArray:
    b = np.asarray(bounds)
    t = (inst.prefix[b[1:]] - inst.prefix[b[:-1]]) / inst.speeds
    if inst.boundary is not None:
        t = t + inst.boundary[np.arange(inst.num_stages), b[1:]]
    return np.asarray(t)


def _stage_mems(inst: _Instance, bounds: list[int]) -> FloatArray:
    assert inst.mem_prefix is not None
    b = np.asarray(bounds)
    ks = np.arange(inst.num_stages)
    m = inst.mem_prefix[ks, b[1:]] - inst.mem_prefix[ks, b[:-1]]
    if inst.mem_start is not None:
        m = m + inst.mem_start[ks, b[:-1]]
    if inst.mem_end is not None:
        m = m + inst.mem_end[ks, b[1:]]
    return np.asarray(m)


def _max_time(inst: _Instance, bounds: list[int]) -> float:
    return float(_stage_times(inst, bounds).max())


def _max_util(inst: _Instance, bounds: list[int]) -> float:
    return float((_stage_mems(inst, bounds) / inst.div).max())


# --------------------------------------------------------------------------------------------------
# Feasibility probes: is there a partition with every stage acceptable under (T, U)?
#
# Reachable sets: R_0 = {0}, R_{k+1} = {j : some i in R_k, i < j, stage k over [i, j) acceptable};
# feasible iff L is in R_p. Stage k can only end in [k+1, L-(p-1-k)] (the others need a layer each).
# Besides the answer, a probe returns the "next event": the smallest threshold above T (or U) at
# which any reachable set would grow. Below it nothing changes, so it is a valid new lower bound
# and the bisection jumps straight to the next candidate value (Pinar & Aykanat 2004, "exact
# bisection", use the same idea for the plain chains-on-chains problem).
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Probe:
    feasible: bool
    bounds: list[int] | None
    next_time: float
    next_util: float


def _fast_applies(inst: _Instance, time_cap: float, util_cap: float) -> bool:
    """Whether the greedy probes and _lex_fast apply: no start terms, and stages monotone in their end.

    (The thresholds do not matter: a probe the greedy cannot settle falls back by itself.)
    """
    return inst.mem_start is None and inst.monotone_in_end


def _probe_fast(inst: _Instance, time_cap: float, util_cap: float) -> _Probe | None:
    """O(p log L) greedy furthest end, or None when it cannot settle the probe (then the caller uses
    the numpy probe).

    Without start terms a stage only gets cheaper as its start i grows, so e_k(i), the furthest end
    stage k reaches from i (i itself when it cannot take one layer), never falls as i grows. Hence
    max R_{k+1} = e_k(max R_k) whenever that exceeds max R_k, and since L is in R_p iff
    max R_p = L, following b_{k+1} = e_k(b_k) decides the probe: holes inside the R_k (single
    layers that do not fit some stage) do not matter. When e_k(b_k) = b_k for k < p-1 the maximum
    comes from an earlier start: not settled here. The last stage only has to reach L from b_{p-1}.

    With monotone_in_end the acceptable ends from b form a run (b, e_k(b)]. Its end is estimated by
    bisection on the prefix sums, ignoring boundary and end terms (both >= 0, so the estimate errs
    high, up to rounding), then settled with the canonical expressions: steps up while the next end
    is acceptable, a galloping search down when the estimate is not.

    Next events: below the next threshold at which some stage reaches b_{k+1} + 1 from b_k (L for
    the last stage), no b_k moves, so the answer cannot change (monotone in j: nothing further
    becomes acceptable first).
    """
    P = inst.prefix_list
    L, p = inst.num_layers, inst.num_stages
    rows, ends, bnds = inst.mem_prefix_rows, inst.mem_end_rows, inst.boundary_rows
    b = 0
    bounds = [0]
    next_time = next_util = _INF
    for k in range(p):
        s, cap, d = inst.speeds_list[k], inst.cap_list[k], inst.div_list[k]
        row = None if rows is None else rows[k]
        erow = None if ends is None else ends[k]
        brow = None if bnds is None else bnds[k]
        pb = P[b]
        mb = 0.0 if row is None else row[b]

        def cost(j: int) -> tuple[float, float]:
            """Canonical (time, memory) of stage k over [b, j); memory 0.0 when none is given
            (it then passes any cap and utilisation)."""
            t = (P[j] - pb) / s  # noqa: B023 (called within this iteration only)
            if brow is not None:  # noqa: B023
                t = t + brow[j]  # noqa: B023
            if row is None:  # noqa: B023
                return t, 0.0
            m = row[j] - mb  # noqa: B023
            if erow is not None:  # noqa: B023
                m = m + erow[j]  # noqa: B023
            return t, m

        jmax = L - (p - 1 - k)
        if k == p - 1:
            t1, m1 = cost(L)
            j = L if t1 <= time_cap and m1 <= cap and m1 / d <= util_cap else b
            next_known = True
        else:
            j = bisect.bisect_right(P, pb + time_cap * s, b + 1, jmax + 1) - 1
            if row is not None:
                j = min(j, bisect.bisect_right(row, mb + min(cap, util_cap * d), b + 1, jmax + 1) - 1)
            next_known = False  # (t1, m1) = cost(j + 1)
            while j < jmax:
                t1, m1 = cost(j + 1)
                if not (t1 <= time_cap and m1 <= cap and m1 / d <= util_cap):
                    next_known = True
                    break
                j += 1
            if j > b:
                t, m = cost(j)
                if not (t <= time_cap and m <= cap and m / d <= util_cap):
                    # the estimate is too high: gallop down from it, then bisect (good fits or is b)
                    good, bad, step = b, j, 1
                    while bad - step > b:
                        t, m = cost(bad - step)
                        if t <= time_cap and m <= cap and m / d <= util_cap:
                            good = bad - step
                            break
                        bad -= step
                        step *= 2
                    while bad - good > 1:
                        mid = (good + bad) // 2
                        t, m = cost(mid)
                        if t <= time_cap and m <= cap and m / d <= util_cap:
                            good = mid
                        else:
                            bad = mid
                    j = good
                    next_known = False
            if j == b:
                return None
        if j < jmax:
            if not next_known:
                t1, m1 = cost(j + 1)
            if m1 <= cap:
                u1 = m1 / d
                if u1 <= util_cap:
                    next_time = min(next_time, t1)
                if t1 <= time_cap and row is not None:
                    next_util = min(next_util, u1)
        b = j
        bounds.append(b)
    feasible = b == L
    return _Probe(feasible, bounds if feasible else None, next_time, next_util)


def _probe_monotone(inst: _Instance, time_cap: float, util_cap: float) -> _Probe:
    """O(pL) numpy: without start terms the best predecessor of j is the largest i in R_k below j."""
    L, p = inst.num_layers, inst.num_stages
    reach = np.zeros(L + 1, dtype=bool)
    reach[0] = True
    preds: list[tuple[int, IntArray]] = []
    next_time = next_util = _INF
    for k in range(p):
        jlo, jhi = k + 1, L - (p - 1 - k)
        seg = reach[jlo - 1 : jhi]  # candidate starts i = jlo-1 .. jhi-1
        first = int(np.argmax(seg))
        if not seg[first]:
            return _Probe(False, None, next_time, next_util)
        # for j = jlo+first+t: largest reachable i <= j-1
        ip = np.maximum.accumulate(np.where(seg[first:], np.arange(jlo - 1 + first, jhi), -1))
        js = np.arange(jlo + first, jhi + 1)
        t = _times(inst, k, ip, js)
        ok = t <= time_cap
        if inst.has_memory:
            m = _mems(inst, k, ip, js)
            u = m / inst.div_list[k]
            fits = m <= inst.cap_list[k]
            mem_ok = fits & (u <= util_cap)
            blocked = ~ok & mem_ok
            if blocked.any():
                next_time = min(next_time, float(t[blocked].min()))
            blocked_u = ok & fits & ~mem_ok
            if blocked_u.any():
                next_util = min(next_util, float(u[blocked_u].min()))
            ok &= mem_ok
        elif not ok.all():
            next_time = min(next_time, float(t[~ok].min()))
        reach = np.zeros(L + 1, dtype=bool)
        reach[js[ok]] = True
        preds.append((jlo + first, ip))
    if not reach[L]:
        return _Probe(False, None, next_time, next_util)
    bounds = [L]
    for offset, ip in reversed(preds):
        bounds.append(int(ip[bounds[-1] - offset]))
    bounds.reverse()
    return _Probe(True, bounds, next_time, next_util)


def _time_lo(inst: _Instance, k: int, time_cap: float, js: IntArray) -> IntArray:
    """For each end j: the smallest start i <= j with time_k(i, j) <= T (j itself when none).

    time_k(i, j) does not increase with i, so the answer is a threshold; searchsorted gives it up
    to rounding and the canonical expression settles it.
    """
    P = inst.prefix
    if js.size == 0:
        return js.copy()
    slack = time_cap - (inst.boundary[k, js] if inst.boundary is not None else 0.0)
    with np.errstate(invalid="ignore"):
        thr = P[js] - slack * inst.speeds_list[k]
    i = np.minimum(np.searchsorted(P, thr, side="left"), js).astype(np.int64)

    def ok(ii: IntArray) -> BoolArray:
        return (ii < js) & (_times(inst, k, ii, js) <= time_cap)

    for _ in range(3):
        down = (i > 0) & ok(np.maximum(i - 1, 0))
        up = (i < js) & ~ok(i)
        if not down.any() and not up.any():
            return i
        i = i - down + up
    # rare: fall back to an exact vectorised binary search over [0, j]
    lo = np.zeros_like(js)
    hi = js.copy()
    while True:
        active = lo < hi
        if not active.any():
            return lo
        mid = (lo + hi) // 2
        good = ok(mid)
        hi = np.where(active & good, mid, hi)
        lo = np.where(active & ~good, mid + 1, lo)


def _argmin_table(vals: FloatArray) -> IntArray:
    """Sparse table: row t holds, at x, the index of the minimum of vals[x : x + 2**t]."""
    n = vals.size
    levels = max(1, n.bit_length())
    table = np.empty((levels, n), dtype=np.int64)
    table[0] = np.arange(n)
    for t in range(1, levels):
        half, span = 1 << (t - 1), 1 << t
        cnt = n - span + 1
        a = table[t - 1, :cnt]
        b = table[t - 1, half : half + cnt]
        table[t, :cnt] = np.where(vals[b] < vals[a], b, a)
        table[t, cnt:] = table[t - 1, cnt:]  # padding, never read
    return table


def _range_argmin(table: IntArray, vals: FloatArray, lo: IntArray, hi: IntArray) -> IntArray:
    """Index of the minimum of vals over each inclusive range [lo, hi] (two overlapping blocks)."""
    lvl = np.frexp((hi - lo + 1).astype(np.float64))[1].astype(np.int64) - 1
    a = table[lvl, lo]
    b = table[lvl, hi - (np.int64(1) << lvl) + 1]
    return np.where(vals[b] < vals[a], b, a)


def _last_at_most(table: IntArray, vals: FloatArray, hi: IntArray, thr: FloatArray) -> IntArray:
    """Largest index x <= hi with vals[x] <= thr (-1 if none): skip power-of-two blocks, largest
    first, whose minimum exceeds thr (the skipped run has length < 2**levels, so each size is
    needed at most once)."""
    mins = vals[table]
    pos = hi.copy()
    for t in range(table.shape[0] - 1, -1, -1):
        span = 1 << t
        start = pos - (span - 1)
        skip = (start >= 0) & (mins[t, np.maximum(start, 0)] > thr)
        pos -= skip * span
    good = pos >= 0
    good &= vals[np.maximum(pos, 0)] <= thr
    return np.where(good, pos, -1)


def _probe_general(inst: _Instance, time_cap: float, util_cap: float, time_events: bool) -> _Probe:
    """O(pL log L): with start terms, j needs the reachable i in its time window [lo(j), j) that
    minimises start[i] - M[i] (a range-minimum query on a sparse table).

    Next event for the time: an unreached j becomes reachable first from the largest reachable i
    whose memory fits (time falls as i grows), found by binary lifting on the same table.
    """
    assert inst.mem_prefix is not None and inst.mem_start is not None
    L, p = inst.num_layers, inst.num_stages
    reach = np.zeros(L + 1, dtype=bool)
    reach[0] = True
    preds: list[IntArray] = []
    next_time = next_util = _INF
    exact_next_time = True
    for k in range(p):
        jlo, jhi = k + 1, L - (p - 1 - k)
        seg = reach[jlo - 1 : jhi]
        first = int(np.argmax(seg))
        if not seg[first]:
            break
        base = jlo - 1 + first  # smallest reachable start
        starts = np.arange(base, jhi)
        g = np.where(seg[first:], inst.mem_start[k, starts] - inst.mem_prefix[k, starts], _INF)
        table = _argmin_table(g)
        all_js = np.arange(base + 1, jhi + 1)
        lo = np.maximum(_time_lo(inst, k, time_cap, all_js), base)
        nonempty = lo < all_js
        js, lo = all_js[nonempty], lo[nonempty]
        pred = np.full(L + 1, -1, dtype=np.int64)
        if js.size:
            best = _range_argmin(table, g, lo - base, js - 1 - base)
            valid = np.isfinite(g[best])
            js, ib = js[valid], best[valid] + base
            m = _mems(inst, k, ib, js)
            u = m / inst.div_list[k]
            fits = m <= inst.cap_list[k]
            ok = fits & (u <= util_cap)
            if (fits & ~ok).any():
                next_util = min(next_util, float(u[fits & ~ok].min()))
            pred[js[ok]] = ib[ok]
        # next event for the time (only needed while bisecting on it)
        if time_events and math.isfinite(time_cap) and exact_next_time:
            open_js = all_js[pred[all_js] < 0]
            if open_js.size:
                room = min(inst.cap_list[k], util_cap * inst.div_list[k])
                thr = room - inst.mem_prefix[k, open_js]
                if inst.mem_end is not None:
                    thr = thr - inst.mem_end[k, open_js]
                cand = _last_at_most(table, g, open_js - 1 - base, thr)
                has = cand >= 0
                ci, cj = cand[has] + base, open_js[has]
                if ci.size:
                    t = _times(inst, k, ci, cj)
                    mem_fine = _mem_ok(inst, k, _mems(inst, k, ci, cj), util_cap)
                    if not np.all(mem_fine & (t > time_cap)):
                        exact_next_time = False  # rounding disagreement: do not jump
                    else:
                        next_time = min(next_time, float(t.min()))
        reach = pred >= 0
        preds.append(pred)
    if not exact_next_time:
        next_time = time_cap
    if len(preds) < p or not reach[L]:
        return _Probe(False, None, next_time, next_util)
    bounds = [L]
    for pred in reversed(preds):
        bounds.append(int(pred[bounds[-1]]))
    bounds.reverse()
    return _Probe(True, bounds, next_time, next_util)


def _probe(inst: _Instance, time_cap: float, util_cap: float, *, time_events: bool = True) -> _Probe:
    """Feasibility under (T, U) by the cheapest exact method; time_events=False skips the (costly
    on the start-term path) next event for T when the caller bisects on U."""
    if _fast_applies(inst, time_cap, util_cap):
        result = _probe_fast(inst, time_cap, util_cap)
        if result is not None:
            return result
    if inst.mem_start is None:
        return _probe_monotone(inst, time_cap, util_cap)
    return _probe_general(inst, time_cap, util_cap, time_events)


# --------------------------------------------------------------------------------------------------
# Lexicographically smallest feasible partition under fixed thresholds
#
# Backward sets Q_k = {i : layers [i, L) split into stages k..p-1 acceptably}; then b_0 = 0 and
# b_{k+1} = the smallest j in Q_{k+1} with stage k over [b_k, j) acceptable.
# --------------------------------------------------------------------------------------------------


def _lex_fast(inst: _Instance, time_cap: float, util_cap: float) -> list[int] | None:
    """O(p log L) without start terms, with monotone_in_end; None when not settled here (the caller
    then uses _lex_general).

    s_k(j), the smallest start from which stage k can end at j (j itself when none), never falls as
    j grows (a stage gets cheaper as its start grows and as its end shrinks), so min Q_k =
    s_k(min Q_{k+1}) whenever that is below min Q_{k+1}: a_p = L, a_k = s_k(a_{k+1}). Then
    (a_0, ..., a_p) is a partition when a_0 = 0, and the lexicographically smallest one: b_1 >= a_1
    for any partition, and so on. For a fixed end j the thresholds on P[i] and M[k, i] are explicit;
    bisection gives them up to rounding and the canonical expressions settle them.
    """
    P = inst.prefix_list
    L, p = inst.num_layers, inst.num_stages
    rows, ends, bnds = inst.mem_prefix_rows, inst.mem_end_rows, inst.boundary_rows
    a = [0] * (p + 1)
    a[p] = L
    for k in range(p - 1, -1, -1):
        j = a[k + 1]
        s, cap, d = inst.speeds_list[k], inst.cap_list[k], inst.div_list[k]
        row = None if rows is None else rows[k]
        erow = None if ends is None else ends[k]
        brow = None if bnds is None else bnds[k]
        pj = P[j]
        tj = 0.0 if brow is None else brow[j]
        mj = 0.0 if row is None else row[j]
        ej = 0.0 if erow is None else erow[j]

        def fits(i: int) -> bool:
            """Stage k over [i, j) under (T, U), by the canonical expressions."""
            t = (pj - P[i]) / s  # noqa: B023 (called within this iteration only)
            if brow is not None:  # noqa: B023
                t = t + tj  # noqa: B023
            if row is None:  # noqa: B023
                return t <= time_cap
            m = mj - row[i]  # noqa: B023
            if erow is not None:  # noqa: B023
                m = m + ej  # noqa: B023
            return t <= time_cap and m <= cap and m / d <= util_cap  # noqa: B023

        i = bisect.bisect_left(P, pj - (time_cap - tj) * s, k, j - 1)
        if row is not None:
            i = max(i, bisect.bisect_left(row, (mj + ej) - min(cap, util_cap * d), k, j - 1))
        while i > k and fits(i - 1):
            i -= 1
        while i < j and not fits(i):
            i += 1
        if i == j:
            return None
        a[k] = i
    return a if a[0] == 0 else None


def _stab_argmin(n: int, lo: IntArray, hi: IntArray, w: FloatArray) -> IntArray:
    """For each point x in [0, n): the interval r with lo[r] <= x <= hi[r] of smallest w[r] (-1: none).

    Each interval is written on the two power-of-two blocks that cover it (as a sparse table
    query would read them), then blocks are pushed down level by level. O((n + m) log n).
    """
    out = np.full(n, -1, dtype=np.int64)
    m = lo.size
    if m == 0:
        return out
    lvl = np.frexp((hi - lo + 1).astype(np.float64))[1].astype(np.int64) - 1
    levels = int(lvl.max()) + 1
    table = np.full((levels, n), -1, dtype=np.int64)
    pos = np.concatenate([lo, hi - (np.int64(1) << lvl) + 1])
    lv = np.concatenate([lvl, lvl])
    rid = np.concatenate([np.arange(m), np.arange(m)])
    order = np.lexsort((w[rid], pos, lv))
    key = lv[order] * n + pos[order]
    head = np.ones(order.size, dtype=bool)
    head[1:] = key[1:] != key[:-1]
    sel = order[head]
    table[lv[sel], pos[sel]] = rid[sel]
    wext = np.append(w, _INF)  # index -1 reads +inf
    for t in range(levels - 1, 0, -1):
        xs = np.flatnonzero(table[t] >= 0)
        if xs.size == 0:
            continue
        cand = table[t, xs]
        for target in (xs, xs + (1 << (t - 1))):
            cur = table[t - 1, target]
            better = wext[cand] < wext[cur]
            table[t - 1, target[better]] = cand[better]
    return table[0]


def _acceptable(inst: _Instance, k: int, i: IntArray | int, j: IntArray, time_cap: float, util_cap: float) -> BoolArray:
    ok = _times(inst, k, i, j) <= time_cap
    if inst.has_memory:
        ok &= _mem_ok(inst, k, _mems(inst, k, i, j), util_cap)
    return np.asarray(ok)


def _lex_general(inst: _Instance, time_cap: float, util_cap: float) -> list[int] | None:
    """Backward sets with boundary, start and end terms: for a fixed end j the acceptable starts by
    time form [lo(j), j); among the ends whose window holds i, memory is least for the smallest
    M[j] + end[j] (a stabbing query), which is then checked with the canonical expression."""
    L, p = inst.num_layers, inst.num_stages
    q_sets: list[BoolArray] = [np.zeros(0, dtype=bool)] * (p + 1)
    q = np.zeros(L + 1, dtype=bool)
    q[L] = True
    q_sets[p] = q
    for k in range(p - 1, -1, -1):
        jlo, jhi = k + 1, L - (p - 1 - k)
        js = np.flatnonzero(q_sets[k + 1][jlo : jhi + 1]).astype(np.int64) + jlo
        lo = np.maximum(_time_lo(inst, k, time_cap, js), k)
        keep = lo < js
        js, lo = js[keep], lo[keep]
        if inst.has_memory:
            assert inst.mem_prefix is not None
            w = inst.mem_prefix[k, js]
            if inst.mem_end is not None:
                w = w + inst.mem_end[k, js]
        else:
            w = np.zeros(js.size)
        witness = _stab_argmin(L + 1, lo, js - 1, w)
        starts = np.flatnonzero(witness >= 0).astype(np.int64)
        q = np.zeros(L + 1, dtype=bool)
        if starts.size:
            ends = js[witness[starts]]
            q[starts[_acceptable(inst, k, starts, ends, time_cap, util_cap)]] = True
        q_sets[k] = q
    if not q_sets[0][0]:
        return None
    bounds = [0]
    for k in range(p):
        b = bounds[-1]
        jhi = L - (p - 1 - k)
        js = np.flatnonzero(q_sets[k + 1][b + 1 : jhi + 1]).astype(np.int64) + b + 1
        ok = _acceptable(inst, k, b, js, time_cap, util_cap)
        if not ok.any():
            return None
        bounds.append(int(js[int(np.argmax(ok))]))
    return bounds


def _lex_smallest(inst: _Instance, time_cap: float, util_cap: float) -> list[int] | None:
    if _fast_applies(inst, time_cap, util_cap):
        bounds = _lex_fast(inst, time_cap, util_cap)
        if bounds is not None:
            return bounds
    return _lex_general(inst, time_cap, util_cap)


# --------------------------------------------------------------------------------------------------
# Bisection on a real threshold with snapping
# --------------------------------------------------------------------------------------------------


def _minimise(
    lo: float,
    hi: float,
    best: list[int],
    probe: Callable[[float], _Probe],
    next_of: Callable[[_Probe], float],
    value: Callable[[list[int]], float],
    try_lo_first: bool,
) -> tuple[float, list[int]]:
    """Smallest threshold admitting a partition, to within _TIE_REL; hi must be admissible (by best).

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
    while hi > lo and hi - lo > _TIE_REL * hi:
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
    O(pL) numpy otherwise; with start terms it costs O(pL log L). Ties are broken deterministically: among partitions whose
    bottleneck is within 1e-12 (relative) of the optimum, the one with the smallest maximum memory
    utilisation ``max_k memory_k / limit_k`` (``max_k memory_k`` without limits; again within 1e-12
    relative) wins, then the lexicographically smallest ``boundaries``.

    Raises ``StageplanError`` on invalid input and ``InfeasiblePlanError`` (with
    ``min_memory_limit_bytes``, the smallest uniform limit that admits a plan) when no partition
    fits the limits.

    >>> solve([1, 2, 3, 4, 5, 6], 2).boundaries
    (0, 4, 6)
    >>> solve([1, 2, 3, 4, 5, 6], 2).stage_costs
    (10.0, 11.0)
    """
    c = _validate_costs(costs)
    num_layers = c.size
    p = _validate_count("num_stages", num_stages, "pipeline stages")
    if p > num_layers:
        raise StageplanError(
            f"num_stages ({p}) exceeds the number of layers ({num_layers}); "
            "use fewer stages or profile at a finer granularity"
        )
    speeds = _validate_speeds("stage_speeds", stage_speeds, p, "stage")
    bcosts = None if boundary_costs is None else _validate_rows("boundary_costs", boundary_costs, p, num_layers, "stage", view=True)
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
        memory = _validate_rows("memory_bytes", memory_bytes, p, num_layers, "stage", view=True)
        if memory_start_bytes is not None:
            start = _validate_rows("memory_start_bytes", memory_start_bytes, p, num_layers, "stage", view=True)
        if memory_end_bytes is not None:
            end = _validate_rows("memory_end_bytes", memory_end_bytes, p, num_layers, "stage", view=True)
        if memory_limit_bytes is not None:
            limits = _validate_limits(memory_limit_bytes, p, "stage")
    inst = _build_instance(c, p, speeds, bcosts, memory, start, end, limits)

    first = _probe(inst, _INF, _INF)
    if not first.feasible:
        assert limits is not None
        _raise_infeasible(inst, limits)
    assert first.bounds is not None

    # Boundary and end terms force the O(pL) probes when a stage can get cheaper as its end grows (see
    # _monotone_in_end). Dropping them relaxes the problem (every term is >= 0), and the relaxed optimum,
    # found with the fast probes, is a lower bound that is usually attained: starting the exact search
    # there (probed first) typically leaves one or two O(pL) probes instead of ~20.
    relaxed: _Instance | None = None
    if start is None and (bcosts is not None or end is not None) and not _fast_applies(inst, _INF, _INF):
        relaxed = _build_instance(c, p, speeds, None, memory, None, None, limits)
    time_lo = inst.time_lower
    if relaxed is not None:
        r_first = _probe(relaxed, _INF, _INF)
        assert r_first.bounds is not None  # a relaxation of a feasible instance is feasible
        r_time, _ = _minimise(relaxed.time_lower, _max_time(relaxed, r_first.bounds), r_first.bounds,
                              lambda t: _probe(relaxed, t, _INF), lambda r: r.next_time,
                              lambda b: _max_time(relaxed, b), try_lo_first=True)
        time_lo = max(time_lo, r_time * (1.0 - _TIE_REL))

    # 1. the optimal bottleneck
    best_time, best = _minimise(
        time_lo,
        _max_time(inst, first.bounds),
        first.bounds,
        lambda t: _probe(inst, t, _INF),
        lambda r: r.next_time,
        lambda b: _max_time(inst, b),
        try_lo_first=True,
    )
    time_cap = best_time + _TIE_REL * best_time
    util_cap = _INF
    # 2. among (near-)optimal partitions, the smallest peak memory utilisation
    if inst.has_memory:
        util_lo = inst.util_lower
        if relaxed is not None and relaxed.has_memory:
            r_probe = _probe(relaxed, time_cap, _INF, time_events=False)
            if r_probe.feasible and r_probe.bounds is not None:
                r_util, _ = _minimise(relaxed.util_lower, _max_util(relaxed, r_probe.bounds), r_probe.bounds,
                                      lambda u: _probe(relaxed, time_cap, u, time_events=False),
                                      lambda r: r.next_util, lambda b: _max_util(relaxed, b), try_lo_first=False)
                util_lo = max(util_lo, r_util * (1.0 - _TIE_REL))
        best_util, best = _minimise(
            util_lo,
            _max_util(inst, best),
            best,
            lambda u: _probe(inst, time_cap, u, time_events=False),
            lambda r: r.next_util,
            lambda b: _max_util(inst, b),
            try_lo_first=relaxed is not None,
        )
        util_cap = best_util + _TIE_REL * best_util
    # 3. among those, the lexicographically smallest boundaries
    bounds = _lex_smallest(inst, time_cap, util_cap) or best

    stage_costs = tuple(float(x) for x in _stage_times(inst, bounds))
    stage_memory = tuple(float(x) for x in _stage_mems(inst, bounds)) if inst.has_memory else None
    return Solution(
        boundaries=tuple(int(b) for b in bounds),
        bottleneck=max(stage_costs),
        stage_costs=stage_costs,
        stage_memory=stage_memory,
        lower_bound=inst.time_lower,
    )


def _min_peak_memory(inst: _Instance) -> float:
    """min over partitions of max_k memory_k: the same min-max machinery with memory as the cost."""
    free = replace(
        inst,
        cap=np.full(inst.num_stages, _INF),
        cap_list=[_INF] * inst.num_stages,
        div=np.ones(inst.num_stages),
        div_list=[1.0] * inst.num_stages,
    )
    assert free.mem_prefix is not None
    free = replace(free, util_lower=float(_layer_min(free.mem_prefix).max()))
    first = _probe(free, _INF, _INF)
    assert first.bounds is not None
    peak, _ = _minimise(
        free.util_lower,
        _max_util(free, first.bounds),
        first.bounds,
        lambda u: _probe(free, _INF, u),
        lambda r: r.next_util,
        lambda b: _max_util(free, b),
        try_lo_first=True,
    )
    return peak


def _raise_infeasible(inst: _Instance, limits: FloatArray) -> NoReturn:
    assert inst.mem_prefix is not None
    L, p = inst.num_layers, inst.num_stages
    needed = _min_peak_memory(inst)
    # what a layer needs wherever it sits: its own row, plus the first layer's start term and the last layer's end
    # term (another layer's start or end terms go with it only where it opens or closes a stage, which it need
    # not: the send buffer of layer 0 had blamed layer 0 where a split with it inside a stage fits)
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


