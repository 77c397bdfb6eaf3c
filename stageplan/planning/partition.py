"""The solver's instance and its feasibility probes: given a time cap and a memory cap, does a contiguous
split into p stages exist, and the lexicographically smallest one (numpy only, no scipy)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

# --------------------------------------------------------------------------------------------------
# The normalised problem
# --------------------------------------------------------------------------------------------------


FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]
INF = math.inf


@dataclass(frozen=True)
class Instance:
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


def _times(inst: Instance, k: int, i: IntArray | int, j: IntArray | int) -> FloatArray:
    t = (inst.prefix[j] - inst.prefix[i]) / inst.speeds_list[k]
    if inst.boundary is not None:
        t = t + inst.boundary[k, j]
    return np.asarray(t)


def _mems(inst: Instance, k: int, i: IntArray | int, j: IntArray | int) -> FloatArray:
    assert inst.mem_prefix is not None
    row = inst.mem_prefix[k]
    m = row[j] - row[i]
    if inst.mem_start is not None:
        m = m + inst.mem_start[k, i]
    if inst.mem_end is not None:
        m = m + inst.mem_end[k, j]
    return np.asarray(m)


def _mem_ok(inst: Instance, k: int, m: FloatArray, util: float) -> BoolArray:
    return (m <= inst.cap_list[k]) & (m / inst.div_list[k] <= util)


def stage_times(inst: Instance, bounds: list[int]) -> FloatArray:
    b = np.asarray(bounds)
    t = (inst.prefix[b[1:]] - inst.prefix[b[:-1]]) / inst.speeds
    if inst.boundary is not None:
        t = t + inst.boundary[np.arange(inst.num_stages), b[1:]]
    return np.asarray(t)


def stage_mems(inst: Instance, bounds: list[int]) -> FloatArray:
    assert inst.mem_prefix is not None
    b = np.asarray(bounds)
    ks = np.arange(inst.num_stages)
    m = inst.mem_prefix[ks, b[1:]] - inst.mem_prefix[ks, b[:-1]]
    if inst.mem_start is not None:
        m = m + inst.mem_start[ks, b[:-1]]
    if inst.mem_end is not None:
        m = m + inst.mem_end[ks, b[1:]]
    return np.asarray(m)


def max_time(inst: Instance, bounds: list[int]) -> float:
    return float(stage_times(inst, bounds).max())


def max_util(inst: Instance, bounds: list[int]) -> float:
    return float((stage_mems(inst, bounds) / inst.div).max())


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
class ProbeResult:
    feasible: bool
    bounds: list[int] | None
    next_time: float
    next_util: float


def fast_applies(inst: Instance, time_cap: float, util_cap: float) -> bool:
    """Whether the greedy probes and _lex_fast apply: no start terms, and stages monotone in their end.

    (The thresholds do not matter: a probe the greedy cannot settle falls back by itself.)
    """
    return inst.mem_start is None and inst.monotone_in_end


def _probe_fast(inst: Instance, time_cap: float, util_cap: float) -> ProbeResult | None:
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
    next_time = next_util = INF
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
    return ProbeResult(feasible, bounds if feasible else None, next_time, next_util)


def _probe_monotone(inst: Instance, time_cap: float, util_cap: float) -> ProbeResult:
    """O(pL) numpy: without start terms the best predecessor of j is the largest i in R_k below j."""
    L, p = inst.num_layers, inst.num_stages
    reach = np.zeros(L + 1, dtype=bool)
    reach[0] = True
    preds: list[tuple[int, IntArray]] = []
    next_time = next_util = INF
    for k in range(p):
        jlo, jhi = k + 1, L - (p - 1 - k)
        seg = reach[jlo - 1 : jhi]  # candidate starts i = jlo-1 .. jhi-1
        first = int(np.argmax(seg))
        if not seg[first]:
            return ProbeResult(False, None, next_time, next_util)
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
        return ProbeResult(False, None, next_time, next_util)
    bounds = [L]
    for offset, ip in reversed(preds):
        bounds.append(int(ip[bounds[-1] - offset]))
    bounds.reverse()
    return ProbeResult(True, bounds, next_time, next_util)


def _time_lo(inst: Instance, k: int, time_cap: float, js: IntArray) -> IntArray:
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


def _probe_general(inst: Instance, time_cap: float, util_cap: float, time_events: bool) -> ProbeResult:
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
    next_time = next_util = INF
    exact_next_time = True
    for k in range(p):
        jlo, jhi = k + 1, L - (p - 1 - k)
        seg = reach[jlo - 1 : jhi]
        first = int(np.argmax(seg))
        if not seg[first]:
            break
        base = jlo - 1 + first  # smallest reachable start
        starts = np.arange(base, jhi)
        g = np.where(seg[first:], inst.mem_start[k, starts] - inst.mem_prefix[k, starts], INF)
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
        return ProbeResult(False, None, next_time, next_util)
    bounds = [L]
    for pred in reversed(preds):
        bounds.append(int(pred[bounds[-1]]))
    bounds.reverse()
    return ProbeResult(True, bounds, next_time, next_util)


def run_probe(inst: Instance, time_cap: float, util_cap: float, *, time_events: bool = True) -> ProbeResult:
    """Feasibility under (T, U) by the cheapest exact method; time_events=False skips the (costly
    on the start-term path) next event for T when the caller bisects on U."""
    if fast_applies(inst, time_cap, util_cap):
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


def _lex_fast(inst: Instance, time_cap: float, util_cap: float) -> list[int] | None:
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
    wext = np.append(w, INF)  # index -1 reads +inf
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


def _acceptable(
    inst: Instance, k: int, i: IntArray | int, j: IntArray, time_cap: float, util_cap: float
) -> BoolArray:
    ok = _times(inst, k, i, j) <= time_cap
    if inst.has_memory:
        ok &= _mem_ok(inst, k, _mems(inst, k, i, j), util_cap)
    return np.asarray(ok)


def _lex_general(inst: Instance, time_cap: float, util_cap: float) -> list[int] | None:
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


def lex_smallest(inst: Instance, time_cap: float, util_cap: float) -> list[int] | None:
    if fast_applies(inst, time_cap, util_cap):
        bounds = _lex_fast(inst, time_cap, util_cap)
        if bounds is not None:
            return bounds
    return _lex_general(inst, time_cap, util_cap)
