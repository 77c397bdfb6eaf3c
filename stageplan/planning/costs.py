"""Profile + options -> the solver's inputs, and one
evaluate(layers, boundaries, options) -> evidence (no torch).

Units: seconds, bytes, bytes/second. Sources are named next to each formula. Each formula lives in one place:
the stage time in ``layer_time``/``comm_time``, the stage memory in ``memory_terms`` (the solver's rows and
the per-stage evidence both sum them), the in-flight counts in ``schedules.schedule_shape``, the lower bound
in
``solver.lower_bound``, and the simulator's boundary delays in ``schedules.one_way_delays``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from stageplan.errors import StageplanError
from stageplan.formats.link import ring_fit
from stageplan.formats.plan import Evidence, StagePlan
from stageplan.formats.profile import Profile
from stageplan.formats.schedule import normalize_schedule
from stageplan.planning.schedules import ScheduleShape, one_way_delays, schedule_shape, simulate_shape
from stageplan.planning.sharding import (
    OPTIMIZER_STATES,
    PRECISIONS,
    bytes_per_param,
    check_sharding,
    data_parallel_sync,
)
from stageplan.planning.solver import lower_bound
from stageplan.units import format_bytes

# Optimizer state held per parameter byte (states kept in the parameters' dtype):
# sgd keeps nothing; SGD with momentum keeps one buffer; Adam/AdamW keep exp_avg and exp_avg_sq.
OPTIMIZER_STATE_FACTOR: dict[str, float] = {k: float(v) for k, v in OPTIMIZER_STATES.items()}
# Gradients: one per parameter byte, except with optimizer "none" (inference-like: no grads kept).
GRAD_FACTOR: dict[str, float] = {"none": 0.0, "sgd": 1.0, "momentum": 1.0, "adam": 1.0, "adamw": 1.0}


@dataclass(frozen=True)
class Device:
    """One pipeline rank's device: ``speed`` relative to the profiled device (2.0 = twice as fast) and its
    memory limit in bytes (None = unlimited)."""

    speed: float = 1.0
    memory_limit_bytes: float | None = None
    name: str = ""


@dataclass(frozen=True)
class CostOptions:
    """Everything the cost model needs besides the profile."""

    num_ranks: int
    num_microbatches: int
    schedule: str = "1F1B"
    virtual_stages: int = 1
    optimizer: str = "adam"
    bandwidth_bytes_per_s: float | None = None
    devices: tuple[Device, ...] = ()
    recompute: bool = False
    # fixed delay per boundary crossing (calibrate's fit, or stageplan link's)
    boundary_latency_s: float = 0.0
    precision: str | None = None  # a key of PRECISIONS, or None: memory in the profiled parameters' bytes
    # where boundary_latency_s came from (said in the note)
    latency_source: str = "fitted by calibrate from a run"
    # the measured link's one-way latency: the per-message latency of collectives (the tied all-reduce), where
    # the per-crossing boundary_latency_s may be calibrate's catch-all for every wait the model does not have
    link_latency_s: float = 0.0
    # torch's schedule's own seconds per chunk action outside the chunk (its loop: record_function, building
    # and posting the P2P ops), as the link probe measured it (link.action_overhead); every forward and every
    # backward of every chunk pays it on its rank
    action_s: float = 0.0
    # PipelineStage's own seconds inside each chunk call, outside the chunk's layers (receiving and detaching
    # its inputs, checking and keeping its outputs; in the backward the autograd engine's cold start and end),
    # as the link probe measured them (link.schedule_overheads): added to every chunk's forward and backward,
    # where a run's chunk timers see them
    chunk_forward_s: float = 0.0
    chunk_backward_s: float = 0.0
    # the ring model's constants for the all-reduce, where the link probe timed the collective itself
    # (link.allreduce_probe): per-step latency and per-link bandwidth; None prices it from the point-to-point
    # link
    allreduce_latency_s: float | None = None
    allreduce_bandwidth_bytes_per_s: float | None = None
    # Data parallelism around the pipeline (planning.sharding): d replicas of every stage, what each holds
    # (ddp, zero1, fsdp), the dtype its gradients are reduced in, and the replicas' link (per GPU, one way);
    # d = 1 is one pipeline, as before.
    data_parallel: int = 1
    sharding: str = "ddp"
    grad_dtype: str = "param"
    dp_bandwidth_bytes_per_s: float | None = None
    dp_latency_s: float = 0.0
    # each sharding mode's own sync as the link timed it at this d (stageplan link --data-parallel D:
    # (kind, fixed_s, bytes_per_s) of formats.link.DP_SYNC_KINDS); a kind it lacks is priced by the ring
    dp_sync_fit: tuple[tuple[str, float, float], ...] = ()
    # The schedule's orders, chunk->rank map and in-flight counts, derived once (make_options validates).
    shape: ScheduleShape = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.shape is None:
            object.__setattr__(self, "shape", schedule_shape(self.schedule, self.num_ranks,
                                                             self.num_microbatches, self.virtual_stages))

    @property
    def num_chunks(self) -> int:
        """p * v: the number of contiguous layer runs; equals num_ranks without interleaving."""
        return self.num_ranks * self.virtual_stages

    def to_json(self) -> dict[str, Any]:
        # field by field: asdict() would deep-copy the schedule
        # shape (every action of the step) only to drop it
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "shape"}
        d["devices"] = [asdict(x) for x in self.devices]
        d["dp_sync_fit"] = [list(row) for row in self.dp_sync_fit]  # as JSON reads it back
        return d


# A device's speed relative to the profiled one lies in [MIN_SPEED, 1 / MIN_SPEED]: beyond that it is a typo,
# and the times it divides overflow to inf
MIN_SPEED = 1e-6


# The simulator's timeline holds every forward and backward of a step, about 50 us and 2.5 KB a pair on one
# CPU core, so a million pairs take minutes and GB to plan; a step larger than that is refused with the most
# microbatches its stages take (a typo such as --microbatches 100000000 would run for hours).
MAX_STEP_PAIRS = 1_000_000


def check_ranks(num_ranks: object) -> None:
    """The pipeline's rank count, as plan, compare and tune refuse it."""
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise StageplanError(f"num_ranks must be an integer >= 1, got {num_ranks!r}; e.g. --stages 2")


