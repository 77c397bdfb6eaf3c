"""What a data-parallel replica holds and sends, by sharding
mode, and what tensor parallelism sends (no torch).

Units: bytes, seconds, bytes/second. Bandwidths are per GPU, one way, as a ring algorithm sees them: a
measured NCCL ``busbw`` (nccl-tests, doc/PERFORMANCE.md) is already that figure for all-reduce, all-gather and
reduce-scatter; its ``algbw`` is busbw x n / (2(n-1)) for all-reduce and busbw x n / (n-1) for the other two.

The modes are what torch runs under ``torch.distributed.pipelining`` (``pipelining/stage.py``), not the
textbook ZeRO stages:

- ``ddp``: DistributedDataParallel with ``gradient_as_bucket_view=True`` (without it the gradients are held
  twice: the ``.grad`` and the bucket). Every microbatch but the last runs under ``no_sync``; the reducer's
  all-reduce runs inside the last microbatch's backward, bucketed (``bucket_cap_mb=25``) and overlapped with
  it. A full replica on every device.
- ``zero1``: DDP plus ``torch.distributed.optim.ZeroRedundancyOptimizer``. Each rank keeps the optimizer
  states (and master weights) of the whole tensors it owns; ``_partition_parameters`` gives them out largest
  first, each to the least-loaded rank (``zero_redundancy_optimizer.py``), so a large embedding lands whole on
  one rank. After the step each owner broadcasts its updated parameters.
- ``fsdp``: FSDP2 ``fully_shard`` per layer with ``reshard_after_forward=False``, as torchtitan runs it under
  pipelining (``torchtitan/distributed/fsdp.py``). ``stage.py`` turns gradient sync and reshard-after-backward
  off for every microbatch but the last, so a stage holds its parameters unsharded and its accumulated
  gradients unsharded (in the reduce dtype) until ``perform_reduce_grad`` reduce-scatters them after the last
  microbatch (``_fsdp_param_group.py``): unsharded weights + unsharded gradients + (sharded master +
  states)/d, Megatron's distributed-optimizer figure (2 + 4 + 12/d bytes per parameter with bf16 weights, fp32
  gradients
  and Adam), not ZeRO-2's 2 + 14/d.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stageplan.errors import StageplanError

SHARDINGS = ("ddp", "zero1", "fsdp")
GRAD_DTYPES = ("param", "fp32")

# Bytes per parameter as training holds them, by precision: (weights, gradients, fp32 master copy, each
# optimizer state). Mixed precision keeps low-precision weights and gradients plus fp32 master weights and
# fp32 optimizer states: with Adam 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter (ZeRO, Rajbhandari et al. 2020,
# section 3); Megatron's 18 keeps its main gradients in fp32 (``--grad-dtype fp32``:
# megatron/training/theoretical_memory_usage.py). fp32 and pure bf16 step the weights themselves (no master).
PRECISIONS: dict[str, tuple[float, float, float, float]] = {
    "fp32": (4.0, 4.0, 0.0, 4.0),
    "bf16": (2.0, 2.0, 0.0, 2.0),
    "bf16-mixed": (2.0, 2.0, 4.0, 4.0),
    "fp16-mixed": (2.0, 2.0, 4.0, 4.0),
}
# Optimizer states per parameter: SGD none, SGD with momentum one buffer, Adam/AdamW exp_avg and exp_avg_sq.
OPTIMIZER_STATES: dict[str, int] = {"none": 0, "sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}
# DDP's default bucket (torch.nn.parallel.DistributedDataParallel, bucket_cap_mb=25): the last bucket's
# all-reduce starts after the backward ends, so at least its time is exposed.
DDP_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per parameter a device holds, by kind, on average over the d replicas (zero1's partition of whole
    tensors can put more on one rank: :func:`zero1_shares`). ``sharded`` is the part divided by d."""

    weights: float
    grads: float
    master: float
    optimizer: float
    sharded: tuple[str, ...] = ()

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.master + self.optimizer


def check_sharding(sharding: object, grad_dtype: object = "param") -> None:
    if sharding not in SHARDINGS:
        raise StageplanError(f"unknown sharding {sharding!r}; use one of {', '.join(SHARDINGS)}")
    if grad_dtype not in GRAD_DTYPES:
        raise StageplanError(f"unknown gradient dtype {grad_dtype!r}; use one of {', '.join(GRAD_DTYPES)} "
                             "(param: gradients in the weights' dtype, as ZeRO counts; fp32: Megatron's main "
                             "gradients)")


