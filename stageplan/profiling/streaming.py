"""Layer-at-a-time profiling: the model stays on meta, each layer gets real weights in turn and is timed on
the real outputs of the layers before it; at most one layer's weights are real at once."""

from __future__ import annotations

import functools
import gc
from typing import Any

import torch

from stageplan._progress import Progress
from stageplan.errors import WorkloadError
from stageplan.formats.profile import Profile
from stageplan.layers import (
    CutModel,
    resolve,
    store_outputs,
    tensor_bytes,
)
from stageplan.materialize import (
    Checkpoint,
    meta_parameter_names,
)
from stageplan.measure import (
    Timer,
    release_free_memory,
)
from stageplan.profiling.assemble import Figures, assemble, make_figures, param_totals
from stageplan.profiling.memory import Peaks, bytes_and_peak, fake_inputs, fake_state
from stageplan.profiling.optimizer import layer_grads, optimizer_times
from stageplan.profiling.signatures import (
    CHECK_ROUNDS,
    check_group,
    forward_checks,
    layer_signature,
    plan_dedup,
)
from stageplan.timing import (
    LayerContext,
    make_run,
    materialize_piece,
    meta_cut,
    release_,
    stream_forward,
    time_rounds,
)


def fake_chain(
    cut: CutModel, args: tuple[Any, ...], device: torch.device
) -> tuple[list[list[Any]], list[int]]:
    """Every piece's inputs as fake tensors (shapes, dtypes and strides; no data, no compute), and the bytes
    that cross a boundary after each piece."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    env: dict[Any, Any] = {}
    inputs: list[list[Any]] = []
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            fake_args = fake_inputs(args, device)
            for k, piece in enumerate(cut.pieces):
                values = [resolve(r, fake_args, env) for r in piece.inputs]
                inputs.append(values)
                out = torch.func.functional_call(piece.module, fake_state(piece.module, device),
                                                 tuple(values))
                store_outputs(env, k, out)
    except Exception as exc:
        raise WorkloadError(
            f"layer {cut.pieces[len(inputs) - 1].name!r} cannot run without data ({type(exc).__name__}: "
            f"{exc}); "
            "profile it with the whole model real (streaming=False) or name layers whose shapes do not "
            "depend on values"
        ) from exc
    n = len(cut.pieces)
    crossing = [0 if k == n - 1
                else sum(tensor_bytes(resolve(r, fake_args, env)) for r in cut.crossing_refs(k))
                for k in range(n)]
    return inputs, crossing


def profile_streaming(ctx: LayerContext, memory: dict[str, Any]) -> Profile:
    src = ctx.workload.model
    # The user's real weights, one layer's worth at a time; FQN-keyed initialisation for a model on meta.
    weights = None if meta_parameter_names(src) else Checkpoint(dict(src.state_dict()))
    model, args, target, cut = meta_cut(ctx, src)
    n = len(cut.pieces)
    plan = plan_dedup([layer_signature(cut, k, model, values) for k,
                       values in enumerate(fake_chain(cut, args, ctx.dev)[0])],
                  ctx.dedup)
    timer = Timer(ctx.dev)
    peaks = Peaks()
    figures: dict[int, Figures] = {}
    crossing: list[int] = []
    params: list[tuple[int, int]] = []
    env: dict[Any, Any] = {}
    measured = set(plan.measured)
    group_of = {k: g for g in plan.groups for k in g}
    checked: dict[int, list[float]] = {}  # a group member's own forward (no grad): its check's samples
    apart: list[int] = []
    reusers = plan.reusers()
    bar = Progress(n, f"profiling {n} layers one at a time ({len(measured)} measured)", enabled=ctx.progress)
    for k, piece in enumerate(cut.pieces):
        bar.update(k, piece.name)
        materialize_piece(cut, model, piece, ctx.dev, weights)
        values = [resolve(r, args, env) for r in piece.inputs]
        if k in group_of:
            # the check of a group's every member: CHECK_ROUNDS - 1 forwards without grad (more until they
            # span CHECK_MIN_S), then the one every layer runs here to feed the next, timed too (the first of
            # a freshly materialised layer reads cold; the check takes the least)
            checked[k] = forward_checks(timer, {k: functools.partial(piece.module, *values)},
                                        rounds=CHECK_ROUNDS - 1, warmup=0)[k]
            t, (env, keep) = timer(functools.partial(stream_forward, env, cut, k, values))
            checked[k].append(t)
            g = group_of[k]
            # a layer that would reuse its group's second's figures is checked against them (the second
            # comes before it); one off them is measured on its own
            if k in reusers and k in check_group(g[1], {j: checked[j] for j in g if j in checked}).off():
                checked[k] += forward_checks(timer, {k: functools.partial(piece.module, *values)},
                                             warmup=0)[k]  # once more: a burst of load is not a layer's cost
                if k in check_group(g[1], {j: checked[j] for j in g if j in checked}).off():
                    apart.append(k)
        else:
            env, keep = stream_forward(env, cut, k, values)
        if k in measured or k in apart:
            run = make_run(piece, k, n, values, ctx.workload, target)
            # a line per round too: one LLaMA-2-7B block took minutes on a CPU
            (s,), _ = time_rounds([run], timer, ctx.warmup, ctx.repeats,
                                  on_round=bar.within(k, piece.name, ctx.warmup + ctx.repeats),
                                  min_time_s=ctx.min_time_s / len(measured), max_time_s=ctx.max_time_s)
            ctx.timed_rounds.append(len(s[0]))
            act, peak = bytes_and_peak(run, ctx.dev, peaks)
            figures[k] = make_figures(s, act, peak,
                                      optimizer_times(run.params, timer, ctx.repeats, layer_grads(run)))
            del run
        del values
        crossing.append(0 if k == n - 1 else sum(tensor_bytes(resolve(r, args, env)) for r in keep))
        params.append(param_totals(piece.module))
        release_(piece.module)
        gc.collect()
        # glibc keeps what a layer freed below the mmap threshold (its small weights, activations and the
        # optimizer-step samples) in its heap, never trimmed (measure.steady_allocator), and the next layers
        # reuse it only in part: Qwen2-7B's shape cut to 2 blocks entered its 2.18 GB fp32 head 1.2 GB above
        # torch's 0.44 GB baseline, and 0.27 GB above it with the free heap handed back here.
        release_free_memory()
        if ctx.dev.type == "cuda":
            peaks.note_cuda(ctx.dev)
            torch.cuda.empty_cache()
    plan = plan.checked([check_group(g[1], {j: checked[j] for j in g}) for g in plan.groups], reusers, apart)
    bar.update(n, "done")
    bar.close()
    extra = {"materialized": "layer-at-a-time", "whole_model_s": None, "whole_model_iqr_s": None,
             "whole_model": "skipped: layer-at-a-time"}
    return assemble(ctx, cut, model, plan, figures, crossing, params, extra, memory, peaks)
