"""Plots: each returns an Axes with the expected bars/patches for a known plan and writes a non-empty PNG."""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pytest
from matplotlib.patches import Rectangle
from matplotlib.text import Annotation, Text
from matplotlib.transforms import Bbox

from stageplan import LayerProfile, Profile
from stageplan.errors import StageplanError
from stageplan.formats.runreport import RunReport
from stageplan.planning.planner import METHODS, plan
from stageplan.planning.schedules import simulate
from stageplan.plots import (
    plot_layer_costs,
    plot_memory,
    plot_predicted_vs_measured,
    plot_stage_balance,
    plot_timeline,
    save,
)


def test_the_timeline_draws_the_optimizer_step_with_its_own_colour_and_legend() -> None:
    import matplotlib

    matplotlib.use("Agg")
    from stageplan.plots import COLORS, plot_timeline

    ax = plot_timeline(simulate("1F1B", [1.0] * 2, [2.0] * 2, 4, optimizer_s=[0.5, 0.5]))
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["forward", "backward", "optimizer", "idle"]
    assert COLORS["O"] not in {COLORS[k] for k in ("F", "B", "I", "W", "idle")}


def test_the_timeline_draws_the_sync_with_its_own_colour_and_legend() -> None:
    import matplotlib

    matplotlib.use("Agg")
    from stageplan.plots import COLORS, plot_timeline

    ax = plot_timeline(simulate("1F1B", [1.0] * 2, [2.0] * 2, 4, optimizer_s=[0.5, 0.5], tied_sync_s=0.25))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "backward", "tied sync",
                                                                   "optimizer", "idle"]
    assert COLORS["T"] not in {COLORS[k] for k in ("F", "B", "I", "W", "O", "idle")}


matplotlib.use("Agg")


def _profile() -> Profile:
    times = [1, 2, 3, 4, 5, 6]
    layers = tuple(LayerProfile(f"l{i}", t * 1e-3, 2 * t * 1e-3, 1000 * t, 10, 100 * t) for i,
                   t in enumerate(times))
    return Profile(layers, {"batch_size": 8, "microbatch_size": 2, "model": "toy"})


def _bars(ax) -> list[Rectangle]:  # type: ignore[no-untyped-def]
    return [p for p in ax.patches if isinstance(p, Rectangle)]