def bytes_per_param(precision: str, optimizer: str, sharding: str = "ddp", data_parallel: int = 1,
                    grad_dtype: str = "param") -> ParamBytes:
    """Bytes per parameter on one device of a replica group of ``data_parallel`` devices.

    >>> bytes_per_param("bf16-mixed", "adam").total          # ZeRO's (2 + 2 + 12)
    16.0
    >>> bytes_per_param("bf16-mixed", "adam", grad_dtype="fp32").total   # Megatron's 18
    18.0
    >>> bytes_per_param("bf16-mixed", "adam", "zero1", 8, "fp32").total  # Megatron's 6 + 12/d
    7.5
    >>> bytes_per_param("bf16-mixed", "adam", "fsdp", 4, "fp32").total   # 2 + 4 + 12/4
    9.0
    """
    check_sharding(sharding, grad_dtype)
    if precision not in PRECISIONS:
        raise StageplanError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATES:
        raise StageplanError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATES)}")
    d = int(data_parallel)
    weight, grad, master, state = PRECISIONS[precision]
    training = optimizer != "none"
    if not training:
        return ParamBytes(weight, 0.0, 0.0, 0.0)
    grad = 4.0 if grad_dtype == "fp32" else grad
    states = OPTIMIZER_STATES[optimizer] * state
    if sharding == "ddp" or d == 1:
        return ParamBytes(weight, grad, master, states)
    if sharding == "zero1":
        return ParamBytes(weight, grad, master / d, states / d, ("master", "optimizer"))
    # fsdp: the sharded parameter is the one the optimizer steps (the master where there is one, else the
    # weights themselves); the unsharded weights and gradients stay whole until the last microbatch's reduce
    stepped = master if master > 0 else weight
    return ParamBytes(weight, grad, stepped / d, states / d, ("master", "optimizer"))


def zero1_shares(numels: Sequence[int], world: int) -> list[int]:
    """Elements each of ``world`` ranks owns under ZeroRedundancyOptimizer's partition: whole tensors, largest
    first, each to the least-loaded rank, the lowest index on ties (``_partition_parameters`` in
    torch/distributed/optim/zero_redundancy_optimizer.py; Python's sort is stable, so equal sizes keep their
    order).

    >>> zero1_shares([128256 * 8192, 8192 * 8192, 8192 * 8192, 8192], 2)
    [1050673152, 134225920]
    """
    sizes = [0] * world
    for n in sorted((int(x) for x in numels), reverse=True):
        r = sizes.index(min(sizes))
        sizes[r] += n
    return sizes


def ring_time(nbytes: float, ranks: int, bandwidth_bytes_per_s: float, latency_s: float = 0.0,
              kind: str = "all_reduce") -> float:
    """Seconds of one ring collective over ``ranks`` devices (Patarasuk and Yuan 2009; Thakur et al. 2005):
    all-reduce 2(n-1)/n x bytes / bandwidth + 2(n-1) x latency; all-gather, reduce-scatter and the owners'
    broadcasts of zero1 half that (n-1 steps). 0 for one rank.

    >>> ring_time(1e9, 4, 1e9)
    1.5
    >>> ring_time(1e9, 4, 1e9, kind="all_gather")
    0.75
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (ranks - 1) if kind == "all_reduce" else ranks - 1
    return steps / ranks * nbytes / bandwidth_bytes_per_s + steps * latency_s


@dataclass(frozen=True)
class DataParallelSync:
    """Seconds a rank spends on its replicas' gradient sync per step, and how much of it the step sees."""

    total_s: float
    exposed_s: float
    kind: str


