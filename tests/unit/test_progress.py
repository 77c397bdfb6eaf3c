"""stageplan._progress: off a terminal, progress is plain throttled lines."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli


def test_profile_progress_is_plain_lines_off_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(["profile", "workloads:mlp", "--warmup", "1", "--repeats", "2", "-o",
                            str(tmp_path / "p.json")],
                           capsys)
    assert code == 0
    assert "profiling 8 layers: 3/3" in err and "\r" not in err


def test_off_a_terminal_lines_are_throttled_and_the_last_is_always_written() -> None:
    import io

    from stageplan._progress import Progress

    out = io.StringIO()  # not a terminal: plain lines, at most one an hour here, plus the last
    progress = Progress(5, "profiling", stream=out, interval_s=3600.0)
    for k in range(1, 5):
        progress.update(k, f"layer {k}")
    progress.update(5)
    progress.close()
    assert out.getvalue() == "profiling: 1/5 layer 1\nprofiling: 5/5\n"
    stopped = io.StringIO()  # ended early: close says where it stopped
    progress = Progress(5, "profiling", stream=stopped, interval_s=3600.0)
    progress.update(2)
    progress.close()
    assert stopped.getvalue() == "profiling: 2/5\nprofiling: 2/5\n"
    quiet = io.StringIO()
    progress = Progress(5, "profiling", enabled=False, stream=quiet)
    progress.update(5)
    progress.close()
    assert quiet.getvalue() == ""
