"""Tensor-parallel shards of a pipeline stage: the ("pp", "tp") mesh's refusals, an HF decoder's own tensor-
parallel plan applied with DTensor to the blocks a rank holds, and the count of its all-reduces (torch).

A plan of p pipeline ranks whose layers are t-way shards (``stageplan layout ... --tensor-parallel t``) runs
on p x t processes. Global rank r sits at (pp, tp) = (r // t, r % t): the shards of one stage are neighbours,
as torchtitan keeps tensor parallelism innermost (``ParallelDims.build_mesh`` in
torchtitan/distributed/parallel_dims.py). Each shard holds the whole hidden states at the stage's
boundaries (no sequence parallelism), so the pipeline's sends go between the same tp coordinate of
neighbouring stages, over the pp group of ranks that share it.

Each decoder block is sharded as its config class's ``base_model_tp_plan`` says (transformers, e.g.
``LlamaConfig.base_model_tp_plan`` in transformers/models/llama/configuration_llama.py): "colwise" with
torch's ``ColwiseParallel`` and "rowwise" with ``RowwiseParallel`` (torch/distributed/tensor/parallel/
style.py). Applied linear by linear, each column-parallel linear turns its input into a replicated DTensor
of its own, so the backward all-reduces the gradient of the attention's input three times (q, k, v) and the
MLP's twice (gate, up): five all-reduces a block where Megatron's f operator has two (Shoeybi et al. 2019,
section 3), measured 20 against 8 over four blocks of a LLaMA with torch 2.13 on gloo. The column-parallel
linears of one module that take the same tensor share one replicated DTensor here (:func:`_share_inputs`),
so their gradients are summed locally first and all-reduced once, as the cost model prices it
(``stageplan.planning.sharding.tensor_parallel_block_s``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stageplan.errors import StageplanError
from stageplan.formats.plan import Plan

# The schedules a tensor-parallel run is tested with (tests/integration/test_tensor.py); the zero-bubble
# schedules split the backward with torch.autograd.grad on chosen inputs, which DTensor's parameters do not
# follow, and interleaving is not covered yet.
TP_SCHEDULES = ("GPipe", "1F1B")
# transformers' style names this module maps onto torch's parallel styles
STYLE_NAMES = ("colwise", "rowwise")


def plan_tensor_parallel(plan: Plan) -> int:
    """t, the tensor-parallel degree the plan's profile was taken at (1: whole layers)."""
    return int(plan.profile_meta.get("tensor_parallel") or 1)


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The HF model's own tensor-parallel plan (its config's ``base_model_tp_plan``: module patterns relative
    to the base model, to style names), refusing a model that has none."""
    config = getattr(model, "config", None)
    tp_plan = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not tp_plan:
        raise StageplanError(
            f"tensor parallelism shards a model as its HF config's base_model_tp_plan says, and "
            f"{type(model).__name__} has none; run it with a plan at --tensor-parallel 1, or use an HF "
            "decoder (llama, mistral, qwen2)")
    return dict(tp_plan)


def tp_styles(tp_plan: Mapping[str, str]) -> dict[str, Any]:
    """torch's parallel style for each module of one decoder block, by its FQN within the block, from an HF
    ``base_model_tp_plan`` ("layers.*.self_attn.q_proj": "colwise" -> "self_attn.q_proj": ColwiseParallel()),
    refusing a style or a pattern this module does not run."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    classes = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    out: dict[str, Any] = {}
    for pattern, style in tp_plan.items():
        if style not in classes:
            raise StageplanError(
                f"the model's tensor-parallel plan shards {pattern!r} as {style!r}, and stageplan run "
                f"applies only {' and '.join(STYLE_NAMES)} (torch's ColwiseParallel and RowwiseParallel); "
                "run it with a plan at --tensor-parallel 1")
        found = re.fullmatch(r"layers\.\*\.(.+)", pattern)
        if found is None:
            raise StageplanError(
                f"the model's tensor-parallel plan names {pattern!r}, outside its decoder blocks "
                "(layers.*.NAME), which stageplan run does not shard; run it with a plan at "
                "--tensor-parallel 1")
        out[found[1]] = classes[style]()
    return out