def make_options(profile: Profile, num_ranks: int, *, num_microbatches: int, schedule: str = "1F1B",
                 virtual_stages: int = 1, optimizer: str = "adam", bandwidth_bytes_per_s: float | None = None,
                 devices: Sequence[Device] | None = None, memory_limit_bytes: float | None = None,
                 recompute: bool = False, boundary_latency_s: float = 0.0, precision: str | None = None,
                 latency_source: str = "fitted by calibrate from a run", link_latency_s: float = 0.0,
                 action_s: float = 0.0, chunk_forward_s: float = 0.0, chunk_backward_s: float = 0.0,
                 allreduce_latency_s: float | None = None,
                 allreduce_bandwidth_bytes_per_s: float | None = None, data_parallel: int = 1,
                 sharding: str = "ddp", grad_dtype: str = "param",
                 dp_bandwidth_bytes_per_s: float | None = None, dp_latency_s: float = 0.0,
                 dp_sync_fit: Mapping[str, Sequence[float]] | Sequence[Sequence[Any]] | None = None,
                 shape: ScheduleShape | None = None) -> CostOptions:
    """Validate and assemble CostOptions; every refusal names the rule, the values and the remedy. ``shape``
    (``schedules.counts_shape``, for memory and loads only) replaces the full schedule shape."""
    if len(profile) == 0:
        raise StageplanError(
            "the profile has no layers; profile a model first (stageplan profile MODEL -o PROFILE.json)")
    check_ranks(num_ranks)
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise StageplanError(
            f"num_microbatches must be an integer >= 1, got {num_microbatches!r}; e.g. --microbatches 8")
    name = normalize_schedule(schedule)
    if virtual_stages < 1:
        raise StageplanError(
            f"virtual_stages must be >= 1, got {virtual_stages}; use 1, or 2+ with Interleaved1F1B")
    if name == "Interleaved1F1B" and virtual_stages == 1:
        virtual_stages = 2  # torch's interleaving needs chunks to interleave; 2 is Megatron's usual choice
    if name in ("GPipe", "1F1B") and virtual_stages != 1:  # refuse it as torch would, before counting layers
        schedule_shape(name, num_ranks, num_microbatches, virtual_stages)
    pairs = num_microbatches * num_ranks * virtual_stages
    if pairs > MAX_STEP_PAIRS:
        # a multiple of the ranks, which every schedule takes (Interleaved1F1B's rounds must divide m)
        most = max(1, MAX_STEP_PAIRS // (num_ranks * virtual_stages) // num_ranks * num_ranks)
        bubble = (num_ranks - 1) / (most + num_ranks - 1)
        raise StageplanError(
            f"a step's timeline is at most {MAX_STEP_PAIRS:,} forward/backward pairs (microbatches x "
            f"stages), got {num_microbatches:,} x {num_ranks * virtual_stages} = {pairs:,}; use "
            f"--microbatches {most} or fewer (the bubble there is already {bubble:.1e} of the step)"
        )
    L, S = len(profile), num_ranks * virtual_stages
    if S > L:
        if virtual_stages > 1:
            raise StageplanError(
                f"{name} with {num_ranks} ranks x {virtual_stages} virtual stages needs at least {S} layers, "
                f"the profile has {L}; "
                "lower --virtual-stages or --stages, or profile at a finer granularity"
            )
        raise StageplanError(
            f"num_ranks ({num_ranks}) exceeds the number of layers ({L}), one stage a rank; use --stages {L} "
            "or fewer, or profile at a finer granularity"
        )
    if shape is None or (shape.schedule, shape.num_ranks, shape.num_microbatches, shape.virtual_stages) != (
            name, num_ranks, num_microbatches, virtual_stages):
        shape = schedule_shape(name, num_ranks, num_microbatches, virtual_stages)
    opt = optimizer.lower()
    if opt not in OPTIMIZER_STATE_FACTOR:
        raise StageplanError(
            f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATE_FACTOR)}")
    if bandwidth_bytes_per_s is not None and (not math.isfinite(bandwidth_bytes_per_s)
                                              or bandwidth_bytes_per_s <= 0):
        raise StageplanError(f"bandwidth must be a positive number of bytes/s, got "
                             f"{bandwidth_bytes_per_s!r}; e.g. --bandwidth 25GB/s")
    if memory_limit_bytes is not None and (not math.isfinite(memory_limit_bytes) or memory_limit_bytes <= 0):
        raise StageplanError(f"memory limit must be a positive number of bytes, got {memory_limit_bytes!r}; "
                             f"e.g. --memory-limit 40GiB")
    if devices:
        devs = tuple(devices)
        if len(devs) != num_ranks:
            raise StageplanError(
                f"got {len(devs)} device entries for {num_ranks} ranks; give one speed per rank, not per "
                f"chunk (e.g. --device-speeds {','.join(['1'] * num_ranks)})"
            )
        for i, d in enumerate(devs):
            if not (math.isfinite(d.speed) and MIN_SPEED <= d.speed <= 1 / MIN_SPEED):
                raise StageplanError(f"device {i} speed must be between {MIN_SPEED:g} and {1 / MIN_SPEED:g}, "
                                     f"got {d.speed!r}; speeds are relative to the profiled device (2 = "
                                     f"twice as fast)")
        if memory_limit_bytes is not None:
            devs = tuple(Device(d.speed, d.memory_limit_bytes if d.memory_limit_bytes is not None
                                else memory_limit_bytes, d.name)
                         for d in devs)
    else:
        devs = tuple(Device(1.0, memory_limit_bytes) for _ in range(num_ranks))
    if not (math.isfinite(boundary_latency_s) and boundary_latency_s >= 0):
        raise StageplanError(
            f"boundary latency must be >= 0 seconds, got {boundary_latency_s!r}; recalibrate the profile")
    if precision is not None and precision not in PRECISIONS:
        raise StageplanError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    for what, value in (("the schedule's time per action", action_s),
                        ("a chunk's forward overhead", chunk_forward_s),
                        ("a chunk's backward overhead", chunk_backward_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                                  and value >= 0):
            raise StageplanError(f"{what} must be >= 0 seconds, got {value!r}; measure the link again "
                                 "(stageplan link -o LINK.json)")
    from stageplan.formats.link import check_allreduce

    check_allreduce({"allreduce_latency_s": allreduce_latency_s,
                     "allreduce_bandwidth_bytes_per_s": allreduce_bandwidth_bytes_per_s}, "the cost options",
                    "give both from a measured link (stageplan link -o LINK.json), or neither")
    ar = (None, None) if allreduce_latency_s is None else (float(allreduce_latency_s),
                                                            float(allreduce_bandwidth_bytes_per_s))  # type: ignore[arg-type]
    _check_data_parallel(data_parallel, sharding, grad_dtype, precision, dp_bandwidth_bytes_per_s,
                         dp_latency_s)
    sync_fit = _sync_fit(dp_sync_fit, int(data_parallel))
    return CostOptions(num_ranks, num_microbatches, name, virtual_stages, opt, bandwidth_bytes_per_s, devs,
                       bool(recompute),
                       float(boundary_latency_s), precision, latency_source, float(link_latency_s),
                       float(action_s), float(chunk_forward_s), float(chunk_backward_s), ar[0], ar[1],
                       int(data_parallel), sharding, grad_dtype, dp_bandwidth_bytes_per_s,
                       float(dp_latency_s), sync_fit, shape=shape)


def _sync_fit(fits: Mapping[str, Sequence[float]] | Sequence[Sequence[Any]] | None, data_parallel: int
              ) -> tuple[tuple[str, float, float], ...]:
    """The sharding modes' measured sync as CostOptions holds it, from a kind -> (fixed_s, bytes_per_s)
    mapping or the (kind, fixed_s, bytes_per_s) rows a plan's JSON keeps; checked as a LINK.json's are."""
    if not fits:
        return ()
    from stageplan.formats.link import check_dp_sync

    as_map = dict(fits) if isinstance(fits, Mapping) else {
        row[0]: list(row[1:]) for row in fits if isinstance(row, (list, tuple)) and len(row) == 3}
    check_dp_sync({"dp_sync_fit": as_map, "dp_sync_ranks": max(data_parallel, 2), "dp_sync_units": 1},
                  "the cost options")
    if not isinstance(fits, Mapping) and len(as_map) != len(fits):
        raise StageplanError(f"the cost options have dp_sync_fit = {fits!r}; it must be rows of (kind, "
                             "fixed seconds, bytes/s); measure it again with stageplan link "
                             "--data-parallel D")
    return tuple((k, float(v[0]), float(v[1])) for k, v in sorted(as_map.items()))


def _check_data_parallel(data_parallel: object, sharding: str, grad_dtype: str, precision: str | None,
                         bandwidth: float | None, latency_s: float) -> None:
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise StageplanError(f"data_parallel must be an integer >= 1, got {data_parallel!r}; e.g. 2 replicas")
    if sharding != "ddp" or grad_dtype != "param":  # the defaults need no check (one module fewer per plan)
        check_sharding(sharding, grad_dtype)
    if (sharding != "ddp" or grad_dtype != "param") and precision is None:
        raise StageplanError(f"sharding {sharding!r} with gradients in {grad_dtype!r} needs a precision to "
                             "count bytes per parameter; give one, e.g. --precision bf16-mixed")
    if bandwidth is not None and not (math.isfinite(bandwidth) and bandwidth > 0):
        raise StageplanError(f"the data-parallel bandwidth must be a positive number of bytes/s, got "
                             f"{bandwidth!r}; e.g. 50GB/s")
    if not (math.isfinite(latency_s) and latency_s >= 0):
        raise StageplanError(f"the data-parallel latency must be >= 0 seconds, got {latency_s!r}")


@dataclass(frozen=True)
class LayerArrays:
    forward_s: np.ndarray
    backward_s: np.ndarray
    activation_bytes: np.ndarray
    output_bytes: np.ndarray
    param_bytes: np.ndarray
    param_count: np.ndarray
    # per optimizer ("sgd", "momentum", "adam", "adamw"): seconds of one optimizer step per layer; NaN where
    # the profile did not measure it (profiles written before it was measured)
    optimizer_s: dict[str, np.ndarray] = field(default_factory=dict)
    # per optimizer: the fixed seconds of one step (profile meta optimizer_step.floor_s), which each layer's
    # optimizer_s carries and a rank pays once; absent in profiles written before it was measured, and
    # estimates
    optimizer_floor_s: dict[str, float] = field(default_factory=dict)
    # the tied parameters two or more layers share (Profile.tied): each one's layers, and its bytes
    tied_layers: tuple[tuple[int, ...], ...] = ()
    tied_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @classmethod
    def of(cls, profile: Profile, num_microbatches: int = 1) -> LayerArrays:
        """Per-layer arrays; backward_s is the mean over a step of ``num_microbatches``: the first backward
        into empty grads, the others accumulating into them (measured separately by the profiler)."""
        arr = {k: np.array([getattr(x, k) for x in profile.layers], dtype=float)
               for k in ("forward_s", "activation_bytes", "output_bytes", "param_bytes")}
        arr["backward_s"] = np.array([x.backward_per_microbatch_s(num_microbatches) for x in profile.layers],
                                     dtype=float)
        # older profiles may lack counts: derive them from the bytes and the profiled dtype
        elem = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}.get(
            str(profile.meta.get("dtype", "float32")), 4)
        arr["param_count"] = np.array([x.param_count or x.param_bytes / elem for x in profile.layers],
                                      dtype=float)
        for k, a in arr.items():
            bad = np.flatnonzero(~np.isfinite(a) | (a < 0))
            if bad.size:
                i = int(bad[0])
                raise StageplanError(
                    f"layer {i} ({profile.layers[i].name!r}) has {k} = {a[i]}; costs must be finite and >= "
                    f"0; re-profile the model"
                )
        optimizer = {name: np.array([math.nan if x.optimizer_s is None else x.optimizer_s.get(name, math.nan)
                                     for x in profile.layers], dtype=float)
                     for name in OPTIMIZER_STATE_FACTOR if name != "none"}
        ties = [t for t in profile.tied if len(t.layers) > 1]  # a tie inside one layer never crosses ranks
        floors = (profile.meta.get("optimizer_step") or {}).get("floor_s") or {}
        floor = {str(k): float(v) for k,
                 v in floors.items() if isinstance(v, (int, float)) and math.isfinite(v) and v >= 0}
        return cls(**arr, optimizer_s=optimizer, optimizer_floor_s=floor,
                   tied_layers=tuple(t.layers for t in ties),
                   tied_bytes=np.array([t.bytes for t in ties], dtype=float))


