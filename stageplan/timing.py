"""Layer timing both the profiler and a run's retiming use (torch): a layer cut from a meta copy, given real
weights, run forward, backward into empty grads and backward accumulating, in rounds over all the layers
timed; medians and spreads with :mod:`stageplan.measure`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stageplan.errors import StageplanError
from stageplan.layers import (
    CutModel,
    Piece,
    cut_layers,
    resolve,
    retarget_devices,
    store_outputs,
    used_parameters,
)
from stageplan.materialize import (
    Checkpoint,
    materialize_,
    meta_copy,
    meta_parameter_names,
    real_parameters,
)
from stageplan.measure import (
    Timer,
    first_microbatch,
    median_iqr,
    timed_rounds,
)
from stageplan.workload import Workload

# The orders a profile times its layers in (profile_model's ``order``): as a stage runs them, or each alone
ORDERS = ("stage", "layer")


def to_device(value: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device, dtype) for v in value)
    return value


def grad_tensors(out: Any) -> list[torch.Tensor]:
    flat = [out] if isinstance(out, torch.Tensor) else [
        t for t in (out if isinstance(out, (tuple, list)) else []) if isinstance(t, torch.Tensor)]
    return [t for t in flat if t.requires_grad]


def zero_grads(params: Sequence[nn.Parameter], inputs: Sequence[Any]) -> None:
    for p in params:
        p.grad = None
    for t in inputs:
        if isinstance(t, torch.Tensor):
            t.grad = None


# --------------------------------------------------------------------------------------------------
# Measuring one layer


@dataclass
class LayerRun:
    """One piece ready to measure: its distinct parameters, its detached inputs and its forward."""

    params: list[nn.Parameter]
    inputs: list[Any]
    fwd: Callable[[], Any]
    module: nn.Module


def param_identity(p: nn.Parameter) -> int:
    # by storage for real tensors (an exported piece can hold
    # two objects on one tied storage), by object on meta
    return p.data_ptr() if p.device.type != "meta" else id(p)


def distinct_params(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    return list({param_identity(p): p for p in params}.values())


def make_run(
    piece: Piece, k: int, n: int, values: Sequence[Any], workload: Workload, target: Any
) -> LayerRun:
    params = distinct_params(list(used_parameters(piece.module).values()))
    inputs: list[Any] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            v = v.detach().clone()
            if k > 0 and v.is_floating_point():
                v.requires_grad_(True)  # a later stage computes the gradient of what it received
        inputs.append(v)

    def fwd(module: nn.Module = piece.module, inputs: list[Any] = inputs, last: bool = k == n - 1) -> Any:
        out = module(*inputs)
        return workload.compute_loss(out, target) if last else out

    return LayerRun(params, inputs, fwd, piece.module)


def fwd_bwd_time(timer: Timer, run: LayerRun) -> tuple[float, float, float]:
    """Forward; backward into empty .grad (autograd hands its buffer over: a step's first microbatch);
    backward again into the filled .grad (an add: every later microbatch of a pipeline step)."""

    def bwd_time() -> float:
        out = run.fwd()
        tensors = grad_tensors(out)
        if not tensors:
            return 0.0
        grads = [torch.ones_like(t) for t in tensors]
        t_b, _ = timer(lambda: torch.autograd.backward(tensors, grads))
        return t_b

    t_f, out = timer(run.fwd)
    del out
    zero_grads(run.params, run.inputs)
    t_first = bwd_time()
    zero_grads([], run.inputs)
    t_acc = bwd_time()
    zero_grads(run.params, run.inputs)
    return t_f, t_first, t_acc


def chain_time(timer: Timer, runs: Sequence[LayerRun]) -> list[tuple[float, float, float]]:
    """The runs in a stage's order: every forward in turn, then every backward in reverse, each timed (into
    empty grads), then the same again with the backwards accumulating. A stage runs a layer's backward after
    the next layer's, with the rest of the model's forwards and backwards since its own forward; timed right
    after its own forward (:func:`fwd_bwd_time`) it reads its saved activations hot. Here, in one process: the
    GPT's blocks' backward 1.05-1.12x their hot figure, the block before its 16384-token head 1.34x (the
    head's backward evicts it), the head 1.03x. Returns, per run, (forward, backward, accumulating
    backward)."""

    def backward(run: LayerRun, out: Any) -> float:
        tensors = grad_tensors(out)
        if not tensors:
            return 0.0
        grads = [torch.ones_like(t) for t in tensors]
        return timer(lambda: torch.autograd.backward(tensors, grads))[0]

    forward: list[float] = []
    outs: list[Any] = []
    for run in runs:
        t_f, out = timer(run.fwd)
        forward.append(t_f)
        outs.append(out)
    first = [0.0] * len(runs)
    for i in reversed(range(len(runs))):
        # empty grads: a weight tied to a later layer's must not read that layer's gradient as its own
        zero_grads(runs[i].params, [])
        first[i] = backward(runs[i], outs[i])
        outs[i] = None
    zero_grads([], [v for run in runs for v in run.inputs])  # a new microbatch's inputs: no gradient yet
    outs = [run.fwd() for run in runs]
    acc = [0.0] * len(runs)
    for i in reversed(range(len(runs))):
        acc[i] = backward(runs[i], outs[i])
        outs[i] = None
    for run in runs:
        zero_grads(run.params, run.inputs)
    return [(forward[i], first[i], acc[i]) for i in range(len(runs))]


def time_rounds(runs: Sequence[LayerRun], timer: Timer, warmup: int, repeats: int,
                 whole: Callable[[], float] | None = None,
                 on_round: Callable[[int], None] | None = None,
                 min_time_s: float = 0.0, chain: bool = False,
                 max_time_s: float = math.inf) -> tuple[list[list[list[float]]], list[float]]:
    """Rounds: each round times every run's forward and backward (and the whole model once), so that a load
    change on the machine hits all of them alike (medians are taken across rounds). Timed rounds go on past
    ``repeats`` until they span ``min_time_s`` seconds, so that the medians average over the machine's own
    drift rather than catch one moment of it, and stop early past ``max_time_s`` (all the runs' rounds
    together; :func:`stageplan.measure.timed_rounds`). ``chain``: the runs in a stage's order
    (:func:`chain_time`), else each backward right after its own forward (:func:`fwd_bwd_time`). Returns,
    per run, [forward, backward, accumulating backward] samples, and the whole-model samples."""
    samples: list[list[list[float]]] = [[[], [], []] for _ in runs]
    whole_times: list[float] = []
    for rnd, timed in timed_rounds(warmup, repeats, min_time_s, max_time_s):
        rows = chain_time(timer, runs) if chain else [fwd_bwd_time(timer, run) for run in runs]
        for i, times in enumerate(rows):
            if timed:
                for j in range(3):
                    samples[i][j].append(times[j])
        if whole is not None:
            t_w = whole()
            if timed:
                whole_times.append(t_w)
        if on_round is not None:
            on_round(rnd + 1)
    return samples, whole_times


# --------------------------------------------------------------------------------------------------
# The model on meta: weightless copies, cast parameters, device constants of a meta trace


def cast_parameters_(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """Give ``model``'s floating parameters (meta or real; ties kept) and persistent floating buffers
    ``dtype``. Non-persistent buffers keep theirs: they are computed at construction on purpose (RoPE
    ``inv_freq`` in float32), as when the model is built under torch.set_default_dtype."""
    if dtype is None:
        return model
    made: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            mod._parameters[name] = made[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_floating_point() and name not in mod._non_persistent_buffers_set:
                mod._buffers[name] = b.to(dtype)
    return model


def typed_meta_copy(model: nn.Module, dtype: torch.dtype | None, buffers_to: torch.device) -> nn.Module:
    """A copy of ``model`` with its parameters on meta (never a second real copy) in ``dtype``, and its
    buffers (small: built real) on ``buffers_to``."""
    meta = cast_parameters_(meta_copy(model), dtype)
    for mod in meta.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = b.to(buffers_to)
    return meta


def piece_fqns(cut: CutModel, piece: Piece) -> dict[str, str]:
    """The piece's meta parameters: its own name -> the
    model's FQN (a Sequential child's names are its own)."""
    prefix = f"{piece.name}." if cut.method == "sequential" else ""
    return {name: prefix + name for name in meta_parameter_names(piece.module)}


def release_(module: nn.Module) -> None:
    """Put ``module``'s real parameters back on meta (ties kept): their memory and gradients go."""
    made: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or p.device.type == "meta":
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            mod._parameters[name] = made[id(p)]


