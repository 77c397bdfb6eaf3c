"""The link between neighbouring ranks, measured by 2 gloo ranks: the ping-pong every run starts with,
stageplan link, and the schedule's overheads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli, spawn_ranks
from unit.test_link import GPT, _profile

import stageplan.running.link
from stageplan import RunReport
from stageplan.formats.link import load_link
from stageplan.formats.plan import Plan
from stageplan.formats.profile import Profile
from stageplan.planning.planner import plan


def test_every_run_starts_with_a_ping_pong(tmp_path: Path) -> None:
    from stageplan.profiling.profiler import profile_model
    from stageplan.running.launch import run
    from stageplan.zoo import build_workload

    wl = build_workload("workloads:mlp", {})
    prof = profile_model(wl, microbatch_size=2, warmup=0, repeats=1, dedup=False)
    report = run("workloads:mlp", plan(prof, 2, num_microbatches=4), steps=1, warmup=0, timeout_s=120,
                 output=tmp_path / "run.json")
    link = report.link
    assert link is not None and link["backend"] == "gloo"
    assert link["latency_s"] > 0 and link["bandwidth_bytes_per_s"] > 0
    # one pair: its own figure
    assert link["exchange_s"] > 0 and link["pairs"][0]["exchange_s"] == link["exchange_s"]
    assert link["sizes"][0] == 4096 and link["sizes"][-1] >= 4 * 2**20
    assert [p["ranks"] for p in link["pairs"]] == [[0, 1]]
    # torch's own loop between two chunk calls, timed by the schedule probe
    assert 0 < link["action_s"] < 1e-2
    # the tied gradient's all-reduce, timed itself: 4 MiB takes longer than 4 KiB, and the ring constants give
    # back the fit through both sizes at the probe's 2 ranks
    small, large = link["allreduce_s"]
    assert link["allreduce_ranks"] == 2 and link["allreduce_sizes"] == [4096, 4 * 2**20] and 0 < small < large
    fixed, rate = 2 * link["allreduce_latency_s"], link["allreduce_bandwidth_bytes_per_s"]
    assert fixed == pytest.approx(small, rel=1e-12) and fixed + 4 * 2**20 / rate == pytest.approx(large,
                                                                                                  rel=1e-12)
    assert RunReport.load(tmp_path / "run.json").link == link


def test_cli_link_writes_a_loadable_link(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "link.json"
    code, stdout, err = run_cli(
        ["link", "--backend", "gloo", "--ranks", "2", "-o", str(out), "--timeout", "60"], capsys)
    assert code == 0, err
    link = load_link(out)
    assert json.loads(out.read_text())["schema"] == "stageplan.link/1"
    assert link["latency_s"] > 0 and link["bandwidth_bytes_per_s"] > 0 and link["num_ranks"] == 2
    pair = link["pairs"][0]
    assert pair["ranks"] == [0, 1] and len(pair["one_way_s"]) == len(link["sizes"]) == 2
    assert pair["one_way_s"][1] > pair["one_way_s"][0]  # 4 MiB takes longer than 4 KiB
    assert "latency" in stdout and f"wrote {out}" in stdout and "torch's schedule" in stdout
    assert "all-reduce" in stdout and " ms at 4096 KiB" in stdout
    # what it measured plans as a link
    pl = plan(_profile(), 2, num_microbatches=4, link=out)
    assert pl.cost_options["bandwidth_bytes_per_s"] == link["bandwidth_bytes_per_s"]
    assert pl.cost_options["allreduce_bandwidth_bytes_per_s"] == link["allreduce_bandwidth_bytes_per_s"]


@pytest.mark.parametrize(("ranks", "pipeline"), [(4, [0, 2]), (2, [0, 1])])
def test_cli_link_times_the_replicas_all_reduce_and_plan_prices_their_sync_with_its_fit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], ranks: int, pipeline: list[int]) -> None:
    """``stageplan link --data-parallel 2`` on 4 ranks (2 pipeline ranks x 2 replicas, as run lays them out)
    and on 2 (1 x 2): both groups of replicas all-reduce at once, by size, and time each sharding mode's own
    sync; plan --link then prices each rank's sync (all exposed under DDP: GPT's gradients per rank are under
    its 25 MiB bucket) at the two-point fit of its mode's times (the latency the smallest size's time, the
    bandwidth the largest size's) on the rank's gradient bytes."""
    out = tmp_path / "link.json"
    code, stdout, err = run_cli(["link", "--backend", "gloo", "--ranks", str(ranks), "--data-parallel", "2",
                                 "-o", str(out), "--timeout", "120"], capsys)
    assert code == 0, err
    link = load_link(out)
    groups = ranks // 2
    assert (link["dp_allreduce_ranks"], link["dp_allreduce_groups"], link["pipeline_parallel"]) == (2, groups,
                                                                                                     groups)
    # the point-to-point probes ran on replica 0's pipeline (global ranks 0 and 2), or with one pipeline rank
    # on stage 0's two replicas
    assert [p["ranks"] for p in link["pairs"]] == [pipeline]
    sizes, times = link["dp_allreduce_sizes"], link["dp_allreduce_s"]
    assert sizes == [4096, 64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20]
    assert all(t > 0 for t in times) and times[0] < times[3] < times[4]  # 4 KiB < 4 MiB < 16 MiB
    # a ceiling, not the budget: the repeats were chosen for about 2 s and took 0.25-1.03 s on a 2-core VM at
    # load 0-7 (docs/accuracy.md), so only a gross slowdown fails here
    assert 0 < link["dp_allreduce_probe_s"] < 10.0
    assert f"data-parallel all-reduce over 2 replicas, {groups} groups at once" in stdout
    # each sharding mode's own sync, timed on a module of 4 units at every size
    kinds = ("ddp", "zero1_broadcast", "fsdp_reduce", "fsdp_gather")
    assert (link["dp_sync_ranks"], link["dp_sync_units"]) == (2, 4)
    assert sorted(link["dp_sync_fit"]) == sorted(kinds)
    sync_sizes = link["dp_sync_sizes"]
    assert sync_sizes == [64 * 2**10, 2**20, 16 * 2**20, 32 * 2**20]
    for kind in kinds:  # 32 MiB takes longer than 64 KiB in every mode
        assert all(t > 0 for t in link["dp_sync_s"][kind]) and link["dp_sync_s"][kind][-1] > link[
            "dp_sync_s"][kind][0], kind
    # FSDP2's kinds once more over 16 units at 16 MiB
    assert (link["dp_sync_many_units"], link["dp_sync_many_size"]) == (16, 16 * 2**20)
    assert sorted(link["dp_sync_many_s"]) == ["fsdp_gather", "fsdp_reduce"]
    assert all(t > 0 for t in link["dp_sync_many_s"].values())
    assert 0 < link["dp_sync_probe_s"] < 60.0  # a ceiling: 16 s at load 7 on a 2-core VM
    assert "each sharding mode's own sync over 2 replicas" in stdout

    def through_ends(xs: list[int], ts: list[float]) -> tuple[float, float]:
        """The oracle: the line through the smallest and the largest size's times (they rise with size)."""
        a = max(0.0, ts[0] - xs[0] * (ts[-1] - ts[0]) / (xs[-1] - xs[0]))
        return a, (ts[-1] - a) / xs[-1]

    params = [x.param_bytes for x in Profile.load(GPT).layers]
    for sharding in ("ddp", "fsdp"):
        plan_path = tmp_path / f"plan-{sharding}.json"
        code, _, err = run_cli(["plan", str(GPT), "--stages", "2", "--microbatches", "4", "--data-parallel",
                                "2", "--sharding", sharding, "--link", str(out), "-o", str(plan_path)],
                               capsys)
        assert code == 0, err
        pl = Plan.load(plan_path)
        for st in pl.stages:
            grads = sum(params[st.first_layer:st.end_layer])
            assert grads < 25 * 2**20  # under DDP's first bucket: DDP's whole sync is exposed
            if sharding == "ddp":
                a, c = through_ends(sync_sizes, link["dp_sync_s"]["ddp"])
                want = a + grads * c
            else:  # FSDP2's fixed costs once per unit: the stage's layers that hold parameters; a unit's is
                # what each of the 12 units more added at 16 MiB, where they added anything, else a / 4
                units = sum(1 for n in params[st.first_layer:st.end_layer] if n > 0)
                want = 0.0
                for k in ("fsdp_reduce", "fsdp_gather"):
                    a, c = through_ends(sync_sizes, link["dp_sync_s"][k])
                    added = (link["dp_sync_many_s"][k] - link["dp_sync_s"][k][2]) / 12
                    want += (added if added > 0 else a / 4) * units + grads * c
            assert st.dp_sync_s == pytest.approx(want, rel=1e-6), (sharding, st)
        assert any("the link's data-parallel all-reduce" in x and "a sharding mode's own sync" in x
                   for x in pl.notes)


