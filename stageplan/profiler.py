"""Per-layer forward/backward timing, saved-for-backward bytes, parameter and boundary bytes -> Profile: with the
whole model real, one layer at a time from meta (streaming), or estimated for a GPU you do not have; identical
layers are measured once."""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import gc
import math
import os
import platform
import re
import resource
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stageplan._progress import Progress
from stageplan._version import __version__
from stageplan.errors import StageplanError, WorkloadError
from stageplan.layers import (
    CutModel,
    Piece,
    cut_layers,
    resolve,
    retarget_devices,
    store_outputs,
    tensor_bytes,
    used_parameters,
)
from stageplan.materialize import (
    Checkpoint,
    init_empty_weights,
    materialize_,
    meta_copy,
    meta_model,
    meta_parameter_names,
    parameter_bytes,
    real_parameters,
)
from stageplan.measure import (
    CacheFlush,
    SavedTensorTracker,
    Timer,
    first_microbatch,
    median_iqr,
    saved_bytes,
    steady_allocator,
    storage_identity,
    timed_rounds,
)
from stageplan.profile import LayerProfile, Profile
from stageplan.workload import Workload

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ESTIMATE_PREFIX = "estimate:"
# Above this relative difference between two instances of one layer, measuring it once is questionable.
DEDUP_SPREAD_WARN = 0.10
# The orders a profile times its layers in (profile_model's ``order``): as a stage runs them, or each alone
ORDERS = ("stage", "layer")
ESTIMATE_ACCURACY = "roughly ±25% in absolute time; ratios between layers are what the solver needs"


class DeviceError(StageplanError):
    """The requested device is not available here."""


def parse_device(device: str | torch.device) -> torch.device:
    """'cpu', 'cuda' or 'cuda:i', refused with a clear line when CUDA or that index is not present."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"unknown device {device!r}; use cpu, cuda, cuda:N or estimate:GPU (e.g. estimate:h100-sxm)") from exc
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DeviceError(f"device {str(device)!r} asked for, but this machine has no CUDA GPU "
                              f"(torch {torch.__version__}); use --device cpu, estimate for a GPU (--device "
                              "estimate:h100-sxm) or run on a GPU machine")
        if dev.index is not None and dev.index >= count:
            raise DeviceError(f"device {str(device)!r} asked for, but only {count} CUDA device(s) exist (0..{count - 1}); pick one of those")
    elif dev.type != "cpu":
        raise DeviceError(f"device type {dev.type!r} is not supported; use cpu, cuda, cuda:N or estimate:GPU")
    return dev


def is_estimate_device(device: str | torch.device) -> bool:
    """True for 'estimate:NAME': nothing runs for real, every layer is estimated for GPU NAME."""
    return isinstance(device, str) and device.strip().lower().startswith(_ESTIMATE_PREFIX)


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise StageplanError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


@contextlib.contextmanager
def default_dtype(dtype: str | torch.dtype | None) -> Iterator[None]:
    """Build under ``dtype`` as torch's default (parameters are created in it, nothing is cast), then restore it.
    ``.to(dtype)`` on a model also casts buffers computed in float32 on purpose (RoPE ``inv_freq``; FIELD.md)."""
    dt = parse_dtype(dtype)
    before = torch.get_default_dtype()
    if dt is not None:
        torch.set_default_dtype(dt)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _to(value: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device, dtype) for v in value)
    return value


def _grad_tensors(out: Any) -> list[torch.Tensor]:
    flat = [out] if isinstance(out, torch.Tensor) else [t for t in (out if isinstance(out, (tuple, list)) else []) if isinstance(t, torch.Tensor)]
    return [t for t in flat if t.requires_grad]


def _zero_grads(params: Sequence[nn.Parameter], inputs: Sequence[Any]) -> None:
    for p in params:
        p.grad = None
    for t in inputs:
        if isinstance(t, torch.Tensor):
            t.grad = None


# --------------------------------------------------------------------------------------------------
# Memory: what the whole model would need, what the device has free, what this process used


def free_bytes(device: torch.device) -> int:
    """Memory the device can give now: CUDA's free memory, or the machine's MemAvailable for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024  # kB
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (ru_maxrss is in KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _fake_state(module: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Fake tensors (call inside a FakeTensorMode) shaped like the module's parameters and buffers."""
    state: dict[str, torch.Tensor] = {}
    fakes: dict[int, torch.Tensor] = {}  # a tied parameter is one fake under all its names (functional_call
    # refused two values for tied keys, so a layer holding a tie could not be streamed or estimated)
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in fakes:
            fakes[id(p)] = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=device).requires_grad_(p.requires_grad)
        state[name] = fakes[id(p)]
    for name, b in module.named_buffers(remove_duplicate=False):
        if id(b) not in fakes:
            fakes[id(b)] = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device=device)
        state[name] = fakes[id(b)]
    return state


def _fake_inputs(args: tuple[Any, ...], device: torch.device) -> tuple[Any, ...]:
    """Fake tensors (call inside a FakeTensorMode) shaped like ``args``, each on a storage of its own (a
    microbatch sliced from the batch would otherwise carry the whole batch's storage)."""
    return tuple(torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=device)
                 if isinstance(a, torch.Tensor) else a for a in args)


