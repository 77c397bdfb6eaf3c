"""Estimate a layer's forward/backward time and saved-for-backward
bytes on a GPU you do not have, running nothing.

The layer runs forward and backward under ``FakeTensorMode`` on fake CPU tensors: shapes, dtypes and
strides are real, no data is allocated, so a LLaMA-70B decoder layer at sequence 4096 takes well under a
second and under 0.5 GB of RSS (torch included). (Fake *CUDA* tensors abort a CPU-only torch in SDPA and
backward, so the fake tensors are CPU ones; the CPU flash SDPA kernel saves q, k, v, out and logsumexp, as
CUDA flash attention does.) A ``TorchDispatchMode`` records every aten op:

- FLOPs from ``torch.utils.flop_counter``'s formula registry (matmuls, convolutions, SDPA). It has no
  formula for ``aten._scaled_dot_product_flash_attention_for_cpu`` (FlopCounterMode counts 0 for it), so
  that kernel is counted here as the math backend would: 4·B·H·Sq·Sk·D forward (QKᵀ and PV, 2 FLOPs per
  multiply-add) and 2× that backward. No causal halving and no backward recompute of QKᵀ are counted:
  the published MFU figures the default efficiency comes from count attention the same way
  (torchtitan's 12·L·H·Q·T per token uses the full sequence), so the two conventions cancel.
- bytes moved: the op's tensor inputs read plus its tensor outputs written (views and allocations move 0).

Each op takes ``max(flops / (eta_c · peak[dtype]), bytes / (eta_m · bandwidth))`` seconds (a roofline);
forward and backward are the sums over their ops. Kernel-launch overheads and fusion are not modelled:
every aten op is one kernel that reaches HBM. Saved-for-backward bytes are exact: the tensors that
``torch.autograd.graph.saved_tensors_hooks`` sees, deduplicated by storage, parameters and buffers
excluded.

GPU figures (peak FLOP/s per dtype, memory bandwidth and size, link bandwidths) live in ``gpus.json``,
each row with the public spec sheet it was read from.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from stageplan._progress import Progress
from stageplan.errors import StageplanError, WorkloadError
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.layers import used_parameters
from stageplan.measure import SavedTensorTracker, storage_identity
from stageplan.profiling.assemble import Figures, assemble, param_totals
from stageplan.profiling.device import ESTIMATE_PREFIX
from stageplan.profiling.memory import Peaks
from stageplan.profiling.optimizer import OPTIMIZER_PASSES
from stageplan.profiling.signatures import layer_signature, plan_dedup
from stageplan.profiling.streaming import fake_chain
from stageplan.timing import LayerContext, distinct_params, meta_cut

# Default compute efficiency eta_c: the fraction of the dense peak a matmul-bound op reaches. 0.45 sits in
# the published model-FLOPs utilisation of large-model training on H100: Megatron-LM 41-48% (NVIDIA
# Megatron-LM README, GPT 2B-462B on H100) and torchtitan 33-39% (Llama-3.1-8B on H100, torchtitan
# benchmarks). An MFU is a whole-step figure, so using it per op is pessimistic for the matmuls and leaves
# room for what this model ignores (launches, communication). With the memory-bound ops on top, a LLaMA-70B
# block (bf16, sequence 4096, flash) comes out at 40% implied MFU on an H100 SXM. The published figures span
# 33-48%, so one MFU for every model moves absolute times by a quarter either way, and no GPU has checked them
# yet (benchmarks/gpu_profiles.sh does, where one is); ratios between layers, which the solver needs, are
# steadier.
DEFAULT_COMPUTE_EFFICIENCY = 0.45
# Default memory efficiency eta_m: memory-bound kernels (elementwise, norms, softmax) typically reach
# 60-80% of the spec-sheet HBM bandwidth (STREAM-like copies on A100/H100); 0.7 is the middle.
DEFAULT_MEMORY_EFFICIENCY = 0.7
_EFFICIENCY_SOURCES = {
    "compute_efficiency": "published MFU on H100: Megatron-LM 41-48%, torchtitan Llama-3.1-8B 33-39%",
    "memory_efficiency": "memory-bound kernels typically reach 60-80% of spec-sheet bandwidth",
}

# Peak keys in gpus.json; torch dtypes map onto them (fp32 parameters may ask for the tf32 peak).
_DTYPE_KEYS = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "tf32": "tf32",
               "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16"}
_TORCH_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_ATTENTION = ("flash", "math")



@dataclass(frozen=True)
class LinkSpec:
    """A link between GPUs: ``bandwidth`` in bytes/s one way, to one peer."""

    name: str
    bandwidth: float
    source: str


@dataclass(frozen=True)
class GpuSpec:
    """Published figures of one GPU (SI units: FLOP/s, bytes/s, bytes); ``source`` names the spec sheet."""

    name: str
    description: str
    peak_fp32_flops: float
    peak_tf32_flops: float
    peak_bf16_flops: float
    peak_fp16_flops: float
    memory_bandwidth: float
    memory_bytes: int
    source: str
    intra_node: LinkSpec
    inter_node: LinkSpec

    def peak_flops(self, dtype: str | torch.dtype) -> float:
        """Dense peak FLOP/s for 'fp32', 'tf32', 'bf16', 'fp16' (or a torch float dtype)."""
        key = _dtype_key(dtype)
        return float(getattr(self, f"peak_{key}_flops"))


@dataclass(frozen=True)
class LayerEstimate:
    """Estimated costs of one layer for one microbatch (seconds, FLOPs, bytes).

    ``activation_bytes`` is exact (saved for backward, deduplicated by storage, parameters and buffers
    excluded); the times are roofline estimates; ``method`` says how they were made.
    """

    forward_s: float
    backward_s: float
    activation_bytes: int
    output_bytes: int
    param_bytes: int
    param_count: int
    forward_flops: int
    backward_flops: int
    forward_bytes_moved: int
    backward_bytes_moved: int
    method: dict[str, Any] = field(default_factory=dict)

    def to_layer_profile(self, name: str) -> LayerProfile:
        """The planner's LayerProfile (``output_bytes`` taken as the bytes that cross a boundary after it)."""
        return LayerProfile(name=name, forward_s=self.forward_s, backward_s=self.backward_s,
                            activation_bytes=self.activation_bytes, output_bytes=self.output_bytes,
                            param_bytes=self.param_bytes, param_count=self.param_count)


