"""Matplotlib figures: stage balance, memory, per-layer costs, schedule timelines, predicted vs measured.

matplotlib is imported inside each function; each takes ``ax=None`` and returns the Axes; none calls show().
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stageplan.errors import StageplanError
from stageplan.formats.layout import Layout
from stageplan.formats.plan import Plan
from stageplan.formats.profile import Profile
from stageplan.formats.runreport import RunReport
from stageplan.formats.schedule import TRANSFER_KINDS

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from stageplan.formats.timeline import Simulation

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#C44E52", "I": "#DD8452", "O": "#8172B3", "T": "#DA8BC3",
          "D": "#CCB974", "comm": "#55A868", "loop": "#937860", "idle": "#EEEEEE"}
HATCHES = ("", "///", "...", "xxx", "\\\\\\", "ooo", "+++", "---")  # one per plan when plans are compared
LABEL_PT = 8  # text written on the data (in flight, microbatch, rank): readable at 110 dpi
LEGEND_PT = 8
MEMORY_COLORS = {"params": "#4C72B0", "grads": "#8172B3", "master": "#64B5CD", "optimizer": "#937860",
                 "activations": "#DD8452", "buffers": "#55A868"}


def _axes(ax: Axes | None, size: tuple[float, float] = (7.0, 4.0)) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, new = plt.subplots(figsize=size)
    return new


def _estimated(obj: Any) -> str:
    """' (ESTIMATE for GPU)' for a plan or profile whose times are analytic, else ''."""
    meta = getattr(obj, "profile_meta", None) or getattr(obj, "meta", None) or {}
    if meta.get("timer") != "analytic":
        return ""
    return f" (ESTIMATE for {(meta.get('estimate') or {}).get('gpu') or meta.get('device', 'a GPU')})"


def plot_stage_balance(plans: Plan | Mapping[str, Plan], ax: Axes | None = None) -> Axes:
    """Per-stage stacked bars of forward, backward and communication ms; a dashed line at the lower bound,
    a triangle over each plan's bottleneck stage. Several plans (e.g. optimal, uniform, parameters) stand side
    by side, each with its own hatch, named in the legend."""
    from matplotlib.patches import Patch

    ax = _axes(ax)
    group = {"plan": plans} if isinstance(plans, Plan) else dict(plans)
    n = len(group)
    width = 0.8 / n
    max_stages = 0
    tallest = 0.0
    method_handles: list[Patch] = []
    for k, (name, plan) in enumerate(group.items()):
        xs = [s + (k - (n - 1) / 2) * width for s in range(plan.num_chunks)]
        f = [st.forward_s * 1e3 for st in plan.stages]
        b = [st.backward_s * 1e3 for st in plan.stages]
        c = [st.comm_s * 1e3 for st in plan.stages]
        a = [st.action_s * 1e3 for st in plan.stages]  # the schedule's loop around the stage's chunks
        # Methods differ by hatch, not by shade: shades of one colour read as different kinds of work.
        hatch = HATCHES[k % len(HATCHES)] if n > 1 else None
        style: dict[str, Any] = {"edgecolor": "white", "linewidth": 0.6, "hatch": hatch}
        ax.bar(xs, f, width, color=COLORS["F"], label="forward" if k == 0 else None, **style)
        ax.bar(xs, b, width, bottom=f, color=COLORS["B"], label="backward" if k == 0 else None, **style)
        ax.bar(xs, c, width, bottom=[x + y for x, y in zip(f, b)], color=COLORS["comm"],
               label="comm" if k == 0 else None, **style)
        if any(a):
            ax.bar(xs, a, width, bottom=[x + y + z for x, y, z in zip(f, b, c)], color=COLORS["loop"],
                   label="schedule loop" if k == 0 else None, **style)
        if n > 1:
            method_handles.append(Patch(facecolor="#8C8C8C", edgecolor="white", hatch=hatch, label=name))
        worst = max(range(plan.num_chunks), key=lambda s: plan.stages[s].time_s)
        top = f[worst] + b[worst] + c[worst] + a[worst]
        tallest = max(tallest, top)
        ax.plot([xs[worst]], [top], marker="v", color="black", markersize=7, linestyle="none",
                label="bottleneck" if k == 0 else None)
        max_stages = max(max_stages, plan.num_chunks)
    first = next(iter(group.values()))
    ax.axhline(first.lower_bound_s * 1e3, color="black", linestyle="--", linewidth=1, label="lower bound")
    ax.set_ylim(0, max(tallest, first.lower_bound_s * 1e3) * 1.12)
    ax.set_xticks(range(max_stages))
    ax.set_xlabel("stage")
    ax.set_ylabel("ms per microbatch")
    title = ", ".join(f"{name}: {p.balance_efficiency:.2f}" for name, p in group.items())
    ax.set_title(f"stage balance (efficiency {title}){_estimated(first)}", fontsize=9)
    handles, _ = ax.get_legend_handles_labels()
    ax.legend(handles=handles + method_handles, fontsize=LEGEND_PT, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return ax


def plot_memory(plan: Plan, ax: Axes | None = None) -> Axes:
    """Per-stage stacked bars of memory by kind (MiB) against each stage's device limit, with the number of
    microbatches each stage holds in flight written over its bar."""
    ax = _axes(ax)
    xs = list(range(plan.num_chunks))
    bottom = [0.0] * plan.num_chunks
    for kind, color in MEMORY_COLORS.items():
        if not any(kind in st.memory for st in plan.stages):
            continue  # "master" exists only with a mixed precision
        vals = [st.memory.get(kind, 0.0) / 2**20 for st in plan.stages]
        label = "activations x in flight" if kind == "activations" else kind
        ax.bar(xs, vals, 0.6, bottom=bottom, color=color, label=label)
        bottom = [a + b for a, b in zip(bottom, vals)]
    for st in plan.stages:
        if st.memory_limit_bytes is not None:
            line = ax.hlines(st.memory_limit_bytes / 2**20, st.index - 0.4, st.index + 0.4, colors="red",
                             linestyles="-")
            line.set_label("limit" if st.index == 0 else "_nolegend_")
    for st in plan.stages:
        ax.annotate(f"x{st.inflight}", (st.index, bottom[st.index]), xytext=(0, 2),
                    textcoords="offset points", ha="center", va="bottom", fontsize=LABEL_PT)
    limits = [st.memory_limit_bytes / 2**20 for st in plan.stages if st.memory_limit_bytes is not None]
    # headroom for the in-flight counts over the tallest bar
    ax.set_ylim(0, max([*bottom, *limits, 1e-9]) * 1.12)
    ax.set_xticks(xs)
    ax.set_xlabel("stage")
    ax.set_ylabel("MiB")
    ax.set_title(f"memory per stage ({plan.schedule}, {plan.num_microbatches} microbatches; x = in flight)"
                 f"{_estimated(plan)}", fontsize=9)
    ax.legend(fontsize=LEGEND_PT, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
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
    ax.set_xticklabels([x.name for x in profile.layers], rotation=60, ha="right", fontsize=LABEL_PT)
    ax.set_ylabel("ms per microbatch")
    ax.set_title(f"per-layer cost ({profile.meta.get('model', '')}, microbatch "
                 f"{profile.meta.get('microbatch_size', '?')}){_estimated(profile)}",
                 fontsize=9)
    ax.legend(fontsize=LEGEND_PT, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return ax


def _timeline_rows(source: Simulation | RunReport | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(source, RunReport):
        return [dict(r) for r in source.timeline]
    timeline = getattr(source, "timeline", None)
    if timeline is not None and not isinstance(source, (list, tuple)):
        return [{"rank": e.rank, "stage": e.stage, "microbatch": e.microbatch, "kind": e.kind,
                 "start_s": e.start_s, "end_s": e.end_s} for e in timeline]
    return [dict(r) for r in source]  # type: ignore[union-attr]


def _fits(ax: Axes, width_data: float, span_data: float, text: str) -> bool:
    """Whether ``text`` at LABEL_PT fits inside a bar ``width_data`` wide on an x axis spanning ``span_data``.
    The axes' width is taken before layout, less a fifth for the legend and margins that layout will take."""
    fig = ax.figure
    axes_pt = ax.get_position().width * fig.get_figwidth() * 72 * 0.8  # type: ignore[union-attr]
    text_pt = 0.62 * LABEL_PT * len(text) + 3  # DejaVu Sans digits are ~0.62 em wide, plus a little air
    return span_data > 0 and width_data / span_data * axes_pt >= text_pt


