"""Build one rank's pipeline stages from a Plan: check the plan fits the model, cut the model, wrap each of
the rank's chunks in torch's PipelineStage, give it its optimizer and keep the tied parameters' gradients in
sync (torch)."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stageplan.errors import StageplanError
from stageplan.formats.plan import Plan
from stageplan.formats.schedule import check_microbatches
from stageplan.layers import CutModel, cut_layers, cut_stages, retarget_devices, used_parameters
from stageplan.materialize import (
    Checkpoint,
    init_empty_weights,
    materialize_,
    meta_copy,
    meta_parameter_names,
    real_parameters,
)
from stageplan.measure import microbatch, microbatch_size_for
from stageplan.workload import Workload, check_model_name, options_words


def first_microbatch_of_plan(workload: Workload, plan: Plan) -> tuple[Any, ...]:
    """The first of the plan's m microbatches of the workload's inputs (of a replica's share, with d
    replicas: the batch makes d x m microbatches), refusing a batch they do not divide."""
    size = microbatch_size_for(workload.batch_size, plan.num_microbatches * plan.data_parallel)
    return tuple(microbatch(workload.input_tuple(), 0, size))


def validate(workload: Workload, plan: Plan, *, world_size: int | None = None) -> None:
    """Refuse, before spawning anything, what would otherwise fail deep inside torch or hang a rank (the
    replicas' own refusals are :func:`stageplan.running.replicas.check_replicas`)."""
    t = int(plan.profile_meta.get("tensor_parallel") or 1)
    if world_size is not None and t > 1 and world_size != plan.num_ranks * t:
        p = plan.num_ranks
        raise StageplanError(
            f"world size {world_size} does not match the plan's {p} pipeline ranks x {t} tensor-parallel "
            f"shards = {p * t}; launch {p * t} processes (torchrun --nproc-per-node {p * t})")
    if world_size is not None and t == 1 and world_size != plan.num_ranks * plan.data_parallel:
        p, d = plan.num_ranks, plan.data_parallel
        raise StageplanError(
            f"world size {world_size} does not match the plan's {p} pipeline ranks x {d} replicas = {p * d}; "
            f"launch {p * d} processes (torchrun --nproc-per-node {p * d}), or plan for "
            f"{'--stages ' + str(world_size) if d == 1 else f'--data-parallel {max(1, world_size // p)}'}")
    # the model first: a plan of another model fails every later check too, and their remedies mislead
    check_model_name(workload.name, plan.profile_meta.get("model"))
    check_microbatches(plan.schedule, plan.num_ranks, plan.num_microbatches, plan.virtual_stages)
    check_same_model(workload, plan.profile_meta, "plan", plan.data_parallel)
    if plan.data_parallel > 1 and workload.batch_size % (plan.data_parallel * plan.num_microbatches):
        d, m = plan.data_parallel, plan.num_microbatches
        raise StageplanError(
            f"a global batch of {workload.batch_size} samples cannot be shared by {d} replicas into {m} "
            f"microbatches each (it must be a multiple of d x m = {d * m}); build the model with a batch of "
            f"{d * m * max(1, workload.batch_size // (d * m))}, or plan another --data-parallel or "
            "--microbatches")
    check_microbatch_size_of_plan(workload.batch_size // plan.data_parallel, plan)
    check_layers(workload.model, first_microbatch_of_plan(workload, plan), plan)


def _json_value(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def check_same_model(workload: Workload, meta: Mapping[str, Any], what: str, data_parallel: int = 1) -> None:
    """Refuse a plan (or profile: ``what``) measured on the same model built with other factory options, or in
    another dtype, than this workload: the layer names stay the same, so nothing else notices, and the run
    would compare another model with the prediction (gpt profiled with vocab_size=2048 and run without it
    trained the default 8192-token head: measured 4.6x the prediction, against 1.6x for the matched run).
    Every option both recorded is compared (a built-in model records its defaults too), except the batch size
    when ``data_parallel`` > 1: d replicas share a global batch, and the run checks that its d x m
    microbatches are the plan's size (:func:`check_microbatch_size_of_plan`)."""
    planned, model = meta.get("factory_options"), meta.get("model")
    same_name = isinstance(model, str) and model.rsplit(":", 1)[-1] == workload.name.rsplit(":", 1)[-1]
    if isinstance(planned, Mapping) and workload.factory_options and same_name:
        given = _json_value(dict(workload.factory_options))
        differing = sorted(k for k in planned if k in given and _json_value(planned[k]) != given[k]
                           and not (k == "batch_size" and data_parallel > 1))
        if differing:
            text = ", ".join(f"{k}={given[k]!r} ({what}: {planned[k]!r})" for k in differing)
            these = options_words(*(f"{k}={given[k]}" for k in differing))
            raise StageplanError(f"the {what} was made for {model} with other options: {text}; profile and "
                                 f"plan the model with these options ({these}), or set "
                                 f"them as the {what} has them")
    dtype = meta.get("dtype")
    params = workload.model.parameters() if workload.model is not None else ()
    own = next((str(t.dtype).removeprefix("torch.") for t in params if t.is_floating_point()), None)
    if isinstance(dtype, str) and own is not None and dtype != own:
        raise StageplanError(f"the {what} was profiled in {dtype}, and this run trains the model in its own "
                             f"{own}: its times and bytes are not this run's; profile without --dtype (or "
                             f"build the model in {dtype}) and plan that")


def check_microbatch_size_of_plan(batch: int, plan: Plan) -> None:
    """Refuse a run whose microbatches are not the size the plan priced: the plan keeps its profile's
    microbatch size for any number of microbatches (a plan of 70B at microbatch 1 for 64 of them), while a run
    splits this model's own batch into the plan's m, so a profile at microbatch 2 planned for 8 microbatches
    ran 8 of 1 sample and compared a 246 ms step with a 334 ms prediction for microbatches twice that size."""
    priced = (plan.cost_options or {}).get("microbatch_size")
    size = microbatch_size_for(batch, plan.num_microbatches)
    if isinstance(priced, int) and not isinstance(priced, bool) and priced != size:
        m = plan.num_microbatches
        fits = (f"plan --microbatches {batch // priced}, " if batch % priced == 0 else "")
        raise StageplanError(
            f"the plan prices {m} microbatches of {priced} sample{'s' * (priced != 1)} (a batch of "
            f"{m * priced}), and this model's batch of {batch} makes {m} microbatches of {size}, so its "
            f"predictions would not describe this run; {fits}profile at --microbatch-size {size} and plan "
            f"that, or build the model with a batch of {m * priced}")


def check_layers(model: nn.Module, args: tuple[Any, ...], plan: Plan) -> None:
    """Refuse a plan whose layers are not this model's: cutting would silently make another split."""
    layers_arg = plan.profile_meta.get("layers_arg")
    names = cut_layers(meta_copy(model), args, layers_arg).names  # cut a weightless copy: no second model
    if list(names) != list(plan.layer_names):
        diff = next((i for i, (a, b) in enumerate(zip(names, plan.layer_names)) if a != b),
                    min(len(names), len(plan.layer_names)))
        got = names[diff] if diff < len(names) else "(none)"
        want = plan.layer_names[diff] if diff < len(plan.layer_names) else "(none)"
        raise StageplanError(
            f"the plan does not match this model: it has {len(plan.layer_names)} layers, the model "
            f"{len(names)}; layer {diff} is {got!r} in the model but {want!r} in the plan (plan made for "
            f"{plan.profile_meta.get('model')!r}); profile and plan this model, with the same options "
            f"({options_words('KEY=VALUE')})"
        )


# The optimizers a run can train with: the same words `plan --optimizer` accepts ("none" runs no update).
OPTIMIZERS = ("none", "sgd", "momentum", "adam", "adamw")
DEFAULT_LR = {"none": 0.0, "sgd": 0.05, "momentum": 0.05, "adam": 1e-3, "adamw": 1e-3}


def make_optimizer(name: str, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer | None:
    """torch's optimizer for ``name`` (momentum: SGD with momentum 0.9); None for "none", or for a stage
    without parameters (an activation alone has nothing to update)."""
    from stageplan.running.replicas import make_replica_optimizer

    return make_replica_optimizer(name, params, lr)


def batch_target(workload: Workload) -> Any:
    """The target torch's schedule splits into microbatches. Without one (a Workload whose loss needs no
    target), a placeholder of the batch size is split instead, and the loss ignores it: torch's schedule
    indexes the target per microbatch whenever a loss function is given."""
    if workload.target is not None:
        return workload.target
    return torch.zeros(workload.batch_size)


TieGroup = tuple[list[str], nn.Parameter]


def tie_groups(model: nn.Module) -> list[TieGroup]:
    """FQN groups that name one shared parameter (e.g. an
    embedding tied to the LM head), with the parameter."""
    by_id: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), ([], p))[0].append(name)
    return [group for group in by_id.values() if len(group[0]) > 1]


def tie_holders(ties: list[TieGroup], cut: CutModel, plan: Plan) -> list[tuple[int, ...]]:
    """Per tie group, the ranks (ascending) whose stages use it under any of its names. Every rank works it
    out alike from the plan and the model, so all of them create the same process groups in the same order."""
    used = [set(used_parameters(piece.module)) for piece in cut.pieces]
    return [tuple(sorted({plan.stages[s].rank for s, fqns in enumerate(used) if fqns.intersection(names)}))
            for names, _ in ties]


def ties_across_ranks(ties: list[TieGroup], cut: CutModel, plan: Plan) -> list[bool]:
    """Per tie group, whether the plan's stages that use it run on two or more ranks: only then is its
    gradient summed across ranks."""
    return [len(ranks) > 1 for ranks in tie_holders(ties, cut, plan)]


def tie_process_groups(holders: Sequence[tuple[int, ...]], rank: int, group: Any = None) -> list[Any]:
    """Per tie group, the process group of the ranks holding it, where this rank is one of them and the tie
    spans two or more ranks; else None. The tie's gradient is summed over its k holders only, as Megatron-LM
    sums the word embeddings' over its embedding group of the first and last stage (``_EMBEDDING_GROUP`` in
    megatron/core/parallel_state.py): a middle rank neither allocates a buffer for it nor joins the
    collective. Over the whole pipeline (``group`` None: the world) every rank calls ``dist.new_group`` for
    every spanning tie in the same order, as torch requires of a new group's creation; under a ``group`` of
    the caller's (one pipeline among several), only the holders create it (``use_local_synchronization``),
    since the other pipelines create their own. A tie on all the pipeline's ranks uses ``group`` itself."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return [None] * len(holders)
    world = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    groups: list[Any] = []
    for ranks in holders:
        if len(ranks) < 2:
            groups.append(None)
        elif len(ranks) == len(world):
            groups.append(group if rank in ranks else None)
        elif group is None:
            made = dist.new_group([world[r] for r in ranks])
            groups.append(made if rank in ranks else None)
        elif rank in ranks:
            groups.append(dist.new_group([world[r] for r in ranks], use_local_synchronization=True))
        else:
            groups.append(None)
    return groups


@dataclass
class RankStages:
    """What one rank runs: its PipelineStage objects (one per chunk it holds), the parameters they use by FQN,
    the unique parameters (for the optimizer), the model's tie groups, which of them the plan puts on two
    or more ranks and, per tie, the process group of its holders where this rank is one (for
    :func:`sync_tied_grads`)."""

    stages: list[Any]
    indices: list[int]
    params: dict[str, nn.Parameter]
    unique_params: list[nn.Parameter]
    ties: list[TieGroup]
    ties_across: list[bool]
    tie_groups: list[Any] = field(default_factory=list)
    # each stage's own module, unwrapped (its FQNs are the model's): a stage's submod may be DDP around it
    pieces: list[nn.Module] = field(default_factory=list)


def cut_rank_stages(model: nn.Module, plan: Plan, mb_args: tuple[Any, ...], device: torch.device) -> CutModel:
    """``model`` cut at the plan's boundaries (every stage's piece, parameters as the model has them), its
    pieces aimed at ``device``. Nothing is materialised: with the model on meta, what this costs is the
    trace's own objects (torch.export's graph of the whole model: 58 MB resident in a fresh process for the
    24-block GPT at d_model 1280, kept after the cut is dropped, measured on a 2-core CPU host)."""
    cut = cut_stages(model, mb_args, plan.layer_names, plan.boundaries, plan.profile_meta.get("layers_arg"))
    retarget_devices(cut, device)  # a trace with meta tensors flowing bakes device=meta into the pieces
    return cut


def build_rank_stages(model: nn.Module, plan: Plan, rank: int, device: torch.device, mb_args: tuple[Any, ...],
                      *, weights: Checkpoint | None = None, seed: int = 0, group: Any = None,
                      wrap: Callable[[nn.Module, list[str]], nn.Module] | None = None,
                      cut: CutModel | None = None) -> RankStages:
    """Cut ``model`` (parameters on meta, or real) at the plan's boundaries, give only this rank's chunks real
    parameters (from ``weights``, else initialised by FQN) and wrap them in PipelineStage objects. ``rank``
    is the pipeline rank and ``group`` the pipeline's process group (None: the world). ``wrap(piece,
    layer_names)`` wraps each stage for its data-parallel replicas (:func:`stageplan.running.replicas.
    wrap_stage`) before its PipelineStage is made. ``cut``: the model already cut at the plan's boundaries
    (:func:`cut_rank_stages`), used as it is; None cuts it here."""
    from torch.distributed.pipelining import PipelineStage

    S = plan.num_chunks
    mine = [s for s, st in enumerate(plan.stages) if st.rank == rank]
    ties = tie_groups(model)
    if cut is None:
        cut = cut_rank_stages(model, plan, mb_args, device)
    holders = tie_holders(ties, cut, plan)  # a spanning tie this rank does not hold costs it nothing
    across = [len(ranks) > 1 for ranks in holders]
    tie_pgs = tie_process_groups(holders, rank, group)
    stages = []
    pieces: list[nn.Module] = []
    for s in mine:
        piece = cut.pieces[s].module
        materialize_(piece,
                     real_parameters(model, meta_parameter_names(piece), device, weights=weights, seed=seed))
        if plan.cost_options.get("recompute"):
            _recompute(piece)
        piece = piece.to(device)
        module = wrap(piece, list(plan.layer_names[plan.boundaries[s]:plan.boundaries[s + 1]])) if wrap \
            else piece
        pieces.append(piece)
        if cut.method == "export":
            if module is not piece:  # the stage is built from the pipe's own child: put the wrapper there
                split = cut.pipe.split_gm  # type: ignore[attr-defined]
                name = next(n for n, child in split.named_children() if child is piece)
                setattr(split, name, module)
            stages.append(cut.pipe.build_stage(s, device, group=group))  # type: ignore[attr-defined]
        else:
            stages.append(PipelineStage(module, s, S, device, group=group))
    _no_warmup_to_self(stages)
    params: dict[str, nn.Parameter] = {}
    every: list[nn.Parameter] = []
    for piece in pieces:  # after wrapping: FSDP2 replaced the parameters with its shards
        used = used_parameters(piece)
        params.update(used)
        # the optimizer's: the parameters the stage uses (an exported stage can hold a tied head's unused
        # alias, which would get states, or a share of ZeRO-1's partition, and never a gradient)
        every.extend(used.values())
    unique = list({id(p): p for p in every}.values())
    return RankStages(stages, mine, params, unique, ties, across, tie_pgs, pieces)


def _no_warmup_to_self(stages: list[Any]) -> None:
    """torch 2.13 warms up stages that are not PipelineStage (the export cut's) by a send and a receive to
    each neighbouring stage, even where that neighbour runs on this rank (ZBVZeroBubble's V puts stages p - 1
    and p on rank p - 1, and its first and last on rank 0). gloo has no pair from a rank to itself ("Pair is
    not connected"), and the schedule hands those tensors over locally anyway, so the warm-up's messages to
    this rank are dropped."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    me = dist.get_rank()
    for st in stages:
        original = getattr(st, "_get_init_p2p_neighbors_ops", None)
        if original is None:
            continue

        def ops(original: Any = original) -> list[Any]:
            return [op for op in original() if op.peer != me]

        st._get_init_p2p_neighbors_ops = ops


def _recompute(module: nn.Module) -> None:
    """Activation recomputation as the plan priced it (Chen et al. 2016): the stage keeps only its inputs for
    the backward and runs its forward again inside it (torch.utils.checkpoint, non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = recomputed


def sync_tied_grads(ties: list[TieGroup], params: dict[str, nn.Parameter], device: torch.device,
                    group: Any = None, across: Sequence[bool] | None = None,
                    groups: Sequence[Any] | None = None) -> None:
    """Sum a tied parameter's gradients over every stage that holds a copy: each copy's own gradient is only
    its stage's share, so every copy is wrong alone (by about 2e-2 for a tied embedding and LM head) and their
    sum is the tie's gradient, as Megatron-LM sums the word embedding's gradients between its first and last
    stage (``_allreduce_word_embedding_grads`` in megatron/core/distributed/finalize_model_grads.py).

    A tie the plan puts on two or more ranks (``across``, from :func:`ties_across_ranks`; None: every tie) is
    all-reduced over the process group of its holders (``groups[g]``, from :func:`tie_process_groups`; without
    ``groups``, over ``group``, which must then be exactly its holders). A rank that holds no copy does
    nothing: no buffer, no collective. On a rank, the copies' own ``.grad`` tensors are used: the others are
    added into the first, which is all-reduced in place, and copied back into the others (no fresh buffer,
    so a wrapper that keeps its own gradient buffers, DDP's or FSDP's, keeps them). In place, HF GPT-2's 4
    MiB tie took its last rank 2.92 ms against 4.06 ms through a buffer (medians of 8 runs each, measured on a
    2-core CPU host). A tie on one rank is summed over that rank's copies, with no communication."""
    import torch.distributed as dist

    for g, (names, _) in enumerate(ties):
        local = list({id(params[n]): params[n] for n in names if n in params}.values())
        spans = across is None or across[g]
        if not local or (not spans and len(local) < 2):
            continue  # no copy here, or this rank's one copy is the whole tie: nothing to add
        grads = [p.grad for p in local if p.grad is not None]
        # with no gradient (a copy the backward did not reach), zeros still take part in the holders' sum (an
        # FSDP2 shard's zeros are a shard too)
        total = grads[0] if grads else torch.zeros_like(local[0])
        for grad in grads[1:]:
            total += grad
        if spans:
            # an FSDP2 gradient is a DTensor: each holder reduces its own shard, and the holders (one per
            # pipeline stage, same replica index) hold the same rows of the tie
            shard = total.to_local() if hasattr(total, "to_local") else total
            dist.all_reduce(shard, group=groups[g] if groups is not None else group)
        for p in local:
            if p.grad is None:
                p.grad = total.clone()
            elif p.grad is not total:
                p.grad.copy_(total)


def reference_model(model: nn.Module, device: torch.device, *, weights: Checkpoint | None = None,
                    seed: int = 0) -> nn.Module:
    """The whole model with the same real parameters the ranks get (for the single-process check)."""
    ref = meta_copy(model) if meta_parameter_names(model) else copy.deepcopy(model)
    return materialize_(ref, real_parameters(model, meta_parameter_names(ref), device, weights=weights,
                                             seed=seed)).to(device)


@dataclass
class RankPipeline:
    """This rank's part of a planned pipeline, for the user's own training loop.

    ``schedule`` is torch's schedule object (``.step(*inputs)`` on the first rank, ``.step(target=...,
    losses=...)`` on the last); ``modules`` are this rank's model parts, for the optimizer; call
    :meth:`sync_tied_grads` after the step and before ``optimizer.step()`` (tied weights, such as an
    embedding shared with the LM head, are summed across the ranks that hold them).
    """

    schedule: Any
    modules: list[nn.Module]
    stage_indices: list[int]
    _ties: list[TieGroup]
    _params: dict[str, nn.Parameter]
    _device: torch.device
    _group: Any = None

    def parameters(self) -> list[nn.Parameter]:
        """This rank's distinct parameters, those its stages use (FSDP2's shards under fsdp)."""
        return list({id(p): p for p in self._params.values()}.values())

    def sync_tied_grads(self) -> None:
        sync_tied_grads(self._ties, self._params, self._device, self._group, self._ties_across,
                        self._tie_groups)

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        return self._num_chunks - 1 in self.stage_indices

    _num_chunks: int = 1
    # per tie group, whether it spans ranks (None: all-reduce every one)
    _ties_across: list[bool] | None = None
    # per tie group, the process group of its holders where this rank is one (tie_process_groups)
    _tie_groups: list[Any] | None = None
    # with data-parallel replicas: this rank's place in the ("pp", "dp") mesh and the sharding its stages
    # were wrapped for (stageplan.running.replicas)
    mesh: Any = None
    sharding: str = "ddp"

    def share(self, batch: Any) -> Any:
        """This rank's replica's share of a global batch (dim 0, contiguous); the batch itself with one
        replica."""
        from stageplan.running.replicas import replica_share

        if self.mesh is None:
            return batch
        return replica_share(batch, self.mesh.dp_rank, self.mesh.data_parallel)

    def optimizer(self, name: str = "adamw", lr: float = 1e-3) -> torch.optim.Optimizer | None:
        """The optimizer that fits the sharding, over this rank's parameters: ZeroRedundancyOptimizer over
        the stage's replicas for zero1, torch's own otherwise (FSDP2's parameters are already shards).
        ``name``: sgd, momentum, adam or adamw."""
        from stageplan.running.replicas import make_replica_optimizer

        return make_replica_optimizer(name, self.parameters(), lr, self.sharding, self.mesh)


def build_pipeline(model_fn: Callable[[], nn.Module], plan: Plan | str | os.PathLike[str], *, rank: int,
                   world_size: int,
                   device: str | torch.device = "cpu", loss_fn: Callable[[Any, Any], Any] | None = None,
                   weights: str | os.PathLike[str] | Mapping[str, torch.Tensor] | None = None,
                   group: Any = None, example_inputs: Any = None, seed: int = 0,
                   sharding: str | None = None) -> RankPipeline:
    """Build this rank's stages of ``plan`` for a training
    loop of your own (torchrun, an initialised process group).

    ``model_fn()`` builds the model; it is called with parameters on meta, so nothing but this rank's stage is
    ever materialised. The stage's tensors come from ``weights`` (a .safetensors file, an HF folder with
    ``model.safetensors.index.json``, or a state dict; a tied tensor stored once is read through its tie; only
    a tensor that is truly absent is an error, naming it), else from an initialisation keyed by FQN, the same
    on
    every rank. ``example_inputs`` (one microbatch) are needed to cut a model that is not an
    ``nn.Sequential``.

    A plan with d > 1 data-parallel replicas (``plan --data-parallel``, or a layout's best) takes p x d
    ranks on a ("pp", "dp") mesh (rank r at (r // d, r % d)), every stage wrapped for ``sharding`` (default:
    the plan's; ddp, zero1, fsdp or fsdp-reshard); feed each rank ``pipe.share(batch)`` of the global batch,
    and step ``pipe.optimizer(...)``, which fits the sharding.
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    from stageplan.running.replicas import check_replicas, make_mesh, no_sync_inference, wrap_stage

    the_plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    p, d = the_plan.num_ranks, the_plan.data_parallel
    t = int(the_plan.profile_meta.get("tensor_parallel") or 1)
    if t > 1:
        raise StageplanError(f"this plan shards each block {t} ways (tensor parallelism), which "
                             "build_pipeline does not set up for a loop of your own yet; train it with "
                             "stageplan run (CLI: stageplan run MODEL --plan PLAN.json), or lay it out with "
                             "--tensor-parallel 1")
    if world_size != p * d or not 0 <= rank < world_size:
        raise StageplanError(f"rank {rank} of world size {world_size} does not fit the plan's {p} ranks x "
                             f"{d} replicas; launch {p * d} processes (torchrun --nproc-per-node {p * d})")
    the_sharding = sharding or str(the_plan.cost_options.get("sharding") or "ddp")
    check_replicas(the_plan, the_sharding)
    if d > 1 and group is not None:
        raise StageplanError("group= names one pipeline's process group, and this plan has "
                             f"{d} replicas, whose groups build_pipeline makes itself (a ('pp', 'dp') mesh); "
                             "drop group=")
    dev = torch.device(device)
    with init_empty_weights():
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise StageplanError(f"model_fn must return a torch.nn.Module, got {type(model).__name__}")
    model.train()
    if example_inputs is None:
        if not isinstance(model, nn.Sequential):
            raise StageplanError(f"{type(model).__name__} is not an nn.Sequential, so cutting it at the "
                                 "plan's layers needs one microbatch of inputs: pass example_inputs=(x,)")
        mb_args: tuple[Any, ...] = ()
    else:
        raw = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        mb_args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in raw)
    check_layers(model, mb_args, the_plan)
    source = Checkpoint(weights) if weights is not None else None
    mesh = make_mesh(rank, p, d, dev)
    rs = build_rank_stages(model, the_plan, mesh.pp_rank, dev, mb_args, weights=source, seed=seed,
                           group=mesh.pp_group if d > 1 else group,
                           wrap=(lambda piece, names: wrap_stage(piece, names, the_sharding, mesh)) if d > 1
                           else None)
    for st in rs.stages:
        no_sync_inference(st)
    cls = get_schedule_class(the_plan.schedule)
    single = issubclass(cls, PipelineScheduleSingle)
    schedule = cls(rs.stages[0] if single else rs.stages, n_microbatches=the_plan.num_microbatches,
                   loss_fn=loss_fn)
    return RankPipeline(schedule, [st.submod for st in rs.stages], rs.indices, rs.ties, rs.params, dev,
                        mesh.pp_group if d > 1 else group, the_plan.num_chunks, rs.ties_across, rs.tie_groups,
                        mesh if d > 1 else None, the_sharding)