def _activation_bytes_without_data(model: nn.Module, args: tuple[Any, ...]) -> int | None:
    """Bytes the uncut model's forward saves for backward, counted on fake tensors (no data, no compute); None
    when the model cannot run without data (data-dependent control flow)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cpu = torch.device("cpu")
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            state = _fake_state(model, cpu)
            tracker = SavedTensorTracker({storage_identity(t) for t in state.values()}, key=storage_identity)
            fake_args = _fake_inputs(args, cpu)
            with tracker.hooks():
                out = torch.func.functional_call(model, state, fake_args)
            live = tracker.live
            del out
            return int(live)
    except Exception:  # any failure only means the rule falls back to parameters alone
        return None


def whole_model_bytes(model: nn.Module, args: tuple[Any, ...], dtype: str | torch.dtype | None = None) -> tuple[int, int | None]:
    """What profiling the whole model at once holds: a copy of its parameters (in ``dtype``), their gradients,
    and the activations of one forward+backward of the whole model (the whole-model timing keeps every layer's,
    not only one layer's). Counted on a weightless copy. Returns (bytes, activation bytes or None when they
    could not be counted without data: then parameters alone decide)."""
    dt = parse_dtype(dtype)
    meta = _meta_model(model, dt, torch.device("cpu"))
    acts = _activation_bytes_without_data(meta, tuple(_to(a, torch.device("cpu"), dt) for a in args))
    return 2 * parameter_bytes(meta) + (acts or 0), acts


# --------------------------------------------------------------------------------------------------
# Building a workload to profile: on meta first (no memory), for real only when it fits


def build_workload_for_profile(model: str, options: dict[str, Any] | None = None, *, device: str = "cpu",
                               dtype: str | torch.dtype | None = None, streaming: bool | None = None) -> Workload:
    """Build the model spec ``model`` for :func:`profile_model`, never bigger than the machine.

    It is built first with parameters on meta (``init_empty_weights``) under ``dtype`` as torch's default.
    That build is returned for an estimate device, for ``streaming=True``, and when the real model, the
    profiler's copy and its gradients (3x the parameters) would take more than half of the device's free
    memory: the profiler then materialises what it needs (one layer at a time, or the whole model initialised
    by FQN). Otherwise the factory builds it for real, with its own initialisation. A factory that cannot build
    on meta is built for real unless streaming or an estimate was asked for.
    """
    from stageplan.zoo import build_workload

    estimate = is_estimate_device(device)
    dev = torch.device("cpu") if estimate else parse_device(device)
    if estimate:
        from stageplan.estimate import parse_estimate_device

        parse_estimate_device(device)  # an unknown GPU is refused before anything is built
    meta_wl: Workload | None = None
    try:
        with default_dtype(dtype), init_empty_weights():
            meta_wl = build_workload(model, options)
    except WorkloadError:
        raise
    except Exception as exc:  # a user factory that needs real tensors while it builds
        if estimate or streaming:
            raise WorkloadError(
                f"model {model!r} cannot be built with its parameters on meta ({type(exc).__name__}: {exc}); "
                "profiling layer at a time or estimating needs a factory that builds under "
                "stageplan.materialize.init_empty_weights(); make its construction not read parameter values"
            ) from exc
    if meta_wl is not None:
        if estimate or streaming or (meta_wl.model is None and meta_wl.model_fn is not None):
            return meta_wl  # a model_fn workload is only ever built on meta: profile_model streams it
        if not isinstance(meta_wl.model, nn.Module):
            raise WorkloadError(f"workload.model must be a torch.nn.Module, got {type(meta_wl.model).__name__}")
        if 3 * parameter_bytes(meta_wl.model) > free_bytes(dev) // 2:
            return meta_wl
    with default_dtype(dtype):
        return build_workload(model, options)


# --------------------------------------------------------------------------------------------------
# Signatures: which layers are identical, so that each is measured once

# Attributes that number a layer within its model (HF's layer_idx, Megatron's layer_number) differ between
# otherwise identical layers and change nothing in what they compute.
_INDEX_ATTR = re.compile(r"(?:.*_)?(?:layer|block|stage)_?(?:idx|index|id|number|num)|idx|index")
_PRIMITIVE = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _const(value: Any, nodes: dict[Any, int] | None = None) -> Any:
    """A hashable, address-free stand-in for a graph argument or a module attribute (None: leave it out). A graph
    node stands in as its position in its graph (``nodes``), so that the wiring counts, not only the ops."""
    if isinstance(value, torch.fx.Node):
        return f"%{nodes[value]}" if nodes is not None and value in nodes else "%"
    if isinstance(value, _PRIMITIVE):
        return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
    if isinstance(value, (tuple, list)):
        items = tuple(_const(v, nodes) for v in value)
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    if isinstance(value, slice):
        return ("slice", _const(value.start, nodes), _const(value.stop, nodes), _const(value.step, nodes))
    if isinstance(value, dict):
        return tuple(sorted((str(k), repr(_const(v, nodes))) for k, v in value.items()))
    return None


def _attribute(value: Any) -> Any:
    """A module attribute in a signature: its constant; a named function by its qualified name; any other object
    (a lambda, a tensor that is not a buffer, a config) by its identity, so that two layers holding different
    ones are measured apart (torch.relu against a lambda, or two config objects, had been taken as one layer)."""
    c = _const(value)
    if c is not None or value is None:
        return c
    name = getattr(value, "__qualname__", None)
    if callable(value) and isinstance(name, str) and "<" not in name and getattr(value, "__module__", None):
        return ("function", f"{value.__module__}.{name}")
    return ("object", type(value).__qualname__, id(value))


def _graph_signature(graph: torch.fx.Graph, rename: Callable[[str], str]) -> tuple[Any, ...]:
    out: list[Any] = []
    nodes = {node: k for k, node in enumerate(graph.nodes)}
    for node in graph.nodes:
        if node.op == "placeholder":  # its name is the producer's, which differs from layer to layer
            out.append(("placeholder",))
            continue
        target = rename(node.target) if isinstance(node.target, str) and node.op != "output" else str(node.target)
        out.append((node.op, target, _const(node.args, nodes), _const(dict(node.kwargs), nodes)))
    return tuple(out)


def _module_signature(module: nn.Module, layer: str) -> tuple[Any, ...]:
    """Class, structure (child types and extra_repr), non-index attributes, graphs of exported code, and the
    names (relative to ``layer``), shapes and dtypes of the parameters and buffers."""

    def rename(name: str) -> str:
        if layer and (name == layer or name.startswith(layer + ".")):
            return "<layer>" + name[len(layer):]
        return name

    def rename_in(owner: str) -> Callable[[str], str]:
        return lambda target: rename(f"{owner}.{target}" if owner else target)

    mods: list[tuple[Any, ...]] = []
    for name, mod in module.named_modules():
        graph = getattr(mod, "graph", None)
        if isinstance(graph, torch.fx.Graph):  # exported code: its graph is its structure
            mods.append((rename(name), "graph", _graph_signature(graph, rename_in(name))))
            continue
        attrs = tuple(sorted(((k, _attribute(v)) for k, v in vars(mod).items()
                              if not k.startswith("_") and not _INDEX_ATTR.fullmatch(k)), key=lambda kv: kv[0]))
        mods.append((rename(name), f"{type(mod).__module__}.{type(mod).__qualname__}", mod.extra_repr(), attrs))
    params = tuple((rename(n), tuple(p.shape), str(p.dtype), p.requires_grad)
                   for n, p in module.named_parameters(remove_duplicate=False))
    buffers = tuple((rename(n), tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers(remove_duplicate=False))
    return (tuple(mods), params, buffers)


def _input_spec(value: Any, requires_grad: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), requires_grad and value.is_floating_point())
    return ("value", _const(value) if _const(value) is not None else type(value).__qualname__)


def layer_signature(cut: CutModel, k: int, model: nn.Module, inputs: Sequence[Any]) -> tuple[Any, ...]:
    """What makes piece ``k`` cost what it costs: its own code and parameters, the original module it stands
    for (named layers), the shapes and dtypes of its inputs, whether they need a gradient (every piece after
    the first), and whether it computes the loss (the last)."""
    piece = cut.pieces[k]
    sig: list[Any] = [k == len(cut.pieces) - 1, tuple(_input_spec(v, k > 0) for v in inputs)]
    if cut.method == "sequential":
        sig.append(_module_signature(piece.module, ""))
    else:
        sig.append(_module_signature(piece.module, piece.name))
        if piece.name in cut.named:
            sig.append(_module_signature(model.get_submodule(piece.name), ""))
    return tuple(sig)


@dataclass(frozen=True)
class _Dedup:
    """``rep[k]``: the piece whose figures piece k reuses (itself when measured); ``spread``: the second and third
    instances of the largest group, both measured, or None when no group has three."""

    rep: list[int]
    spread: tuple[int, int] | None
    distinct: int = 0  # distinct signatures

    @property
    def measured(self) -> list[int]:
        ks = {k for k, r in enumerate(self.rep) if r == k}
        if self.spread is not None:
            ks.add(self.spread[1])
        return sorted(ks)


def _dedup(signatures: Sequence[Any], enabled: bool) -> _Dedup:
    n = len(signatures)
    if not enabled:
        return _Dedup(list(range(n)), None, n)
    groups: dict[Any, list[int]] = {}
    for k, sig in enumerate(signatures):
        groups.setdefault(sig, []).append(k)
    # The first of a run of identical layers follows a different layer (the embedding, whose backward writes a
    # multi-MiB gradient), the others follow their own kind: GPT's blocks.0 measured 1.27x blocks.1-5 here, and
    # the same inside the pipeline. So the first and the second instance are measured, and the rest reuse the second.
    rep = list(range(n))
    for members in groups.values():
        for k in members[2:]:
            rep[k] = members[1]
    # the spread check compares two instances that should agree: the second and third (both follow their own kind)
    largest = max(groups.values(), key=len)  # the first of the largest groups on a tie (dicts keep order)
    spread = (largest[1], largest[2]) if len(largest) > 2 else None  # of a pair, both are measured and used
    return _Dedup(rep, spread, len(groups))


def _pools(signatures: Sequence[Any]) -> list[list[int]]:
    """Groups of two or more identical layers between identical neighbours (the same signature before and after, or
    none): in a stage's order each is timed in its place, and what can differ between them is the neighbours (the
    first block follows the embedding, the last precedes the head), so each such group's figures are the medians
    over all its members' rounds: more samples, and no boundary moved by one block reading slower than its twin."""
    n = len(signatures)
    groups: dict[Any, list[int]] = {}
    for k in range(n):
        key = (signatures[k - 1] if k > 0 else None, signatures[k], signatures[k + 1] if k < n - 1 else None)
        groups.setdefault(key, []).append(k)
    return [g for g in groups.values() if len(g) > 1]


