"""What a spawned rank runs around its task: a failing task leaves its innermost cause in one line in
rank<N>.error and ends the process with exit 1 at once; a task that finishes exits 0."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from stageplan.running.rank import rank_entry


def _fails() -> None:
    try:
        raise KeyError("blocks.5.lin@1.weight")
    except KeyError as exc:
        raise RuntimeError("stage 1 failed\nwith a traceback below") from exc


def _finishes() -> None:
    pass


@pytest.mark.parametrize(("task", "code", "error"), [(_fails, 1, "KeyError: 'blocks.5.lin@1.weight'"),
                                                     (_finishes, 0, None)])
def test_a_ranks_task_ends_its_process_and_names_its_cause(task: object, code: int, error: str | None,
                                                           tmp_path: Path) -> None:
    # fork: the child runs rank_entry as a rank would, and its os._exit ends only the child
    proc = multiprocessing.get_context("fork").Process(target=rank_entry, args=(str(tmp_path), 3, task))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == code
    written = tmp_path / "rank3.error"
    assert (written.read_text().strip() if written.exists() else None) == error
