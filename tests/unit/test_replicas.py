"""stageplan.running.replicas without starting a rank: the refusals a layout's run makes before any process
starts, a replica's share of the batch, DDP's exposed sync from the step's backward calls, and `plan
--data-parallel`. The runs on a ("pp", "dp") mesh are in tests/integration/test_replicas.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, run_cli

from stageplan.errors import StageplanError
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.planning.planner import plan
from stageplan.running.replicas import check_replicas, ddp_exposed_s, replica_share


def _prof() -> Profile:
    layers = tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 1024, 4096, 1024, param_count=256) for i in range(8))
    return Profile(layers, meta={"batch_size": 8, "microbatch_size": 2, "dtype": "float32"})


def test_zero_bubble_with_ddp_or_zero1_replicas_and_fsdp_reshard_are_refused_naming_why() -> None:
    """pytorch/pytorch#144530: ZBV and InterleavedZeroBubble with DDP and d >= 2 give gradients about 7e-2
    off; ZBV with FSDP2 resharded after forward gives wrong or missing ones even at d = 1."""
    zbv = plan(_prof(), 2, num_microbatches=4, schedule="ZBVZeroBubble", virtual_stages=2, data_parallel=2)
    for sharding in ("ddp", "zero1"):
        with pytest.raises(StageplanError, match=r"ZBVZeroBubble with .* replicas \(d = 2\) computes "
                                                 r"wrong gradients in torch \(pytorch/pytorch#144530.*"
                                                 r"--schedule 1F1B.*--sharding fsdp"):
            check_replicas(zbv, sharding)
    check_replicas(zbv, "fsdp")  # FSDP2 kept unsharded until the last microbatch is right
    alone = plan(_prof(), 2, num_microbatches=4, schedule="ZBVZeroBubble", virtual_stages=2)
    check_replicas(alone, "ddp")  # one replica: nothing to reduce
    with pytest.raises(StageplanError, match=r"resharded after forward computes wrong or missing gradients"):
        check_replicas(alone, "fsdp-reshard")
    with pytest.raises(StageplanError, match=r"unknown sharding 'zero3'; use one of ddp, zero1, fsdp"):
        check_replicas(alone, "zero3")


def test_a_world_or_a_batch_the_mesh_cannot_take_is_refused() -> None:
    """torchrun's world must be p x d; the workload's batch is the global one, d x m microbatches."""
    from stageplan.materialize import init_empty_weights
    from stageplan.running.stages import validate
    from stageplan.zoo import build_workload

    stored = Path(__file__).parents[2] / "profiles" / "cpu" / "gpt.json"
    pl = plan(str(stored), 2, num_microbatches=4, data_parallel=2)
    with init_empty_weights():
        validate(build_workload("gpt", {"batch_size": 16}), pl, world_size=4)
        with pytest.raises(StageplanError, match=r"world size 6 does not match the plan's 2 pipeline ranks "
                                                 r"x 2 replicas = 4; launch 4 processes .*data-parallel 3"):
            validate(build_workload("gpt", {"batch_size": 16}), pl, world_size=6)
        with pytest.raises(StageplanError, match=r"a global batch of 12 samples cannot be shared by 2 "
                                                 r"replicas into 4 microbatches each \(it must be a multiple "
                                                 r"of d x m = 8\)"):
            validate(build_workload("gpt", {"batch_size": 12}), pl)


@pytest.mark.usefixtures("no_spawn")
def test_run_refuses_a_zero_bubble_ddp_layout_in_one_line_before_any_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before the workload is even built: the schedule and sharding alone decide."""
    zbv = plan(_prof(), 2, num_microbatches=4, schedule="ZBVZeroBubble", virtual_stages=2, data_parallel=2)
    path = tmp_path / "zbv.json"
    zbv.save(path)
    code, _, err = run_cli(["run", "workloads:faulty", "--plan", str(path)], capsys)
    assert_one_line_error(code, err, r"ZBVZeroBubble with ddp replicas \(d = 2\) computes wrong gradients")
    code, _, err = run_cli(["run", "workloads:faulty", "--plan", str(path), "--sharding", "fsdp-reshard"],
                           capsys)
    assert_one_line_error(code, err, r"resharded after forward computes wrong or missing gradients")


def test_each_replica_takes_its_own_contiguous_share() -> None:
    batch = torch.arange(12).reshape(6, 2)
    shares = [replica_share(batch, r, 3) for r in range(3)]
    assert torch.equal(torch.cat(shares), batch)
    assert [s[:, 0].tolist() for s in shares] == [[0, 2], [4, 6], [8, 10]]
    assert replica_share(batch, 0, 1) is batch and replica_share("text", 1, 2) == "text"


def test_ddps_exposed_sync_is_the_last_backward_beyond_the_others() -> None:
    """Per stage: its last microbatch's backward less the median of its others (never below 0), summed."""
    calls = [(0, 0, 1.0), (0, 1, 1.2), (0, 2, 1.1), (0, 3, 1.5),  # stage 0: 1.5 - 1.1
             (2, 0, 2.0), (2, 1, 2.0), (2, 2, 2.0), (2, 3, 1.0)]  # stage 2: below its others, 0
    assert ddp_exposed_s(calls, 4) == pytest.approx(0.4)
    assert ddp_exposed_s([(0, 3, 1.0)], 4) == 0.0  # nothing to compare with


