"""The link between neighbouring pipeline ranks, measured (torch.distributed): a ping-pong for latency and
bandwidth, the schedule's own overheads and the tied all-reduce; written as LINK.json
(:mod:`stageplan.formats.link`).

Every run starts with it (executor.py), and ``stageplan link`` runs it alone (launch.measure_link). Ranks r
and r + 1 of the pipeline's process group send a message back and forth, for a few sizes, after a warm-up; the
median round trip / 2 is the one-way time at that size. The fit is the latency-bandwidth (Hockney) model,
t(n) = latency + n / bandwidth: the latency is the small message's one-way time, the bandwidth the large
message's bytes over its one-way time less that latency.

A pipeline schedule does not send alone: torch's schedules post a send fused with a receive
(``batch_isend_irecv``) and wait for both, at every crossing. So each pair also times that exchange, both
ranks posting a small send and a small receive to each other at once: ``exchange_s``, the cost of one crossing
as the schedule pays it. A plan priced with the link uses the larger of the two per crossing. Every timed
message follows about 1 ms of the rank's own work, as a chunk computes between receiving and sending
(:data:`GAP_MATMULS`).

The ranks also time the all-reduce that syncs a tied parameter's gradient (:func:`allreduce_probe`), at 4 KiB
and 4 MiB after a barrier, so a plan priced with the link prices that sync from the collective's own times.
Last, the ranks run torch's own GPipe schedule over a trivial layer each (:func:`schedule_overheads`): the gap
between one chunk call and the next on a rank that does not wait is what torch's loop costs per action outside
the chunks (``action_s``), and each chunk call's time outside its module is what PipelineStage costs inside it
(``chunk_forward_s``, ``chunk_backward_s``); a plan priced with the link adds the first around every forward
and every backward, and the other two to every chunk's forward and backward.

torch is imported inside the functions that measure, so that the planner can read LINK.json without torch."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from stageplan.formats.link import DP_SYNC_KINDS, ring_constants

SMALL_BYTES = 4 * 2**10  # the latency probe: small enough that bandwidth plays no part
LARGE_BYTES = 4 * 2**20  # the bandwidth probe when the plan's boundary tensors are smaller (or unknown)
# cap on the largest probe: the ping-pong must stay well under a second on gloo localhost
MAX_BYTES = 16 * 2**20
# Round trips per size before timing (connection set-up, first touch of the buffers, waking idle CPUs), and
# timed ones (median taken). A short probe can fall inside one slow spell of a shared host, and a plan prices
# every crossing with what it reads: with 2 warm-up and 5 timed round trips, the median latency read 2.1 ms
# against 63-80 us (measured on a 2-core CPU host). The 25 round trips at a large size cost about 0.1 s at 4
# MiB and 0.35 s at 16 MiB per pair on gloo (measured on the same host).
WARMUP = 10
REPEATS = 15
# Timed round trips of a message of at most SMALL_MAX_BYTES (the latency probe and the fused exchange): a
# median over 60, about 6 ms in all. A gloo round trip on a shared CPU host stalls about 2 ms now and then,
# most often in the first few (3-10 of 220, measured on a 2-core CPU host), which a median of 15 small round
# trips did not outlast in 3 of 14 probes (1.6-2.0 ms medians).
SMALL_REPEATS = 60
SMALL_MAX_BYTES = 64 * 2**10
# Work before each timed message, as a rank computes its chunk between receiving and sending: 16 matmuls of
# 128 x 128 floats on the CPU, about 1 ms (60 us each, measured on a 2-core CPU host). Messages sent back to
# back time the OS scheduler, not the link: on a host whose scheduler tick is 4 ms, a fused exchange between
# two pinned gloo ranks took 3.7-4.0 ms back to back, against 0.09-0.10 ms after a barrier and 0.16-0.33 ms
# after 0.3-2 ms of compute, and plans priced at the back-to-back figure over-predicted their runs' steps by
# 12-49 ms; back-to-back round trips likewise read a 1.4-1.9 ms latency in 2 of 6 probes, 46 us in the others
# (measured on a 2-core CPU host, medians of 40-50).
GAP_MATMULS = 16
# The schedule probe (:func:`schedule_overheads`): torch's GPipe over a 16-float linear layer per rank,
# microbatches per step, untimed steps (the first one infers the stages' shapes), timed steps, and the bytes
# each chunk call writes, as a real chunk streams its weights and activations through the caches. The gap
# after a chunk grows with what the chunk evicted (medians of 60-70 gaps, measured on a 2-core CPU host): 68
# us after none, 117 us after 1 MiB, 142-145 us after 4-16 MiB, 222 us after 64 MiB; a rank's chunk of a model
# that needs a pipeline streams tens of MiB. The probe takes 0.63-0.66 s (and 0.86 s to import torch's
# pipelining the first time, which a run imports anyway).
ACTION_MICROBATCHES = 8
ACTION_WARMUP = 1
ACTION_STEPS = 3
ACTION_EVICT_BYTES = 64 * 2**20
# The all-reduce probe (:func:`allreduce_probe`): every rank all-reduces a buffer of each size after a
# barrier, as the tied gradient's sync starts once every rank is there. The collective itself is timed because
# the ring model priced from the point-to-point fit is far off on gloo: its all-reduce of 1, 4 and 16 MiB
# between two pinned CPU ranks took 2.1-4.7x the model's time (3.9-5.4 ms against 1.49 ms at 4 MiB, of which
# the half-buffer add each rank does is 0.05 ms; measured on a 2-core CPU host).
ALLREDUCE_SIZES = (SMALL_BYTES, LARGE_BYTES)
ALLREDUCE_REPEATS = 15


def probe_sizes(largest_boundary_bytes: float | None = None) -> tuple[int, ...]:
    """The message sizes (bytes) to probe: 4 KiB, and the largest boundary tensor the plan sends, at least
    4 MiB and at most 16 MiB.

    >>> probe_sizes(), probe_sizes(64 * 2**20)
    ((4096, 4194304), (4096, 16777216))
    """
    large = LARGE_BYTES if not largest_boundary_bytes else int(
        min(max(largest_boundary_bytes, LARGE_BYTES), MAX_BYTES))
    return (SMALL_BYTES, large)


def fit(sizes_bytes: Sequence[int], one_way_s: Sequence[float]) -> tuple[float, float]:
    """(latency_s, bandwidth_bytes_per_s) from one-way times at the smallest and largest size (Hockney model):
    latency is the smallest message's time; bandwidth = largest bytes / (its time - latency), or bytes / its
    time when the difference is not positive (a link too fast to tell at these sizes).

    >>> latency_s, bandwidth = fit([4096, 4194304], [1e-5, 1e-5 + 4194304 / 1e9])
    >>> latency_s, round(bandwidth)
    (1e-05, 1000000000)
    """
    i_small, i_large = (
        min(range(len(sizes_bytes)), key=lambda i: sizes_bytes[i]),
        max(range(len(sizes_bytes)), key=lambda i: sizes_bytes[i]),
    )
    latency_s = float(one_way_s[i_small])
    extra_s = float(one_way_s[i_large]) - latency_s
    bandwidth = sizes_bytes[i_large] / (extra_s if extra_s > 0 else float(one_way_s[i_large]))
    return latency_s, float(bandwidth)


def ping_pong(device: Any, *, sizes_bytes: Sequence[int] = (SMALL_BYTES, LARGE_BYTES), warmup: int = WARMUP,
              repeats: int = REPEATS, group: Any = None) -> dict[str, Any]:
    """Measure every neighbouring pair (r, r + 1) of ``group`` (the default group when None), one pair at a
    time, on an initialised process group; every rank calls it and every rank gets the result:
    ``{"backend", "latency_s", "exchange_s", "bandwidth_bytes_per_s", "sizes", "pairs"}``, where ``pairs``
    holds each pair's one-way median seconds per size, its fused exchange and its own fit, and the overall
    figures are the medians over pairs; plus ``action_s``, torch's schedule loop per chunk action, and
    ``chunk_forward_s`` and ``chunk_backward_s``, PipelineStage's own time inside each chunk call
    (:func:`schedule_overheads`), on the
    CPU with two or more ranks.
    """
    import torch
    import torch.distributed as dist

    from stageplan.measure import Timer, median_iqr

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    dev = torch.device(device)
    timer = Timer("cpu")  # wall clock of the whole round trip; on CUDA the round trip synchronises itself
    sizes = [int(n) for n in sizes_bytes]
    buffers = {n: torch.zeros(max(n // 4, 1), dtype=torch.float32, device=dev) for n in sizes}
    gap = torch.ones(128, 128)  # on the CPU: the host thread's own work between messages (GAP_MATMULS)
    pairs: list[dict[str, Any]] = []
    # every rank joins one collective first: NCCL wants all ranks in the first batch_isend_irecv of a group,
    # and a barrier makes the first (communicator-creating) call a collective that every rank makes
    dist.barrier(group=group)
    for low in range(world - 1):
        row: dict[str, Any] = {"ranks": [ranks[low], ranks[low + 1]], "one_way_s": [], "one_way_iqr_s": []}
        if rank in (low, low + 1):
            first = rank == low
            peer = ranks[low + 1] if first else ranks[low]
            for n in sizes:
                trip = functools.partial(_round_trip, buffers[n], peer, first, group)
                for _ in range(warmup):
                    trip()
                timed = max(repeats, SMALL_REPEATS) if n <= SMALL_MAX_BYTES else repeats
                one_way = []
                for _ in range(timed):
                    _compute_gap(gap)
                    one_way.append(timer(trip)[0] / 2.0)  # one way = round trip / 2
                med, iqr = median_iqr(one_way)
                row["one_way_s"].append(med)
                row["one_way_iqr_s"].append(iqr)
            small = min(sizes)
            out_buf, in_buf = buffers[small], torch.zeros_like(buffers[small])
            exchanges = []
            for k in range(warmup + max(repeats, SMALL_REPEATS)):
                _round_trip(out_buf, peer, first, group)  # both ranks leave it together,
                _compute_gap(gap)  # compute as a chunk would,
                # then post at once
                seconds, _ = timer(functools.partial(_exchange, out_buf, in_buf, peer, group))
                if k >= warmup:
                    exchanges.append(seconds)
            row["exchange_s"] = median_iqr(exchanges)[0]
        if rank == low:
            lat, bw = fit(sizes, row["one_way_s"])
            row.update(latency_s=lat, bandwidth_bytes_per_s=bw)
            pairs.append(row)
        # one pair at a time: pairs measured together would share the cores and the bus
        dist.barrier(group=group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, pairs, group=group)
    all_pairs = [row for rows in gathered for row in rows]
    overheads = schedule_overheads(dev, group=group)
    collective = allreduce_probe(dev, group=group, warmup=min(warmup, 3))
    return {
        **(overheads or {}),
        **(collective or {}),
        "backend": str(dist.get_backend(group)),
        "latency_s": median_iqr([r["latency_s"] for r in all_pairs])[0] if all_pairs else None,
        "exchange_s": median_iqr([r["exchange_s"] for r in all_pairs])[0] if all_pairs else None,
        "bandwidth_bytes_per_s": median_iqr([r["bandwidth_bytes_per_s"] for r in all_pairs])[0] if all_pairs
        else None,
        "sizes": sizes, "warmup": warmup, "repeats": repeats, "small_repeats": max(repeats, SMALL_REPEATS),
        "device": str(dev), "pairs": all_pairs,
    }


def allreduce_probe(device: Any, *, group: Any = None, sizes_bytes: Sequence[int] = ALLREDUCE_SIZES,
                    warmup: int = 3, repeats: int = ALLREDUCE_REPEATS) -> dict[str, Any] | None:
    """Time the all-reduce that syncs a tied parameter's gradient across ranks, at each size, on every rank of
    ``group`` (each calls it; each gets the result): a barrier, then one ``all_reduce`` of a float buffer,
    timed until its result is there; the median per size, the slowest rank's (the sync ends for the step when
    it ends for every rank). The Hockney fit a + n / B of those times is stored as the ring model's constants
    at this rank count p, so that :func:`stageplan.planning.costs.ring_allreduce_time` gives back a + n / B
    here and scales it to another p: ``allreduce_latency_s`` = a / (2(p - 1)) per ring step and
    ``allreduce_bandwidth_bytes_per_s`` = B x 2(p - 1) / p. Also ``allreduce_ranks`` (p), ``allreduce_sizes``
    and ``allreduce_s`` (the medians). None on a single rank."""

    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world < 2:
        return None
    sizes = [int(n) for n in sizes_bytes]
    medians = _allreduce_medians(torch.device(device), sizes, group, group, warmup, repeats)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, medians, group=group)
    slowest = [max(row[i] for row in gathered) for i in range(len(sizes))]
    latency, bandwidth = ring_constants(*fit(sizes, slowest), world)
    return {"allreduce_latency_s": latency, "allreduce_bandwidth_bytes_per_s": bandwidth,
            "allreduce_ranks": world, "allreduce_sizes": sizes, "allreduce_s": slowest}


# The data-parallel group's all-reduce (:func:`dp_allreduce_probe`): sizes from a small gradient bucket to the
# size of DDP's 25 MiB buckets, so that the fit is read where a replica's sync is priced, and timed rounds
# (median). Every group of replicas all-reduces at once, as every stage's replicas sync at the end of a real
# step, so the contention between groups on one host is in the figure. 3 warm-up and 9 timed rounds at these
# sizes took 0.25 s for 1 pipeline rank x 2 replicas and 0.58 s for 2 x 2 (gloo, pinned ranks, measured on a
# 2-core CPU host), well inside the probe's budget of about 2 s.
DP_ALLREDUCE_SIZES = (SMALL_BYTES, 64 * 2**10, 2**20, LARGE_BYTES, MAX_BYTES)
DP_ALLREDUCE_WARMUP = 3
DP_ALLREDUCE_REPEATS = 9


def line_through_ends(sizes_bytes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """(fixed_s, bandwidth_bytes_per_s) of the line t(n) = fixed + n / bandwidth through the times at the
    smallest and the largest size, the fixed cost held >= 0; with no positive slope (the large message no
    slower), the ping-pong's two-point :func:`fit`.

    >>> sizes = [4096, 2**20, 2**24]
    >>> fixed_s, bandwidth = line_through_ends(sizes, [1e-4 + n / 1e9 for n in sizes])
    >>> round(fixed_s * 1e6, 6), round(bandwidth)
    (100.0, 1000000000)
    """
    small = min(range(len(sizes_bytes)), key=lambda i: sizes_bytes[i])
    large = max(range(len(sizes_bytes)), key=lambda i: sizes_bytes[i])
    rise = float(seconds[large]) - float(seconds[small])
    run = float(sizes_bytes[large]) - float(sizes_bytes[small])
    if rise <= 0 or run <= 0:
        return fit(sizes_bytes, seconds)
    fixed = max(0.0, float(seconds[small]) - float(sizes_bytes[small]) * rise / run)
    return fixed, float((sizes_bytes[large]) / (float(seconds[large]) - fixed))


def dp_allreduce_probe(device: Any, dp_group: Any, *, sizes_bytes: Sequence[int] = DP_ALLREDUCE_SIZES,
                       warmup: int = DP_ALLREDUCE_WARMUP, repeats: int = DP_ALLREDUCE_REPEATS
                       ) -> dict[str, Any] | None:
    """Time the replicas' gradient all-reduce: every rank of the world calls it with its own data-parallel
    group (``dp_group``, its stage's d replicas) and every rank gets the result. Per size and round, a
    barrier of the whole world, then one ``all_reduce`` of a float buffer on each group at once, timed until
    its result is there; the median per rank and size, the slowest rank's per size (the step waits for the
    last replica's sync). The :func:`line_through_ends` a + n / B is stored as the ring model's constants at
    d, as :func:`allreduce_probe` stores its own: ``dp_allreduce_latency_s`` = a / (2(d - 1)) per ring step
    and
    ``dp_allreduce_bandwidth_bytes_per_s`` = B x 2(d - 1) / d, so that
    :func:`stageplan.planning.sharding.ring_time` gives back a + n / B at d and scales it to another d.
    Also ``dp_allreduce_ranks`` (d), ``dp_allreduce_groups`` (the groups that ran at once, p),
    ``dp_allreduce_sizes`` and ``dp_allreduce_s`` (the slowest medians), ``dp_allreduce_probe_s`` (the
    probe's wall time on rank 0's clock). None with one replica."""
    import time

    import torch
    import torch.distributed as dist


    d = dist.get_world_size(dp_group)
    if d < 2:
        return None
    world = dist.get_world_size()
    sizes = [int(n) for n in sizes_bytes]
    began = time.perf_counter()
    # the barrier of the whole world: every group starts its all-reduce together
    medians = _allreduce_medians(torch.device(device), sizes, dp_group, None, warmup, repeats)
    took = time.perf_counter() - began
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, medians)
    slowest = [max(row[i] for row in gathered) for i in range(len(sizes))]
    return {**dp_allreduce_fields(sizes, slowest, d, world // d), "dp_allreduce_probe_s": took}


def _allreduce_medians(dev: Any, sizes: Sequence[int], group: Any, barrier_group: Any, warmup: int,
                       repeats: int) -> list[float]:
    """This rank's median seconds of an ``all_reduce`` of a float buffer of each size on ``group``, each
    round after a barrier of ``barrier_group`` (None: the whole world), timed until its result is there."""
    import time

    import torch
    import torch.distributed as dist

    from stageplan.measure import median_iqr

    medians = []
    for n in sizes:
        buf = torch.ones(max(n // 4, 1), dtype=torch.float32, device=dev)
        times = []
        for k in range(warmup + repeats):
            dist.barrier(group=barrier_group)
            start = time.perf_counter()
            dist.all_reduce(buf, group=group)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if k >= warmup:
                times.append(time.perf_counter() - start)
        medians.append(median_iqr(times)[0])
    return medians


def dp_allreduce_fields(sizes_bytes: Sequence[int], seconds: Sequence[float], ranks: int, groups: int
                        ) -> dict[str, Any]:
    """LINK.json's fields for the data-parallel all-reduce timed at ``seconds`` per size over ``ranks``
    replicas, ``groups`` groups at once: the :func:`line_through_ends` a + n / B as the ring's per-step
    latency a / (2(d - 1)) and per-link bandwidth B x 2(d - 1) / d (see :func:`dp_allreduce_probe`).

    >>> f = dp_allreduce_fields([4096, 2**24], [1e-4 + 4096 / 1e9, 1e-4 + 2**24 / 1e9], 2, 1)
    >>> round(f["dp_allreduce_latency_s"] * 1e6, 6), round(f["dp_allreduce_bandwidth_bytes_per_s"])
    (50.0, 1000000000)
    """
    # the latency from the smallest size and the bandwidth from the largest, as the ping-pong's fit: the sync
    # it prices sends a stage's whole gradients, megabytes at least, where a line weighting every size alike
    # lets the small sizes set the slope (gloo's times grow faster than linearly towards 16 MiB: 2.5 ms at 4
    # MiB, 11.5 ms at 16 MiB between two ranks of a 2-core CPU host)
    latency, bandwidth = ring_constants(*line_through_ends(sizes_bytes, seconds), ranks)
    return {"dp_allreduce_latency_s": latency, "dp_allreduce_bandwidth_bytes_per_s": bandwidth,
            "dp_allreduce_ranks": int(ranks), "dp_allreduce_groups": int(groups),
            "dp_allreduce_sizes": [int(n) for n in sizes_bytes],
            "dp_allreduce_s": [float(t) for t in seconds]}


# The sharding modes' own sync (:func:`dp_sync_probe`): torch's DDP, ZeRO-1 and FSDP2 code around the
# collective costs as much as the collective on gloo. Between two pinned CPU ranks (torch 2.13, medians of 9
# on a loaded 2-core host), 20.6 MiB of gradients: a bare all-reduce 20.8 ms, DDP's sync 56 ms; FSDP2's
# reduce (what PipelineStage.perform_reduce_grad runs) 45 ms over 8 units against a bare reduce-scatter of
# 33 ms, and its unshard 31 ms against a bare all-gather of 30 ms; at 4 MiB over 8 units FSDP2's reduce took
# 23 ms against 6 ms bare, a fixed cost per unit the ring model does not have. So the probe times each mode's
# own calls over a module of DP_SYNC_UNITS equal layers, at sizes from DP_SYNC_SIZES[0] (where the fixed costs
# show) to DP_SYNC_SIZES[-1] (past DDP's 25 MiB bucket, as a stage's gradients are).
DP_SYNC_SIZES = (64 * 2**10, 2**20, 16 * 2**20, 32 * 2**20)
DP_SYNC_UNITS = 4
# FSDP2's kinds timed once more at one size over more units: their fixed cost a unit where units hold MiBs, as
# a stage's layers do. Read from the smallest size alone the all-gather's was 0.5 ms a unit, where at 20.6 MiB
# 9 units took 33-38 ms against 27-29 ms for 4, 1-2 ms for each unit more (gloo, 2 replicas, a 2-core CPU
# host)
DP_SYNC_MANY_UNITS = 16
DP_SYNC_MANY_SIZE = 16 * 2**20
DP_SYNC_WARMUP = 2
DP_SYNC_REPEATS = 7
# What each kind times: DDP's backward with its sync less the same backward under no_sync (the whole
# all-reduce and DDP's work around it, nothing overlapped: the probe's backward is a fill);
# ZeroRedundancyOptimizer's broadcast of the stepped partitions (_sync_params, what a run's sync clock
# times); FSDP2's reduce of the accumulated gradients after the last microbatch, as torch's
# PipelineStage.perform_reduce_grad runs it; FSDP2's unshard (all-gather) of every unit before a step's first
# forward.
# the kinds whose fixed cost is paid once per FSDP2 unit (each fully_shard call's parameter group issues
# its own collective), not once per stage
DP_SYNC_PER_UNIT = ("fsdp_reduce", "fsdp_gather")


def dp_sync_probe(device: Any, mesh: Any, *, sizes_bytes: Sequence[int] = DP_SYNC_SIZES,
                  units: int = DP_SYNC_UNITS, warmup: int = DP_SYNC_WARMUP, repeats: int = DP_SYNC_REPEATS,
                  many_units: int = DP_SYNC_MANY_UNITS, many_size: int = DP_SYNC_MANY_SIZE
                  ) -> dict[str, Any] | None:
    """Time each sharding mode's own data-parallel sync (:data:`DP_SYNC_KINDS`) on the replicas of ``mesh``
    (:class:`stageplan.running.replicas.Mesh`): a module of ``units`` equal layers holding ``n`` bytes of fp32
    weights in all, per size, wrapped as a run wraps a stage. Every stage's replicas probe at once, each round
    after a barrier of the whole world; the median per rank, kind and size, the slowest rank's per kind and
    size (the step waits for the last replica). FSDP2's kinds once more at ``many_size`` over ``many_units``
    layers (skipped where ``many_size`` is not one of the sizes). Stored as :func:`dp_sync_fields`. None with
    one replica."""
    import time

    import torch
    import torch.distributed as dist

    from stageplan.measure import median_iqr

    d = int(mesh.data_parallel)
    if d < 2:
        return None
    dev = torch.device(device)
    sizes = [int(n) for n in sizes_bytes]
    began = time.perf_counter()
    medians: dict[str, list[float]] = {}

    def timed(call: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        call()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - start

    for n in sizes:
        for kind, seconds in _dp_sync_rounds(dev, mesh, n, units, warmup + repeats, timed).items():
            medians.setdefault(kind, []).append(median_iqr(seconds[warmup:])[0])
    many: dict[str, float] = {}
    if many_size in sizes and many_units > units:
        for kind, seconds in _dp_sync_rounds(dev, mesh, many_size, many_units, warmup + repeats, timed,
                                             fsdp_only=True).items():
            many[kind] = median_iqr(seconds[warmup:])[0]
    took = time.perf_counter() - began
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (medians, many))
    slowest = {k: [max(row[0][k][i] for row in gathered) for i in range(len(sizes))] for k in medians}
    slowest_many = {k: max(row[1][k] for row in gathered) for k in many}
    more = (many_units, many_size, slowest_many) if slowest_many else None
    return {**dp_sync_fields(sizes, slowest, d, units, more), "dp_sync_probe_s": took}


def _sync_module(n: int, units: int, device: Any) -> Any:
    """``units`` bias-free linear layers of 256 inputs holding ``n`` bytes of fp32 weights in all (at least
    one row each), whose forward is a weighted sum of the weights: its backward fills the gradients and does
    nothing else, so a sync timed around it is the sync."""
    import torch

    rows = max(n // 4 // units // 256, 1)

    class Units(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(256, rows, bias=False, device=device)
                                              for _ in range(units))

        def forward(self, x: Any) -> Any:
            return sum((layer.weight * x).sum() for layer in self.layers)

    return Units()


def _dp_sync_rounds(dev: Any, mesh: Any, n: int, units: int, rounds: int, timed: Any, fsdp_only: bool = False
                    ) -> dict[str, list[float]]:
    """Seconds of every round of each kind at ``n`` bytes (see :data:`DP_SYNC_KINDS`; FSDP2's alone with
    ``fsdp_only``); ``timed(call)`` runs ``call`` after a barrier of the world and returns its seconds."""
    import types

    import torch
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from stageplan.running.replicas import fsdp_units, wrap_stage

    x = torch.ones((), device=dev)
    names = [f"layers.{i}" for i in range(units)]
    reduce = getattr(_PipelineStageBase, "perform_reduce_grad", None)
    # torch before the schedule ran FSDP2's reduce itself (perform_reduce_grad) reduces inside the last
    # backward, a path this probe does not time: those links price fsdp from the all-reduce
    out: dict[str, list[float]] = {k: [] for k in DP_SYNC_KINDS if reduce is not None or k.startswith(
        ("ddp", "zero1"))}
    if fsdp_only:
        out = {k: v for k, v in out.items() if k in DP_SYNC_PER_UNIT}
    else:
        _ddp_and_zero1_rounds(_sync_module(n, units, dev), names, x, mesh, rounds, timed, out)
    if reduce is None:
        return out
    # FSDP2, as a run wraps a stage: every layer a unit, then the root, not resharded after forward
    fsdp: Any = wrap_stage(_sync_module(n, units, dev), names, "fsdp", mesh)
    unit_modules = fsdp_units(fsdp)
    # torch's own reduce, called as the schedule calls it: it reads only the stage's module
    # (torch/distributed/pipelining/stage.py, perform_reduce_grad)
    stage = types.SimpleNamespace(submod=fsdp)
    for _ in range(rounds):
        out["fsdp_gather"].append(timed(lambda: [m.unshard() for m in unit_modules]))
        fsdp.set_requires_gradient_sync(False)
        fsdp.set_reshard_after_backward(False)
        fsdp(x).backward()
        out["fsdp_reduce"].append(timed(lambda: reduce(stage, 1)))
        for p in fsdp.parameters():
            p.grad = None
    return out


def _ddp_and_zero1_rounds(module: Any, names: list[str], x: Any, mesh: Any, rounds: int, timed: Any,
                          out: dict[str, list[float]]) -> None:
    """DDP's and ZeRO-1's rounds of :func:`_dp_sync_rounds` on ``module`` (its units ``names``), into
    ``out``."""
    from stageplan.running.replicas import make_replica_optimizer, wrap_stage

    # DDP, as a run wraps a stage (gradients as views into its buckets, zeroed in place)
    ddp: Any = wrap_stage(module, names, "ddp", mesh)
    apart, synced = [], []
    for _ in range(rounds):
        ddp.zero_grad(set_to_none=False)
        with ddp.no_sync():
            apart.append(timed(lambda: ddp(x).backward()))
        synced.append(timed(lambda: ddp(x).backward()))
    out["ddp"] = [max(0.0, s - a) for s, a in zip(synced, apart)]
    # ZeRO-1's broadcast, with each replica's partition in one bucket as a run builds it
    zero = make_replica_optimizer("sgd", list(ddp.parameters()), 0.0, "zero1", mesh)
    out["zero1_broadcast"] = [timed(zero._sync_params) for _ in range(rounds)]  # type: ignore[union-attr]


def dp_sync_fields(sizes_bytes: Sequence[int], seconds: Mapping[str, Sequence[float]], ranks: int, units: int,
                   many: tuple[int, int, Mapping[str, float]] | None = None) -> dict[str, Any]:
    """LINK.json's fields for the sharding modes' sync timed at ``seconds[kind]`` per size over ``ranks``
    replicas on a module of ``units`` layers: per kind, the :func:`line_through_ends` a + n / B as
    ``dp_sync_fit[kind] = [fixed_s, bytes_per_s]``, the fixed cost per FSDP2 unit for the kinds of
    :data:`DP_SYNC_PER_UNIT`, per stage for the others; and the sizes and times it was fitted to.

    An FSDP2 unit's fixed cost is a / units, or, with ``many`` = (more units, one of the sizes, seconds per
    kind there), what each unit past ``units`` added at that size, where it added anything: the units a run's
    stage holds are MiBs, not the smallest size's KiBs.

    >>> sizes = [2**16, 2**25]
    >>> f = dp_sync_fields(sizes, {k: [4e-3 + n / 1e9 for n in sizes] for k in DP_SYNC_KINDS}, 2, 4)
    >>> [(round(a * 1e3, 6), round(b)) for a, b in (f["dp_sync_fit"]["ddp"], f["dp_sync_fit"]["fsdp_gather"])]
    [(4.0, 1000000000), (1.0, 1000000000)]
    >>> f = dp_sync_fields(sizes, {k: [4e-3 + n / 1e9 for n in sizes] for k in DP_SYNC_KINDS}, 2, 4,
    ...                    (16, 2**25, {"fsdp_gather": 4e-3 + 2**25 / 1e9 + 12 * 2e-3}))
    >>> [round(f["dp_sync_fit"][k][0] * 1e3, 6) for k in ("fsdp_gather", "fsdp_reduce")]
    [2.0, 1.0]
    """
    fits = {}
    for kind in (k for k in DP_SYNC_KINDS if k in seconds):
        fixed, rate = line_through_ends(sizes_bytes, seconds[kind])
        if kind in DP_SYNC_PER_UNIT:
            fixed /= units
            if many is not None and kind in many[2] and many[0] > units and many[1] in sizes_bytes:
                added = (many[2][kind] - seconds[kind][list(sizes_bytes).index(many[1])]) / (many[0] - units)
                fixed = added if added > 0 else fixed
        fits[kind] = [fixed, rate]
    out = {"dp_sync_ranks": int(ranks), "dp_sync_units": int(units),
           "dp_sync_sizes": [int(n) for n in sizes_bytes],
           "dp_sync_s": {k: [float(t) for t in seconds[k]] for k in fits}, "dp_sync_fit": fits}
    if many is not None:
        out.update(dp_sync_many_units=int(many[0]), dp_sync_many_size=int(many[1]),
                   dp_sync_many_s={k: float(t) for k, t in many[2].items()})
    return out


def schedule_overheads(device: Any, *, group: Any = None, microbatches: int = ACTION_MICROBATCHES,
                       warmup: int = ACTION_WARMUP, steps: int = ACTION_STEPS,
                       evict_bytes: int = ACTION_EVICT_BYTES) -> dict[str, float] | None:
    """What torch's pipelining costs around a chunk's own layers, on a rank that does not wait, from
    ``ScheduleGPipe`` over a 16-float linear layer per rank whose forward and backward each write
    ``evict_bytes`` (every rank of ``group`` calls it; every rank gets the result), medians over the timed
    steps:

    - ``action_s``: the gap between one chunk call and the next, over the first rank's forwards and the last
      rank's backwards. Between two such calls torch's loop builds the P2P ops, posts the send
      (``_batch_p2p``), leaves one ``record_function`` and enters the next, its code and data cold after the
      chunk. 0.2-0.4 ms between chunk calls were traced in real runs on a 2-core CPU host: 54-85 us of
      ``record_function``, 57-110 us posting a send, 12 us per list of ops built.
    - ``chunk_forward_s`` and ``chunk_backward_s``: each chunk call's time outside its module, over every
      rank's forwards and backwards: PipelineStage's own code (retrieving and detaching the received inputs,
      flattening and checking the outputs, keeping them for the backward) and, in the backward, the autograd
      engine's start and end around the module's gradients (cold after a chunk, where a layer profiled alone
      starts it hot). The chunk timers of a run see these inside the chunk's forward and backward.

    Measured on GPipe's loop, priced once per forward and once per backward of every schedule (a zero-bubble
    backward's I and W share them). None on a single rank (no pipeline) and off the CPU, where the host's loop
    runs ahead of the device's queued kernels."""
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dev = torch.device(device)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world < 2 or dev.type != "cpu":
        return None
    spans: list[float] = []  # the module's own stamps, in order: forward begin/end, backward begin and ends
    with torch.random.fork_rng(devices=[]):  # the caller's random stream stays where it was
        torch.manual_seed(0)
        module = _streaming_layer(evict_bytes, spans).to(dev)
        stage = PipelineStage(module, rank, world, dev, group=group)
        x = torch.randn(microbatches, 16, device=dev)
    stamps: list[tuple[str, int, float, float, list[float]]] = []

    def timed(kind: str, call: Any) -> Any:
        def chunk_call(chunk: int, *a: Any, **k: Any) -> Any:
            spans.clear()
            t0 = time.perf_counter()
            try:
                return call(chunk, *a, **k)
            finally:
                stamps.append((kind, chunk, t0, time.perf_counter(), list(spans)))
        return chunk_call

    stage.forward_one_chunk = timed("F", stage.forward_one_chunk)  # type: ignore[method-assign]
    stage.backward_one_chunk = timed("B", stage.backward_one_chunk)  # type: ignore[method-assign]
    schedule = ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=lambda out, target: out.sum())
    gaps: list[float] = []
    outside: dict[str, list[float]] = {"F": [], "B": []}
    for step in range(warmup + steps):
        stamps.clear()
        if rank == 0:
            schedule.step(x, return_outputs=False)
        elif rank == world - 1:
            schedule.step(target=torch.zeros(microbatches, 16, device=dev), losses=[], return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        if step < warmup:
            continue
        mine = "F" if rank == 0 else "B" if rank == world - 1 else None
        calls = sorted((t0, t1) for kind, _, t0, t1, _ in stamps if kind == mine)
        gaps += [calls[i + 1][0] - calls[i][1] for i in range(len(calls) - 1)]
        for kind, _, t0, t1, inner in stamps:
            if len(inner) >= 2:  # the module's first and last stamp inside this call
                outside[kind].append(max((t1 - t0) - (max(inner) - min(inner)), 0.0))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (gaps, outside), group=group)
    from stageplan.measure import median_iqr

    every = [g for rows, _ in gathered for g in rows]
    out: dict[str, float] = {}
    if every:
        out["action_s"] = median_iqr(every)[0]
    for kind, key in (("F", "chunk_forward_s"), ("B", "chunk_backward_s")):
        rows = [t for _, by_kind in gathered for t in by_kind[kind]]
        if rows:
            out[key] = median_iqr(rows)[0]
    return out or None