def optimizer_time(arr: LayerArrays, opts: CostOptions) -> np.ndarray:
    """Seconds of one optimizer step (``opts.optimizer``) per layer on the profiled device, as the profiler
    measured it (the step over the layer's parameters with gradients present; memory-bound, so it does not
    depend on the microbatch). 0 for optimizer "none", and 0 where the profile lacks it
    (``optimizer_measured`` says so). Paid once per step per rank, after its last backward: it adds to the
    step, never to the per-microbatch stage time the solver balances. Each layer's figure is net of the step's
    fixed cost (:func:`optimizer_floor`), which a rank pays once for all its layers."""
    times = arr.optimizer_s.get(opts.optimizer)
    if times is None:
        return np.zeros_like(arr.forward_s)
    times = np.nan_to_num(times, nan=0.0)
    return np.where(times > 0, np.maximum(times - optimizer_floor(arr, opts), 0.0), 0.0)


def optimizer_floor(arr: LayerArrays, opts: CostOptions) -> float:
    """Seconds of one optimizer step's fixed cost on the profiled device (the profiler's flushed step over one
    tiny parameter), paid once per rank whose layers have any parameter to step; 0 where the profile lacks
    it."""
    if opts.optimizer == "none":
        return 0.0
    return float(arr.optimizer_floor_s.get(opts.optimizer, 0.0))


def trained_mask(arr: LayerArrays, opts: CostOptions) -> np.ndarray:
    """Per layer, 1.0 where its optimizer step was measured above 0 (it has parameters to step)."""
    times = arr.optimizer_s.get(opts.optimizer)
    if times is None or opts.optimizer == "none":
        return np.zeros_like(arr.forward_s)
    return (np.nan_to_num(times, nan=0.0) > 0).astype(float)


