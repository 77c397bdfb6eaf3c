"""Per-layer figures -> Profile: medians and spreads, dedup groups copied to their members, tied parameters,
the optimizer floor, and the meta that says how it was measured."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stageplan._version import __version__
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.layers import (
    CutModel,
    Piece,
    used_parameters,
)
from stageplan.measure import (
    Timer,
    median_iqr,
)
from stageplan.profiling.memory import Peaks, peak_rss_bytes
from stageplan.profiling.optimizer import OPTIMIZER_SLICE_NOTE, optimizer_floors
from stageplan.profiling.signatures import DEDUP_SPREAD_WARN, Dedup
from stageplan.timing import (
    LayerContext,
    distinct_params,
    param_identity,
)


@dataclass
class Figures:
    forward_s: float
    backward_s: float
    forward_iqr_s: float
    backward_iqr_s: float
    backward_accumulate_s: float | None
    activation_bytes: int
    peak_bytes: int | None
    optimizer_s: dict[str, float] | None = None


def make_figures(samples: list[list[float]], act: int, peak: int | None,
             optimizer_s: dict[str, float] | None = None) -> Figures:
    f_med, f_iqr = median_iqr(samples[0])
    b_med, b_iqr = median_iqr(samples[1])
    return Figures(f_med, b_med, f_iqr, b_iqr, median_iqr(samples[2])[0], act, peak, optimizer_s)


def piece_used_fqns(cut: CutModel, piece: Piece) -> set[str]:
    """The model FQNs of the parameters the piece uses (a Sequential child's names are its own)."""
    prefix = f"{piece.name}." if cut.method == "sequential" else ""
    return {prefix + name for name in used_parameters(piece.module)}


def tied_parameters(cut: CutModel, model: nn.Module) -> list[dict[str, Any]]:
    """``meta["tied"]``: each parameter the model holds under two or more FQNs (an embedding tied to the LM
    head), with the layers whose pieces use it (under any of its names) and its bytes in the profiled dtype.
    Matched by FQN, so it holds whether the pieces are real, on meta, or released back to meta."""
    groups: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(param_identity(p), ([], p))[0].append(name)
    used = [piece_used_fqns(cut, piece) for piece in cut.pieces]
    return [{"names": names, "layers": [k for k, fqns in enumerate(used) if fqns.intersection(names)],
             "bytes": p.numel() * p.element_size()} for names, p in groups.values() if len(names) > 1]


def param_totals(module: nn.Module) -> tuple[int, int]:
    """Bytes and count of the distinct parameters a piece uses."""
    ps = distinct_params(list(used_parameters(module).values()))
    return sum(p.numel() * p.element_size() for p in ps), sum(p.numel() for p in ps)


def assemble(ctx: LayerContext, cut: CutModel, model: nn.Module, plan: Dedup, figures: Mapping[int, Figures],
              crossing: Sequence[int], params: Sequence[tuple[int, int]], extra: dict[str, Any],
              memory: dict[str, Any], peaks: Peaks, device: str | None = None) -> Profile:
    """Rows (a deduplicated layer takes its representative's figures, its own bytes) and meta."""
    names = cut.names
    results = _rows(cut, plan, figures, crossing, params)
    spread = _dedup_spread(plan, figures, names)
    checks, apart = _dedup_checks(plan, names, estimate=device is not None)
    dev = ctx.dev
    # a measured profile's step floor (an estimate prices its steps by bytes, and its meta says so instead)
    floors = optimizer_floors(dev, Timer(dev), ctx.repeats) if device is None else None
    layer_sum = sum(r.forward_s + r.backward_s for r in results)
    whole = extra.get("whole_model_s")
    meta: dict[str, Any] = {
        "model": ctx.workload.name,
        "factory_options": dict(ctx.workload.factory_options),
        "layers_arg": list(ctx.layers) if ctx.layers else None,
        "split_method": cut.method,
        "named_layers": list(cut.named),
        "device": device or str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda"
        else (platform.processor() or platform.machine()),
        "dtype": str(ctx.dt or next((p.dtype for p in model.parameters()), torch.float32)).replace("torch.",
                                                                                                   ""),
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
        # and max_time_s fewer, for a slow layer (None: no cap)
        "max_time_s": ctx.max_time_s if ctx.max_time_s < float("inf") else None,
        "timed_rounds": min(ctx.timed_rounds) if ctx.timed_rounds else None,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "timer": "cuda_event" if dev.type == "cuda" else "perf_counter",
        "method": "per-layer forward and backward timed separately on detached inputs, median of repeats "
                  "after warm-up; "
                  + ("in a stage's order (every layer's forward in turn, then every backward in reverse: a "
                     "backward follows the next layer's); " if ctx.order == "stage" else
                     "each backward right after its own forward; " if ctx.order == "layer" else "")
                  + "backward timed into empty grads (backward_s) and into filled grads "
                  "(backward_accumulate_s); activation bytes via saved_tensors_hooks deduplicated by "
                  "storage, views at their own extent (the loss target at its microbatch size); optimizer_s: "
                  "median of repeats of one step() per optimizer over copies of the layer's parameters with "
                  "gradients of ones, torch's default implementation, after warm-up steps",
        "optimizer_step": {"optimizers": {"sgd": "SGD(lr=1e-3)", "momentum": "SGD(lr=1e-3, momentum=0.9)",
                                          "adam": "Adam(lr=1e-3)", "adamw": "AdamW(lr=1e-3)"},
                           "implementation": "torch default (foreach=None, fused=None): foreach on CUDA, "
                                             "per-tensor loop on the CPU",
                           # the fixed cost of one step, in every layer's optimizer_s and paid once per rank
                           "floor_s": floors, "sliced": OPTIMIZER_SLICE_NOTE},
        "whole_model_s": whole,
        "whole_model_iqr_s": None,
        "sum_vs_whole": layer_sum / whole if whole else None,
        "dedup": ctx.dedup,
        # 'stage': every layer timed in a chain (identical layers share their optimizer step and bytes, and
        # those between identical neighbours their pooled times: pooled_layers); 'layer': each alone; None:
        # estimated
        "order": ctx.order,
        "layers_measured": len(plan.measured),
        "layers_reused": sum(1 for k, r in enumerate(plan.rep) if r != k),
        "distinct_layers": plan.distinct,
        "dedup_spread": spread,
        # every member of every group of identical layers against the figure it would reuse, and those
        # measured on their own for being off it (None for an estimate: no timer noise to rule out, nothing
        # timed)
        "dedup_checks": checks,
        "measured_apart": apart,
        "tied": tied_parameters(cut, model),
        "peak_rss_bytes": peak_rss_bytes(),
        # other processes on the machine inflate wall-clock
        # timings (up to 2x on a 2-core CPU host shared with them)
        "load_average_1min": os.getloadavg()[0],
    }
    meta.update(extra)
    if dev.type == "cuda":
        meta["peak_cuda_allocated_bytes"] = peaks.cuda
    if memory:
        meta["memory_check"] = memory
    return Profile(tuple(results), meta)


def _rows(cut: CutModel, plan: Dedup, figures: Mapping[int, Figures], crossing: Sequence[int],
          params: Sequence[tuple[int, int]]) -> list[LayerProfile]:
    """A row per layer: a deduplicated layer takes its representative's figures and keeps its own bytes."""
    names = cut.names
    results: list[LayerProfile] = []
    for k, piece in enumerate(cut.pieces):
        rep = plan.rep[k]
        fig = figures[rep]
        results.append(LayerProfile(
            name=piece.name, forward_s=fig.forward_s, backward_s=fig.backward_s,
            activation_bytes=fig.activation_bytes,
            output_bytes=int(crossing[k]), param_bytes=int(params[k][0]),
            param_count=int(params[k][1]), forward_iqr_s=fig.forward_iqr_s,
            backward_iqr_s=fig.backward_iqr_s, peak_bytes=fig.peak_bytes,
            backward_accumulate_s=fig.backward_accumulate_s, measured_as=None if rep == k else names[rep],
            optimizer_s=None if fig.optimizer_s is None else dict(fig.optimizer_s),
        ))
    return results


def _dedup_spread(plan: Dedup, figures: Mapping[int, Figures], names: Sequence[str]) -> dict[str, Any] | None:
    """How far apart the two identical layers dedup measured are (None where it measured one), warned past
    DEDUP_SPREAD_WARN."""
    spread: dict[str, Any] | None = None
    if plan.spread is not None:
        a, b = plan.spread
        fa, fb = figures[a], figures[b]
        spread = {"layer": names[b], "vs": names[a],
                  "forward_ratio": fb.forward_s / fa.forward_s if fa.forward_s > 0 else None,
                  "backward_ratio": fb.backward_s / fa.backward_s if fa.backward_s > 0 else None}
        off = [r for r in (spread["forward_ratio"], spread["backward_ratio"]) if r is not None
               and abs(r - 1) > DEDUP_SPREAD_WARN]
        if off:
            warnings.warn(
                f"identical layers {names[a]!r} and {names[b]!r} measured "
                f"{', '.join(f'{r:.2f}x' for r in off)} apart (more than {DEDUP_SPREAD_WARN:.0%}): the "
                "machine was busy or the layers differ in a way their signature misses; re-profile with more "
                "--repeats on a quiet machine, or with --no-dedup", stacklevel=5)
    return spread


def _dedup_checks(plan: Dedup, names: Sequence[str],
                  estimate: bool) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """``meta["dedup_checks"]`` (each group: its layers, the one whose figures they would reuse, each one's
    time over that one's, the tolerance) and ``meta["measured_apart"]`` (each layer the checks measured on its
    own); a warning names the latter: their signature matched a layer they do not cost like."""
    if estimate or plan.checks is None:
        return None, None
    checks: list[dict[str, Any]] = []
    apart: list[dict[str, Any]] = []
    for c in plan.checks:
        checks.append({"as": names[c.rep], "layers": [names[m] for m in c.members],
                       "forward_ratio": list(c.forward), "tolerance": c.tolerance})
        apart.extend({"layer": names[m], "as": names[c.rep], "forward_ratio": r, "tolerance": c.tolerance}
                     for m, r in zip(c.members, c.forward) if m in plan.apart)
    if apart:
        shown = ", ".join(f"{a['layer']!r} ({a['forward_ratio']:.2f}x {a['as']!r}'s forward)" for a in apart)
        warnings.warn(
            f"measured on their own: {shown}: each has the signature of an identical layer but not its cost "
            f"(outside {min(a['tolerance'] for a in apart):.2f}x), so its figures are its own "
            "(meta['measured_apart']); an attribute such as layer_idx may change what it computes",
            stacklevel=5)
    return checks, apart
