"""Plan -> RunReport (torch.distributed): launch the
ranks, build each rank's stages, train, measure, check."""

from __future__ import annotations

from stageplan.running.launch import profile_in_processes, run
from stageplan.running.stages import build_pipeline

__all__ = ["build_pipeline", "profile_in_processes", "run"]
