"""Tests of stageplan.planning.schedules: torch's own
execution order, closed forms, hand-computed timelines."""

from __future__ import annotations

import doctest
import itertools
import math
from typing import Any

import numpy as np
import pytest
from conftest import SCHEDULE_CASES
from hypothesis import given, settings
from hypothesis import strategies as st

from stageplan.errors import StageplanError
from stageplan.formats.schedule import SCHEDULES, check_microbatches, normalize_schedule, stage_ranks
from stageplan.formats.timeline import Simulation
from stageplan.planning import schedules
from stageplan.planning.schedules import Action, bubble_closed_form, peak_inflight, rank_orders, simulate


class _RecordingStage:
    """Just enough of torch's _PipelineStageBase for the schedules' bookkeeping; records compute calls."""

    def __init__(self, index: int, num_stages: int, num_ranks: int, rank: int, log: list[Any]) -> None:
        self.stage_index = index
        self.num_stages = num_stages
        self.group_size = num_ranks
        self.group_rank = rank
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.submod = None
        self.device = "cpu"
        self.has_backward = True
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.args_recv_info: dict[int, tuple[()]] = {0: ()}  # read by the adjacency validator
        self.act_send_info: dict[int, list[int]] = {}
        self.log = log

    def _get_init_p2p_neighbors_ops(self) -> list[Any]:
        return []

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> None:
        return None

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_fwd_recv_ops(self, mb: int) -> list[Any]:
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self.log.append(Action(self.stage_index, mb, "F"))

    def backward_one_chunk(
        self, mb: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        self.log.append(Action(self.stage_index, mb, "B" if full_backward else "I"))

    def backward_weight_one_chunk(self, mb: int, last_backward: bool = False) -> None:
        self.log.append(Action(self.stage_index, mb, "W"))

    def perform_reduce_grad(self, *args: Any) -> None:
        pass

    def set_local_fwd_input(self, *args: Any) -> None:
        pass

    def set_local_bwd_input(self, *args: Any) -> None:
        pass

    def get_local_bwd_output(self, mb: int) -> None:
        return None


def _torch_schedule(name: str, num_ranks: int, m: int, v: int, rank: int, log: list[Any]) -> Any:
    from torch.distributed.pipelining import schedules as torch_schedules
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

    style = "v" if name == "ZBVZeroBubble" else "loop"
    local = generate_rank_to_stage_mapping(num_ranks, num_ranks * v, style)[rank]
    stages = [_RecordingStage(k, num_ranks * v, num_ranks, rank, log) for k in local]
    cls = torch_schedules.get_schedule_class(name)
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        return cls(stages[0], m)
    return cls(stages, m)


def _torch_executed_orders(name: str, num_ranks: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    orders = []
    for rank in range(num_ranks):
        log: list[Action] = []
        _torch_schedule(name, num_ranks, m, v, rank, log)._step_microbatches()
        orders.append(tuple(log))
    return tuple(orders)


def _grid() -> list[tuple[str, int, int, int]]:
    cases = []
    for name in SCHEDULES:
        virtual = (1,) if name in ("GPipe", "1F1B") else (2,) if name == "ZBVZeroBubble" else (1, 2, 3)
        for p, v, m in itertools.product((1, 2, 3, 4), virtual, range(1, 10)):
            cases.append((name, p, m, v))
    return cases


@pytest.mark.parametrize("name", SCHEDULES)
def test_orders_equal_torch_execution_and_torch_accepts_the_same_numbers(name: str) -> None:
    pytest.importorskip("torch")
    compared = 0
    for case_name, p, m, v in _grid():
        if case_name != name:
            continue
        try:
            expected = _torch_executed_orders(name, p, m, v)
        except ValueError:  # torch refuses these numbers: so must we
            with pytest.raises(StageplanError):
                check_microbatches(name, p, m, v)
            continue
        assert rank_orders(name, p, m, v) == expected, (name, p, m, v)
        compared += 1
    assert compared >= 20


@pytest.mark.parametrize(
    ("name", "p", "m", "v"),
    [
        ("Interleaved1F1B", 2, 2, 2),
        ("Interleaved1F1B", 2, 4, 2),
        ("Interleaved1F1B", 2, 8, 2),
        ("Interleaved1F1B", 4, 2, 2),
        ("Interleaved1F1B", 4, 4, 2),
        ("Interleaved1F1B", 4, 8, 2),
        ("Interleaved1F1B", 4, 6, 3),
        ("InterleavedZeroBubble", 4, 8, 2),
        ("LoopedBFS", 4, 8, 2),
        ("ZBVZeroBubble", 4, 8, 2),
        ("ZBVZeroBubble", 4, 3, 2),
    ],
)
def test_multi_stage_orders_equal_torch_pipeline_order_ir(name: str, p: int, m: int, v: int) -> None:
    # For the runtime schedules torch also exposes `pipeline_order` (rank -> [_Action | None]); its
    # compute actions, without the None idle slots, are what the runtime executes.
    pytest.importorskip("torch")
    ir = _torch_schedule(name, p, m, v, 0, []).pipeline_order
    expected = tuple(
        tuple(
            Action(a.stage_index, a.microbatch_index, a.computation_type.value)
            for a in ir[rank]
            if a is not None
        )
        for rank in range(p)
    )
    assert rank_orders(name, p, m, v) == expected


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
def test_balanced_step_and_bubble_match_closed_form(name: str) -> None:
    # Balanced stages, no communication: step = (m + p - 1)(f + b), bubble = (p - 1)/(m + p - 1).
    f, b = 0.5, 1.25
    for p, m in itertools.product(range(1, 9), range(1, 17)):
        if name == "1F1B" and m < p:
            continue
        sim = simulate(name, [f] * p, [b] * p, m)
        assert sim.step_s == pytest.approx((m + p - 1) * (f + b))
        assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert sim.bubble_fraction == pytest.approx(bubble_closed_form(p, m))


def test_seed_numbers() -> None:
    # The seeds: 8 stages and 8 microbatches give 47% bubble, 64 microbatches give 10%.
    for name in ("GPipe", "1F1B"):
        assert round(100 * simulate(name, [1.0] * 8, [2.0] * 8, 8).bubble_fraction, 1) == 46.7
        assert round(100 * simulate(name, [1.0] * 8, [2.0] * 8, 64).bubble_fraction, 1) == 9.9
    assert round(100 * bubble_closed_form(8, 8), 1) == 46.7
    assert round(100 * bubble_closed_form(8, 64), 1) == 9.9


@pytest.mark.parametrize(("p", "v"), [(2, 2), (4, 2), (4, 3), (3, 2)])
def test_interleaved_balanced_step_matches_megatron(p: int, v: int) -> None:
    # Megatron (Narayanan et al. 2021): with v chunks per rank of time (f + b)/v each and m a multiple
    # of p, the step is m(f + b) + (p - 1)(f + b)/v, i.e. a bubble of (p - 1)/(v m) relative to ideal.
    f, b = 1.0, 2.0
    for m in (p, 2 * p, 4 * p):
        sim = simulate("Interleaved1F1B", [f / v] * (p * v), [b / v] * (p * v), m, virtual_stages=v)
        assert sim.step_s == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v)


def test_zero_bubble_schedules_beat_1f1b_when_balanced() -> None:
    # Zero bubble (Qi et al. 2024) fills the drain with W; with I = W = b/2 the step shrinks.
    p, m = 4, 8
    one_f_one_b = simulate("1F1B", [1.0] * p, [2.0] * p, m).step_s
    zbh1 = simulate("InterleavedZeroBubble", [1.0] * p, [2.0] * p, m).step_s
    zbv = simulate("ZBVZeroBubble", [0.5] * (2 * p), [1.0] * (2 * p), m, virtual_stages=2).step_s
    assert zbh1 < one_f_one_b
    assert zbv < one_f_one_b
    assert zbv >= m * 3.0  # never below the busy time of one rank


def test_peak_inflight_gpipe_holds_all_microbatches() -> None:
    for p, m in itertools.product(range(1, 7), range(1, 10)):
        assert peak_inflight("GPipe", p, m) == (m,) * p


def test_peak_inflight_1f1b_matches_warmup_count() -> None:
    # 1F1B: stage s holds min(p - s, m) microbatches in flight (Megatron's warm-up count). torch's
    # Schedule1F1B warms up exactly min(m, p - s) forwards, then alternates B and F.
    for p, m in itertools.product(range(1, 7), range(1, 13)):
        if m < p:
            continue
        assert peak_inflight("1F1B", p, m) == tuple(min(p - s, m) for s in range(p))


def test_peak_inflight_zero_bubble_counts_until_weight_grad() -> None:
    # Rank 0 of ZBV with p = 1 runs F0,F0' then I,W per chunk: stage 0 holds 1 microbatch until its W.
    assert peak_inflight("ZBVZeroBubble", 1, 1, 2) == (1, 1)
    orders = rank_orders("InterleavedZeroBubble", 2, 4)
    held = 0
    for action in orders[0]:  # replay stage 0 by hand: F adds one, W removes one, I changes nothing
        held += {"F": 1, "W": -1}.get(action.kind, 0)
        assert held <= peak_inflight("InterleavedZeroBubble", 2, 4)[0]


def test_gpipe_two_stages_by_hand() -> None:
    # f = (1, 2), b = (2, 4), m = 2, no comm.
    # rank 0: F(0,0) 0-1, F(0,1) 1-2
    # rank 1: F(1,0) 1-3, F(1,1) 3-5, B(1,0) 5-9, B(1,1) 9-13
    # rank 0: B(0,0) waits for B(1,0): 9-11; B(0,1) waits for B(1,1): 13-15  -> step 15
    sim = simulate("GPipe", [1.0, 2.0], [2.0, 4.0], 2)
    assert sim.step_s == 15.0
    assert sim.busy_s == (6.0, 12.0)
    assert sim.idle_s == (9.0, 3.0)
    assert sim.bubble_fraction == pytest.approx(12.0 / 30.0)
    times = {(e.stage, e.microbatch, e.kind): (e.start_s, e.end_s) for e in sim.timeline}
    assert times == {
        (0, 0, "F"): (0.0, 1.0),
        (0, 1, "F"): (1.0, 2.0),
        (1, 0, "F"): (1.0, 3.0),
        (1, 1, "F"): (3.0, 5.0),
        (1, 0, "B"): (5.0, 9.0),
        (1, 1, "B"): (9.0, 13.0),
        (0, 0, "B"): (9.0, 11.0),
        (0, 1, "B"): (13.0, 15.0),
    }
    # With comm 0.5 on the boundary. GPipe posts each receive just before the action needing it, and the
    # message moves from then on: start = max(rank free, producer end) + 0.5.
    # rank 1: F(1,0) max(0, 1)+0.5=1.5-3.5, F(1,1) max(3.5, 2)+0.5=4-6, B(1,0) 6-10, B(1,1) 10-14
    # rank 0: B(0,0) max(2, 10)+0.5=10.5-12.5, B(0,1) max(12.5, 14)+0.5=14.5-16.5  -> step 16.5
    assert simulate("GPipe", [1.0, 2.0], [2.0, 4.0], 2, comm_s=[0.5]).step_s == 16.5
    # LoopedBFS at one stage per rank runs the same order, but torch's multi-stage runtime posts receives
    # ahead, so a message moves as soon as it is sent: start = max(rank free, producer end + 0.5).
    # rank 1: F(1,0) 1.5-3.5, F(1,1) max(3.5, 2.5)=3.5-5.5, B(1,0) 5.5-9.5, B(1,1) 9.5-13.5
    # rank 0: B(0,0) 9.5+0.5=10-12, B(0,1) 13.5+0.5=14-16  -> step 16
    ahead = simulate("LoopedBFS", [1.0, 2.0], [2.0, 4.0], 2, comm_s=[0.5])
    assert sorted(
        (e.rank, e.stage, e.microbatch, e.kind) for e in ahead.timeline if e.kind not in "AG"
    ) == sorted((e.rank, e.stage, e.microbatch, e.kind) for e in sim.timeline)
    assert ahead.step_s == 16.0
    # Each crossing is an event of its own on the receiving rank, from when the message moves to its arrival:
    # activations "A" to rank 1's forwards, gradients "G" to rank 0's backwards (hand-computed above;
    # LoopedBFS runs its backwards last microbatch first, so the gradient at 9.5 is microbatch 1's).
    moves = {(e.rank, e.stage, e.microbatch, e.kind): (e.start_s, e.end_s) for e in ahead.timeline
             if e.kind in "AG"}
    assert moves == {(1, 1, 0, "A"): (1.0, 1.5), (1, 1, 1, "A"): (2.0, 2.5), (0, 0, 1, "G"): (9.5, 10.0),
                     (0, 0, 0, "G"): (13.5, 14.0)}
    on_demand = simulate("GPipe", [1.0, 2.0], [2.0, 4.0], 2, comm_s=[0.5])
    moves = {(e.rank, e.stage, e.microbatch, e.kind): (e.start_s, e.end_s) for e in on_demand.timeline
             if e.kind in "AG"}
    assert moves == {(1, 1, 0, "A"): (1.0, 1.5), (1, 1, 1, "A"): (3.5, 4.0), (0, 0, 0, "G"): (10.0, 10.5),
                     (0, 0, 1, "G"): (14.0, 14.5)}
    assert on_demand.busy_s == sim.busy_s  # a transfer occupies the link, not the rank


def _random_step(schedule: str, p: int, m: int, v: int, seed: int
                 ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, Simulation, schedules.ScheduleShape]:
    """Seeded per-stage forward (1-2), backward (2-4) and comm
    (0.1-0.5) times, their simulated step and the shape."""
    n = p * v
    rng = np.random.default_rng(seed)
    fwd, bwd, comm = rng.uniform(1, 2, n), rng.uniform(2, 4, n), rng.uniform(0.1, 0.5, n - 1)
    return n, fwd, bwd, comm, simulate(schedule, fwd, bwd, m, comm_s=comm, virtual_stages=v), \
        schedules.schedule_shape(schedule, p, m, v)


@pytest.mark.parametrize(("schedule", "p", "m", "v"), SCHEDULE_CASES)
def test_every_crossing_is_one_transfer_event_that_feeds_its_action(
    schedule: str, p: int, m: int, v: int
) -> None:
    n, fwd, bwd, comm, sim, shape = _random_step(schedule, p, m, v, seed=7)
    owner = shape.stage_ranks
    compute = {(e.stage, e.microbatch, e.kind): e for e in sim.timeline if e.kind not in "AG"}
    moves = [e for e in sim.timeline if e.kind in "AG"]
    # oracle: one per receiving action whose producer sits on another rank (a hand-over on one rank is free)
    expected = {(k, i, "A") for k in range(1, n) for i in range(m) if owner[k] != owner[k - 1]}
    expected |= {(k, i, "G") for k in range(n - 1) for i in range(m) if owner[k] != owner[k + 1]}
    assert {(e.stage, e.microbatch, e.kind) for e in moves} == expected and len(moves) == len(expected)
    grads = "I" if "ZeroBubble" in schedule else "B"
    for e in moves:
        k, i = e.stage, e.microbatch
        producer = compute[(k - 1, i, "F")] if e.kind == "A" else compute[(k + 1, i, grads)]
        took = comm[k - 1] if e.kind == "A" else comm[k]
        assert e.rank == owner[k]
        assert e.end_s - e.start_s == pytest.approx(took, rel=1e-12)
        assert e.start_s >= producer.end_s - 1e-12  # it moves once produced...
        # ...and feeds its action
        assert compute[(k, i, "F" if e.kind == "A" else grads)].start_s >= e.end_s - 1e-12
    assert sim.step_s == max(e.end_s for e in compute.values())
    assert not [e for e in simulate(schedule, fwd, bwd, m, virtual_stages=v).timeline if e.kind in "AG"]


def test_receive_waits_by_hand() -> None:
    # GPipe, f = (1, 2), b = (2, 4), m = 2, comm 0.5 (the transfers hand-computed above). Rank 1 posts
    # F(1,0)'s receive at 0, the activation arrives at 1.5 (wait 1.5), F(1,0) 1.5-3.5; F(1,1) posted at 3.5,
    # arrives 4.0 (0.5). Rank 0 waits for its forward sends (received at 1.5 and 4.0) before posting B(0,0)'s
    # receive at 4.0; the gradient leaves at 10 and arrives at 10.5 (6.5), B(0,0) 10.5-12.5; B(0,1) posted at
    # 12.5, its gradient leaves at 14 and arrives at 14.5 (2.0).
    on_demand = simulate("GPipe", [1.0, 2.0], [2.0, 4.0], 2, comm_s=[0.5])
    assert on_demand.receive_wait_s == pytest.approx((8.5, 2.0), abs=1e-12)
    # 1F1B, m = 3, no comm (the step by hand below): rank 1 waits 1 for F(1,0) and nothing else (F(1,1) and
    # F(1,2) find their activations there); rank 0 waits 2->7 for B(0,0), 10->13 for B(0,1), 15->19 for B(0,2)
    assert simulate("1F1B", [1.0, 2.0], [2.0, 4.0], 3).receive_wait_s == pytest.approx((12.0, 1.0), abs=1e-12)


@pytest.mark.parametrize(("schedule", "p", "m", "v"), SCHEDULE_CASES)
def test_receive_waits_are_the_gaps_before_the_actions_fed_across_ranks(
    schedule: str, p: int, m: int, v: int
) -> None:
    n, _, _, _, sim, shape = _random_step(schedule, p, m, v, seed=11)
    owner, last = shape.stage_ranks, n - 1
    # oracle: per rank, the idle gap just before each action whose input comes from another rank
    gaps = [0.0] * p
    for rank in range(p):
        free = 0.0
        for e in sorted((e for e in sim.timeline if e.rank == rank and e.kind in "FBIW"),
                        key=lambda e: e.start_s):
            fed = (e.kind == "F" and e.stage > 0 and owner[e.stage - 1] != rank) or \
                (e.kind in "BI" and e.stage < last and owner[e.stage + 1] != rank)
            if fed:
                gaps[rank] += e.start_s - free
            free = e.end_s
    for rank in range(p):
        assert 0.0 <= sim.receive_wait_s[rank] <= sim.idle_s[rank] + 1e-9
        if shape.send_waits is None:  # the rank reaches a receive the moment its previous action ends
            assert sim.receive_wait_s[rank] == pytest.approx(gaps[rank], abs=1e-9)
        else:  # torch's single-stage loops may first wait for the rank's own sends, before posting
            assert sim.receive_wait_s[rank] <= gaps[rank] + 1e-9
    assert any(w > 0 for w in sim.receive_wait_s)


def test_1f1b_two_stages_by_hand() -> None:
    # f = (1, 2), b = (2, 4), m = 3. Orders: rank 0 F0 F1 B0 F2 B1 B2; rank 1 F0 B0 F1 B1 F2 B2.
    # rank 0: F(0,0) 0-1, F(0,1) 1-2
    # rank 1: F(1,0) 1-3, B(1,0) 3-7, F(1,1) max(7, 2)=7-9, B(1,1) 9-13
    # rank 0: B(0,0) max(2, 7)=7-9, F(0,2) 9-10, B(0,1) max(10, 13)=13-15
    # rank 1: F(1,2) max(13, 10)=13-15, B(1,2) 15-19
    # rank 0: B(0,2) 19-21  -> step 21; busy (9, 18); bubble (12 + 3) / 42
    assert [str(a) for a in rank_orders("1F1B", 2, 3)[0]] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]
    sim = simulate("1F1B", [1.0, 2.0], [2.0, 4.0], 3)
    assert sim.step_s == 21.0
    assert sim.busy_s == (9.0, 18.0)
    assert sim.bubble_fraction == pytest.approx(15.0 / 42.0)
    # With comm 0.5 (each receive posted when the rank gets to the action: start = max(free, producer end) +
    # 0.5): rank 1: F(1,0) 1.5-3.5, B(1,0) 3.5-7.5, F(1,1) max(7.5, 2)+0.5=8-10, B(1,1) 10-14
    # rank 0: B(0,0) max(2, 7.5)+0.5=8-10, F(0,2) 10-11, B(0,1) max(11, 14)+0.5=14.5-16.5
    # rank 1: F(1,2) max(14, 11)+0.5=14.5-16.5, B(1,2) 16.5-20.5
    # rank 0: B(0,2) max(16.5, 20.5)+0.5=21-23  -> step 23
    assert simulate("1F1B", [1.0, 2.0], [2.0, 4.0], 3, comm_s=[0.5]).step_s == 23.0


