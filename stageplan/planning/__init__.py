"""Profile -> Plan, no torch: the cost model, the exact solver, the split search and the step simulator."""

from __future__ import annotations

from stageplan.planning.costs import Device
from stageplan.planning.planner import plan
from stageplan.planning.schedules import simulate
from stageplan.planning.solver import solve

__all__ = ["Device", "plan", "simulate", "solve"]
