"""Every command in the README runs as written: the ```sh blocks (except the two setup commands, which are
what runs this test) and the ```python block, in a scratch folder that sees profiles/."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_opens_with_the_two_commands() -> None:
    first = _blocks("sh")[0].split()
    assert first == ["make", "demo", "make", "test"]


def test_readme_shell_commands_run(tmp_path: Path) -> None:
    (tmp_path / "profiles").symlink_to(ROOT / "profiles")
    bindir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", MPLBACKEND="Agg")
    commands = [line.split("  #")[0].strip() for block in _blocks("sh")[1:] for line in block.splitlines()]
    commands = [c for c in commands if c]
    assert len(commands) >= 10
    for cmd in commands:
        argv = shlex.split(cmd)
        assert argv[0] in ("stageplan", "torchrun"), cmd
        # each in its own session, ended with its children on
        # a timeout (torchrun's workers are never orphaned)
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == 0, f"{cmd}\n{out[-2000:]}\n{err[-2000:]}"


def test_readme_python_tour_runs(tmp_path: Path) -> None:
    code = _blocks("python")[0]
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, MPLBACKEND="Agg"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "True" in done.stdout  # the check passed