def data_parallel_sync(sharding: str, data_parallel: int, grad_bytes: float, weight_bytes: float,
                       last_backward_s: float, bandwidth_bytes_per_s: float, latency_s: float = 0.0,
                       fits: Mapping[str, tuple[float, float]] | None = None, units: int = 1,
                       ) -> DataParallelSync:
    """One rank's data-parallel communication per step, for a stage holding ``grad_bytes`` of gradients (in
    the reduce dtype) and ``weight_bytes`` of weights.

    - ddp: one all-reduce of the gradients inside the last microbatch's backward (``last_backward_s``),
      overlapped with it bucket by bucket; exposed is what the backward cannot hide, and at least the last
      bucket's (25 MiB) all-reduce, which starts when the backward ends.
    - zero1: DDP's, plus the owners' broadcast of the updated weights after the step (exposed).
    - fsdp: a reduce-scatter of the gradients after the last microbatch (``perform_reduce_grad``), and the
      all-gather of the weights before the first microbatch's forward; both exposed (no other work is left to
      hide them behind at either end of the step).

    Each collective is the ring model's (:func:`ring_time` over ``bandwidth_bytes_per_s`` and ``latency_s``),
    or, where ``fits`` has the mode's own measured sync at this d (``stageplan link --data-parallel D``:
    kind -> (fixed_s, bytes_per_s), :data:`stageplan.formats.link.DP_SYNC_KINDS`), that line: DDP's whole
    sync and ZeRO-1's broadcast
    once per stage, FSDP2's reduce and gather with their fixed cost once per unit (``units``: the stage's
    layers that hold parameters, each its own ``fully_shard``).

    >>> fits = {"fsdp_reduce": (1e-3, 1e9), "fsdp_gather": (5e-4, 2e9)}
    >>> round(data_parallel_sync("fsdp", 2, 1e8, 1e8, 0.0, 1e9, fits=fits, units=3).total_s, 6)
    0.1545
    """
    d = int(data_parallel)
    if d <= 1:
        return DataParallelSync(0.0, 0.0, "none")
    fits = fits or {}

    def own(kind: str, nbytes: float, times: int = 1) -> float | None:
        if kind not in fits or nbytes <= 0:
            return None
        fixed, rate = fits[kind]
        return times * float(fixed) + nbytes / float(rate)

    if sharding == "fsdp":
        reduce = own("fsdp_reduce", grad_bytes, max(units, 1))
        gather = own("fsdp_gather", weight_bytes, max(units, 1))
        total = ((ring_time(grad_bytes, d, bandwidth_bytes_per_s, latency_s, "reduce_scatter")
                  if reduce is None else reduce)
                 + (ring_time(weight_bytes, d, bandwidth_bytes_per_s, latency_s, "all_gather")
                    if gather is None else gather))
        return DataParallelSync(total, total, "reduce-scatter + all-gather")
    allreduce = own("ddp", grad_bytes)
    last_bucket = own("ddp", min(grad_bytes, DDP_BUCKET_BYTES))
    if allreduce is None or last_bucket is None:
        allreduce = ring_time(grad_bytes, d, bandwidth_bytes_per_s, latency_s)
        last_bucket = ring_time(min(grad_bytes, DDP_BUCKET_BYTES), d, bandwidth_bytes_per_s, latency_s)
    exposed = max(allreduce - last_backward_s, last_bucket)
    if sharding == "zero1":
        broadcast = own("zero1_broadcast", weight_bytes)
        if broadcast is None:
            broadcast = ring_time(weight_bytes, d, bandwidth_bytes_per_s, latency_s, "broadcast")
        return DataParallelSync(allreduce + broadcast, exposed + broadcast, "all-reduce + owners' broadcast")
    return DataParallelSync(allreduce, exposed, "all-reduce")


def tensor_parallel_block_s(tokens: int, hidden: int, activation_bytes: float, t: int,
                            bandwidth_bytes_per_s: float, latency_s: float = 0.0,
                            recompute: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of a transformer block's tensor-parallel communication per microbatch:
    Megatron's two all-reduces of b*s*h elements in the forward (after attention and after the MLP) and two in
    the backward (Shoeybi et al. 2019, section 3); full recompute runs the forward's two again inside the
    backward. Sequence parallelism moves the same volume as all-gather + reduce-scatter (Korthikanti et al.
    2022, section 4.2.2), so the same time. ``tokens`` = b*s, ``activation_bytes`` per element.

    >>> [round(x * 1e6, 1) for x in tensor_parallel_block_s(4096, 8192, 2, 4, 450e9)]  # microseconds
    [447.4, 447.4]
    """
    if t <= 1:
        return 0.0, 0.0
    one = ring_time(float(tokens) * hidden * activation_bytes, t, bandwidth_bytes_per_s, latency_s)
    return 2 * one, (4 if recompute else 2) * one


def tensor_parallel_collectives(num_blocks: int, num_microbatches: int, t: int, recompute: bool = False,
                                ends_with_block: bool = False) -> tuple[int, int]:
    """(forward, backward) all-reduces one stage issues in a step for tensor parallelism, the count that
    :func:`tensor_parallel_block_s` prices: per block and microbatch, Megatron's g operator twice in the
    forward (the attention's and the MLP's row-parallel outputs summed) and its f operator twice in the
    backward (the gradients of the two column-parallel inputs summed; Shoeybi et al. 2019, section 3,
    figure 3). Full recompute runs the forward's two again inside the backward, but for the stage's last
    all-reduce when the stage ends with a block (``ends_with_block``): torch.utils.checkpoint stops
    recomputing once the backward's saved tensors are back, and nothing in the stage saves the last block's
    output (non-reentrant early stop, torch/utils/checkpoint.py ``set_checkpoint_early_stop``). (0, 0)
    without tensor parallelism.

    >>> tensor_parallel_collectives(2, 4, 2)
    (16, 16)
    >>> tensor_parallel_collectives(2, 4, 2, recompute=True, ends_with_block=True)
    (16, 28)
    """
    if t <= 1 or num_blocks <= 0:
        return 0, 0
    forward = 2 * num_blocks
    again = (forward - (1 if ends_with_block else 0)) if recompute else 0
    return forward * num_microbatches, (2 * num_blocks + again) * num_microbatches


def padded_vocab(vocab_size: int, t: int, multiple: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by`` (128) x t, so each of
    the t shards is whole (megatron/training/tokenizer/tokenizer.py, ``_vocab_size_with_padding``).

    >>> padded_vocab(128256, 4)
    128512
    """
    step = multiple * t
    return int(math.ceil(vocab_size / step) * step)