def check_order(order: object, streaming: bool | None = None) -> None:
    """Refuse an ``order`` that is not None or one of :data:`ORDERS`, and 'stage' with ``streaming=True``."""
    if order not in (None, *ORDERS):
        raise StageplanError(f"order must be one of {', '.join(ORDERS)}, got {order!r}; e.g. --order stage")
    if order == "stage" and streaming:
        raise StageplanError("order 'stage' times every layer in one chain, and a layer-at-a-time profile "
                             "holds one layer at a time; use --order layer with --streaming (or let it "
                             "choose), or profile the whole model where it fits")


@dataclass
class LayerContext:
    workload: Workload
    mb: int
    dev: torch.device
    dt: torch.dtype | None
    warmup: int
    repeats: int
    layers: Sequence[str] | None
    progress: bool
    mb_args_cpu: tuple[Any, ...]
    dedup: bool
    min_time_s: float = 0.0
    order: str | None = None  # 'stage' or 'layer' (profile_model's order); None for an estimate
    max_time_s: float = math.inf  # a measured layer's timed rounds stop past this (profile_model's)
    timed_rounds: list[int] = field(default_factory=list)  # per time_rounds call: the rounds it timed

    def target(self) -> Any:
        t = (
            self.workload.target[: self.mb]
            if isinstance(self.workload.target, torch.Tensor)
            else self.workload.target
        )
        return to_device(t, self.dev, None)