def optimizer_measured(arr: LayerArrays, opts: CostOptions) -> bool:
    """False when the optimizer step counts but the profile did not measure it for some layer."""
    if opts.optimizer == "none":
        return True
    times = arr.optimizer_s.get(opts.optimizer)
    return times is not None and bool(np.all(np.isfinite(times)))


def layer_time(arr: LayerArrays, opts: CostOptions) -> np.ndarray:
    """Seconds per microbatch per layer on the profiled device: forward + backward; with recomputation the
    forward runs again inside the backward (Chen et al. 2016), so it is paid twice."""
    return arr.forward_s * (2.0 if opts.recompute else 1.0) + arr.backward_s


def comm_time(arr: LayerArrays, opts: CostOptions) -> np.ndarray:
    """Seconds one crossing of the boundary after each layer costs, one way: output_bytes / bandwidth
    (0 with no bandwidth). A stage is charged both directions (the activation out, its gradient back).

    The calibrated per-crossing latency (``boundary_latency_s``) is not part of this: it is the same at every
    boundary, so it cannot change which split is best, and charging it to one side of each boundary would bias
    the split. It delays the simulated step only (see ``one_way_delays``)."""
    if opts.bandwidth_bytes_per_s is None:
        return np.zeros_like(arr.output_bytes)
    return arr.output_bytes / opts.bandwidth_bytes_per_s


def ring_allreduce_time(nbytes: np.ndarray, opts: CostOptions, ranks: int | np.ndarray | None = None
                        ) -> np.ndarray:
    """Seconds of one all-reduce of ``nbytes`` over ``ranks`` ranks k (None: all p; an array broadcasts
    against ``nbytes``), as gloo and NCCL run it on a ring (Patarasuk and Yuan 2009): each rank sends and
    receives 2(k-1)/k of the buffer in 2(k-1) steps, each paying the per-message latency, so 2(k-1)/k x
    bytes / bandwidth + 2(k-1) x latency (the measured link's one-way latency, ``link_latency_s``); 0 at
    k = 1. Where the link probe timed the all-reduce itself, its constants (``allreduce_latency_s``,
    ``allreduce_bandwidth_bytes_per_s``) replace the point-to-point ones, with or without a point-to-point
    bandwidth: at the probe's rank count this gives back the probe's own fit. 0 with neither."""
    nbytes = np.asarray(nbytes, dtype=float)
    k = np.asarray(opts.num_ranks if ranks is None else ranks, dtype=float)
    if opts.allreduce_bandwidth_bytes_per_s is not None:
        bandwidth, latency = opts.allreduce_bandwidth_bytes_per_s, float(opts.allreduce_latency_s or 0.0)
    elif opts.bandwidth_bytes_per_s is not None:
        bandwidth, latency = opts.bandwidth_bytes_per_s, opts.link_latency_s
    else:
        return np.zeros(np.broadcast(nbytes, k).shape)
    return 2.0 * (k - 1) / k * nbytes / bandwidth + 2.0 * (k - 1) * latency


def tied_holders(arr: LayerArrays, bounds: np.ndarray, opts: CostOptions) -> np.ndarray:
    """For each row of ``bounds`` (N, S+1), how many distinct ranks hold each tied parameter's layers (N,
    ties): chunks map to ranks by ``opts.shape.stage_ranks``, so interleaved chunks of one rank share it."""
    bounds = np.asarray(bounds)
    ranks = np.asarray(opts.shape.stage_ranks)
    count = np.ones((bounds.shape[0], len(arr.tied_layers)), dtype=int)
    for g, layers in enumerate(arr.tied_layers):
        # the chunk holding layer l is the number of inner boundaries at or before l
        chunk = (bounds[:, None, 1:] <= np.asarray(layers)[None, :, None]).sum(axis=2)  # (N, layers)
        held = np.sort(ranks[chunk], axis=1)
        count[:, g] = 1 + (np.diff(held, axis=1) != 0).sum(axis=1)
    return count


def tied_across(arr: LayerArrays, bounds: np.ndarray, opts: CostOptions) -> np.ndarray:
    """For each row of ``bounds`` (N, S+1), whether each tied parameter's layers fall on two or more ranks
    (N, ties)."""
    return tied_holders(arr, bounds, opts) > 1


def tied_sync_time(arr: LayerArrays, bounds: np.ndarray, opts: CostOptions) -> np.ndarray:
    """Seconds per step (N,) of the gradient all-reduces of the tied parameters each split (row of ``bounds``)
    puts on two or more ranks: per parameter, one ring all-reduce over the k ranks that hold it (not all p:
    ``stages.sync_tied_grads`` sums it on a process group of its holders, after the schedule and before the
    optimizer step), so 2(k-1)/k x bytes / bandwidth + 2(k-1) x latency. A tie kept on one rank (k = 1)
    costs nothing; without a bandwidth or the all-reduce's constants nothing is priced (``evaluate`` notes
    it)."""
    k = tied_holders(arr, bounds, opts)
    return ring_allreduce_time(np.asarray(arr.tied_bytes, dtype=float)[None, :], opts, ranks=k).sum(axis=1)


def tied_sync_rank_time(arr: LayerArrays, boundaries: Sequence[int], opts: CostOptions) -> np.ndarray:
    """Seconds per step (p,) each rank spends in the tied all-reduces of one split: a rank pays those of the
    ties it holds, over their holders (:func:`tied_sync_time`), and nothing for a tie it does not hold."""
    bounds = np.asarray([boundaries])
    ranks = np.asarray(opts.shape.stage_ranks)
    k = tied_holders(arr, bounds, opts)[0]
    price = ring_allreduce_time(np.asarray(arr.tied_bytes, dtype=float), opts, ranks=k)
    out = np.zeros(opts.num_ranks)
    for g, layers in enumerate(arr.tied_layers):
        chunk = (bounds[0, None, 1:] <= np.asarray(layers)[:, None]).sum(axis=1)
        out[np.unique(ranks[chunk])] += price[g]
    return out


@dataclass(frozen=True)
class MemoryTerm:
    """Bytes one kind of memory adds to a stage over layers [i, j):
    ``sum(rows[s, i:j]) + start[s, i] + end[j - 1]`` (start/end None when the kind has none)."""

    rows: np.ndarray  # (S, L)
    start: np.ndarray | None  # (S, L)
    end: np.ndarray | None  # (L,)

    def stage(self, s: int, i: int, j: int) -> float:
        value = float(self.rows[s, i:j].sum())
        if self.start is not None:
            value += float(self.start[s, i])
        if self.end is not None:
            value += float(self.end[j - 1])
        return value


