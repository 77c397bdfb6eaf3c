"""stageplan._io: writes are atomic, through a symlink to its target, into a pipe without replacing it, and a
write that fails at the end keeps the result."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from stageplan._io import write_json_atomic
from stageplan.errors import StageplanError
from stageplan.formats.profile import Profile

from .test_cli import _profile


def test_an_output_through_a_symlink_writes_its_target_and_keeps_the_link(tmp_path: Path) -> None:
    """-o link.json, a link to target.json: the rename had replaced the link by a file and left the target
    unwritten."""
    (tmp_path / "target.json").write_text("old")
    os.symlink("target.json", tmp_path / "link.json")
    write_json_atomic(tmp_path / "link.json", {"a": 1})
    assert (tmp_path / "link.json").is_symlink()
    assert json.loads((tmp_path / "target.json").read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "target.json"]  # no temporary left


def test_an_output_that_is_a_pipe_is_written_to_not_replaced(tmp_path: Path) -> None:
    """-o /dev/null had replaced the device by a regular file (the rename). A pipe stands in for the device
    here: it is written through, and stays a pipe."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    write_json_atomic(fifo, {"a": 1})
    reader.join(timeout=30)
    assert not reader.is_alive() and got and json.loads(got[0]) == {"a": 1}
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_write_that_fails_at_the_end_keeps_the_result(tmp_path: Path) -> None:
    from stageplan._io import save_or_keep

    prof = Profile.load(_profile(tmp_path))
    target = tmp_path / "gone" / "p.json"  # the folder disappeared while the work ran
    with pytest.raises(StageplanError,
                       match=r"could not write .*p\.json.*; the result was kept in (/\S+\.json)") as info:
        save_or_keep(prof, target)
    kept = str(info.value).rsplit(" ", 1)[-1]
    assert Profile.load(kept) == prof
    Path(kept).unlink()