def meta_cut(ctx: LayerContext, src: nn.Module) -> tuple[nn.Module, Any, Any, CutModel]:
    """A weightless copy of ``src`` in the profile's dtype, cut into layers, with the microbatch and target on
    the device: what layer-at-a-time profiling and estimation start from."""
    model = typed_meta_copy(src, ctx.dt, ctx.dev)
    model.train()
    args = to_device(ctx.mb_args_cpu, ctx.dev, ctx.dt)
    cut = cut_layers(model, args, ctx.layers)
    retarget_devices(cut, ctx.dev)
    return model, args, ctx.target(), cut


def materialize_piece(cut: CutModel, model: nn.Module, piece: Piece, dev: torch.device,
                      weights: Checkpoint | None,
                       seed: int = 0) -> None:
    """Give one piece of a cut of the meta ``model`` its real
    parameters: from ``weights``, else initialised by FQN."""
    fqns = piece_fqns(cut, piece)
    tensors = real_parameters(model, fqns.values(), dev, weights=weights, seed=seed)
    materialize_(piece.module, {local: tensors[fqn] for local, fqn in fqns.items()})


def stream_forward(env: dict[Any, Any], cut: CutModel, k: int,
                    values: Sequence[Any]) -> tuple[dict[Any, Any], list[Any]]:
    """Run piece ``k`` forward on ``values`` without grad and keep, of ``env`` and its outputs, only what
    later pieces read: the new env and those refs (one layer at a time, the real outputs streamed to the
    layers that need them)."""
    with torch.no_grad():
        store_outputs(env, k, cut.pieces[k].module(*values))
    keep = cut.crossing_refs(k)
    return {r: v for r, v in env.items() if r in keep}, keep


def retime_layers(workload: Workload, layer_names: Sequence[str], layers: Sequence[int], microbatch_size: int,
                  device: torch.device | str, *, layers_arg: Sequence[str] | None = None,
                  weights: Checkpoint | None = None, seed: int = 0, warmup: int = 1,
                  repeats: int = 5, order: str | None = "layer") -> dict[int, list[float]]:
    """Time ``layers`` (indices into the profile's ``layer_names``) of ``workload`` as the profiler times a
    layer, in this process and now: each alone, forward, backward into empty grads and backward accumulating,
    in rounds over all of them (a change in the machine's speed hits them alike; medians over ``repeats``
    rounds after ``warmup``). A pipeline rank calls it on its own layers after its run
    (:mod:`stageplan.running.executor`), so that the layers' times inside the pipeline against the profile
    split in two: this process's speed now against the profile's (the machine drifts by the minute), and what
    the pipeline itself adds (inside against now).

    The model is cut as the profile cut it (``layers_arg``: its ``--layers``); layers before the first asked
    for are materialised one at a time and run forward only, to give the asked-for ones their real inputs;
    parameters come from ``weights``, else initialised by FQN with ``seed`` (a rank's starting weights: values
    do not move a dense layer's time). ``order`` is the profile's (:func:`profile_model`; None, a profile
    without one, is 'layer'): under 'stage' the layers run as one chain
    together with the layer after each contiguous group (as the profile's chain runs it there, and a stage's
    last layer's backward follows it), timed but not returned. Returns {layer: [forward_s, backward_s,
    backward_accumulate_s]}."""
    if not layers:
        return {}
    check_order(order)
    if order is None:
        order = "layer"
    dev = torch.device(device)
    mb_args_cpu = first_microbatch(workload, microbatch_size)
    ctx = LayerContext(workload, microbatch_size, dev, None, warmup, repeats, layers_arg, False, mb_args_cpu,
                       False)
    src = workload.model
    if weights is None and not meta_parameter_names(src):
        weights = Checkpoint(dict(src.state_dict()))
    model, args, target, cut = meta_cut(ctx, src)
    names = [piece.name for piece in cut.pieces]
    if names != list(layer_names):
        def some(xs: Sequence[str]) -> str:
            return ", ".join(list(xs)[:4]) + (", ..." if len(xs) > 4 else "")

        raise StageplanError(f"the model cuts into {len(names)} layers here ({some(names)}) and the plan has "
                             f"{len(layer_names)} ({some(layer_names)}): its profile is of another model or "
                             "another --layers; profile this model and plan again")
    wanted = sorted(set(int(k) for k in layers))
    n = len(cut.pieces)
    timed = set(wanted)
    if order == "stage":
        timed |= {k + 1 for k in wanted if k + 1 < n and k + 1 not in wanted}
    runs: dict[int, LayerRun] = {}
    env: dict[Any, Any] = {}
    for k, piece in enumerate(cut.pieces[: max(timed) + 1]):
        materialize_piece(cut, model, piece, dev, weights, seed)
        values = [resolve(r, args, env) for r in piece.inputs]
        if k in timed:
            runs[k] = make_run(piece, k, n, values, workload, target)
        if k < max(timed):
            env, _ = stream_forward(env, cut, k, values)
        del values
        if k not in runs:
            release_(piece.module)
    samples, _ = time_rounds(list(runs.values()), Timer(dev), warmup, repeats, chain=order == "stage")
    for k in runs:
        release_(cut.pieces[k].module)
    return {k: [median_iqr(s[j])[0] for j in range(3)] for k, s in zip(runs, samples) if k in wanted}