def memory_terms(arr: LayerArrays, opts: CostOptions) -> dict[str, MemoryTerm]:
    """Stage memory by kind, as solver-ready arrays: the one place the memory formula is written.

    - params, grads, optimizer: (1, grad factor, optimizer factor) x parameter bytes (ZeRO paper accounting:
      Adam keeps two states per parameter; gradients one per parameter unless optimizer is "none"); with a
      ``precision``, bytes per parameter from PRECISIONS instead, plus "master" (the fp32 copy of mixed
      precision).
    - activations: in_flight[s] x saved bytes per microbatch (1F1B: stage s holds min(p - s, m), Megatron's
      warm-up count + 1; GPipe all m; interleaved read off torch's order). With recomputation (Chen et al.
      2016) each in-flight microbatch keeps only the stage input (output_bytes[i-1]) and one microbatch's full
      activations are live while it is recomputed.
    - buffers: 2 x output_bytes[j-1] after every stage but the last: the send buffer of the activation and the
      receive buffer of its gradient.
    """
    L = len(arr.forward_s)
    S = opts.num_chunks
    fl = np.array(opts.shape.peak_inflight, dtype=float)

    def rows(values: np.ndarray) -> np.ndarray:
        return np.broadcast_to(values[None, :], (S, L))

    if opts.precision is None:
        terms = {
            "params": MemoryTerm(rows(arr.param_bytes), None, None),
            "grads": MemoryTerm(rows(GRAD_FACTOR[opts.optimizer] * arr.param_bytes), None, None),
            "optimizer": MemoryTerm(rows(OPTIMIZER_STATE_FACTOR[opts.optimizer] * arr.param_bytes), None,
                                    None),
        }
    else:
        # by sharding mode, on average over the replicas (planning.sharding); zero1's partition of whole
        # tensors can load one replica more, which the layout search checks on the split
        per = bytes_per_param(opts.precision, opts.optimizer, opts.sharding, opts.data_parallel,
                              opts.grad_dtype)
        count = arr.param_count
        terms = {
            "params": MemoryTerm(rows(per.weights * count), None, None),
            "grads": MemoryTerm(rows(per.grads * count), None, None),
            "master": MemoryTerm(rows(per.master * count), None, None),
            "optimizer": MemoryTerm(rows(per.optimizer * count), None, None),
        }
    if opts.recompute:
        stage_input = np.concatenate([[0.0], arr.output_bytes[:-1]])
        terms["activations"] = MemoryTerm(rows(arr.activation_bytes), fl[:, None] * stage_input[None, :],
                                          None)
    else:
        terms["activations"] = MemoryTerm(fl[:, None] * arr.activation_bytes[None, :], None, None)
    end = 2.0 * arr.output_bytes
    end[L - 1] = 0.0
    terms["buffers"] = MemoryTerm(np.zeros((S, L)), None, end)
    return terms


def solver_inputs(arr: LayerArrays, opts: CostOptions) -> dict[str, Any]:
    """Arrays for stageplan.planning.solver: per-stage time rows, boundary costs and memory rows.

    Stage time over layers [i, j) = sum(layer_time) / speed + 2 * comm_time[j-1] (charged to that stage).
    Stage memory = the sum of ``memory_terms`` (rows, start and end terms added kind by kind). Without
    recomputation, "static_memory_bytes" is the same without the activations (the rows of every other kind)
    and "activation_bytes" the saved bytes per layer and microbatch, for a solver that counts a rank's
    activation peak
    over its own order (``opts.shape.live_counts``) rather than chunk by chunk.
    """
    by_kind = memory_terms(arr, opts)
    terms = list(by_kind.values())
    memory = sum((t.rows for t in terms), start=np.zeros_like(terms[0].rows))
    static = sum((t.rows for k, t in by_kind.items() if k != "activations"),
                 start=np.zeros_like(terms[0].rows))
    starts = [t.start for t in terms if t.start is not None]
    ends = [t.end for t in terms if t.end is not None]
    limits = [d.memory_limit_bytes for d in opts.devices]
    rank = opts.shape.stage_ranks
    return {
        "costs": layer_time(arr, opts),
        "speeds": np.array([opts.devices[rank[s]].speed for s in range(opts.num_chunks)]),
        "boundary_costs": 2.0 * comm_time(arr, opts),
        "memory_bytes": memory,
        "static_memory_bytes": None if opts.recompute else static,
        "activation_bytes": None if opts.recompute else np.asarray(arr.activation_bytes, dtype=float),
        "memory_start_bytes": sum(starts[1:], start=starts[0]) if starts else None,
        "memory_end_bytes": sum(ends[1:], start=ends[0]) if ends else None,
        "limits": None if all(x is None for x in limits)
        else np.array([np.inf if x is None else x for x in limits]),
    }


def per_chunk_s(opts: CostOptions) -> float:
    """Seconds per microbatch every chunk pays whatever layers it holds: torch's schedule loop around its
    forward and backward, and PipelineStage's own code inside them."""
    return 2.0 * opts.action_s + opts.chunk_forward_s + opts.chunk_backward_s


