"""compare end to end: the ranks run each method's plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli


def test_compare_gpt_two_stages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    code, stdout, err = run_cli(["compare", "gpt", "--stages", "2", "--set", "n_layer=3", "--set",
                                 "d_model=32",
                                 "--set", "vocab_size=2048", "--set", "seq_len=16", "--microbatches", "4",
                                 "--steps", "2", "--warmup", "1", "-o", str(out)], capsys)
    assert code == 0, err
    data = json.loads((out / "compare.json").read_text())
    # stageplan's three methods and the peers' own defaults (Megatron's with E and L, torchtitan's)
    assert {"optimal", "uniform", "parameters", "torchtitan"} <= set(data["methods"])
    assert any(name.startswith("megatron") for name in data["methods"])
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
    code, _, err = run_cli(
        ["profile", "convnet", "--warmup", "0", "--repeats", "1", "--quiet", "-o", str(prof)], capsys)
    assert code == 0, err
    code, _, err = run_cli(["show", str(prof), "--plot", str(tmp_path / "p.png")], capsys)
    assert code == 0, err
    assert (tmp_path / "p.png").stat().st_size > 1000
    code, _, err = run_cli(["show", str(prof), "--plot", str(tmp_path / "missing" / "p.png")], capsys)
    assert code == 2 and "does not exist" in err


def test_a_failed_compare_leaves_the_folder_as_it_was_and_a_finished_one_no_stale_file(
    tmp_path: Path,
) -> None:
    """Everything goes to a staging folder inside DIR first: a failing compare had replaced plan_optimal.json
    beside the old compare.json; a compare that ran nothing left an old run_optimal.json beside its
    compare.json."""
    from stageplan import RunError
    from stageplan.comparison import compare
    from stageplan.formats.profile import LayerProfile, Profile

    out = tmp_path / "cmp"
    out.mkdir()
    old = {"compare.json": "old compare", "plan_optimal.json": "old plan", "run_optimal.json": "old run",
           "notes.txt": "the user's"}
    for name, text in old.items():
        (out / name).write_text(text)
    meta = {"batch_size": 8, "microbatch_size": 4, "model": "workloads:faulty"}
    skewed = Profile(tuple(LayerProfile(str(i), 1e-3 * (1 + 3 * i), 1e-3, 0, 8, 4) for i in range(4)), meta)
    with pytest.raises(RunError):  # the faulty layer raises in step 2 of every run
        compare("workloads:faulty", 2, profile=skewed, num_microbatches=2, steps=3, warmup=0, output_dir=out)
    assert {f.name: f.read_text() for f in out.iterdir()} == old  # no staging folder left either
    even = Profile(tuple(LayerProfile(str(i), 1e-3, 1e-3, 0, 8, 4) for i in range(4)), meta)
    result = compare("workloads:faulty", 2, profile=even, num_microbatches=2, output_dir=out)
    assert result["identical"]  # every method splits 2 | 2: nothing is run
    names = {f.name for f in out.iterdir()}
    assert "run_optimal.json" not in names and (out / "notes.txt").read_text() == "the user's"
    assert {"compare.json", "plan_optimal.json", "plan_uniform.json", "balance.png"} <= names
    assert json.loads((out / "compare.json").read_text())["identical"] is True
