"""Composition of the public API: profile_model(), plan(), run(); torch parts are imported lazily."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import pathlib
import statistics
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from stageplan._io import is_number
from stageplan.costmodel import (
    CostOptions,
    Device,
    LayerArrays,
    SplitCosts,
    check_ranks,
    evaluate,
    layer_time,
    make_options,
    per_chunk_s,
    solver_inputs,
    tied_sync_time,
)
from stageplan.errors import InfeasiblePlanError, PlanNote, StageplanError
from stageplan.plan import Plan, boundaries_from_megatron, boundaries_from_module_fqns, named_layers
from stageplan.profile import Profile
from stageplan.runreport import RunReport
from stageplan.schedules import normalize_schedule
from stageplan.units import parse_bandwidth, parse_bytes
from stageplan.workload import Workload, default_microbatch_size


def build_workload(model: str, options: dict[str, Any] | None = None) -> Workload:
    """A built-in name or ``package.module:factory`` called with ``options``."""
    from stageplan.zoo import build_workload as _build

    return _build(model, options)


# ------------------------------------------------------------------------------------------------------
# Planning

METHODS = ("optimal", "uniform", "parameters")


def _as_profile(profile: Profile | str | os.PathLike[str]) -> Profile:
    return profile if isinstance(profile, Profile) else Profile.load(profile)


def _devices(devices: Sequence[Device | float] | None) -> list[Device] | None:
    if devices is None:
        return None
    return [d if isinstance(d, Device) else Device(float(d)) for d in devices]


# How each kind of given split is named in messages, and the plan() keyword that gives it
GIVEN_AS = {"boundaries": "boundaries", "megatron_layout": "the Megatron layout",
            "fqns": "the module FQNs per model part"}


def _boundaries(method: str, arr: LayerArrays, opts: CostOptions, given: tuple[int, ...] | None = None,
                given_as: str = "boundaries", time_limit_s: float = 2.0) -> tuple[tuple[int, ...], dict[str, Any]]:
    """Stage boundaries by ``method``; the second value carries solver evidence (proven bounds)."""
    from stageplan import baselines, interleaved, solver

    S = opts.num_chunks
    L = len(arr.forward_s)
    if method == "given":
        assert given is not None
        b = list(given)
        if given_as != "boundaries" and len(b) != S + 1:
            n = len(b) - 1
            raise StageplanError(
                f"{GIVEN_AS[given_as]} gives {n} stage{'s' if n != 1 else ''} but {opts.num_ranks} ranks x "
                f"{opts.virtual_stages} chunks need {S}; give {S} stages, or plan {n} (--stages {n}, one chunk per rank)")
        ranks = list(opts.shape.stage_ranks)
        if given_as == "megatron_layout" and ranks != [s % opts.num_ranks for s in range(S)]:
            raise StageplanError(
                f"Megatron places virtual stages round-robin (stage s on rank s mod {opts.num_ranks}), and "
                f"{opts.shape.schedule} places them otherwise (ranks {ranks}), so the layout would be scored on a "
                "placement Megatron never runs; score it with --schedule Interleaved1F1B, or give this schedule's "
                "split with --boundaries or --fqns")
        if len(b) != S + 1 or b[0] != 0 or b[-1] != L or any(x >= y for x, y in zip(b, b[1:])):
            raise StageplanError(
                f"boundaries {b} must be {S + 1} increasing cut points from 0 to {L} (the number of layers) for "
                f"{opts.num_ranks} ranks x {opts.virtual_stages} chunks, every stage non-empty; e.g. "
                f"{','.join(str(x) for x in baselines.partition_uniform(L, S))}"
            )
        return tuple(b), {}
    if method == "uniform":  # equal layer counts: Megatron's default, DeepSpeed partition_method="uniform"
        return tuple(baselines.partition_uniform(L, S)), {}
    if method == "parameters":  # DeepSpeed's default partition_method="parameters": balance parameter counts
        return tuple(baselines.partition_balanced(arr.param_bytes, S)), {}
    inp = solver_inputs(arr, opts)
    if opts.virtual_stages > 1:
        rank_speeds = np.array([d.speed for d in opts.devices])
        exact = inp["activation_bytes"] is not None  # a rank's activation peak over its order, as evaluate counts it
        isol = interleaved.solve_interleaved(inp["costs"], opts.num_ranks, opts.virtual_stages, rank_speeds=rank_speeds,
                                             memory_bytes=inp["static_memory_bytes" if exact else "memory_bytes"],
                                             memory_limit_bytes=inp["limits"],
                                             placement=opts.shape.stage_ranks, boundary_costs=inp["boundary_costs"],
                                             memory_start_bytes=inp["memory_start_bytes"],
                                             memory_end_bytes=inp["memory_end_bytes"],
                                             activation_bytes=inp["activation_bytes"] if exact else None,
                                             live_counts=opts.shape.live_counts if exact else None,
                                             time_limit_s=time_limit_s)
        # the MILP balances the layers; every rank also pays the schedule's loop and PipelineStage's overhead
        # around its v chunks (evaluate)
        loop = per_chunk_s(opts) * opts.virtual_stages
        return tuple(isol.boundaries), {"optimal": isol.optimal, "proven_lower_bound_s": isol.lower_bound + loop,
                                        "timed_out": isol.timed_out}
    sol = solver.solve(inp["costs"], S, stage_speeds=inp["speeds"], boundary_costs=inp["boundary_costs"],
                       memory_bytes=inp["memory_bytes"], memory_start_bytes=inp["memory_start_bytes"],
                       memory_end_bytes=inp["memory_end_bytes"], memory_limit_bytes=inp["limits"])
    return tuple(sol.boundaries), {"optimal": True}


# The tie-break's bounded work: at most _TIE_SPLITS equal-bottleneck splits are listed (visiting at most _TIE_NODES
# search nodes), else a descent from the solver's split runs for at most _TIE_ROUNDS moves; in all, at most
# _TIE_WORK schedule actions are simulated (splits x actions per step: 64 splits at p = 64, m = 128).
_TIE_SPLITS = 256
_TIE_NODES = 2048
_TIE_WORK = 2**20
_TIE_ROUNDS = 8
_FASTER_NOTE = 0.01  # objective "bottleneck" notes a faster split found when it is at least this much faster
_STEP_ROUNDS = 64  # the step search's descents (from several seeds) may move further
_TIE_REL = 1e-12  # bottleneck and step tolerance (relative), as the solver's own ties


def _alive_positions(costs: SplitCosts, cap: float, most: int) -> np.ndarray | None:
    """One chunk per rank: ``alive[s, x]`` when boundary s can sit at layer x in a split whose stages all stay
    within ``cap`` and fit in memory; None when there are more than ``most`` such splits (or too many positions to
    count them). Positions are first bounded by the work alone (greedy from each end), then counted exactly."""
    opts = costs.opts
    S, L = opts.num_chunks, costs.num_layers
    work = costs.fwd_prefix * (2.0 if opts.recompute else 1.0) + costs.bwd_prefix  # layer-time prefix at speed 1
    room = cap * costs.speed * (1 + 1e-9)  # the most work a stage can hold
    hi, lo = [0] * (S + 1), [L] * (S + 1)
    for k in range(S):  # boundary k+1 lies at most where the first k+1 stages, packed full, end
        hi[k + 1] = min(L - (S - k - 1), int(np.searchsorted(work, work[hi[k]] + room[k], side="right")) - 1)
    for k in range(S - 1, 0, -1):  # and at least where the last S-k stages, packed full, begin
        lo[k] = max(k, int(np.searchsorted(work, work[lo[k + 1]] - room[k], side="left")))
    lo[0] = 0
    if any(lo[k] > hi[k] for k in range(S + 1)) or sum(
            (hi[k] - lo[k] + 1) * (hi[k + 1] - lo[k + 1] + 1) for k in range(S)) > 2**18:
        return None
    alive = np.zeros((S + 1, L + 1), dtype=bool)
    count = np.zeros(L + 1)
    count[L] = 1.0
    alive[S, L] = True
    for k in range(S - 1, -1, -1):
        xs = np.arange(lo[k], hi[k] + 1)[:, None]
        ys = np.arange(lo[k + 1], hi[k + 1] + 1)[None, :]
        f, b, c, m = costs.stage(k, xs, np.maximum(ys, xs + 1))
        ok = (ys > xs) & (f + b + c <= cap) & (m <= costs.limits[opts.shape.stage_ranks[k]]) & (count[ys] > 0)
        below = np.minimum((ok * count[ys]).sum(axis=1), most + 1.0)  # splits from each x on, capped
        count = np.zeros(L + 1)
        count[xs[:, 0]] = below
        alive[k, xs[:, 0]] = below > 0
    return alive if 0 < count[0] <= most else None


def _equal_bottleneck_splits(costs: SplitCosts, cap: float, most: int) -> list[tuple[int, ...]] | None:
    """Every split whose rank times stay within ``cap`` and whose rank memory fits, in lexicographic order; None
    when there are more than ``most``. One chunk per rank: counted first (``_alive_positions``), then listed
    without dead ends; interleaved: a search over rank loads that gives up after _TIE_NODES nodes."""
    opts = costs.opts
    S, L, p = opts.num_chunks, costs.num_layers, opts.num_ranks
    ranks = opts.shape.stage_ranks
    alive = _alive_positions(costs, cap, most) if opts.virtual_stages == 1 else None
    if opts.virtual_stages == 1 and alive is None:
        return None
    work = costs.fwd_prefix * (2.0 if opts.recompute else 1.0) + costs.bwd_prefix
    rank_speed = np.array([d.speed for d in opts.devices])
    later = np.zeros((S, p))  # later[s, r] = 1 when rank r still runs a chunk after chunk s
    for s in range(S):
        later[s, list(ranks[s + 1:])] = 1.0
    found: list[tuple[int, ...]] = []
    nodes = 0
    # an interleaved rank's activations peak over its order: carry, per rank, each live-count vector's sum over the
    # chunks placed so far (a lower bound of the rank's peak while chunks remain, its peak once all are placed)
    live = costs.live

    def visit(s: int, x: int, load: np.ndarray, mem: np.ndarray, cuts: list[int],
              partial: tuple[np.ndarray, ...] = ()) -> bool:
        nonlocal nodes
        nodes += 1
        if (alive is None and nodes > _TIE_NODES) or len(found) > most:
            return False
        r, last = ranks[s], s == S - 1
        # a stage's work only grows with its end: stop where the work alone passes what its rank has left
        reach = int(np.searchsorted(work, work[x] + (cap - load[r]) * costs.speed[s] * (1 + 1e-9), side="right")) - 1
        if last:
            ys = np.array([L]) if reach >= L else np.zeros(0, dtype=np.int64)
        else:
            ys = np.arange(x + 1, min(reach, L - (S - s - 1)) + 1)
            if alive is not None:
                ys = ys[alive[s + 1, ys]]
        if not ys.size:
            return True
        f, b, c, m = costs.stage(s, x, ys)
        t = load[r] + (f + b + c)
        if live is not None:
            acts = costs.act_prefix[ys] - costs.act_prefix[x]
            sums = partial[r][None, :] + acts[:, None] * live[r][:, s][None, :]  # (len(ys), K_r)
            ok = (t <= cap) & (mem[r] + m + sums.max(axis=1) <= costs.limits[r])
        else:
            ok = (t <= cap) & (mem[r] + m <= costs.limits[r])
        if not last:  # the work after y must fit in what the later ranks have left (communication only adds)
            room = later[s] @ ((cap - load) * rank_speed) - later[s, r] * (t - load[r]) * rank_speed[r]
            ok &= work[L] - work[ys] <= room * (1 + 1e-9)
        for idx in np.flatnonzero(ok).tolist():
            y = int(ys[idx])
            if last:
                found.append((*cuts, y))
                continue
            load2, mem2 = load.copy(), mem.copy()
            load2[r], mem2[r] = float(t[idx]), mem[r] + float(m[idx])
            partial2 = partial
            if live is not None:
                partial2 = tuple(sums[idx] if q == r else partial[q] for q in range(p))
            if not visit(s + 1, y, load2, mem2, [*cuts, y], partial2):
                return False
        return True

    start_partial = tuple(np.zeros(len(k)) for k in live) if live is not None else ()
    complete = visit(0, 0, np.zeros(p), np.zeros(p), [0], start_partial)
    return found if complete and len(found) <= most else None


def _best(splits: np.ndarray, steps: np.ndarray, keep: tuple[int, ...]) -> tuple[tuple[int, ...], float]:
    """The split with the lowest step; among steps within _TIE_REL of it, ``keep`` (the solver's split, which
    also has the least memory pressure) when it is one, else the lexicographically smallest."""
    low = float(steps.min())
    tied = [tuple(int(v) for v in row) for row in splits[steps <= low * (1 + _TIE_REL)]]
    return (keep if keep in tied else min(tied)), low


def _lowest_step(costs: SplitCosts, start: tuple[int, ...], cap: float, rounds: int,
                 other_starts: Sequence[tuple[int, ...]] = ()) -> dict[str, Any]:
    """The split with the lowest simulated step among those whose every rank's time per microbatch stays within
    ``cap`` and whose memory fits: every such split when there are few (exhaustive: exact for the simulator), else
    a descent from ``start`` (and then from each of ``other_starts`` that fits) moving one boundary at a time, best
    move first, while the step falls, for at most ``rounds`` moves each. Never returns a split slower than
    ``start``. All bounded by _TIE_* (at most _TIE_WORK schedule actions simulated)."""
    opts = costs.opts
    S = opts.num_chunks
    f, b, c, _ = costs.split(np.array([start]))
    step0 = float(costs.split_steps(np.array([start]), f, b, c)[0])
    budget = max(1, _TIE_WORK // (2 * S * opts.num_microbatches))  # splits we may simulate
    listed = _equal_bottleneck_splits(costs, cap, min(_TIE_SPLITS, budget)) if S > 1 else [start]
    best, step, evaluated, exhaustive = start, step0, 1, listed is not None
    if listed and S > 1:
        cand = np.array(listed)
        f, b, c, _ = costs.split(cand)
        best, step = _best(cand, costs.split_steps(cand, f, b, c), start)
        evaluated = len(listed)
        if step > step0 * (1 + _TIE_REL):  # the start was not listed: never trade it for a slower split
            best, step = start, step0
    if exhaustive:
        return {"boundaries": best, "step_s": step, "from_step_s": step0, "splits_evaluated": evaluated,
                "exhaustive": True}

    def fits(cand: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        f, b, c, mem = costs.split(cand)
        return (costs.rank_time(f, b, c).max(axis=1) <= cap) & np.all(mem <= costs.limits, axis=1), (f, b, c)

    seeds = [start]
    for other in other_starts:  # each further seed that fits and is not the start
        if len(other) == S + 1 and tuple(other) not in seeds and fits(np.array([other]))[0][0]:
            seeds.append(tuple(other))
    for seed in seeds:
        here = seed
        if seed != start:
            if evaluated >= budget:
                break
            _, (f, b, c) = fits(np.array([seed]))
            here_step = float(costs.split_steps(np.array([seed]), f, b, c)[0])
            evaluated += 1
        else:
            here_step = step0
        for _ in range(rounds):
            cur = np.array(here)
            # every single-boundary move, nearest first: boundary k to x, strictly between its neighbours
            ks = np.concatenate([np.full(cur[k + 1] - cur[k - 1] - 1, k) for k in range(1, S)])
            xs = np.concatenate([np.arange(cur[k - 1] + 1, cur[k + 1]) for k in range(1, S)])
            keep = xs != cur[ks]
            ks, xs = ks[keep], xs[keep]
            near = np.lexsort((xs, ks, np.abs(xs - cur[ks])))
            cand = np.repeat(cur[None, :], len(near), axis=0)
            cand[np.arange(len(near)), ks[near]] = xs[near]
            ok, (f, b, c) = fits(cand)
            pick = np.flatnonzero(ok)[: budget - evaluated]
            if not pick.size:
                break
            evaluated += pick.size
            new, low = _best(cand[pick], costs.split_steps(cand[pick], f[pick], b[pick], c[pick]), here)
            if low >= here_step * (1 - _TIE_REL):
                break
            here, here_step = new, low
        if here_step < step * (1 - _TIE_REL):
            best, step = here, here_step
    return {"boundaries": best, "step_s": step, "from_step_s": step0, "splits_evaluated": evaluated,
            "exhaustive": False}


def _tie_break(costs: SplitCosts, start: tuple[int, ...]) -> tuple[tuple[int, ...], dict[str, Any]]:
    """Among the splits whose bottleneck stays within the solver's (and whose memory fits), the one with the
    lowest simulated step: every such split when there are few (exhaustive), else a descent from the solver's
    split that moves one boundary at a time, best move first, while the step falls. Bounded by _TIE_*."""
    f, b, c, _ = costs.split(np.array([start]))
    cap = float(costs.rank_time(f, b, c).max()) * (1 + _TIE_REL)
    found = _lowest_step(costs, start, cap, _TIE_ROUNDS)
    return found["boundaries"], {"from_boundaries": list(start), "to_boundaries": list(found["boundaries"]),
                                 "from_step_s": found["from_step_s"], "to_step_s": found["step_s"],
                                 "splits_evaluated": found["splits_evaluated"], "exhaustive": found["exhaustive"]}


def _step_search(costs: SplitCosts, start: tuple[int, ...], step0: float) -> dict[str, Any]:
    """The split with the lowest simulated step, whatever its bottleneck, searched from the bottleneck-optimal
    split ``start`` (whose step is ``step0``). A rank runs its m forwards and backwards one after another, so a split
    whose step beats ``start``'s has every rank's forward + backward per microbatch within step / m: adding the most
    a rank's crossings can add, that caps the rank times the search lists (exhaustive when few splits pass it, else
    descents from ``start``, the uniform split and the parameter-balanced one)."""
    from stageplan import baselines

    opts, arr = costs.opts, costs.arr
    S, L, m = opts.num_chunks, costs.num_layers, opts.num_microbatches
    crossings = opts.virtual_stages * 2.0 * float(costs.comm.max()) if costs.comm.size else 0.0
    cap = (step0 / m + crossings) * (1 + 1e-9)
    seeds = [tuple(baselines.partition_uniform(L, S)), tuple(baselines.partition_balanced(arr.param_bytes, S))]
    found = _lowest_step(costs, start, cap, _STEP_ROUNDS, seeds)
    to = found["boundaries"]
    f, b, c, _ = costs.split(np.array([start, to]))
    bottleneck = costs.rank_time(f, b, c).max(axis=1)
    return {"from_boundaries": list(start), "to_boundaries": list(to), "from_step_s": step0, "to_step_s": found["step_s"],
            "from_bottleneck_s": float(bottleneck[0]), "to_bottleneck_s": float(bottleneck[1]),
            "rank_time_cap_s": cap, "splits_evaluated": found["splits_evaluated"], "exhaustive": found["exhaustive"]}


def _one_layer_note(profile: Profile, arr: LayerArrays, opts: CostOptions, bubble_fraction: float) -> str | None:
    """When one layer bounds the step (largest layer >= total / p, so the lower bound is that layer), say so:
    a balance efficiency of 1.000 then means "as good as that layer allows", not "no time lost". A note, not a
    warning: the options are valid and the plan is the best they allow (only notes about the bubble warn)."""
    from stageplan.solver import lower_bound

    times = layer_time(arr, opts)
    speeds = [d.speed for d in opts.devices]
    big = int(np.argmax(times))
    largest = float(times[big]) / max(speeds)  # the lower bound's second term (solver.lower_bound)
    share = math.fsum(times.tolist()) / sum(speeds)  # and its first: total / p
    if opts.num_ranks < 2 or lower_bound(times, speeds) > largest:
        return None
    return (f"one layer bounds the step: {profile.names[big]!r} takes {largest * 1e3:.3f} ms per microbatch, at least "
            f"total / p = {share * 1e3:.3f} ms, so no split can beat it and balance efficiency is measured against it; "
            f"the ranks still sit idle {bubble_fraction:.0%} of the step; what helps: finer --layers (profile "
            f"that layer as several), fewer stages, or splitting the layer itself (e.g. a vocabulary-parallel head)")


OBJECTIVES = ("bottleneck", "step")


def check_objective(objective: object, method: str | None = None) -> None:
    """Refuse an unknown objective, and "step" with a method that fixes the split (uniform, parameters)."""
    if objective not in OBJECTIVES:
        raise StageplanError(f"objective {objective!r} is unknown; use bottleneck (the least slowest stage, the default) "
                             "or step (the lowest predicted step), e.g. --objective step")
    if objective == "step" and method in ("uniform", "parameters"):
        raise StageplanError(f"objective 'step' chooses among splits, but method {method!r} fixes the split; drop "
                             "--objective step, or plan with --method optimal")


def _optimal_split(arr: LayerArrays, opts: CostOptions, objective: str, time_limit_s: float, report: bool = True
                   ) -> tuple[tuple[int, ...], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The optimal method's split: the solver's (least bottleneck), the tie-break among equal bottlenecks, then the
    search for the lowest step whatever the bottleneck, which ``objective`` "step" takes and "bottleneck" only
    reports (skipped there when ``report`` is False: only the split is wanted). Returns the split, the solver's
    evidence, the tie-break's and the step search's."""
    boundaries, solver_evidence = _boundaries("optimal", arr, opts, time_limit_s=time_limit_s)
    costs = SplitCosts(arr, opts)
    boundaries, tie = _tie_break(costs, boundaries)
    wanted = opts.num_chunks > 1 and (objective == "step" or report)
    search = _step_search(costs, boundaries, tie["to_step_s"]) if wanted else {}
    if search:
        search["objective"] = objective
        if objective == "step":
            boundaries = tuple(search["to_boundaries"])
    return boundaries, solver_evidence, tie, search


