"""stageplan._progress: off a terminal, progress is plain throttled lines."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli


def test_profile_progress_is_plain_lines_off_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["profile", "workloads:mlp", "--warmup", "1", "--repeats", "2", "-o", str(tmp_path / "p.json")],
                           capsys)
    assert code == 0
    assert "profiling 8 layers: 3/3" in err and "\r" not in err
