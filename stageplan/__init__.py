"""stageplan: profile a model per layer, plan pipeline stages exactly, run and check the plan.

``import stageplan`` does not import torch: planning from a stored profile works without it.
The torch-backed names (``profile_model``, ``run``) are loaded on first use (PEP 562).
"""

from __future__ import annotations

from typing import Any

from stageplan.errors import InfeasiblePlanError, RunError, StageplanError
from stageplan.profile import LayerProfile, Profile
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

# Loaded on first use: the planning names pull numpy/scipy; profile_model and run pull torch.
_LAZY = {
    "profile_model": "stageplan.api",
    "plan": "stageplan.api",
    "run": "stageplan.api",
    "calibrate": "stageplan.api",
    "Plan": "stageplan.plan",
    "RunReport": "stageplan.runreport",
    "Device": "stageplan.costmodel",
    "simulate": "stageplan.schedules",
    "solve": "stageplan.solver",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stageplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
