"""Parse sizes and bandwidths given as text ("40GiB", "25GB/s"); SI inside the code (no torch)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

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


# a lowercase b is a bit whatever the prefix's case (25Gb/s, 25gb/s, 25Gbit/s, 25gbps); B a byte (25GB/s)
_BITS = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*((?i:[kmgt]i?)?)(?:b|bit|bits)\s*$")
_BIT_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
               "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_RATE_EXAMPLE = "25GB/s or 400MiB/s (bytes), 100Gb/s, 100Gbit/s or 100Gbps (bits), or 1e9 (bytes/s)"


def parse_bandwidth(text: str | float | int) -> float:
    """A rate in bytes/s. A plain number is bytes/s; B is a byte and b a bit, as links are sold: '25GB/s' ->
    2.5e10, '400Gb/s' (one InfiniBand NDR port), '400Gbit/s' and '400Gbps' -> 5e10.

    >>> parse_bandwidth("25GB/s"), parse_bandwidth("400Gb/s"), parse_bandwidth("100Gbps")
    (25000000000.0, 50000000000.0, 12500000000.0)
    """
    t = text.strip() if isinstance(text, str) else text
    if isinstance(t, str) and t.lower().endswith(("/s", "ps")):
        t = t[:-2]
    bits = _BITS.match(t) if isinstance(t, str) else None
    if bits:
        rate = float(bits.group(1)) * _BIT_PREFIX[bits.group(2).lower()] / 8
    else:
        try:
            rate = parse_bytes(t if t != "" else text, "bandwidth")
        except StageplanError:  # say it in bandwidth's words: the text as given, a rate as the example
            m = _RE.match(t) if isinstance(t, str) else None
            if m and m.group(2).lower() not in _UNITS:
                raise StageplanError(
                    f"cannot read the unit of bandwidth {text!r}; use {_RATE_EXAMPLE}"
                ) from None
            if isinstance(t, str) and not m:
                raise StageplanError(f"cannot read bandwidth {text!r}; use a number with a unit such as "
                                     f"{_RATE_EXAMPLE}") from None
            rate = -1.0  # read, and not positive
    if not (math.isfinite(rate) and rate > 0):
        raise StageplanError(f"bandwidth must be a positive rate, got {text!r}; use a number with a unit "
                             f"such as {_RATE_EXAMPLE}")
    if rate < MIN_BANDWIDTH:  # a unit slip: a link slower than a modem prices every crossing in hours
        raise StageplanError(f"bandwidth must be at least 1 kB/s, got {text!r} ({rate:g} bytes/s); use a "
                             f"number with a unit such as {_RATE_EXAMPLE}")
    return rate


MIN_BANDWIDTH = 1e3  # bytes/s: the least bandwidth a plan accepts from the user


_BINARY = (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10))


def _unit_for(value: float) -> tuple[str, float]:
    for unit, scale in _BINARY:
        if abs(value) >= scale:
            return unit, scale
    return "B", 1.0


def format_bytes(n: float) -> str:
    """Bytes for people: '1.50 GiB', '512 B'; infinity (no limit) reads 'unlimited'.

    >>> format_bytes(3 * 2**29), format_bytes(15), format_bytes(float("inf"))
    ('1.50 GiB', '15 B', 'unlimited')
    """
    if not math.isfinite(n):
        return "unlimited"
    unit, scale = _unit_for(n)
    return f"{n:g} B" if unit == "B" else f"{n / scale:.2f} {unit}"


def format_limits(limits: Iterable[float], what: str) -> str:
    """Memory limits in a message: one value when all agree, else a list in one shared unit.

    >>> format_limits([2.0, 3.0], "stage")
    'the per-stage memory limits [2, 3] B'
    """
    values = [float(x) for x in limits]
    if all(x == values[0] for x in values):
        return f"the memory limit of {format_bytes(values[0])} per {what}"
    finite = [x for x in values if math.isfinite(x)]
    unit, scale = _unit_for(max(finite) if finite else 1.0)
    parts = [("inf" if not math.isfinite(x) else (f"{x:g}" if unit == "B" else f"{x / scale:.2f}"))
             for x in values]
    return f"the per-{what} memory limits [{', '.join(parts)}] {unit}"
