"""stageplan: profile a model per layer, plan pipeline stages exactly, run and check the plan.

``import stageplan`` does not import torch: planning from a stored profile works without it.
The torch-backed functions (``profile_model``, ``run``) import torch when called; ``solve`` loads on first
use (PEP 562).
"""

from __future__ import annotations

from typing import Any

# Bound eagerly: importing the submodule stageplan.plan would otherwise shadow the function plan().
from stageplan.api import calibrate, plan, profile_model, run
from stageplan.costmodel import Device
from stageplan.errors import InfeasiblePlanError, RunError, StageplanError
from stageplan.plan import Plan
from stageplan.profile import LayerProfile, Profile
from stageplan.runreport import RunReport
from stageplan.schedules import simulate
from stageplan.workload import Workload

__version__ = "0.1.0"

__all__ = [
    "Device",
    "InfeasiblePlanError",
    "LayerProfile",
    "Plan",
    "Profile",
    "RunError",
    "RunReport",
    "StageplanError",
    "Workload",
    "__version__",
    "calibrate",
    "plan",
    "profile_model",
    "run",
    "simulate",
    "solve",
]

# Loaded on first use (it pulls scipy); profile_model and run import torch only when called.
_LAZY = {"solve": "stageplan.solver"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stageplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