def _step_search_note(search: dict[str, Any]) -> str | None:
    """What the step search says in the plan's notes: under objective "step", how far it moved the split; under
    "bottleneck", a faster split it found (at least _FASTER_NOTE faster), with what it costs in bottleneck."""
    if not search or search["to_boundaries"] == search["from_boundaries"]:
        return None
    how = f"{search['splits_evaluated']} splits simulated, {'every one that could' if search['exhaustive'] else 'descents'}"
    gain = search["to_step_s"] / search["from_step_s"] if search["from_step_s"] > 0 else 1.0
    moves = (f"predicted step {search['from_step_s'] * 1e3:.3f} -> {search['to_step_s'] * 1e3:.3f} ms ({gain:.3f}x), "
             f"bottleneck {search['from_bottleneck_s'] * 1e3:.3f} -> {search['to_bottleneck_s'] * 1e3:.3f} ms")
    if search["objective"] == "step":
        return (f"objective step: the lowest predicted step, not the least bottleneck: {moves} ({how}; the "
                f"least-bottleneck split was {search['from_boundaries']})")
    if gain > 1 - _FASTER_NOTE:
        return None
    return (f"a split with a larger bottleneck predicts a faster step: {search['to_boundaries']}, {moves} ({how}); "
            "the slowest stage per microbatch is not the whole step here (the optimizer steps, the tied-gradient "
            "sync, the fill and the drain are not in it): --objective step (objective='step') plans for the step")


