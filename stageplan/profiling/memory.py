"""Memory the profiler reads: free bytes on the device, the process's peak RSS, the whole model's parameter
and activation bytes without data (fake tensors), and a layer's saved bytes and peak during its timed runs."""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stageplan.materialize import (
    parameter_bytes,
)
from stageplan.measure import (
    SavedTensorTracker,
    saved_bytes,
    storage_identity,
)
from stageplan.profiling.device import parse_dtype
from stageplan.timing import LayerRun, grad_tensors, to_device, typed_meta_copy, zero_grads

# --------------------------------------------------------------------------------------------------
# Memory: what the whole model would need, what the device has free, what this process used


def free_bytes(device: torch.device) -> int:
    """Memory the device can give now: CUDA's free memory, or the machine's MemAvailable for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines()
                    if ln.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024  # kB
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (ru_maxrss is in KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def fake_state(module: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Fake tensors (call inside a FakeTensorMode) shaped like the module's parameters and buffers."""
    state: dict[str, torch.Tensor] = {}
    fakes: dict[int, torch.Tensor] = {}  # a tied parameter is one fake under all its names (functional_call
    # refused two values for tied keys, so a layer holding a tie could not be streamed or estimated)
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in fakes:
            fakes[id(p)] = torch.empty_strided(
                p.shape, p.stride(), dtype=p.dtype, device=device
            ).requires_grad_(p.requires_grad)
        state[name] = fakes[id(p)]
    for name, b in module.named_buffers(remove_duplicate=False):
        if id(b) not in fakes:
            fakes[id(b)] = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device=device)
        state[name] = fakes[id(b)]
    return state


def fake_inputs(args: tuple[Any, ...], device: torch.device) -> tuple[Any, ...]:
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
            state = fake_state(model, cpu)
            tracker = SavedTensorTracker({storage_identity(t) for t in state.values()}, key=storage_identity)
            fake_args = fake_inputs(args, cpu)
            with tracker.hooks():
                out = torch.func.functional_call(model, state, fake_args)
            live = tracker.live
            del out
            return int(live)
    except Exception:  # any failure only means the rule falls back to parameters alone
        return None


def whole_model_bytes(
    model: nn.Module, args: tuple[Any, ...], dtype: str | torch.dtype | None = None
) -> tuple[int, int | None]:
    """What profiling the whole model at once holds: a copy of its parameters (in ``dtype``), their gradients,
    and the activations of one forward+backward of the whole model (the whole-model timing keeps every
    layer's, not only one layer's). Counted on a weightless copy. Returns (bytes, activation bytes or None
    when they could not be counted without data: then parameters alone decide)."""
    dt = parse_dtype(dtype)
    meta = typed_meta_copy(model, dt, torch.device("cpu"))
    acts = _activation_bytes_without_data(meta, tuple(to_device(a, torch.device("cpu"), dt) for a in args))
    return 2 * parameter_bytes(meta) + (acts or 0), acts


def bytes_and_peak(run: LayerRun, dev: torch.device, peaks: Peaks) -> tuple[int, int | None]:
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
        tensors = grad_tensors(out)
        if tensors:
            torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
        torch.cuda.synchronize(dev)
        peak = int(torch.cuda.max_memory_allocated(dev) - base)
        peaks.note_cuda(dev)
        del out, tensors
    zero_grads(run.params, run.inputs)
    return int(act_bytes), peak


class Peaks:
    """The largest CUDA allocation seen (the per-layer peaks reset torch's counter)."""

    def __init__(self) -> None:
        self.cuda = 0

    def note_cuda(self, dev: torch.device) -> None:
        self.cuda = max(self.cuda, int(torch.cuda.max_memory_allocated(dev)))