def test_plan_prices_replicas_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """d replicas train d times the samples in the same step (no data-parallel bandwidth given: no sync
    priced); zero1 without a precision counts the profiled fp32 bytes, its optimizer states split over d."""
    prof = _prof()
    one = plan(prof, 2, num_microbatches=4)
    two = plan(prof, 2, num_microbatches=4, data_parallel=2, sharding="zero1")
    assert two.predicted_step_s == pytest.approx(one.predicted_step_s)
    assert two.throughput_samples_s == pytest.approx(2 * one.throughput_samples_s)
    adam_fp32 = 8 * 256 * 4  # two fp32 states of 256 parameters, 4 layers a stage
    assert two.stages[0].memory["optimizer"] == pytest.approx(adam_fp32 / 2)
    path = tmp_path / "p.json"
    prof.save(path)
    code, out, _ = run_cli(["plan", str(path), "--stages", "2", "--microbatches", "4", "--data-parallel", "2",
                            "--sharding", "zero1"], capsys)
    assert code == 0
    assert "1F1B, 2 ranks x 1 virtual x 2 replicas (zero1), 4 microbatches of 2" in out


def test_a_measured_link_prices_the_replicas_sync_as_a_ring_all_reduce() -> None:
    """With --link, d replicas' DDP sync is the link's all-reduce on the stage's gradients: under DDP's last
    bucket (25 MiB) it is all exposed, 2(d - 1) latencies + 2(d - 1)/d x bytes / bandwidth (Patarasuk and
    Yuan 2009), with the probe's per-step latency and bandwidth."""
    import json

    root = Path(__file__).parents[2]
    link = json.loads((root / "profiles" / "cpu" / "links" / "gloo-2ranks.json").read_text())
    prof = _prof()
    grads = sum(x.param_bytes for x in prof.layers[:4])  # stage 0's 4 layers, fp32 gradients
    for d in (2, 4):
        pl = plan(prof, 2, num_microbatches=4, data_parallel=d, link=link, boundaries=[0, 4, 8])
        want = 2 * (d - 1) * link["allreduce_latency_s"] + 2 * (d - 1) / d * grads / link[
            "allreduce_bandwidth_bytes_per_s"]
        assert pl.stages[0].dp_sync_s == pytest.approx(want, rel=1e-9)
    assert plan(prof, 2, num_microbatches=4, link=link).stages[0].dp_sync_s == 0.0  # one replica


def test_the_replicas_sync_is_its_own_bar_in_the_simulated_step_and_its_trace() -> None:
    """A plan with replicas simulates each rank's sync as a "D" event of its stages' dp_sync_s, after its
    last backward (only its optimizer step may follow), and the step ends where evaluate's did (the plan's
    predicted step); the trace names it."""
    import json

    from stageplan.formats.trace import KIND_NAMES

    root = Path(__file__).parents[2]
    link = json.loads((root / "profiles" / "cpu" / "links" / "gloo-2ranks.json").read_text())
    pl = plan(_prof(), 2, num_microbatches=4, data_parallel=2, link=link, boundaries=[0, 4, 8])
    sim = pl.simulate()
    assert sim.step_s == pytest.approx(pl.predicted_step_s, rel=1e-12)
    for rank in range(2):
        mine = [e for e in sim.timeline if e.rank == rank]
        sync = [e for e in mine if e.kind == "D"]
        assert len(sync) == 1 and sync[0].microbatch == -1
        assert sync[0].end_s - sync[0].start_s == pytest.approx(pl.stages[rank].dp_sync_s, rel=1e-12)
        last_b = max(e.end_s for e in mine if e.kind == "B")
        after = [e for e in mine if e.start_s >= sync[0].end_s - 1e-15]
        assert last_b <= sync[0].start_s and {e.kind for e in after} <= {"D", "O"}
    names = [e["cat"] for e in pl.chrome_trace()["traceEvents"] if e["ph"] == "X"]
    assert names.count(KIND_NAMES["D"]) == 2
    one = plan(_prof(), 2, num_microbatches=4, link=link, boundaries=[0, 4, 8])
    assert not [e for e in one.simulate().timeline if e.kind == "D"]  # one replica: nothing to sync


def test_a_runs_sync_events_sit_where_torch_ran_them() -> None:
    """DDP's exposed all-reduce is the tail of its stage's last backward; what SyncClock timed (FSDP2's
    reduce-scatter, ZeRO-1's broadcast) keeps its own place on the step's clock."""
    from stageplan.running.executor import _sync_events
    from stageplan.running.replicas import SyncClock

    # (kind, stage, microbatch, wall start, seconds, cpu, idle): stage 1's last backward starts at wall 10.5
    intervals = [("B", 1, 0, 10.0, 0.2, 0.2, 0.0), ("B", 1, 1, 10.5, 0.3, 0.3, 0.0),
                 ("F", 1, 1, 10.3, 0.1, 0.1, 0.0)]
    clock = SyncClock(torch.device("cpu"))
    clock.spans.append((101.0, 101.25, None))  # perf_counter seconds; the step began at perf_counter 100
    rows = _sync_events(3, 1, intervals, {1: 0.1}, clock, wall0=10.0, t0=100.0, t_other=101.5, m=2)
    assert [(r["kind"], r["stage"], r["microbatch"]) for r in rows] == [("D", 1, -1)] * 2
    assert rows[0]["start_wall"] == pytest.approx(10.5 + 0.3 - 0.1) and rows[0]["duration_s"] == 0.1
    assert rows[1]["start_wall"] == pytest.approx(11.0) and rows[1]["duration_s"] == pytest.approx(0.25)
    assert _sync_events(3, 1, intervals, {1: 0.0}, SyncClock(torch.device("cpu")), wall0=10.0, t0=100.0,
                        t_other=101.5, m=2) == []  # nothing exposed, nothing timed
