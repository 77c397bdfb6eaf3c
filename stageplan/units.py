"""Parse sizes and bandwidths given as text ("40GiB", "25GB/s"); SI inside the code (no torch)."""

from __future__ import annotations

import math
import re

from stageplan.errors import StageplanError

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | float | int, what: str = "memory limit") -> float:
    """'40GiB' -> 42949672960.0; '40GB' -> 4e10; a plain number is bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _RE.match(str(text))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise StageplanError(
                f"cannot read {what} {text!r}; use a number with a unit such as 40GiB, 40GB, 512MiB or 1e9"
            )
        value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value <= 0:
        raise StageplanError(f"{what} must be positive, got {text!r}; e.g. 40GiB")
    return value


def parse_bandwidth(text: str | float | int) -> float:
    """'25GB/s' -> 2.5e10 bytes/s; a plain number is bytes/s."""
    if isinstance(text, str):
        t = text.strip()
        if t.lower().endswith("/s"):
            t = t[:-2]
        return parse_bytes(t, "bandwidth") if t else parse_bytes(text, "bandwidth")
    return parse_bytes(text, "bandwidth")


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