def evaluate(arr: LayerArrays, boundaries: Sequence[int], opts: CostOptions,
             layer_names: Sequence[str] | None = None) -> Evidence:
    """Evaluate any partition (any method's, or one given by the user) under the cost model: per-stage times
    and memory by kind, per-rank load and memory, the simulated step and bubble, and notes on soft problems.

    Example (no torch needed)::

        >>> from stageplan.formats.profile import LayerProfile, Profile
        >>> prof = Profile(
        ...     tuple(LayerProfile(f"l{i}", t, 2 * t, 0, 0, 0) for i, t in enumerate([1, 2, 3, 4]))
        ... )
        >>> ev = evaluate(
        ...     LayerArrays.of(prof), (0, 3, 4), make_options(prof, 2, num_microbatches=2, optimizer="sgd")
        ... )
        >>> ev.rank_time_s, ev.bottleneck_s, ev.lower_bound_s
        ((18.0, 12.0), 18.0, 15.0)
    """
    names = list(layer_names) if layer_names is not None else [str(i) for i in range(len(arr.forward_s))]
    shape = opts.shape
    fl, ranks = shape.peak_inflight, shape.stage_ranks
    comm = comm_time(arr, opts)
    opt_time = optimizer_time(arr, opts)
    floor, trained = optimizer_floor(arr, opts), trained_mask(arr, opts)
    terms = memory_terms(arr, opts)
    L = len(arr.forward_s)
    p = opts.num_ranks
    tied = float(tied_sync_time(arr, np.array([boundaries]), opts)[0])
    dp_sync = data_parallel_sync_s(arr, boundaries, opts)
    tied_rank = tied_sync_rank_time(arr, boundaries, opts)
    stages = []
    for s in range(len(boundaries) - 1):
        i, j = int(boundaries[s]), int(boundaries[s + 1])
        dev = opts.devices[ranks[s]]
        f = float(arr.forward_s[i:j].sum()) / dev.speed
        b = float(arr.backward_s[i:j].sum()) / dev.speed
        if opts.recompute:
            b += f  # the forward runs again inside the backward
        # PipelineStage's own code around the layers
        f, b = f + opts.chunk_forward_s, b + opts.chunk_backward_s
        c = 2.0 * float(comm[j - 1]) if j < L else 0.0
        mem = {kind: term.stage(s, i, j) for kind, term in terms.items()}
        mem["total"] = sum(mem.values())
        # once per step, not per microbatch: not in time_s; zero1 and fsdp step only the rank's 1/d share
        o = float(opt_time[i:j].sum()) / dev.speed / (opts.data_parallel if opts.sharding != "ddp" else 1)
        first = ranks.index(ranks[s]) == s
        if first and floor > 0:
            # the step's fixed cost, once per rank with anything to step, on its first chunk
            mine = [k for k in range(len(boundaries) - 1) if ranks[k] == ranks[s]]
            if any(trained[int(boundaries[k]):int(boundaries[k + 1])].any() for k in mine):
                o += floor / dev.speed
        t = float(tied_rank[ranks[s]]) if first else 0.0  # the rank's all-reduces, held by its first chunk
        sync = dp_sync[ranks[s]] if first else 0.0  # the replicas' sync, held by the rank's first chunk
        a = 2.0 * opts.action_s  # the schedule's loop around the chunk's forward and its backward
        stages.append(
            StagePlan(
                s,
                ranks[s],
                tuple(names[i:j]),
                i,
                j,
                f,
                b,
                c,
                f + b + c + a,
                fl[s],
                mem,
                dev.memory_limit_bytes,
                o,
                t,
                a,
                opts.chunk_forward_s + opts.chunk_backward_s,
                sync,
            )
        )
    rank_time = [0.0] * p
    static = [0.0] * p
    for st in stages:
        rank_time[st.rank] += st.time_s
        static[st.rank] += st.memory["total"] - st.memory["activations"]
    if opts.recompute:  # in-flight stage inputs plus one microbatch recomputed; per stage, summed per rank
        peaks = tuple(sum(st.memory["activations"] for st in stages if st.rank == r) for r in range(p))
    else:
        peaks = rank_peak_activation_bytes(arr, boundaries, shape)
    sim = simulate_shape(shape, np.array([st.forward_s for st in stages]) + opts.action_s,
                         np.array([st.backward_s for st in stages]) + opts.action_s,
                         np.array(one_way_delays([st.comm_s for st in stages], opts.boundary_latency_s)),
                         np.array([st.optimizer_s for st in stages]), tied, timeline=False,
                         dp_sync=np.array([st.dp_sync_s for st in stages]))
    bottleneck = max(rank_time)
    # every rank pays the schedule's loop and PipelineStage's
    # overhead around each of its v chunks, whatever the split
    lower = (
        lower_bound(layer_time(arr, opts), [d.speed for d in opts.devices])
        + per_chunk_s(opts) * opts.virtual_stages
    )
    rank_mem = tuple(static[r] + peaks[r] for r in range(p))
    notes = _evidence_notes(arr, boundaries, opts, rank_mem, sim.bubble_fraction)
    return Evidence(
        stages=tuple(stages), rank_time_s=tuple(rank_time), rank_memory_bytes=rank_mem,
        rank_peak_activation_bytes=tuple(peaks), bottleneck_s=bottleneck, lower_bound_s=lower,
        balance_efficiency=lower / bottleneck if bottleneck > 0 else 1.0, predicted_step_s=sim.step_s,
        bubble_fraction=sim.bubble_fraction, notes=tuple(notes),
    )


def data_parallel_sync_s(arr: LayerArrays, boundaries: Sequence[int], opts: CostOptions) -> list[float]:
    """Per rank, the exposed seconds of its replicas' gradient sync per step
    (``sharding.data_parallel_sync``): after its last backward and before its optimizer step, like the tied
    all-reduce. 0 with one replica, and without a data-parallel bandwidth (the layout search always gives
    one)."""
    p, d = opts.num_ranks, opts.data_parallel
    if d <= 1 or opts.dp_bandwidth_bytes_per_s is None:
        return [0.0] * p
    per = (bytes_per_param(opts.precision, opts.optimizer, opts.sharding, d, opts.grad_dtype)
           if opts.precision is not None else None)
    ranks = opts.shape.stage_ranks
    fits = {k: (a, b) for k, a, b in opts.dp_sync_fit}
    out = []
    for r in range(p):
        mine = [s for s in range(len(boundaries) - 1) if ranks[s] == r]
        count = sum(float(arr.param_count[boundaries[s]:boundaries[s + 1]].sum()) for s in mine)
        # FSDP2's units: each layer holding parameters is sharded on its own (running.replicas.wrap_stage)
        units = sum(int((arr.param_count[boundaries[s]:boundaries[s + 1]] > 0).sum()) for s in mine)
        params = sum(float(arr.param_bytes[boundaries[s]:boundaries[s + 1]].sum()) for s in mine)
        speed = opts.devices[r].speed
        last_backward = (
            sum(float(arr.backward_s[boundaries[s] : boundaries[s + 1]].sum()) for s in mine) / speed
        )
        grads, weights = (per.grads * count, per.weights * count) if per is not None else (params, params)
        out.append(data_parallel_sync(opts.sharding, d, grads, weights, last_backward,
                                      opts.dp_bandwidth_bytes_per_s, opts.dp_latency_s, fits,
                                      units).exposed_s)
    return out


def _evidence_notes(arr: LayerArrays, boundaries: Sequence[int], opts: CostOptions, rank_mem: Sequence[float],
                    bubble_fraction: float) -> list[str]:
    """The cost model's notes on a split: what it could not price (no bandwidth, no optimizer step, a tie
    without its all-reduce's constants), the link's terms it priced, a rank over its memory limit, too few
    microbatches."""
    notes = []
    p = opts.num_ranks
    if opts.bandwidth_bytes_per_s is None and opts.boundary_latency_s == 0:
        notes.append("no bandwidth given: communication between stages is not modelled (comm_s = 0)")
    if not optimizer_measured(arr, opts):
        notes.append("optimizer step not measured in this profile: re-profile to include it")
    tied_note = _tied_note(arr, boundaries, opts)
    if tied_note:
        notes.append(tied_note)
    if opts.boundary_latency_s > 0:
        notes.append(
            f"boundary latency {opts.boundary_latency_s * 1e3:.3f} ms per crossing, {opts.latency_source}")
    if opts.action_s > 0:
        notes.append(f"torch's schedule takes {opts.action_s * 1e3:.3f} ms around each chunk's forward and "
                     "backward (its loop: record_function, building and posting the sends), measured by the "
                     "link probe")
    if opts.chunk_forward_s > 0 or opts.chunk_backward_s > 0:
        notes.append(f"PipelineStage takes {opts.chunk_forward_s * 1e3:.3f} ms inside each chunk's forward "
                     f"and {opts.chunk_backward_s * 1e3:.3f} ms inside its backward outside the layers (its "
                     "inputs, outputs and the autograd engine's start), measured by the link probe")
    for r, d in enumerate(opts.devices):
        if d.memory_limit_bytes is not None and rank_mem[r] > d.memory_limit_bytes:
            notes.append(f"rank {r} needs {format_bytes(rank_mem[r])}, over its limit of "
                         f"{format_bytes(d.memory_limit_bytes)}")
    if opts.num_microbatches < p:
        notes.append(f"num_microbatches ({opts.num_microbatches}) < num_ranks ({p}): bubble "
                     f"{bubble_fraction:.0%}; use at least {2 * p} microbatches")
    return notes