def test_gpipe_three_stages_with_comm_by_hand() -> None:
    # f = (1, 2, 1), b = (2, 3, 1), comm = (0.5, 0.25), m = 2; start = max(rank free, producer end) + comm.
    # rank 0: F(0,0) 0-1, F(0,1) 1-2
    # rank 1: F(1,0) 1+0.5=1.5-3.5, F(1,1) max(3.5, 2)+0.5=4-6
    # rank 2: F(2,0) 3.5+0.25=3.75-4.75, F(2,1) max(4.75, 6)+0.25=6.25-7.25, B(2,0) 7.25-8.25, B(2,1)
    # 8.25-9.25 rank 1: B(1,0) max(6, 8.25)+0.25=8.5-11.5, B(1,1) max(11.5, 9.25)+0.25=11.75-14.75
    # rank 0: B(0,0) max(2, 11.5)+0.5=12-14, B(0,1) max(14, 14.75)+0.5=15.25-17.25  -> step 17.25
    sim = simulate("GPipe", [1.0, 2.0, 1.0], [2.0, 3.0, 1.0], 2, comm_s=[0.5, 0.25])
    assert sim.step_s == 17.25
    assert sim.busy_s == (6.0, 10.0, 4.0)
    assert sim.bubble_fraction == pytest.approx((11.25 + 7.25 + 13.25) / (3 * 17.25))


