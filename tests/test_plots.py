"""Plots: each returns an Axes with the expected bars/patches for a known plan and writes a non-empty PNG."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
from matplotlib.patches import Rectangle

from stageplan import LayerProfile, Profile
from stageplan.api import METHODS, plan
from stageplan.plots import (
    plot_layer_costs,
    plot_memory,
    plot_predicted_vs_measured,
    plot_stage_balance,
    plot_timeline,
    save,
)
from stageplan.runreport import RunReport


def _profile() -> Profile:
    times = [1, 2, 3, 4, 5, 6]
    layers = tuple(LayerProfile(f"l{i}", t * 1e-3, 2 * t * 1e-3, 1000 * t, 10, 100 * t) for i, t in enumerate(times))
    return Profile(layers, {"batch_size": 8, "microbatch_size": 2, "model": "toy"})


def _bars(ax) -> list[Rectangle]:  # type: ignore[no-untyped-def]
    return [p for p in ax.patches if isinstance(p, Rectangle)]


@pytest.fixture(autouse=True)
def _close() -> None:
    yield
    plt.close("all")


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
