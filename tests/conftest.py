"""Shared fixtures and helpers of both tiers (tests/unit, tests/integration): one intra-op thread, as every
rank runs; temporary folders under pytest's own; no process started where input should be refused."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# (schedule, p, m, v): one case per schedule family, for the tests that check the batch pricer (SplitCosts)
# against the one evaluate on random splits
SCHEDULE_CASES = [("1F1B", 3, 6, 1), ("GPipe", 2, 3, 1), ("Interleaved1F1B", 2, 4, 2),
                  ("ZBVZeroBubble", 2, 4, 2), ("InterleavedZeroBubble", 2, 4, 2), ("LoopedBFS", 2, 4, 2)]


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _temp_under_pytest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Temporary folders (and the rank processes' TMPDIR) go under pytest's own base, which it rotates: a run
    whose ranks fail keeps its logs for the user on purpose, and the tests that make ranks fail would
    otherwise leave those folders in the system's /tmp on every run."""
    import tempfile

    base = str(tmp_path_factory.mktemp("tmp"))
    old_env, old_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = base, base
    yield
    tempfile.tempdir = old_dir
    if old_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old_env


@pytest.fixture()
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Input that must be refused before any rank starts: starting a process fails the test."""
    from stageplan.running import launch

    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("a process was started for input that should have been refused")

    monkeypatch.setattr(launch.subprocess, "Popen", refuse)
    monkeypatch.setattr(launch, "_spawn_and_wait", refuse)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from stageplan.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, pattern: str) -> None:
    import re

    assert code == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert re.search(pattern, lines[0]), lines[0]


def spawn_ranks(target: Callable[..., None], world: int, *args: Any) -> dict[int, tuple[Any, ...]]:
    """Run ``target(rank, port, *args, queue)`` in ``world`` spawned processes that meet on a free localhost
    ``port``; each puts ``(rank, *values)`` on the queue once. Returns ``{rank: values}``; every process is
    joined, and killed if it has not ended 60 s after the answers (or the 120 s wait for them)."""
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return {rank: tuple(values) for rank, *values in (queue.get(timeout=120) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