def _probe_in_child(rank: int, port: int, where: str, delay_s: float, queue) -> None:  # type: ignore[no-untyped-def]
    """One rank of the schedule probe; with ``delay_s``, a sleep of that long put into torch's code at
    ``where``: "loop", entering each action of the schedule's loop (outside the chunk calls); "forward" or
    "backward", inside each chunk's forward or backward call, just before PipelineStage runs the module (or
    its gradients)."""
    import contextlib
    import os
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.pipelining import PipelineStage

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if delay_s and where == "loop":
        real = schedules.record_function

        @contextlib.contextmanager
        def slow(name: str):  # type: ignore[no-untyped-def]
            time.sleep(delay_s)
            with real(name):
                yield

        schedules.record_function = slow
    elif delay_s:
        name = f"{where}_maybe_with_nosync"
        inner = getattr(PipelineStage, name)

        def slow_chunk(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            time.sleep(delay_s)
            return inner(self, *args, **kwargs)

        setattr(PipelineStage, name, slow_chunk)
    try:
        queue.put((rank, stageplan.running.link.schedule_overheads(torch.device("cpu"), evict_bytes=2**20)))
    finally:
        dist.destroy_process_group()


@pytest.mark.timing
@pytest.mark.parametrize(("where", "delay_s"),
                         [("loop", 0.0), ("loop", 0.004), ("forward", 0.004), ("backward", 0.004)])
def test_the_schedule_probe_times_what_torch_spends_around_the_chunks_layers(
    where: str, delay_s: float
) -> None:
    """Oracle: a known delay put into torch's own code shows up in the probe's figure for that place, and only
    there: in its loop between two chunk calls (``action_s``), or in PipelineStage inside each chunk's forward
    or backward call outside the module (``chunk_forward_s``, ``chunk_backward_s``); without it each stays
    well under a millisecond here."""
    got = {rank: values[0] for rank, values in spawn_ranks(_probe_in_child, 2, where, delay_s).items()}
    assert got[0] == got[1]  # every rank gets the same figures
    figures = got[0]
    assert set(figures) == {"action_s", "chunk_forward_s", "chunk_backward_s"}
    delayed = (
        {"loop": "action_s", "forward": "chunk_forward_s", "backward": "chunk_backward_s"}[where]
        if delay_s
        else None
    )
    for key, value in figures.items():
        if key == delayed:
            assert delay_s < value < delay_s + 3e-3, (key, value)
        else:
            assert 0 < value < 2e-3, (key, value)


def _ping_pong_in_child(rank: int, port: int, gap_s: float, queue) -> None:  # type: ignore[no-untyped-def]
    """One rank of the ping-pong, its work before each timed message (link._compute_gap) replaced by a sleep
    of ``gap_s`` that counts its calls."""
    import os
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    calls = [0]

    def gap(_: object) -> None:
        calls[0] += 1
        time.sleep(gap_s)

    stageplan.running.link._compute_gap = gap
    try:
        link = stageplan.running.link.ping_pong(torch.device("cpu"), sizes_bytes=(4096, 2**20), warmup=2,
                                                repeats=5)
        queue.put((rank, calls[0], link["latency_s"], link["exchange_s"]))
    finally:
        dist.destroy_process_group()


@pytest.mark.timing
def test_every_timed_message_follows_the_ranks_own_work_outside_the_timer() -> None:
    """Back to back with the message before, a fused exchange between two pinned gloo ranks stalled 3.7-4.0 ms
    on one VM (0.16-0.33 ms after compute, as a chunk computes between receiving and sending), so the probe
    works before every timed message: once before each of the 60 small and 5 large round trips and each of the
    2 + 60 exchanges, on both ranks, and never inside the timer (a 5 ms gap would show in every figure)."""
    got = spawn_ranks(_ping_pong_in_child, 2, 0.005)
    small = stageplan.running.link.SMALL_REPEATS
    assert [got[r][0] for r in (0, 1)] == [small + 5 + 2 + small] * 2
    for _, latency, exchange in got.values():  # under 2 ms when the host is quiet; one busy run read 2.26 ms
        assert 0 < latency < 4.5e-3 and 0 < exchange < 4.5e-3, (latency, exchange)