def _versus_optimal(arr: LayerArrays, opts: CostOptions, ev: Any, given_as: str, given_input: Any,
                    time_limit_s: float = 2.0, objective: str = "bottleneck") -> dict[str, Any]:
    """How far a given split is from the optimal plan under the same options: bottleneck and predicted step
    ratios (given / optimal) and memory per rank (need, limit, headroom = limit - need)."""
    limits = [d.memory_limit_bytes for d in opts.devices]
    need = [float(x) for x in ev.rank_memory_bytes]
    out: dict[str, Any] = {
        "given_as": given_as, "given": given_input, "rank_memory_bytes": need, "memory_limit_bytes": limits,
        "memory_headroom_bytes": [None if lim is None else lim - n for lim, n in zip(limits, need)],
    }
    try:
        best, _, _, _ = _optimal_split(arr, opts, objective, time_limit_s, report=False)
    except InfeasiblePlanError as exc:
        out.update(optimal_boundaries=None, optimal_infeasible=str(exc))
        return out
    opt = evaluate(arr, best, opts)
    out.update(
        optimal_boundaries=list(best), optimal_bottleneck_s=opt.bottleneck_s, optimal_predicted_step_s=opt.predicted_step_s,
        bottleneck_ratio=ev.bottleneck_s / opt.bottleneck_s if opt.bottleneck_s > 0 else 1.0,
        step_ratio=ev.predicted_step_s / opt.predicted_step_s if opt.predicted_step_s > 0 else 1.0,
        optimal_rank_memory_bytes=[float(x) for x in opt.rank_memory_bytes],
    )
    return out


def _make_plan(profile: Profile, arr: LayerArrays, opts: CostOptions, method: str, meta_extra: dict[str, Any],
               given: tuple[int, ...] | None = None, given_as: str = "boundaries", given_input: Any = None,
               time_limit_s: float = 2.0, objective: str = "bottleneck") -> Plan:
    tie: dict[str, Any] = {}
    search: dict[str, Any] = {}
    if method == "optimal":
        boundaries, solver_evidence, tie, search = _optimal_split(arr, opts, objective, time_limit_s)
    else:
        boundaries, solver_evidence = _boundaries(method, arr, opts, given, given_as, time_limit_s)
    ev = evaluate(arr, boundaries, opts, profile.names)
    notes = list(ev.notes)
    if tie and tie["to_boundaries"] != tie["from_boundaries"]:
        how = "every one of them" if tie["exhaustive"] else "a descent from the solver's split"
        notes.append(f"tie-break among equal-bottleneck splits: predicted step {tie['from_step_s'] * 1e3:.3f} ms -> "
                     f"{tie['to_step_s'] * 1e3:.3f} ms ({tie['splits_evaluated']} splits simulated, {how}; the solver's "
                     f"split was {tie['from_boundaries']})")
    searched = _step_search_note(search)
    if searched:
        notes.append(searched)
    one_layer = _one_layer_note(profile, arr, opts, ev.bubble_fraction)
    if one_layer:
        notes.append(one_layer)
    versus = (_versus_optimal(arr, opts, ev, given_as, given_input, time_limit_s, objective) if method == "given"
              else {})
    label = estimate_label(profile.meta)
    if label:
        notes.insert(0, label)
    if solver_evidence.get("optimal") is False:
        gap = ev.bottleneck_s / solver_evidence["proven_lower_bound_s"]
        if solver_evidence.get("timed_out", True):
            notes.append(f"interleaved solve hit its time limit ({time_limit_s:g} s): within {gap:.3f}x of the proven "
                         "optimum; a longer --time-limit may close the gap")
        else:  # HiGHS ended otherwise (numerical trouble, or its split missed the exact memory check by its tolerance)
            notes.append(f"interleaved split not proven optimal: the MILP ended without a proof it could use, before "
                         f"its time limit; the split kept is within {gap:.3f}x of the proven lower bound")
    mb = int(meta_extra.get("microbatch_size") or profile.meta.get("microbatch_size") or 1)
    cost_options = {"method": method, **({"objective": objective} if method in ("optimal", "given") else {}),
                    **opts.to_json(), "microbatch_size": mb, **solver_evidence}
    meta_keys = ("model", "layers_arg", "named_layers", "split_method", "microbatch_size", "batch_size", "device", "dtype",
                 "timer", "estimate", "processes", "order")
    pmeta = {k: profile.meta[k] for k in meta_keys if k in profile.meta}
    pmeta["factory_options"] = dict(profile.meta.get("factory_options", profile.meta.get("options")) or {})
    pmeta.update(meta_extra)
    step = ev.predicted_step_s
    return Plan(
        boundaries=tuple(boundaries), layer_names=tuple(profile.names), stages=ev.stages, bottleneck_s=ev.bottleneck_s,
        lower_bound_s=ev.lower_bound_s, balance_efficiency=ev.balance_efficiency, predicted_step_s=step,
        bubble_fraction=ev.bubble_fraction,
        throughput_samples_s=opts.num_microbatches * mb / step if step > 0 else math.inf,
        rank_time_s=ev.rank_time_s, rank_memory_bytes=ev.rank_memory_bytes,
        rank_peak_activation_bytes=ev.rank_peak_activation_bytes,
        cost_options=cost_options, profile_digest=profile.digest(), profile_meta=pmeta, notes=tuple(notes),
        tie_break=tie, step_search=search, versus_optimal=versus,
    )


def _given_split(prof: Profile, method: str | None, boundaries: Sequence[int] | None, megatron_layout: str | None,
                 fqns: Sequence[Sequence[str]] | str | os.PathLike[str] | None
                 ) -> tuple[tuple[int, ...] | None, str, Any]:
    """The split the user gave (boundaries, a Megatron layout or torchtitan FQNs) as boundaries, which of the
    three it was, and the input as given (JSON-ready); (None, "", None) when none was given."""
    named = [k for k, v in (("boundaries", boundaries), ("megatron_layout", megatron_layout), ("fqns", fqns))
             if v is not None]
    if len(named) > 1:
        raise StageplanError(f"got {' and '.join(named)}: each gives a split to score; pass only one of boundaries, "
                             "megatron_layout and fqns")
    if not named:
        return None, "", None
    if method is not None:
        raise StageplanError(f"method {method!r} chooses a split but {named[0]} gives one; drop one of them (a given "
                             "split is scored against the optimal plan in any case)")
    if boundaries is not None:
        try:
            return tuple(int(b) for b in boundaries), "boundaries", [int(b) for b in boundaries]
        except (TypeError, ValueError):
            raise StageplanError(f"boundaries must be whole numbers, got {boundaries!r}; e.g. --boundaries 0,5,10") from None
    if megatron_layout is not None:
        if not isinstance(megatron_layout, str):
            raise StageplanError(f"megatron_layout must be a string such as 'E,t*4|t*4,L', got {megatron_layout!r}")
        return (boundaries_from_megatron(megatron_layout, prof.names, named_layers(prof.names, prof.meta)),
                "megatron_layout", megatron_layout)
    assert fqns is not None
    parts = _read_fqns(fqns) if isinstance(fqns, (str, os.PathLike)) else fqns
    bounds = boundaries_from_module_fqns(parts, prof.names)  # checks the shape before anything is copied
    return bounds, "fqns", [list(part) for part in parts]


def _read_fqns(path: str | os.PathLike[str]) -> Any:
    """torchtitan's module_fqns_per_model_part from a JSON file: the list itself, or an object holding it under
    that key (as --export torchtitan prints the list)."""
    import json
    from pathlib import Path

    p = Path(path)
    if not str(path).strip() or p.is_dir():
        raise StageplanError(f"--fqns {str(path)!r} is {'a folder' if str(path).strip() else 'empty'}; give the JSON "
                             "file of the parts, e.g. from stageplan plan PROFILE.json --stages N --export torchtitan "
                             "> FQNS.json")
    if not p.is_file():
        raise StageplanError(f"FQN file {str(p)!r} does not exist; write the parts there, e.g. with "
                             "stageplan plan PROFILE.json --stages N --export torchtitan > FQNS.json")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        why = "nests deeper than Python reads" if isinstance(exc, RecursionError) else f"is not valid JSON ({exc})"
        raise StageplanError(f"FQN file {str(p)!r} {why}; write a JSON list of lists of module FQNs") from None
    if isinstance(data, dict) and "module_fqns_per_model_part" in data:
        data = data["module_fqns_per_model_part"]
    return data


def estimate_label(meta: dict[str, Any]) -> str | None:
    """The words that mark figures computed from an analytic estimate rather than measured."""
    if meta.get("timer") != "analytic":
        return None
    gpu = (meta.get("estimate") or {}).get("gpu") or str(meta.get("device", "")).removeprefix("estimate:")
    return (f"ESTIMATE: times are analytic (roofline) for {gpu or 'a GPU'}, not measured; roughly +-25% in absolute "
            "time, ratios between layers are steadier")


# What every chunk pays whatever its layers, as the link's schedule probe measures it (link.schedule_overheads):
# torch's loop around each forward and backward, and PipelineStage's own code inside them. CostOptions fields.
OVERHEADS = ("action_s", "chunk_forward_s", "chunk_backward_s")
# The all-reduce the link probe timed (link.allreduce_probe), as the ring model's constants: CostOptions fields,
# None where the link did not time it (then the tied sync is priced from the point-to-point link)
COLLECTIVE = ("allreduce_latency_s", "allreduce_bandwidth_bytes_per_s")


