"""Plots: each returns an Axes with the expected bars/patches for a known plan and writes a non-empty PNG."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
from matplotlib.patches import Rectangle

from stageplan import LayerProfile, Profile
from stageplan.api import compare_methods, plan
from stageplan.errors import StageplanError
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
    ax = plot_stage_balance(compare_methods(_profile(), 3, num_microbatches=4))
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
                    stages=({"rank": 0, "predicted_compute_s": 0.01, "measured_compute_s": 0.012},
                            {"rank": 1, "predicted_compute_s": 0.011, "measured_compute_s": 0.013}),
                    losses=(), plan={"method": "optimal"}, options={})
    ax = plot_predicted_vs_measured([rep, rep])
    assert len(ax.collections) == 4 and len(ax.lines) == 1
    save(ax, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.parametrize(("suffix", "magic"), [(".png", b"\x89PNG"), (".svg", b"<svg"), (".pdf", b"%PDF"), (".PDF", b"%PDF")])
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


@pytest.mark.parametrize(("name", "said"), [("fig.jpg", "suffix '.jpg' is not supported"), ("fig", "it has no suffix"),
                                            ("fig.png.bak", "suffix '.bak' is not supported")])
def test_save_refuses_other_suffixes_before_writing(tmp_path: Path, name: str, said: str) -> None:
    ax = plot_stage_balance(plan(_profile(), 3, num_microbatches=4))
    with pytest.raises(StageplanError, match=re.escape(f"{str(tmp_path / name)!r}: {said}") + ".*use .png, .svg or .pdf"):
        save(ax, str(tmp_path / name))
    assert list(tmp_path.iterdir()) == []


def test_save_replaces_an_existing_file_and_cleans_up_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
