"""Layouts run on a ("pp", "dp") mesh of local ranks: each sharding mode and schedule against single-process
training on the whole global batch (--check), the tied LM under replicas, and what each rank held against
the plan's bytes by kind (ZeRO-1's greedy partition, FSDP2's shards)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stageplan.formats.plan import Plan
from stageplan.planning.planner import plan
from stageplan.planning.sharding import zero1_shares
from stageplan.profiling.profiler import profile_model
from stageplan.running.launch import run
from stageplan.zoo import build_workload

pytestmark = pytest.mark.slow

OPTIONS = {"n_layer": 2, "vocab_size": 512, "tied": True}
DEEP = {**OPTIONS, "n_layer": 6}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tied GPT profiled at microbatch 2 (batch 8)."""
    path = tmp_path_factory.mktemp("replicas") / "gpt.json"
    profile_model(build_workload("gpt", OPTIONS), microbatch_size=2, warmup=0, repeats=1).save(path)
    return path


@pytest.fixture(scope="module")
def profiled_deep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same GPT with six blocks (8 profiled layers): 4 ranks x 2 virtual stages need a layer each."""
    path = tmp_path_factory.mktemp("replicas") / "gpt6.json"
    profile_model(build_workload("gpt", DEEP), microbatch_size=2, warmup=0, repeats=1).save(path)
    return path


def _run(profiled: Path, p: int, d: int, sharding: str, schedule: str = "1F1B", v: int = 1,
         m: int = 4, options: dict | None = None) -> tuple[Plan, object]:
    # the plan prices fsdp; the run reshards after every forward under fsdp-reshard
    pl = plan(str(profiled), p, num_microbatches=m, schedule=schedule, virtual_stages=v, data_parallel=d,
              sharding=sharding.removesuffix("-reshard"), optimizer="adam")
    report = run("gpt", pl, factory_options={**(options or OPTIONS), "batch_size": 2 * m * d}, steps=2,
                 warmup=1, check=True, retime=False, timeout_s=240, sharding=sharding)
    return pl, report


@pytest.mark.parametrize(("sharding", "schedule", "v"), [
    ("ddp", "1F1B", 1), ("zero1", "1F1B", 1), ("fsdp", "1F1B", 1), ("fsdp-reshard", "1F1B", 1),
    ("ddp", "Interleaved1F1B", 2), ("zero1", "Interleaved1F1B", 2), ("fsdp", "Interleaved1F1B", 2),
])
def test_a_2x2_layout_trains_as_one_process_does(
    profiled: Path, sharding: str, schedule: str, v: int
) -> None:
    """Four ranks, two replicas of a two-rank pipeline holding a tied embedding and LM head: every replica's
    parameters and the replicas' mean loss equal one process training the whole global batch. DDP had
    reduced twice in the first step (torch's shape inference ran the module outside no_sync) and an exported
    stage had not been given its wrapper at all: both trained each replica on its own half."""
    _, report = _run(profiled, 2, 2, sharding, schedule, v)
    assert report.check is not None and report.check["passed"], report.check
    # every replica's gradients too, by FQN: Adam's update alone could hide a gradient off by a factor
    assert report.check["grads_compared"] == report.check["params_compared"]
    assert report.check["max_grad_diff"] < 1e-6, report.check
    assert report.check["params_compared"] == 2 * sum(1 for _ in build_workload("gpt", OPTIONS)
                                                      .model.named_parameters(remove_duplicate=False))
    assert report.meta["mesh"] == {"pp": 2, "dp": 2} and report.meta["sharding"] == sharding
    rows = [*report.ranks, *report.replicas]
    assert sorted((r["mesh"]["pp"], r["mesh"]["dp"]) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["measured_dp_sync_s"] is not None and r["measured_dp_sync_s"] >= 0 for r in rows)
    assert report.samples_per_s == pytest.approx(2 * 4 * 2 / report.measured_step_s)
    _sync_bars_sit_where_torch_ran_them(report.timeline, sharding)


def _sync_bars_sit_where_torch_ran_them(timeline: tuple[dict, ...], sharding: str) -> None:
    """The run's "D" rows: DDP's exposed all-reduce inside its stage's last backward, the stage's
    ``perform_reduce_grad`` (FSDP2's reduce-scatter) after the rank's last backward and before its optimizer
    step, FSDP2's all-gather of each stage before that stage's first forward, ZeRO-1's broadcast inside the
    optimizer step (its DDP part as DDP's). FSDP2 and ZeRO-1 sync on
    every rank every step; DDP's exposed part may be nothing."""
    slack = 1e-4  # seconds: wall clocks read on either side of one call
    sync = [e for e in timeline if e["kind"] == "D"]
    if sharding != "ddp":  # the timeline is the first replica's pipeline: ranks 0 and 2
        assert {e["rank"] for e in sync} == {0, 2}
    for e in sync:
        mine = [x for x in timeline if x["rank"] == e["rank"]]
        own_b = [x for x in mine if x["kind"] == "B" and x["stage"] == e["stage"]]
        opt = [x for x in mine if x["kind"] == "O"]
        inside = [x for x in own_b + opt if x["start_s"] - slack <= e["start_s"] <= e["end_s"]
                  <= x["end_s"] + slack]
        after = max(x["end_s"] for x in own_b) - slack <= e["start_s"] and all(
            e["end_s"] <= x["start_s"] + slack for x in opt)
        # FSDP2's all-gather of the stage's units, timed at the step's start, before its first forward
        own_f = [x for x in mine if x["kind"] == "F" and x["stage"] == e["stage"]]
        before = sharding == "fsdp" and e["end_s"] <= min(x["start_s"] for x in own_f) + slack
        assert inside or after or before, (sharding, e)
    if sharding == "fsdp":  # each stage gathers before its first forward, and reduces after its last backward
        for rank in {e["rank"] for e in sync}:
            firsts = {x["stage"]: x["start_s"] for x in sorted(timeline, key=lambda x: -x["start_s"])
                      if x["rank"] == rank and x["kind"] == "F"}
            mine = [e for e in sync if e["rank"] == rank]
            assert all(any(e["stage"] == s and e["end_s"] <= t + slack for e in mine)
                       for s, t in firsts.items()), (rank, mine)


# 4 x 1 runs once a schedule: with one replica no stage is wrapped and the optimizer is torch's own whatever
# the sharding (replicas.wrap_stage, make_replica_optimizer), so ddp and zero1 there would repeat the fsdp
# run. benchmarks/check_matrix.py runs every sharding on every mesh and schedule.
@pytest.mark.parametrize(("p", "d", "sharding", "schedule", "v"), [
    (1, 4, "ddp", "1F1B", 1), (1, 4, "zero1", "1F1B", 1), (1, 4, "fsdp", "1F1B", 1),
    (1, 4, "zero1", "Interleaved1F1B", 2), (4, 1, "fsdp", "1F1B", 1), (4, 1, "fsdp", "Interleaved1F1B", 2),
])
def test_a_1x4_and_a_4x1_layout_train_as_one_process_does(
    request: pytest.FixtureRequest, p: int, d: int, sharding: str, schedule: str, v: int
) -> None:
    """One stage on four replicas (DDP over four, ZeRO-1's partition over four, FSDP2 sharding the tied LM
    over four; interleaved, both of the rank's stages on the same four replicas), and four stages on one
    replica (interleaved: eight stages, so the six-block GPT)."""
    deep = p * v > 4  # the two-block GPT has 4 layers: embedding, the blocks, the head
    options = DEEP if deep else OPTIONS
    _, report = _run(request.getfixturevalue("profiled_deep" if deep else "profiled"), p, d, sharding,
                     schedule, v, options=options)
    assert report.check is not None and report.check["passed"], report.check
    names = build_workload("gpt", options).model.named_parameters(remove_duplicate=False)
    assert report.check["params_compared"] == d * sum(1 for _ in names)
    assert report.check["grads_compared"] == report.check["params_compared"]
    assert report.check["max_grad_diff"] < 1e-6, report.check
    assert report.meta["mesh"] == {"pp": p, "dp": d}


def test_each_rank_holds_what_its_sharding_says(profiled: Path) -> None:
    """ZeRO-1: each replica's Adam states are exactly its share of ZeroRedundancyOptimizer's greedy
    partition of whole tensors (8 bytes an fp32 element); DDP: whole states on every replica, equal to the
    plan's; FSDP2: the shards it steps are the stage's parameters split over d (dim 0 padded to d rows)."""
    from stageplan.layers import cut_stages, used_parameters
    from stageplan.running.stages import first_microbatch_of_plan

    pl, ddp = _run(profiled, 2, 2, "ddp")
    _, zero1 = _run(profiled, 2, 2, "zero1")
    _, fsdp = _run(profiled, 2, 2, "fsdp")
    workload = build_workload("gpt", {**OPTIONS, "batch_size": 16})
    cut = cut_stages(workload.model, first_microbatch_of_plan(workload, pl), pl.layer_names, pl.boundaries)
    # each stage's distinct tensors in the order its rank's optimizer sees them
    sizes = [[t.numel() for t in {id(t): t for t in used_parameters(piece.module).values()}.values()]
             for piece in cut.pieces]
    for row in [*zero1.ranks, *zero1.replicas]:
        shares = zero1_shares(sizes[row["stages"][0]], 2)
        assert row["measured_memory_by_kind"]["optimizer"] == 8 * shares[row["mesh"]["dp"]]
    for row in [*ddp.ranks, *ddp.replicas]:
        held, want = row["measured_memory_by_kind"], row["predicted_memory_by_kind"]
        assert held["optimizer"] == 8 * sum(sizes[row["stages"][0]])
        assert held["optimizer"] == pytest.approx(want["optimizer"], rel=0.01)
        assert held["params"] == pytest.approx(want["params"], rel=0.01)
    for row in [*fsdp.ranks, *fsdp.replicas]:
        whole = 4 * sum(sizes[row["stages"][0]])
        assert whole / 2 <= row["measured_memory_by_kind"]["master"] <= whole / 2 * 1.05