def test_stage_balance_bars(tmp_path: Path) -> None:
    pl = plan(_profile(), 3, num_microbatches=4)
    ax = plot_stage_balance(pl)
    assert len(_bars(ax)) == 3 * 3  # forward, backward, comm per stage
    heights = [r.get_height() for r in _bars(ax)]
    assert heights[:3] == pytest.approx([st.forward_s * 1e3 for st in pl.stages])
    save(ax, str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").stat().st_size > 1000
    ax = plot_stage_balance({m: plan(_profile(), 3, num_microbatches=4, method=m) for m in METHODS})
    assert len(_bars(ax)) == 3 * 3 * 3  # three plans side by side


def test_memory_bars_and_limits(tmp_path: Path) -> None:
    pl = plan(_profile(), 2, num_microbatches=4, memory_limit="1MiB")
    ax = plot_memory(pl)
    assert len(_bars(ax)) == 5 * 2  # params, grads, optimizer, activations, buffers per stage
    assert len(ax.collections) == 2  # one limit line per stage
    save(ax, str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").stat().st_size > 1000


def test_layer_costs_with_boundaries(tmp_path: Path) -> None:
    pl = plan(_profile(), 3, num_microbatches=4)
    ax = plot_layer_costs(_profile(), pl)
    assert len(_bars(ax)) == 2 * 6
    assert len(ax.lines) == 2  # one line per inner boundary
    save(ax, str(tmp_path / "l.png"))


def test_timeline_from_simulation_and_rows(tmp_path: Path) -> None:
    pl = plan(_profile(), 2, num_microbatches=4, schedule="GPipe")
    sim = pl.simulate()
    ax = plot_timeline(sim)
    # one idle background per rank + one box per action (2 ranks x 4 microbatches x F and B)
    assert len(ax.collections) == 2 + 2 * 4 * 2
    save(ax, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_timeline_draws_each_transfer_below_its_receiving_rank() -> None:
    from matplotlib.colors import to_hex

    from stageplan.plots import COLORS

    sim = plan(_profile(), 2, num_microbatches=4, schedule="1F1B", bandwidth="1GB/s").simulate()
    moves = [e for e in sim.timeline if e.kind in ("A", "G")]
    assert len(moves) == 2 * 4  # each microbatch's activation to rank 1 and its gradient back to rank 0
    ax = plot_timeline(sim)
    assert len(ax.collections) == 2 + len(sim.timeline)  # the idle rows, then one bar per event
    green = [c for c in ax.collections if to_hex(c.get_facecolor()[0]) == to_hex(COLORS["comm"])]
    assert len(green) == len(moves)
    for c, e in zip(green, sorted(moves, key=lambda e: (e.start_s, e.rank))):
        (x0, y0), (x1, y1) = c.get_paths()[0].get_extents().get_points()
        assert (x0, x1) == pytest.approx((e.start_s * 1e3, e.end_s * 1e3))
        assert e.rank + 0.4 < y0 < y1 < e.rank + 0.6  # in the gap below the rank's row, over no compute bar
    assert "transfer" in [t.get_text() for t in ax.get_legend().get_texts()]
    plain = plot_timeline(plan(_profile(), 2, num_microbatches=4, schedule="1F1B").simulate())
    assert "transfer" not in [t.get_text() for t in plain.get_legend().get_texts()]  # no link: none drawn


def test_predicted_vs_measured(tmp_path: Path) -> None:
    rep = RunReport(measured_step_s=0.1, predicted_step_s=0.08, measured_step_iqr_s=0.0, samples_per_s=80,
                    measured_bubble_fraction=0.2, predicted_bubble_fraction=0.2,
                    ranks=({"rank": 0, "predicted_compute_s": 0.01, "measured_compute_s": 0.012},
                            {"rank": 1, "predicted_compute_s": 0.011, "measured_compute_s": 0.013}),
                    losses=(), plan={"method": "optimal"}, run_options={})
    ax = plot_predicted_vs_measured([rep, rep])
    assert len(ax.collections) == 4 and len(ax.lines) == 1
    save(ax, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_predicted_vs_measured_draws_each_ranks_layers_alone_after_the_run() -> None:
    import dataclasses

    rep = _report()
    ranks = tuple({**r, "retimed_compute_s": a} for r, a in zip(rep.ranks, (0.0115, 0.0105)))
    ax = plot_predicted_vs_measured(dataclasses.replace(rep, ranks=ranks))
    hollow = [c for c in ax.collections if c.get_label() == "optimal: its layers alone after the run"]
    assert len(hollow) == 1
    # at (predicted, alone) in ms, and a line from each up or down to its measured dot (the pipeline's share)
    assert hollow[0].get_offsets().ravel().tolist() == pytest.approx([10.0, 11.5, 11.0, 10.5])
    (lines,) = [c for c in ax.collections if type(c).__name__ == "LineCollection"]
    assert [s.ravel().tolist() for s in lines.get_segments()] == [pytest.approx([10.0, 11.5, 10.0, 12.0]),
                                                                  pytest.approx([11.0, 10.5, 11.0, 13.0])]
    # a report without them draws neither
    ax = plot_predicted_vs_measured(rep)
    assert not [c for c in ax.collections if "alone" in str(c.get_label())
                or type(c).__name__ == "LineCollection"]


@pytest.mark.parametrize(("suffix", "magic"),
                         [(".png", b"\x89PNG"), (".svg", b"<svg"), (".pdf", b"%PDF"), (".PDF", b"%PDF")])
def test_save_writes_the_format_its_suffix_names(tmp_path: Path, suffix: str, magic: bytes) -> None:
    path = tmp_path / f"fig{suffix}"
    save(plot_stage_balance(plan(_profile(), 3, num_microbatches=4)), path)
    data = path.read_bytes()
    if magic == b"<svg":
        assert magic in data[:2000] and not data.startswith(b"\x89PNG")
    else:
        assert data.startswith(magic)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # what open() gives, not mkstemp's 0o600


@pytest.mark.parametrize(("name", "said"), [("fig.jpg", "suffix '.jpg' is not supported"),
                                            ("fig", "it has no suffix"),
                                            ("fig.png.bak", "suffix '.bak' is not supported")])
def test_save_refuses_other_suffixes_before_writing(tmp_path: Path, name: str, said: str) -> None:
    ax = plot_stage_balance(plan(_profile(), 3, num_microbatches=4))
    with pytest.raises(StageplanError,
                       match=re.escape(f"{str(tmp_path / name)!r}: {said}") + ".*use .png, .svg or .pdf"):
        save(ax, str(tmp_path / name))
    assert list(tmp_path.iterdir()) == []


def test_save_replaces_an_existing_file_and_cleans_up_on_failure(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "fig.png"
    path.write_bytes(b"old")
    ax = plot_stage_balance(plan(_profile(), 3, num_microbatches=4))

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(ax.figure, "savefig", broken)
    with pytest.raises(OSError, match="disk full"):
        save(ax, path)
    assert [p.name for p in tmp_path.iterdir()] == ["fig.png"] and path.read_bytes() == b"old"  # untouched
    monkeypatch.undo()
    save(ax, path)
    assert path.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(StageplanError, match="does not exist"):
        save(ax, tmp_path / "missing" / "fig.png")


def _drawn(ax):  # type: ignore[no-untyped-def]
    """Lay the figure out as save() does and draw it, so window extents are final."""
    ax.figure.tight_layout()
    ax.figure.canvas.draw()
    return ax.figure.canvas.get_renderer()


def _report(timeline: tuple[dict[str, object], ...] = (), step_s: float = 0.1) -> RunReport:
    return RunReport(measured_step_s=step_s, predicted_step_s=0.08, measured_step_iqr_s=0.0, samples_per_s=80,
                     measured_bubble_fraction=0.2, predicted_bubble_fraction=0.2,
                     ranks=({"rank": 0, "predicted_compute_s": 0.01, "measured_compute_s": 0.012},
                             {"rank": 1, "predicted_compute_s": 0.011, "measured_compute_s": 0.013}),
                     losses=(), plan={"method": "optimal"}, run_options={}, timeline=timeline)


def test_timeline_legend_does_not_cover_rank_0() -> None:
    sim = plan(_profile(), 2, num_microbatches=4, schedule="GPipe").simulate()
    ax = plot_timeline(sim)  # GPipe: rank 0 runs the step's last backward, at the top right corner
    renderer = _drawn(ax)
    legend = ax.get_legend().get_window_extent(renderer)
    rank0 = [e for e in sim.timeline if e.rank == 0]
    assert rank0
    for e in rank0:
        (x0, y0), (x1, y1) = ax.transData.transform([(e.start_s * 1e3, -0.4), (e.end_s * 1e3, 0.4)])
        box = Bbox.from_extents(min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1))
        assert not legend.overlaps(box), (e, legend, box)


@pytest.mark.parametrize("which", ["balance", "compare", "memory", "layers", "timeline", "predicted"])
def test_legends_sit_outside_the_data_and_text_is_at_least_8pt(which: str) -> None:
    pl = plan(_profile(), 3, num_microbatches=4, memory_limit="1MiB")
    sim = pl.simulate()
    ax = {
        "balance": lambda: plot_stage_balance(pl),
        "compare": lambda: plot_stage_balance(
            {m: plan(_profile(), 3, num_microbatches=4, method=m) for m in METHODS}),
        "memory": lambda: plot_memory(pl),
        "layers": lambda: plot_layer_costs(_profile(), pl),
        "timeline": lambda: plot_timeline(_report(tuple(sim.to_pandas().to_dict("records")))),
        "predicted": lambda: plot_predicted_vs_measured(_report()),
    }[which]()
    renderer = _drawn(ax)
    texts = [t for t in ax.texts if t.get_text()]
    if which in ("memory", "timeline", "predicted"):
        assert texts  # in-flight counts, microbatch numbers, rank names
    legend = ax.get_legend()
    texts += list(legend.get_texts())
    small = [(t.get_text(), t.get_fontsize()) for t in texts if t.get_fontsize() < 8]
    assert not small
    assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))


@pytest.mark.parametrize("source", ["toy", "gpt"])
def test_memory_writes_each_stage_in_flight_count_inside_the_axes(source: str) -> None:
    prof = _profile() if source == "toy" else Profile.load(Path(__file__).parents[2] / "profiles" / "cpu"
                                                           / "gpt.json")
    pl = plan(prof, 4 if source == "gpt" else 3, num_microbatches=8)
    ax = plot_memory(pl)
    assert [t.get_text() for t in ax.texts] == [f"x{st.inflight}" for st in pl.stages]
    assert all(t.get_fontsize() >= 8 for t in ax.texts)
    renderer = _drawn(ax)
    inside = ax.get_window_extent(renderer)
    for t in ax.texts:  # the tallest bar's count was drawn over the title
        box = t.get_window_extent(renderer)
        assert inside.y0 <= box.y0 and box.y1 <= inside.y1


def test_predicted_vs_measured_names_each_rank() -> None:
    rep = _report()
    other = dataclasses.replace(rep, plan={"method": "uniform"}, measured_step_s=0.4)
    ax = plot_predicted_vs_measured([rep, other])
    notes = [(t.get_text(), tuple(t.xy)) for t in ax.texts if isinstance(t, Annotation)]
    for r in rep.ranks:
        point = (r["predicted_compute_s"] * 1e3, r["measured_compute_s"] * 1e3)
        assert [n for n in notes if n[0] == f"rank {r['rank']}" and n[1] == pytest.approx(point)]
    assert all(t.get_fontsize() >= 8 for t in ax.texts)


@pytest.mark.parametrize("measured_s", [0.025, 0.018], ids=["above-y=x", "below-y=x"])
def test_rank_names_of_a_balanced_plan_do_not_overlap(measured_s: float) -> None:
    # A balanced plan puts every rank at almost the same point; their names must still be readable.
    stages = tuple({"rank": r, "predicted_compute_s": 0.022 * (1 + 0.01 * r),
                    "measured_compute_s": measured_s * (1 + 0.01 * r)} for r in range(6))
    rep = dataclasses.replace(_report(), ranks=stages)
    ax = plot_predicted_vs_measured([rep, dataclasses.replace(rep, plan={"method": "uniform"})])
    renderer = _drawn(ax)
    boxes = [Text.get_window_extent(t, renderer) for t in ax.texts]  # the words, without the leader lines
    assert len(boxes) == 12
    inside = ax.get_window_extent(renderer)
    for i, a in enumerate(boxes):
        assert inside.y0 <= a.y0 and a.y1 <= inside.y1  # not over the tick labels or the title
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b)


@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0])
def test_predicted_vs_measured_tick_labels_do_not_touch(scale: float) -> None:
    # The notebook's layout (a narrow panel beside the timeline) and a range inside one decade, where the
    # old log axis wrote '3x10^1' and '4x10^1' 2 px apart.
    stages = tuple({"rank": r, "predicted_compute_s": scale * 0.022 * (1 + 0.05 * r),
                    "measured_compute_s": scale * 0.025 * (1 + 0.04 * r)} for r in range(4))
    rep = dataclasses.replace(_report(), ranks=stages, predicted_step_s=scale * 0.09,
                              measured_step_s=scale * 0.099)
    _fig, axes = plt.subplots(1, 2, figsize=(13, 3.5), gridspec_kw={"width_ratios": [2.5, 1]})
    ax = plot_predicted_vs_measured(rep, ax=axes[1])
    renderer = _drawn(ax)
    for i, axis in enumerate((ax.xaxis, ax.yaxis)):
        lo, hi = sorted(ax.get_xlim() if i == 0 else ax.get_ylim())
        shown = [t for t in axis.get_ticklabels(minor=True) + axis.get_ticklabels()
                 if t.get_text() and t.get_visible() and lo <= t.get_position()[i] <= hi]
        assert len(shown) >= 2
        boxes = sorted((t.get_window_extent(renderer) for t in shown), key=lambda b: b.x0 if i == 0 else b.y0)
        gaps = [b.x0 - a.x1 if i == 0 else b.y0 - a.y1 for a, b in zip(boxes, boxes[1:])]
        assert min(gaps) >= 5, ([t.get_text() for t in shown], gaps)