def check_tensor_parallel_run(model: nn.Module, plan: Plan) -> None:
    """Refuse, before any rank starts, a tensor-parallel plan this executor does not run: replicas beside the
    shards, a schedule other than GPipe or 1F1B, sequence parallelism, a model without an HF tensor-parallel
    plan, and t not dividing the heads, key/value heads or the MLP's intermediate size."""
    t = plan_tensor_parallel(plan)
    if t <= 1:
        return
    if plan.data_parallel > 1:
        raise StageplanError(
            f"this plan has {plan.data_parallel} data-parallel replicas of {t}-way tensor-parallel shards, "
            "and stageplan run trains replicas or shards, not both yet; lay it out with --tensor-parallel 1, "
            f"or with --devices {plan.num_ranks * t} for one replica")
    if plan.schedule not in TP_SCHEDULES:
        raise StageplanError(
            f"a tensor-parallel run (t = {t}) is tested with {' and '.join(TP_SCHEDULES)}, not "
            f"{plan.schedule}; lay it out with --schedule 1F1B")
    if plan.profile_meta.get("sequence_parallel"):
        raise StageplanError(
            f"this plan uses sequence parallelism with its {t}-way shards, which stageplan run does not "
            "apply (each shard holds the whole sequence); lay it out without --sequence-parallel")
    tp_styles(model_tp_plan(model))  # a model without a plan, or with styles this module does not apply
    config: Any = model.config  # model_tp_plan found it
    heads = int(config.num_attention_heads)
    fields = (("attention heads", heads), ("key/value heads", int(getattr(config, "num_key_value_heads",
                                                                          None) or heads)),
              ("intermediate size", int(getattr(config, "intermediate_size", 0) or 0)))
    for what, n in fields:
        if n and n % t:
            raise StageplanError(f"tensor-parallel degree {t} does not divide the model's {what} ({n}); lay "
                                 "it out with a --tensor-parallel degree that divides it")


def _as_linear(module: nn.Module, name: str) -> nn.Linear:
    """An exported piece's unflattened linear (an InterpreterModule whose graph is one ``aten.linear`` on its
    own weight and bias) as the ``nn.Linear`` it was, sharing the same parameters: torch's parallel styles
    shard only ``nn.Linear`` (and embeddings). A module that is an ``nn.Linear`` already is returned as is."""
    if isinstance(module, nn.Linear):
        return module
    graph = getattr(module, "graph", None)
    calls = [n for n in graph.nodes if n.op in ("call_function", "call_module", "call_method")] \
        if isinstance(graph, torch.fx.Graph) else []
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    if len(calls) != 1 or calls[0].target is not torch.ops.aten.linear.default \
            or not isinstance(weight, nn.Parameter) or weight.dim() != 2:
        raise StageplanError(f"the tensor-parallel plan shards {name} as a linear layer, and it is a "
                             f"{type(module).__name__} that does not run one; run it with a plan at "
                             "--tensor-parallel 1")
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = weight
    if bias is not None:
        linear.bias = bias
    return linear


@dataclass
class _SharedInput:
    """The replicated DTensor made of the last tensor the column-parallel linears of one module took."""

    local: Any = None
    shared: Any = None