def plot_timeline(source: Simulation | RunReport | Sequence[Mapping[str, Any]], ax: Axes | None = None,
                  title: str | None = None) -> Axes:
    """Gantt chart of rank x time: forward, backward (and W), the tied-gradient sync, the data-parallel
    replicas' sync and the optimizer step coloured, idle in grey, microbatches labelled. A crossing's transfer
    (kinds "A" and "G", an activation or a gradient) is a thin bar in the strip just below its receiving
    rank's row: it occupies the link, and the rank may compute meanwhile. A run's bar runs from when the
    message could start to move (the later of the receive's post and the producing call's end) to when the
    receiving rank's wait for it returned.
    ``source`` is a simulator result, a RunReport (its measured last step) or rows with rank, stage,
    microbatch, kind, start_s, end_s.

    For a RunReport the title always ends with the plotted step's span and the median step, e.g.
    ``measured timeline (last step): 87.0 ms (median step 99.0 ms)``: one step is shown, the report's figures
    are medians, and the span runs from the first forward to the end of the last rank's optimizer step (a run
    records its step's tail, the tied all-reduce and the optimizer step, as "T" and "O" events; reports
    written
    before that end at the last backward).
    """
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
        if str(r["kind"]) in TRANSFER_KINDS:  # on the link: below the receiver's row, not over its compute
            ax.broken_barh([(start, stop - start)], (int(r["rank"]) + 0.42, 0.12), facecolors=COLORS["comm"],
                           edgecolors="white", linewidth=0.3)
            continue
        ax.broken_barh([(start, stop - start)], (int(r["rank"]) - 0.4, 0.8),
                       facecolors=COLORS.get(str(r["kind"]), "grey"), edgecolors="white", linewidth=0.5)
        # the step's tail has no microbatch
        label = "" if str(r["kind"]) in ("O", "T", "D") else str(r["microbatch"])
        if label and _fits(ax, stop - start, end * 1e3, label):
            ax.text((start + stop) / 2, int(r["rank"]), label, ha="center", va="center", fontsize=LABEL_PT,
                    color="white")
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_xlim(0, end * 1e3)
    from matplotlib.patches import Patch

    kinds = sorted({"X" if str(r["kind"]) in TRANSFER_KINDS else str(r["kind"]) for r in rows},
                   key="FBIWXTDO".find)
    names = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad", "X": "transfer",
             "T": "tied sync", "D": "replicas' sync", "O": "optimizer"}
    handles = [Patch(color=COLORS["comm"] if k == "X" else COLORS.get(k, "grey"), label=names.get(k, k))
               for k in kinds]
    handles.append(Patch(color=COLORS["idle"], label="idle"))
    # Outside the axes: inside, any corner covers some rank's work (rank 0's last backwards, top right).
    ax.legend(handles=handles, fontsize=LEGEND_PT, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              borderaxespad=0.0)
    if isinstance(source, RunReport):
        facts = f"{end * 1e3:.1f} ms (median step {source.measured_step_s * 1e3:.1f} ms)"
        ax.set_title(f"{title or 'measured timeline (last step)'}: {facts}", fontsize=9)
    else:
        ax.set_title(title or f"timeline ({end * 1e3:.1f} ms)", fontsize=9)
    return ax


