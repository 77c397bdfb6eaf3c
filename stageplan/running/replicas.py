"""Data-parallel replicas of a pipeline: the ("pp", "dp") device mesh, each stage wrapped for its sharding
mode, each replica's share of the batch, and what the replicas' ranks hold and wait for (torch).

A layout of p pipeline ranks and d replicas runs on p x d processes. Global rank r sits at mesh coordinates
(pp, dp) = (r // d, r % d): the replicas of one stage are neighbours, as torchtitan builds its mesh with the
pipeline dimension outermost (``ParallelDims.build_mesh`` in torchtitan/distributed/parallel_dims.py) and as
the layout search places data parallelism inside pipeline parallelism. torch's schedules drive the wrappers
themselves: DDP runs every microbatch but the last under ``no_sync`` and reduces during the last backward;
FSDP2 turns gradient sync and resharding off until the schedule's ``perform_reduce_grad`` after the last
microbatch (torch/distributed/pipelining/stage.py, ``backward_maybe_with_nosync``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stageplan.errors import StageplanError
from stageplan.formats.plan import Plan
from stageplan.formats.schedule import ZERO_BUBBLE
from stageplan.measure import DeviceClock, median_iqr, release_free_memory

# What each replica's rank holds (the cost model's three modes, planning/sharding.py) and FSDP with its
# parameters resharded after every forward (re-gathered for the backward: less memory, more traffic)
SHARDINGS = ("ddp", "zero1", "fsdp", "fsdp-reshard")


def check_replicas(plan: Plan, sharding: str) -> None:
    """Refuse, before any rank starts, what torch would run wrongly: a zero-bubble schedule with DDP or ZeRO-1
    replicas (d >= 2: wrong gradients upstream, pytorch/pytorch#144530), and FSDP resharded after forward
    under a zero-bubble schedule (wrong or missing gradients, even at d = 1). A world that is not the plan's p
    x d ranks and a global batch the replicas cannot share are refused with the model's checks
    (:func:`stageplan.running.stages.validate`)."""
    d = plan.data_parallel
    if sharding not in SHARDINGS:
        raise StageplanError(f"unknown sharding {sharding!r}; use one of {', '.join(SHARDINGS)}")
    if plan.schedule in ZERO_BUBBLE and sharding in ("ddp", "zero1") and d >= 2:
        raise StageplanError(
            f"{plan.schedule} with {sharding} replicas (d = {d}) computes wrong gradients in torch "
            "(pytorch/pytorch#144530: the split backward's weight gradients miss DDP's reduction); plan with "
            "--schedule 1F1B or Interleaved1F1B, or run the replicas with --sharding fsdp")
    if plan.schedule in ZERO_BUBBLE and sharding == "fsdp-reshard":
        raise StageplanError(
            f"{plan.schedule} with FSDP resharded after forward computes wrong or missing gradients in torch "
            "(its weight-gradient step runs after the parameters were resharded); run with --sharding fsdp "
            "(parameters kept unsharded until the last microbatch), or plan another schedule")


@dataclass
class Mesh:
    """This rank's place in the ("pp", "dp") mesh and the groups it talks in: ``pp_group`` is its pipeline's
    ranks (None: the whole world, one replica), ``dp_group`` its stage's replicas (None where d = 1), and
    ``dp_mesh`` the 1-D mesh FSDP2 shards over."""

    pp_rank: int
    dp_rank: int
    num_ranks: int
    data_parallel: int
    pp_group: Any = None
    dp_group: Any = None
    dp_mesh: Any = None
    # with tensor-parallel shards (stageplan.running.tensor): this rank's shard, t, and the 1-D mesh its
    # stage's blocks are sharded over
    tp_rank: int = 0
    tensor_parallel: int = 1
    tp_mesh: Any = None

    @property
    def coordinates(self) -> dict[str, int]:
        return {"pp": self.pp_rank, "dp": self.dp_rank, **({"tp": self.tp_rank} if self.tensor_parallel > 1
                                                            else {})}


def make_mesh(rank: int, p: int, d: int, device: torch.device, t: int = 1) -> Mesh:
    """The mesh of p pipeline ranks x d replicas, or of p pipeline ranks x t tensor-parallel shards (rank r
    at (r // t, r % t); every rank calls this, in the same order: creating a group is collective). With one
    replica and one shard, no subgroup: the pipeline is the whole world, as before."""
    from torch.distributed.device_mesh import init_device_mesh

    if t > 1:
        if d > 1:
            raise StageplanError(f"a mesh of {d} replicas and {t} tensor-parallel shards is not run yet; "
                                 "lay the model out with --tensor-parallel 1 or one replica")
        mesh = init_device_mesh(device.type, (p, t), mesh_dim_names=("pp", "tp"))
        return Mesh(rank // t, 0, p, 1, mesh["pp"].get_group(), tp_rank=rank % t, tensor_parallel=t,
                    tp_mesh=mesh["tp"])
    if d == 1:
        return Mesh(rank, 0, p, 1)
    mesh = init_device_mesh(device.type, (p, d), mesh_dim_names=("pp", "dp"))
    return Mesh(rank // d, rank % d, p, d, mesh["pp"].get_group(), mesh["dp"].get_group(), mesh["dp"])


def replica_share(batch: Any, dp_rank: int, d: int) -> Any:
    """Replica ``dp_rank``'s contiguous share of a batch (dim 0), as a distributed sampler gives each replica
    its own samples; anything that is not a tensor is shared whole."""
    if d == 1 or not isinstance(batch, torch.Tensor) or batch.dim() == 0:
        return batch
    size = batch.shape[0] // d
    return batch[dp_rank * size:(dp_rank + 1) * size]


def _tied_layers(piece: nn.Module, layer_names: Sequence[str]) -> set[str]:
    """The stage's layers that share a parameter with another of its layers (an embedding tied to the head on
    one rank): FSDP2 shards a parameter in one unit only, so these stay with the stage's root unit."""
    owners: dict[int, set[str]] = {}
    for name in layer_names:
        try:
            mod = piece.get_submodule(name)
        except AttributeError:
            continue
        for prm in mod.parameters():
            owners.setdefault(id(prm), set()).add(name)
    return {n for names in owners.values() if len(names) > 1 for n in names}


def wrap_stage(piece: nn.Module, layer_names: Sequence[str], sharding: str, mesh: Mesh) -> nn.Module:
    """``piece`` (one stage, its parameters real) wrapped for its replicas: DDP over the stage's replicas for
    ddp and zero1 (ZeRO-1 shards the optimizer, not the module), or FSDP2 in place for fsdp: every layer of
    the stage that is a module its own unit, then the stage itself, with ``reshard_after_forward`` off
    (torchtitan's choice under pipelining: each microbatch's backward would gather the parameters again) or
    on for fsdp-reshard. A stage without parameters, or with one replica, is returned as it is."""
    if mesh.data_parallel == 1 or not any(True for _ in piece.parameters()):
        return piece
    if sharding in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel

        from stageplan.layers import used_parameters

        # a parameter the stage holds and never uses (an exported stage keeps a tied LM head's alias beside
        # the embedding it ties to) never gets a gradient: DDP's reducer would wait for it and fail the next
        # step ("Expected to have finished reduction in the prior iteration"), so DDP leaves it out
        used = {id(p) for p in used_parameters(piece).values()}
        unused = [n for n, p in piece.named_parameters(remove_duplicate=False) if id(p) not in used]
        if unused:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(piece, unused)
        # buffers start the same on every replica: no broadcast before each forward. Gradients as views into
        # DDP's buckets, as the cost model counts DDP (one copy of the gradients, not two: the gradient_as_
        # bucket_view argument of torch.nn.parallel.DistributedDataParallel)
        wrapped = DistributedDataParallel(piece, process_group=mesh.dp_group, broadcast_buffers=False,
                                          gradient_as_bucket_view=True)
        graph = getattr(piece, "graph", None)
        if graph is not None:
            # an exported stage's _PipelineStage reads its module's graph (placeholders and output) when it
            # infers its inputs and outputs; DDP does not forward attributes to the module it wraps
            wrapped.graph = graph
        return wrapped
    from torch.distributed.fsdp import fully_shard

    reshard = sharding == "fsdp-reshard"
    tied = _tied_layers(piece, layer_names)
    for name in layer_names:
        if name in tied:
            continue
        try:
            mod = piece.get_submodule(name)
        except AttributeError:
            continue  # code between the named modules: part of the stage's root unit
        if mod is not piece and any(True for _ in mod.parameters()):
            fully_shard(mod, mesh=mesh.dp_mesh, reshard_after_forward=reshard)
    fully_shard(piece, mesh=mesh.dp_mesh, reshard_after_forward=reshard)
    return piece


def no_sync_inference(stage: Any) -> None:
    """Run a DDP stage's shape inference under ``no_sync``. torch 2.13 infers a stage's inputs and outputs on
    the first step by calling its module once outside any schedule action (``_forward_metadata_inference`` in
    torch/distributed/pipelining/stage.py); through DDP that forward prepares the reducer for a backward, so
    the first microbatch's backward then all-reduced too and the bucket rebuild counted every parameter twice:
    the first step's gradients came out wrong (a GPT's losses 0.17 off from one process over 6 steps), or
    DDP's reducer asserted ("rebuilt parameter indices size is not same as original model parameters size")
    on the next forward. Measured with torch 2.13 on gloo, 2 x 2 ranks."""
    from torch.nn.parallel import DistributedDataParallel

    module = getattr(stage, "submod", None)
    infer = getattr(stage, "_forward_metadata_inference", None)
    if not isinstance(module, DistributedDataParallel) or infer is None:
        return

    def quiet(*a: Any, **k: Any) -> Any:
        with module.no_sync():
            return infer(*a, **k)

    stage._forward_metadata_inference = quiet


# The optimizers a run can train with, by the words `plan --optimizer` accepts ("none" runs no update):
# torch's class and the arguments beside the learning rate (momentum: SGD with momentum 0.9).
OPTIMIZER_CLASSES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {}), "momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "adam": (torch.optim.Adam, {}), "adamw": (torch.optim.AdamW, {})}


def make_replica_optimizer(name: str, params: list[nn.Parameter], lr: float, sharding: str = "ddp",
                           mesh: Mesh | None = None) -> torch.optim.Optimizer | None:
    """The optimizer of a rank: None for "none" or a stage without parameters; torch's for one replica, ddp
    and fsdp (FSDP2's parameters are already shards); ZeroRedundancyOptimizer over the stage's replicas for
    zero1 (each steps its partition of whole tensors, then broadcasts it:
    torch/distributed/optim/zero_redundancy_optimizer.py)."""
    if name == "none" or not params:
        return None
    if name not in OPTIMIZER_CLASSES:
        raise StageplanError(f"unknown optimizer {name!r}; use one of none, {', '.join(OPTIMIZER_CLASSES)}")
    cls, extra = OPTIMIZER_CLASSES[name]
    if sharding != "zero1" or mesh is None or mesh.data_parallel == 1:
        return cls(params, lr=lr, **extra)  # type: ignore[call-arg]
    from torch.distributed.optim import ZeroRedundancyOptimizer

    # parameters_as_bucket_view: each replica's partition lives in one contiguous bucket, so the broadcast
    # after the step is one message per replica, not one per tensor (ZeRO-1's sync of the skewed GPT's 1 x 2
    # run took 129-154 ms against the 58 ms its all-gather is priced at, on gloo on a 2-core CPU host,
    # broadcasting tensor by tensor)
    optimizer = ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=mesh.dp_group, lr=lr,
                                        parameters_as_bucket_view=True, **extra)
    if next(iter(params)).device.type == "cpu":
        # the buckets took a copy of every parameter and freed the old storages, which glibc keeps resident
        # (under steady_allocator's thresholds). Handed back here; on CUDA the caching allocator reuses them.
        # Resident memory above baseline / plan on a 2 x 2 ZeRO-1 run of a 1 GB GPT (Adam), one run each on a
        # 2-core CPU host: 1.28-1.41 with bucket views, 1.21-1.31 with this, 1.17-1.20 broadcasting tensor by
        # tensor (whose sync took 3.5 x as long)
        release_free_memory()
    return optimizer


