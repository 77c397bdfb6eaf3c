"""The records stageplan reads and writes, as frozen dataclasses with versioned JSON (no torch)."""

from __future__ import annotations

from stageplan.formats.plan import Plan
from stageplan.formats.profile import LayerProfile, Profile, merge_profiles
from stageplan.formats.runreport import RunReport

__all__ = ["LayerProfile", "Plan", "Profile", "RunReport", "merge_profiles"]
