"""stageplan: profile a model per layer, plan pipeline stages exactly, run and check the plan.

``import stageplan`` does not import torch (nor scipy): planning from a stored profile works without them.
The torch-backed functions (``profile_model``, ``profile_in_processes``, ``run``, ``build_pipeline``) are the
real functions of ``stageplan.profiling`` and ``stageplan.running``, re-exported lazily (PEP 562): torch is
imported on
first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stageplan._version import __version__
from stageplan.calibration import calibrate
from stageplan.errors import InfeasiblePlanError, PlanNote, RunError, RunInterrupted, StageplanError
from stageplan.formats.layout import Layout
from stageplan.formats.plan import Plan
from stageplan.formats.profile import LayerProfile, Profile, merge_profiles
from stageplan.formats.runreport import RunReport
from stageplan.layouting import layout
from stageplan.planning.costs import Device
from stageplan.planning.planner import plan
from stageplan.planning.schedules import simulate
from stageplan.planning.solver import solve
from stageplan.tuning import tune
from stageplan.workload import Workload

if TYPE_CHECKING:
    from stageplan.profiling.profiler import profile_model
    from stageplan.running.launch import profile_in_processes, run
    from stageplan.running.stages import build_pipeline

__all__ = [
    "Device",
    "InfeasiblePlanError",
    "LayerProfile",
    "Layout",
    "Plan",
    "PlanNote",
    "Profile",
    "RunError",
    "RunInterrupted",
    "RunReport",
    "StageplanError",
    "Workload",
    "__version__",
    "build_pipeline",
    "calibrate",
    "layout",
    "merge_profiles",
    "plan",
    "profile_in_processes",
    "profile_model",
    "run",
    "simulate",
    "solve",
    "tune",
]

# The torch edge, loaded on first access.
_LAZY = {"profile_model": "stageplan.profiling", "run": "stageplan.running",
         "profile_in_processes": "stageplan.running", "build_pipeline": "stageplan.running"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stageplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