def _measured_link(link: Mapping[str, Any] | str | os.PathLike[str], calibration: Mapping[str, Any]
                   ) -> tuple[float, float, str, str, float, dict[str, Any]]:
    """Bandwidth (bytes/s), per-crossing delay (s), where the delay came from, the plan's note, the one-way
    latency (s, for collectives) and the schedule probe's seconds per chunk (:data:`OVERHEADS`; 0 where the probe
    did not time them: links measured before it, a single rank, CUDA) with the all-reduce's constants
    (:data:`COLLECTIVE`, None where the probe did not time it), from a LINK.json or its dict.

    For a profile calibrated from a run (``calibration``, its ``meta["calibration"]``), the link prices the
    boundaries (its bandwidth and crossing delay replace the fitted one), but the chunk overheads stay the run's,
    since its layers were calibrated net of them (another probe's would move every rank's compute off what the run
    measured), and so does the tied all-reduce where calibrate scaled it to the sum the run took
    (``tied_sync_ratio``): the sum inside the pipeline held steadier than the probe's (README, Limitations)."""
    from stageplan.link import crossing_s, load_link

    measured = load_link(link)
    bw, latency_s = measured["bandwidth_bytes_per_s"], crossing_s(measured)
    where = f" in {str(link)!r}" if not isinstance(link, Mapping) else ""
    pairs = len(measured.get("pairs", []))
    how = (f"measured by stageplan link ({measured.get('backend', 'unknown backend')}, {pairs} "
           f"pair{'' if pairs == 1 else 's'}){where}")
    note = f"link bandwidth {bw / 1e9:.3g} GB/s one way prices the boundary bytes, {how}"  # the latency has its own note
    calibrated_latency_s = float(calibration.get("boundary_latency_s", 0.0))
    if calibrated_latency_s > 0:
        note += f"; it replaces the profile's calibrated {calibrated_latency_s * 1e3:.3f} ms per crossing"
    # a crossing costs what the schedule's fused send/receive took, where the link timed it (above the latency)
    kind = "a fused send/receive exchange" if latency_s > measured["latency_s"] else "the one-way latency"
    overheads: dict[str, Any] = {k: float(measured.get(k) or 0.0) for k in OVERHEADS}
    if calibration:
        overheads = {k: float(calibration.get(k, 0.0)) for k in OVERHEADS}
        note += (f"; the chunk overheads stay the calibrating run's, which the calibrated layers are net of (torch's "
                 f"loop {overheads['action_s'] * 1e3:.3f} ms per action, PipelineStage "
                 f"{overheads['chunk_forward_s'] * 1e3:.3f} + {overheads['chunk_backward_s'] * 1e3:.3f} ms per chunk)")
    else:
        missing = [k for k in OVERHEADS if measured.get(k) is None]
        if missing:
            note += (f"; this link's schedule probe has no {', '.join(missing)}: what torch's loop and PipelineStage "
                     "spend around each chunk's layers is not priced in full; measure it again with stageplan link")
    kept = calibration.get("tied_sync_ratio") is not None and calibration.get("allreduce_bandwidth_bytes_per_s") is not None
    source = calibration if kept else measured
    overheads.update({k: source.get(k) for k in COLLECTIVE})
    if overheads["allreduce_bandwidth_bytes_per_s"] is not None:
        p = int(measured.get("allreduce_ranks") or 2) if not kept else 2
        fixed = overheads["allreduce_latency_s"] * 2 * (p - 1)
        rate = overheads["allreduce_bandwidth_bytes_per_s"] * p / (2 * (p - 1))
        whose = (f"as the calibrating run's last rank to reach the sum took it ({float(calibration['tied_sync_ratio']):.3f}x "
                 "its price then), not from this link's probe" if kept else "from the link's own all-reduce")
        note += (f"; a tied gradient's all-reduce is priced {whose} ({fixed * 1e3:.3f} ms + "
                 f"bytes / {rate / 1e9:.3g} GB/s at {p} ranks, scaled as a ring to other rank counts)")
    return bw, latency_s, f"{kind} {how}", note, measured["latency_s"], overheads


def _estimated_link(meta: dict[str, Any]) -> tuple[float | None, str | None]:
    """The documented default for a profile estimated for a GPU: its link within a node from gpus.json (NVLink
    or xGMI, one way to one peer), and the note naming the figure, its source and the link across nodes."""
    import json
    from importlib import resources

    table = json.loads(resources.files("stageplan").joinpath("gpus.json").read_text(encoding="utf-8"))
    gpu = str((meta.get("estimate") or {}).get("gpu") or str(meta.get("device", "")).removeprefix("estimate:")).lower()
    row = table["gpus"].get(gpu)
    if row is None:
        return None, None
    intra, inter = row["intra_node"], row.get("inter_node", table["inter_node_default"])
    bw = float(intra["bandwidth"])
    note = (f"no link given: boundaries priced at {gpu}'s link within a node, {intra['name']}, "
            f"{bw / 1e9:.0f} GB/s one way ({intra['source']}); latency not modelled; across nodes "
            f"{inter['name']} would apply, {float(inter['bandwidth']) / 1e9:.0f} GB/s ({inter['source']}): "
            f"plan with --bandwidth {float(inter['bandwidth']) / 1e9:.0f}GB/s, or --link LINK.json measured there")
    return bw, note


def _rescaled(profile: Profile, factor: float) -> Profile:
    """The profile at ``factor`` x its microbatch size, assuming time and activations linear in the batch
    (an extrapolation: see FIELD.md, pipedream #47; re-profile at the chosen size to confirm)."""
    from dataclasses import replace

    layers = tuple(replace(x, forward_s=x.forward_s * factor, backward_s=x.backward_s * factor,
                           backward_accumulate_s=None if x.backward_accumulate_s is None else x.backward_accumulate_s * factor,
                           activation_bytes=int(x.activation_bytes * factor), output_bytes=int(x.output_bytes * factor))
                   for x in profile.layers)
    return Profile(layers, dict(profile.meta))