def _tied_note(arr: LayerArrays, boundaries: Sequence[int], opts: CostOptions) -> str | None:
    """Without a bandwidth or the all-reduce's constants (``ring_allreduce_time``), say that the tied
    parameters this split puts on two or more ranks are synced unpriced."""
    across = tied_across(arr, np.array([boundaries]), opts)[0]
    priced = opts.bandwidth_bytes_per_s is not None or opts.allreduce_bandwidth_bytes_per_s is not None
    if priced or not across.any():
        return None
    return (f"no bandwidth given: the gradient all-reduce of the {int(across.sum())} tied parameter(s) this "
            f"split puts on two or more ranks ({format_bytes(float(arr.tied_bytes[across].sum()))}) is not "
            "modelled (tied_sync_s = 0); give a bandwidth to price it")


def rank_peak_activation_bytes(
    arr: LayerArrays, boundaries: Sequence[int], shape: ScheduleShape
) -> tuple[float, ...]:
    """Per rank, the peak of live saved-activation bytes over its torch order (+ on F, - on B, or on W in
    zero-bubble schedules), from the counts each chunk holds at the moments it can peak
    (``ScheduleShape.live_counts``): exact for interleaved ranks that hold several stages, where summing
    per-stage peaks would overcount."""
    acts = np.array([float(arr.activation_bytes[boundaries[s]:boundaries[s + 1]].sum())
                     for s in range(len(boundaries) - 1)])
    return tuple(float(x) for x in shape.activation_peaks(acts))


# What every chunk pays whatever its layers, as the link's schedule probe measures it
# (link.schedule_overheads): torch's loop around each forward and backward, and PipelineStage's own code
# inside them. CostOptions fields.
OVERHEADS = ("action_s", "chunk_forward_s", "chunk_backward_s")
# The all-reduce the link probe timed (link.allreduce_probe), as the ring model's constants: CostOptions
# fields, None where the link did not time it (then the tied sync is priced from the point-to-point link)
COLLECTIVE = ("allreduce_latency_s", "allreduce_bandwidth_bytes_per_s")
# The data-parallel group's own all-reduce (link.dp_allreduce_probe, stageplan link --data-parallel D): its
# ring constants, the replicas it was timed over and the groups that ran at once; None where not measured
DP_COLLECTIVE = ("dp_allreduce_latency_s", "dp_allreduce_bandwidth_bytes_per_s", "dp_allreduce_ranks",
                 "dp_allreduce_groups")
# Each sharding mode's own sync, timed by the same probe (link.dp_sync_probe): its fits, the replicas and
# the FSDP2 units it was timed over
DP_SYNC = ("dp_sync_fit", "dp_sync_ranks", "dp_sync_units")


def data_parallel_link(data_parallel: int, measured: Mapping[str, Any], *,
                       link_bandwidth_bytes_per_s: float | None = None, link_latency_s: float = 0.0
                       ) -> tuple[dict[str, Any], str | None]:
    """The replicas' link for the ring model of their sync (:func:`stageplan.planning.sharding.ring_time`:
    per-step latency, per-link bandwidth) as :func:`make_options`' ``dp_latency_s`` and
    ``dp_bandwidth_bytes_per_s``, and the plan's note saying where it came from, first found of:

    1. the data-parallel group's own all-reduce (:data:`DP_COLLECTIVE` in ``measured``): at the d it was timed
       over it gives back its fit a + n / B at every size; at another d the ring scales it;
    2. the all-reduce that prices the tied gradients (:data:`COLLECTIVE`: the link's over its pipeline ranks,
       or a calibrating run's), scaled the same way;
    3. the point-to-point link (``link_bandwidth_bytes_per_s``, ``link_latency_s``), as a ring of d.

    Nothing with one replica or with none of them (the sync is then not priced). Beside those, where the link
    timed each sharding mode's own sync at this d (:data:`DP_SYNC`: ``stageplan link --data-parallel D``),
    ``dp_sync_fit`` prices each mode's sync from its own line
    (:func:`stageplan.planning.sharding.data_parallel_sync`).

    >>> opts, note = data_parallel_link(2, {"dp_allreduce_latency_s": 1e-4, "dp_allreduce_ranks": 2,
    ...                                     "dp_allreduce_bandwidth_bytes_per_s": 1e9})
    >>> opts
    {'dp_bandwidth_bytes_per_s': 1000000000.0, 'dp_latency_s': 0.0001}
    """
    if data_parallel <= 1:
        return {}, None
    fields, note = _ring_link(data_parallel, measured, link_bandwidth_bytes_per_s, link_latency_s)
    fits, ranks = measured.get("dp_sync_fit"), measured.get("dp_sync_ranks")
    if fits and fields and ranks == data_parallel:
        fields["dp_sync_fit"] = dict(fits)
        note = (f"{note}; where the link timed a sharding mode's own sync over {ranks} replicas (DDP's, "
                "ZeRO-1's broadcast, FSDP2's reduce and gather, with the code around each collective), that "
                "prices it instead")
    elif fits and fields:
        note = (f"{note}; the link timed the sharding modes' own sync over {ranks} replicas, not "
                f"{data_parallel}: measure it again with stageplan link --data-parallel {data_parallel}")
    return fields, note


