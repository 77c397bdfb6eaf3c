"""Matplotlib figures: stage balance, memory, per-layer costs, schedule timelines, predicted vs measured.

matplotlib is imported inside each function; each takes ``ax=None`` and returns the Axes; none calls show().
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stageplan.errors import StageplanError
from stageplan.plan import Plan
from stageplan.profile import Profile
from stageplan.runreport import RunReport

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from stageplan.schedules import Simulation

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#C44E52", "I": "#DD8452", "comm": "#55A868", "idle": "#EEEEEE"}
MEMORY_COLORS = {"params": "#4C72B0", "grads": "#8172B3", "optimizer": "#937860", "activations": "#DD8452", "buffers": "#55A868"}


def _axes(ax: Axes | None, size: tuple[float, float] = (7.0, 4.0)) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, new = plt.subplots(figsize=size)
    return new


def plot_stage_balance(plans: Plan | Mapping[str, Plan], ax: Axes | None = None) -> Axes:
    """Per-stage stacked bars of forward, backward and communication ms; a dashed line at the lower bound,
    the bottleneck stage outlined in black. Several plans (e.g. optimal, uniform, parameters) side by side."""
    ax = _axes(ax)
    group = {"plan": plans} if isinstance(plans, Plan) else dict(plans)
    n = len(group)
    width = 0.8 / n
    max_stages = 0
    tallest = 0.0
    for k, (name, plan) in enumerate(group.items()):
        xs = [s + (k - (n - 1) / 2) * width for s in range(plan.num_stages)]
        f = [st.forward_s * 1e3 for st in plan.stages]
        b = [st.backward_s * 1e3 for st in plan.stages]
        c = [st.comm_s * 1e3 for st in plan.stages]
        alpha = 1.0 - 0.25 * k
        ax.bar(xs, f, width, color=COLORS["F"], alpha=alpha, label="forward" if k == 0 else None)
        ax.bar(xs, b, width, bottom=f, color=COLORS["B"], alpha=alpha, label="backward" if k == 0 else None)
        ax.bar(xs, c, width, bottom=[x + y for x, y in zip(f, b)], color=COLORS["comm"], alpha=alpha,
               label="comm" if k == 0 else None)
        worst = max(range(plan.num_stages), key=lambda s: plan.stages[s].time_s)
        top = f[worst] + b[worst] + c[worst]
        tallest = max(tallest, top)
        ax.plot([xs[worst]], [top], marker="v", color="black", markersize=7, linestyle="none",
                label="bottleneck" if k == 0 else None)
        if n > 1:  # name each plan under its bars
            for x in xs:
                ax.text(x, 0, name, rotation=90, va="bottom", ha="center", fontsize=7, color="white")
        max_stages = max(max_stages, plan.num_stages)
    first = next(iter(group.values()))
    ax.axhline(first.lower_bound_s * 1e3, color="black", linestyle="--", linewidth=1, label="lower bound")
    ax.set_ylim(0, max(tallest, next(iter(group.values())).lower_bound_s * 1e3) * 1.12)
    ax.set_xticks(range(max_stages))
    ax.set_xlabel("stage")
    ax.set_ylabel("ms per microbatch")
    title = ", ".join(f"{name}: {p.balance_efficiency:.2f}" for name, p in group.items())
    ax.set_title(f"stage balance (efficiency {title})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax


def plot_memory(plan: Plan, ax: Axes | None = None) -> Axes:
    """Per-stage stacked bars of memory by kind (MiB) against each stage's device limit."""
    ax = _axes(ax)
    xs = list(range(plan.num_stages))
    bottom = [0.0] * plan.num_stages
    for kind, color in MEMORY_COLORS.items():
        vals = [st.memory.get(kind, 0.0) / 2**20 for st in plan.stages]
        label = "activations x in flight" if kind == "activations" else kind
        ax.bar(xs, vals, 0.6, bottom=bottom, color=color, label=label)
        bottom = [a + b for a, b in zip(bottom, vals)]
    for st in plan.stages:
        if st.memory_limit_bytes is not None:
            line = ax.hlines(st.memory_limit_bytes / 2**20, st.index - 0.4, st.index + 0.4, colors="red", linestyles="-")
            line.set_label("limit" if st.index == 0 else "_nolegend_")
    for st in plan.stages:
        ax.text(st.index, bottom[st.index], f"x{st.inflight}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(xs)
    ax.set_xlabel("stage")
    ax.set_ylabel("MiB")
    ax.set_title(f"memory per stage ({plan.schedule}, {plan.num_microbatches} microbatches; x = in flight)", fontsize=9)
    ax.legend(fontsize=7)
    return ax


def plot_layer_costs(profile: Profile, plan: Plan | None = None, ax: Axes | None = None) -> Axes:
    """Per-layer forward+backward ms (stacked), with the plan's boundaries drawn as vertical lines."""
    ax = _axes(ax, (8.0, 3.5))
    xs = list(range(len(profile)))
    f = [x.forward_s * 1e3 for x in profile.layers]
    b = [x.backward_s * 1e3 for x in profile.layers]
    ax.bar(xs, f, 0.8, color=COLORS["F"], label="forward")
    ax.bar(xs, b, 0.8, bottom=f, color=COLORS["B"], label="backward")
    if plan is not None:
        for boundary in plan.boundaries[1:-1]:
            ax.axvline(boundary - 0.5, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(xs)
    ax.set_xticklabels([x.name for x in profile.layers], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("ms per microbatch")
    ax.set_title(f"per-layer cost ({profile.meta.get('model', '')}, microbatch {profile.meta.get('microbatch_size', '?')})",
                 fontsize=9)
    ax.legend(fontsize=7)
    return ax


def _timeline_rows(source: Simulation | RunReport | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(source, RunReport):
        return [dict(r) for r in source.timeline]
    timeline = getattr(source, "timeline", None)
    if timeline is not None and not isinstance(source, (list, tuple)):
        return [{"rank": e.rank, "stage": e.stage, "microbatch": e.microbatch, "kind": e.kind, "start_s": e.start_s,
                 "end_s": e.end_s} for e in timeline]
    return [dict(r) for r in source]  # type: ignore[union-attr]


def plot_timeline(source: Simulation | RunReport | Sequence[Mapping[str, Any]], ax: Axes | None = None,
                  title: str | None = None) -> Axes:
    """Gantt chart of rank x time: forward, backward (and W) coloured, idle in grey, microbatches labelled.
    ``source`` is a simulator result, a RunReport (its measured last step) or rows with rank, stage, microbatch,
    kind, start_s, end_s."""
    ax = _axes(ax, (9.0, 3.0))
    rows = _timeline_rows(source)
    if not rows:
        ax.set_title("no timeline recorded")
        return ax
    ranks = sorted({int(r["rank"]) for r in rows})
    end = max(float(r["end_s"]) for r in rows)
    for rank in ranks:
        ax.broken_barh([(0.0, end * 1e3)], (rank - 0.4, 0.8), facecolors=COLORS["idle"])
    for r in rows:
        start, stop = float(r["start_s"]) * 1e3, float(r["end_s"]) * 1e3
        ax.broken_barh([(start, stop - start)], (int(r["rank"]) - 0.4, 0.8), facecolors=COLORS.get(str(r["kind"]), "grey"),
                       edgecolors="white", linewidth=0.5)
        if stop - start > end * 1e3 * 0.015:
            ax.text((start + stop) / 2, int(r["rank"]), str(r["microbatch"]), ha="center", va="center", fontsize=6,
                    color="white")
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_xlim(0, end * 1e3)
    from matplotlib.patches import Patch

    kinds = sorted({str(r["kind"]) for r in rows}, key="FBIW".find)
    handles = [Patch(color=COLORS.get(k, "grey"), label={"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}.get(k, k))
               for k in kinds] + [Patch(color=COLORS["idle"], label="idle")]
    ax.legend(handles=handles, fontsize=7, loc="upper right", ncol=len(handles))
    ax.set_title(title or f"timeline ({end * 1e3:.1f} ms)", fontsize=9)
    return ax


def plot_predicted_vs_measured(reports: RunReport | Sequence[RunReport], ax: Axes | None = None) -> Axes:
    """Scatter of measured against predicted ms: per-rank compute per microbatch (dots) and the step (squares),
    with the y = x line."""
    ax = _axes(ax, (4.5, 4.5))
    items = [reports] if isinstance(reports, RunReport) else list(reports)
    pts: list[float] = []
    for i, rep in enumerate(items):
        px = [r["predicted_compute_s"] * 1e3 for r in rep.stages]
        my = [r["measured_compute_s"] * 1e3 for r in rep.stages]
        ax.scatter(px, my, marker="o", color=f"C{i}", label=f"{rep.plan.get('method', 'run')} per-rank compute")
        ax.scatter([rep.predicted_step_s * 1e3], [rep.measured_step_s * 1e3], marker="s", color=f"C{i}",
                   label=f"{rep.plan.get('method', 'run')} step")
        pts += px + my + [rep.predicted_step_s * 1e3, rep.measured_step_s * 1e3]
    hi = max(pts) * 1.1 if pts else 1.0
    ax.plot([0, hi], [0, hi], color="black", linestyle="--", linewidth=1, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted ms")
    ax.set_ylabel("measured ms")
    ax.set_title("predicted vs measured", fontsize=9)
    ax.legend(fontsize=6)
    return ax


SAVE_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def save(ax: Axes, path: str | os.PathLike[str]) -> None:
    """Write the Axes' figure in the format its suffix names (.png, .svg or .pdf), atomically: to a temporary
    file in the same folder, then ``os.replace``, so a reader never sees a half-written figure.

    An unknown or missing suffix is refused before anything is written (matplotlib would otherwise fall back
    to PNG bytes under any name).
    """
    from stageplan._io import check_output_path, default_mode

    suffix = Path(path).suffix
    fmt = SAVE_FORMATS.get(suffix.lower())
    if fmt is None:
        what = f"suffix {suffix!r} is not supported" if suffix else "it has no suffix"
        raise StageplanError(
            f"cannot save a figure to {str(path)!r}: {what}; the format follows the suffix; "
            f"use {', '.join(list(SAVE_FORMATS)[:-1])} or {list(SAVE_FORMATS)[-1]}"
        )
    p = check_output_path(path)
    fig = ax.figure
    fig.tight_layout()  # type: ignore[union-attr]
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=str(p.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            # bbox_inches="tight": legends placed outside the axes are kept, not cropped
            fig.savefig(f, format=fmt, dpi=110, bbox_inches="tight")  # type: ignore[union-attr]
        os.chmod(tmp, default_mode())
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