def _spread(wanted: Sequence[float], gap: float, low: float, high: float) -> list[float]:
    """Positions as near ``wanted`` (ascending) as allows ``gap`` between neighbours, inside [low, high] where
    they fit: pushed up from below, then back down from the top."""
    out: list[float] = []
    for w in wanted:
        out.append(max(w, low, out[-1] + gap) if out else max(w, low))
    if out and out[-1] > high:
        out[-1] = max(high, low + gap * (len(out) - 1))
        for k in range(len(out) - 2, -1, -1):
            out[k] = min(out[k], out[k + 1] - gap)
    return out


def _label_points(ax: Axes, labels: Sequence[tuple[float, float, str, str]]) -> None:
    """Write each (x, y, text, colour) label beside its point, on the far side of the y = x line (left of
    points above it, right of those below), spread out so that no two labels overlap and they stay inside the
    axes: the ranks of a balanced plan sit almost on one spot. A label moved away from its point gets a thin
    leader line."""
    ax.apply_aspect()  # final box, so data -> display is right (up to the layout's scaling)
    to_pt = 72 / ax.figure.dpi
    box = ax.get_window_extent()
    gap = LABEL_PT * 1.5  # points between neighbouring labels' centres
    for above in (True, False):
        side = sorted((float(ax.transData.transform((x, y))[1]) * to_pt, x, y, text, color)
                      for x, y, text, color in labels if (y >= x) == above)
        wanted = [y_pt + (gap / 2 if above else -gap / 2) for y_pt, *_ in side]
        placed = _spread(wanted, gap, box.y0 * to_pt + gap, box.y1 * to_pt - gap)
        # a column of moved labels stands further off, so that
        # the leaders slope away from the labels below them
        dx = 14 if any(abs(at - y_pt) > gap for at, (y_pt, *_) in zip(placed, side)) else 6
        for (y_pt, x, y, text, color), at in zip(side, placed):
            moved = abs(at - y_pt) > gap
            ax.annotate(text, (x, y), xytext=(-dx if above else dx, at - y_pt), textcoords="offset points",
                        ha="right" if above else "left", va="center", fontsize=LABEL_PT, color=color,
                        # the leader leaves from the label's corner nearest the point, so it crosses no label
                        arrowprops={"arrowstyle": "-", "color": color, "linewidth": 0.5, "shrinkA": 1,
                                    "shrinkB": 3,
                                    "relpos": (1.0 if above else 0.0, 0.0 if at > y_pt else 1.0)} if moved
                        else None)