def test_comm_between_stages_on_one_rank_is_free() -> None:
    # ZBV puts stages p-1 and p on rank p-1; torch hands the tensor over locally (no send/recv).
    base = simulate("ZBVZeroBubble", [1.0] * 4, [2.0] * 4, 4, virtual_stages=2)
    middle_only = simulate("ZBVZeroBubble", [1.0] * 4, [2.0] * 4, 4, virtual_stages=2, comm_s=[0, 5.0, 0])
    assert middle_only.step_s == base.step_s


def test_zero_bubble_splits_backward_in_halves() -> None:
    sim = simulate("InterleavedZeroBubble", [1.0, 1.0], [3.0, 5.0], 2)
    durations = {(e.stage, e.kind): e.end_s - e.start_s for e in sim.timeline}
    assert durations == {
        (0, "F"): 1.0,
        (1, "F"): 1.0,
        (0, "I"): 1.5,
        (0, "W"): 1.5,
        (1, "I"): 2.5,
        (1, "W"): 2.5,
    }


def _valid_cases() -> list[tuple[str, int, int, int]]:
    cases = []
    for name, p, m, v in _grid():
        try:
            check_microbatches(name, p, m, v)
        except StageplanError:
            continue
        cases.append((name, p, m, v))
    return cases


_CASES = _valid_cases()


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(_CASES), data=st.data())
def test_simulation_invariants(case: tuple[str, int, int, int], data: st.DataObject) -> None:
    name, p, m, v = case
    num_stages = p * v
    times = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)
    fwd = data.draw(st.lists(times, min_size=num_stages, max_size=num_stages))
    bwd = data.draw(st.lists(times, min_size=num_stages, max_size=num_stages))
    comm = data.draw(st.lists(times, min_size=num_stages - 1, max_size=num_stages - 1))
    sim = simulate(name, fwd, bwd, m, comm_s=comm, virtual_stages=v)
    ranks = stage_ranks(name, p, v)
    orders = rank_orders(name, p, m, v)

    # Every rank runs exactly torch's order, one action at a time (transfers, "A" and "G", are on the link).
    actions = [e for e in sim.timeline if e.kind not in "AG"]
    events = {(e.stage, e.microbatch, e.kind): e for e in actions}
    assert len(events) == len(actions) == sum(len(o) for o in orders)
    for rank, order in enumerate(orders):
        mine = [events[(a.stage, a.microbatch, a.kind)] for a in order]
        assert all(e.rank == rank == ranks[e.stage] for e in mine)
        assert all(x.end_s <= y.start_s for x, y in itertools.pairwise(mine))
        assert sum(e.end_s - e.start_s for e in mine) == pytest.approx(sim.busy_s[rank])

    # Dependencies: activations forward, gradients backward, each plus its comm if it changes rank.
    def arrival(k: int, src: int, dst: int) -> float:
        return 0.0 if ranks[src] == ranks[dst] else comm[k]

    eps = 1e-9
    for (k, i, kind), e in events.items():
        if kind == "F" and k > 0:
            assert e.start_s >= events[(k - 1, i, "F")].end_s + arrival(k - 1, k - 1, k) - eps
        if kind in ("B", "I"):
            assert e.start_s >= events[(k, i, "F")].end_s - eps
            if k < num_stages - 1:
                upstream = events.get((k + 1, i, "B")) or events[(k + 1, i, "I")]
                assert e.start_s >= upstream.end_s + arrival(k, k + 1, k) - eps
        if kind == "W":
            assert e.start_s >= events[(k, i, "I")].end_s - eps

    assert min(e.start_s for e in sim.timeline) == 0.0
    assert sim.step_s == pytest.approx(max(e.end_s for e in sim.timeline))
    assert sim.step_s >= max(sim.busy_s) - eps
    assert sim.idle_s == pytest.approx(tuple(sim.step_s - b for b in sim.busy_s))
    if sim.step_s > 0:
        assert sim.bubble_fraction == pytest.approx(sum(sim.idle_s) / (p * sim.step_s))
    assert sim.peak_inflight == peak_inflight(name, p, m, v)

    # Start times are max-plus expressions of the durations, so slowing one stage never speeds the step.
    k = data.draw(st.integers(min_value=0, max_value=num_stages - 1))
    slower = list(fwd)
    slower[k] += 1.0
    assert simulate(name, slower, bwd, m, comm_s=comm, virtual_stages=v).step_s >= sim.step_s - eps


