"""Per-layer forward/backward timing, saved-for-backward bytes, parameter and boundary bytes -> Profile."""

from __future__ import annotations

import copy
import datetime as _dt
import os
import platform
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from stageplan._progress import Progress
from stageplan._version import __version__
from stageplan.errors import StageplanError, WorkloadError
from stageplan.layers import CutModel, cut_layers, resolve, store_outputs, tensor_bytes, used_parameters
from stageplan.measure import Timer, first_microbatch, median_iqr, saved_bytes
from stageplan.profile import LayerProfile, Profile
from stageplan.workload import Workload

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeviceError(StageplanError):
    """The requested device is not available here."""


def parse_device(device: str | torch.device) -> torch.device:
    """'cpu', 'cuda' or 'cuda:i', refused with a clear line when CUDA or that index is not present."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from exc
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DeviceError(f"device {str(device)!r} asked for, but this machine has no CUDA GPU "
                              f"(torch {torch.__version__}); use --device cpu or run on a GPU machine")
        if dev.index is not None and dev.index >= count:
            raise DeviceError(f"device {str(device)!r} asked for, but only {count} CUDA device(s) exist (0..{count - 1}); pick one of those")
    elif dev.type != "cpu":
        raise DeviceError(f"device type {dev.type!r} is not supported; use cpu, cuda or cuda:N")
    return dev


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise StageplanError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


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
) -> Profile:
    """Profile every layer of ``workload`` at ``microbatch_size`` on ``device``; the user's model is untouched."""
    if warmup < 0 or repeats < 1:
        raise StageplanError(f"warmup must be >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}; e.g. --warmup 3 --repeats 10")
    dev = parse_device(device)
    dt = parse_dtype(dtype)
    if dev.type == "cpu" and dt in (torch.float16, torch.bfloat16):
        import warnings

        warnings.warn(f"profiling in {str(dt).replace('torch.', '')} on the CPU: most CPU kernels have no fast half-precision "
                      "path (float16 ran about 20x slower than float32 here), so these times will not predict a GPU; "
                      "profile on the GPU you will train on, or estimate for it (--device estimate:NAME)", stacklevel=2)
    mb_args_cpu = first_microbatch(workload, microbatch_size)
    if not isinstance(workload.model, nn.Module):
        raise WorkloadError(f"workload.model must be a torch.nn.Module, got {type(workload.model).__name__}")

    rng_cpu = torch.get_rng_state()
    rng_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # one intra-op thread, as each pipeline rank will run
    try:
        return _profile(workload, microbatch_size, dev, dt, warmup, repeats, layers, progress, mb_args_cpu)
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng_cpu)
        if rng_cuda is not None:
            torch.cuda.set_rng_state_all(rng_cuda)


