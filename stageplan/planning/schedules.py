"""Per-rank action orders of torch.distributed.pipelining schedules, mirrored from torch 2.13's code, and the
schedule's shape (in-flight microbatches, live activations) once per (schedule, p, m, v)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

from stageplan.errors import StageplanError
from stageplan.formats.schedule import (
    SINGLE_STAGE,
    ZERO_BUBBLE,
    check_count,
    check_microbatches,
    interleaved_rounds,
    normalize_schedule,
    placement_of,
)
from stageplan.formats.timeline import Simulation, TimelineEvent

if TYPE_CHECKING:
    pass

__all__ = [
    "Action",
    "ScheduleShape",
    "SendWaits",
    "bubble_closed_form",
    "check_microbatches",
    "normalize_schedule",
    "peak_inflight",
    "rank_orders",
    "schedule_shape",
    "send_waits",
]
# Share of a stage's backward time given to W in zero-bubble schedules; I gets the rest. A profile
# measures one backward per layer (autograd hooks cannot time the weight-gradient work alone; torch
# splits I from W only inside its zero-bubble stages, torch/distributed/pipelining/_backward.py), so
# the split is an assumption: an even split, the I = W case the zero-bubble paper (Qi et al. 2024,
# arXiv 2401.10241) analyses.
WEIGHT_GRAD_SHARE = 0.5


@dataclass(frozen=True)
class Action:
    """One compute action: kind "F" forward, "B" full backward, "I" input-grad, "W" weight-grad."""

    stage: int
    microbatch: int
    kind: str

    def __str__(self) -> str:
        # torch's _Action notation, e.g. "2F0" = stage 2, forward, microbatch 0.
        return f"{self.stage}{self.kind}{self.microbatch}"


# ---------------------------------------------------------------------------------------------------
# Orders. Each generator mirrors the torch 2.13 code that decides what a rank executes; the tests
# compare them with torch's own execution loop run on recording fake stages.


def _gpipe(p: int, m: int, rank: int) -> list[Action]:
    # ScheduleGPipe._step_microbatches: all forwards, then all backwards, both in microbatch order.
    return [Action(rank, i, "F") for i in range(m)] + [Action(rank, i, "B") for i in range(m)]


def _one_f_one_b(p: int, m: int, rank: int) -> list[Action]:
    # Schedule1F1B._step_microbatches (the executed loop; its pipeline_order IR differs on the last
    # rank, where it starts at F1). Warm-up min(m, p - rank) forwards, then B/F pairs, then cool-down Bs.
    warmup = min(m, p - rank)
    order = [Action(rank, i, "F") for i in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        order.append(Action(rank, bwd, "B"))
        bwd += 1
        if fwd == m:
            break
        order.append(Action(rank, fwd, "F"))
        fwd += 1
    order.extend(Action(rank, i, "B") for i in range(bwd, m))
    return order


def _interleaved(p: int, m: int, v: int, rank: int, *, zero_bubble: bool) -> list[Action]:
    # ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble._calculate_single_rank_operations with
    # _get_warmup_ops and _get_1f1b_rank_ops, without the None (idle) slots. The zero-bubble variant's
    # _add_bubbles_to_actions only inserts None slots, so it does not change the compute order.
    rounds = interleaved_rounds(p, m)
    per_round = m // rounds
    factor = 1 if zero_bubble else 2
    warmup = min((v - 1) * per_round + factor * (p - 1 - rank), m * v)
    total_mb_ops = v * m
    fwd_bwd = total_mb_ops - warmup
    cooldown = total_mb_ops - fwd_bwd
    delay_w = rank  # num_1f1b_microbatches: W lags I by this many steady-state steps

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * p + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    next_mb: dict[tuple[str, int], int] = {}

    def take(kind: str, stage: int) -> Action:
        mb = next_mb.get((kind, stage), 0)
        next_mb[(kind, stage)] = mb + 1
        return Action(stage, mb, kind)

    grad_kind = "I" if zero_bubble else "B"
    order: list[Action] = []
    backward_steps: list[int] = []
    weights_done = 0
    for step in range(warmup + fwd_bwd + cooldown):
        if step < warmup:
            order.append(take("F", fwd_stage(step)))
            continue
        if step < warmup + fwd_bwd:
            order.append(take("F", fwd_stage(step)))
        order.append(take(grad_kind, bwd_stage(step)))
        backward_steps.append(step)
        if zero_bubble and step - warmup >= delay_w:
            order.append(take("W", bwd_stage(backward_steps[weights_done])))
            weights_done += 1
    if zero_bubble:
        for step in backward_steps[weights_done:]:
            order.append(take("W", bwd_stage(step)))
    return order


def _looped_bfs(p: int, m: int, v: int, rank: int) -> list[Action]:
    # ScheduleLoopedBFS._calculate_single_rank_operations: every microbatch through each local stage in
    # turn, then backwards through the local stages in reverse, microbatches in reverse.
    stages = range(rank, p * v, p)
    order = [Action(s, i, "F") for s in stages for i in range(m)]
    order += [Action(s, i, "B") for s in reversed(stages) for i in reversed(range(m))]
    return order


def _zbv(p: int, m: int, rank: int) -> list[Action]:
    # ScheduleZBVZeroBubble._calculate_single_rank_operations: it plans max(2p - 1, m) microbatches and
    # then drops the actions of microbatches >= m.
    n = max(2 * p - 1, m)
    c0, c1 = rank, 2 * p - 1 - rank
    order: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - rank) - 1):
        order.append(Action(c0, f0, "F"))
        f0 += 1
    for _ in range(rank):
        order += [Action(c1, f1, "F"), Action(c0, f0, "F")]
        f1 += 1
        f0 += 1
    for _ in range(p - rank):
        order += [Action(c1, f1, "F"), Action(c1, b1, "I"), Action(c1, b1, "W")]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            order.append(Action(c0, f0, "F"))
            f0 += 1
        order += [Action(c0, b0, "I"), Action(c0, b0, "W")]
        b0 += 1
        order += [Action(c1, f1, "F"), Action(c1, b1, "I"), Action(c1, b1, "W")]
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        order += [Action(c0, b0, "I"), Action(c1, b1, "I")]
        b0 += 1
        b1 += 1
    for _ in range(p - rank):
        order += [Action(c0, b0, "I"), Action(c0, w0, "W")]
        b0 += 1
        w0 += 1
    order += [Action(c1, i, "W") for i in range(w1, b1)]
    order += [Action(c0, i, "W") for i in range(w0, b0)]
    return [a for a in order if a.microbatch < m]


@dataclass(frozen=True)
class SendWaits:
    """Where a rank of a single-stage schedule (GPipe, 1F1B)
    waits for its own sends, as torch 2.13's loops do.

    A send is named by the action that consumes it on the neighbouring rank (``Action(s + 1, i, "F")`` for
    stage s's activation of microbatch i, ``Action(s - 1, i, "B")`` for its input gradient): it completes once
    that rank has posted the matching receive and the message has crossed (gloo and NCCL point-to-point sends
    are rendezvous: a 1 KiB-4 MiB gloo send's wait() returns only after the receive is posted, as
    the run's timeline shows). Per action of the rank's order: ``before_post`` (sends waited before the
    action's receive is posted) and ``with_post`` (sends fused with that receive, waited together);
    ``at_end``: sends waited after the last action, before ``step()`` returns (so before the tied all-reduce
    and the optimizer step)."""

    before_post: tuple[tuple[Action, ...], ...]
    with_post: tuple[tuple[Action, ...], ...]
    at_end: tuple[Action, ...]


def _f_send(p: int, stage: int, mb: int) -> list[Action]:
    return [Action(stage + 1, mb, "F")] if stage < p - 1 else []


def _b_send(stage: int, mb: int) -> list[Action]:
    return [Action(stage - 1, mb, "B")] if stage > 0 else []


def _gpipe_send_waits(p: int, m: int, rank: int) -> SendWaits:
    # ScheduleGPipe._step_microbatches: the forward sends are waited after the last forward, before the first
    # backward's receive; the backward sends after the last backward
    before: list[list[Action]] = [[] for _ in range(2 * m)]
    before[m] = _f_send(p, rank, m - 1)  # sends to one peer complete in order: the last one stands for all
    return SendWaits(tuple(map(tuple, before)), ((),) * (2 * m), tuple(_b_send(rank, m - 1)))


def _one_f_one_b_send_waits(p: int, m: int, rank: int) -> SendWaits:
    # Schedule1F1B._step_microbatches, replayed: after each warm-up forward the previous forward send is
    # waited; the B/F pairs fuse the pending send with the next receive and wait both; each cool-down backward
    # waits the previous backward send after it; the last send is waited at the end
    before: list[list[Action]] = []
    fused: list[list[Action]] = []
    pending: list[Action] = []  # waited after the last action, before the next receive is posted
    warmup = min(m, p - rank)
    send_work: list[Action] = []
    fwd_sends: list[Action] = []
    for j in range(warmup):
        before.append(pending)
        fused.append([])
        pending = send_work
        fwd_sends = _f_send(p, rank, j)
        if j != warmup - 1:
            send_work = fwd_sends
    fwd, bwd = warmup, 0
    while True:
        before.append(pending)
        fused.append(fwd_sends)
        pending = []
        bwd_sends = _b_send(rank, bwd)
        bwd += 1
        if fwd == m:
            break
        before.append([])
        fused.append(bwd_sends)
        fwd_sends = _f_send(p, rank, fwd)
        fwd += 1
    send_work = bwd_sends
    for _ in range(bwd, m):
        before.append(pending)
        fused.append([])
        pending = send_work
        send_work = _b_send(rank, bwd)
        bwd += 1
    return SendWaits(tuple(map(tuple, before)), tuple(map(tuple, fused)), tuple(pending + send_work))


def send_waits(schedule: str, num_ranks: int, num_microbatches: int) -> tuple[SendWaits, ...] | None:
    """Per rank, where torch's loop waits for the rank's own sends (:class:`SendWaits`), for the single-stage
    schedules; None for the others (torch's multi-stage runtime, whose sends are not modelled as waits). The
    same as ``schedule_shape(...).send_waits``."""
    return schedule_shape(schedule, num_ranks, num_microbatches).send_waits


@lru_cache(maxsize=256)
def _orders(name: str, p: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    orders: list[list[Action]] = []
    for rank in range(p):
        if name == "GPipe":
            orders.append(_gpipe(p, m, rank))
        elif name == "1F1B":
            orders.append(_one_f_one_b(p, m, rank))
        elif name == "Interleaved1F1B":
            orders.append(_interleaved(p, m, v, rank, zero_bubble=False))
        elif name == "InterleavedZeroBubble":
            orders.append(_interleaved(p, m, v, rank, zero_bubble=True))
        elif name == "LoopedBFS":
            orders.append(_looped_bfs(p, m, v, rank))
        else:  # ZBVZeroBubble
            orders.append(_zbv(p, m, rank))
    return tuple(tuple(order) for order in orders)


def rank_orders(
    schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
) -> tuple[tuple[Action, ...], ...]:
    """Per rank, the compute actions torch 2.13 executes, in order (no communication actions).

    >>> [str(a) for a in rank_orders("1F1B", 2, 3)[0]]
    ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
    """
    return schedule_shape(schedule, num_ranks, num_microbatches, virtual_stages).orders


def _peak_inflight(orders: tuple[tuple[Action, ...], ...], num_stages: int) -> tuple[int, ...]:
    # A forward saves the stage's activations for one microbatch; a full backward (B) frees them. With
    # I/W split, W still needs the stage's saved inputs, so the microbatch counts until its W.
    held = [0] * num_stages
    peak = [0] * num_stages
    for order in orders:
        for action in order:
            if action.kind == "F":
                held[action.stage] += 1
                peak[action.stage] = max(peak[action.stage], held[action.stage])
            elif action.kind in ("B", "W"):
                held[action.stage] -= 1
    return tuple(peak)


@dataclass(frozen=True)
class ScheduleShape:
    """Everything the cost model and the simulator read off a schedule's torch order, for one
    (schedule, num_ranks, num_microbatches, virtual_stages): computed once by :func:`schedule_shape`.

    ``orders[r]`` is rank r's compute actions in torch 2.13's order; ``stage_ranks[k]`` the rank running
    chunk k; ``peak_inflight[k]`` the most microbatches whose activations chunk k holds at once.
    """

    schedule: str
    num_ranks: int
    num_microbatches: int
    virtual_stages: int
    orders: tuple[tuple[Action, ...], ...]
    stage_ranks: tuple[int, ...]
    peak_inflight: tuple[int, ...]

    @property
    def num_chunks(self) -> int:
        """p * v: the number of contiguous layer runs (stages) the model is cut into."""
        return self.num_ranks * self.virtual_stages

    @property
    def receives_on_demand(self) -> bool:
        """A receive is posted only when the rank is about to run the action that needs it, so a crossing's
        transfer starts no earlier than that (torch's single-stage schedules, GPipe and 1F1B: each posts its
        receive right before the forward or backward and waits for it; a point-to-point message moves once
        both sides have posted, on gloo and NCCL alike). torch's multi-stage runtime posts receives ahead (its
        RECV_F and RECV_B actions), so there a transfer overlaps the receiving rank's compute."""
        return self.schedule in SINGLE_STAGE

    @cached_property
    def send_waits(self) -> tuple[SendWaits, ...] | None:
        """Per rank, where torch's loop waits for the rank's own sends (:class:`SendWaits`); None where
        receives are not on demand (torch's multi-stage runtime, whose sends are not modelled as waits)."""
        if not self.receives_on_demand:
            return None
        build = _gpipe_send_waits if self.schedule == "GPipe" else _one_f_one_b_send_waits
        return tuple(build(self.num_ranks, self.num_microbatches, r) for r in range(self.num_ranks))

    @property
    def zero_bubble(self) -> bool:
        """The backward is split into I and W actions (activations are held until W)."""
        return self.schedule in ZERO_BUBBLE

    @cached_property
    def live_counts(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Per rank, how many microbatches' activations each chunk holds at the moments the rank's live
        activation bytes can peak: the counts (one per chunk, 0 off the rank) after each forward in its order,
        keeping only those no other moment's counts cover chunk by chunk. A rank's activation peak is the
        largest of sum_c counts[c] x bytes of chunk c over these (exact for a rank holding several chunks,
        where sum_c peak_inflight[c] x bytes overcounts).

        >>> shape = schedule_shape("Interleaved1F1B", 2, 4, 2)
        >>> shape.peak_inflight, shape.live_counts[0]  # rank 0 holds chunks 0 and 2: never 4 and 2 at once
        ((4, 3, 2, 1), ((4, 0, 1, 0), (3, 0, 2, 0)))
        """
        out = []
        for counts in self._forward_counts:  # every distinct count vector after a forward, by rank
            unique = {tuple(int(c) for c in row) for row in counts}
            kept = [x for x in unique
                    if not any(y != x and all(a <= b for a, b in zip(x, y, strict=True)) for y in unique)]
            out.append(tuple(sorted(kept, reverse=True)))
        return tuple(out)

    def activation_peaks(self, chunk_bytes: np.ndarray) -> np.ndarray:
        """Each rank's peak of live activation bytes, given each chunk's saved bytes per microbatch:
        ``chunk_bytes`` (C,) gives (p,), (N, C) gives (N, p); the largest sum_c counts[c] x chunk_bytes[c]
        over ``live_counts``.

        >>> schedule_shape("Interleaved1F1B", 2, 4, 2).activation_peaks(
        ...     np.array([1.0, 1.0, 1.0, 1.0])
        ... ).tolist()
        [5.0, 3.0]
        """
        chunk_bytes = np.asarray(chunk_bytes, dtype=float)
        return np.stack([(chunk_bytes @ k.T).max(axis=-1) for k in self._forward_counts], axis=-1)

    @cached_property
    def _forward_counts(self) -> tuple[np.ndarray, ...]:
        """Per rank, every distinct count vector after a forward (``live_counts`` before its pruning of
        dominated moments, which costs O(n^2) in the moments): the same peaks for bytes >= 0, at a matrix
        product's cost; a layout search computes them for hundreds of schedules."""
        release = "W" if self.zero_bubble else "B"
        out = []
        for order in self.orders:
            held = [0] * self.num_chunks
            seen: set[tuple[int, ...]] = set()
            for action in order:
                if action.kind == "F":
                    held[action.stage] += 1
                    seen.add(tuple(held))
                elif action.kind == release:
                    held[action.stage] -= 1
            out.append(np.array(sorted(seen), dtype=float).reshape(len(seen), self.num_chunks))
        return tuple(out)


def schedule_shape(
    schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
) -> ScheduleShape:
    """Validate once and return the schedule's shape (cached per canonical name and counts).

    >>> shape = schedule_shape("1F1B", 4, 8)
    >>> shape.peak_inflight, shape.stage_ranks
    ((4, 3, 2, 1), (0, 1, 2, 3))
    """
    name = normalize_schedule(schedule)
    check_microbatches(name, num_ranks, num_microbatches, virtual_stages)
    return _shape(name, int(num_ranks), int(num_microbatches), int(virtual_stages))


@lru_cache(maxsize=256)
def _shape(name: str, p: int, m: int, v: int) -> ScheduleShape:
    orders = _orders(name, p, m, v)
    return ScheduleShape(name, p, m, v, orders, placement_of(name, p, v), _peak_inflight(orders, p * v))


def counts_shape(
    schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
) -> ScheduleShape:
    """The schedule's shape for memory only: its placement, each chunk's peak in flight and each rank's
    counts after every forward (what ``activation_peaks`` reads), computed from the counts of its order
    without building the order (``orders`` is empty: it cannot be simulated). GPipe holds every microbatch;
    1F1B min(p - s, m) on stage s; Interleaved1F1B follows torch's warm-up / steady / cool-down steps, as
    ``_interleaved`` does; other schedules get the full shape. A layout search prices thousands of candidates
    with it and simulates only its finalists.

    >>> full, fast = schedule_shape("Interleaved1F1B", 4, 8, 3), counts_shape("Interleaved1F1B", 4, 8, 3)
    >>> fast.peak_inflight == full.peak_inflight, fast.orders
    (True, ())
    """
    name = normalize_schedule(schedule)
    p, m, v = int(num_ranks), int(num_microbatches), int(virtual_stages)
    check_microbatches(name, p, m, v)
    if name in SINGLE_STAGE:  # one chunk a rank: its peak is the only moment that matters
        peaks = tuple([m] * p) if name == "GPipe" else tuple(min(p - r, m) for r in range(p))
        counts = [np.array([[float(peaks[r])]]) for r in range(p)]
    elif name == "Interleaved1F1B":
        counts, peak = [], [0] * (p * v)
        for rank in range(p):
            held = _interleaved_counts(p, m, v, rank)
            counts.append(held)
            for k in range(v):
                peak[k * p + rank] = int(held[:, k].max())
        peaks = tuple(peak)
    else:
        return schedule_shape(name, p, m, v)
    shape = ScheduleShape(name, p, m, v, (), placement_of(name, p, v), peaks)
    # one column per chunk of the whole pipeline (0 off the rank), as _forward_counts holds them
    wide = []
    for rank, held in enumerate(counts):
        full = np.zeros((held.shape[0], p * v))
        full[:, rank::p] = held
        wide.append(full)
    shape.__dict__["_forward_counts"] = tuple(wide)  # the cached_property's value, set where it is computed
    return shape


def _interleaved_counts(p: int, m: int, v: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s microbatches held per local chunk after each forward of torch's Interleaved1F1B (the
    steps of ``_interleaved``: warm-up forwards, then a forward and a backward per step, then backwards)."""
    rounds = interleaved_rounds(p, m)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    total = v * m
    steps = np.arange(total)
    # step s runs forward s, then (from step warmup on) backward s - warmup: before forward s, the first
    # max(0, s - warmup) backwards have run. Forward s is on local chunk (s // per_round) % v, backward b on
    # v - 1 - (b // per_round) % v.
    one_hot = np.eye(v)
    forwards = np.cumsum(one_hot[(steps // per_round) % v], axis=0)
    backwards = np.zeros((total + 1, v))
    np.cumsum(one_hot[v - 1 - (steps // per_round) % v], axis=0, out=backwards[1:])
    return forwards - backwards[np.maximum(steps - warmup, 0)]


def warmup_counts(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
                  ) -> np.ndarray:
    """Per chunk (p * v of them), the microbatches it holds at the first moment its rank holds the most in
    total: one of the counts ``counts_shape`` lists for the rank (so each rank's activation peak is at least
    sum_c counts[c] x bytes of chunk c), in closed form, without the order. GPipe: m on every stage; 1F1B:
    min(p - s, m); Interleaved1F1B: the end of rank r's warm-up, its first min(w_r + 1, v m) forwards with
    w_r = (v - 1) x m / rounds + 2 (p - 1 - r), taken round by round through its local chunks
    (``_interleaved_counts``).

    >>> warmup_counts("Interleaved1F1B", 2, 4, 2).tolist()  # rank 0: chunks 0 and 2; rank 1: chunks 1 and 3
    [3.0, 2.0, 2.0, 1.0]
    """
    name = normalize_schedule(schedule)
    p, m, v = int(num_ranks), int(num_microbatches), int(virtual_stages)
    if name == "GPipe":
        return np.full(p, float(m))
    if name == "1F1B":
        return np.minimum(np.arange(p, 0, -1), m).astype(float)
    if name != "Interleaved1F1B":
        raise StageplanError(f"warmup_counts prices GPipe, 1F1B and Interleaved1F1B, got {schedule!r}")
    per_round = m // interleaved_rounds(p, m)
    out = np.zeros(p * v)
    for rank in range(p):
        forwards = min((v - 1) * per_round + 2 * (p - 1 - rank) + 1, m * v)
        cycles, rest = divmod(forwards, v * per_round)
        for k in range(v):
            out[k * p + rank] = cycles * per_round + min(max(rest - k * per_round, 0), per_round)
    return out


def peak_inflight(
    schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
) -> tuple[int, ...]:
    """Per stage, the most microbatches whose activations the stage holds at once, from the order alone.

    Counted as #F - #B done on the stage (for zero-bubble schedules #F - #W: W needs the saved inputs).

    >>> peak_inflight("GPipe", 4, 8), peak_inflight("1F1B", 4, 8)
    ((8, 8, 8, 8), (4, 3, 2, 1))
    """
    return schedule_shape(schedule, num_ranks, num_microbatches, virtual_stages).peak_inflight


def bubble_closed_form(num_ranks: int, num_microbatches: int) -> float:
    """Idle share of a step for balanced GPipe and 1F1B without communication: (p - 1) / (m + p - 1).

    Source: GPipe (Huang et al. 2019, arXiv 1811.06965). 8 ranks and 8 microbatches give 46.7%.

    >>> round(bubble_closed_form(8, 8), 3), round(bubble_closed_form(8, 64), 3)
    (0.467, 0.099)
    """
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    return (p - 1) / (m + p - 1)


def _after_the_schedule(events: list[_Event], free: list[float], busy: list[float],
                        ranks: Sequence[int], optimizer: np.ndarray | None, tied_sync_s: float,
                        dp_sync: np.ndarray | None = None) -> None:
    """Per rank, after its last backward (or W): the tied-gradient all-reduce ("T"; a collective, so it starts
    when the last rank gets there), then the data-parallel replicas' sync of its chunks' gradients ("D"; the
    rank's own group of replicas, so each rank starts when it gets there) and one optimizer step over all its
    chunks' parameters ("O")."""
    first = {r: ranks.index(r) for r in sorted(set(ranks))}  # each rank's first chunk names its events
    if tied_sync_s > 0:
        begin = max(free)
        for rank, chunk in first.items():
            events.append(TimelineEvent(rank, chunk, -1, "T", begin, begin + tied_sync_s))
            free[rank] = begin + tied_sync_s
            busy[rank] += tied_sync_s
    for kind, per_chunk in (("D", dp_sync), ("O", optimizer)):
        if per_chunk is None:
            continue
        for rank, chunk in first.items():
            took = sum(float(per_chunk[k]) for k in range(len(ranks)) if ranks[k] == rank)
            if took > 0:
                events.append(TimelineEvent(rank, chunk, -1, kind, free[rank], free[rank] + took))
                free[rank] += took
                busy[rank] += took


def _times(name: str, values: npt.ArrayLike, length: int | None, remedy: str) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        raise StageplanError(
            f"{name} must be a sequence of numbers in seconds, got {values!r}; {remedy}"
        ) from None
    if array.ndim != 1:
        raise StageplanError(
            f"{name} must be one-dimensional (one value per stage), got shape {array.shape}; {remedy}"
        )
    if length is not None and array.shape[0] != length:
        raise StageplanError(f"{name} must have {length} values, got {array.shape[0]}; {remedy}")
    bad = np.flatnonzero(~np.isfinite(array) | (array < 0))
    if bad.size:
        k = int(bad[0])
        raise StageplanError(
            f"{name} must be finite and >= 0 seconds, got {name}[{k}] = {array[k]}; "
            "fix the profile or cost model that produced it"
        )
    return array


def one_way_delays(stage_comm_s: Sequence[float], boundary_latency_s: float) -> list[float]:
    """The simulator's delay at each boundary k -> k+1 (seconds): half the sending stage's comm_s (which
    counts both directions) plus the calibrated per-crossing latency. The one formula used by evaluate() and
    Plan.simulate()."""
    return [float(c) / 2.0 + boundary_latency_s for c in list(stage_comm_s)[:-1]]


def simulate(
    schedule: str,
    forward_s: npt.ArrayLike,
    backward_s: npt.ArrayLike,
    num_microbatches: int,
    *,
    comm_s: npt.ArrayLike | None = None,
    virtual_stages: int = 1,
    optimizer_s: npt.ArrayLike | None = None,
    tied_sync_s: float = 0.0,
    dp_sync_s: npt.ArrayLike | None = None,
) -> Simulation:
    """Simulate one training step of ``schedule`` on per-stage times (seconds, one microbatch each).

    ``forward_s`` and ``backward_s`` have one value per stage (S = num_ranks * virtual_stages); ``comm_s``
    has one per boundary k -> k+1 (S - 1 values): an activation or gradient crossing it arrives that long
    after its producer ends, or, in GPipe and 1F1B, that long after the receiving rank posts its receive, if
    that is later (``ScheduleShape.receives_on_demand``: torch posts the receive just before the action that
    needs it, and the message moves once both sides have posted). Each rank runs its torch order one action
    at a time; an action starts when the rank is free and its inputs have arrived. Sends occupy no rank, but
    in GPipe and 1F1B a rank waits for its own sends where torch's loop does (:func:`send_waits`: a send
    completes when its receiver has posted and the message has crossed), and ``step()`` returns only once its
    last sends have completed, so a rank's tied all-reduce and optimizer step start no earlier than that; a
    boundary whose two stages share a rank costs nothing (torch hands the tensor over locally). Each transfer
    with a cost is a timeline event of its own (kind "A" or "G", on the receiving rank; not busy time). In
    zero-bubble schedules a backward splits into I and W, each half of ``backward_s`` (an assumption; see
    ``WEIGHT_GRAD_SHARE``).

    ``optimizer_s`` has one value per stage: the seconds of one optimizer step over that stage's parameters.
    Each rank runs the sum over its stages once per step, after its last backward (or W) action, as an "O"
    event; the step ends when the last rank's optimizer step ends. Optimizer time counts as busy time, so the
    bubble stays the idle share of the step.

    ``tied_sync_s`` is the seconds of the all-reduce of tied parameters' gradients (an embedding tied to the
    LM head on two ranks). It is a collective over every rank: it starts when the last rank has ended its last
    backward (or W) action, runs on every rank at once as a "T" event, and each rank's optimizer step follows
    it. Like the optimizer step it counts as busy time; the ranks that wait for the last one idle.

    ``dp_sync_s`` has one value per stage: the seconds a rank waits for its data-parallel replicas to sync
    that stage's gradients (the exposed all-reduce, reduce-scatter or broadcast;
    ``costs.data_parallel_sync_s``). Each rank runs the sum over its stages after the tied all-reduce and
    before its optimizer step, as a "D" event of busy time.

    >>> sim = simulate("1F1B", [1.0] * 4, [2.0] * 4, 8)
    >>> sim.step_s, round(sim.bubble_fraction, 4)   # (m + p - 1)(f + b) = 11 * 3
    (33.0, 0.2727)
    >>> simulate("1F1B", [1.0] * 4, [2.0] * 4, 8, optimizer_s=[0.5] * 4).step_s   # rank 0 ends last: + o
    33.5
    >>> simulate("1F1B", [1.0] * 4, [2.0] * 4, 8, optimizer_s=[0.5] * 4, tied_sync_s=0.25).step_s   # + t + o
    33.75
    >>> simulate("1F1B", [1.0] * 4, [2.0] * 4, 8, optimizer_s=[0.5] * 4,
    ...          dp_sync_s=[0.125] * 4).step_s  # + d + o
    33.625
    """
    name = normalize_schedule(schedule)
    v = check_count("virtual_stages", virtual_stages)
    length_hint = "pass one value per stage (num_ranks * virtual_stages values)"
    fwd = _times("forward_s", forward_s, None, length_hint)
    num_stages = fwd.shape[0]
    if num_stages == 0:
        raise StageplanError(f"forward_s must have at least one stage, got 0 values; {length_hint}")
    bwd = _times(
        "backward_s", backward_s, num_stages, "pass one backward time per stage, as many as forward_s"
    )
    if num_stages % v != 0:
        raise StageplanError(
            f"the number of stages ({num_stages}) must be a multiple of virtual_stages ({v}) "
            "(each rank runs virtual_stages stages); pass num_ranks * virtual_stages stage times"
        )
    comm = (
        np.zeros(max(num_stages - 1, 0))
        if comm_s is None
        else _times(
            "comm_s", comm_s, num_stages - 1, f"pass one value per boundary between stages ({num_stages - 1})"
        )
    )
    opt = None if optimizer_s is None else _times("optimizer_s", optimizer_s, num_stages,
                                                  "pass one optimizer-step time per stage, as many as "
                                                  "forward_s")
    try:
        tied = math.nan if isinstance(tied_sync_s, bool) else float(tied_sync_s)
    except (TypeError, ValueError):
        tied = math.nan
    if not 0 <= tied < math.inf:
        raise StageplanError(f"tied_sync_s must be finite and >= 0 seconds, got {tied_sync_s!r}; "
                             "fix the profile or cost model that produced it")
    sync = None if dp_sync_s is None else _times("dp_sync_s", dp_sync_s, num_stages,
                                                 "pass one data-parallel sync time per stage, as many as "
                                                 "forward_s")
    return simulate_shape(schedule_shape(name, num_stages // v, num_microbatches, v), fwd, bwd, comm, opt,
                          tied, dp_sync=sync)


def simulate_shape(shape: ScheduleShape, fwd: np.ndarray, bwd: np.ndarray, comm: np.ndarray,
                   optimizer: np.ndarray | None = None, tied_sync_s: float = 0.0, timeline: bool = True,
                   dp_sync: np.ndarray | None = None) -> Simulation:
    """:func:`simulate` on a validated shape and validated per-chunk arrays (the cost model's entry point:
    it holds the shape already, so nothing is re-derived per plan). ``optimizer``: seconds per chunk of one
    optimizer step, run per rank (summed over its chunks) after the rank's last action; None or 0: none.
    ``tied_sync_s``: seconds of the tied-gradient all-reduce, a collective every rank starts once the last
    rank's last action has ended, before its optimizer step; 0: none. ``dp_sync``: seconds per chunk of the
    replicas' gradient sync, run per rank (summed over its chunks) between the two; None: none.
    ``timeline=False`` keeps no timeline
    (``Simulation.timeline`` is empty; the step and the shares are the same): for callers that read only
    those, such as ``costs.evaluate``."""
    hop, duration = _hops_and_durations(shape, fwd, bwd, comm)
    events, free, busy, waited = _run_orders(shape, hop, duration, TimelineEvent if timeline else _Span)
    return _simulation(shape, events, free, busy, waited, optimizer, tied_sync_s, timeline, dp_sync)


def _hops_and_durations(shape: ScheduleShape, fwd: np.ndarray, bwd: np.ndarray,
                        comm: np.ndarray) -> tuple[list[float], dict[str, list[float]]]:
    """Per boundary k -> k+1, the delay of a crossing (seconds); per action kind, each chunk's duration."""
    ranks = shape.stage_ranks
    # A boundary between two stages on one rank is a local hand-over in torch: no transfer time.
    hop = [0.0 if ranks[k] == ranks[k + 1] else float(comm[k]) for k in range(shape.num_chunks - 1)]
    duration = {
        "F": fwd.tolist(),
        "B": bwd.tolist(),
        "I": (bwd * (1.0 - WEIGHT_GRAD_SHARE)).tolist(),
        "W": (bwd * WEIGHT_GRAD_SHARE).tolist(),
    }
    return hop, duration


class _Span(NamedTuple):
    """A timeline event's fields without TimelineEvent (a frozen dataclass, whose construction took 60% of a
    1F1B p16 m1024 step's simulation): for a simulation whose timeline is not kept."""

    rank: int
    stage: int
    microbatch: int
    kind: str
    start_s: float
    end_s: float


_Event = TimelineEvent | _Span
_Done = Callable[[Sequence[Action]], float | None]  # done(sends): when the last of them completed
_StartAt = Callable[[Action, int, float], float | None]  # start_at(action, position, free_at)


def _event_clock(
    shape: ScheduleShape,
    hop: list[float],
    forward_end: list[list[float | None]],
    grad_end: list[list[float | None]],
    posted: dict[tuple[str, int, int], float],
    arrived: dict[tuple[str, int, int], float],
    transfers: dict[tuple[str, int, int], _Event],
    make: type[TimelineEvent] | type[_Span] = TimelineEvent,
) -> tuple[_Done, _StartAt]:
    """The two questions the event loop asks, as closures over the simulation's state (the dicts and lists
    passed in, which they read and fill): ``done(sends)`` and ``start_at(action, position, free_at)``."""
    ranks = shape.stage_ranks
    last = shape.num_chunks - 1
    on_demand = shape.receives_on_demand
    waits = shape.send_waits

    def done(sends: Sequence[Action]) -> float | None:
        """When the last of ``sends`` completed (0.0 for none), or None while one has not (a loop, not a
        list and max: the loop asks this about every action of the step)."""
        latest = 0.0
        for c in sends:
            t = arrived.get((c.kind, c.stage, c.microbatch))
            if t is None:
                return None
            if t > latest:  # arrival times are >= 0: the same as max(times, default=0.0)
                latest = t
        return latest

    def start_at(a: Action, position: int, free_at: float) -> float | None:
        """When a starts on a rank free from ``free_at``, or None if something it waits for has not been
        simulated yet: its inputs, a crossing's transfer starting at its producer's end or (``on_demand``) at
        the later of that and the moment the rank posts the receive; there (torch's single-stage loops) the
        rank also waits for its own earlier sends where torch's loop does, before posting and with the
        post."""
        k, i = a.stage, a.microbatch
        key = (a.kind, k, i)
        if key not in posted:
            sends = waits[ranks[k]].before_post[position] if waits is not None else ()
            before = done(sends) if sends else 0.0  # most actions wait for no send: no call
            if before is None:
                return None
            posted[key] = max(free_at, before)
        post = posted[key]
        if a.kind == "F":
            if k == 0:
                return post
            end, delay = forward_end[k - 1][i], hop[k - 1]
        elif a.kind == "W" or k == last:
            return post
        else:
            end, delay = grad_end[k + 1][i], hop[k]
        if end is None:
            return None
        moves = max(post, end) if on_demand else end
        arrived[key] = moves + delay
        if delay > 0:
            transfers[key] = make(ranks[k], k, i, "A" if a.kind == "F" else "G", moves, arrived[key])
        sends = waits[ranks[k]].with_post[position] if waits is not None else ()
        fused = done(sends) if sends else 0.0
        if fused is None:
            return None
        return max(post, arrived[key], fused)

    return done, start_at


def _run_orders(shape: ScheduleShape, hop: list[float], duration: dict[str, list[float]],
                make: type[TimelineEvent] | type[_Span] = TimelineEvent
                ) -> tuple[list[_Event], list[float], list[float], list[float]]:
    """Run every rank's torch order, one action at a time: the timeline's compute events followed by its
    transfers, and per rank when it is free after its last sends, its busy seconds and its receive waits."""
    name, p, m, v = shape.schedule, shape.num_ranks, shape.num_microbatches, shape.virtual_stages
    orders = shape.orders
    ranks = shape.stage_ranks
    last = shape.num_chunks - 1
    # End times: forward_end[k][i]; grad_end[k][i] = end of B or I (the action sending the gradient).
    forward_end: list[list[float | None]] = [[None] * m for _ in range(shape.num_chunks)]
    grad_end: list[list[float | None]] = [[None] * m for _ in range(shape.num_chunks)]
    # per action (kind, stage, microbatch): when its receive was posted, and when its input arrived (the
    # moment the send feeding it completes, for the sender's own waits)
    posted: dict[tuple[str, int, int], float] = {}
    arrived: dict[tuple[str, int, int], float] = {}
    transfers: dict[tuple[str, int, int], _Event] = {}  # per receiving action: its message's crossing
    done, start_at = _event_clock(shape, hop, forward_end, grad_end, posted, arrived, transfers, make)

    events: list[_Event] = []
    free = [0.0] * p
    busy = [0.0] * p
    waited = [0.0] * p
    position = [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for rank in range(p):
            order = orders[rank]
            while position[rank] < len(order):
                action = order[position[rank]]
                had = len(posted)
                start = start_at(action, position[rank], free[rank])
                progressed = progressed or len(posted) > had
                if start is None:
                    break
                took = duration[action.kind][action.stage]
                end = start + took
                k = action.stage
                if (action.kind == "F" and k > 0 and ranks[k - 1] != rank) or \
                        (action.kind in ("B", "I") and k < last and ranks[k + 1] != rank):
                    waited[rank] += start - posted[(action.kind, k, action.microbatch)]
                if action.kind == "F":
                    forward_end[action.stage][action.microbatch] = end
                elif action.kind in ("B", "I"):
                    grad_end[action.stage][action.microbatch] = end
                events.append(make(rank, action.stage, action.microbatch, action.kind, start, end))
                free[rank] = end
                busy[rank] += took
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # torch's orders are deadlock-free; reaching this is a bug in this module
            raise RuntimeError(
                f"simulation of {name} (p={p}, m={m}, v={v}) deadlocked at positions {position}"
            )
    waits = shape.send_waits
    if waits is not None:  # step() returns once the rank's last sends have been received
        for rank in range(p):
            last_sends = done(waits[rank].at_end)
            assert last_sends is not None  # every action has run, so every receive has been posted
            free[rank] = max(free[rank], last_sends)
    events += transfers.values()
    return events, free, busy, waited


def _simulation(shape: ScheduleShape, events: list[_Event], free: list[float], busy: list[float],
                waited: list[float], optimizer: np.ndarray | None, tied_sync_s: float,
                timeline: bool = True, dp_sync: np.ndarray | None = None) -> Simulation:
    """The step after the schedule (tied all-reduce, the replicas' sync, optimizer steps) and the result: step
    time, idle shares and the timeline sorted by start time (none without ``timeline``)."""
    p = shape.num_ranks
    _after_the_schedule(events, free, busy, shape.stage_ranks, optimizer, float(tied_sync_s), dp_sync)
    step = max(e.end_s for e in events)
    idle = tuple(step - b for b in busy)
    bubble = sum(idle) / (p * step) if step > 0 else 0.0
    if timeline:
        events.sort(key=lambda e: (e.start_s, e.rank))
    return Simulation(
        schedule=shape.schedule,
        num_ranks=p,
        num_microbatches=shape.num_microbatches,
        virtual_stages=shape.virtual_stages,
        step_s=step,
        busy_s=tuple(busy),
        idle_s=idle,
        bubble_fraction=bubble,
        peak_inflight=shape.peak_inflight,
        timeline=tuple(events) if timeline else (),  # type: ignore[arg-type]  # TimelineEvents where kept
        receive_wait_s=tuple(waited),
    )