def test_to_pandas_has_one_row_per_event() -> None:
    pytest.importorskip("pandas")
    sim = simulate("Interleaved1F1B", [1.0] * 4, [2.0] * 4, 4, virtual_stages=2)
    frame = sim.to_pandas()
    assert list(frame.columns) == ["rank", "stage", "microbatch", "kind", "start_s", "end_s"]
    assert len(frame) == len(sim.timeline) == 2 * 4 * 4
    assert frame["end_s"].max() == sim.step_s
    assert frame.groupby("rank")["kind"].count().tolist() == [16, 16]


def test_numpy_inputs_and_zero_times() -> None:
    sim = simulate("GPipe", np.zeros(3), np.zeros(3), 4, comm_s=np.zeros(2))
    assert sim.step_s == 0.0
    assert sim.bubble_fraction == 0.0
    assert math.isfinite(sim.bubble_fraction)


def test_unknown_schedule_lists_valid_names() -> None:
    with pytest.raises(
        StageplanError, match=r"unknown schedule 'PipeDream'; use one of GPipe, 1F1B, Interleaved1F1B"
    ):
        normalize_schedule("PipeDream")
    with pytest.raises(StageplanError, match=r"schedule must be a string, got 3 \(int\)"):
        normalize_schedule(3)  # type: ignore[arg-type]
    with pytest.raises(StageplanError, match="unknown schedule 'DualPipeV'"):
        simulate("DualPipeV", [1.0], [1.0], 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("GPipe", 0, 4), r"num_ranks must be >= 1, got 0; pass a whole number >= 1"),
        (("GPipe", 2, 0), r"num_microbatches must be >= 1, got 0"),
        (("GPipe", 2, 4, 0), r"virtual_stages must be >= 1, got 0"),
        (("GPipe", 2, 2.5), r"num_microbatches must be an integer, got 2.5"),
        (("GPipe", True, 2), r"num_ranks must be an integer, got True"),
        (("GPipe", 2, 4, 2), r"GPipe runs one stage per rank, got virtual_stages=2; use virtual_stages=1"),
        (("1F1B", 2, 4, 2), r"1F1B runs one stage per rank, got virtual_stages=2"),
        (
            ("1F1B", 4, 3),
            r"1F1B needs num_microbatches >= num_ranks, got num_microbatches=3 < num_ranks=4 "
            r"\(torch's Schedule1F1B refuses it\); use at least 4 microbatches, or GPipe",
        ),
        (
            ("Interleaved1F1B", 4, 9, 2),
            r"Interleaved1F1B needs num_microbatches to be a multiple of its rounds max\(1, m // p\); "
            r"got num_microbatches=9, num_ranks=4, rounds=2 \(torch refuses it\); use 8 or 10 microbatches",
        ),
        (
            ("InterleavedZeroBubble", 2, 7, 2),
            r"InterleavedZeroBubble needs .* rounds=3 .* use 6 or 8 microbatches",
        ),
        (("ZBVZeroBubble", 2, 4, 1), r"ZBVZeroBubble runs exactly 2 stages per rank .* got virtual_stages=1"),
        (("ZBVZeroBubble", 2, 4, 3), r"got virtual_stages=3; use virtual_stages=2"),
    ],
)
def test_check_microbatches_errors(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(StageplanError, match=message):
        check_microbatches(*args)
    with pytest.raises(StageplanError, match=message):
        rank_orders(*args)
    with pytest.raises(StageplanError, match=message):
        peak_inflight(*args)


def test_bubble_closed_form_errors() -> None:
    with pytest.raises(StageplanError, match=r"num_ranks must be >= 1, got 0"):
        bubble_closed_form(0, 4)
    with pytest.raises(StageplanError, match=r"num_microbatches must be >= 1, got -1"):
        bubble_closed_form(4, -1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"forward_s": [1.0, 2.0], "backward_s": [1.0]},
            r"backward_s must have 2 values, got 1; pass one backward time per stage",
        ),
        ({"forward_s": [], "backward_s": []}, r"forward_s must have at least one stage, got 0 values"),
        (
            {"forward_s": [[1.0, 2.0]], "backward_s": [1.0, 2.0]},
            r"forward_s must be one-dimensional .* got shape \(1, 2\)",
        ),
        (
            {"forward_s": ["a", 1.0], "backward_s": [1.0, 1.0]},
            r"forward_s must be a sequence of numbers in seconds, got \['a', 1.0\]",
        ),
        (
            {"forward_s": [1.0, float("nan")], "backward_s": [1.0, 1.0]},
            r"forward_s must be finite and >= 0 seconds, got forward_s\[1\] = nan",
        ),
        (
            {"forward_s": [1.0, 1.0], "backward_s": [-1.0, 1.0]},
            r"backward_s must be finite and >= 0 seconds, got backward_s\[0\] = -1.0; fix the profile",
        ),
        (
            {"forward_s": [1.0, 1.0], "backward_s": [1.0, 1.0], "comm_s": [0.1, 0.1]},
            r"comm_s must have 1 values, got 2; pass one value per boundary between stages \(1\)",
        ),
        (
            {"forward_s": [1.0, 1.0], "backward_s": [1.0, 1.0], "comm_s": [float("inf")]},
            r"comm_s must be finite and >= 0 seconds, got comm_s\[0\] = inf",
        ),
        (
            {
                "forward_s": [1.0] * 3,
                "backward_s": [1.0] * 3,
                "virtual_stages": 2,
                "schedule": "Interleaved1F1B",
            },
            r"the number of stages \(3\) must be a multiple of virtual_stages \(2\)",
        ),
        (
            {"forward_s": [1.0] * 2, "backward_s": [1.0] * 2, "num_microbatches": 0},
            r"num_microbatches must be >= 1, got 0",
        ),
        (
            {"forward_s": [1.0] * 4, "backward_s": [1.0] * 4, "schedule": "1F1B", "num_microbatches": 2},
            r"1F1B needs num_microbatches >= num_ranks",
        ),
        (
            {"forward_s": [1.0] * 4, "backward_s": [1.0] * 4, "virtual_stages": 0},
            r"virtual_stages must be >= 1, got 0",
        ),
    ],
)
def test_simulate_errors(kwargs: dict[str, Any], message: str) -> None:
    call: dict[str, Any] = {"schedule": "GPipe", "num_microbatches": 4, **kwargs}
    with pytest.raises(StageplanError, match=message):
        simulate(
            call.pop("schedule"),
            call.pop("forward_s"),
            call.pop("backward_s"),
            call.pop("num_microbatches"),
            **call,
        )


