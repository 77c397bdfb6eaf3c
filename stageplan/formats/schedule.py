"""The schedule vocabulary a Plan and a RunReport record: torch's schedule names, torch's rules on
microbatches and stages per rank, and the kinds of timeline events (no torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from stageplan.errors import StageplanError

if TYPE_CHECKING:
    pass

# Canonical names are the keys of torch 2.13 `schedules.get_schedule_class`. ScheduleDualPipeV is not
# reproduced: its order fuses a forward and a backward into one OVERLAP_F_B action.
SCHEDULES: tuple[str, ...] = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
)

# Schedules built on torch's PipelineScheduleSingle: exactly one stage per rank.
SINGLE_STAGE = frozenset({"GPipe", "1F1B"})
# Schedules that split the backward into I (input gradient) and W (weight gradient) actions.
ZERO_BUBBLE = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble"})


def _key(name: str) -> str:
    key = name.strip().lower().replace("_", "").replace("-", "").replace(" ", "")
    return key.removeprefix("schedule") if key != "schedule" else key


_ALIASES: dict[str, str] = {_key(name): name for name in SCHEDULES}


def normalize_schedule(name: str) -> str:
    """Return the canonical torch name of a schedule, ignoring case, ``_``/``-`` and a ``Schedule`` prefix.

    >>> normalize_schedule("ScheduleInterleaved1F1B"), normalize_schedule("gpipe")
    ('Interleaved1F1B', 'GPipe')
    """
    if not isinstance(name, str):
        raise StageplanError(
            f"schedule must be a string, got {name!r} ({type(name).__name__}); use one of "
            f"{', '.join(SCHEDULES)}"
        )
    canonical = _ALIASES.get(_key(name))
    if canonical is None:
        raise StageplanError(
            f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)} "
            "(case-insensitive, torch class names such as 'Schedule1F1B' are accepted)"
        )
    return canonical


def check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise StageplanError(f"{name} must be an integer, got {value!r}; pass a whole number >= 1")
    if value < 1:
        raise StageplanError(f"{name} must be >= 1, got {value}; pass a whole number >= 1")
    return int(value)


def interleaved_rounds(num_ranks: int, num_microbatches: int) -> int:
    # torch 2.13 ScheduleInterleaved1F1B/ScheduleInterleavedZeroBubble.__init__:
    # number_of_rounds = max(1, n_microbatches // pp_group_size); n_microbatches % number_of_rounds == 0.
    return max(1, num_microbatches // num_ranks)


def _nearest_interleaved_microbatches(num_ranks: int, num_microbatches: int) -> tuple[int, int]:
    below = next(m for m in range(num_microbatches, 0, -1) if m % interleaved_rounds(num_ranks, m) == 0)
    above = next(
        m
        for m in range(num_microbatches, num_microbatches + num_ranks + 1)
        if m % interleaved_rounds(num_ranks, m) == 0
    )
    return below, above


def check_microbatches(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    """Raise StageplanError where torch 2.13 would refuse these numbers for this schedule.

    The rules, read in torch 2.13 ``distributed/pipelining/schedules.py`` and confirmed by building the
    schedules:

    - GPipe, 1F1B (PipelineScheduleSingle): one stage per rank, so ``virtual_stages == 1``;
    - 1F1B: ``num_microbatches >= num_ranks`` (Schedule1F1B.__init__ raises otherwise);
    - Interleaved1F1B, InterleavedZeroBubble: with ``rounds = max(1, m // p)``, ``m % rounds == 0``
      (so any m < 2p and any multiple of p work); any ``virtual_stages >= 1`` is accepted;
    - ZBVZeroBubble: exactly ``virtual_stages == 2``; any m >= 1;
    - LoopedBFS: any m, v >= 1.

    >>> check_microbatches("1F1B", 4, 8)
    >>> check_microbatches("1F1B", 4, 2)
    Traceback (most recent call last):
    ...
    stageplan.errors.StageplanError: 1F1B needs num_microbatches >= num_ranks...use at least 4 microbatches...
    """
    name = normalize_schedule(schedule)
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    v = check_count("virtual_stages", virtual_stages)
    if name in SINGLE_STAGE and v != 1:
        raise StageplanError(
            f"{name} runs one stage per rank, got virtual_stages={v}; "
            "use virtual_stages=1 (--virtual-stages 1), or Interleaved1F1B/LoopedBFS for several stages per "
            "rank"
        )
    if name == "1F1B" and m < p:
        raise StageplanError(
            f"1F1B needs num_microbatches >= num_ranks, got num_microbatches={m} < num_ranks={p} "
            f"(torch's Schedule1F1B refuses it); use at least {p} microbatches, or GPipe"
        )
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = interleaved_rounds(p, m)
        if m % rounds != 0:
            below, above = _nearest_interleaved_microbatches(p, m)
            raise StageplanError(
                f"{name} needs num_microbatches to be a multiple of its rounds max(1, m // p); "
                f"got num_microbatches={m}, num_ranks={p}, rounds={rounds} "
                f"(torch refuses it); use {below} or {above} microbatches (a multiple of {p} always works)"
            )
    if name == "ZBVZeroBubble" and v != 2:
        raise StageplanError(
            f"ZBVZeroBubble runs exactly 2 stages per rank (a V shape), got virtual_stages={v}; "
            "use virtual_stages=2"
        )


def stage_ranks(schedule: str, num_ranks: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Per stage (length ``num_ranks * virtual_stages``), the rank that runs it.

    Stage k runs on rank k % p (torch's "loop" style), except ZBVZeroBubble, which uses torch's "v"
    style: rank r holds stages r and 2p - 1 - r.

    >>> stage_ranks("Interleaved1F1B", 2, 2), stage_ranks("ZBVZeroBubble", 2, 2)
    ((0, 1, 0, 1), (0, 1, 1, 0))
    """
    name = normalize_schedule(schedule)
    p = check_count("num_ranks", num_ranks)
    v = check_count("virtual_stages", virtual_stages)
    if name == "ZBVZeroBubble":
        check_microbatches(name, p, 1, v)
    return placement_of(name, p, v)


def placement_of(name: str, p: int, v: int) -> tuple[int, ...]:
    if name == "ZBVZeroBubble":
        return tuple(k if k < p else 2 * p - 1 - k for k in range(2 * p))
    return tuple(k % p for k in range(p * v))


# ---------------------------------------------------------------------------------------------------
# Simulation.


TRANSFER_KINDS = ("A", "G")  # a crossing's transfer in a timeline: an activation, a gradient (TimelineEvent)
# a chunk call in a timeline: the rank computes (TimelineEvent; measure.Timer.BUSY_KINDS)
CALL_KINDS = ("F", "B", "I", "W")
# A chunk call "after idle": its rank computed nothing for at least this long (s) before it. A CPU core left
# idle for a few ms loses its caches and clock (one GPT block's forward ran at its back-to-back time after a
# 1 ms sleep and up to 1.6x slower after 20-80 ms; docs/accuracy.md); RunReport splits each rank's calls here.
RESUME_GAP_S = 1e-3
