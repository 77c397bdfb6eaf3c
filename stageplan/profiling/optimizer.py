"""The optimizer step per layer, timed on the layer's own
parameters and gradients, and its fixed cost per call."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from stageplan.measure import (
    CacheFlush,
    Timer,
    median_iqr,
)
from stageplan.timing import LayerRun, grad_tensors, zero_grads

# The optimizers the profiler times, as torch builds them (lr is irrelevant to the time; momentum 0.9 is the
# usual). Each uses torch's default implementation for the parameters' device (foreach=None, fused=None):
# torch 2.13 picks foreach on CUDA and the per-tensor loop on the CPU.
_OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
}
# Tensors an optimizer step reads or writes per parameter, each once (it is memory-bound): read the parameter
# and its gradient, write the parameter, read and write each state (momentum: 1 buffer; Adam/AdamW: exp_avg
# and exp_avg_sq). The estimate device prices a step as these bytes / (eta_m * bandwidth).
OPTIMIZER_PASSES: dict[str, int] = {"sgd": 3, "momentum": 5, "adam": 7, "adamw": 7}
OPTIMIZER_REPEATS = 5  # timed optimizer steps per layer and optimizer
# The most elements a layer's timed step copies: a larger layer's step is timed on an evenly strided sample of
# every one of its tensors, at this many elements and at half as many, and the time is extrapolated to the
# whole layer by element count (:func:`optimizer_times`). 2^24 fp32 elements are 64 MiB, so a step's copies,
# gradients and two Adam states hold 256 MiB at most, whatever the layer (a 152k-token fp32 head is 2.2 GB:
# its step over whole copies had held about 5x that), and each sample is still larger than a last-level cache.
OPTIMIZER_SLICE_ELEMENTS = 1 << 24
SLICE_ABOVE = 4  # a layer is sampled only above this many slices' elements (optimizer_times)
# What the profile's meta says of the slicing (assemble.py writes it under meta["optimizer_step"])
OPTIMIZER_SLICE_NOTE = (
    f"a layer above {SLICE_ABOVE * OPTIMIZER_SLICE_ELEMENTS} elements has its step timed on an evenly "
    f"strided sample of each tensor (its parameters and the gradient its backward made) at "
    f"{OPTIMIZER_SLICE_ELEMENTS} and at {OPTIMIZER_SLICE_ELEMENTS // 2} elements, extrapolated linearly to "
    "the layer's element count (the step is elementwise: a fixed cost per call and per tensor, and a cost "
    "per element)")


def layer_grads(run: LayerRun) -> list[torch.Tensor | None]:
    """The gradient each of ``run.params`` gets from one forward and backward of the layer (the output's
    gradient all ones, as :func:`fwd_bwd_time` gives it; the last layer's loss its own): what the optimizer
    step reads. A parameter the backward does not reach gets None, and a step skips it, as torch's optimizers
    skip a None grad."""
    out = run.fwd()
    tensors = grad_tensors(out)
    if tensors:
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
    del out, tensors
    # handed over, not copied: the parameters lose them next anyway (a copy had held the layer's gradients
    # twice, 4.4 GB more for a 152k-token fp32 head)
    grads = [p.grad.detach() if p.grad is not None else None for p in run.params]
    zero_grads(run.params, run.inputs)
    return grads


def optimizer_times(params: Sequence[nn.Parameter], timer: Timer, repeats: int,
                     grads: Sequence[torch.Tensor | None] | None = None,
                     slice_elements: int = OPTIMIZER_SLICE_ELEMENTS) -> dict[str, float]:
    """Median seconds of one ``step()`` of each optimizer over copies of ``params`` (so that the layer itself
    is not changed), after one warm-up step (it creates the states), over at most ``OPTIMIZER_REPEATS`` steps:
    a step is memory-bound and steady, and on a 7B block each Adam step costs about a second, so the layer's
    own repeats would add minutes to a profile. Each timed step starts from a flushed last-level cache
    (:class:`CacheFlush`), as a rank's step does after its backward.

    A layer of more than 4 x ``slice_elements`` elements is not copied whole: its step is timed on every
    tensor's evenly strided sample (each tensor kept, so the per-tensor cost is the layer's), at
    ``slice_elements`` and at half as many, and extrapolated to the layer's element count along the line
    through the two. The step is elementwise, so its time is a fixed cost plus a cost per element
    (OPTIMIZER_PASSES tensors read or written per element); a copy of the whole layer, with its gradients and
    Adam's two states, had held 5x the layer (18.4 GB to profile a 152k-token fp32 head).

    ``grads`` (one per parameter, from :func:`layer_grads`: one microbatch's, where a step reads the sum over
    m, so an embedding has a few more zero rows in it than in the step) are the gradients the step reads;
    without them, gradients of ones. The values matter: an embedding's gradient is zero on every row its batch
    does not use (97% of a 16384-token table at 512 tokens), Adam's ``exp_avg_sq`` stays zero there, and
    torch's CPU ``sqrt`` of a zero can take 8x its time on a non-zero (2.68 against 0.32 ms over 2M floats,
    numpy 0.61 ms either way, measured on a 2-core CPU host), so that table's Adam step took 10.7 ms with its
    real gradient against 5.4 ms with ones; a strided sample keeps the share of zero rows."""
    given = list(grads) if grads is not None else [None] * len(params)
    trained = [(p, g) for p, g in zip(params, given) if p.requires_grad and (grads is None or g is not None)]
    if not trained:
        return dict.fromkeys(_OPTIMIZERS, 0.0)
    total = sum(p.numel() for p, _ in trained)
    # up to 4 slices' worth the layer is stepped whole (its copies, gradients and states at most 1 GiB in fp32
    # at the default): sampling a layer just above one slice at two sizes left more of the heap resident than
    # the whole step did (24 fp32 layers of 4096 x 4096 streamed: 1.11 GB peak RSS against 0.88 GB whole)
    if total <= SLICE_ABOVE * slice_elements:
        return _step_times(trained, 1, timer, repeats)
    small, large = slice_elements // 2, slice_elements
    stride_small, stride_large = -(-total // small), -(-total // large)  # ceil: at most that many elements
    t_small = _step_times(trained, stride_small, timer, repeats)
    t_large = _step_times(trained, stride_large, timer, repeats)
    n_small = sum(-(-p.numel() // stride_small) for p, _ in trained)
    n_large = sum(-(-p.numel() // stride_large) for p, _ in trained)
    out = {}
    for name in _OPTIMIZERS:
        per_element = (t_large[name] - t_small[name]) / (n_large - n_small) if n_large > n_small else 0.0
        # the fixed part, between 0 (noise made the smaller sample look dearer) and the smaller sample's time
        fixed = min(max(t_small[name] - per_element * n_small, 0.0), t_small[name])
        out[name] = fixed + (t_large[name] - fixed) / n_large * total
    return out


def _step_times(trained: Sequence[tuple[nn.Parameter, torch.Tensor | None]], stride: int, timer: Timer,
                repeats: int) -> dict[str, float]:
    """Per optimizer, the median seconds of one ``step()`` over copies of every 'stride'-th element of each
    parameter (all of it at stride 1) with the same elements of its gradient (ones where None)."""
    out: dict[str, float] = {}
    device = trained[0][0].device
    flush = CacheFlush(device)
    elements = sum(-(-p.numel() // stride) for p, _ in trained)
    state_bytes = 4 * elements * trained[0][0].element_size()  # weights, grads, two Adam states

    def sample(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone() if stride == 1 else t.detach().reshape(-1)[::stride].clone()

    for name, make in _OPTIMIZERS.items():
        copies = []
        for p, g in trained:
            q = sample(p).requires_grad_(True)
            # a sparse gradient (nn.Embedding(sparse=True)) as its
            # dense equal: torch's dense optimizers refuse sparse
            q.grad = torch.ones_like(q) if g is None else sample(g.to_dense() if g.is_sparse else g)
            copies.append(q)
        opt = make(copies)
        opt.step()
        samples = []
        for _ in range(min(repeats, OPTIMIZER_REPEATS)):
            if state_bytes < flush.size_bytes:
                # a rank steps after a backward that evicted these states: time it from memory, not cache
                flush()
            samples.append(timer(opt.step)[0])
        out[name] = median_iqr(samples)[0]
        del opt, copies
    flush.release()
    return out


def optimizer_floors(device: torch.device, timer: Timer, repeats: int) -> dict[str, float]:
    """Per optimizer, the seconds of one ``step()`` over a single 8-element parameter, timed as
    :func:`optimizer_times` times a layer's (from a flushed cache): the fixed cost of a step (Python, the
    dispatcher, the optimizer's own state, cold after the flush), which every layer's figure carries once and
    a rank pays once, since it steps all its layers in one ``step()``. Measured on a 2-core CPU host: 0.31 ms
    for SGD and 0.51 ms for Adam against 0.02 and 0.05 ms hot, and 0.33 / 0.69 ms over 10 such parameters, so
    it is per step, not per tensor; summed over the convnet's 9 trained layers the per-layer figures came to
    13.9 ms of Adam against 10.1 ms for one flushed step over the whole model (the GPT: 22.6 against 19.8 ms).
    Measured once per process and device (about 0.7 s of flushes): it is the machine's and the process's, not
    the model's."""
    key = str(device)
    if key not in _FLOORS:
        tiny = nn.Parameter(torch.zeros(8, device=device))
        _FLOORS[key] = optimizer_times([tiny], timer, max(3, repeats))
    return dict(_FLOORS[key])


_FLOORS: dict[str, dict[str, float]] = {}