# --------------------------------------------------------------------------------------------------
# Measuring one layer


@dataclass
class _Run:
    """One piece ready to measure: its distinct parameters, its detached inputs and its forward."""

    params: list[nn.Parameter]
    inputs: list[Any]
    fwd: Callable[[], Any]
    module: nn.Module


@dataclass
class _Figures:
    forward_s: float
    backward_s: float
    forward_iqr_s: float
    backward_iqr_s: float
    backward_accumulate_s: float | None
    activation_bytes: int
    peak_bytes: int | None
    optimizer_s: dict[str, float] | None = None


# The optimizers the profiler times, as torch builds them (lr is irrelevant to the time; momentum 0.9 is the usual).
# Each uses torch's default implementation for the parameters' device (foreach=None, fused=None): torch 2.13 picks
# foreach on CUDA and the per-tensor loop on the CPU.
_OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
}
# Tensors an optimizer step reads or writes per parameter, each once (it is memory-bound): read the parameter and
# its gradient, write the parameter, read and write each state (momentum: 1 buffer; Adam/AdamW: exp_avg and
# exp_avg_sq). The estimate device prices a step as these bytes / (eta_m * bandwidth).
OPTIMIZER_PASSES: dict[str, int] = {"sgd": 3, "momentum": 5, "adam": 7, "adamw": 7}
OPTIMIZER_REPEATS = 5  # timed optimizer steps per layer and optimizer


def _layer_grads(run: _Run) -> list[torch.Tensor | None]:
    """The gradient each of ``run.params`` gets from one forward and backward of the layer (the output's gradient
    all ones, as :func:`_fwd_bwd_time` gives it; the last layer's loss its own): what the optimizer step reads. A
    parameter the backward does not reach gets None, and a step skips it, as torch's optimizers skip a None grad."""
    out = run.fwd()
    tensors = _grad_tensors(out)
    if tensors:
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
    del out, tensors
    grads = [p.grad.detach().clone() if p.grad is not None else None for p in run.params]
    _zero_grads(run.params, run.inputs)
    return grads


def _optimizer_times(params: Sequence[nn.Parameter], timer: Timer, repeats: int,
                     grads: Sequence[torch.Tensor | None] | None = None) -> dict[str, float]:
    """Median seconds of one ``step()`` of each optimizer over copies of ``params`` (so that the layer itself is not
    changed), after one warm-up step (it creates the states), over at most ``OPTIMIZER_REPEATS`` steps: a step is
    memory-bound and steady, and on a 7B block each Adam step costs about a second, so the layer's own repeats would
    add minutes to a profile. Each timed step starts from a flushed last-level cache (:class:`CacheFlush`), as a
    rank's step does after its backward.

    ``grads`` (one per parameter, from :func:`_layer_grads`: one microbatch's, where a step reads the sum over m, so
    an embedding has a few more zero rows here than in the step) are the gradients the step reads; without them,
    gradients of ones. The values matter: an embedding's gradient is zero on every row its batch does not use (97%
    of a 16384-token table at 512 tokens), Adam's ``exp_avg_sq`` stays zero there, and torch's CPU ``sqrt`` of a
    zero takes 8x its time on a non-zero here (2.68 against 0.32 ms over 2M floats; numpy 0.61 ms either way), so
    that table's Adam step took 10.7 ms with its real gradient against 5.4 ms with ones."""
    given = list(grads) if grads is not None else [None] * len(params)
    trained = [(p, g) for p, g in zip(params, given) if p.requires_grad and (grads is None or g is not None)]
    if not trained:
        return dict.fromkeys(_OPTIMIZERS, 0.0)
    out: dict[str, float] = {}
    flush = CacheFlush(trained[0][0].device)
    state_bytes = 4 * sum(p.numel() * p.element_size() for p, _ in trained)  # weights, grads, two Adam states
    for name, make in _OPTIMIZERS.items():
        copies = []
        for p, g in trained:
            q = p.detach().clone().requires_grad_(True)
            # a sparse gradient (nn.Embedding(sparse=True)) as its dense equal: torch's dense optimizers refuse sparse
            q.grad = torch.ones_like(q) if g is None else g.to_dense() if g.is_sparse else g.clone()
            copies.append(q)
        opt = make(copies)
        opt.step()
        samples = []
        for _ in range(min(repeats, OPTIMIZER_REPEATS)):
            if state_bytes < flush.size_bytes:
                flush()  # a rank steps after a backward that evicted these states: time it from memory, not cache
            samples.append(timer(opt.step)[0])
        out[name] = median_iqr(samples)[0]
        del opt, copies
    flush.release()
    return out


def _optimizer_floors(device: torch.device, timer: Timer, repeats: int) -> dict[str, float]:
    """Per optimizer, the seconds of one ``step()`` over a single 8-element parameter, timed as
    :func:`_optimizer_times` times a layer's (from a flushed cache): the fixed cost of a step (Python, the
    dispatcher, the optimizer's own state, cold after the flush), which every layer's figure carries once and a
    rank pays once, since it steps all its layers in one ``step()``. Here: 0.31 ms for SGD and 0.51 ms for Adam
    against 0.02 and 0.05 ms hot, and 0.33 / 0.69 ms over 10 such parameters, so it is per step, not per tensor;
    summed over the convnet's 9 trained layers the per-layer figures came to 13.9 ms of Adam against 10.1 ms for one
    flushed step over the whole model (the GPT: 22.6 against 19.8 ms). Measured once per process and device (about
    0.7 s of flushes): it is the machine's and the process's, not the model's."""
    key = str(device)
    if key not in _FLOORS:
        tiny = nn.Parameter(torch.zeros(8, device=device))
        _FLOORS[key] = _optimizer_times([tiny], timer, max(3, repeats))
    return dict(_FLOORS[key])


_FLOORS: dict[str, dict[str, float]] = {}


def _identity(p: nn.Parameter) -> int:
    # by storage for real tensors (an exported piece can hold two objects on one tied storage), by object on meta
    return p.data_ptr() if p.device.type != "meta" else id(p)