def full_value(param: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value on CPU: an FSDP2 shard (a DTensor) gathered over its replicas (collective:
    every replica of the stage calls it for the same parameters in the same order)."""
    full = getattr(param, "full_tensor", None)
    value = full() if callable(full) else param
    return value.detach().cpu().clone()


def local_bytes(tensors: Sequence[torch.Tensor | None]) -> int:
    """Bytes this rank holds of ``tensors``: an FSDP2 DTensor's local shard only, each storage once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        if not isinstance(local, torch.Tensor) or local.device.type == "meta":
            continue
        key = local.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += local.untyped_storage().nbytes()
    return total


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the optimizer's state this rank holds (ZeRO-1: its partition's only)."""
    if optimizer is None:
        return 0
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer steps its local optimizer
    return local_bytes([v for state in inner.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0])


class SyncClock(DeviceClock):
    """The data-parallel sync each step waits for, measured where torch runs it: FSDP2's reduce-scatter in
    each stage's ``perform_reduce_grad`` (after the last microbatch's backward) and its all-gather at the
    step's start (:meth:`gather`), ZeRO-1's broadcast of the
    stepped partitions (``ZeroRedundancyOptimizer._sync_params``), and DDP's all-reduce as what the last
    microbatch's backward took beyond the stage's other backwards (DDP reduces inside it: its buckets'
    all-reduces overlap the backward, and what is left is exposed). On the device's own clock
    (stageplan.measure): read :attr:`seconds` after the step's synchronisation."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # (begin, end, stage): a stage's reduce, or the optimizer's broadcast (stage None)
        self.spans: list[tuple[Any, Any, int | None]] = []
        # each stage's FSDP2 units, found once (attach) for the step's gather
        self.units: dict[int, list[Any]] = {}

    @property
    def seconds(self) -> float:
        return sum(self._seconds(a, b) for a, b, _ in self.spans)

    def timed(self, fn: Callable[..., Any], stage: int | None = None) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            begin = self._now()
            try:
                return fn(*a, **k)
            finally:
                self.spans.append((begin, self._now(), stage))
        return run

    def attach(self, stages: Sequence[Any], optimizer: Any) -> None:
        for st in stages:
            if hasattr(st, "perform_reduce_grad"):
                st.perform_reduce_grad = self.timed(st.perform_reduce_grad, int(st.stage_index))
        if optimizer is not None and hasattr(optimizer, "_sync_params"):
            optimizer._sync_params = self.timed(optimizer._sync_params)
        self.units = {int(st.stage_index): fsdp_units(st.submod) for st in stages}

    def gather(self) -> None:
        """Unshard (all-gather) every FSDP2 unit of each stage now, timed as that stage's sync: at a step's
        start, where FSDP2 not resharded after forward would otherwise gather each unit inside the first
        microbatch's forward, out of sight of the sync clock. ``FSDPModule.unshard`` is FSDP2's own call
        for it (torch/distributed/fsdp/_fully_shard/_fully_shard.py); the forward then finds the units
        gathered."""
        for stage, units in self.units.items():
            if units:
                self.timed(lambda units=units: [m.unshard() for m in units], stage)()


def fsdp_units(module: nn.Module) -> list[Any]:
    """The FSDP2 units in ``module`` (each ``fully_shard`` call's module, with its own ``unshard``); none in a
    module FSDP2 did not wrap."""
    return [m for m in module.modules() if callable(getattr(m, "unshard", None))]


def ddp_exposed(backwards: Sequence[tuple[int, int, float]], m: int) -> dict[int, float]:
    """DDP's exposed all-reduce in one step, per stage: its last microbatch's backward (``(stage,
    microbatch, seconds)`` of the step's backward calls) less the median of its other backwards, never
    below 0 (a stage with nothing to compare with: none)."""
    out: dict[int, float] = {}
    for s in sorted({st for st, _, _ in backwards}):
        own = [(mb, sec) for st, mb, sec in backwards if st == s]
        last = [sec for mb, sec in own if mb == m - 1]
        rest = [sec for mb, sec in own if mb != m - 1]
        if last and rest:
            out[s] = max(0.0, last[0] - median_iqr(rest)[0])
    return out


def ddp_exposed_s(backwards: Sequence[tuple[int, int, float]], m: int) -> float:
    """:func:`ddp_exposed` summed over the rank's stages (seconds)."""
    return sum(ddp_exposed(backwards, m).values())