def plot_predicted_vs_measured(reports: RunReport | Sequence[RunReport], ax: Axes | None = None) -> Axes:
    """Scatter of measured against predicted ms: per-rank compute per microbatch (dots, each marked with its
    rank) and the step (squares), with the y = x line. Where a run timed each rank's layers alone after it
    (``retimed_compute_s``), a hollow circle at that figure and a line from it to the measured dot: the
    circle's height over y = x is the machine's drift since the profile, the line the pipeline's own share.
    Log axes (a step is many microbatches long) ticked at 1, 2, 5 x 10^k with plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax = _axes(ax, (6.5, 4.5))
    ax.set_box_aspect(1)  # square, so y = x is the diagonal and a legend beside it cannot squeeze the x axis
    items = [reports] if isinstance(reports, RunReport) else list(reports)
    pts: list[float] = []
    labels: list[tuple[float, float, str, str]] = []
    for i, rep in enumerate(items):
        method = rep.plan.get("method", "run")
        px = [r["predicted_compute_s"] * 1e3 for r in rep.ranks]
        my = [r["measured_compute_s"] * 1e3 for r in rep.ranks]
        ax.scatter(px, my, marker="o", color=f"C{i}", label=f"{method} per-rank compute")
        labels += [(x, y, f"rank {row.get('rank', k)}", f"C{i}") for k,
                   (row, x, y) in enumerate(zip(rep.ranks, px, my))]
        alone = [(x, row["retimed_compute_s"] * 1e3, y) for row, x, y in zip(rep.ranks, px, my)
                 if row.get("retimed_compute_s")]
        if alone:
            ax.scatter([a[0] for a in alone], [a[1] for a in alone], marker="o", facecolors="none",
                       edgecolors=f"C{i}", label=f"{method}: its layers alone after the run")
            ax.vlines([a[0] for a in alone], [a[1] for a in alone], [a[2] for a in alone], colors=f"C{i}",
                      linewidth=0.8)
            pts += [a[1] for a in alone]
        ax.scatter([rep.predicted_step_s * 1e3], [rep.measured_step_s * 1e3], marker="s", color=f"C{i}",
                   label=f"{method} step")
        pts += px + my + [rep.predicted_step_s * 1e3, rep.measured_step_s * 1e3]
    pts = [v for v in pts if v > 0]
    lo, hi = (min(pts) / 1.3, max(pts) * 1.3) if pts else (1.0, 10.0)
    if hi / lo < 10:  # span at least a decade, which always holds three of 1, 2, 5 x 10^k
        widen = (10 * lo / hi) ** 0.5
        lo, hi = lo / widen, hi * widen
    ax.plot([lo, hi], [lo, hi], color="black", linestyle="--", linewidth=1, label="y = x")
    ax.set_xscale("log")  # before the locators: setting a scale resets them
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    _label_points(ax, labels)
    ax.set_xlabel("predicted ms")
    ax.set_ylabel("measured ms")
    ax.set_title("predicted vs measured", fontsize=9)
    ax.legend(fontsize=LEGEND_PT, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    return ax


SAVE_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def check_figure_path(path: str | os.PathLike[str]) -> str:
    """The format a figure path names by its suffix, after checking its folder can be written; an unknown or
    missing suffix is refused (matplotlib would otherwise write PNG bytes under any name). Call it before any
    work that ends in a figure."""
    from stageplan._io import check_output_path

    suffix = Path(path).suffix
    fmt = SAVE_FORMATS.get(suffix.lower())
    if fmt is None:
        what = f"suffix {suffix!r} is not supported" if suffix else "it has no suffix"
        raise StageplanError(
            f"cannot save a figure to {str(path)!r}: {what}; the format follows the suffix; "
            f"use {', '.join(list(SAVE_FORMATS)[:-1])} or {list(SAVE_FORMATS)[-1]}"
        )
    check_output_path(path)
    return fmt


def save(ax: Axes, path: str | os.PathLike[str]) -> None:
    """Write the Axes' figure in the format its suffix names (.png, .svg or .pdf), atomically: to a temporary
    file in the same folder, then ``os.replace``, so a reader never sees a half-written figure.

    An unknown or missing suffix is refused before anything is written (matplotlib would otherwise fall back
    to PNG bytes under any name).
    """
    from stageplan._io import write_atomic

    fmt = check_figure_path(path)
    fig = ax.figure
    fig.tight_layout()  # type: ignore[union-attr]
    # bbox_inches="tight": legends placed outside the axes are kept, not cropped
    write_atomic(path, lambda f: fig.savefig(f, format=fmt, dpi=110, bbox_inches="tight"))  # type: ignore[union-attr]


def plot_layouts(layout: Layout, ax: Axes | None = None) -> Axes:
    """Each priced candidate's predicted step against its fullest device's memory: feasible ones filled, the
    memory limit as a line, the chosen layout named."""
    ax = _axes(ax)
    gib = 1024.0**3
    cands = [c for c in layout.candidates if c.peak_memory_bytes is not None]
    xs = [c.peak_memory_bytes / gib for c in cands]  # type: ignore[operator]
    ys = [c.step_s for c in cands]
    ax.scatter(xs, ys, s=14, c="#4C72B0", alpha=0.6, label="feasible candidates")
    over = [c for c in layout.over_limit if c.peak_memory_bytes is not None and c.step_s < float("inf")]
    if over:
        ax.scatter([c.peak_memory_bytes / gib for c in over], [c.step_s for c in over],  # type: ignore[operator]
                   s=14, facecolors="none", edgecolors="#937860", label="over the memory limit")
    if layout.memory_limit_bytes is not None:
        ax.axvline(layout.memory_limit_bytes / gib, color="#C44E52", linestyle="--", label="memory limit")
    best = layout.best
    ax.scatter([(best.peak_memory_bytes or 0) / gib], [best.step_s], s=60, c="#DD8452", marker="*",
               label=f"chosen: {best.degrees}", zorder=3)
    if layout.given is not None and layout.given.peak_memory_bytes is not None:
        g = layout.given
        ax.scatter([(g.peak_memory_bytes or 0.0) / gib], [g.step_s], s=50, c="#55A868", marker="D",
                   label=f"given: {g.degrees}", zorder=3)
    ax.set_xlabel("fullest device (GiB)")
    ax.set_ylabel("predicted step (s)")
    ax.set_title(f"layouts of {layout.num_devices} devices{_estimated(layout.plan) if layout.plan else ''}")
    ax.legend(fontsize=LEGEND_PT, loc="best")
    return ax