def test_docstring_examples() -> None:
    result = doctest.testmod(schedules, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0


@settings(max_examples=80, deadline=None)
@given(case=st.sampled_from(_CASES),
       data=st.data())
def test_live_counts_give_each_ranks_exact_activation_peak(case: tuple[str, int, int, int],
                                                           data: st.DataObject) -> None:
    """A rank's activation peak is the largest of sum_c counts[c] x bytes of chunk c over its live-count
    vectors, against a replay of its order by hand (+ bytes on F, - on B, or on W in zero-bubble schedules);
    and no vector is covered by another."""
    name, p, m, v = case
    shape = schedules.schedule_shape(name, p, m, v)
    chunk = np.array(data.draw(st.lists(st.integers(0, 1000), min_size=p * v, max_size=p * v)), dtype=float)
    release = "W" if shape.zero_bubble else "B"
    for r, order in enumerate(shape.orders):
        live = peak = 0.0
        for a in order:
            live += chunk[a.stage] if a.kind == "F" else -chunk[a.stage] if a.kind == release else 0.0
            peak = max(peak, live)
        vectors = shape.live_counts[r]
        assert max(float(np.dot(k, chunk)) for k in vectors) == peak
        assert all(k[c] == 0 for k in vectors for c in range(p * v) if shape.stage_ranks[c] != r)
        assert not any(x != y and all(a <= b for a, b in zip(x, y)) for x in vectors for y in vectors)
        assert max(k[c] for k in vectors for c in range(p * v)) <= max(shape.peak_inflight)


class _P2PStage(_RecordingStage):
    """A recording stage whose p2p ops are markers: ("recv" | "send", the action consuming the message)."""

    def get_fwd_recv_ops(self, mb: int) -> list[Any]:
        return [] if self.is_first else [("recv", Action(self.stage_index, mb, "F"))]

    def get_bwd_recv_ops(self, mb: int) -> list[Any]:
        return [] if self.is_last else [("recv", Action(self.stage_index, mb, "B"))]

    def get_fwd_send_ops(self, mb: int) -> list[Any]:
        return [] if self.is_last else [("send", Action(self.stage_index + 1, mb, "F"))]

    def get_bwd_send_ops(self, mb: int) -> list[Any]:
        return [] if self.is_first else [("send", Action(self.stage_index - 1, mb, "B"))]


def _torch_send_waits(name: str, p: int, m: int, rank: int, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The rank's log from torch's loop: compute actions,
    ("post", ops) per batch posted, ("wait", ops) per wait."""
    from torch.distributed.pipelining import schedules as torch_schedules

    log: list[Any] = []

    def batch(ops: list[Any], desc: str | None = None) -> list[Any]:
        if ops:
            log.append(("post", tuple(ops)))
        return list(ops)

    monkeypatch.setattr(torch_schedules, "_batch_p2p", batch)
    monkeypatch.setattr(torch_schedules, "_sorted_batch_p2p", lambda ops,
                        desc=None: {0: batch(ops)} if ops else {})
    monkeypatch.setattr(torch_schedules, "_wait_batch_p2p", lambda works: log.append(("wait", tuple(works))))
    stage = _P2PStage(rank, p, p, rank, log)
    torch_schedules.get_schedule_class(name)(stage, m)._step_microbatches()
    return log


def _latest(sends: list[Action]) -> Action | None:
    """The send whose completion implies the others' (sends to one peer complete in order)."""
    assert len({(a.kind, a.stage) for a in sends}) <= 1  # one peer, one direction
    return max(sends, key=lambda a: a.microbatch, default=None)


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
def test_send_waits_are_where_torchs_loop_waits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from stageplan.planning.schedules import send_waits

    for p, m in itertools.product((1, 2, 3, 4), range(1, 9)):
        try:
            waits = send_waits(name, p, m)
        except StageplanError:
            continue
        assert waits is not None
        for rank in range(p):
            log = _torch_send_waits(name, p, m, rank, monkeypatch)
            before: list[list[Action]] = [[]]
            fused: list[list[Action]] = [[]]
            my_recv: set[Action] = set()  # the receive batch of the coming action, once posted
            for entry in log:
                if isinstance(entry, Action):
                    before.append([])
                    fused.append([])
                    my_recv = set()
                elif entry[0] == "post" and any(kind == "recv" for kind, _ in entry[1]):
                    my_recv = {c for _, c in entry[1]}
                elif entry[0] == "wait":
                    sends = [c for kind, c in entry[1] if kind == "send"]
                    (fused if sends and set(sends) <= my_recv else before)[-1].extend(sends)
            mine = waits[rank]
            actions = [e for e in log if isinstance(e, Action)]
            assert len(mine.before_post) == len(actions)
            for t in range(len(actions)):
                assert _latest(list(mine.before_post[t])) == _latest(before[t]), (p, m, rank, t)
                assert _latest(list(mine.with_post[t])) == _latest(fused[t]), (p, m, rank, t)
            assert _latest(list(mine.at_end)) == _latest(before[-1] + fused[-1]), (p, m, rank)
    assert send_waits("Interleaved1F1B", 2, 4) is None


def test_a_rank_steps_its_optimizer_once_its_last_gradient_is_received() -> None:
    """GPipe, 2 ranks, m = 4, no transfer time; rank 0 slower (F 2, B 3) than rank 1 (F 1, B 1), whose
    optimizer step takes 10. Closed form: rank 1's last backward ends at 4*2 + 1 + 4*1 = 13, but its gradient
    is received only when rank 0 posts that receive, after its third backward: 4*2 + 1 + 1 + 3*3 = 19; rank
    1's step() returns then, and its optimizer ends at 29 (without the wait: 23). Rank 0 ends at 4*2 + 1 + 1 +
    4*3 = 22."""
    sim = simulate("GPipe", [2.0, 1.0], [3.0, 1.0], 4, optimizer_s=[0.0, 10.0])
    assert sim.step_s == 29.0
    opt = next(e for e in sim.timeline if e.kind == "O")
    assert (opt.rank, opt.start_s, opt.end_s) == (1, 19.0, 29.0)
    assert max(e.end_s for e in sim.timeline if e.rank == 0) == 22.0


def test_idle_before_each_call_by_hand() -> None:
    """GPipe, 2 ranks, 2 microbatches, forwards 30 / 3 ms, backwards 20 / 5 ms (the sleepers' run test). Rank
    0: F0 0-30, F1 30-60, B0 68-88 (rank 1's B0 ends at 68), B1 88-108; rank 1: F0 30-33, F1 60-63, B0 63-68,
    B1 68-73; the step is 108 ms. Rank 0's F0 follows its own previous step's end (108 - 108 = 0): no gap, B0
    waits 8 ms. Rank 1's F0 comes 30 ms into the step after its previous step ended 35 ms before the end: 65
    ms; F1 waits 27 ms."""
    sim = simulate("GPipe", [0.030, 0.003], [0.020, 0.005], 2)
    assert sim.step_s == pytest.approx(0.108)
    gaps = {(e.rank, e.kind, e.microbatch): idle for e, idle in sim.idle_before()}
    assert gaps == pytest.approx({(0, "F", 0): 0.0, (0, "F", 1): 0.0, (0, "B", 0): 0.008, (0, "B", 1): 0.0,
                                  (1, "F", 0): 0.065, (1, "F", 1): 0.027, (1, "B", 0): 0.0, (1, "B", 1): 0.0},
                                 abs=1e-12)
    # an optimizer step is busy: rank 0's F0 now counts from its optimizer's end (108-112), rank 1's from its
    # own, which starts once its last send is received: rank 0 posts B1's receive at 88, so 88-90, and F0
    # idles 112 - 90 + 30 = 52 ms
    sim = simulate("GPipe", [0.030, 0.003], [0.020, 0.005], 2, optimizer_s=[0.004, 0.002])
    gaps = {(e.rank, e.kind, e.microbatch): idle for e, idle in sim.idle_before()}
    assert sim.step_s == pytest.approx(0.112)
    assert gaps[(0, "F", 0)] == pytest.approx(0.0) and gaps[(1, "F", 0)] == pytest.approx(0.052)


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
@pytest.mark.parametrize(("p", "m"), [(2, 2), (3, 5), (4, 8), (8, 16)])
def test_equal_stages_step_is_the_closed_form_plus_one_optimizer_step(schedule: str, p: int, m: int) -> None:
    # Balanced stages: rank 0 ends its last backward last, at (m + p - 1)(f + b); its optimizer step follows.
    f, b, o = 1.0, 2.0, 0.75
    sim = simulate(schedule, [f] * p, [b] * p, m, optimizer_s=[o] * p)
    step = (m + p - 1) * (f + b) + o
    assert sim.step_s == pytest.approx(step, rel=1e-12)
    # optimizer time is busy time: each rank idles (p - 1)(f + b)
    assert sim.busy_s == pytest.approx([m * (f + b) + o] * p)
    assert sim.bubble_fraction == pytest.approx((p - 1) * (f + b) / step, rel=1e-12)


def test_each_rank_steps_after_its_own_last_backward() -> None:
    # 1F1B, equal stages: rank r ends its last backward at (m + p - 1)(f + b) - r b; its optimizer step o_r
    # follows, and the step ends when the last of them does.
    p, m, f, b = 4, 8, 1.0, 2.0
    o = [0.0, 1.0, 3.0, 10.0]
    sim = simulate("1F1B", [f] * p, [b] * p, m, optimizer_s=o)
    ends = [(m + p - 1) * (f + b) - r * b for r in range(p)]
    assert sim.step_s == pytest.approx(max(e + x for e, x in zip(ends, o)))
    events = {e.rank: e for e in sim.timeline if e.kind == "O"}
    assert sorted(events) == [1, 2, 3]  # a rank without an optimizer step gets no event
    for r, e in events.items():
        assert (e.start_s, e.end_s, e.microbatch, e.stage) == pytest.approx((ends[r], ends[r] + o[r], -1, r))
        assert all(x.end_s <= e.start_s for x in sim.timeline if x.rank == r and x.kind != "O")


def test_interleaved_rank_runs_one_optimizer_step_over_its_chunks() -> None:
    sim = simulate("Interleaved1F1B", [1.0] * 4, [2.0] * 4, 4, virtual_stages=2,
                   optimizer_s=[0.5, 0.25, 1.0, 2.0])
    events = sorted((e.rank, e.stage, e.end_s - e.start_s) for e in sim.timeline if e.kind == "O")
    assert events == [(0, 0, pytest.approx(1.5)), (1, 1, pytest.approx(2.25))]
    without = simulate("Interleaved1F1B", [1.0] * 4, [2.0] * 4, 4, virtual_stages=2)
    assert not [e for e in without.timeline if e.kind == "O"]


def test_optimizer_times_are_validated() -> None:
    with pytest.raises(ValueError, match=r"optimizer_s must have 2 values, got 3; pass one optimizer-step "
                                         r"time per stage"):
        simulate("1F1B", [1.0, 1.0], [1.0, 1.0], 2, optimizer_s=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError,
                       match=r"optimizer_s must be finite and >= 0 seconds, got optimizer_s\[1\] = -1.0"):
        simulate("1F1B", [1.0, 1.0], [1.0, 1.0], 2, optimizer_s=[1.0, -1.0])


def test_the_sync_is_a_collective_after_the_last_backward_and_before_each_optimizer_step() -> None:
    # 1F1B, equal stages: rank r ends its last backward at (m + p - 1)(f + b) - r b, rank 0 last; the
    # all-reduce starts there on every rank and each rank's optimizer step follows it.
    p, m, f, b, t = 4, 8, 1.0, 2.0, 0.75
    o = [0.5, 1.0, 0.0, 2.0]
    sim = simulate("1F1B", [f] * p, [b] * p, m, optimizer_s=o, tied_sync_s=t)
    begin = (m + p - 1) * (f + b)
    sync = {e.rank: e for e in sim.timeline if e.kind == "T"}
    assert sorted(sync) == list(range(p))
    for r, e in sync.items():
        assert (e.start_s, e.end_s, e.microbatch, e.stage) == pytest.approx((begin, begin + t, -1, r))
    for e in (e for e in sim.timeline if e.kind == "O"):
        assert (e.start_s, e.end_s) == pytest.approx((begin + t, begin + t + o[e.rank]))
    assert sim.step_s == pytest.approx(begin + t + max(o))
    assert sim.busy_s == pytest.approx([m * (f + b) + t + x for x in o])  # the all-reduce is busy time
    assert not [e for e in simulate("1F1B", [f] * p, [b] * p, m).timeline if e.kind == "T"]


def test_a_bad_sync_time_is_refused() -> None:
    with pytest.raises(ValueError,
                       match=r"tied_sync_s must be finite and >= 0 seconds, got -1.0; fix the profile"):
        simulate("1F1B", [1.0, 1.0], [1.0, 1.0], 2, tied_sync_s=-1.0)


def test_counts_shape_matches_the_full_order_for_memory() -> None:
    """The layout search prices with the schedule's counts only: the same peaks in flight and the same rank
    activation peaks as torch's whole order gives, for any chunk bytes."""
    import itertools

    import numpy as np

    from stageplan.planning.schedules import counts_shape, schedule_shape

    rng = np.random.default_rng(0)
    cases = [("GPipe", p, m, 1) for p, m in itertools.product([1, 2, 5], [1, 4, 9])]
    cases += [("1F1B", p, m, 1) for p, m in itertools.product([1, 2, 5], [5, 9, 16])]
    grid = itertools.product([2, 3, 4], [2, 4, 8, 12, 16], [2, 3])
    # torch's rule on m (check_microbatches)
    cases += [("Interleaved1F1B", p, m, v) for p, m, v in grid if m % max(1, m // p) == 0]
    for name, p, m, v in cases:
        full, fast = schedule_shape(name, p, m, v), counts_shape(name, p, m, v)
        assert fast.peak_inflight == full.peak_inflight, (name, p, m, v)
        assert fast.stage_ranks == full.stage_ranks and fast.orders == ()
        for _ in range(4):
            chunk = rng.random(p * v) * 1e6
            np.testing.assert_allclose(fast.activation_peaks(chunk), full.activation_peaks(chunk), rtol=1e-12)
