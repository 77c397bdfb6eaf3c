"""The committed notebooks execute top to bottom (nbclient, in a temporary folder); a failing cell fails."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]


NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_four_notebooks_are_committed() -> None:
    assert [p.stem for p in NOTEBOOKS] == ["01_stage_balance", "02_schedules_and_bubbles",
                                           "03_predicted_vs_measured", "04_layout_for_64_gpus"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copy(path, tmp_path / path.name)
    nb = nbformat.read(str(tmp_path / path.name), as_version=4)
    assert any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), "committed without outputs"
    monkeypatch.setenv("STAGEPLAN_ROOT", str(ROOT))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    assert os.listdir(tmp_path) == [path.name]  # a notebook leaves nothing behind