def _profile(workload: Workload, mb: int, dev: torch.device, dt: torch.dtype | None, warmup: int, repeats: int,
             layers: Sequence[str] | None, progress: bool, mb_args_cpu: tuple[Any, ...]) -> Profile:
    model = copy.deepcopy(workload.model).to(dev)
    if dt is not None:
        model = model.to(dt)
    model.train()
    args = _to(mb_args_cpu, dev, dt)
    target = workload.target[:mb] if isinstance(workload.target, torch.Tensor) else workload.target
    target = _to(target, dev, None)
    cut: CutModel = cut_layers(model, args, layers)
    timer = Timer(dev)

    # One forward pass through the chain gives every piece its real inputs.
    env: dict[Any, Any] = {}
    with torch.no_grad():
        for k, piece in enumerate(cut.pieces):
            store_outputs(env, k, piece.module(*[resolve(r, args, env) for r in piece.inputs]))

    n = len(cut.pieces)
    bar = Progress(warmup + repeats, f"profiling {n} layers", enabled=progress)
    states = []
    for k, piece in enumerate(cut.pieces):
        params = list({p.data_ptr(): p for p in used_parameters(piece.module).values()}.values())
        inputs = []
        for r in piece.inputs:
            v = resolve(r, args, env)
            if isinstance(v, torch.Tensor):
                v = v.detach().clone()
                if k > 0 and v.is_floating_point():
                    v.requires_grad_(True)  # a later stage computes the gradient of what it received
            inputs.append(v)

        def fwd(piece: Any = piece, inputs: list[Any] = inputs, last: bool = k == n - 1) -> Any:
            out = piece.module(*inputs)
            return workload.compute_loss(out, target) if last else out

        states.append((piece, params, inputs, fwd))

    def bwd_time(fwd: Callable[[], Any]) -> float:
        out = fwd()
        tensors = _grad_tensors(out)
        if not tensors:
            return 0.0
        grads = [torch.ones_like(t) for t in tensors]

        def bwd(tensors: list[torch.Tensor] = tensors, grads: list[torch.Tensor] = grads) -> None:
            torch.autograd.backward(tensors, grads)

        t_b, _ = timer(bwd)
        return t_b

    def fwd_bwd_time(fwd: Callable[[], Any], params: list[nn.Parameter], inputs: list[Any]) -> tuple[float, float, float]:
        """Forward; backward into empty .grad (autograd hands its buffer over: a step's first microbatch);
        backward again into the filled .grad (an add: every later microbatch of a pipeline step)."""
        t_f, out = timer(fwd)
        del out
        _zero_grads(params, inputs)
        t_first = bwd_time(fwd)
        _zero_grads([], inputs)
        t_acc = bwd_time(fwd)
        _zero_grads(params, inputs)
        return t_f, t_first, t_acc

    whole_params = list(model.parameters())

    def whole() -> None:
        loss = workload.compute_loss(model(*args), target)
        loss.backward()

    # Rounds: each round times every layer's forward, every layer's backward and the whole model once,
    # so that a load change on the machine hits all of them alike (medians are taken across rounds).
    fwd_times: list[list[float]] = [[] for _ in range(n)]
    bwd_times: list[list[float]] = [[] for _ in range(n)]
    acc_times: list[list[float]] = [[] for _ in range(n)]
    whole_times: list[float] = []
    for rnd in range(warmup + repeats):
        for k, (_, params, inputs, fwd) in enumerate(states):
            t_f, t_b, t_acc = fwd_bwd_time(fwd, params, inputs)
            if rnd >= warmup:
                fwd_times[k].append(t_f)
                bwd_times[k].append(t_b)
                acc_times[k].append(t_acc)
        t_w, _ = timer(whole)
        _zero_grads(whole_params, [])
        if rnd >= warmup:
            whole_times.append(t_w)
        bar.update(rnd + 1, "warm-up" if rnd < warmup else "measuring")
    bar.close()
    whole_med, whole_iqr = median_iqr(whole_times)

    results: list[LayerProfile] = []
    for k, (piece, params, inputs, fwd) in enumerate(states):
        param_ptrs = {p.untyped_storage().data_ptr() for p in piece.module.parameters()}
        act_bytes, out = saved_bytes(fwd, param_ptrs)
        del out
        peak: int | None = None
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            out = fwd()
            tensors = _grad_tensors(out)
            if tensors:
                torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
            torch.cuda.synchronize(dev)
            peak = int(torch.cuda.max_memory_allocated(dev) - base)
            del out, tensors
        _zero_grads(params, inputs)
        crossing = 0 if k == n - 1 else sum(tensor_bytes(resolve(r, args, env)) for r in cut.crossing_refs(k))
        f_med, f_iqr = median_iqr(fwd_times[k])
        b_med, b_iqr = median_iqr(bwd_times[k])
        results.append(LayerProfile(
            name=piece.name, forward_s=f_med, backward_s=b_med, activation_bytes=int(act_bytes),
            output_bytes=int(crossing), param_bytes=int(sum(p.numel() * p.element_size() for p in params)),
            param_count=int(sum(p.numel() for p in params)), forward_iqr_s=f_iqr, backward_iqr_s=b_iqr, peak_bytes=peak,
            backward_accumulate_s=median_iqr(acc_times[k])[0],
        ))

    layer_sum = sum(r.forward_s + r.backward_s for r in results)
    meta: dict[str, Any] = {
        "model": workload.name,
        "factory_options": dict(workload.factory_options),
        "layers_arg": list(layers) if layers else None,
        "split_method": cut.method,
        "named_layers": list(cut.named),
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine()),
        "dtype": str(dt or next((p.dtype for p in model.parameters()), torch.float32)).replace("torch.", ""),
        "microbatch_size": mb,
        "batch_size": workload.batch_size,
        "input_shapes": [list(a.shape) for a in args if isinstance(a, torch.Tensor)],
        "torch_version": torch.__version__,
        "stageplan_version": __version__,
        "threads": torch.get_num_threads(),
        "warmup": warmup,
        "repeats": repeats,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "timer": "cuda_event" if dev.type == "cuda" else "perf_counter",
        "method": "per-layer forward and backward timed separately on detached inputs, median of repeats after warm-up; "
                  "backward timed into empty grads (backward_s) and into filled grads (backward_accumulate_s); "
                  "activation bytes via saved_tensors_hooks deduplicated by storage",
        "whole_model_s": whole_med,
        "whole_model_iqr_s": whole_iqr,
        "sum_vs_whole": layer_sum / whole_med if whole_med > 0 else None,
        # other processes on the machine inflate wall-clock timings (seen here: up to 2x on 2 shared cores)
        "load_average_1min": os.getloadavg()[0],
    }
    return Profile(tuple(results), meta)
