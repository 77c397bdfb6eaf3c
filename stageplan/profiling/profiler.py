"""Per-layer forward/backward timing, saved-for-backward bytes, parameter and boundary bytes -> Profile: with
the whole model real, one layer at a time from meta (streaming), or estimated for a GPU you do not have;
identical layers are measured once."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from stageplan._progress import Progress
from stageplan.errors import StageplanError, WorkloadError
from stageplan.formats.profile import Profile
from stageplan.layers import (
    CutModel,
    cut_layers,
    resolve,
    store_outputs,
    tensor_bytes,
)
from stageplan.materialize import (
    init_empty_weights,
    materialize_,
    meta_model,
    meta_parameter_names,
    parameter_bytes,
    real_parameters,
)
from stageplan.measure import (
    MAX_LAYER_S,
    Timer,
    first_microbatch,
    median_iqr,
    steady_allocator,
)
from stageplan.profiling.assemble import Figures, assemble, make_figures, param_totals
from stageplan.profiling.device import default_dtype, is_estimate_device, parse_device, parse_dtype
from stageplan.profiling.estimate import profile_estimate
from stageplan.profiling.memory import Peaks, bytes_and_peak, free_bytes, whole_model_bytes
from stageplan.profiling.optimizer import layer_grads, optimizer_times
from stageplan.profiling.signatures import (
    check_group,
    forward_checks,
    layer_signature,
    plan_dedup,
    stage_pools,
)
from stageplan.profiling.streaming import profile_streaming
from stageplan.timing import (
    LayerContext,
    cast_parameters_,
    check_order,
    make_run,
    time_rounds,
    to_device,
    typed_meta_copy,
    zero_grads,
)
from stageplan.workload import Workload

# --------------------------------------------------------------------------------------------------
# Building a workload to profile: on meta first (no memory), for real only when it fits


def build_workload_for_profile(
    model: str,
    options: dict[str, Any] | None = None,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype | None = None,
    streaming: bool | None = None,
) -> Workload:
    """Build the model spec ``model`` for :func:`profile_model`, never bigger than the machine.

    It is built first with parameters on meta (``init_empty_weights``) under ``dtype`` as torch's default.
    That build is returned for an estimate device, for ``streaming=True``, and when the real model, the
    profiler's copy and its gradients (3x the parameters) would take more than half of the device's free
    memory: the profiler then materialises what it needs (one layer at a time, or the whole model initialised
    by FQN). Otherwise the factory builds it for real, with its own initialisation. A factory that cannot
    build
    on meta is built for real unless streaming or an estimate was asked for.
    """
    from stageplan.zoo import build_workload

    estimate = is_estimate_device(device)
    dev = torch.device("cpu") if estimate else parse_device(device)
    if estimate:
        from stageplan.profiling.estimate import parse_estimate_device

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
            raise WorkloadError(
                f"workload.model must be a torch.nn.Module, got {type(meta_wl.model).__name__}")
        if 3 * parameter_bytes(meta_wl.model) > free_bytes(dev) // 2:
            return meta_wl
    with default_dtype(dtype):
        return build_workload(model, options)


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
    max_time_s: float = MAX_LAYER_S,
) -> Profile:
    """Profile every layer of ``workload`` at ``microbatch_size``; the user's model is untouched.

    - ``device``: 'cpu', 'cuda', 'cuda:N' to measure, or 'estimate:NAME' (e.g. 'estimate:h100-sxm') to
      estimate every layer for a GPU you do not have, on fake tensors (``compute_efficiency`` and
      ``memory_efficiency`` override the roofline's defaults; see :mod:`stageplan.profiling.estimate`).
    - ``streaming``: True measures one layer at a time from a model on meta (only that layer's parameters are
      real; the whole-model timing is skipped); None chooses it when the whole model, its gradients and its
      activations would not fit in the device's free memory.
    - ``dedup``: in order 'layer', of identical layers (same code, parameter shapes and dtypes, input shapes)
      the first two are measured and the rest reuse the second's figures (the first follows a different layer,
      and runs slower); their rows say ``measured_as``. In a group of three or more, the third instance is
      measured too and its ratio to the second recorded in ``meta["dedup_spread"]`` (None without such a
      group; a pair is simply measured twice). In order 'stage' every layer is timed; dedup shares the
      optimizer step and bytes, and pools the times of identical layers between identical neighbours. False:
      each layer its own figures.
    - ``dtype``: the parameter and input dtype (default: the model's own). Build the model under that default
      dtype instead where you can (:func:`default_dtype`): only parameters and persistent buffers are cast.
    - ``min_time_s``: time more rounds than ``repeats`` until the timed rounds span this many seconds (one
      layer at a time: each measured layer's rounds an equal share of it). A shared machine's speed drifts by
      the second: on a 2-core CPU host two windows of the same work differed by up to 33% (98th percentile)
      over 1.7 s and 9% over 20 s (README, Limitations); the medians of rounds spread over longer average more
      of it out.
    - ``max_time_s``: a measured layer's timed rounds stop once they span this many seconds and number at
      least 5, and its warm-up after a quarter of it (at least one round): a Qwen2-7B block's round takes
      about 3 s on one CPU core, and 25 of them are not needed for its median. ``math.inf``: every round.
      ``min_time_s`` wins over it.
    - ``order``: 'stage' times the layers as a stage runs them, every forward in turn and then every backward
      in reverse, so that a layer's backward follows the next layer's and reads activations the rest of the
      model has since pushed out of the cache (every layer is timed in its place; identical layers share their
      optimizer step, and those between identical neighbours their times, pooled over all of them:
      ``meta["pooled_layers"]``); 'layer' times each layer's backward right after its own forward (hot: the
      GPT's blocks' backward read 0.89-0.95x the stage order's, the block before the head 0.75x). None:
      'stage' where the whole model is materialised,
      'layer' one layer at a time (only one layer is real there).
    """
    if warmup < 0 or repeats < 1:
        raise StageplanError(f"warmup must be >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}; "
                             f"e.g. --warmup 3 --repeats 10")
    check_min_time(min_time_s)
    check_max_time(max_time_s)
    check_order(order)
    estimate = is_estimate_device(device)
    if estimate:
        gpu: Any = _estimate_target(device, min_time_s, order, compute_efficiency, memory_efficiency)
        # fake CPU tensors stand in for the target's (see stageplan.profiling.estimate)
        dev = torch.device("cpu")
    else:
        gpu = None
        dev = _measured_device(device, compute_efficiency, memory_efficiency)
    dt = parse_dtype(dtype)
    if not isinstance(dedup, bool) or (streaming is not None and not isinstance(streaming, bool)):
        raise StageplanError(f"streaming must be True, False or None and dedup True or False, got "
                             f"streaming={streaming!r}, dedup={dedup!r}")
    if dev.type == "cpu" and not estimate and dt in (torch.float16, torch.bfloat16):
        warnings.warn(f"profiling in {str(dt).replace('torch.', '')} on the CPU: most CPU kernels have no "
                      "fast half-precision path (float16 can run many times slower than float32), so these "
                      "times will not predict a GPU; profile on the GPU you will train on, or estimate for "
                      "it (--device estimate:NAME)", stacklevel=2)
    mb_args_cpu = first_microbatch(workload, microbatch_size)
    if workload.model is None and workload.model_fn is not None:  # a model only ever built on meta (model_fn)
        workload = dataclasses.replace(workload, model=meta_model(workload), model_fn=None)
    if not isinstance(workload.model, nn.Module):
        raise WorkloadError(f"workload.model must be a torch.nn.Module, got {type(workload.model).__name__}")

    steady_allocator()  # reuse large buffers, as every rank does: see measure.steady_allocator
    with _one_thread_rng_restored(dev):
        ctx = LayerContext(workload, microbatch_size, dev, dt, warmup, repeats, layers, progress, mb_args_cpu,
                           dedup, float(min_time_s), order, max_time_s=float(max_time_s))
        if estimate:
            return profile_estimate(ctx, gpu, compute_efficiency, memory_efficiency)
        return _profile_measured(ctx, streaming, order)


def _estimate_target(device: str | torch.device, min_time_s: float, order: str | None,
                     compute_efficiency: float | None, memory_efficiency: float | None) -> Any:
    """The GpuSpec an 'estimate:NAME' device names; StageplanError for an option that only a measurement uses,
    or an efficiency that is not a fraction in (0, 1]."""
    from stageplan.profiling.estimate import (
        DEFAULT_COMPUTE_EFFICIENCY,
        DEFAULT_MEMORY_EFFICIENCY,
        parse_estimate_device,
    )

    gpu = parse_estimate_device(str(device))
    if min_time_s:
        raise StageplanError(f"min_time_s ({min_time_s}) spreads measured rounds over time, and an estimate "
                             "measures nothing; drop --min-time, or measure on a device you have")
    if order is not None:
        raise StageplanError(f"order ({order}) is the order layers are timed in, and an estimate times "
                             "nothing; drop --order, or measure on a device you have")
    for name, value, default in (("compute_efficiency", compute_efficiency, DEFAULT_COMPUTE_EFFICIENCY),
                                 ("memory_efficiency", memory_efficiency, DEFAULT_MEMORY_EFFICIENCY)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0.0 < float(value) <= 1.0):
            raise StageplanError(f"{name} must be a fraction in (0, 1], got {value!r}; e.g. {default}")
    return gpu


def _measured_device(device: str | torch.device, compute_efficiency: float | None,
                     memory_efficiency: float | None) -> torch.device:
    """The device to measure on; StageplanError for an option that only an estimate uses."""
    dev = parse_device(device)
    for name, value in (("compute_efficiency", compute_efficiency), ("memory_efficiency", memory_efficiency)):
        if value is not None:
            raise StageplanError(f"{name} ({value}) applies to estimates only; use it with --device "
                                 "estimate:GPU (e.g. estimate:h100-sxm), or drop it when measuring")
    return dev


@contextlib.contextmanager
def _one_thread_rng_restored(dev: torch.device) -> Iterator[None]:
    """One intra-op thread on the CPU, as each pipeline rank will run; torch's thread count and the CPU and
    CUDA random states are restored on the way out, so that profiling leaves the caller's process as it found
    it."""
    rng_cpu = torch.get_rng_state()
    rng_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng_cpu)
        if rng_cuda is not None:
            torch.cuda.set_rng_state_all(rng_cuda)


def _profile_measured(ctx: LayerContext, streaming: bool | None, order: str | None) -> Profile:
    """Measure the whole model materialised, or one layer at a time (``streaming``; None: when the whole model
    would not fit in the device's free memory)."""
    memory: dict[str, Any] = {}
    if streaming is None:
        need, acts = whole_model_bytes(ctx.workload.model, ctx.mb_args_cpu, ctx.dt)
        free = free_bytes(ctx.dev)
        streaming = need > free
        memory = {"rule": "layer at a time when 2 x parameters + activations > free memory",
                  "whole_model_bytes": need, "activation_bytes": acts, "free_bytes": free}
    if streaming:
        check_order(order, streaming)
        ctx.order = "layer"
        return profile_streaming(ctx, memory)
    ctx.order = order or "stage"
    return _profile_whole(ctx, memory)


def check_max_time(max_time_s: object) -> None:
    """Refuse a ``max_time_s`` that is not a number of seconds > 0 (``math.inf``: no cap)."""
    if isinstance(max_time_s, bool) or not isinstance(max_time_s, (int, float)) or not max_time_s > 0:
        raise StageplanError(f"max_time_s must be a number of seconds > 0 (inf for no cap), got "
                             f"{max_time_s!r}; e.g. --max-time 30")


def check_min_time(min_time_s: object) -> None:
    """Refuse a ``min_time_s`` that is not a finite number of seconds >= 0."""
    if (
        isinstance(min_time_s, bool)
        or not isinstance(min_time_s, (int, float))
        or not 0 <= min_time_s < math.inf
    ):
        raise StageplanError(
            f"min_time_s must be a finite number of seconds >= 0, got {min_time_s!r}; e.g. --min-time 20")


def _profile_whole(ctx: LayerContext, memory: dict[str, Any]) -> Profile:
    src = ctx.workload.model
    if meta_parameter_names(src):  # built on meta: the whole model, initialised by FQN
        model = typed_meta_copy(src, ctx.dt, ctx.dev)
        materialize_(model, real_parameters(model, meta_parameter_names(model), ctx.dev))
    else:
        model = cast_parameters_(copy.deepcopy(src), ctx.dt).to(ctx.dev)
    model.train()
    args = to_device(ctx.mb_args_cpu, ctx.dev, ctx.dt)
    target = ctx.target()
    cut: CutModel = cut_layers(model, args, ctx.layers)
    timer = Timer(ctx.dev)
    peaks = Peaks()

    # One forward pass through the chain gives every piece its real inputs.
    env: dict[Any, Any] = {}
    with torch.no_grad():
        for k, piece in enumerate(cut.pieces):
            store_outputs(env, k, piece.module(*[resolve(r, args, env) for r in piece.inputs]))
    n = len(cut.pieces)
    values = [[resolve(r, args, env) for r in piece.inputs] for piece in cut.pieces]
    signatures = [layer_signature(cut, k, model, values[k]) for k in range(n)]
    plan = plan_dedup(signatures, ctx.dedup)
    stage = ctx.order == "stage"
    # in a stage's order every layer is timed (its backward depends on what ran since its forward); identical
    # layers still share their optimizer step and bytes
    timed = list(range(n)) if stage else plan.measured
    runs = [make_run(cut.pieces[k], k, n, values[k], ctx.workload, target) for k in timed]

    whole_params = list(model.parameters())

    def whole() -> float:
        def step() -> None:
            loss = ctx.workload.compute_loss(model(*args), target)
            loss.backward()

        t_w, _ = timer(step)
        zero_grads(whole_params, [])
        return t_w

    bar = Progress(ctx.warmup + ctx.repeats, f"profiling {n} layers", enabled=ctx.progress)
    doing = (
        "in a stage's order"
        if stage
        else f"{len(timed)} of them, the others identical"
        if len(timed) < n
        else ""
    )
    samples, whole_times = time_rounds(
        runs, timer, ctx.warmup, ctx.repeats, whole,
        lambda r: bar.update(r,
                             " ".join(filter(None, ["warm-up" if r <= ctx.warmup else "measuring", doing]))),
        ctx.min_time_s, chain=stage, max_time_s=ctx.max_time_s * len(runs))
    ctx.timed_rounds.append(len(whole_times))
    bar.close()
    by_layer = dict(zip(timed, zip(runs, samples)))
    pools = stage_pools(signatures) if stage and ctx.dedup else []
    if plan.groups:
        # every member's own forward, checked against the figures the others reuse; one off them is measured
        # on its own (a branch on layer_idx, which the signature leaves out, can make a block do far more
        # work). In a stage's order every layer is timed in its place already, and the check judges what it
        # would still share: its group's bytes and optimizer step, and its pool's times.
        got = forward_checks(timer, {k: functools.partial(cut.pieces[k].module, *values[k])
                                     for g in plan.groups for k in g})
        plan = plan.checked([check_group(g[1], {k: got[k] for k in g}) for g in plan.groups],
                            plan.reusers() | {k for pool in pools for k in pool})
        apart = [k for k in plan.measured if k not in by_layer]
        if apart:
            more = [make_run(cut.pieces[k], k, n, values[k], ctx.workload, target) for k in apart]
            more_samples, _ = time_rounds(more, timer, ctx.warmup, ctx.repeats,
                                          min_time_s=ctx.min_time_s * len(apart) / len(timed),
                                          max_time_s=ctx.max_time_s * len(apart))
            ctx.timed_rounds.append(len(more_samples[0][0]))
            by_layer.update(zip(apart, zip(more, more_samples)))
    measured = plan.measured
    figures: dict[int, Figures] = {}
    for k in measured:
        run, s = by_layer[k]
        act, peak = bytes_and_peak(run, ctx.dev, peaks)
        figures[k] = make_figures(s, act, peak,
                                  optimizer_times(run.params, timer, ctx.repeats, layer_grads(run)))
    pooled: list[list[int]] = []
    if stage:
        # every layer timed in its place; an identical layer its representative's bytes and optimizer step
        # a member measured apart keeps its own times
        pooled = [kept for pool in pools if len(kept := [k for k in pool if k not in plan.apart]) > 1]
        pool_of = {k: group for group in pooled for k in group}
        for k in range(n):
            fig = figures.get(k) or figures[plan.rep[k]]
            group = pool_of.get(k, [k])
            times = [[t for j in group for t in by_layer[j][1][i]] for i in range(3)]
            figures[k] = make_figures(times, fig.activation_bytes, fig.peak_bytes, fig.optimizer_s)
        # nothing reused: no spread to check (the checks of every member stay)
        plan = dataclasses.replace(plan, rep=list(range(n)), spread=None)
    crossing = [0 if k == n - 1 else sum(tensor_bytes(resolve(r, args, env)) for r in cut.crossing_refs(k))
                for k in range(n)]
    params = [param_totals(p.module) for p in cut.pieces]
    whole_med, whole_iqr = median_iqr(whole_times)
    if ctx.dev.type == "cuda":
        peaks.note_cuda(ctx.dev)
    extra = {"materialized": "whole-model", "whole_model_s": whole_med, "whole_model_iqr_s": whole_iqr,
             "whole_model": "measured",
             "pooled_layers": [[cut.pieces[k].name for k in group] for group in pooled]}
    return assemble(ctx, cut, model, plan, figures, crossing, params, extra, memory, peaks)
