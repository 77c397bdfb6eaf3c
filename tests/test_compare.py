"""stageplan compare and show --plot, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow


def test_compare_gpt_two_stages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    code, stdout, err = run_cli(["compare", "gpt", "--stages", "2", "--set", "n_layer=3", "--set", "d_model=32",
                                 "--set", "vocab_size=2048", "--set", "seq_len=16", "--microbatches", "4",
                                 "--steps", "2", "--warmup", "1", "-o", str(out)], capsys)
    assert code == 0, err
    data = json.loads((out / "compare.json").read_text())
    assert set(data["methods"]) == {"optimal", "uniform", "parameters"}
    for row in data["methods"].values():
        assert row["measured_step_s"] > 0 and row["predicted_step_s"] > 0
    assert data["methods"]["uniform"]["speedup_over_uniform"] == pytest.approx(1.0)
    assert "speed-up vs uniform" in stdout
    for name in ("balance.png", "timeline_optimal.png", "plan_optimal.json", "run_optimal.json"):
        assert (out / name).stat().st_size > 0
    for name in ("plan_optimal.json", "run_optimal.json"):
        png = tmp_path / (name + ".png")
        code, stdout, err = run_cli(["show", str(out / name), "--plot", str(png)], capsys)
        assert code == 0, err
        assert png.stat().st_size > 1000


def test_show_profile_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "p.json"
    code, _, err = run_cli(["profile", "convnet", "--warmup", "0", "--repeats", "1", "--quiet", "-o", str(prof)], capsys)
    assert code == 0, err
    code, _, err = run_cli(["show", str(prof), "--plot", str(tmp_path / "p.png")], capsys)
    assert code == 0, err
    assert (tmp_path / "p.png").stat().st_size > 1000
    code, _, err = run_cli(["show", str(prof), "--plot", str(tmp_path / "missing" / "p.png")], capsys)
    assert code == 2 and "does not exist" in err