def test_run_timeline_title_states_the_plotted_step_and_the_median() -> None:
    rows = ({"rank": 0, "stage": 0, "microbatch": 0, "kind": "F", "start_s": 0.0, "end_s": 0.030},
            {"rank": 1, "stage": 1, "microbatch": 0, "kind": "F", "start_s": 0.030, "end_s": 0.060},
            {"rank": 1, "stage": 1, "microbatch": 0, "kind": "B", "start_s": 0.060, "end_s": 0.087})
    rep = _report(rows, step_s=0.099)
    assert plot_timeline(rep).get_title() == "measured timeline (last step): 87.0 ms (median step 99.0 ms)"
    title = plot_timeline(rep, title="optimal: measured timeline (last step)").get_title()
    assert title == "optimal: measured timeline (last step): 87.0 ms (median step 99.0 ms)"


def test_compared_methods_are_named_in_the_legend_and_hatched_apart() -> None:
    plans = {m: plan(_profile(), 3, num_microbatches=4, method=m) for m in METHODS}
    ax = plot_stage_balance(plans)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert set(plans) <= set(labels)
    bars = _bars(ax)
    per_plan = 3 * 3  # forward, backward, comm for each of 3 stages
    hatches = [{b.get_hatch() for b in bars[k * per_plan : (k + 1) * per_plan]} for k in range(len(plans))]
    assert all(len(h) == 1 for h in hatches)  # one hatch per method...
    assert len({next(iter(h)) for h in hatches}) == len(plans)  # ...and a different one for each


@pytest.mark.parametrize("layout", ["alone", "beside"])
def test_timeline_microbatch_numbers_fit_inside_their_boxes(layout: str) -> None:
    sim = plan(_profile(), 3, num_microbatches=12, schedule="1F1B").simulate()
    if layout == "alone":
        ax = plot_timeline(sim)
    else:  # the CLI's run figure: timeline beside the predicted-vs-measured panel
        _fig, axes = plt.subplots(1, 2, figsize=(14, 4), gridspec_kw={"width_ratios": [2.5, 1]})
        ax = plot_timeline(sim, ax=axes[0])
    renderer = _drawn(ax)
    assert len(ax.texts) >= len(sim.timeline) // 2  # most boxes are wide enough to say their microbatch
    for t in ax.texts:
        box = t.get_window_extent(renderer)
        x, rank = t.get_position()
        e = next(e for e in sim.timeline if e.rank == rank and abs((e.start_s + e.end_s) * 500 - x) < 1e-9)
        (x0, _), (x1, _) = ax.transData.transform([(e.start_s * 1e3, 0), (e.end_s * 1e3, 0)])
        assert x0 <= box.x0 and box.x1 <= x1, (t.get_text(), box, x0, x1)
