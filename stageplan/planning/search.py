"""The split search (no torch): the split by method (solver, interleaved MILP or a peer's rule), the tie-break
among equal-bottleneck splits and the search for the lowest simulated step, priced many splits at once by
SplitCosts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from stageplan.errors import InfeasiblePlanError, StageplanError
from stageplan.planning.costs import (
    CostOptions,
    LayerArrays,
    comm_time,
    evaluate,
    memory_terms,
    optimizer_floor,
    optimizer_time,
    per_chunk_s,
    solver_inputs,
    tied_sync_time,
    trained_mask,
)
from stageplan.planning.schedules import WEIGHT_GRAD_SHARE, Action, ScheduleShape
from stageplan.planning.solver import TIE_REL, shape_text, validate_count

# ------------------------------------------------------------------------------------------------------
# Many splits at once: the searches that try hundreds of splits (the planner's tie-break) price them here.


class SplitCosts:
    """Stage times, stage memory and the simulated step of many splits at once, from prefix sums of the same
    terms ``evaluate`` sums (equal to its figures up to rounding; ``evaluate`` stays the reference for one
    split).

    ``stage(s, i, j)`` broadcasts chunk indices and layer ranges ``[i, j)``; ``steps(bounds)`` simulates every
    row of an (N, S+1) array of boundaries in one pass over the schedule's dependency levels.
    """

    def __init__(self, arr: LayerArrays, opts: CostOptions) -> None:
        S, L = opts.num_chunks, len(arr.forward_s)
        self.arr, self.opts, self.num_layers = arr, opts, L
        self.fwd_prefix = np.concatenate([[0.0], np.cumsum(arr.forward_s)])
        self.bwd_prefix = np.concatenate([[0.0], np.cumsum(arr.backward_s)])
        self.opt_prefix = np.concatenate([[0.0], np.cumsum(optimizer_time(arr, opts))])
        self.trained_prefix = np.concatenate([[0.0], np.cumsum(trained_mask(arr, opts))])
        self.opt_floor = optimizer_floor(arr, opts)
        self.comm = comm_time(arr, opts)  # one way, per boundary after each layer
        self.speed = np.array([opts.devices[r].speed for r in opts.shape.stage_ranks])
        by_kind = memory_terms(arr, opts)
        terms = list(by_kind.values())
        # interleaved ranks without recomputation: a rank's activations peak over its own order (live_counts),
        # not at the sum of its chunks' peaks, so the activations are kept apart from the chunks' other bytes
        self.exact_peak = opts.virtual_stages > 1 and not opts.recompute
        rows = sum(t.rows for k, t in by_kind.items() if not (self.exact_peak and k == "activations"))
        self.mem_prefix = np.concatenate([np.zeros((S, 1)), np.cumsum(rows, axis=1)], axis=1)
        self.act_prefix = np.concatenate([[0.0], np.cumsum(np.asarray(arr.activation_bytes, dtype=float))])
        # (K_r, S)
        self.live = [np.asarray(k, dtype=float) for k in opts.shape.live_counts] if self.exact_peak else None
        self.mem_start = sum((t.start for t in terms if t.start is not None), start=np.zeros((S, L)))
        self.mem_end = sum((t.end for t in terms if t.end is not None), start=np.zeros(L))
        self.rank_of = np.zeros((S, opts.num_ranks))  # chunk -> rank, one-hot
        self.rank_of[np.arange(S), opts.shape.stage_ranks] = 1.0
        self.limits = np.array(
            [np.inf if d.memory_limit_bytes is None else d.memory_limit_bytes for d in opts.devices])

    def stage(self, s: np.ndarray | int, i: np.ndarray | int, j: np.ndarray | int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Forward, backward (each with the schedule's loop around it, ``action_s``), comm (both directions)
        seconds and memory bytes of chunk s over layers [i, j):
        the formulas of ``evaluate``, term by term. With :attr:`exact_peak` the memory leaves the activations
        out (a rank adds its peak over its order: :meth:`rank_peaks`)."""
        s, i, j = np.asarray(s), np.asarray(i), np.asarray(j)
        f = (self.fwd_prefix[j] - self.fwd_prefix[i]) / self.speed[s]
        b = (self.bwd_prefix[j] - self.bwd_prefix[i]) / self.speed[s]
        if self.opts.recompute:
            b = b + f  # the forward runs again inside the backward
        # PipelineStage's overhead inside the chunk, and each action's share of the schedule's loop around it,
        # on its rank (evaluate: StagePlan.chunk_s and StagePlan.action_s)
        f = f + self.opts.chunk_forward_s + self.opts.action_s
        b = b + self.opts.chunk_backward_s + self.opts.action_s
        c = np.where(j < self.num_layers, 2.0 * self.comm[j - 1], 0.0)
        mem = self.mem_prefix[s, j] - self.mem_prefix[s, i] + self.mem_start[s, i] + self.mem_end[j - 1]
        return f, b, c, mem

    def split(self, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For each row of ``bounds`` (N, S+1): per-chunk forward, backward and comm seconds (N, S) and
        per-rank memory bytes (N, p), as ``evaluate`` counts them: the sum of the rank's chunks, with an
        interleaved rank's activations at their peak over its order."""
        bounds = np.asarray(bounds)
        f, b, c, mem = self.stage(np.arange(bounds.shape[1] - 1)[None, :], bounds[:, :-1], bounds[:, 1:])
        return f, b, c, mem @ self.rank_of + self.rank_peaks(bounds)

    def rank_peaks(self, bounds: np.ndarray) -> np.ndarray:
        """Per rank (N, p), the activation bytes :meth:`stage` leaves out: with :attr:`exact_peak`, the
        largest sum_c count_c x chunk c's saved bytes over the rank's live-count vectors
        (``ScheduleShape.live_counts``); else 0."""
        bounds = np.asarray(bounds)
        if self.live is None:
            return np.zeros((bounds.shape[0], self.opts.num_ranks))
        return self.opts.shape.activation_peaks(self.act_prefix[bounds[:, 1:]]
                                                - self.act_prefix[bounds[:, :-1]])

    def optimizer(self, bounds: np.ndarray) -> np.ndarray:
        """Per-chunk seconds of one optimizer step (N, S) for each row of ``bounds`` (N, S+1), as ``evaluate``
        counts it (the layers' optimizer times over the chunk's device speed)."""
        bounds = np.asarray(bounds)
        s = np.arange(bounds.shape[1] - 1)[None, :]
        per_chunk = (self.opt_prefix[bounds[:, 1:]] - self.opt_prefix[bounds[:, :-1]]) / self.speed[s]
        if self.opt_floor > 0:
            # the step's fixed cost, on each rank's first chunk where the rank steps anything
            trained = self.trained_prefix[bounds[:, 1:]] - self.trained_prefix[bounds[:, :-1]]  # (N, S)
            steps = (trained @ self.rank_of) > 0  # (N, p)
            ranks = self.opts.shape.stage_ranks
            firsts = [ranks.index(r) for r in range(self.opts.num_ranks)]
            per_chunk[:, firsts] += steps * (self.opt_floor / self.speed[firsts])[None, :]
        return per_chunk

    def tied_sync(self, bounds: np.ndarray) -> np.ndarray:
        """Seconds of the tied-gradient all-reduce (N,) for each row of ``bounds`` (N, S+1), as ``evaluate``
        counts it (``tied_sync_time``)."""
        return tied_sync_time(self.arr, np.asarray(bounds), self.opts)

    def split_steps(self, bounds: np.ndarray, f: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
        """The simulated step of each split (row of ``bounds``) whose per-chunk times ``split`` gave, with its
        optimizer steps and its tied-gradient all-reduce: ``evaluate(...).predicted_step_s`` of every row."""
        return self.steps(f, b, c, self.optimizer(bounds), self.tied_sync(bounds))

    def rank_time(self, f: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
        """Per-rank seconds per microbatch (N, p): the sum of
        its chunks' f + b + c, as ``evaluate`` counts it."""
        return (f + b + c) @ self.rank_of

    def steps(self, f: np.ndarray, b: np.ndarray, c: np.ndarray, o: np.ndarray | None = None,
              t: np.ndarray | None = None) -> np.ndarray:
        """The simulated step (seconds) of each row of per-chunk times (N, S), as ``evaluate`` simulates it
        (``schedules.simulate_shape``: each action starts when its rank is free and its inputs have arrived, a
        crossing no earlier than the receive is posted where the schedule posts it on demand;
        where a row's tied-gradient all-reduce ``t`` (N,) is > 0, it starts once every rank has ended its last
        action; then each rank's optimizer step ``o``, summed over its chunks)."""
        shape = self.opts.shape
        graph = _step_graph(shape)
        n = f.shape[0]
        share = WEIGHT_GRAD_SHARE
        duration = np.concatenate([f.T, b.T, (b * (1.0 - share)).T, (b * share).T, np.zeros((1, n))])
        # one-way delay at each boundary k -> k+1 (schedules.one_way_delays), none between chunks of one rank
        hop = c[:, :-1].T / 2.0 + self.opts.boundary_latency_s
        hop = np.concatenate([hop * graph.crosses[:, None], np.zeros((1, n))])
        A = graph.num_actions
        end = np.zeros((A + 1, n))  # the last row stays 0: "no such predecessor"
        arrived = np.zeros((A + 1, n))  # when an action's inputs are there (its receive's message, on demand)
        on_demand = shape.receives_on_demand  # a transfer starts no earlier than its receive is posted
        for posts, starts in graph.levels:
            if len(posts):
                # the receive's post (after the rank's previous action and the sends it waits first)
                post = np.maximum(end[graph.prev[posts]], arrived[graph.pre[posts]])
                h1, h2 = hop[graph.hop1[posts]], hop[graph.hop2[posts]]
                if on_demand:  # at most one input crosses ranks; a local one has a 0 hop
                    a1 = np.maximum(post, end[graph.dep1[posts]]) + h1
                    a2 = np.maximum(post, end[graph.dep2[posts]]) + h2
                else:
                    a1 = np.maximum(post, end[graph.dep1[posts]] + h1)
                    a2 = end[graph.dep2[posts]] + h2
                arrived[posts] = np.maximum(a1, a2)
            if len(starts):  # and the sends it waits for with that post
                start = np.maximum(arrived[starts], arrived[graph.fused[starts]])
                end[starts] = start + duration[graph.kind_stage[starts]]
        if o is None and t is None:
            return end[:-1].max(axis=0)
        # a rank's last action ends last on that rank; the all-reduce (a collective: every rank starts it when
        # the last one gets there) and then the rank's optimizer step follow (schedules.simulate_shape)
        # (p, N): step() returns once its sends are in
        last = np.maximum(end[graph.last], arrived[graph.at_end])
        if t is not None:
            last = np.where(t > 0, last.max(axis=0) + t, last)
        finish = last if o is None else last + (o @ self.rank_of).T
        return np.maximum(end[:-1].max(axis=0), finish.max(axis=0))


@dataclass(frozen=True)
class _StepGraph:
    """A schedule's actions as a dependency graph. Per action: its rank's previous action (``prev``), its
    inputs (``dep1``, ``dep2``) with the boundary each crosses (``hop1``, ``hop2``), its row in the duration
    table (``kind_stage``), and in torch's single-stage loops the sends the rank waits for before posting the
    action's receive (``pre``) and with it (``fused``), each named by the action consuming the last of them,
    whose input's arrival is the send's completion (``ScheduleShape.send_waits``); ``at_end`` per rank, the
    same after its last action. Absent entries point at a zero row. ``levels``: each action's post (its
    inputs' arrival) and start are two nodes, grouped into levels of mutually independent nodes, as (posts,
    starts) action ids."""

    num_actions: int
    levels: tuple[tuple[np.ndarray, np.ndarray], ...]
    prev: np.ndarray
    dep1: np.ndarray
    hop1: np.ndarray
    dep2: np.ndarray
    hop2: np.ndarray
    kind_stage: np.ndarray
    crosses: np.ndarray  # per boundary k -> k+1: 1.0 when chunks k and k+1 run on different ranks
    last: np.ndarray  # per rank, its last action
    pre: np.ndarray
    fused: np.ndarray
    at_end: np.ndarray  # per rank


_STEP_GRAPHS: dict[tuple[str, int, int, int], _StepGraph] = {}


def _step_graph(shape: ScheduleShape) -> _StepGraph:
    """The step's dependency graph for a shape, built once
    per (schedule, p, m, v) from the shape the plan holds."""
    key = (shape.schedule, shape.num_ranks, shape.num_microbatches, shape.virtual_stages)
    if key not in _STEP_GRAPHS:
        if len(_STEP_GRAPHS) >= 32:
            _STEP_GRAPHS.pop(next(iter(_STEP_GRAPHS)))
        _STEP_GRAPHS[key] = _build_step_graph(shape)
    return _STEP_GRAPHS[key]


def _longest_path_levels(deps: np.ndarray) -> np.ndarray | None:
    """Each node's longest-path level in a DAG: 0 for a node whose dependencies are all "none", else one more
    than its deepest dependency. ``deps[:, n]`` are node n's dependencies, N (the number of nodes) standing
    for none. One pass in topological order (Kahn's), linear in the edges; None where the graph has a
    cycle."""
    n = deps.shape[1]
    rows, child = np.nonzero(deps < n)  # an edge parent -> child for each real dependency
    parent = deps[rows, child]
    indegree = np.bincount(child, minlength=n)
    order = np.argsort(parent, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(parent, minlength=n))])
    children = child[order].tolist()
    first, left = starts.tolist(), indegree.tolist()
    level = [0] * n
    ready = [v for v in range(n) if left[v] == 0]
    done = 0
    while ready:
        v = ready.pop()
        done += 1
        lv = level[v] + 1
        for c in children[first[v]:first[v + 1]]:
            if level[c] < lv:
                level[c] = lv
            left[c] -= 1
            if left[c] == 0:
                ready.append(c)
    return np.array(level, dtype=np.int64) if done == n else None


def _group_by(values: np.ndarray, n: int) -> list[np.ndarray]:
    """``[np.flatnonzero(values == k) for k in range(n)]``, in one sort rather than n scans."""
    order = np.argsort(values, kind="stable")
    return np.split(order, np.cumsum(np.bincount(values, minlength=n))[:-1])


def _build_step_graph(shape: ScheduleShape) -> _StepGraph:
    m = shape.num_microbatches
    S = shape.num_chunks
    kinds = {"F": 0, "B": 1, "I": 2, "W": 3}
    table = np.array([(kinds[a.kind], a.stage, a.microbatch, t) for order in shape.orders for t,
                      a in enumerate(order)],
                     dtype=np.int64).reshape(-1, 4)
    kind, stage, mb, pos = table.T
    A = len(table)
    # (kind, chunk, microbatch) -> action, A where the schedule has no such action
    ident = np.full((4, S, m), A)
    ident[kind, stage, mb] = np.arange(A)
    grad = np.where(ident[1] < A, ident[1], ident[2])  # the action sending the input gradient: B, or I
    none_hop = S - 1  # the zero row of the hop table
    prev = np.where(pos > 0, np.arange(A) - 1, A)
    dep1, hop1 = np.full(A, A), np.full(A, none_hop)
    dep2, hop2 = np.full(A, A), np.full(A, none_hop)
    fwd = (kind == 0) & (stage > 0)  # the forward of the chunk before, across boundary k-1
    dep1[fwd], hop1[fwd] = ident[0, stage[fwd] - 1, mb[fwd]], stage[fwd] - 1
    w = kind == 3  # the input gradient of the same chunk
    dep1[w] = grad[stage[w], mb[w]]
    back = (kind == 1) | (kind == 2)  # its own forward, and the gradient from the chunk after
    dep1[back] = ident[0, stage[back], mb[back]]
    nxt = back & (stage < S - 1)
    dep2[nxt], hop2[nxt] = grad[stage[nxt] + 1, mb[nxt]], stage[nxt]
    # the sends torch's single-stage loops wait for, each by the action consuming the last of them
    pre, fused, at_end = np.full(A, A), np.full(A, A), np.full(shape.num_ranks, A)
    waits = shape.send_waits
    if waits is not None:
        def consumer(sends: tuple[Action, ...]) -> int:
            return int(ident[kinds[sends[-1].kind], sends[-1].stage, sends[-1].microbatch]) if sends else A

        first = np.cumsum([0] + [len(o) for o in shape.orders])
        for r, w in enumerate(waits):
            for t in range(len(shape.orders[r])):
                pre[first[r] + t], fused[first[r] + t] = consumer(w.before_post[t]), consumer(w.with_post[t])
            at_end[r] = consumer(w.at_end)
    # longest-path level of each node (the orders are deadlock-free, so the graph is acyclic): node a is
    # action a's post, node A + a its start, node 2A "none"; nodes of one level are independent
    none = 2 * A

    def start_node(ids: np.ndarray) -> np.ndarray:
        return np.where(ids < A, A + ids, none)

    def post_node(ids: np.ndarray) -> np.ndarray:
        return np.where(ids < A, ids, none)

    post_deps = np.stack([start_node(prev), post_node(pre), start_node(dep1), start_node(dep2)])
    start_deps = np.stack([np.arange(A), post_node(fused)])
    level = _longest_path_levels(
        np.concatenate([post_deps, np.vstack([start_deps, np.full((2, A), none)])], axis=1))
    if level is None:
        # a cycle: torch's loops never wait on themselves; reaching this is a bug in this module
        raise RuntimeError(f"the step graph of {shape.schedule} (p={shape.num_ranks}, m={m}) has a cycle")
    depth = int(level.max()) + 1
    levels = list(zip(_group_by(level[:A], depth), _group_by(level[A:], depth)))
    ranks = shape.stage_ranks
    crosses = np.array([float(ranks[k] != ranks[k + 1]) for k in range(S - 1)])
    last = np.cumsum([len(o) for o in shape.orders]) - 1
    return _StepGraph(A, tuple(levels), prev, dep1, hop1, dep2, hop2, kind * S + stage, crosses, last,
                      pre, fused, at_end)


# How each kind of given split is named in messages, and the plan() keyword that gives it
GIVEN_AS = {"boundaries": "boundaries", "megatron_layout": "the Megatron layout",
            "fqns": "the module FQNs per model part"}


def split_by_method(
    method: str,
    arr: LayerArrays,
    opts: CostOptions,
    given: tuple[int, ...] | None = None,
    given_as: str = "boundaries",
    time_limit_s: float = 2.0,
) -> tuple[tuple[int, ...], dict[str, Any]]:
    """Stage boundaries by ``method``; the second value carries solver evidence (proven bounds)."""

    S = opts.num_chunks
    L = len(arr.forward_s)
    if method == "given":
        assert given is not None
        b = list(given)
        if given_as != "boundaries" and len(b) != S + 1:
            n = len(b) - 1
            raise StageplanError(
                f"{GIVEN_AS[given_as]} gives {n} stage{'s' if n != 1 else ''} but {opts.num_ranks} ranks x "
                f"{opts.virtual_stages} chunks need {S}; give {S} stages, or plan {n} (--stages {n}, one "
                f"chunk per rank)")
        ranks = list(opts.shape.stage_ranks)
        if given_as == "megatron_layout" and ranks != [s % opts.num_ranks for s in range(S)]:
            raise StageplanError(
                f"Megatron places virtual stages round-robin (stage s on rank s mod {opts.num_ranks}), and "
                f"{opts.shape.schedule} places them otherwise (ranks {ranks}), so the layout would be scored "
                "on a placement Megatron never runs; score it with --schedule Interleaved1F1B, or give this "
                "schedule's split with --boundaries or --fqns")
        if len(b) != S + 1 or b[0] != 0 or b[-1] != L or any(x >= y for x, y in zip(b, b[1:])):
            raise StageplanError(
                f"boundaries {b} must be {S + 1} increasing cut points from 0 to {L} (the number of layers) "
                f"for {opts.num_ranks} ranks x {opts.virtual_stages} chunks, every stage non-empty; e.g. "
                f"{','.join(str(x) for x in partition_uniform(L, S))}"
            )
        return tuple(b), {}
    if method == "uniform":  # equal layer counts: Megatron's default, DeepSpeed partition_method="uniform"
        return tuple(partition_uniform(L, S)), {}
    if method == "parameters":  # DeepSpeed's default partition_method="parameters": balance parameter counts
        return tuple(partition_balanced(arr.param_bytes, S)), {}
    try:
        return _optimal_boundaries(arr, opts, time_limit_s)
    except InfeasiblePlanError as exc:
        raise InfeasiblePlanError(with_memory_remedies(str(exc), opts),
                                  min_memory_limit_bytes=exc.min_memory_limit_bytes) from None


def with_memory_remedies(message: str, opts: CostOptions) -> str:
    """``message`` with its remedies (from "; raise the limit" on) replaced by those not already set: a 70B
    plan with --recompute on was told "or use recomputation". Each remedy names its flag.

    The solvers know costs and limits, not the options behind them, so the remedies are chosen here."""
    head, sep, tail = message.partition("; raise the limit")
    if not sep:
        return message
    alone = "split that layer" in tail  # one layer exceeds the limit wherever it sits
    out = ["raise the limit (--memory-limit)"]
    if not alone:
        out.append("add ranks (--stages)")
    if opts.virtual_stages > 1:
        out.append("use fewer virtual stages (--virtual-stages)")
    if not opts.recompute:
        out.append("recompute activations (--recompute)")
    # 1F1B holds at most min(p - s, m) microbatches' activations on stage s; GPipe and the looped and
    # interleaved orders hold more (torch.distributed.pipelining.schedules)
    if opts.schedule != "1F1B":
        out.append("use a schedule with fewer microbatches in flight (--schedule 1F1B)")
    if alone:
        out.append("split that layer")
    return f"{head}; {', '.join(out[:-1])}, or {out[-1]}" if len(out) > 1 else f"{head}; {out[0]}"


def _optimal_boundaries(arr: LayerArrays, opts: CostOptions,
                        time_limit_s: float) -> tuple[tuple[int, ...], dict[str, Any]]:
    from stageplan.planning import interleaved, solver

    S = opts.num_chunks
    inp = solver_inputs(arr, opts)
    if opts.virtual_stages > 1:
        rank_speeds = np.array([d.speed for d in opts.devices])
        # a rank's activation peak over its order, as evaluate counts it
        exact = inp["activation_bytes"] is not None
        isol = interleaved.solve_interleaved(
            inp["costs"],
            opts.num_ranks,
            opts.virtual_stages,
            rank_speeds=rank_speeds,
            memory_bytes=inp["static_memory_bytes" if exact else "memory_bytes"],
            memory_limit_bytes=inp["limits"],
            placement=opts.shape.stage_ranks,
            boundary_costs=inp["boundary_costs"],
            memory_start_bytes=inp["memory_start_bytes"],
            memory_end_bytes=inp["memory_end_bytes"],
            activation_bytes=inp["activation_bytes"] if exact else None,
            live_counts=opts.shape.live_counts if exact else None,
            time_limit_s=time_limit_s,
        )
        # the MILP balances the layers; every rank also pays the schedule's loop and PipelineStage's overhead
        # around its v chunks (evaluate)
        loop = per_chunk_s(opts) * opts.virtual_stages
        return tuple(isol.boundaries), {"optimal": isol.optimal,
                                        "proven_lower_bound_s": isol.lower_bound + loop,
                                        "timed_out": isol.timed_out}
    sol = solver.solve(inp["costs"], S, stage_speeds=inp["speeds"], boundary_costs=inp["boundary_costs"],
                       memory_bytes=inp["memory_bytes"], memory_start_bytes=inp["memory_start_bytes"],
                       memory_end_bytes=inp["memory_end_bytes"], memory_limit_bytes=inp["limits"])
    return tuple(sol.boundaries), {"optimal": True}


# The tie-break's bounded work: at most _TIE_SPLITS equal-bottleneck splits are listed (visiting at most
# _TIE_NODES search nodes), else a descent from the solver's split runs for at most _TIE_ROUNDS moves; in all,
# at most _TIE_WORK schedule actions are simulated (splits x actions per step: 64 splits at p = 64, m = 128).
_TIE_SPLITS = 256
_TIE_NODES = 2048
_TIE_WORK = 2**20
_TIE_ROUNDS = 8
_STEP_ROUNDS = 64  # the step search's descents (from several seeds) may move further


def _alive_positions(costs: SplitCosts, cap: float, most: int) -> np.ndarray | None:
    """One chunk per rank: ``alive[s, x]`` when boundary s can sit at layer x in a split whose stages all stay
    within ``cap`` and fit in memory; None when there are more than ``most`` such splits (or too many
    positions to count them). Positions are first bounded by the work alone (greedy from each end), then
    counted exactly."""
    opts = costs.opts
    S, L = opts.num_chunks, costs.num_layers
    # layer-time prefix at speed 1
    work = costs.fwd_prefix * (2.0 if opts.recompute else 1.0) + costs.bwd_prefix
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
    """Every split whose rank times stay within ``cap`` and whose rank memory fits, in lexicographic order;
    None when there are more than ``most``. One chunk per rank: counted first (``_alive_positions``), then
    listed without dead ends; interleaved: a search over rank loads that gives up after _TIE_NODES nodes."""
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
    # an interleaved rank's activations peak over its order: carry, per rank, each live-count vector's sum
    # over the chunks placed so far (a lower bound of the rank's peak while chunks remain, its peak once all
    # are placed)
    live = costs.live

    def visit(s: int, x: int, load: np.ndarray, mem: np.ndarray, cuts: list[int],
              partial: tuple[np.ndarray, ...] = ()) -> bool:
        nonlocal nodes
        nodes += 1
        if (alive is None and nodes > _TIE_NODES) or len(found) > most:
            return False
        r, last = ranks[s], s == S - 1
        # a stage's work only grows with its end: stop where the work alone passes what its rank has left
        reach = int(np.searchsorted(work, work[x] + (cap - load[r]) * costs.speed[s] * (1 + 1e-9),
                                    side="right")) - 1
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
    """The split with the lowest step; among steps within TIE_REL of it, ``keep`` (the solver's split, which
    also has the least memory pressure) when it is one, else the lexicographically smallest."""
    low = float(steps.min())
    tied = [tuple(int(v) for v in row) for row in splits[steps <= low * (1 + TIE_REL)]]
    return (keep if keep in tied else min(tied)), low


def _lowest_step(costs: SplitCosts, start: tuple[int, ...], cap: float, rounds: int,
                 other_starts: Sequence[tuple[int, ...]] = ()) -> dict[str, Any]:
    """The split with the lowest simulated step among those whose every rank's time per microbatch stays
    within ``cap`` and whose memory fits: every such split when there are few (exhaustive: exact for the
    simulator), else a descent from ``start`` (and then from each of ``other_starts`` that fits) moving one
    boundary at a time, best move first, while the step falls, for at most ``rounds`` moves each. Never
    returns a split slower than ``start``. All bounded by _TIE_* (at most _TIE_WORK schedule actions
    simulated)."""
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
        if step > step0 * (1 + TIE_REL):  # the start was not listed: never trade it for a slower split
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
            if low >= here_step * (1 - TIE_REL):
                break
            here, here_step = new, low
        if here_step < step * (1 - TIE_REL):
            best, step = here, here_step
    return {"boundaries": best, "step_s": step, "from_step_s": step0, "splits_evaluated": evaluated,
            "exhaustive": False}


def _tie_break(costs: SplitCosts, start: tuple[int, ...]) -> tuple[tuple[int, ...], dict[str, Any]]:
    """Among the splits whose bottleneck stays within the solver's (and whose memory fits), the one with the
    lowest simulated step: every such split when there are few (exhaustive), else a descent from the solver's
    split that moves one boundary at a time, best move first, while the step falls. Bounded by _TIE_*."""
    f, b, c, _ = costs.split(np.array([start]))
    cap = float(costs.rank_time(f, b, c).max()) * (1 + TIE_REL)
    found = _lowest_step(costs, start, cap, _TIE_ROUNDS)
    return found["boundaries"], {"from_boundaries": list(start), "to_boundaries": list(found["boundaries"]),
                                 "from_step_s": found["from_step_s"], "to_step_s": found["step_s"],
                                 "splits_evaluated": found["splits_evaluated"],
                                 "exhaustive": found["exhaustive"]}


def _step_search(costs: SplitCosts, start: tuple[int, ...], step0: float) -> dict[str, Any]:
    """The split with the lowest simulated step, whatever its bottleneck, searched from the bottleneck-optimal
    split ``start`` (whose step is ``step0``). A rank runs its m forwards and backwards one after another, so
    a split whose step beats ``start``'s has every rank's forward + backward per microbatch within step / m:
    adding the most a rank's crossings can add, that caps the rank times the search lists (exhaustive when few
    splits pass it, else descents from ``start``, the uniform split and the parameter-balanced one)."""


    opts, arr = costs.opts, costs.arr
    S, L, m = opts.num_chunks, costs.num_layers, opts.num_microbatches
    crossings = opts.virtual_stages * 2.0 * float(costs.comm.max()) if costs.comm.size else 0.0
    cap = (step0 / m + crossings) * (1 + 1e-9)
    seeds = [tuple(partition_uniform(L, S)), tuple(partition_balanced(arr.param_bytes, S))]
    found = _lowest_step(costs, start, cap, _STEP_ROUNDS, seeds)
    to = found["boundaries"]
    f, b, c, _ = costs.split(np.array([start, to]))
    bottleneck = costs.rank_time(f, b, c).max(axis=1)
    return {"from_boundaries": list(start), "to_boundaries": list(to), "from_step_s": step0,
            "to_step_s": found["step_s"],
            "from_bottleneck_s": float(bottleneck[0]), "to_bottleneck_s": float(bottleneck[1]),
            "rank_time_cap_s": cap, "splits_evaluated": found["splits_evaluated"],
            "exhaustive": found["exhaustive"]}


def optimal_split(arr: LayerArrays, opts: CostOptions, objective: str, time_limit_s: float,
                  report: bool = True
                   ) -> tuple[tuple[int, ...], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The optimal method's split: the solver's (least bottleneck), the tie-break among equal bottlenecks,
    then the search for the lowest step whatever the bottleneck, which ``objective`` "step" takes and
    "bottleneck" only reports (skipped there when ``report`` is False: only the split is wanted). Returns the
    split, the solver's evidence, the tie-break's and the step search's."""
    boundaries, solver_evidence = split_by_method("optimal", arr, opts, time_limit_s=time_limit_s)
    costs = SplitCosts(arr, opts)
    boundaries, tie = _tie_break(costs, boundaries)
    wanted = opts.num_chunks > 1 and (objective == "step" or report)
    search = _step_search(costs, boundaries, tie["to_step_s"]) if wanted else {}
    if search:
        search["objective"] = objective
        if objective == "step":
            boundaries = tuple(search["to_boundaries"])
    return boundaries, solver_evidence, tie, search


def versus_optimal(arr: LayerArrays, opts: CostOptions, ev: Any, given_as: str, given_input: Any,
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
        best, _, _, _ = optimal_split(arr, opts, objective, time_limit_s, report=False)
    except InfeasiblePlanError as exc:
        out.update(optimal_boundaries=None, optimal_infeasible=str(exc))
        return out
    opt = evaluate(arr, best, opts)
    out.update(
        optimal_boundaries=list(best), optimal_bottleneck_s=opt.bottleneck_s,
        optimal_predicted_step_s=opt.predicted_step_s,
        bottleneck_ratio=ev.bottleneck_s / opt.bottleneck_s if opt.bottleneck_s > 0 else 1.0,
        step_ratio=ev.predicted_step_s / opt.predicted_step_s if opt.predicted_step_s > 0 else 1.0,
        optimal_rank_memory_bytes=[float(x) for x in opt.rank_memory_bytes],
    )
    return out


__all__ = ["partition_balanced", "partition_uniform", "peer_splits"]


def partition_uniform(num_items: int, num_parts: int) -> tuple[int, ...]:
    """DeepSpeed's ``partition_uniform``: equal layer counts, the first ``n % p`` parts one larger.

    With ``num_items <= num_parts`` part k ends at ``min(k, num_items)`` (so some parts are empty).

    >>> partition_uniform(10, 4)
    (0, 3, 6, 8, 10)
    """
    n = _validate_count_zero("num_items", num_items)
    p = validate_count("num_parts", num_parts, "parts")
    if n <= p:
        return tuple(min(k, n) for k in range(p + 1))
    chunksize = n // p
    residual = n - chunksize * p
    # DeepSpeed: arange(0, (p+1)*chunksize, chunksize), then parts[i+1:] += 1 for i < residual
    return tuple(k * chunksize + min(k, residual) for k in range(p + 1))


def _validate_count_zero(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 0:
        raise StageplanError(f"{name} must be an integer >= 0, got {value!r}; pass a count of layers")
    return int(value)


def partition_balanced(weights: ArrayLike, num_parts: int) -> tuple[int, ...]:
    """DeepSpeed's ``partition_balanced``: the O(n^2 p) DP minimising (max part sum - min part sum).

    Same results as DeepSpeed's triple loop, ties included (``if dp_cost[i, j] >= cost`` keeps the
    last k with the minimal cost); only the innermost loop over k is vectorised, and over j too.
    With ``n <= num_parts`` it falls back to :func:`partition_uniform`.

    >>> partition_balanced([1, 1, 1, 1, 4], 2)
    (0, 4, 5)
    """
    w = np.asarray(weights)
    if w.ndim != 1:
        raise StageplanError(
            f"weights must be one-dimensional (one value per layer), got shape {shape_text(w.shape)}; "
            "pass a flat sequence"
        )
    try:
        wf = w.astype(np.float64)
    except (TypeError, ValueError) as exc:
        raise StageplanError(f"weights must be numeric, got {weights!r}; pass numbers") from exc
    if not np.all(np.isfinite(wf)):
        k = int(np.flatnonzero(~np.isfinite(wf))[0])
        raise StageplanError(
            f"weights[{k}] is {float(wf[k])!r}; every weight must be finite; check the weights")
    m = validate_count("num_parts", num_parts, "parts")
    n = w.size
    if n <= m:
        return partition_uniform(n, m)
    dp_max = np.full((n + 1, m + 1), np.inf)
    dp_min = np.full((n + 1, m + 1), np.inf)
    dp_cost = np.full((n + 1, m + 1), np.inf)
    position = np.zeros((n + 1, m + 1), dtype=np.int64)
    prefix_sum = np.zeros(n + 1)
    prefix_sum[1:] = np.cumsum(w) if w.size else []  # as DeepSpeed: cumsum in the input dtype
    dp_max[0, 0] = 0
    dp_cost[0, 0] = 0
    for i in range(1, n + 1):
        jm = min(i, m)
        seg = (prefix_sum[i] - prefix_sum[:i])[:, None]  # (k, 1)
        max_sum = np.maximum(dp_max[:i, :jm], seg)  # column j-1 for j = 1..jm
        min_sum = np.minimum(dp_min[:i, :jm], seg)
        cost = max_sum - min_sum
        # the last k attaining the minimum (DeepSpeed updates on >=)
        k = i - 1 - np.argmin(cost[::-1], axis=0)
        cols = np.arange(jm)
        dp_cost[i, 1 : jm + 1] = cost[k, cols]
        dp_max[i, 1 : jm + 1] = max_sum[k, cols]
        dp_min[i, 1 : jm + 1] = min_sum[k, cols]
        position[i, 1 : jm + 1] = k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(int(position[parts[-1], j]))
    parts.reverse()
    return tuple(parts)


# The peers' default splits, each under its own name, with what it does (printed under the comparison
# table). DeepSpeed's two rules are the planner's methods "uniform" and "parameters".
PEERS = {
    "megatron": "Megatron-LM default: equal blocks per stage, embedding (E) on the first, head (L) on the "
                "last",
    "megatron+E": "Megatron-LM --account-for-embedding-in-pipeline-split: E counts as one block",
    "megatron+L": "Megatron-LM --account-for-loss-in-pipeline-split: L counts as one block",
    "megatron+E+L": "Megatron-LM with both: E and L count as one block each",
    "torchtitan": "torchtitan default (generate_llm_fqn_per_model_part): E and L weigh one block each",
}


def _megatron_split(edge: tuple[bool, bool], blocks: int, num_stages: int,
                    account: tuple[bool, bool]) -> tuple[int, ...] | str:
    """Megatron-LM's split (megatron/core/transformer/transformer_block.py, get_num_layers_to_build, and the
    check in transformer_config.py): (blocks + the accounted E and L) // p blocks per stage, one fewer on the
    first stage with E accounted and on the last with L accounted; the count must divide by p."""
    counted = blocks + sum(account)
    if counted % num_stages:
        extra = " + ".join(["E"] * account[0] + ["L"] * account[1])
        return (f"Megatron needs {blocks} blocks{' + ' + extra if extra else ''} = {counted} divisible by "
                f"{num_stages} stages")
    per = counted // num_stages
    sizes = [per - (account[0] and s == 0) - (account[1] and s == num_stages - 1) for s in range(num_stages)]
    if any(n < 0 for n in sizes):
        return f"{per} block per stage leaves the first or last stage with fewer than none"
    return _with_edges(sizes, edge)


def _with_edges(sizes: Sequence[int], edge: tuple[bool, bool]) -> tuple[int, ...] | str:
    """Boundaries from blocks per stage, E (the first layer) with the first stage and L (the last) with the
    last; a stage left with no layer is reported (a stageplan split needs one per stage)."""
    sizes = list(sizes)
    sizes[0] += edge[0]
    sizes[-1] += edge[1]
    if any(n <= 0 for n in sizes):
        return f"stage {sizes.index(min(sizes))} would hold no layer"
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return tuple(out)


def _torchtitan_split(blocks: int, num_stages: int) -> tuple[int, ...] | str:
    """torchtitan's generate_llm_fqn_per_model_part(num_stages, num_layers, input_weight=1, output_weight=1)
    (torchtitan/distributed/pipeline_parallel.py): blocks + 2 effective layers, the first (effective % p)
    stages one more, the embedding and the head each taking one of their stage's share."""
    effective = blocks + 2
    per, extra = divmod(effective, num_stages)
    if per < 1:
        return f"torchtitan needs at most {effective} stages (blocks + E + L)"
    sizes = [per + (s < extra) - (s == 0) - (s == num_stages - 1) for s in range(num_stages)]
    sizes[-1] = blocks - sum(sizes[:-1])  # the last stage takes what is left, as torchtitan's loop does
    return _with_edges(sizes, (True, True))


def peer_splits(layer_names: Sequence[str], named: Sequence[str], num_stages: int) -> dict[str, Any]:
    """The boundaries each peer's default rule gives this profile on ``num_stages`` stages (chunks), or why
    the rule does not apply (a string). E is the first layer and L the last where they are not named blocks
    (``named``: the profile's decoder blocks).

    >>> blocks = [f"h.{i}" for i in range(8)]
    >>> peer_splits(["emb", *blocks, "head"], blocks, 4)["megatron"]
    (0, 3, 5, 7, 10)
    """
    is_named = set(named)
    L = len(layer_names)
    edge = (L > 0 and layer_names[0] not in is_named, L > 1 and layer_names[-1] not in is_named)
    blocks = L - sum(edge)
    if any(n not in is_named for n in layer_names[edge[0]:L - edge[1]]):
        why = "the profile's layers are not E, blocks, L in that order"
        return dict.fromkeys(PEERS, why)
    out: dict[str, Any] = {"megatron": _megatron_split(edge, blocks, num_stages, (False, False))}
    for name, account in (("megatron+E", (True, False)), ("megatron+L", (False, True)),
                          ("megatron+E+L", (True, True))):
        missing = [w for w, on, has in zip(("embedding", "head"), account, edge) if on and not has]
        out[name] = (f"the profile has no {' or '.join(missing)} layer apart from the blocks" if missing
                     else _megatron_split(edge, blocks, num_stages, account))
    out["torchtitan"] = (_torchtitan_split(blocks, num_stages) if all(edge)
                         else "the profile has no embedding and head apart from the blocks")
    return out