# ---------------------------------------------------------------------------------------------- GPU table

@cache
def _table() -> dict[str, Any]:
    text = resources.files("stageplan").joinpath("gpus.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def known_gpus() -> tuple[str, ...]:
    """The GPU names ``gpu_spec`` accepts, in table order."""
    return tuple(_table()["gpus"])


def _link(row: Mapping[str, Any]) -> LinkSpec:
    return LinkSpec(name=str(row["name"]), bandwidth=float(row["bandwidth"]), source=str(row["source"]))


@cache
def gpu_spec(name: str) -> GpuSpec:
    """The published figures of GPU ``name`` (case-insensitive,
    e.g. 'h100-sxm'); StageplanError if unknown."""
    table = _table()
    key = str(name).strip().lower()
    row = table["gpus"].get(key)
    if row is None:
        raise StageplanError(f"unknown GPU {name!r} for --device {ESTIMATE_PREFIX}{name}; "
                             f"known: {', '.join(known_gpus())}")
    peaks = row["peak_flops"]
    return GpuSpec(
        name=key, description=str(row["name"]),
        peak_fp32_flops=float(peaks["fp32"]), peak_tf32_flops=float(peaks["tf32"]),
        peak_bf16_flops=float(peaks["bf16"]), peak_fp16_flops=float(peaks["fp16"]),
        memory_bandwidth=float(row["memory_bandwidth"]), memory_bytes=int(row["memory_bytes"]),
        source=str(row["source"]), intra_node=_link(row["intra_node"]),
        inter_node=_link(row.get("inter_node", table["inter_node_default"])),
    )


def parse_estimate_device(device: str) -> GpuSpec:
    """'estimate:h100-sxm' -> the H100 SXM's GpuSpec; StageplanError for any other text or an unknown GPU."""
    text = str(device).strip()
    if not text.lower().startswith(ESTIMATE_PREFIX) or not text[len(ESTIMATE_PREFIX):].strip():
        raise StageplanError(f"device {device!r} is not an estimate device; use {ESTIMATE_PREFIX}<gpu>, "
                             f"e.g. {ESTIMATE_PREFIX}h100-sxm (known: {', '.join(known_gpus())})")
    return gpu_spec(text[len(ESTIMATE_PREFIX):].strip())


def _dtype_key(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        key = _TORCH_KEYS.get(dtype)
    else:
        key = _DTYPE_KEYS.get(str(dtype).strip().lower().replace("torch.", ""))
    if key is None:
        raise StageplanError(f"no peak FLOP/s for dtype {dtype!r}; use one of fp32, tf32, bf16, fp16")
    return key


# ------------------------------------------------------------------------------------------ op accounting

_ATEN = torch.ops.aten
_CPU_FLASH = _ATEN._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward
# Ops that move no bytes although their schema does not call them views: allocation and metadata.
_NO_TRAFFIC = {_ATEN.empty, _ATEN.empty_like, _ATEN.empty_strided, _ATEN.new_empty, _ATEN.new_empty_strided,
               _ATEN._unsafe_view, _ATEN._reshape_alias, _ATEN.lift_fresh}


def _attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Forward FLOPs of softmax(QKᵀ)V as the math backend
    counts them: 2·B·H·Sq·Sk·(D + Dv), no causal halving."""
    *batch, heads, s_q, d = q.shape
    s_k, d_v = k.shape[-2], v.shape[-1]
    b = 1
    for n in batch:
        b *= int(n)
    return 2 * b * int(heads) * int(s_q) * int(s_k) * (int(d) + int(d_v))


def _op_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    packet = func._overloadpacket
    if packet is _CPU_FLASH:
        return _attention_flops(args[0], args[1], args[2])
    if packet is _CPU_FLASH_BACKWARD:  # (grad_out, q, k, v, out, logsumexp, ...): dQ, dK, dV, dP = 2x forward
        return 2 * _attention_flops(args[1], args[2], args[3])
    formula = flop_registry.get(packet)
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


def _footprint(t: torch.Tensor) -> int:
    """Bytes a kernel touches to read or write ``t``: its elements, or less when strides repeat (expand)."""
    numel = t.numel()
    if numel == 0:
        return 0
    span = 1 + sum((int(n) - 1) * abs(int(s)) for n, s in zip(t.shape, t.stride()) if n > 1)
    return min(numel, span) * t.element_size()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _op_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    mutable = func._schema.is_mutable
    outs = _tensors(out)
    if not mutable and (func.is_view or func._overloadpacket in _NO_TRAFFIC or not outs):
        return 0
    inputs = {id(t): t for t in _tensors((args, kwargs))}
    if not outs:  # an in-place op returning nothing (_foreach_*_): it writes its mutated arguments
        outs = [a for a, spec in zip(args, func._schema.arguments)
                if isinstance(a, torch.Tensor) and spec.alias_info is not None and spec.alias_info.is_write]
    return sum(_footprint(t) for t in inputs.values()) + sum(_footprint(t) for t in outs)


class _OpRecorder(TorchDispatchMode):
    """Records (flops, bytes) of every aten op into the current phase ('forward'/'backward'; None: skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase: str | None = None
        self.ops: dict[str, list[tuple[int, int]]] = {"forward": [], "backward": []}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.phase is not None:
            self.ops[self.phase].append(
                (_op_flops(func, args, kwargs, out), _op_bytes(func, args, kwargs, out)))
        return out


class _SdpaCalls(TorchFunctionMode):
    """Counts F.scaled_dot_product_attention calls: 0 means
    ``attention`` had nothing to choose (eager attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))


# -------------------------------------------------------------------------------------------- the estimate

def _check_efficiency(value: float | None, default: float, what: str) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) <= 1.0:
        raise StageplanError(f"{what} must be a fraction in (0, 1], got {value!r}; e.g. {default}")
    return float(value)


def _model_dtype(module: nn.Module, args: Sequence[Any]) -> torch.dtype | None:
    """The floating dtype holding most parameter elements, else the first floating input's dtype."""
    counts: dict[torch.dtype, int] = {}
    for p in module.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    if counts:
        return max(counts, key=lambda d: counts[d])
    return next((t.dtype for t in _tensors(args) if t.is_floating_point()), None)


def _peak_key(module: nn.Module, args: Sequence[Any], dtype: str | torch.dtype | None) -> str:
    found = _model_dtype(module, args)
    found_key = _TORCH_KEYS.get(found) if found is not None else None
    if dtype is None:
        if found_key is None:
            raise StageplanError(f"cannot tell the compute dtype (parameters/inputs are {found}); "
                                 "pass dtype='bf16', 'fp16', 'fp32' or 'tf32'")
        return found_key
    key = _dtype_key(dtype)
    want = "fp32" if key == "tf32" else key
    if found_key is not None and found_key != want:
        raise StageplanError(
            f"dtype {dtype!r} asked for, but the layer's parameters are {found}; build the model under "
            f"torch.set_default_dtype(...) for that dtype (do not call .to(dtype) on a meta or fake model)")
    return key


def estimate_module(
    module: nn.Module,
    args: Any,
    *,
    gpu: str | GpuSpec,
    dtype: str | torch.dtype | None,
    compute_efficiency: float | None = None,
    memory_efficiency: float | None = None,
    attention: str = "flash",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    inputs_require_grad: bool = True,
) -> LayerEstimate:
    """Estimate ``module(*args, **kwargs)``'s forward and backward on ``gpu`` without running it for real.

    - ``module``: parameters on any device, ``meta`` included (never moved, cast or mutated). Build it
      under the target default dtype; its parameters' dtype picks the peak FLOP/s.
    - ``args``: the activations the layer receives (a tensor or a tuple; meta tensors are fine; only shapes,
      dtypes and strides are used). Floating ones require grad when ``inputs_require_grad`` (a stage
      after the first computes the gradient of what it received); ``kwargs`` are side inputs without
      gradient (masks, position embeddings).
    - ``dtype``: 'bf16', 'fp16', 'fp32' or 'tf32' (fp32 parameters on the TF32 peak), or None to take the
      parameters' dtype; a dtype the parameters do not have is refused.
    - ``compute_efficiency`` / ``memory_efficiency``: fractions of peak FLOP/s and of bandwidth (defaults
      DEFAULT_COMPUTE_EFFICIENCY, DEFAULT_MEMORY_EFFICIENCY).
    - ``attention``: 'flash' forces the flash SDPA kernel (saves q, k, v, out, logsumexp), 'math' the math
      backend (saves the S×S attention matrix); match the target's backend. ``method['sdpa_calls']`` counts
      the F.scaled_dot_product_attention calls it applied to (0 for eager attention, e.g. an HF config
      without ``attn_implementation='sdpa'``).
    - ``loss_fn``: called on the output (under fake mode) to give the scalar that backward starts from;
      without it backward starts from a gradient of ones on every output that requires grad.
    """
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    if attention not in _ATTENTION:
        raise StageplanError(f"attention must be one of {', '.join(_ATTENTION)}, got {attention!r}")
    eta_c = _check_efficiency(compute_efficiency, DEFAULT_COMPUTE_EFFICIENCY, "compute_efficiency")
    eta_m = _check_efficiency(memory_efficiency, DEFAULT_MEMORY_EFFICIENCY, "memory_efficiency")
    args_t = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs_d = dict(kwargs or {})
    key = _peak_key(module, args_t, dtype)
    peak, bandwidth = spec.peak_flops(key), spec.memory_bandwidth

    params = dict(module.named_parameters())
    param_count = sum(p.numel() for p in params.values())
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    run = _run_fake(module, args_t, kwargs_d, attention=attention, loss_fn=loss_fn,
                    inputs_require_grad=inputs_require_grad)

    def total_time(ops: list[tuple[int, int]]) -> float:
        return sum(max(f / (eta_c * peak), b / (eta_m * bandwidth)) for f, b in ops)

    fwd, bwd = run.ops["forward"], run.ops["backward"]
    method: dict[str, Any] = {
        "model": "per-op roofline max(flops/(eta_c*peak), bytes/(eta_m*bandwidth)) over the aten ops of a "
                 "fake-tensor forward and backward; saved bytes via saved_tensors_hooks deduplicated by "
                 "storage",
        "gpu": spec.name,
        "dtype": key,
        "peak_flops": peak,
        "memory_bandwidth": bandwidth,
        "compute_efficiency": eta_c,
        "memory_efficiency": eta_m,
        "attention": attention,
        "attention_causal_halving": False,
        "sdpa_calls": run.sdpa_calls,
        "ops": {"forward": len(fwd), "backward": len(bwd)},
        "sources": {"gpu": spec.source, **_EFFICIENCY_SOURCES},
    }
    return LayerEstimate(
        forward_s=total_time(fwd), backward_s=total_time(bwd),
        activation_bytes=int(run.saved_bytes), output_bytes=int(run.output_bytes),
        param_bytes=int(param_bytes), param_count=int(param_count),
        forward_flops=sum(f for f, _ in fwd), backward_flops=sum(f for f, _ in bwd),
        forward_bytes_moved=sum(b for _, b in fwd), backward_bytes_moved=sum(b for _, b in bwd),
        method=method,
    )


@dataclass(frozen=True)
class _FakeRun:
    """What one forward and backward on fake tensors recorded: (flops, bytes) per aten op of each phase, the
    bytes saved for backward, the output's bytes, and the F.scaled_dot_product_attention calls."""

    ops: dict[str, list[tuple[int, int]]]
    saved_bytes: int
    output_bytes: int
    sdpa_calls: int


def _fake_like(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """Called inside fake_mode: a fake CPU tensor with ``t``'s shape, strides and dtype, and no data."""
    x = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return x.requires_grad_(requires_grad and (t.is_floating_point() or t.is_complex()))


def _run_fake(module: nn.Module, args_t: tuple[Any, ...], kwargs_d: dict[str, Any], *, attention: str,
              loss_fn: Callable[[Any], torch.Tensor] | None, inputs_require_grad: bool) -> _FakeRun:
    """Run ``module`` forward and backward on fake CPU tensors like its parameters, buffers and inputs, under
    the ``attention`` SDPA backend, recording every aten op; WorkloadError for a layer whose shapes need
    data."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
        UnsupportedFakeTensorException,
    )
    from torch.nn.attention import SDPBackend, sdpa_kernel

    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    recorder = _OpRecorder()
    sdpa_calls = _SdpaCalls()
    backend = SDPBackend.FLASH_ATTENTION if attention == "flash" else SDPBackend.MATH
    try:
        with fake_mode:
            state = {n: _fake_like(p, p.requires_grad) for n, p in params.items()}
            state.update({n: _fake_like(b, False) for n, b in buffers.items()})
            tracker = SavedTensorTracker({storage_identity(t) for t in state.values()}, key=storage_identity)
            f_args = tree_map(lambda x: _fake_like(x, inputs_require_grad) if isinstance(x, torch.Tensor)
                              else x, args_t)
            f_kwargs = tree_map(lambda x: _fake_like(x, False) if isinstance(x, torch.Tensor) else x,
                                kwargs_d)

            with recorder, sdpa_kernel(backend), sdpa_calls:
                recorder.phase = "forward"
                with tracker.hooks():
                    out = torch.func.functional_call(module, state, f_args, f_kwargs)
                    root = loss_fn(out) if loss_fn is not None else None
                saved_bytes = tracker.live  # before the backward frees them
                recorder.phase = None
                outs = [t for t in _tensors(out) if t.requires_grad]
                if root is not None:
                    roots, grads = [root], [torch.ones_like(root)]
                else:
                    roots, grads = outs, [torch.ones_like(t) for t in outs]
                recorder.phase = "backward"
                if roots and any(r.requires_grad for r in roots):
                    torch.autograd.backward(roots, grads)
                recorder.phase = None
            output_bytes = sum(t.numel() * t.element_size() for t in _tensors(out))
    except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedFakeTensorException) as exc:
        raise WorkloadError(f"{type(module).__name__} cannot be estimated without data: {exc}; "
                            "estimate a part whose shapes do not depend on tensor values") from exc
    except RuntimeError as exc:
        if attention == "flash" and "No available kernel" in str(exc):
            raise StageplanError(f"the flash SDPA kernel cannot run {type(module).__name__}'s attention "
                                 f"({exc}); "
                                 "use attention='math'") from exc
        raise
    return _FakeRun(recorder.ops, saved_bytes, output_bytes, sdpa_calls.calls)


ESTIMATE_ACCURACY = "analytic, not yet checked against a GPU; ratios between layers are what the solver needs"


def profile_estimate(ctx: LayerContext, gpu: Any, compute_efficiency: float | None,
                      memory_efficiency: float | None) -> Profile:

    model, args, target, cut = meta_cut(ctx, ctx.workload.model)
    n = len(cut.pieces)
    inputs, crossing = fake_chain(cut, args, ctx.dev)
    plan = plan_dedup([layer_signature(cut, k, model, values) for k, values in enumerate(inputs)], ctx.dedup)
    figures: dict[int, Figures] = {}
    method: dict[str, Any] = {}
    bar = Progress(len(plan.measured),
                   f"estimating {n} layers for {gpu.name} ({len(plan.measured)} estimated)",
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
                      for p in distinct_params(list(used_parameters(cut.pieces[k].module).values()))
                      if p.requires_grad)
        opt_s = {name: passes * trained / rate for name, passes in OPTIMIZER_PASSES.items()}
        figures[k] = Figures(est.forward_s, est.backward_s, 0.0, 0.0, est.backward_s, est.activation_bytes,
                             None, opt_s)
    bar.update(len(plan.measured), "done")
    bar.close()
    params = [param_totals(p.module) for p in cut.pieces]
    extra = {
        "materialized": "none (analytic estimate on fake tensors)",
        "whole_model_s": None, "whole_model_iqr_s": None, "whole_model": "skipped: analytic estimate",
        "timer": "analytic",
        # in the profiled dtype with no master copy; plan --precision bf16-mixed prices the fp32 master and
        # states instead (stageplan.planning.precision: Adam 28 bytes per parameter against 14 in bf16)
        "optimizer_step": {"implementation": "analytic: bytes moved / (eta_m x bandwidth), parameters, "
                                             "gradients and states in the profiled dtype"},
        "warmup": None, "repeats": None, "threads": None,  # nothing was timed
        "device_name": gpu.description,
        "estimate": {"gpu": gpu.name, "eta_c": method.get("compute_efficiency"),
                     "eta_m": method.get("memory_efficiency"),
                     "attention": "flash", "sources": method.get("sources"), "model": method.get("model"),
                     "accuracy": ESTIMATE_ACCURACY},
        "method": "per-layer analytic roofline estimate (stageplan.profiling.estimate) on fake tensors, "
                  "nothing run; activation bytes exact via saved_tensors_hooks deduplicated by storage, "
                  "views at their own extent; optimizer step = tensors touched (sgd 3, momentum 5, "
                  "adam/adamw 7) x parameter bytes / (eta_m x bandwidth), repriced by plan --precision",
    }
    return assemble(ctx, cut, model, plan, figures, crossing, params, extra, {}, Peaks(),
                    device=f"{ESTIMATE_PREFIX}{gpu.name}")