def _ring_link(data_parallel: int, measured: Mapping[str, Any], link_bandwidth_bytes_per_s: float | None,
               link_latency_s: float) -> tuple[dict[str, Any], str | None]:
    """:func:`data_parallel_link`'s ring constants and their note."""
    for keys, what in ((DP_COLLECTIVE, "the link's data-parallel all-reduce"),
                       (COLLECTIVE, "the all-reduce that prices the tied gradients (the link's over its "
                                    "pipeline ranks, or a calibrating run's; stageplan link --data-parallel "
                                    "D times the replicas' own)")):
        latency, bandwidth = measured.get(keys[0]), measured.get(keys[1])
        if bandwidth is None:
            continue
        k = int(measured.get(f"{keys[0].removesuffix('latency_s')}ranks") or 2)
        fixed, rate = ring_fit(float(latency or 0.0), float(bandwidth), k)
        groups = measured.get("dp_allreduce_groups") if keys is DP_COLLECTIVE else None
        at_once = f", {groups} groups at once" if groups else ""
        scaled = "" if k == data_parallel else f", scaled as a ring to {data_parallel}"
        return ({"dp_bandwidth_bytes_per_s": float(bandwidth), "dp_latency_s": float(latency or 0.0)},
                f"the replicas' gradient sync is priced from {what}: {fixed * 1e3:.3f} ms + bytes / "
                f"{rate / 1e9:.3g} GB/s over {k} ranks{at_once}{scaled}")
    if link_bandwidth_bytes_per_s is not None:
        return ({"dp_bandwidth_bytes_per_s": float(link_bandwidth_bytes_per_s),
                 "dp_latency_s": float(link_latency_s)},
                f"the replicas' gradient sync is priced as a ring of {data_parallel} over the link's "
                f"point-to-point {link_bandwidth_bytes_per_s / 1e9:.3g} GB/s and "
                f"{link_latency_s * 1e6:.1f} us a step (the link timed no all-reduce: stageplan link "
                "--data-parallel D measures one)")
    return {}, None


def measured_link(link: Mapping[str, Any] | str | os.PathLike[str], calibration: Mapping[str, Any]
                   ) -> tuple[float, float, str, str, float, dict[str, Any]]:
    """Bandwidth (bytes/s), per-crossing delay (s), where the delay came from, the plan's note, the one-way
    latency (s, for collectives) and the schedule probe's seconds per chunk (:data:`OVERHEADS`; 0 where the
    probe did not time them: links measured before it, a single rank, CUDA) with the all-reduce's constants
    (:data:`COLLECTIVE`, None where the probe did not time it), from a LINK.json or its dict.

    For a profile calibrated from a run (``calibration``, its ``meta["calibration"]``), the link prices the
    boundaries (its bandwidth and crossing delay replace the fitted one), but the chunk overheads stay the
    run's, since its layers were calibrated net of them (another probe's would move every rank's compute off
    what the run measured), and so does the tied all-reduce where calibrate scaled it to the sum the run took
    (``tied_sync_ratio``): the sum inside the pipeline held steadier than the probe's (docs/accuracy.md)."""
    from stageplan.formats.link import crossing_s, load_link

    measured = load_link(link)
    bw, latency_s = measured["bandwidth_bytes_per_s"], crossing_s(measured)
    where = f" in {str(link)!r}" if not isinstance(link, Mapping) else ""
    pairs = len(measured.get("pairs", []))
    how = (f"measured by stageplan link ({measured.get('backend', 'unknown backend')}, {pairs} "
           f"pair{'' if pairs == 1 else 's'}){where}")
    # the latency has its own note
    note = f"link bandwidth {bw / 1e9:.3g} GB/s one way prices the boundary bytes, {how}"
    calibrated_latency_s = float(calibration.get("boundary_latency_s", 0.0))
    if calibrated_latency_s > 0:
        note += f"; it replaces the profile's calibrated {calibrated_latency_s * 1e3:.3f} ms per crossing"
    # a crossing costs what the schedule's fused send/receive
    # took, where the link timed it (above the latency)
    kind = "a fused send/receive exchange" if latency_s > measured["latency_s"] else "the one-way latency"
    overheads: dict[str, Any] = {k: float(measured.get(k) or 0.0) for k in OVERHEADS}
    if calibration:
        overheads = {k: float(calibration.get(k, 0.0)) for k in OVERHEADS}
        note += (f"; the chunk overheads stay the calibrating run's, which the calibrated layers are net of "
                 f"(torch's loop {overheads['action_s'] * 1e3:.3f} ms per action, PipelineStage "
                 f"{overheads['chunk_forward_s'] * 1e3:.3f} + {overheads['chunk_backward_s'] * 1e3:.3f} ms "
                 f"per chunk)")
    else:
        missing = [k for k in OVERHEADS if measured.get(k) is None]
        if missing:
            note += (f"; this link's schedule probe has no {', '.join(missing)}: what torch's loop and "
                     "PipelineStage spend around each chunk's layers is not priced in full; measure it again "
                     "with stageplan link")
    kept = (
        calibration.get("tied_sync_ratio") is not None
        and calibration.get("allreduce_bandwidth_bytes_per_s") is not None
    )
    source = calibration if kept else measured
    overheads.update({k: source.get(k) for k in COLLECTIVE})
    overheads["allreduce_ranks"] = 2 if kept else measured.get("allreduce_ranks")  # what the constants are at
    # the replicas' own, whatever calibrated
    overheads.update({k: measured.get(k) for k in (*DP_COLLECTIVE, *DP_SYNC)})
    if overheads["allreduce_bandwidth_bytes_per_s"] is not None:
        p = int(measured.get("allreduce_ranks") or 2) if not kept else 2
        fixed, rate = ring_fit(overheads["allreduce_latency_s"], overheads["allreduce_bandwidth_bytes_per_s"],
                               p)
        whose = (f"as the calibrating run's last rank to reach the sum took it "
                 f"({float(calibration['tied_sync_ratio']):.3f}x "
                 "its price then), not from this link's probe" if kept else "from the link's own all-reduce")
        note += (f"; a tied gradient's all-reduce is priced {whose} ({fixed * 1e3:.3f} ms + "
                 f"bytes / {rate / 1e9:.3g} GB/s at {p} ranks, scaled as a ring to other rank counts)")
    return bw, latency_s, f"{kind} {how}", note, measured["latency_s"], overheads


def estimated_link(meta: dict[str, Any]) -> tuple[float | None, str | None]:
    """The documented default for a profile estimated for a GPU: its link within a node from gpus.json (NVLink
    or xGMI, one way to one peer), and the note naming the figure, its source and the link across nodes."""
    from importlib import resources

    table = json.loads(resources.files("stageplan").joinpath("gpus.json").read_text(encoding="utf-8"))
    gpu = str((meta.get("estimate") or {}).get("gpu")
              or str(meta.get("device", "")).removeprefix("estimate:")).lower()
    row = table["gpus"].get(gpu)
    if row is None:
        return None, None
    intra, inter = row["intra_node"], row.get("inter_node", table["inter_node_default"])
    bw = float(intra["bandwidth"])
    note = (f"no link given: boundaries priced at {gpu}'s link within a node, {intra['name']}, "
            f"{bw / 1e9:.0f} GB/s one way ({intra['source']}); latency not modelled; across nodes "
            f"{inter['name']} would apply, {float(inter['bandwidth']) / 1e9:.0f} GB/s ({inter['source']}): "
            f"plan with --bandwidth {float(inter['bandwidth']) / 1e9:.0f}GB/s, or --link LINK.json measured "
            f"there")
    return bw, note