def plan(
    profile: Profile | str | os.PathLike[str],
    num_ranks: int,
    *,
    num_microbatches: int | str | None = None,
    schedule: str = "1F1B",
    virtual_stages: int = 1,
    memory_limit: float | str | None = None,
    bandwidth: float | str | None = None,
    optimizer: str = "adam",
    devices: Sequence[Device | float] | None = None,
    recompute: bool = False,
    method: str | None = None,
    boundaries: Sequence[int] | None = None,
    precision: str | None = None,
    megatron_layout: str | None = None,
    fqns: Sequence[Sequence[str]] | str | os.PathLike[str] | None = None,
    link: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    time_limit_s: float = 2.0,
    objective: str = "bottleneck",
) -> Plan:
    """Choose stage boundaries for ``profile`` on ``num_ranks`` pipeline ranks and predict the step.

    ``method`` is "optimal" (the default: the exact min-max split; among splits with that bottleneck, the one
    with the lowest simulated step), "uniform" or "parameters". Or score the split you run today (method
    "given", the same evidence, plus ``plan.versus_optimal``: bottleneck and step ratios to the optimal plan
    under the same options and memory headroom per rank), given by exactly one of ``boundaries``
    (``(0, b1, ..., L)``), ``megatron_layout`` (Megatron's ``--pipeline-model-parallel-layout``, e.g.
    ``"E,t*4|t*4,L"``: E the first layer, t each named block, L the last layer) or ``fqns`` (torchtitan's
    ``module_fqns_per_model_part``, or the path of a JSON file holding it).

    ``num_microbatches`` defaults to the profiled batch / microbatch size; ``"auto"`` tries every divisor of
    the profiled batch (times scaled linearly from the profiled microbatch size) and ``schedule="auto"``
    tries GPipe, 1F1B and Interleaved1F1B; the plan keeps the fastest feasible candidate and lists them all.
    ``memory_limit`` ("40GiB" or bytes) applies to every rank without its own; ``bandwidth`` ("25GB/s" or
    bytes/s) prices boundary traffic; ``devices`` are speeds relative to the profiled device (or Device);
    ``precision`` (fp32, bf16, bf16-mixed, fp16-mixed) sets the bytes per parameter training holds (16 with
    Adam in mixed precision), else the profiled parameters' bytes are used.

    ``link`` (a LINK.json written by ``stageplan link``, or its dict) prices the boundaries with the measured
    link instead of ``bandwidth``: its bandwidth as ``bandwidth`` would, and its fused send/receive exchange (its
    latency where the link has no exchange, :func:`stageplan.link.crossing_s`) as the delay of every boundary
    crossing, its ``action_s`` (torch's schedule loop per chunk action) around every forward and backward, and its
    ``chunk_forward_s`` and ``chunk_backward_s`` (PipelineStage's own code inside each chunk call) in every chunk's
    forward and backward. A profile calibrated from a run keeps that run's chunk overheads with a link or without
    (its layers were calibrated net of them), and its tied all-reduce where calibrate scaled it to the sum the run
    took; without a link it keeps the run's crossing delay too, and with one the link's replaces it. A profile
    estimated for a GPU (``--device estimate:GPU``) planned with neither gets that GPU's link within a node from
    gpus.json (NVLink or xGMI), said in a note.

    ``objective`` is what the optimal method minimises. "bottleneck" (the default): the slowest rank's time per
    microbatch, exactly, then the lowest simulated step among splits with that bottleneck. "step": the lowest
    simulated step whatever the bottleneck; the step also holds the optimizer steps, the tied-gradient sync and the
    pipeline's fill and drain, so a split with a larger bottleneck can be faster. Both search the step from the
    bottleneck-optimal split (``plan.step_search``: exhaustive over every split that could beat it when few can,
    else descents); under "bottleneck" a split found at least 1% faster is named in a note. With a given split, the
    objective chooses the optimal plan it is scored against.

    ``time_limit_s`` bounds each MILP solve of an interleaved or V plan (``virtual_stages`` > 1; HiGHS): a plan
    that hits it says how far from the proven optimum it may be, and a tight memory limit may need longer to
    find any split that fits.

    Example (no torch needed)::

        >>> from stageplan import LayerProfile, Profile, plan
        >>> prof = Profile(tuple(LayerProfile(f"l{i}", t, t, 0, 0, 0) for i, t in enumerate([1, 2, 3, 4, 5, 6])))
        >>> plan(prof, 2, num_microbatches=4).boundaries
        (0, 4, 6)
    """
    prof = _as_profile(profile)
    given, given_as, given_input = _given_split(prof, method, boundaries, megatron_layout, fqns)
    if given is not None:
        method = "given"
    elif method is None:
        method = "optimal"
    elif method not in METHODS:
        raise StageplanError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    check_objective(objective, method)
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, numbers.Real) or not 0 < time_limit_s < math.inf:
        raise StageplanError(f"the solver's time limit must be a finite number of seconds > 0, got {time_limit_s!r}; "
                             "e.g. --time-limit 20 (time_limit_s=20)")
    time_limit_s = float(time_limit_s)
    limit = parse_bytes(memory_limit) if memory_limit is not None else None
    bw = parse_bandwidth(bandwidth) if bandwidth is not None else None
    latency_s = float(prof.meta.get("calibration", {}).get("boundary_latency_s", 0.0))
    link_latency_s = float(prof.meta.get("calibration", {}).get("link_latency_s", 0.0))  # the calibrating run's link
    calibration = prof.meta.get("calibration", {})
    overheads: dict[str, Any] = {k: float(calibration.get(k, 0.0)) for k in OVERHEADS}  # and its schedule probe
    overheads.update({k: calibration.get(k) for k in COLLECTIVE})  # and its all-reduce
    latency_source = "fitted by calibrate from a run"
    link_note = None
    if link is not None:
        if bandwidth is not None:
            raise StageplanError("link and bandwidth both price the boundaries (--link and --bandwidth); give one: "
                                 "--link LINK.json for the measured link, or --bandwidth RATE")
        bw, latency_s, latency_source, link_note, link_latency_s, overheads = _measured_link(link, calibration)
    elif bw is None and estimate_label(prof.meta):
        bw, link_note = _estimated_link(prof.meta)
    devs = _devices(devices)
    LayerArrays.of(prof)  # refuses NaN or negative costs before any candidate is tried
    if len(prof) == 0:
        raise StageplanError("the profile has no layers; profile a model first (stageplan profile MODEL -o PROFILE.json)")
    batch = int(prof.meta["batch_size"]) if prof.meta.get("batch_size") else 0
    mb0 = int(prof.meta.get("microbatch_size") or 1)

    schedules = ["1F1B", "GPipe", "Interleaved1F1B"] if schedule == "auto" else [schedule]
    if num_microbatches == "auto":
        if not batch:
            raise StageplanError("num_microbatches='auto' needs the global batch size in the profile meta (batch_size); "
                                 "pass a number of microbatches instead")
        ms = [m for m in range(1, batch + 1) if batch % m == 0]
    elif num_microbatches is None:
        ms = [batch // mb0 if batch and batch % mb0 == 0 else 2 * num_ranks]
    elif isinstance(num_microbatches, str):
        raise StageplanError(f"num_microbatches must be an integer or 'auto', got {num_microbatches!r}")
    else:
        ms = [num_microbatches]

    auto = len(ms) * len(schedules) > 1
    candidates: list[dict[str, Any]] = []
    best: Plan | None = None
    last_error: StageplanError | None = None
    for sched in schedules:
        for m in ms:
            # auto tries single-stage schedules too: they run v = 1; a schedule named by the user gets v as given (refused if it cannot)
            v = virtual_stages if schedule != "auto" or normalize_schedule(sched) not in ("GPipe", "1F1B") else 1
            try:
                mb = batch // m if num_microbatches == "auto" else mb0
                prof_m = _rescaled(prof, mb / mb0) if mb != mb0 else prof
                arr = LayerArrays.of(prof_m, m)
                opts = make_options(prof_m, num_ranks, num_microbatches=m, schedule=sched, virtual_stages=v,
                                    optimizer=optimizer, bandwidth_bytes_per_s=bw, devices=devs,
                                    memory_limit_bytes=limit, recompute=recompute, precision=precision,
                                    boundary_latency_s=latency_s, latency_source=latency_source,
                                    link_latency_s=link_latency_s, action_s=overheads["action_s"],
                                    chunk_forward_s=overheads["chunk_forward_s"],
                                    chunk_backward_s=overheads["chunk_backward_s"],
                                    allreduce_latency_s=overheads["allreduce_latency_s"],
                                    allreduce_bandwidth_bytes_per_s=overheads["allreduce_bandwidth_bytes_per_s"])
                cand = _make_plan(prof, arr, opts, method, {"microbatch_size": mb}, given, given_as, given_input,
                                  time_limit_s, objective)
                if link_note:
                    cand = dataclasses.replace(cand, notes=(*cand.notes, link_note))
            except StageplanError as exc:
                if not auto:
                    raise
                # a memory limit no split meets says more than a candidate the schedule cannot run (m < p, too
                # few layers for its chunks): keep the first kind once seen
                if last_error is None or not isinstance(last_error, InfeasiblePlanError) or isinstance(
                        exc, InfeasiblePlanError):
                    last_error = exc
                candidates.append({"schedule": sched, "num_microbatches": m, "feasible": False, "reason": str(exc)})
                continue
            over = [n for n in cand.notes if "over its limit" in n]
            candidates.append({"schedule": cand.schedule, "num_microbatches": m, "virtual_stages": cand.virtual_stages,
                               "microbatch_size": mb, "feasible": not over, "predicted_step_s": cand.predicted_step_s,
                               "bottleneck_s": cand.bottleneck_s, "bubble_fraction": cand.bubble_fraction,
                               **({"reason": "; ".join(over), "peak_bytes": max(cand.rank_memory_bytes)} if over else {})})
            if over and auto:
                continue
            if best is None or cand.predicted_step_s < best.predicted_step_s - 1e-15:
                best = cand
    if best is None:
        over_limit = [c for c in candidates if "peak_bytes" in c]
        if over_limit:  # every candidate that could be priced was over a limit: that, not the others' errors, is why
            closest = min(over_limit, key=lambda c: c["peak_bytes"])
            raise InfeasiblePlanError(
                f"no candidate of the {len(candidates)} tried ({', '.join(schedules)}; m in {ms}) fits the memory limits "
                f"with method {method}; the closest, {closest['schedule']} with {closest['num_microbatches']} "
                f"microbatch{'es' * (closest['num_microbatches'] != 1)}: {closest['reason']}; raise --memory-limit, add --stages or add --recompute"
                + ("" if method == "optimal" else ", or let the optimal method move the boundaries"))
        assert last_error is not None  # every candidate raised, and auto kept the last error
        raise last_error
    if auto:
        notes = list(best.notes)
        if num_microbatches == "auto" and best.cost_options["microbatch_size"] != mb0:
            notes.append(f"times scaled linearly from microbatch size {mb0} to {best.cost_options['microbatch_size']}; "
                         "re-profile at that size to confirm")
        best = dataclasses.replace(best, candidates=tuple(candidates), notes=tuple(notes))
    mb_best, m_best = int(best.cost_options["microbatch_size"]), best.num_microbatches
    if batch and mb_best * m_best != batch:
        fits = f"plan --microbatches {batch // mb_best}, or " if batch % mb_best == 0 else ""
        redo = (f"profile at --microbatch-size {batch // m_best} and plan that"
                if batch % m_best == 0 else f"build the model with a batch of {mb_best * m_best}")
        best = dataclasses.replace(best, notes=(*best.notes, (
            f"this plan prices {m_best} microbatches of {mb_best} sample{'s' * (mb_best != 1)}, a batch of {mb_best * m_best}, and the "
            f"profiled model's batch is {batch}: stageplan run splits the model's own batch, so to run this model "
            f"{fits}{redo}")))
    for note in best.notes:
        if "bubble" in note:
            warnings.warn(note, PlanNote, stacklevel=2)
    return best


# ------------------------------------------------------------------------------------------------------
# Running and calibrating


def calibrate(profile: Profile | str | os.PathLike[str], report: RunReport | str | os.PathLike[str]) -> Profile:
    """Rescale each layer's forward and backward times to what the run measured of that layer inside the real
    schedule (the executor's per-layer clock), so the next plan starts from the run.

    A rank's time outside its layers (PipelineStage's receive, flatten, detach, send) is shared out over its layers
    in proportion to their measured time, so a rank's calibrated compute equals its measured compute. A report
    without per-layer figures (written before the clock existed), a run with recomputation and a zero-bubble run
    are calibrated per rank: every layer of a rank by that rank's measured / predicted compute. The result's
    ``meta["calibration"]`` says which, gives the factors, and keeps the raw (never calibrated) profile's digest
    through repeated calibrations. Where the run timed a priced tied-gradient sum, the all-reduce's constants are
    scaled to what it took on the rank that reached it last (``tied_sync_ratio``; :func:`_tied_sync_as_run`)."""
    prof = _as_profile(profile)
    rep = report if isinstance(report, RunReport) else RunReport.load(report)
    names = rep.plan.get("layer_names")
    if (names is not None and list(names) != prof.names) or rep.plan["boundaries"][-1] != len(prof):
        raise StageplanError(
            "the run report was made from a plan over other layers than this profile's; "
            "calibrate the profile that the run's plan was made from"
        )
    label = estimate_label(prof.meta)
    if label:
        raise StageplanError(f"calibrate puts a run's measured times on the footing of a profile measured alike, and this "
                             f"profile is an analytic estimate ({label}); calibrate the profile measured here that the "
                             "run's plan was made from")
    planned = rep.plan.get("profile_meta") or {}
    for key in ("model", "device", "dtype", "factory_options"):  # same layer names, another model or footing
        if key in planned and key in prof.meta and json.dumps(planned[key], sort_keys=True, default=str) != json.dumps(
                prof.meta[key], sort_keys=True, default=str):
            raise StageplanError(f"the run's plan was made from a profile with {key} = {planned[key]!r}, and this profile "
                                 f"has {key} = {prof.meta[key]!r}; calibrate the profile that the run's plan was made from")
    for row in rep.ranks:
        pred, meas = row["predicted_compute_s"], row["measured_compute_s"]
        if not (pred > 0 and meas > 0 and math.isfinite(meas)):
            raise StageplanError(f"rank {row['rank']} has no usable measurement (predicted {pred}, measured {meas}); rerun with more --steps")
    m = int(rep.plan["num_microbatches"])
    why_not = _why_not_per_layer(prof, rep)
    if why_not is None:
        fwd, bwd = _layer_factors(prof, rep, m)
        how: dict[str, Any] = {"per": "layer", "forward_factors": fwd, "backward_factors": bwd}
    else:
        fwd = bwd = _rank_factors(prof, rep)
        how = {"per": "rank", "why": why_not, "rank_factors": [row["measured_compute_s"] / row["predicted_compute_s"]
                                                               for row in sorted(rep.ranks, key=lambda r: r["rank"])]}
    out, stepped = _optimizer_as_run(prof.scaled(fwd, bwd), rep)
    arr, opts = _replay_options(out, rep)
    opts, collective = _tied_sync_as_run(arr, opts, rep)
    latency = _fit_boundary_latency(arr, opts, rep)
    meta = dict(out.meta)
    before = prof.meta.get("calibration") or {}
    link_latency = float((rep.link or {}).get("latency_s") or 0.0)
    meta["calibration"] = {**how, "boundary_latency_s": latency, "link_latency_s": link_latency,
                           **_run_overheads(rep), **collective, **stepped,
                           "from_profile_digest": prof.digest(),
                           # a profile calibrated before raw_profile_digest existed names only what it came from
                           "raw_profile_digest": before.get("raw_profile_digest",
                                                            before.get("from_profile_digest", prof.digest())),
                           "rounds": int(before.get("rounds", 0)) + 1, "run_plan": rep.plan}
    return Profile(out.layers, meta)


def _optimizer_as_run(prof: Profile, rep: RunReport) -> tuple[Profile, dict[str, Any]]:
    """The profile with the run's optimizer's per-layer step figures scaled, rank by rank, to what each rank's
    ``optimizer.step()`` took in the run, and what calibrate records of it.

    A rank steps all its layers in one call, so the run gives one figure per rank: each of its layers' figure above
    the step's fixed cost (the profile's ``floor_s``, which the rank pays once) is scaled by (measured - floor) /
    the sum of those figures, so the rank's priced step equals the measured one (on the profile's footing: times
    the rank's device speed). The profiler times each layer's step alone from a flushed cache; inside the runs of
    stop 28 the step above the fixed cost read 0.64-0.66x that on HF GPT-2's first rank and 1.15-1.25x on its last
    (README, Limitations). Only the optimizer
    the run used is scaled (a plan of the calibrated profile with another optimizer prices the profiled figures).
    Nothing changes where the run used no optimizer, the profile did not measure it, or the report did not time the
    step apart: ``measured_optimizer_step_s``, else the rank's time after its schedule less its timed tied sum."""
    opt = str(rep.run_options.get("optimizer") or (rep.plan.get("cost_options") or {}).get("optimizer") or "sgd").lower()
    if opt == "none" or any(x.optimizer_s is None or not is_number(x.optimizer_s.get(opt)) for x in prof.layers):
        return prof, {}
    measured: dict[int, float] = {}
    for row in rep.ranks:
        took = row.get("measured_optimizer_step_s")
        if took is None and row.get("measured_tied_sync_s") is not None and row.get("optimizer_s") is not None:
            took = float(row["optimizer_s"]) - float(row["measured_tied_sync_s"])
        if took is None or not is_number(took) or float(took) < 0:
            return prof, {}
        measured[int(row["rank"])] = float(took)
    cost = rep.plan.get("cost_options") or {}
    speeds = [float(d.get("speed", 1.0)) for d in cost.get("devices") or []]
    floor = float(LayerArrays.of(prof).optimizer_floor_s.get(opt, 0.0))  # as costmodel.optimizer_floor reads it
    p = int(rep.plan["num_ranks"])
    mine: dict[int, list[int]] = {}
    for layer, r in enumerate(_layer_ranks(rep)):
        mine.setdefault(r, []).append(layer)
    raw = [float(x.optimizer_s[opt]) for x in prof.layers]  # type: ignore[index]
    new = list(raw)
    factors: dict[int, float] = {}
    for r, indices in mine.items():
        trained = [i for i in indices if raw[i] > 0]
        above = sum(max(raw[i] - floor, 0.0) for i in trained)
        if not trained or above <= 0:
            continue
        target = measured[r] * (speeds[r] if r < len(speeds) else 1.0) - floor  # the profile's footing, less the floor
        factors[r] = max(target, 0.0) / above
        for i in trained:
            new[i] = floor + factors[r] * max(raw[i] - floor, 0.0)
    if not factors:
        return prof, {}
    stepped = tuple(dataclasses.replace(x, optimizer_s={**(x.optimizer_s or {}), opt: t}) for x, t in zip(prof.layers, new))
    return Profile(stepped, dict(prof.meta)), {
        "optimizer": opt, "optimizer_factors": [factors.get(r) for r in range(p)],
        "optimizer_measured_s": [measured[r] for r in range(p)]}


def _layer_ranks(rep: RunReport) -> list[int]:
    """Per layer of the run's plan: the rank that ran it (its stage's; stage s on rank s mod p in older plans)."""
    bounds = rep.plan["boundaries"]
    p = int(rep.plan["num_ranks"])
    stage_rank = [int(r) for r in rep.plan.get("stage_ranks") or [s % p for s in range(len(bounds) - 1)]]
    return [stage_rank[s] for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]


def _rank_factors(prof: Profile, rep: RunReport) -> list[float]:
    """Per layer: the measured / predicted compute of the rank that ran it."""
    by_rank = {int(row["rank"]): row["measured_compute_s"] / row["predicted_compute_s"] for row in rep.ranks}
    return [by_rank[r] for r in _layer_ranks(rep)]


def _why_not_per_layer(prof: Profile, rep: RunReport) -> str | None:
    """Why a run cannot be calibrated per layer (then it is per rank), or None."""
    from stageplan.schedules import normalize_schedule

    if len(rep.layers) != len(prof):
        return "the run report has no per-layer times (written before the per-layer clock)"
    if (rep.plan.get("cost_options") or {}).get("recompute"):
        return "under recomputation a chunk's whole forward runs again inside its last layer's backward"
    if normalize_schedule(str(rep.plan["schedule"])) in ("InterleavedZeroBubble", "ZBVZeroBubble"):
        return "a zero-bubble schedule computes weight gradients outside the layers' backward spans"
    return None


def _layer_factors(prof: Profile, rep: RunReport, m: int) -> tuple[list[float], list[float]]:
    """Per layer: measured / profiled forward and backward (per microbatch, the backward as a step of m blends it).

    The measured times are put on the profile's footing first: times the rank's device speed (the plan divided by
    it) and scaled to the profile's microbatch size when the plan rescaled it (``--microbatches auto``). Each rank's
    chunk overhead is shared over its layers by their measured time, and a rank's layers are then scaled together
    so that they add up to the rank's measured compute (the clock's steps against the measured steps' median). A
    layer the profile or the run put at zero keeps factor 1. Last, the chunk overhead that later plans price
    (:func:`_run_overheads`) is taken off each rank's layers in proportion, as they will add it back."""
    cost = rep.plan.get("cost_options") or {}
    speeds = [float(d.get("speed", 1.0)) for d in cost.get("devices") or []]
    mb_run, mb_prof = rep.run_options.get("microbatch_size"), prof.meta.get("microbatch_size")
    size = float(mb_prof) / float(mb_run) if mb_run and mb_prof else 1.0
    parts: dict[int, list[float]] = {}
    for x in rep.layers:
        t = parts.setdefault(int(x["rank"]), [0.0, 0.0])
        t[0] += x["measured_forward_s"]
        t[1] += x["measured_backward_s"]
    scale: dict[int, tuple[float, float]] = {}  # per rank: what multiplies a layer's measured forward, backward
    for row in rep.ranks:
        r = int(row["rank"])
        tf, tb = parts.get(r, (0.0, 0.0))
        over_f, over_b = row.get("measured_overhead_forward_s") or 0.0, row.get("measured_overhead_backward_s") or 0.0
        clocked = tf + tb + over_f + over_b
        footing = (row["measured_compute_s"] / clocked if clocked > 0 else 1.0) * size * (speeds[r] if r < len(speeds) else 1.0)
        scale[r] = ((1.0 + over_f / tf if tf > 0 else 1.0) * footing, (1.0 + over_b / tb if tb > 0 else 1.0) * footing)
    # what later plans price per chunk (PipelineStage's overhead, :func:`_run_overheads`) comes off the rank's layers
    # again, in proportion, so that layers and priced overhead add up to the measured compute, not more
    over = _run_overheads(rep)
    chunks: dict[int, int] = {}
    for r in rep.plan.get("stage_ranks") or range(int(rep.plan["num_ranks"])):
        chunks[int(r)] = chunks.get(int(r), 0) + 1
    scaled: dict[int, list[float]] = {}
    for x in rep.layers:
        t = scaled.setdefault(int(x["rank"]), [0.0, 0.0])
        t[0] += x["measured_forward_s"] * scale[int(x["rank"])][0]
        t[1] += x["measured_backward_s"] * scale[int(x["rank"])][1]
    for r, (sf, sb) in scaled.items():  # the sums are on the profile's footing: the priced seconds go there too
        on_footing = chunks.get(r, 0) * size * (speeds[r] if r < len(speeds) else 1.0)
        priced = over["chunk_forward_s"] * on_footing, over["chunk_backward_s"] * on_footing
        net = [max(1.0 - p / t, NET_OF_OVERHEAD_MIN) if t > 0 else 1.0 for p, t in zip(priced, (sf, sb))]
        scale[r] = (scale[r][0] * net[0], scale[r][1] * net[1])
    fwd, bwd = [1.0] * len(prof), [1.0] * len(prof)
    for x in rep.layers:
        i, r = int(x["index"]), int(x["rank"])
        f, b = x["measured_forward_s"] * scale[r][0], x["measured_backward_s"] * scale[r][1]
        pf, pb = prof.layers[i].forward_s, prof.layers[i].backward_per_microbatch_s(m)
        if pf > 0 and f > 0:
            fwd[i] = f / pf
        if pb > 0 and b > 0:
            bwd[i] = b / pb
    return fwd, bwd


# The least share of a rank's measured layer time that calibrate keeps when it takes the priced chunk overhead off
# (a link whose probe read more overhead than the run's chunks spent in all)
NET_OF_OVERHEAD_MIN = 0.05


def _run_overheads(rep: RunReport) -> dict[str, float]:
    """The schedule probe's seconds per chunk a run paid (:data:`OVERHEADS`): its plan's where the plan priced
    them (with a measured link), else what the run's own link probe timed. The calibrated layers, the latency fit
    and the calibrated profile's later plans use the same figures, so that neither counts them again."""
    planned = rep.plan.get("cost_options") or {}
    priced = any(planned.get(k) for k in OVERHEADS)
    return {k: float((planned.get(k) if priced else (rep.link or {}).get(k)) or 0.0) for k in OVERHEADS}


def _run_collective(rep: RunReport) -> dict[str, float | None]:
    """The all-reduce's constants (:data:`COLLECTIVE`) a run's tied sync was priced with: its plan's where the plan
    had them (from a measured link), else what the run's own link probe timed, else None (the point-to-point link)."""
    planned = rep.plan.get("cost_options") or {}
    source = planned if planned.get("allreduce_bandwidth_bytes_per_s") is not None else (rep.link or {})
    if source.get("allreduce_bandwidth_bytes_per_s") is None:
        return {k: None for k in COLLECTIVE}
    return {k: float(source[k]) for k in COLLECTIVE}


def _replay_options(profile: Profile, rep: RunReport) -> tuple[LayerArrays, CostOptions]:
    """The run's own conditions, to replay its plan on ``profile``: its optimizer (its step is in the measured
    step), the plan's cost options, the schedule probe's overheads and the all-reduce's constants it ran with
    (:func:`_run_overheads`, :func:`_run_collective`), at its microbatch size (a plan of --microbatches auto
    rescaled the profile to it)."""
    plan_json = rep.plan
    cost = plan_json.get("cost_options") or {}
    mb_plan, mb_prof = cost.get("microbatch_size"), profile.meta.get("microbatch_size")
    if mb_plan and mb_prof and int(mb_plan) != int(mb_prof):
        profile = _rescaled(profile, int(mb_plan) / int(mb_prof))
    arr = LayerArrays.of(profile, int(plan_json["num_microbatches"]))
    devices = [Device(float(d["speed"]), None, str(d.get("name", ""))) for d in cost.get("devices") or []] or None
    over, collective = _run_overheads(rep), _run_collective(rep)
    opts = make_options(profile, int(plan_json["num_ranks"]), num_microbatches=int(plan_json["num_microbatches"]),
                        schedule=plan_json["schedule"], virtual_stages=int(plan_json.get("virtual_stages", 1)),
                        optimizer=str(rep.run_options.get("optimizer") or cost.get("optimizer") or "sgd"),
                        bandwidth_bytes_per_s=cost.get("bandwidth_bytes_per_s"), devices=devices,
                        recompute=bool(cost.get("recompute", False)), precision=cost.get("precision"),
                        link_latency_s=float(cost.get("link_latency_s") or 0.0), action_s=over["action_s"],
                        chunk_forward_s=over["chunk_forward_s"], chunk_backward_s=over["chunk_backward_s"],
                        allreduce_latency_s=collective["allreduce_latency_s"],
                        allreduce_bandwidth_bytes_per_s=collective["allreduce_bandwidth_bytes_per_s"])
    return arr, opts


def _tied_sync_as_run(arr: LayerArrays, opts: CostOptions, rep: RunReport) -> tuple[CostOptions, dict[str, Any]]:
    """The run's options with the all-reduce's constants scaled to what its tied sum took, and what calibrate records
    of it. The rank that reaches the sum last waits for no one, so its ``measured_tied_sync_s`` (the least over the
    ranks; the others' add their wait for it) is the collective's own time; both constants are scaled by it over the
    price (the ring's time scales alike at every size). The price comes from the constants the run had, else from
    the point-to-point link its plan priced (its latency and bandwidth as the ring's). Nothing changes where the
    run's split kept every tie on one rank, where nothing priced the sum (no bandwidth, no probe) or where the
    report did not time it (written before it did)."""
    bounds = np.array([rep.plan["boundaries"]])
    base = opts
    if opts.allreduce_bandwidth_bytes_per_s is None and opts.bandwidth_bytes_per_s is not None:
        base = dataclasses.replace(opts, allreduce_latency_s=opts.link_latency_s,
                                   allreduce_bandwidth_bytes_per_s=opts.bandwidth_bytes_per_s)
    price = float(tied_sync_time(arr, bounds, base)[0])
    times = [row.get("measured_tied_sync_s") for row in rep.ranks]
    timed = [float(x) for x in times if x is not None and is_number(x) and float(x) > 0]
    bandwidth = base.allreduce_bandwidth_bytes_per_s  # set wherever the price is above 0
    if not (price > 0 and bandwidth is not None and len(timed) == len(times)):
        return opts, {k: getattr(opts, k) for k in COLLECTIVE}
    last = min(timed)
    ratio = last / price
    scaled = dataclasses.replace(base, allreduce_latency_s=float(base.allreduce_latency_s or 0.0) * ratio,
                                 allreduce_bandwidth_bytes_per_s=bandwidth / ratio)
    return scaled, {**{k: getattr(scaled, k) for k in COLLECTIVE}, "tied_sync_ratio": ratio,
                    "tied_sync_measured_s": last}


def _fit_boundary_latency(arr: LayerArrays, opts: CostOptions, rep: RunReport) -> float:
    """The per-crossing delay that makes the simulated step of the run's plan (with calibrated layer times, under
    the run's options: :func:`_replay_options`) equal the measured step: what the ranks waited beyond compute
    (send/recv rendezvous, the optimizer step). Bisection: the simulated step does not decrease as the delay grows."""
    bounds = rep.plan["boundaries"]

    def step(latency: float) -> float:
        return evaluate(arr, bounds, dataclasses.replace(opts, boundary_latency_s=latency)).predicted_step_s

    target = rep.measured_step_s
    if not (math.isfinite(target) and target > step(0.0)):
        return 0.0
    lo, hi = 0.0, target
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < target else (lo, mid)
    return hi


COMPARE_SCHEMA = "stageplan.compare/1"


def _measured_profile(model: str, factory_options: dict[str, Any] | None, num_microbatches: int | None,
                      profile: Profile | str | os.PathLike[str] | None, progress: bool, command: str,
                      processes: int = 1, timeout_s: float = 1800.0, min_time_s: float = 0.0,
                      order: str | None = None) -> Profile:
    """``profile``, or a fresh profile of ``model`` at the microbatch size of ``num_microbatches`` (with ``processes``
    > 1, the per-layer median of that many fresh processes: :func:`stageplan.launch.profile_in_processes`; its
    rounds spread over ``min_time_s``, its layers timed in ``order``: :func:`stageplan.profile_model`); never an
    analytic estimate, since the commands that call this measure runs on this machine."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise StageplanError(f"processes must be an integer >= 1, got {processes!r}; e.g. --processes 3")
    if processes > 1 and profile is not None:
        raise StageplanError(f"--processes {processes} profiles the model in fresh processes, and --profile gives the "
                             "profile to start from; drop one of them")
    if profile is not None and min_time_s:
        raise StageplanError(f"--min-time {min_time_s:g} spreads the rounds of the profile {command} takes, and --profile "
                             "gives the profile to start from; drop one of them")
    if profile is not None and order is not None:
        raise StageplanError(f"--order {order} sets how the profile {command} takes times its layers, and --profile "
                             "gives the profile to start from; drop one of them")
    if profile is None:
        workload = build_workload(model, factory_options)
        from stageplan.measure import microbatch_size_for

        batch = workload.batch_size
        if num_microbatches is not None and (isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int)
                                             or num_microbatches < 1):
            raise StageplanError(f"--microbatches must be an integer >= 1, got {num_microbatches!r}; e.g. --microbatches 4")
        # refused here, before the profile, as the run would refuse it after
        mb = microbatch_size_for(batch, num_microbatches) if num_microbatches else default_microbatch_size(batch)
        from stageplan.profiler import check_min_time, check_order

        check_min_time(min_time_s)
        check_order(order)
        if processes > 1:
            from stageplan.launch import profile_in_processes

            del workload
            prof = profile_in_processes(model, factory_options, processes=processes, microbatch_size=mb, progress=progress,
                                        timeout_s=timeout_s, min_time_s=min_time_s, order=order)
        else:
            from stageplan.profiler import profile_model

            prof = profile_model(workload, microbatch_size=mb, progress=progress, min_time_s=min_time_s, order=order)
    else:
        prof = _as_profile(profile)
    if estimate_label(prof.meta):
        raise StageplanError(f"{command} measures runs on this machine, and this profile is an analytic GPU estimate; "
                             f"{command} a profile measured here, or plan the estimate with stageplan plan --compare")
    return prof


def compare(
    model: str,
    num_ranks: int,
    *,
    factory_options: dict[str, Any] | None = None,
    num_microbatches: int | None = None,
    schedule: str = "1F1B",
    steps: int = 10,
    warmup: int = 2,
    profile: Profile | str | os.PathLike[str] | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 300.0,
    progress: bool = False,
    pin_cpus: bool = True,
    processes: int = 1,
    runs: int = 1,
    min_time_s: float = 0.0,
    objective: str = "bottleneck",
    order: str | None = None,
) -> dict[str, Any]:
    """Profile ``model`` (or take ``profile``), plan it with optimal, uniform and parameters, run each distinct
    plan and return ``{"methods": {name: {"measured_step_s", "predicted_step_s", ...}}}``; with ``output_dir``,
    also write compare.json (schema ``stageplan.compare/1``), the plans, the run reports and the figures there.
    When every method gives the same boundaries nothing is run: ``result["identical"]`` says so. ``processes`` > 1
    profiles in that many fresh processes and keeps each layer's median (:func:`stageplan.profile_in_processes`);
    ``pin_cpus`` places the ranks as :func:`stageplan.run` does; ``min_time_s`` spreads the profile's rounds as
    :func:`stageplan.profile_model` does. ``runs`` > 1 runs every distinct plan that many
    times in turns (:func:`_in_turns`): each method's step is the median of its runs (``measured_steps_s`` lists
    them; run_NAME.json is the run of that median) and its speed-up the median of the speed-ups of runs side by
    side. ``objective`` is the optimal plan's (:func:`plan`); ``order`` the profile's (:func:`stageplan.profile_model`;
    default: stage)."""
    from pathlib import Path

    from stageplan._io import check_output_dir

    check_objective(objective)
    _check_runs(runs)
    _check_loop(num_ranks, schedule, steps, warmup, timeout_s, auto=True)
    out = check_output_dir(output_dir) if output_dir is not None else None
    if out is not None:
        _refuse_input_among_outputs(out, profile, _is_compare_output)
    prof = _measured_profile(model, factory_options, num_microbatches, profile, progress, "compare", processes, timeout_s,
                             min_time_s, order)
    plans = {name: plan(prof, num_ranks, num_microbatches=num_microbatches, schedule=schedule, method=name,
                        objective=objective if name == "optimal" else "bottleneck") for name in METHODS}
    identical = len({pl.boundaries for pl in plans.values()}) == 1
    result: dict[str, Any] = {
        "schema": COMPARE_SCHEMA, "model": model, "factory_options": factory_options or {}, "num_ranks": num_ranks,
        "schedule": plans["optimal"].schedule, "num_microbatches": plans["optimal"].num_microbatches,
        "profile_digest": prof.digest(), "identical": identical, "runs": runs, "objective": objective, "methods": {}}
    if out is None:
        _compare_runs(result, plans, None, model, factory_options, steps, warmup, timeout_s, pin_cpus, progress, runs)
        return result
    # everything is written to a staging folder inside DIR and moved in at the end: a failed compare leaves DIR as
    # it was (it had replaced plan_optimal.json beside an old compare.json), and a finished one leaves no file of
    # an earlier compare's (an old run_optimal.json beside a compare.json that ran nothing)
    import shutil
    import tempfile

    out.mkdir(exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".stageplan-compare-", dir=out))
    try:
        _compare_runs(result, plans, stage, model, factory_options, steps, warmup, timeout_s, pin_cpus, progress, runs)
        written = {f.name for f in stage.iterdir()}
        for old in out.iterdir():
            if old.is_file() and old.name not in written and _is_compare_output(old.name):
                old.unlink()
        for f in stage.iterdir():
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return result


def _refuse_input_among_outputs(out: pathlib.Path, given: Any, written: Callable[[str], bool]) -> None:
    """Refuse a --profile that is one of the files the command writes into its output folder (compare -o DIR
    with --profile DIR/compare.json replaced the profile)."""
    if isinstance(given, (str, os.PathLike)) and pathlib.Path(given).is_file() and out.is_dir() \
            and written(pathlib.Path(given).name) and os.path.samefile(pathlib.Path(given).parent, out):
        raise StageplanError(f"--profile {str(given)!r} is one of the files this command writes into {str(out)!r}; "
                             "writing them would replace it: move the profile, or give another -o folder")


def _is_compare_output(name: str) -> bool:
    return name in ("compare.json", "balance.png") or (
        name.startswith(("plan_", "run_")) and name.endswith(".json")) or (
        name.startswith("timeline_") and name.endswith(".png"))


def _compare_runs(result: dict[str, Any], plans: dict[str, Plan], out: pathlib.Path | None, model: str,
                  factory_options: dict[str, Any] | None, steps: int, warmup: int, timeout_s: float, pin_cpus: bool,
                  progress: bool, runs: int = 1) -> None:
    """Run each distinct plan of ``plans`` ``runs`` times, in turns, into ``result``; with ``out``, write the plans,
    the run reports (each method's median run), compare.json and the figures there."""
    from stageplan.launch import run

    identical = bool(result["identical"])
    rows: dict[str, dict[str, Any]] = result["methods"]
    same: dict[str, str | None] = {}
    for name, pl in plans.items():
        if out is not None:
            pl.save(out / f"plan_{name}.json")
        rows[name] = {"predicted_step_s": pl.predicted_step_s, "balance_efficiency": pl.balance_efficiency,
                      "boundaries": list(pl.boundaries), "peak_memory_bytes": list(pl.rank_memory_bytes)}
        # an identical split is the same run: measure it once
        same[name] = next((other for other in same if same[other] is None and plans[other].boundaries == pl.boundaries), None)
    reports = {} if identical else _measured_in_turns(rows, plans, same, out, runs, progress, lambda pl: run(
        model, pl, factory_options=factory_options, steps=steps, warmup=warmup, timeout_s=timeout_s, pin_cpus=pin_cpus))
    if out is not None:
        from stageplan._io import write_json_atomic
        from stageplan.plots import plot_stage_balance, plot_timeline, save

        write_json_atomic(out / "compare.json", result)
        save(plot_stage_balance(plans), str(out / "balance.png"))
        for name in ("optimal", "uniform"):
            if name in reports:
                save(plot_timeline(reports[name], title=f"{name}: measured timeline (last step)"),
                     str(out / f"timeline_{name}.png"))
        import matplotlib.pyplot as plt

        plt.close("all")


def _measured_in_turns(rows: dict[str, dict[str, Any]], plans: dict[str, Plan], same: dict[str, str | None],
                       out: pathlib.Path | None, runs: int, progress: bool,
                       measure: Callable[[Plan], RunReport]) -> dict[str, RunReport]:
    """Compare's runs: every distinct plan ``runs`` times in turns; each method's row gets its median step, every
    run's step and its speed-up over uniform; returns each method's median run (written to ``out`` as
    run_NAME.json, once per distinct split)."""
    from stageplan._progress import Progress

    distinct = [name for name in plans if same[name] is None]
    bar = Progress(len(distinct) * runs, "compare", enabled=progress, interval_s=0.0)
    done = [0]

    def one(name: str) -> RunReport:
        bar.update(done[0], f"running {name}" + (f" ({done[0] // len(distinct) + 1} of {runs})" if runs > 1 else ""))
        rep = measure(plans[name])
        done[0] += 1
        return rep

    measured = dict(zip(distinct, _in_turns(distinct, runs, one)))
    bar.close()
    reports: dict[str, RunReport] = {}
    for name in plans:
        reps = measured[same[name] or name]
        reports[name] = _median_run(reps)
        if out is not None and same[name] is None:
            reports[name].save(out / f"run_{name}.json")
        rows[name].update({"measured_step_s": statistics.median(r.measured_step_s for r in reps),
                           "measured_steps_s": [r.measured_step_s for r in reps],
                           "measured_step_iqr_s": reports[name].measured_step_iqr_s,
                           "measured_peak_activation_bytes": [r["measured_peak_activation_bytes"] for r in reports[name].ranks],
                           "same_run_as": same[name]})
    base = measured[same["uniform"] or "uniform"]
    for name, row in rows.items():
        row["speedup_over_uniform"] = _paired_speedup(base, measured[same[name] or name])
    return reports


TUNE_SCHEMA = "stageplan.tune/1"
# what tune -o DIR writes: the final plan, the calibrated profile it was planned from, the median runs of the final
# and the uniform plans, and the record of the rounds
TUNE_OUTPUTS = ("plan.json", "profile.json", "run_final.json", "run_uniform.json", "tune.json")


def _check_loop(num_ranks: object, schedule: str, steps: object, warmup: object, timeout_s: object,
                auto: bool = False) -> None:
    """compare's and tune's ranks, schedule, steps and timeout, refused before their profile (they were refused
    only after it: seconds here, minutes on a large model)."""
    from stageplan.launch import check_steps_and_timeout

    check_ranks(num_ranks)  # as plan refuses it
    if not (auto and schedule == "auto"):  # compare's plan() picks the schedule itself; tune refuses it, as before
        normalize_schedule(schedule)
    check_steps_and_timeout(steps, warmup, timeout_s)


def _check_runs(runs: object) -> None:
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise StageplanError(f"runs must be an integer >= 1, got {runs!r}; e.g. --runs 3")


def _in_turns(items: Sequence[Any], runs: int, measure: Callable[[Any], RunReport]) -> list[list[RunReport]]:
    """Each of ``items`` measured ``runs`` times in turns (A B A B ...), one list of reports per item: a shared
    machine's speed drifts over the minutes this takes (here two profiles of one model minutes apart differed by
    10-19% on every layer alike), and in turns the drift falls on every item alike instead of on whichever ran
    last."""
    out: list[list[RunReport]] = [[] for _ in items]
    for _ in range(runs):
        for reps, item in zip(out, items):
            reps.append(measure(item))
    return out


def _median_run(reports: Sequence[RunReport]) -> RunReport:
    """The run whose step is the median of ``reports``' (the lower of the two middle ones for an even count).

    >>> from types import SimpleNamespace as R
    >>> _median_run([R(measured_step_s=3.0), R(measured_step_s=1.0), R(measured_step_s=2.0)]).measured_step_s
    2.0
    """
    ordered = sorted(reports, key=lambda r: r.measured_step_s)
    return ordered[(len(ordered) - 1) // 2]


def _paired_speedup(base: Sequence[RunReport], other: Sequence[RunReport]) -> float | None:
    """The median over turns of base step / other step, each pair run side by side (a single run each: their ratio).

    >>> from types import SimpleNamespace as R
    >>> _paired_speedup([R(measured_step_s=2.0), R(measured_step_s=3.0)], [R(measured_step_s=1.0), R(measured_step_s=3.0)])
    1.5
    """
    ratios = [b.measured_step_s / o.measured_step_s for b, o in zip(base, other) if o.measured_step_s]
    return statistics.median(ratios) if ratios else None


def tune(
    model: str,
    num_ranks: int,
    *,
    factory_options: dict[str, Any] | None = None,
    num_microbatches: int | None = None,
    schedule: str = "1F1B",
    rounds: int = 3,
    steps: int = 20,
    warmup: int = 3,
    profile: Profile | str | os.PathLike[str] | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 300.0,
    progress: bool = False,
    pin_cpus: bool = True,
    processes: int = 1,
    runs: int = 1,
    min_time_s: float = 0.0,
    objective: str = "bottleneck",
    order: str | None = None,
) -> dict[str, Any]:
    """Close the loop: profile, plan, run, calibrate, plan again, until the plan stops changing or after
    ``rounds`` rounds; then run the final plan once more (its prediction error is measured on that fresh run, not on
    the runs it was calibrated on) and the uniform split once, for reference. ``runs`` > 1 runs each round's plan
    that many times and calibrates from its median run (:func:`_median_run`: one run's window catches one moment of
    a drifting machine), and runs the final and uniform plans that many times in turns (:func:`_in_turns`): the final
    error is its median run's, and the final-over-uniform gain the median of the gains of runs side by side;
    ``measured_steps_s`` lists every run.

    Every run measures ``steps`` steps after ``warmup``: a step's median over 20 steps varied 3-9% between runs of
    one plan here, over 8 steps 7-14%, and the final error cannot be reliably smaller than that spread.

    ``processes`` > 1 profiles in that many fresh processes (each layer's median), ``min_time_s`` spreads the
    profile's rounds as :func:`stageplan.profile_model` does, ``pin_cpus`` places the ranks as :func:`stageplan.run`
    does. ``objective`` is every round's plan's (:func:`plan`): "step" tunes for the lowest predicted step.
    ``order`` is the first profile's (:func:`stageplan.profile_model`: stage, the default, or layer); each run's
    retiming follows it.

    Returns ``{"rounds": [{"boundaries", "predicted_step_s", "measured_step_s"}, ...], "final": {...},
    "uniform": {...}}``; with ``output_dir``, writes there ``plan.json`` (the final plan), ``profile.json`` (the
    calibrated profile it and the uniform reference were priced from), ``run_final.json`` and ``run_uniform.json``
    (each plan's median fresh run: ``stageplan show``/``calibrate`` read them) and ``tune.json``.
    """

    from stageplan._io import check_output_dir, write_json_atomic
    from stageplan.launch import run

    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise StageplanError(f"rounds must be an integer >= 1, got {rounds!r}; e.g. --rounds 3")
    check_objective(objective)
    _check_runs(runs)
    _check_loop(num_ranks, schedule, steps, warmup, timeout_s)
    out = check_output_dir(output_dir) if output_dir is not None else None
    if out is not None:
        _refuse_input_among_outputs(out, profile, lambda name: name in TUNE_OUTPUTS)
    prof = _measured_profile(model, factory_options, num_microbatches, profile, progress, "tune", processes, timeout_s,
                             min_time_s, order)

    def measure(pl: Plan) -> RunReport:
        return run(model, pl, factory_options=factory_options, steps=steps, warmup=warmup, timeout_s=timeout_s,
                   pin_cpus=pin_cpus)

    def row(pl: Plan, *reps: RunReport) -> dict[str, Any]:
        step = statistics.median(r.measured_step_s for r in reps)
        entry = {"boundaries": list(pl.boundaries), "predicted_step_s": pl.predicted_step_s, "measured_step_s": step,
                 "error": step / pl.predicted_step_s - 1.0}
        return entry if len(reps) == 1 else {**entry, "measured_steps_s": [r.measured_step_s for r in reps]}

    rows: list[dict[str, Any]] = []
    current = plan(prof, num_ranks, num_microbatches=num_microbatches, schedule=schedule, objective=objective)
    for k in range(rounds):
        reps = [measure(current) for _ in range(runs)]
        rep = _median_run(reps)
        rows.append(row(current, *reps))
        if progress:  # a line per round on stderr; the caller prints the result
            print(f"tune round {k + 1}: boundaries {list(current.boundaries)}, predicted {current.predicted_step_s * 1e3:.1f} ms, "
                  f"measured {rows[-1]['measured_step_s'] * 1e3:.1f} ms ({rows[-1]['error']:+.1%})", file=sys.stderr, flush=True)
        prof = calibrate(prof, rep)
        following = plan(prof, num_ranks, num_microbatches=num_microbatches, schedule=schedule, objective=objective)
        changed = following.boundaries != current.boundaries
        current = following
        if not changed:
            break
    uniform_plan = plan(prof, num_ranks, num_microbatches=num_microbatches, schedule=schedule, method="uniform")
    final_runs, uniform_runs = _in_turns([current, uniform_plan], runs, measure)
    final, uniform = row(current, *final_runs), row(uniform_plan, *uniform_runs)
    result = {"schema": TUNE_SCHEMA, "model": model, "factory_options": factory_options or {}, "num_ranks": num_ranks,
              "schedule": current.schedule, "num_microbatches": current.num_microbatches, "rounds": rows,
              "final": final, "uniform": uniform, "runs": runs, "objective": objective,
              "final_over_uniform_measured": _paired_speedup(uniform_runs, final_runs),
              "final_prediction_error": final["error"]}
    if out is not None:
        out.mkdir(exist_ok=True)
        current.save(out / "plan.json")
        prof.save(out / "profile.json")  # what the final plan and the uniform reference were priced from
        _median_run(final_runs).save(out / "run_final.json")
        _median_run(uniform_runs).save(out / "run_uniform.json")
        write_json_atomic(out / "tune.json", result)
    return result
