"""Interleaved (virtual-stage) planning: p*v contiguous chunks, chunk c on rank placement[c] (c % p for the
looped schedules, a V for ZBVZeroBubble), as a MILP (scipy/HiGHS) with a local-search incumbent and a proven
bound (no torch)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NoReturn

import numpy as np
from numpy.typing import ArrayLike

from stageplan.errors import InfeasiblePlanError, StageplanError
from stageplan.planning.milp import LiveActivations, interleaved_milp
from stageplan.planning.partition import INF, BoolArray, FloatArray, IntArray
from stageplan.planning.solver import (
    TIE_REL,
    lower_bound,
    solve,
    validate_costs,
    validate_count,
    validate_limits,
    validate_rows,
    validate_speeds,
)
from stageplan.units import format_bytes, format_limits

__all__ = ["InterleavedSolution", "solve_interleaved"]



@dataclass(frozen=True)
class InterleavedSolution:
    """A partition of L layers into p*v contiguous chunks, chunk c running on rank ``placement[c]``.

    ``rank_loads[r]`` is the summed cost of rank r's chunks divided by its speed,
    ``bottleneck == max(rank_loads)``. ``lower_bound`` is a proven lower bound on the optimal
    bottleneck (equal to ``bottleneck`` when ``optimal``). ``chunk_memory`` holds bytes per chunk (with live
    counts, each chunk at its own activation peak: a rank's chunks need not peak at once, so their sum bounds
    the rank's memory from above). ``timed_out`` is True when the MILP stopped at ``time_limit_s`` or at its
    ``node_limit`` (then ``optimal`` is False unless a split it had found is proven to share the optimum's
    bottleneck). ``nodes``: the branch-and-bound nodes HiGHS solved (0 where no MILP ran).
    """

    boundaries: tuple[int, ...]
    rank_loads: tuple[float, ...]
    bottleneck: float
    lower_bound: float
    optimal: bool
    chunk_memory: tuple[float, ...] | None
    timed_out: bool = False
    nodes: int = 0


def _chunk_values(
    rows: FloatArray, start: FloatArray | None, end: FloatArray | None, bounds: list[int]
) -> FloatArray:
    """Per chunk: its layers' values (rows, (C, L)), plus the start term of its first layer and the end term
    of its last."""
    prefix = np.zeros((rows.shape[0], rows.shape[1] + 1))
    np.cumsum(rows, axis=1, out=prefix[:, 1:])
    b = np.asarray(bounds)
    ks = np.arange(rows.shape[0])
    out = prefix[ks, b[1:]] - prefix[ks, b[:-1]]
    if start is not None:
        out = out + start[ks, b[:-1]]
    if end is not None:
        out = out + end[ks, b[1:] - 1]
    return np.asarray(out)


def _per_rank(chunk: FloatArray, place: list[int], p: int) -> FloatArray:
    return np.array(
        [math.fsum(float(chunk[c]) for c in range(len(place)) if place[c] == r) for r in range(p)])


def _rank_loads(costs: FloatArray, speeds: FloatArray, bounds: list[int], place: list[int],
                time_end: FloatArray | None) -> tuple[float, ...]:
    """Each rank's time: its chunks' layers plus their boundary times (``time_end``, times the rank's speed),
    over its speed."""
    chunk = _chunk_values(np.broadcast_to(costs, (len(place), costs.size)), None, time_end, bounds)
    return tuple(float(x) for x in _per_rank(chunk, place, speeds.size) / speeds)


def _rank_memory(memory: FloatArray, bounds: list[int], place: list[int], p: int,
                 start: FloatArray | None = None, end: FloatArray | None = None) -> FloatArray:
    return _per_rank(_chunk_values(memory, start, end, bounds), place, p)


def _exact_rank_memory(static: FloatArray, live: LiveActivations | None, bounds: list[int], place: list[int],
                       p: int, start: FloatArray | None, end: FloatArray | None) -> FloatArray:
    """Each rank's memory: its chunks' (static) bytes, plus its exact activation peak with ``live``."""
    out = _rank_memory(static, bounds, place, p, start, end)
    return out if live is None else out + live.rank_peaks(bounds)


def solve_interleaved(
    costs: ArrayLike,
    num_ranks: int,
    virtual_stages: int,
    *,
    rank_speeds: ArrayLike | None = None,
    memory_bytes: ArrayLike | None = None,
    memory_limit_bytes: ArrayLike | None = None,
    time_limit_s: float = 2.0,
    placement: Sequence[int] | None = None,
    boundary_costs: ArrayLike | None = None,
    memory_start_bytes: ArrayLike | None = None,
    memory_end_bytes: ArrayLike | None = None,
    activation_bytes: ArrayLike | None = None,
    live_counts: Sequence[Sequence[Sequence[int]]] | None = None,
    node_limit: int | None = None,
    incumbent: Sequence[int] | None = None,
) -> InterleavedSolution:
    """Split layers into ``p*v`` contiguous non-empty chunks, chunk c on rank ``placement[c]`` (default ``c %
    p``, torch's looped schedules; ZBVZeroBubble's V is ``0..p-1, p-1..0``), minimising the largest rank load
    (the summed cost of a rank's chunks divided by its speed, plus each chunk's ``boundary_costs[j-1]`` after
    its last layer j-1, the last chunk's excepted, not divided: as :func:`stageplan.planning.solver.solve`
    charges them).

    ``memory_bytes`` is ``(L,)`` or ``(p*v, L)`` (one row per chunk); a chunk's memory adds
    ``memory_start_bytes[c, i]`` of its first layer i and ``memory_end_bytes[c, j-1]`` of its last; a rank's
    memory is the sum of its chunks' and must fit ``memory_limit_bytes`` (scalar or one per rank). With
    ``activation_bytes`` (L,) and ``live_counts`` (per rank, the microbatch counts each of the C chunks holds
    at the moments its activations can peak: ScheduleShape.live_counts), ``memory_bytes`` is the static part
    and a rank adds its exact activation peak, max over its count vectors of sum_c count_c x chunk c's
    activation bytes (a rank's chunks do not all peak at once). ``v == 1``
    is the contiguous problem and is solved exactly by :func:`solve`. Otherwise a MILP is solved with
    HiGHS (scipy.optimize.milp) within ``time_limit_s``: ``optimal`` is True when HiGHS proves it
    (gap 1e-9 of the objective scaled by the trivial bound); else the best plan found is returned
    with ``lower_bound`` = the proven dual bound. Among optimal plans the one HiGHS returns is kept
    (not canonical; repeatable when HiGHS finishes within the time limit). Each MILP (the plan,
    and on infeasibility the smallest limit) gets ``time_limit_s``; under memory limits, so does each of the
    incumbent's two slide searches (:class:`_Slides`: towards fitting, then faster).

    ``node_limit`` (an int >= 1) also bounds each MILP by HiGHS's branch-and-bound nodes: a deterministic
    budget (the same input, the same answer) where ``time_limit_s`` is set beyond what that many nodes take.
    ``incumbent``: boundaries (p*v + 1 of them) of a split known already, e.g. the contiguous split chunk by
    chunk; where it fits it replaces the heuristic incumbent's search (only the single-layer moves of
    :func:`_improve_interleaved` descend from it) and bounds the MILP, so the split returned is never slower
    than it.

    >>> solve_interleaved([1, 1, 1, 1], 2, 2).rank_loads
    (2.0, 2.0)
    >>> solve_interleaved([2, 8, 1, 6, 1, 3], 2, 2, placement=[0, 1, 1, 0]).boundaries  # a V: ranks 12 and 9
    (0, 1, 2, 3, 6)
    """
    c = validate_costs(costs)
    L = c.size
    p = validate_count("num_ranks", num_ranks, "pipeline ranks")
    v = validate_count("virtual_stages", virtual_stages, "virtual stages per rank")
    C = p * v
    if L < C:
        raise StageplanError(
            f"interleaved needs at least p*v = {C} layers, the profile has {L}; "
            "lower virtual_stages or profile at a finer granularity"
        )
    speeds = validate_speeds("rank_speeds", rank_speeds, p, "rank")
    place = _validated_placement(placement, p, v)
    bc = None if boundary_costs is None else validate_rows("boundary_costs", boundary_costs, C, L, "chunk")
    memory, limits, start, end = _validated_memory(L, p, C, memory_bytes, memory_limit_bytes,
                                                   memory_start_bytes, memory_end_bytes)
    live = _validate_live(activation_bytes, live_counts, memory is not None, place, L)
    if (
        isinstance(time_limit_s, bool)
        or not isinstance(time_limit_s, (int, float))
        or not (time_limit_s > 0)
        or math.isnan(time_limit_s)
    ):
        raise StageplanError(
            f"time_limit_s must be a number > 0, got {time_limit_s!r}; pass seconds, e.g. 2.0")
    if node_limit is not None and (isinstance(node_limit, bool)
                                   or not isinstance(node_limit, (int, np.integer)) or node_limit < 1):
        raise StageplanError(f"node_limit must be an int >= 1 or None, got {node_limit!r}; e.g. 200")
    given = None
    if incumbent is not None:
        given = [int(x) for x in incumbent]
        if len(given) != C + 1 or given[0] != 0 or given[-1] != L or any(
                a >= b for a, b in zip(given, given[1:], strict=False)):
            raise StageplanError(f"incumbent must be {C + 1} increasing boundaries from 0 to {L}, got "
                                 f"{list(incumbent)}")

    if v == 1:
        return _solve_one_chunk_per_rank(c, p, speeds, place, bc, memory, limits, start, end, live)
    time_end = None
    if bc is not None and np.any(bc[:-1] > 0):
        # charged undivided: times the speed the row divides by
        time_end = np.array(bc) * speeds[place][:, None]
        time_end[C - 1] = 0.0  # the last chunk sends nothing
    return _solve_interleaved_milp(c, p, v, speeds, memory, limits, float(time_limit_s), place, time_end, bc,
                                   start, end, live, node_limit, given)


def _validated_placement(placement: Sequence[int] | None, p: int, v: int) -> list[int]:
    """Each chunk's rank: ``c % p`` by default; a given placement must give every rank v of the p*v chunks."""
    C = p * v
    place = [c_ % p for c_ in range(C)] if placement is None else [int(r) for r in placement]
    if len(place) != C or sorted(place) != sorted(list(range(p)) * v):
        raise StageplanError(f"placement must give each of the {C} chunks a rank, every rank {v} chunks; got "
                             f"{list(placement or [])}")
    return place


def _validated_memory(
    L: int,
    p: int,
    C: int,
    memory_bytes: ArrayLike | None,
    memory_limit_bytes: ArrayLike | None,
    memory_start_bytes: ArrayLike | None,
    memory_end_bytes: ArrayLike | None,
) -> tuple[FloatArray | None, FloatArray | None, FloatArray | None, FloatArray | None]:
    """The memory rows (C, L), the limits (p,) and the start and end rows (C, L); all None without
    memory_bytes, where a limit given alone is an error."""
    memory = limits = start = end = None
    if memory_bytes is None:
        if memory_limit_bytes is not None:
            raise StageplanError(
                f"memory_limit_bytes is given but memory_bytes is None; pass per-layer memory_bytes "
                f"(shape ({L},) or ({C}, {L})) or drop memory_limit_bytes"
            )
    else:
        memory = validate_rows("memory_bytes", memory_bytes, C, L, "chunk")
        if memory_start_bytes is not None:
            start = validate_rows("memory_start_bytes", memory_start_bytes, C, L, "chunk")
        if memory_end_bytes is not None:
            end = validate_rows("memory_end_bytes", memory_end_bytes, C, L, "chunk")
        if memory_limit_bytes is not None:
            limits = validate_limits(memory_limit_bytes, p, "rank")
    return memory, limits, start, end


def _solve_one_chunk_per_rank(
    c: FloatArray, p: int, speeds: FloatArray, place: list[int], bc: FloatArray | None,
    memory: FloatArray | None,
    limits: FloatArray | None, start: FloatArray | None, end: FloatArray | None, live: LiveActivations | None,
) -> InterleavedSolution:
    """v == 1: the contiguous problem, solved exactly by :func:`solve` with chunk k on rank ``place[k]``."""
    if live is not None:  # one chunk per rank: its own peak is the rank's
        assert memory is not None
        memory = memory + live.upper_activations
    sol = solve(c, p, stage_speeds=speeds[place], boundary_costs=bc, memory_bytes=memory,
                memory_start_bytes=start,
                memory_end_bytes=end, memory_limit_bytes=None if limits is None else limits[place])
    return InterleavedSolution(
        boundaries=sol.boundaries,
        rank_loads=sol.stage_costs,
        bottleneck=sol.bottleneck,
        lower_bound=sol.bottleneck,
        optimal=True,
        chunk_memory=sol.stage_memory,
    )


def _validate_live(activation_bytes: ArrayLike | None, live_counts: Sequence[Sequence[Sequence[int]]] | None,
                   has_memory: bool, place: list[int], L: int) -> LiveActivations | None:
    if activation_bytes is None and live_counts is None:
        return None
    if activation_bytes is None or live_counts is None or not has_memory:
        raise StageplanError(
            "activation_bytes and live_counts go together, with memory_bytes holding the static bytes (pass "
            "zeros for none); pass all three, or fold the activations into memory_bytes and pass neither")
    C, p = len(place), max(place) + 1
    act = validate_rows("activation_bytes", activation_bytes, 1, L, "chunk")[0]
    if len(live_counts) != p:
        raise StageplanError(f"live_counts needs one list of count vectors per rank ({p}), got "
                             f"{len(live_counts)}; "
                             "pass ScheduleShape.live_counts")
    counts = []
    for r, vectors in enumerate(live_counts):
        k = np.asarray(vectors, dtype=float)
        if k.ndim != 2 or k.shape[0] < 1 or k.shape[1] != C or not np.all(np.isfinite(k)) or np.any(k < 0):
            raise StageplanError(f"live_counts[{r}] must be one or more vectors of {C} counts >= 0, got "
                                 f"shape {k.shape}; pass ScheduleShape.live_counts")
        off = [ci for ci in range(C) if place[ci] != r and np.any(k[:, ci] != 0)]
        if off:
            raise StageplanError(f"live_counts[{r}] counts chunks {off}, which run on other ranks; a rank "
                                 "counts only its own chunks (0 elsewhere)")
        counts.append(k)
    return LiveActivations(act, tuple(counts))


@dataclass(frozen=True)
class _Split:
    """One interleaved instance, with the ways the incumbent's search and the final choice score a split."""

    c: FloatArray
    p: int
    v: int
    speeds: FloatArray
    static: FloatArray | None  # the memory rows as given (the static bytes alone with live counts)
    # with live counts, each chunk at its own activation peak: what heuristics bound by
    memory: FloatArray | None
    limits: FloatArray | None
    time_limit_s: float
    place: list[int]
    time_end: FloatArray | None
    bc: FloatArray | None
    start: FloatArray | None
    end: FloatArray | None
    live: LiveActivations | None

    @property
    def time_rows(self) -> FloatArray:
        return np.broadcast_to(self.c, (len(self.place), self.c.size))

    def fits(self, bounds: list[int]) -> bool:
        if self.static is None or self.limits is None:
            return True
        return bool(np.all(_exact_rank_memory(self.static, self.live, bounds, self.place, self.p, self.start,
                                              self.end) <= self.limits))

    def bottleneck_of(self, bounds: list[int]) -> float:
        return max(_rank_loads(self.c, self.speeds, bounds, self.place, self.time_end))

    def largest_chunk(self, bounds: list[int]) -> float:
        return float(
            (_chunk_values(self.time_rows, None, self.time_end, bounds) / self.speeds[self.place]).max())


def _solve_interleaved_milp(
    c: FloatArray,
    p: int,
    v: int,
    speeds: FloatArray,
    memory: FloatArray | None,
    limits: FloatArray | None,
    time_limit_s: float,
    place: list[int],
    time_end: FloatArray | None,
    bc: FloatArray | None,
    start: FloatArray | None,
    end: FloatArray | None,
    live: LiveActivations | None = None,
    node_limit: int | None = None,
    given: list[int] | None = None,
) -> InterleavedSolution:
    trivial = lower_bound(c, speeds)
    static = memory
    if memory is not None and live is not None:
        # per chunk, its own peak: what the heuristics bound ranks by
        memory = memory + live.upper_activations
    split = _Split(c, p, v, speeds, static, memory, limits, time_limit_s, place, time_end, bc, start, end,
                   live)
    if given is not None and split.fits(given):
        heur = _improve_interleaved(split.time_rows, p, speeds, static, limits, given, place, None, time_end,
                                    start, end, live)
        if not (split.fits(heur) and split.bottleneck_of(heur) <= split.bottleneck_of(given)):
            heur = given
        upper = split.bottleneck_of(heur)
    else:
        heur, upper = _incumbent(split)
    heur_ok = bool(heur)

    result = interleaved_milp(c, p, v, speeds, static, limits, "time", upper, trivial, time_limit_s, place,
                              time_end, start, end, live, node_limit=node_limit)
    if result.infeasible and not heur_ok:
        _raise_interleaved_infeasible(c, p, v, static, limits, time_limit_s, place, start, end, live,
                                      node_limit)
    return replace(_best_split(split, (result.bounds, result.unchecked), result.optimal, heur, trivial,
                               result.dual_bound, result.timed_out), nodes=result.nodes)


def _incumbent_starts(s: _Split) -> list[list[int]]:
    """Contiguous optima over p*v stages with the ranks' speeds: memory ignored, then (under limits) each
    chunk held to a share of its rank's limit (:func:`_memory_starts`), those that exist, without repeats."""
    C = len(s.place)
    chunk_speeds = s.speeds[s.place]
    starts = [list(solve(s.c, C, stage_speeds=chunk_speeds, boundary_costs=s.bc).boundaries)]
    if s.memory is not None and s.limits is not None:
        assert s.static is not None
        for rows, share in _memory_starts(s.static, s.live, s.memory, s.place, s.p):
            with contextlib.suppress(InfeasiblePlanError):
                sol = solve(s.c, C, stage_speeds=chunk_speeds, boundary_costs=s.bc, memory_bytes=rows,
                            memory_start_bytes=s.start, memory_end_bytes=s.end,
                            memory_limit_bytes=s.limits[s.place] * share)
                if list(sol.boundaries) not in starts:
                    starts.append(list(sol.boundaries))
    return starts


def _incumbent(s: _Split) -> tuple[list[int], float]:
    """The heuristic split that bounds the MILP and its bottleneck ([] and inf when none fits): the contiguous
    optimum over p*v stages with the ranks' speeds (memory ignored, or each chunk held to a share of its
    rank's limit), improved by local search."""
    heur: list[int] = []
    upper = INF
    slides = None
    if s.static is not None and s.limits is not None:
        slides = _Slides(s.static, s.live, s.start, s.end, s.limits, s.c, s.speeds, s.time_end, s.place, s.p,
                         s.time_limit_s)
    for first in _incumbent_starts(s):
        if not s.fits(first):
            if heur:
                # repairs are the costly part (up to 16k slides a step at 128 chunks): one that fits is enough
                continue
            assert slides is not None
            first = slides.repair(first)
        if s.fits(first):
            cand = _improve_interleaved(s.time_rows, s.p, s.speeds, s.static, s.limits, first, s.place, None,
                                        s.time_end, s.start, s.end, s.live)
            load = s.bottleneck_of(cand)
            if load < upper:
                heur, upper = cand, load
    if heur and slides is not None:  # slides from the best start only: at 128 chunks each costs about 1 s
        quick = slides.faster(heur)
        # faster() takes a bottleneck equal up to rounding (TIE_REL) as a tie, to lower the largest chunk; the
        # bulk sums round in another order than bottleneck_of, so the split is checked again with that same
        # tolerance (an exact test would drop a faster() result over one ulp, 26.2 against 26.199999999999996)
        if s.fits(quick) and _no_slower(s.bottleneck_of(quick), upper):
            heur, upper = quick, s.bottleneck_of(quick)
    return heur, upper


def _best_split(s: _Split, found_by_milp: tuple[list[int] | None, ...], proven: bool, heur: list[int],
                trivial: float, dual_bound: float, timed_out: bool) -> InterleavedSolution:
    """The fastest of the MILP's splits (``proven``: HiGHS proved them optimal) and the incumbent ``heur``,
    those that fit; among equal bottlenecks the one whose largest chunk is smallest. ``dual_bound``: the
    MILP's proven bound; ``timed_out``: the MILP stopped at its time limit."""
    candidates: list[tuple[float, float, list[int], bool]] = []
    for found in found_by_milp:  # the check's split and the one it refuted: the exact better
        if found is not None and s.fits(found):
            candidates.append((s.bottleneck_of(found), s.largest_chunk(found), found, proven))
    if heur:
        candidates.append((s.bottleneck_of(heur), s.largest_chunk(heur), heur, False))
    if not candidates:
        raise StageplanError(
            f"no interleaved plan of {s.c.size} layers into {s.p} ranks x {s.v} virtual stages was found "
            f"within time_limit_s={s.time_limit_s:g}, and infeasibility was not proven either; give the "
            "solver longer (time_limit_s; stageplan plan --time-limit SECONDS), raise the memory limit, or "
            "use recomputation"
        )
    best = min(t[0] for t in candidates)
    # equal bottlenecks: keep the split whose largest chunk is smallest (a chunk is what the schedule waits
    # on; a proven-optimal MILP split of the 70B estimate with 20-layer and 1-layer chunks simulated 15.9 s
    # against 11.1 s)
    tied = [t for t in candidates if t[0] <= best * (1 + TIE_REL)]
    _, _, bounds, _ = min(tied, key=lambda t: t[1])
    optimal = any(t[3] for t in tied)  # a proven optimum's bottleneck is shared by every tied split
    bottleneck = best
    loads = _rank_loads(s.c, s.speeds, bounds, s.place, s.time_end)
    lower = bottleneck if optimal else min(bottleneck, max(trivial, dual_bound))
    return InterleavedSolution(
        boundaries=tuple(int(b) for b in bounds),
        rank_loads=loads,
        bottleneck=max(loads),
        lower_bound=lower,
        optimal=optimal,
        chunk_memory=None if s.memory is None else tuple(float(x) for x in _chunk_values(s.memory, s.start,
                                                                                         s.end, bounds)),
        timed_out=timed_out,
    )


_SHARE_BLENDS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _memory_starts(static: FloatArray, live: LiveActivations | None, upper: FloatArray, place: list[int],
                   p: int) -> list[tuple[FloatArray, FloatArray]]:
    """Per-chunk memory rows and each chunk's share of its rank's limit, for contiguous solves that seed the
    incumbent: rows that bound each chunk by its own peak (their sum over a rank bounds the rank), or with
    live counts each rank's heaviest moment's counts (equal-sized chunks; not a bound, so a split is kept only
    when its exact memory fits); shares equal (1/v), or in proportion to a chunk's bytes per layer (a chunk
    holding more microbatches gets more of the limit, and so about as many layers)."""
    C = len(place)
    options = [upper]
    if live is not None:
        heaviest = np.zeros(C)
        for k in live.counts:
            heaviest += k[int(np.argmax(k.sum(axis=1)))]
        options.append(static + heaviest[:, None] * live.activation_bytes[None, :])
    out = []
    for rows in options:
        per_layer = rows.mean(axis=1) + 1e-300
        rank_total = np.array([per_layer[[ci for ci in range(C) if place[ci] == r]].sum() for r in range(p)])
        proportional = per_layer / rank_total[place]
        counts = np.bincount(place, minlength=p)
        equal = 1.0 / counts[place]
        out += [(rows, (1 - t) * equal + t * proportional) for t in _SHARE_BLENDS]
    return out


def _improve_interleaved(
    values: FloatArray,
    p: int,
    div: FloatArray,
    guard_rows: FloatArray | None,
    guard_limits: FloatArray | None,
    bounds: list[int],
    place: list[int],
    v_start: FloatArray | None,
    v_end: FloatArray | None,
    g_start: FloatArray | None,
    g_end: FloatArray | None,
    g_live: LiveActivations | None = None,
) -> list[int]:
    """Local search over chunk boundaries: move one layer across a boundary whenever that lowers the
    larger load of the ranks involved (rank load = sum of its chunks' values, each chunk's first-layer start
    and last-layer end terms included, / div[rank]), keeping every rank within guard_limits on guard_rows
    (with their start and end terms, plus the rank's exact activation peak with ``g_live``) when given. The
    sorted load vector falls with every move, so it stops; the result is a heuristic incumbent, not a
    proof."""
    C = values.shape[0]
    if p == 1:
        return bounds
    b = list(bounds)
    cost_of = _span_sums(values, v_start, v_end)
    cost = [cost_of(i, b[i], b[i + 1]) for i in range(C)]
    load = [math.fsum(cost[ci] for ci in range(C) if place[ci] == r) for r in range(p)]
    guard = None
    if guard_rows is not None and guard_limits is not None:
        guard = _MemoryGuard(guard_rows, guard_limits, g_start, g_end, g_live, b, place, p)
    _single_moves(b, place, div.tolist(), cost_of, cost, load, guard)
    if guard_rows is not None and guard_limits is not None and not np.all(
        _exact_rank_memory(guard_rows, g_live, b, place, p, g_start, g_end) <= guard_limits
    ):
        return bounds  # incremental sums drifted past a limit: keep the start
    return b


def _term(rows: FloatArray | None, ci: int, layer: int) -> float:
    return 0.0 if rows is None else float(rows[ci, layer])


def _span_sums(
    rows: FloatArray, start: FloatArray | None, end: FloatArray | None
) -> Callable[[int, int, int], float]:
    """f(ci, i, j): chunk ci over layers [i, j), the sum of its row of ``rows`` plus the start term of its
    first layer and the end term of its last (from prefix sums, as Python floats)."""
    prefix = np.zeros((rows.shape[0], rows.shape[1] + 1))
    np.cumsum(rows, axis=1, out=prefix[:, 1:])
    P = prefix.tolist()

    def span(ci: int, i: int, j: int) -> float:
        return P[ci][j] - P[ci][i] + _term(start, ci, i) + _term(end, ci, j - 1)

    return span


class _MemoryGuard:
    """Each rank's memory under the single moves, kept incrementally: its chunks' bytes on ``rows`` (with
    their start and end terms) plus, with ``live``, its exact activation peak; a move is admitted only while
    the ranks it touches stay within ``limits``."""

    def __init__(self, rows: FloatArray, limits: FloatArray, start: FloatArray | None, end: FloatArray | None,
                 live: LiveActivations | None, b: list[int], place: list[int], p: int) -> None:
        C = rows.shape[0]
        self.mem_of = _span_sums(rows, start, end)
        self.lim: list[float] = limits.tolist()
        self.cmem = [self.mem_of(i, b[i], b[i + 1]) for i in range(C)]
        self.rmem = [math.fsum(self.cmem[ci] for ci in range(C) if place[ci] == r) for r in range(p)]
        self.live = live
        self.act_prefix = None if live is None else np.concatenate([[0.0], np.cumsum(live.activation_bytes)])
        self.cact: list[float] = []
        if self.act_prefix is not None:
            self.cact = [float(self.act_prefix[b[i + 1]] - self.act_prefix[b[i]]) for i in range(C)]

    def peak(self, r: int) -> float:
        """Rank r's activation peak over its order (0 without live counts)."""
        if self.live is None:
            return 0.0
        return float((self.live.counts[r] @ np.asarray(self.cact)).max())

    def admits(self, b: list[int], ci: int, nb: int, ra: int, rb: int) -> bool:
        """Whether moving boundary ci to nb keeps ranks ra and rb (its chunks' ranks) within their limits; if
        it does, the move's memory is recorded (the caller then makes the move), else nothing changes."""
        cmem, rmem, cact, act_prefix = self.cmem, self.rmem, self.cact, self.act_prefix
        ma = self.mem_of(ci - 1, b[ci - 1], nb)
        mb = self.mem_of(ci, nb, b[ci + 1])
        nmem = {ra: rmem[ra], rb: rmem[rb]}
        nmem[ra] += ma - cmem[ci - 1]
        nmem[rb] += mb - cmem[ci]
        old_act = cact[ci - 1:ci + 1]
        if act_prefix is not None:
            cact[ci - 1] = float(act_prefix[nb] - act_prefix[b[ci - 1]])
            cact[ci] = float(act_prefix[b[ci + 1]] - act_prefix[nb])
        if any(x + self.peak(r) > self.lim[r] for r, x in nmem.items()):
            cact[ci - 1:ci + 1] = old_act
            return False
        for r, x in nmem.items():
            rmem[r] = x
        cmem[ci - 1], cmem[ci] = ma, mb
        return True


def _single_moves(b: list[int], place: list[int], d: list[float], cost_of: Callable[[int, int, int], float],
                  cost: list[float], load: list[float], guard: _MemoryGuard | None) -> None:
    """The descent of :func:`_improve_interleaved`, in place on ``b`` (the boundaries), ``cost`` (per chunk)
    and ``load`` (per rank, before dividing by ``d``): until no single move lowers the larger load of its two
    ranks."""
    C = len(b) - 1
    improved = True
    while improved:
        improved = False
        for ci in range(1, C):
            ra, rb = place[ci - 1], place[ci]
            for nb in (b[ci] + 1, b[ci] - 1):
                if not b[ci - 1] < nb < b[ci + 1]:
                    continue
                ca = cost_of(ci - 1, b[ci - 1], nb)
                cb = cost_of(ci, nb, b[ci + 1])
                new = {ra: load[ra], rb: load[rb]}
                new[ra] += ca - cost[ci - 1]
                new[rb] += cb - cost[ci]
                if max(x / d[r] for r, x in new.items()) >= max(load[r] / d[r] for r in new) * (1 - TIE_REL):
                    continue
                if guard is not None and not guard.admits(b, ci, nb, ra, rb):
                    continue
                for r, x in new.items():
                    load[r] = x
                cost[ci - 1], cost[ci] = ca, cb
                b[ci] = nb
                improved = True
                break


def _no_slower(bottleneck: float, upper: float) -> bool:
    """Whether a bottleneck summed one way is no slower than ``upper`` summed another, up to their rounding (a
    tie within TIE_REL of each, as the slides take them)."""
    return bottleneck <= upper * (1 + 2 * TIE_REL)


class _Slides:
    """Local search over slides, for splits under memory limits: a slide shifts a run of consecutive
    boundaries one layer the same way, so one chunk gives a layer and another, possibly on a distant rank,
    takes one while the chunks between keep their sizes. Single moves (:func:`_improve_interleaved`) stall
    where one layer of a large model is more than a neighbour has to spare: the 70B estimate at 16 ranks x 2
    chunks stayed at 190 GiB under a 150 GiB limit, where slides carry the layer on to a rank with room.
    Splits are scored in bulk by the exact rank memory (static bytes plus, with ``live``, each rank's
    activation peak) and the rank loads."""

    def __init__(self, static: FloatArray, live: LiveActivations | None, start: FloatArray | None,
                 end: FloatArray | None,
                 limits: FloatArray, costs: FloatArray, speeds: FloatArray, time_end: FloatArray | None,
                 place: list[int], p: int, seconds: float) -> None:
        C, L = static.shape
        self.seconds = seconds
        self.deadline = {"repair": time.perf_counter() + seconds}
        self.L = L
        self.rows = np.arange(C)
        self.static = np.zeros((C, L + 1))
        np.cumsum(static, axis=1, out=self.static[:, 1:])
        self.act = None if live is None else np.concatenate([[0.0], np.cumsum(live.activation_bytes)])
        if live is not None:  # every rank's count vectors stacked, and where each rank's rows start
            self.counts = np.concatenate(live.counts, axis=0).T
            self.segments = np.cumsum([0] + [len(k) for k in live.counts[:-1]])
        self.time = np.concatenate([[0.0], np.cumsum(costs)])
        self.start, self.end, self.time_end = start, end, time_end
        self.onto = np.zeros((C, p))
        self.onto[self.rows, place] = 1.0
        self.limits = np.asarray(limits, dtype=float)
        self.speeds = np.asarray(speeds, dtype=float)
        self.chunk_speeds = self.speeds[place]
        firsts, lasts = np.triu_indices(C - 1)
        k = np.arange(C + 1)
        runs = ((k[None, :] >= firsts[:, None] + 1) & (k[None, :] <= lasts[:, None] + 1)).astype(np.int64)
        self.moves = np.concatenate([runs, -runs])

    def memory(self, cands: IntArray) -> FloatArray:
        """(N, C + 1) splits -> (N, p) exact rank bytes."""
        lo, hi = cands[:, :-1], cands[:, 1:]
        chunk = self.static[self.rows, hi] - self.static[self.rows, lo]
        if self.start is not None:
            chunk = chunk + self.start[self.rows, lo]
        if self.end is not None:
            chunk = chunk + self.end[self.rows, hi - 1]
        out = chunk @ self.onto
        if self.act is not None:
            ca = self.act[hi] - self.act[lo]
            out = out + np.maximum.reduceat(ca @ self.counts, self.segments, axis=1)
        return np.asarray(out)

    def loads(self, cands: IntArray) -> tuple[FloatArray, FloatArray]:
        """(N, C + 1) splits -> (N, p) rank loads, as :func:`_rank_loads`, and (N, C) chunk times over their
        ranks' speeds."""
        lo, hi = cands[:, :-1], cands[:, 1:]
        chunk = self.time[hi] - self.time[lo]
        if self.time_end is not None:
            chunk = chunk + self.time_end[self.rows, hi - 1]
        return np.asarray((chunk @ self.onto) / self.speeds), np.asarray(chunk / self.chunk_speeds)

    def _search(self, phase: str, bounds: list[int], score: Callable[[IntArray], tuple[FloatArray, ...]],
                done: Callable[[list[float]], bool],
                admissible: Callable[[IntArray], BoolArray] | None = None) -> list[int]:
        """Best-improvement descent on the score tuple, compared in order (each key with a relative
        tolerance), which falls with every step; with ``admissible``, only over the splits it accepts (asked
        of the improving ones only)."""
        b = np.asarray(bounds, dtype=np.int64)
        now = [float(x[0]) for x in score(b[None, :])]
        for _ in range(4 * self.L):
            if done(now) or time.perf_counter() > self.deadline[phase]:
                break
            cands = b[None, :] + self.moves
            cands = cands[np.all(np.diff(cands, axis=1) > 0, axis=1)]
            if not len(cands):
                break
            keys = score(cands)
            better = np.zeros(len(cands), dtype=bool)
            tied = np.ones(len(cands), dtype=bool)
            for key, ref in zip(keys, now):
                better |= tied & (key < ref * (1 - TIE_REL))
                tied &= key <= ref * (1 + TIE_REL)
            idx = np.flatnonzero(better)
            if admissible is not None and len(idx):
                idx = idx[admissible(cands[idx])]
            if not len(idx):
                break
            pick = idx[np.lexsort(tuple(k[idx] for k in reversed(keys)))[0]]
            b = cands[pick]
            now = [float(k[pick]) for k in keys]
        return [int(x) for x in b]

    def repair(self, bounds: list[int]) -> list[int]:
        """Towards fitting: lower the bytes over the limits, then the sum of squared fill."""

        def score(cands: IntArray) -> tuple[FloatArray, ...]:
            mem = self.memory(cands)
            return np.maximum(mem - self.limits, 0.0).sum(axis=1), ((mem / self.limits) ** 2).sum(axis=1)

        return self._search("repair", bounds, score, lambda now: now[0] <= 0)

    def faster(self, bounds: list[int]) -> list[int]:
        """Within the limits (a split that fits stays fitting): lower the bottleneck, then the largest chunk
        (what the schedule waits on), then the sum of squared loads."""

        def score(cands: IntArray) -> tuple[FloatArray, ...]:
            loads, chunks = self.loads(cands)
            return loads.max(axis=1), chunks.max(axis=1), (loads ** 2).sum(axis=1)

        def fits(cands: IntArray) -> BoolArray:
            return np.asarray(np.all(self.memory(cands) <= self.limits, axis=1))

        self.deadline["faster"] = time.perf_counter() + self.seconds
        return self._search("faster", bounds, score, lambda _: False, fits)


def _raise_interleaved_infeasible(
    c: FloatArray, p: int, v: int, memory: FloatArray | None, limits: FloatArray | None, time_limit_s: float,
    place: list[int], start: FloatArray | None, end: FloatArray | None, live: LiveActivations | None = None,
    node_limit: int | None = None,
) -> NoReturn:
    assert memory is not None and limits is not None
    L = c.size
    needed: float | None = None
    # HiGHS's proof with presolve is checked without it (interleaved_milp): with it alone, HiGHS (scipy
    # 1.17.1) called a split 1 B above the optimum optimal on a 7-layer ZBV instance (35 B against 34 B)
    res = interleaved_milp(c, p, v, np.ones(p), memory, None, "memory", INF, 0.0, time_limit_s, place, None,
                           start, end, live, node_limit=node_limit)
    if res.optimal and res.bounds:
        needed = min(float(_exact_rank_memory(memory, live, found, place, p, start, end).max())
                     for found in (res.bounds, res.unchecked) if found)
    tail = (
        f"the smallest limit that admits a plan is {format_bytes(needed)}"
        if needed is not None
        else f"the smallest limit that admits a plan was not found within time_limit_s={time_limit_s:g} "
             "(give the solver longer to find it: stageplan plan --time-limit SECONDS)"
    )
    raise InfeasiblePlanError(
        f"no partition of {L} layers into {p * v} chunks ({p} ranks x {v} virtual stages) fits "
        f"{format_limits(limits, 'rank')}; {tail}; raise the limit, add ranks, use fewer virtual stages, "
        "or use recomputation / a schedule with fewer microbatches in flight",
        min_memory_limit_bytes=needed,
    )