def _distinct(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    return list({_identity(p): p for p in params}.values())


def _make_run(piece: Piece, k: int, n: int, values: Sequence[Any], workload: Workload, target: Any) -> _Run:
    params = _distinct(list(used_parameters(piece.module).values()))
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

    return _Run(params, inputs, fwd, piece.module)


def _fwd_bwd_time(timer: Timer, run: _Run) -> tuple[float, float, float]:
    """Forward; backward into empty .grad (autograd hands its buffer over: a step's first microbatch);
    backward again into the filled .grad (an add: every later microbatch of a pipeline step)."""

    def bwd_time() -> float:
        out = run.fwd()
        tensors = _grad_tensors(out)
        if not tensors:
            return 0.0
        grads = [torch.ones_like(t) for t in tensors]
        t_b, _ = timer(lambda: torch.autograd.backward(tensors, grads))
        return t_b

    t_f, out = timer(run.fwd)
    del out
    _zero_grads(run.params, run.inputs)
    t_first = bwd_time()
    _zero_grads([], run.inputs)
    t_acc = bwd_time()
    _zero_grads(run.params, run.inputs)
    return t_f, t_first, t_acc


def _chain_time(timer: Timer, runs: Sequence[_Run]) -> list[tuple[float, float, float]]:
    """The runs in a stage's order: every forward in turn, then every backward in reverse, each timed (into empty
    grads), then the same again with the backwards accumulating. A stage runs a layer's backward after the next
    layer's, with the rest of the model's forwards and backwards since its own forward; timed right after its own
    forward (:func:`_fwd_bwd_time`) it reads its saved activations hot. Here, in one process: the GPT's blocks'
    backward 1.05-1.12x their hot figure, the block before its 16384-token head 1.34x (the head's backward evicts
    it), the head 1.03x. Returns, per run, (forward, backward, accumulating backward)."""

    def backward(run: _Run, out: Any) -> float:
        tensors = _grad_tensors(out)
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
        _zero_grads(runs[i].params, [])
        first[i] = backward(runs[i], outs[i])
        outs[i] = None
    _zero_grads([], [v for run in runs for v in run.inputs])  # a new microbatch's inputs: no gradient yet
    outs = [run.fwd() for run in runs]
    acc = [0.0] * len(runs)
    for i in reversed(range(len(runs))):
        acc[i] = backward(runs[i], outs[i])
        outs[i] = None
    for run in runs:
        _zero_grads(run.params, run.inputs)
    return [(forward[i], first[i], acc[i]) for i in range(len(runs))]


def _time_rounds(runs: Sequence[_Run], timer: Timer, warmup: int, repeats: int,
                 whole: Callable[[], float] | None = None,
                 on_round: Callable[[int], None] | None = None,
                 min_time_s: float = 0.0, chain: bool = False) -> tuple[list[list[list[float]]], list[float]]:
    """Rounds: each round times every run's forward and backward (and the whole model once), so that a load
    change on the machine hits all of them alike (medians are taken across rounds). Timed rounds go on past
    ``repeats`` until they span ``min_time_s`` seconds, so that the medians average over the machine's own
    drift rather than catch one moment of it. ``chain``: the runs in a stage's order (:func:`_chain_time`), else
    each backward right after its own forward (:func:`_fwd_bwd_time`). Returns, per run, [forward, backward,
    accumulating backward] samples, and the whole-model samples."""
    samples: list[list[list[float]]] = [[[], [], []] for _ in runs]
    whole_times: list[float] = []
    for rnd in timed_rounds(warmup, repeats, min_time_s):
        rows = _chain_time(timer, runs) if chain else [_fwd_bwd_time(timer, run) for run in runs]
        for i, times in enumerate(rows):
            if rnd >= warmup:
                for j in range(3):
                    samples[i][j].append(times[j])
        if whole is not None:
            t_w = whole()
            if rnd >= warmup:
                whole_times.append(t_w)
        if on_round is not None:
            on_round(rnd + 1)
    return samples, whole_times


def _bytes_and_peak(run: _Run, dev: torch.device, peaks: _Peaks) -> tuple[int, int | None]:
    """Saved-for-backward bytes (parameters excluded) and, on CUDA, the peak allocated above the baseline
    during one forward+backward."""
    # parameters and buffers are module state, not per-microbatch activations (the estimate excludes both)
    param_ptrs = {t.untyped_storage().data_ptr() for t in (*run.module.parameters(), *run.module.buffers())}
    act_bytes, out = saved_bytes(run.fwd, param_ptrs)
    del out
    peak: int | None = None
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        peaks.note_cuda(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        out = run.fwd()
        tensors = _grad_tensors(out)
        if tensors:
            torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
        torch.cuda.synchronize(dev)
        peak = int(torch.cuda.max_memory_allocated(dev) - base)
        peaks.note_cuda(dev)
        del out, tensors
    _zero_grads(run.params, run.inputs)
    return int(act_bytes), peak


class _Peaks:
    """The largest CUDA allocation seen (the per-layer peaks reset torch's counter)."""

    def __init__(self) -> None:
        self.cuda = 0

    def note_cuda(self, dev: torch.device) -> None:
        self.cuda = max(self.cuda, int(torch.cuda.max_memory_allocated(dev)))


def _figures(samples: list[list[float]], act: int, peak: int | None,
             optimizer_s: dict[str, float] | None = None) -> _Figures:
    f_med, f_iqr = median_iqr(samples[0])
    b_med, b_iqr = median_iqr(samples[1])
    return _Figures(f_med, b_med, f_iqr, b_iqr, median_iqr(samples[2])[0], act, peak, optimizer_s)


# --------------------------------------------------------------------------------------------------
# The model on meta: weightless copies, cast parameters, device constants of a meta trace


def _cast_parameters_(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """Give ``model``'s floating parameters (meta or real; ties kept) and persistent floating buffers ``dtype``.
    Non-persistent buffers keep theirs: they are computed at construction on purpose (RoPE ``inv_freq`` in
    float32), as when the model is built under torch.set_default_dtype."""
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


def _meta_model(model: nn.Module, dtype: torch.dtype | None, buffers_to: torch.device) -> nn.Module:
    """A copy of ``model`` with its parameters on meta (never a second real copy) in ``dtype``, and its buffers
    (small: built real) on ``buffers_to``."""
    meta = _cast_parameters_(meta_copy(model), dtype)
    for mod in meta.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = b.to(buffers_to)
    return meta


def _fake_chain(cut: CutModel, args: tuple[Any, ...], device: torch.device) -> tuple[list[list[Any]], list[int]]:
    """Every piece's inputs as fake tensors (shapes, dtypes and strides; no data, no compute), and the bytes that
    cross a boundary after each piece."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    env: dict[Any, Any] = {}
    inputs: list[list[Any]] = []
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            fake_args = _fake_inputs(args, device)
            for k, piece in enumerate(cut.pieces):
                values = [resolve(r, fake_args, env) for r in piece.inputs]
                inputs.append(values)
                out = torch.func.functional_call(piece.module, _fake_state(piece.module, device), tuple(values))
                store_outputs(env, k, out)
    except Exception as exc:
        raise WorkloadError(
            f"layer {cut.pieces[len(inputs) - 1].name!r} cannot run without data ({type(exc).__name__}: {exc}); "
            "profile it with the whole model real (streaming=False) or name layers whose shapes do not depend on values"
        ) from exc
    n = len(cut.pieces)
    crossing = [0 if k == n - 1 else sum(tensor_bytes(resolve(r, fake_args, env)) for r in cut.crossing_refs(k))
                for k in range(n)]
    return inputs, crossing


def _piece_fqns(cut: CutModel, piece: Piece) -> dict[str, str]:
    """The piece's meta parameters: its own name -> the model's FQN (a Sequential child's names are its own)."""
    prefix = f"{piece.name}." if cut.method == "sequential" else ""
    return {name: prefix + name for name in meta_parameter_names(piece.module)}


def _piece_used_fqns(cut: CutModel, piece: Piece) -> set[str]:
    """The model FQNs of the parameters the piece uses (a Sequential child's names are its own)."""
    prefix = f"{piece.name}." if cut.method == "sequential" else ""
    return {prefix + name for name in used_parameters(piece.module)}


def _tied_parameters(cut: CutModel, model: nn.Module) -> list[dict[str, Any]]:
    """``meta["tied"]``: each parameter the model holds under two or more FQNs (an embedding tied to the LM head),
    with the layers whose pieces use it (under any of its names) and its bytes in the profiled dtype. Matched by
    FQN, so it holds whether the pieces are real, on meta, or released back to meta."""
    groups: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(_identity(p), ([], p))[0].append(name)
    used = [_piece_used_fqns(cut, piece) for piece in cut.pieces]
    return [{"names": names, "layers": [k for k, fqns in enumerate(used) if fqns.intersection(names)],
             "bytes": p.numel() * p.element_size()} for names, p in groups.values() if len(names) > 1]


def _param_totals(module: nn.Module) -> tuple[int, int]:
    """Bytes and count of the distinct parameters a piece uses."""
    ps = _distinct(list(used_parameters(module).values()))
    return sum(p.numel() * p.element_size() for p in ps), sum(p.numel() for p in ps)


def _release_(module: nn.Module) -> None:
    """Put ``module``'s real parameters back on meta (ties kept): their memory and gradients go."""
    made: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or p.device.type == "meta":
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            mod._parameters[name] = made[id(p)]


# --------------------------------------------------------------------------------------------------
# The entry point


def profile_model(
    workload: Workload,
    *,
    microbatch_size: int,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    warmup: int = 5,
    repeats: int = 20,
    layers: Sequence[str] | None = None,
    progress: bool = False,
    streaming: bool | None = None,
    dedup: bool = True,
    compute_efficiency: float | None = None,
    memory_efficiency: float | None = None,
    min_time_s: float = 0.0,
    order: str | None = None,
) -> Profile:
    """Profile every layer of ``workload`` at ``microbatch_size``; the user's model is untouched.

    - ``device``: 'cpu', 'cuda', 'cuda:N' to measure, or 'estimate:NAME' (e.g. 'estimate:h100-sxm') to
      estimate every layer for a GPU you do not have, on fake tensors (``compute_efficiency`` and
      ``memory_efficiency`` override the roofline's defaults; see :mod:`stageplan.estimate`).
    - ``streaming``: True measures one layer at a time from a model on meta (only that layer's parameters are
      real; the whole-model timing is skipped); None chooses it when the whole model, its gradients and its
      activations would not fit in the device's free memory.
    - ``dedup``: in order 'layer', of identical layers (same code, parameter shapes and dtypes, input shapes) the
      first two are measured and the rest reuse the second's figures (the first follows a different layer, and runs
      slower); their rows say ``measured_as``. In a group of three or more, the third instance is measured too and
      its ratio to the second recorded in ``meta["dedup_spread"]`` (None without such a group; a pair is simply
      measured twice). In order 'stage' every layer is timed; dedup shares the optimizer step and bytes, and pools
      the times of identical layers between identical neighbours. False: each layer its own figures.
    - ``dtype``: the parameter and input dtype (default: the model's own). Build the model under that default
      dtype instead where you can (:func:`default_dtype`): only parameters and persistent buffers are cast.
    - ``min_time_s``: time more rounds than ``repeats`` until the timed rounds span this many seconds (one layer at
      a time: each measured layer's rounds an equal share of it). A shared machine's speed drifts by the second:
      two windows of the same work here differed by up to 33% (98th percentile) over 1.7 s windows and 9% over 20 s
      (README, Limitations); the medians of rounds spread over longer average more of it out.
    - ``order``: 'stage' times the layers as a stage runs them, every forward in turn and then every backward in
      reverse, so that a layer's backward follows the next layer's and reads activations the rest of the model has
      since pushed out of the cache (every layer is timed in its place; identical layers share their optimizer step,
      and those between identical neighbours their times, pooled over all of them: ``meta["pooled_layers"]``);
      'layer' times each layer's backward right after its own forward (hot: the GPT's blocks' backward read 0.89-0.95x
      the stage order's, the block before the head 0.75x). None: 'stage' where the whole model is materialised,
      'layer' one layer at a time (only one layer is real there).
    """
    if warmup < 0 or repeats < 1:
        raise StageplanError(f"warmup must be >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}; e.g. --warmup 3 --repeats 10")
    check_min_time(min_time_s)
    check_order(order)
    estimate = is_estimate_device(device)
    gpu: Any = None
    if estimate:
        from stageplan.estimate import (
            DEFAULT_COMPUTE_EFFICIENCY,
            DEFAULT_MEMORY_EFFICIENCY,
            parse_estimate_device,
        )

        gpu = parse_estimate_device(str(device))
        if min_time_s:
            raise StageplanError(f"min_time_s ({min_time_s}) spreads measured rounds over time, and an estimate measures "
                                 "nothing; drop --min-time, or measure on a device you have")
        if order is not None:
            raise StageplanError(f"order ({order}) is the order layers are timed in, and an estimate times nothing; "
                                 "drop --order, or measure on a device you have")
        dev = torch.device("cpu")  # fake CPU tensors stand in for the target's (see stageplan.estimate)
        for name, value, default in (("compute_efficiency", compute_efficiency, DEFAULT_COMPUTE_EFFICIENCY),
                                     ("memory_efficiency", memory_efficiency, DEFAULT_MEMORY_EFFICIENCY)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0.0 < float(value) <= 1.0):
                raise StageplanError(f"{name} must be a fraction in (0, 1], got {value!r}; e.g. {default}")
    else:
        dev = parse_device(device)
        for name, value in (("compute_efficiency", compute_efficiency), ("memory_efficiency", memory_efficiency)):
            if value is not None:
                raise StageplanError(f"{name} ({value}) applies to estimates only; use it with --device estimate:GPU "
                                     "(e.g. estimate:h100-sxm), or drop it when measuring")
    dt = parse_dtype(dtype)
    if not isinstance(dedup, bool) or (streaming is not None and not isinstance(streaming, bool)):
        raise StageplanError(f"streaming must be True, False or None and dedup True or False, got streaming={streaming!r}, "
                             f"dedup={dedup!r}")
    if dev.type == "cpu" and not estimate and dt in (torch.float16, torch.bfloat16):
        warnings.warn(f"profiling in {str(dt).replace('torch.', '')} on the CPU: most CPU kernels have no fast half-precision "
                      "path (float16 ran about 20x slower than float32 here), so these times will not predict a GPU; "
                      "profile on the GPU you will train on, or estimate for it (--device estimate:NAME)", stacklevel=2)
    mb_args_cpu = first_microbatch(workload, microbatch_size)
    if workload.model is None and workload.model_fn is not None:  # a model only ever built on meta (model_fn)
        import dataclasses

        workload = dataclasses.replace(workload, model=meta_model(workload), model_fn=None)
    if not isinstance(workload.model, nn.Module):
        raise WorkloadError(f"workload.model must be a torch.nn.Module, got {type(workload.model).__name__}")

    steady_allocator()  # reuse large buffers, as every rank does: see measure.steady_allocator
    rng_cpu = torch.get_rng_state()
    rng_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # one intra-op thread, as each pipeline rank will run
    try:
        ctx = _Context(workload, microbatch_size, dev, dt, warmup, repeats, layers, progress, mb_args_cpu, dedup,
                       float(min_time_s), order)
        if estimate:
            return _profile_estimate(ctx, gpu, compute_efficiency, memory_efficiency)
        memory: dict[str, Any] = {}
        if streaming is None:
            need, acts = whole_model_bytes(workload.model, mb_args_cpu, dt)
            free = free_bytes(dev)
            streaming = need > free
            memory = {"rule": "layer at a time when 2 x parameters + activations > free memory",
                      "whole_model_bytes": need, "activation_bytes": acts, "free_bytes": free}
        if streaming:
            check_order(order, streaming)
            ctx.order = "layer"
            return _profile_streaming(ctx, memory)
        ctx.order = order or "stage"
        return _profile_whole(ctx, memory)
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng_cpu)
        if rng_cuda is not None:
            torch.cuda.set_rng_state_all(rng_cuda)


def check_order(order: object, streaming: bool | None = None) -> None:
    """Refuse an ``order`` that is not None or one of :data:`ORDERS`, and 'stage' with ``streaming=True``."""
    if order not in (None, *ORDERS):
        raise StageplanError(f"order must be one of {', '.join(ORDERS)}, got {order!r}; e.g. --order stage")
    if order == "stage" and streaming:
        raise StageplanError("order 'stage' times every layer in one chain, and a layer-at-a-time profile holds one "
                             "layer at a time; use --order layer with --streaming (or let it choose), or profile the "
                             "whole model where it fits")


def check_min_time(min_time_s: object) -> None:
    """Refuse a ``min_time_s`` that is not a finite number of seconds >= 0."""
    if isinstance(min_time_s, bool) or not isinstance(min_time_s, (int, float)) or not 0 <= min_time_s < math.inf:
        raise StageplanError(f"min_time_s must be a finite number of seconds >= 0, got {min_time_s!r}; e.g. --min-time 20")


@dataclass
class _Context:
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
    timed_rounds: list[int] = field(default_factory=list)  # per _time_rounds call: the rounds it timed

    def target(self) -> Any:
        t = self.workload.target[: self.mb] if isinstance(self.workload.target, torch.Tensor) else self.workload.target
        return _to(t, self.dev, None)


def _profile_whole(ctx: _Context, memory: dict[str, Any]) -> Profile:
    src = ctx.workload.model
    if meta_parameter_names(src):  # built on meta: the whole model, initialised by FQN
        model = _meta_model(src, ctx.dt, ctx.dev)
        materialize_(model, real_parameters(model, meta_parameter_names(model), ctx.dev))
    else:
        model = _cast_parameters_(copy.deepcopy(src), ctx.dt).to(ctx.dev)
    model.train()
    args = _to(ctx.mb_args_cpu, ctx.dev, ctx.dt)
    target = ctx.target()
    cut: CutModel = cut_layers(model, args, ctx.layers)
    timer = Timer(ctx.dev)
    peaks = _Peaks()

    # One forward pass through the chain gives every piece its real inputs.
    env: dict[Any, Any] = {}
    with torch.no_grad():
        for k, piece in enumerate(cut.pieces):
            store_outputs(env, k, piece.module(*[resolve(r, args, env) for r in piece.inputs]))
    n = len(cut.pieces)
    values = [[resolve(r, args, env) for r in piece.inputs] for piece in cut.pieces]
    signatures = [layer_signature(cut, k, model, values[k]) for k in range(n)]
    plan = _dedup(signatures, ctx.dedup)
    stage = ctx.order == "stage"
    # in a stage's order every layer is timed (its backward depends on what ran since its forward); identical layers
    # still share their optimizer step and bytes
    timed = list(range(n)) if stage else plan.measured
    measured = plan.measured
    runs = [_make_run(cut.pieces[k], k, n, values[k], ctx.workload, target) for k in timed]

    whole_params = list(model.parameters())

    def whole() -> float:
        def step() -> None:
            loss = ctx.workload.compute_loss(model(*args), target)
            loss.backward()

        t_w, _ = timer(step)
        _zero_grads(whole_params, [])
        return t_w

    bar = Progress(ctx.warmup + ctx.repeats, f"profiling {n} layers", enabled=ctx.progress)
    doing = "in a stage's order" if stage else f"{len(timed)} of them, the others identical" if len(timed) < n else ""
    samples, whole_times = _time_rounds(
        runs, timer, ctx.warmup, ctx.repeats, whole,
        lambda r: bar.update(r, " ".join(filter(None, ["warm-up" if r <= ctx.warmup else "measuring", doing]))),
        ctx.min_time_s, chain=stage)
    ctx.timed_rounds.append(len(whole_times))
    bar.close()
    figures: dict[int, _Figures] = {}
    by_layer = dict(zip(timed, zip(runs, samples)))
    for k in measured:
        run, s = by_layer[k]
        act, peak = _bytes_and_peak(run, ctx.dev, peaks)
        figures[k] = _figures(s, act, peak, _optimizer_times(run.params, timer, ctx.repeats, _layer_grads(run)))
    pooled: list[list[int]] = []
    if stage:  # every layer timed in its place; an identical layer its representative's bytes and optimizer step
        pooled = _pools(signatures) if ctx.dedup else []
        pool_of = {k: group for group in pooled for k in group}
        for k in range(n):
            fig = figures.get(k) or figures[plan.rep[k]]
            group = pool_of.get(k, [k])
            times = [[t for j in group for t in by_layer[j][1][i]] for i in range(3)]
            figures[k] = _figures(times, fig.activation_bytes, fig.peak_bytes, fig.optimizer_s)
        plan = _Dedup(list(range(n)), None, plan.distinct)  # nothing reused: no spread to check
    crossing = [0 if k == n - 1 else sum(tensor_bytes(resolve(r, args, env)) for r in cut.crossing_refs(k)) for k in range(n)]
    params = [_param_totals(p.module) for p in cut.pieces]
    whole_med, whole_iqr = median_iqr(whole_times)
    if ctx.dev.type == "cuda":
        peaks.note_cuda(ctx.dev)
    extra = {"materialized": "whole-model", "whole_model_s": whole_med, "whole_model_iqr_s": whole_iqr,
             "whole_model": "measured", "pooled_layers": [[cut.pieces[k].name for k in group] for group in pooled]}
    return _assemble(ctx, cut, model, plan, figures, crossing, params, extra, memory, peaks)


def _meta_cut(ctx: _Context, src: nn.Module) -> tuple[nn.Module, Any, Any, CutModel]:
    """A weightless copy of ``src`` in the profile's dtype, cut into layers, with the microbatch and target on the
    device: what layer-at-a-time profiling and estimation start from."""
    model = _meta_model(src, ctx.dt, ctx.dev)
    model.train()
    args = _to(ctx.mb_args_cpu, ctx.dev, ctx.dt)
    cut = cut_layers(model, args, ctx.layers)
    retarget_devices(cut, ctx.dev)
    return model, args, ctx.target(), cut


def _materialize_piece(cut: CutModel, model: nn.Module, piece: Piece, dev: torch.device, weights: Checkpoint | None,
                       seed: int = 0) -> None:
    """Give one piece of a cut of the meta ``model`` its real parameters: from ``weights``, else initialised by FQN."""
    fqns = _piece_fqns(cut, piece)
    tensors = real_parameters(model, fqns.values(), dev, weights=weights, seed=seed)
    materialize_(piece.module, {local: tensors[fqn] for local, fqn in fqns.items()})


def _stream_forward(env: dict[Any, Any], cut: CutModel, k: int,
                    values: Sequence[Any]) -> tuple[dict[Any, Any], list[Any]]:
    """Run piece ``k`` forward on ``values`` without grad and keep, of ``env`` and its outputs, only what later
    pieces read: the new env and those refs (one layer at a time, the real outputs streamed to the layers that need
    them)."""
    with torch.no_grad():
        store_outputs(env, k, cut.pieces[k].module(*values))
    keep = cut.crossing_refs(k)
    return {r: v for r, v in env.items() if r in keep}, keep


def _profile_streaming(ctx: _Context, memory: dict[str, Any]) -> Profile:
    src = ctx.workload.model
    # The user's real weights, one layer's worth at a time; FQN-keyed initialisation for a model on meta.
    weights = None if meta_parameter_names(src) else Checkpoint(dict(src.state_dict()))
    model, args, target, cut = _meta_cut(ctx, src)
    n = len(cut.pieces)
    plan = _dedup([layer_signature(cut, k, model, values) for k, values in enumerate(_fake_chain(cut, args, ctx.dev)[0])],
                  ctx.dedup)
    timer = Timer(ctx.dev)
    peaks = _Peaks()
    figures: dict[int, _Figures] = {}
    crossing: list[int] = []
    params: list[tuple[int, int]] = []
    env: dict[Any, Any] = {}
    measured = set(plan.measured)
    bar = Progress(n, f"profiling {n} layers one at a time ({len(measured)} measured)", enabled=ctx.progress)
    for k, piece in enumerate(cut.pieces):
        bar.update(k, piece.name)
        _materialize_piece(cut, model, piece, ctx.dev, weights)
        values = [resolve(r, args, env) for r in piece.inputs]
        if k in measured:
            run = _make_run(piece, k, n, values, ctx.workload, target)
            (s,), _ = _time_rounds([run], timer, ctx.warmup, ctx.repeats, min_time_s=ctx.min_time_s / len(measured))
            ctx.timed_rounds.append(len(s[0]))
            act, peak = _bytes_and_peak(run, ctx.dev, peaks)
            figures[k] = _figures(s, act, peak, _optimizer_times(run.params, timer, ctx.repeats, _layer_grads(run)))
            del run
        env, keep = _stream_forward(env, cut, k, values)
        del values
        crossing.append(0 if k == n - 1 else sum(tensor_bytes(resolve(r, args, env)) for r in keep))
        params.append(_param_totals(piece.module))
        _release_(piece.module)
        gc.collect()
        if ctx.dev.type == "cuda":
            peaks.note_cuda(ctx.dev)
            torch.cuda.empty_cache()
    bar.update(n, "done")
    bar.close()
    extra = {"materialized": "layer-at-a-time", "whole_model_s": None, "whole_model_iqr_s": None,
             "whole_model": "skipped: layer-at-a-time"}
    return _assemble(ctx, cut, model, plan, figures, crossing, params, extra, memory, peaks)


def retime_layers(workload: Workload, layer_names: Sequence[str], layers: Sequence[int], microbatch_size: int,
                  device: torch.device | str, *, layers_arg: Sequence[str] | None = None,
                  weights: Checkpoint | None = None, seed: int = 0, warmup: int = 1,
                  repeats: int = 5, order: str | None = "layer") -> dict[int, list[float]]:
    """Time ``layers`` (indices into the profile's ``layer_names``) of ``workload`` as the profiler times a layer,
    in this process and now: each alone, forward, backward into empty grads and backward accumulating, in rounds
    over all of them (a change in the machine's speed hits them alike; medians over ``repeats`` rounds after
    ``warmup``). A pipeline rank calls it on its own layers after its run (:mod:`stageplan.executor`), so that the
    layers' times inside the pipeline against the profile split in two: this process's speed now against the
    profile's (the machine drifts by the minute), and what the pipeline itself adds (inside against now).

    The model is cut as the profile cut it (``layers_arg``: its ``--layers``); layers before the first asked for are
    materialised one at a time and run forward only, to give the asked-for ones their real inputs; parameters come
    from ``weights``, else initialised by FQN with ``seed`` (a rank's starting weights: values do not move a dense
    layer's time). ``order`` is the profile's (:func:`profile_model`; None, a profile without one, is 'layer'):
    under 'stage' the layers run as one chain
    together with the layer after each contiguous group (as the profile's chain runs it there, and a stage's last
    layer's backward follows it), timed but not returned. Returns {layer: [forward_s, backward_s,
    backward_accumulate_s]}."""
    if not layers:
        return {}
    check_order(order)
    if order is None:
        order = "layer"
    dev = torch.device(device)
    mb_args_cpu = first_microbatch(workload, microbatch_size)
    ctx = _Context(workload, microbatch_size, dev, None, warmup, repeats, layers_arg, False, mb_args_cpu, False)
    src = workload.model
    if weights is None and not meta_parameter_names(src):
        weights = Checkpoint(dict(src.state_dict()))
    model, args, target, cut = _meta_cut(ctx, src)
    names = [piece.name for piece in cut.pieces]
    if names != list(layer_names):
        def some(xs: Sequence[str]) -> str:
            return ", ".join(list(xs)[:4]) + (", ..." if len(xs) > 4 else "")

        raise StageplanError(f"the model cuts into {len(names)} layers here ({some(names)}) and the plan has "
                             f"{len(layer_names)} ({some(layer_names)}): its profile is of another model or another "
                             "--layers; profile this model and plan again")
    wanted = sorted(set(int(k) for k in layers))
    n = len(cut.pieces)
    timed = set(wanted)
    if order == "stage":
        timed |= {k + 1 for k in wanted if k + 1 < n and k + 1 not in wanted}
    runs: dict[int, _Run] = {}
    env: dict[Any, Any] = {}
    for k, piece in enumerate(cut.pieces[: max(timed) + 1]):
        _materialize_piece(cut, model, piece, dev, weights, seed)
        values = [resolve(r, args, env) for r in piece.inputs]
        if k in timed:
            runs[k] = _make_run(piece, k, n, values, workload, target)
        if k < max(timed):
            env, _ = _stream_forward(env, cut, k, values)
        del values
        if k not in runs:
            _release_(piece.module)
    samples, _ = _time_rounds(list(runs.values()), Timer(dev), warmup, repeats, chain=order == "stage")
    for k in runs:
        _release_(cut.pieces[k].module)
    return {k: [median_iqr(s[j])[0] for j in range(3)] for k, s in zip(runs, samples) if k in wanted}


def _profile_estimate(ctx: _Context, gpu: Any, compute_efficiency: float | None,
                      memory_efficiency: float | None) -> Profile:
    from stageplan.estimate import estimate_module

    model, args, target, cut = _meta_cut(ctx, ctx.workload.model)
    n = len(cut.pieces)
    inputs, crossing = _fake_chain(cut, args, ctx.dev)
    plan = _dedup([layer_signature(cut, k, model, values) for k, values in enumerate(inputs)], ctx.dedup)
    figures: dict[int, _Figures] = {}
    method: dict[str, Any] = {}
    bar = Progress(len(plan.measured), f"estimating {n} layers for {gpu.name} ({len(plan.measured)} estimated)",
                   enabled=ctx.progress)
    for i, k in enumerate(plan.measured):
        bar.update(i, cut.pieces[k].name)

        def loss(out: Any) -> torch.Tensor:
            loss_value: torch.Tensor = ctx.workload.compute_loss(out, target)
            return loss_value

        # Attention as the target runs it: flash SDPA on every GPU in the table (CUDA and ROCm).
        est = estimate_module(cut.pieces[k].module, inputs[k], gpu=gpu, dtype=None, attention="flash",
                              compute_efficiency=compute_efficiency, memory_efficiency=memory_efficiency,
                              loss_fn=loss if k == n - 1 else None, inputs_require_grad=k > 0)
        method = est.method
        # memory-bound: every tensor the step touches read or written once, at eta_m of the spec bandwidth
        rate = float(method.get("memory_efficiency") or 1.0) * gpu.memory_bandwidth
        trained = sum(p.numel() * p.element_size()
                      for p in _distinct(list(used_parameters(cut.pieces[k].module).values())) if p.requires_grad)
        opt_s = {name: passes * trained / rate for name, passes in OPTIMIZER_PASSES.items()}
        figures[k] = _Figures(est.forward_s, est.backward_s, 0.0, 0.0, est.backward_s, est.activation_bytes, None, opt_s)
    bar.update(len(plan.measured), "done")
    bar.close()
    params = [_param_totals(p.module) for p in cut.pieces]
    extra = {
        "materialized": "none (analytic estimate on fake tensors)",
        "whole_model_s": None, "whole_model_iqr_s": None, "whole_model": "skipped: analytic estimate",
        "timer": "analytic",
        "optimizer_step": {"implementation": "analytic: bytes moved / (eta_m x bandwidth)"},
        "warmup": None, "repeats": None, "threads": None,  # nothing was timed
        "device_name": gpu.description,
        "estimate": {"gpu": gpu.name, "eta_c": method.get("compute_efficiency"), "eta_m": method.get("memory_efficiency"),
                     "attention": "flash", "sources": method.get("sources"), "model": method.get("model"),
                     "accuracy": ESTIMATE_ACCURACY},
        "method": "per-layer analytic roofline estimate (stageplan.estimate) on fake tensors, nothing run; "
                  "activation bytes exact via saved_tensors_hooks deduplicated by storage, views at their own extent; "
                  "optimizer step = tensors touched (sgd 3, momentum 5, adam/adamw 7) x parameter bytes / (eta_m x bandwidth)",
    }
    return _assemble(ctx, cut, model, plan, figures, crossing, params, extra, {}, _Peaks(), device=f"{_ESTIMATE_PREFIX}{gpu.name}")


def _assemble(ctx: _Context, cut: CutModel, model: nn.Module, plan: _Dedup, figures: Mapping[int, _Figures],
              crossing: Sequence[int], params: Sequence[tuple[int, int]], extra: dict[str, Any],
              memory: dict[str, Any], peaks: _Peaks, device: str | None = None) -> Profile:
    """Rows (a deduplicated layer takes its representative's figures, its own bytes) and meta."""
    names = cut.names
    results: list[LayerProfile] = []
    for k, piece in enumerate(cut.pieces):
        rep = plan.rep[k]
        fig = figures[rep]
        results.append(LayerProfile(
            name=piece.name, forward_s=fig.forward_s, backward_s=fig.backward_s, activation_bytes=fig.activation_bytes,
            output_bytes=int(crossing[k]), param_bytes=int(params[k][0]),
            param_count=int(params[k][1]), forward_iqr_s=fig.forward_iqr_s,
            backward_iqr_s=fig.backward_iqr_s, peak_bytes=fig.peak_bytes, backward_accumulate_s=fig.backward_accumulate_s,
            measured_as=None if rep == k else names[rep],
            optimizer_s=None if fig.optimizer_s is None else dict(fig.optimizer_s),
        ))
    spread: dict[str, Any] | None = None
    if plan.spread is not None:
        a, b = plan.spread
        fa, fb = figures[a], figures[b]
        spread = {"layer": names[b], "vs": names[a],
                  "forward_ratio": fb.forward_s / fa.forward_s if fa.forward_s > 0 else None,
                  "backward_ratio": fb.backward_s / fa.backward_s if fa.backward_s > 0 else None}
        off = [r for r in (spread["forward_ratio"], spread["backward_ratio"]) if r is not None and abs(r - 1) > DEDUP_SPREAD_WARN]
        if off:
            warnings.warn(
                f"identical layers {names[a]!r} and {names[b]!r} measured {', '.join(f'{r:.2f}x' for r in off)} apart "
                f"(more than {DEDUP_SPREAD_WARN:.0%}): the machine was busy or the layers differ in a way their "
                "signature misses; re-profile with more --repeats on a quiet machine, or with --no-dedup", stacklevel=4)
    dev = ctx.dev
    # a measured profile's step floor (an estimate prices its steps by bytes, and its meta says so instead)
    floors = _optimizer_floors(dev, Timer(dev), ctx.repeats) if device is None else None
    layer_sum = sum(r.forward_s + r.backward_s for r in results)
    whole = extra.get("whole_model_s")
    meta: dict[str, Any] = {
        "model": ctx.workload.name,
        "factory_options": dict(ctx.workload.factory_options),
        "layers_arg": list(ctx.layers) if ctx.layers else None,
        "split_method": cut.method,
        "named_layers": list(cut.named),
        "device": device or str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine()),
        "dtype": str(ctx.dt or next((p.dtype for p in model.parameters()), torch.float32)).replace("torch.", ""),
        "microbatch_size": ctx.mb,
        "batch_size": ctx.workload.batch_size,
        "input_shapes": [list(a.shape) for a in ctx.mb_args_cpu if isinstance(a, torch.Tensor)],
        "torch_version": torch.__version__,
        "stageplan_version": __version__,
        "threads": torch.get_num_threads(),
        "warmup": ctx.warmup,
        "repeats": ctx.repeats,
        # min_time_s can make more rounds than repeats: the fewest a measured layer got (None for an estimate)
        "min_time_s": ctx.min_time_s,
        "timed_rounds": min(ctx.timed_rounds) if ctx.timed_rounds else None,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "timer": "cuda_event" if dev.type == "cuda" else "perf_counter",
        "method": "per-layer forward and backward timed separately on detached inputs, median of repeats after warm-up; "
                  + ("in a stage's order (every layer's forward in turn, then every backward in reverse: a backward "
                     "follows the next layer's); " if ctx.order == "stage" else
                     "each backward right after its own forward; " if ctx.order == "layer" else "")
                  + "backward timed into empty grads (backward_s) and into filled grads (backward_accumulate_s); "
                  "activation bytes via saved_tensors_hooks deduplicated by storage, views at their own extent (the loss target "
                  "at its microbatch size); optimizer_s: median of repeats "
                  "of one step() per optimizer over copies of the layer's parameters with gradients of ones, torch's "
                  "default implementation, after warm-up steps",
        "optimizer_step": {"optimizers": {"sgd": "SGD(lr=1e-3)", "momentum": "SGD(lr=1e-3, momentum=0.9)",
                                          "adam": "Adam(lr=1e-3)", "adamw": "AdamW(lr=1e-3)"},
                           "implementation": "torch default (foreach=None, fused=None): foreach on CUDA, "
                                             "per-tensor loop on the CPU",
                           # the fixed cost of one step, in every layer's optimizer_s and paid once per rank
                           "floor_s": floors},
        "whole_model_s": whole,
        "whole_model_iqr_s": None,
        "sum_vs_whole": layer_sum / whole if whole else None,
        "dedup": ctx.dedup,
        # 'stage': every layer timed in a chain (identical layers share their optimizer step and bytes, and those
        # between identical neighbours their pooled times: pooled_layers); 'layer': each alone; None: estimated
        "order": ctx.order,
        "layers_measured": len(plan.measured),
        "layers_reused": sum(1 for k, r in enumerate(plan.rep) if r != k),
        "distinct_layers": plan.distinct,
        "dedup_spread": spread,
        "tied": _tied_parameters(cut, model),
        "peak_rss_bytes": peak_rss_bytes(),
        # other processes on the machine inflate wall-clock timings (seen here: up to 2x on 2 shared cores)
        "load_average_1min": os.getloadavg()[0],
    }
    meta.update(extra)
    if dev.type == "cuda":
        meta["peak_cuda_allocated_bytes"] = peaks.cuda
    if memory:
        meta["memory_check"] = memory
    return Profile(tuple(results), meta)