def _streaming_layer(evict_bytes: int, spans: list[float] | None = None) -> Any:
    """The probe's layer: a 16-float linear layer whose forward and backward each write ``evict_bytes``. With
    ``spans``, it appends perf_counter stamps: its forward's begin and end, its backward's begin (the last op
    of the forward is the first of the backward) and the moment each gradient it makes is ready (its input's,
    where the input needs one, and its parameters' once accumulated), as LayerClock stamps a layer."""
    import time

    import torch

    def stamp() -> None:
        if spans is not None:
            spans.append(time.perf_counter())

    class Stream(torch.autograd.Function):
        """Identity that writes the module's buffer in its forward and in its backward."""

        @staticmethod
        def forward(ctx: Any, x: Any, buf: Any) -> Any:
            buf.fill_(1)
            ctx.buf = buf
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            stamp()
            ctx.buf.fill_(2)
            return grad.clone(), None

    class Streaming(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)
            self.register_buffer("stream", torch.zeros(max(int(evict_bytes), 1), dtype=torch.uint8),
                                 persistent=False)
            for p in self.linear.parameters():
                p.register_post_accumulate_grad_hook(lambda _: stamp())

        def forward(self, x: Any) -> Any:
            stamp()
            if x.requires_grad:
                x.register_hook(lambda _: stamp())
            out = Stream.apply(self.linear(x), self.stream)
            stamp()
            return out

    return Streaming()


def _round_trip(buf: Any, peer: int, first: bool, group: Any) -> None:
    """One message there and back: the lower rank sends
    first, its peer echoes; on CUDA, until it has landed."""
    import torch
    import torch.distributed as dist

    if first:
        dist.send(buf, peer, group=group)
        dist.recv(buf, peer, group=group)
    else:
        dist.recv(buf, peer, group=group)
        dist.send(buf, peer, group=group)
    if buf.device.type == "cuda":
        torch.cuda.synchronize(buf.device)


def _compute_gap(matrix: Any) -> None:
    """The rank's own work before a timed message (:data:`GAP_MATMULS`)."""
    import torch

    for _ in range(GAP_MATMULS):
        torch.mm(matrix, matrix)


def _exchange(out_buf: Any, in_buf: Any, peer: int, group: Any) -> None:
    """One crossing as torch's schedules make it: a send and a receive posted together, both waited for."""
    import torch
    import torch.distributed as dist

    ops = [dist.P2POp(dist.isend, out_buf, peer, group), dist.P2POp(dist.irecv, in_buf, peer, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if out_buf.device.type == "cuda":
        torch.cuda.synchronize(out_buf.device)
