"""model -> Profile (torch): per-layer timing, saved
bytes, dedup of identical layers, streaming, estimates."""

from __future__ import annotations

from stageplan.profiling.profiler import profile_model

__all__ = ["profile_model"]
