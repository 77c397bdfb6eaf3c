"""stageplan: profile a model per layer, plan pipeline stages exactly, run and check the plan.

``import stageplan`` does not import torch (nor scipy): planning from a stored profile works without them.
The torch-backed functions (``profile_model``, ``profile_in_processes``, ``run``, ``build_pipeline``) are the real
functions of ``stageplan.profiler``, ``stageplan.launch`` and ``stageplan.stages``, re-exported lazily (PEP 562):
torch is imported on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stageplan._version import __version__

# Bound eagerly: importing the submodule stageplan.plan would otherwise shadow the function plan().
from stageplan.api import calibrate, plan, tune
from stageplan.costmodel import Device
from stageplan.errors import InfeasiblePlanError, PlanNote, RunError, StageplanError
from stageplan.plan import Plan
from stageplan.profile import LayerProfile, Profile, merge_profiles
from stageplan.runreport import RunReport
from stageplan.schedules import simulate
from stageplan.solver import solve
from stageplan.workload import Workload

if TYPE_CHECKING:
    from stageplan.launch import profile_in_processes, run
    from stageplan.profiler import profile_model
    from stageplan.stages import build_pipeline

__all__ = [
    "Device",
    "InfeasiblePlanError",
    "LayerProfile",
    "Plan",
    "PlanNote",
    "Profile",
    "RunError",
    "RunReport",
    "StageplanError",
    "Workload",
    "__version__",
    "build_pipeline",
    "calibrate",
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
_LAZY = {"profile_model": "stageplan.profiler", "run": "stageplan.launch", "profile_in_processes": "stageplan.launch",
         "build_pipeline": "stageplan.stages"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stageplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
