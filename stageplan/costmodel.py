"""Profile + options -> per-layer time, memory by schedule and communication, per stage (no torch).

Units: seconds, bytes, bytes/second. Sources are named next to each formula.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from stageplan.errors import StageplanError
from stageplan.profile import Profile
from stageplan.schedules import (
    check_microbatches,
    normalize_schedule,
    peak_inflight,
    rank_orders,
    stage_ranks,
)

# Optimizer state held per parameter byte (states kept in the parameters' dtype):
# sgd keeps nothing; SGD with momentum keeps one buffer; Adam/AdamW keep exp_avg and exp_avg_sq.
OPTIMIZER_STATE_FACTOR: dict[str, float] = {"none": 0.0, "sgd": 0.0, "momentum": 1.0, "adam": 2.0, "adamw": 2.0}
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
    boundary_latency_s: float = 0.0  # fixed delay per boundary crossing (fitted by calibrate from a run)

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.virtual_stages

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["devices"] = [asdict(x) for x in self.devices]
        return d


def make_options(profile: Profile, num_ranks: int, *, num_microbatches: int, schedule: str = "1F1B",
                 virtual_stages: int = 1, optimizer: str = "adam", bandwidth_bytes_per_s: float | None = None,
                 devices: Sequence[Device] | None = None, memory_limit_bytes: float | None = None,
                 recompute: bool = False, boundary_latency_s: float = 0.0) -> CostOptions:
    """Validate and assemble CostOptions; every refusal names the rule, the values and the remedy."""
    if len(profile) == 0:
        raise StageplanError("the profile has no layers; profile a model first (stageplan profile MODEL -o PROFILE.json)")
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise StageplanError(f"num_stages must be an integer >= 1, got {num_ranks!r}; e.g. --stages 2")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise StageplanError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}; e.g. --microbatches 8")
    name = normalize_schedule(schedule)
    if virtual_stages < 1:
        raise StageplanError(f"virtual_stages must be >= 1, got {virtual_stages}; use 1, or 2+ with Interleaved1F1B")
    if name == "Interleaved1F1B" and virtual_stages == 1:
        virtual_stages = 2  # torch's interleaving needs chunks to interleave; 2 is Megatron's usual choice
    L, S = len(profile), num_ranks * virtual_stages
    if S > L:
        if virtual_stages > 1:
            raise StageplanError(
                f"{name} with {num_ranks} ranks x {virtual_stages} virtual stages needs at least {S} layers, the profile has {L}; "
                "lower --virtual-stages or --stages, or profile at a finer granularity"
            )
        raise StageplanError(
            f"num_stages ({num_ranks}) exceeds the number of layers ({L}); use fewer stages or profile at a finer granularity"
        )
    check_microbatches(name, num_ranks, num_microbatches, virtual_stages)
    opt = optimizer.lower()
    if opt not in OPTIMIZER_STATE_FACTOR:
        raise StageplanError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATE_FACTOR)}")
    if bandwidth_bytes_per_s is not None and (not math.isfinite(bandwidth_bytes_per_s) or bandwidth_bytes_per_s <= 0):
        raise StageplanError(f"bandwidth must be a positive number of bytes/s, got {bandwidth_bytes_per_s!r}; e.g. --bandwidth 25GB/s")
    if memory_limit_bytes is not None and (not math.isfinite(memory_limit_bytes) or memory_limit_bytes <= 0):
        raise StageplanError(f"memory limit must be a positive number of bytes, got {memory_limit_bytes!r}; e.g. --memory-limit 40GiB")
    if devices:
        devs = tuple(devices)
        if len(devs) != num_ranks:
            raise StageplanError(
                f"got {len(devs)} device entries for {num_ranks} stages; give one speed per stage "
                f"(e.g. --device-speeds {','.join(['1'] * num_ranks)})"
            )
        for i, d in enumerate(devs):
            if not (math.isfinite(d.speed) and d.speed > 0):
                raise StageplanError(f"device {i} speed must be > 0, got {d.speed!r}; speeds are relative to the profiled device")
        if memory_limit_bytes is not None:
            devs = tuple(Device(d.speed, d.memory_limit_bytes if d.memory_limit_bytes is not None else memory_limit_bytes, d.name)
                         for d in devs)
    else:
        devs = tuple(Device(1.0, memory_limit_bytes) for _ in range(num_ranks))
    if not (math.isfinite(boundary_latency_s) and boundary_latency_s >= 0):
        raise StageplanError(f"boundary latency must be >= 0 seconds, got {boundary_latency_s!r}; recalibrate the profile")
    return CostOptions(num_ranks, num_microbatches, name, virtual_stages, opt, bandwidth_bytes_per_s, devs, bool(recompute),
                       float(boundary_latency_s))


@dataclass(frozen=True)
class LayerArrays:
    forward_s: np.ndarray
    backward_s: np.ndarray
    activation_bytes: np.ndarray
    output_bytes: np.ndarray
    param_bytes: np.ndarray

    @classmethod
    def of(cls, profile: Profile, num_microbatches: int = 1) -> LayerArrays:
        """Per-layer arrays; backward_s is the mean over a step of ``num_microbatches``: the first backward into
        empty grads, the others accumulating into them (measured separately by the profiler)."""
        arr = {k: np.array([getattr(x, k) for x in profile.layers], dtype=float)
               for k in ("forward_s", "activation_bytes", "output_bytes", "param_bytes")}
        arr["backward_s"] = np.array([x.backward_per_microbatch_s(num_microbatches) for x in profile.layers], dtype=float)
        for k, a in arr.items():
            bad = np.flatnonzero(~np.isfinite(a) | (a < 0))
            if bad.size:
                i = int(bad[0])
                raise StageplanError(
                    f"layer {i} ({profile.layers[i].name!r}) has {k} = {a[i]}; costs must be finite and >= 0; re-profile the model"
                )
        return cls(**arr)


def inflight(opts: CostOptions) -> tuple[int, ...]:
    """Microbatches whose activations each stage holds at peak, read off the simulator's own torch order.
    GPipe: m on every stage; 1F1B: min(p - s, m) (Megatron's warm-up count + 1); interleaved: from the order."""
    return peak_inflight(opts.schedule, opts.num_ranks, opts.num_microbatches, opts.virtual_stages)


def stage_rank(opts: CostOptions) -> tuple[int, ...]:
    return stage_ranks(opts.schedule, opts.num_ranks, opts.virtual_stages)


def layer_time(arr: LayerArrays, opts: CostOptions) -> np.ndarray:
    """Seconds per microbatch per layer on the profiled device: forward + backward; with recomputation the
    forward runs again inside the backward (Chen et al. 2016), so it is paid twice."""
    return arr.forward_s * (2.0 if opts.recompute else 1.0) + arr.backward_s


def comm_time(arr: LayerArrays, opts: CostOptions) -> np.ndarray:
    """Seconds a boundary after each layer costs one way: output_bytes / bandwidth (0 with no bandwidth).

    The calibrated per-crossing latency (``boundary_latency_s``) is not part of this: it is the same at every
    boundary, so it cannot change which split is best, and charging it to one side of each boundary would bias
    the split. It delays the simulated step only (see ``simulated_comm``)."""
    if opts.bandwidth_bytes_per_s is None:
        return np.zeros_like(arr.output_bytes)
    return arr.output_bytes / opts.bandwidth_bytes_per_s


def simulated_comm(arr: LayerArrays, boundaries: Sequence[int], opts: CostOptions) -> list[float]:
    """One-way delay at each stage boundary for the simulator: bytes / bandwidth + the calibrated latency."""
    comm = comm_time(arr, opts)
    return [float(comm[b - 1]) + opts.boundary_latency_s for b in boundaries[1:-1]]


def static_factor(opts: CostOptions) -> float:
    """Bytes held per parameter byte: the parameters, their gradients and the optimizer state."""
    return 1.0 + GRAD_FACTOR[opts.optimizer] + OPTIMIZER_STATE_FACTOR[opts.optimizer]


def solver_inputs(arr: LayerArrays, opts: CostOptions) -> dict[str, Any]:
    """Arrays for stageplan.solver: per-stage time rows, boundary costs and memory rows (stage-dependent in flight).

    Stage time over layers [i, j) = sum(fwd + bwd) / speed + 2 * output_bytes[j-1] / bandwidth: the activation going
    out and the gradient coming back across the boundary after the stage (charged to that stage).
    Stage memory = (1 + grad + optimizer factor) * params + in_flight * activations + 2 * output_bytes[j-1]
    (the send buffer of the activation and the receive buffer of its gradient).
    With recomputation, each in-flight microbatch keeps only the stage input (output_bytes[i-1]) and one
    microbatch's full activations are live while it is recomputed.
    """
    L = len(arr.forward_s)
    fl = np.array(inflight(opts), dtype=float)
    rows = static_factor(opts) * arr.param_bytes[None, :]
    if opts.recompute:
        memory = np.broadcast_to(rows + arr.activation_bytes[None, :], (len(fl), L)).copy()
        stage_input = np.concatenate([[0.0], arr.output_bytes[:-1]])
        start = fl[:, None] * stage_input[None, :]
    else:
        memory = rows + fl[:, None] * arr.activation_bytes[None, :]
        start = None
    end = 2.0 * arr.output_bytes.copy()
    end[L - 1] = 0.0
    limits = [d.memory_limit_bytes for d in opts.devices]
    rank = stage_rank(opts)
    return {
        "costs": layer_time(arr, opts),
        "speeds": np.array([opts.devices[rank[s]].speed for s in range(opts.num_stages)]),
        "boundary_costs": 2.0 * comm_time(arr, opts),
        "memory_bytes": memory,
        "memory_start_bytes": start,
        "memory_end_bytes": end,
        "limits": None if all(x is None for x in limits) else np.array([np.inf if x is None else x for x in limits]),
    }


@dataclass(frozen=True)
class StageCost:
    """Per-stage evidence: time in seconds per microbatch and memory in bytes by kind."""

    index: int
    rank: int
    first_layer: int
    end_layer: int  # exclusive
    forward_s: float
    backward_s: float
    comm_s: float
    time_s: float
    inflight: int
    memory: dict[str, float]
    memory_limit_bytes: float | None


def stage_costs(arr: LayerArrays, boundaries: Sequence[int], opts: CostOptions) -> list[StageCost]:
    """Evaluate a partition (any method's) under the cost model."""
    fl = inflight(opts)
    ranks = stage_rank(opts)
    comm = comm_time(arr, opts)
    L = len(arr.forward_s)
    out = []
    for s in range(len(boundaries) - 1):
        i, j = int(boundaries[s]), int(boundaries[s + 1])
        dev = opts.devices[ranks[s]]
        f = float(arr.forward_s[i:j].sum()) / dev.speed
        b = float(arr.backward_s[i:j].sum()) / dev.speed
        if opts.recompute:
            b += f
        c = 2.0 * float(comm[j - 1]) if j < L else 0.0
        params = float(arr.param_bytes[i:j].sum())
        if opts.recompute:
            held = fl[s] * (float(arr.output_bytes[i - 1]) if i > 0 else 0.0) + float(arr.activation_bytes[i:j].sum())
        else:
            held = fl[s] * float(arr.activation_bytes[i:j].sum())
        mem = {
            "params": params,
            "grads": GRAD_FACTOR[opts.optimizer] * params,
            "optimizer": OPTIMIZER_STATE_FACTOR[opts.optimizer] * params,
            "activations": held,
            "buffers": 2.0 * float(arr.output_bytes[j - 1]) if j < L else 0.0,
        }
        mem["total"] = sum(mem.values())
        out.append(StageCost(s, ranks[s], i, j, f, b, c, f + b + c, fl[s], mem, dev.memory_limit_bytes))
    return out


def rank_peak_activation_bytes(arr: LayerArrays, boundaries: Sequence[int], opts: CostOptions) -> tuple[float, ...]:
    """Per rank, the peak of live saved-activation bytes over its torch order (+ on F, - on B/W): exact for
    interleaved ranks that hold several stages, where summing per-stage peaks would overcount."""
    acts = [float(arr.activation_bytes[boundaries[s]:boundaries[s + 1]].sum()) for s in range(len(boundaries) - 1)]
    orders = rank_orders(opts.schedule, opts.num_ranks, opts.num_microbatches, opts.virtual_stages)
    zero_bubble = any(a.kind == "W" for order in orders for a in order)
    peaks = []
    for order in orders:
        live = peak = 0.0
        for a in order:
            if a.kind == "F":
                live += acts[a.stage]
            elif a.kind == ("W" if zero_bubble else "B"):
                live -= acts[a.stage]
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)
