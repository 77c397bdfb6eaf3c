"""What each rank process a local launch starts runs (``python -m stageplan.running.rank RUN_DIR RANK
WORLD``): its task from the run folder's payload (train with a plan, the link's ping-pong, or one profile),
ended with its launcher, and its error written in one line for the launcher to blame."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stageplan.formats.plan import Plan
from stageplan.running.executor import link_main, worker_main
from stageplan.workload import Workload


def _profile_task(run_dir: str, payload: dict[str, Any]) -> None:
    """One process of :func:`profile_in_processes`: build, profile, write run_dir/profile.json."""
    from stageplan.profiling.profiler import build_workload_for_profile, profile_model

    options = dict(payload["options"])
    workload = build_workload_for_profile(payload["model"], payload["factory_options"],
                                          device=options.get("device", "cpu"), dtype=options.get("dtype"),
                                          streaming=options.get("streaming"))
    profile_model(workload, microbatch_size=payload["microbatch_size"], **options).save(Path(run_dir)
                                                                                        / "profile.json")


def train_rank(run_dir: str, rank: int, world: int, payload: tuple[Workload, Plan, dict[str, Any]]) -> None:
    wl, plan, options = payload
    report = str(Path(run_dir) / "report.json") if rank == 0 else None
    worker_main(wl, plan, rank=rank, world_size=world, options=options, report_path=report)


def _die_with_parent() -> None:
    """A rank this launcher started ends when the launcher does, however it ends (kill -9, the OOM killer):
    Linux sends it SIGKILL then (PR_SET_PDEATHSIG). Not under torchrun, whose agent watches its workers
    itself."""
    parent = os.environ.get("STAGEPLAN_PARENT_PID")
    if not parent or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError, ValueError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != int(parent):  # the launcher died before the line above
            os._exit(1)


def rank_entry(run_dir: str, rank: int, task: Callable[[], None]) -> None:
    """Run one rank's ``task``; on any error write its one-line cause to rank<N>.error and exit 1 at once."""
    _die_with_parent()
    try:
        torch.set_num_threads(1)
        task()
        sys.stdout.flush()
        os._exit(0)
    except BaseException as exc:
        traceback.print_exc()
        root: BaseException = exc  # torch wraps a stage's error; the innermost cause says what went wrong
        while (root.__cause__ or root.__context__) is not None and len(
            str(root.__cause__ or root.__context__)
        ) > 0:
            root = root.__cause__ or root.__context__  # type: ignore[assignment]
        lines = [ln.strip() for ln in str(root).splitlines() if ln.strip()]
        msg = f"{type(root).__name__}: {lines[0]}" if lines else type(root).__name__
        (Path(run_dir) / f"rank{rank}.error").write_text(msg + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _payload_task(run_dir: str, rank: int, world: int) -> None:
    """A spawned rank's work, read from the payload: training with a plan, only the link's ping-pong, or one
    profile of :func:`profile_in_processes`."""
    payload = torch.load(Path(run_dir) / "payload.pt", weights_only=False)
    if payload.get("task") == "profile":
        _profile_task(run_dir, payload)
        return
    if payload.get("task") == "link":
        output = str(Path(run_dir) / "link.json") if rank == 0 else None
        link_main(rank=rank, world_size=world, options=payload["options"], output_path=output)
        return
    train_rank(run_dir, rank, world,
                (payload["workload"], Plan.from_json(payload["plan"]), payload["options"]))

if __name__ == "__main__":
    rank_entry(sys.argv[1], int(sys.argv[2]),
                lambda: _payload_task(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