def _share_inputs(block: nn.Module, colwise: Sequence[str], tp_mesh: Any) -> None:
    """Make the column-parallel linears of each module in ``block`` (q, k and v under the attention; gate and
    up under the MLP) that take the very same tensor take one replicated DTensor made of it: ColwiseParallel
    then finds its input a DTensor already and makes none of its own, and the backward sums the linears'
    partial gradients locally and all-reduces them once (the module docstring says why). The DTensor is
    dropped when the module's forward ends, so no step's tensors outlive it."""
    from torch.distributed.tensor import DTensor, Replicate

    groups: dict[str, list[str]] = {}
    for name in colwise:
        groups.setdefault(name.rpartition(".")[0], []).append(name)
    for parent, names in groups.items():
        if len(names) < 2:
            continue
        cache = _SharedInput()

        def share(_mod: nn.Module, args: tuple[Any, ...], cache: _SharedInput = cache) -> Any:
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
                return None
            if cache.local is not x:
                cache.local = x
                cache.shared = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)
            return (cache.shared, *args[1:])

        def drop(_mod: nn.Module, _args: Any, _out: Any, cache: _SharedInput = cache) -> None:
            cache.local = cache.shared = None

        for name in names:
            # before ColwiseParallel's own input hook, which then leaves the DTensor as it is
            block.get_submodule(name).register_forward_pre_hook(share, prepend=True)
        (block.get_submodule(parent) if parent else block).register_forward_hook(drop)


def parallelize_stage(piece: nn.Module, layer_names: Sequence[str], tp_mesh: Any,
                      tp_plan: Mapping[str, str], base_prefix: str) -> nn.Module:
    """Shard, in place, each decoder block of ``piece`` (one stage, parameters real) named in ``layer_names``
    (FQNs ``{base_prefix}layers.K``) over ``tp_mesh`` as ``tp_plan`` says; the embedding, the norms and the
    LM head stay whole on every shard (the HF plan does not name them). Returns ``piece``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    block_name = re.compile(re.escape(base_prefix) + r"layers\.\d+")
    for name in layer_names:
        if not block_name.fullmatch(name):
            continue
        try:
            block = piece.get_submodule(name)
        except AttributeError:
            continue
        styles = tp_styles(tp_plan)
        for sub in styles:
            parent, _, leaf = sub.rpartition(".")
            owner = block.get_submodule(parent) if parent else block
            setattr(owner, leaf, _as_linear(block.get_submodule(sub), f"{name}.{sub}"))
        colwise = [s for s, style in styles.items() if isinstance(style, ColwiseParallel)]
        _share_inputs(block, colwise, tp_mesh)
        parallelize_module(block, tp_mesh, styles)
    return piece


def base_prefix(model: nn.Module) -> str:
    """The FQN prefix of an HF model's base model (``model.`` in LlamaForCausalLM), which the patterns of its
    ``base_model_tp_plan`` are relative to."""
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    return f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""


def _all_reduce_mode() -> Any:
    """A dispatch mode that counts the all-reduces dispatched under it (``count``): DTensor's functional
    ones (``_c10d_functional::all_reduce``, which its redistributions issue) and c10d's in-place
    ``allreduce_``. torch's CommDebugMode counts the same ops, but its module tracker fails on a forward that
    torch.utils.checkpoint recomputes inside the backward (KeyError on the module's name, torch 2.13)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class AllReduces(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = str(getattr(getattr(func, "_schema", None), "name", ""))
            if name.endswith(("::all_reduce", "::all_reduce_", "::allreduce_")):
                self.count += 1
            return func(*args, **(kwargs or {}))

    return AllReduces()


@dataclass
class CollectiveCounter:
    """The all-reduces one rank's chunk calls issue (:func:`_all_reduce_mode`: forward and backward; the
    pipeline's sends are point-to-point and not counted) while :attr:`enabled`: forward calls' apart from
    backward calls' (a recomputed forward runs inside its backward and counts there)."""

    enabled: bool = False
    counts: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})

    def wrap(self, stage: Any) -> None:
        for attr, kind in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                           ("backward_weight_one_chunk", "backward")):
            call = getattr(stage, attr, None)
            if call is not None:
                setattr(stage, attr, self._counted(call, kind))

    def _counted(self, call: Any, kind: str) -> Any:
        def counted(*a: Any, **k: Any) -> Any:
            if not self.enabled:
                return call(*a, **k)
            mode = _all_reduce_mode()
            with mode:
                out = call(*a, **k)
            self.counts[kind] += mode.count
            return out
        return counted
