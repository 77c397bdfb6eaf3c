"""stageplan.formats.schedule: torch's schedule names, stage placement and rules on microbatches."""

from __future__ import annotations

import pytest

from stageplan.formats.schedule import SCHEDULES, check_microbatches, normalize_schedule, stage_ranks


def test_stage_placement_matches_torch() -> None:
    pytest.importorskip("torch")
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for p, v in [(2, 2), (4, 2), (3, 3)]:
        loop = generate_stage_to_rank_mapping(p, p * v, "loop")
        assert stage_ranks("Interleaved1F1B", p, v) == tuple(loop[k] for k in range(p * v))
    for p in (1, 2, 4):
        vee = generate_stage_to_rank_mapping(p, 2 * p, "v")
        assert stage_ranks("ZBVZeroBubble", p, 2) == tuple(vee[k] for k in range(2 * p))


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("GPipe", "GPipe"),
        ("gpipe", "GPipe"),
        ("ScheduleGPipe", "GPipe"),
        ("1f1b", "1F1B"),
        ("Schedule1F1B", "1F1B"),
        ("interleaved1f1b", "Interleaved1F1B"),
        ("ScheduleInterleaved1F1B", "Interleaved1F1B"),
        ("interleaved_1f1b", "Interleaved1F1B"),
        ("ScheduleLoopedBFS", "LoopedBFS"),
        ("ScheduleInterleavedZeroBubble", "InterleavedZeroBubble"),
        ("zbvzerobubble", "ZBVZeroBubble"),
    ],
)
def test_normalize_schedule(alias: str, canonical: str) -> None:
    assert normalize_schedule(alias) == canonical


def test_canonical_names_are_torch_names() -> None:
    pytest.importorskip("torch")
    from torch.distributed.pipelining.schedules import get_schedule_class

    for name in SCHEDULES:
        assert get_schedule_class(name).__name__ in (name, f"Schedule{name}")


def test_check_microbatches_accepts_what_torch_accepts() -> None:
    check_microbatches("GPipe", 8, 2)  # m < p runs under GPipe (a large bubble, not an error)
    check_microbatches("1F1B", 4, 4)
    check_microbatches("Interleaved1F1B", 4, 3, 2)  # rounds = 1 for any m < 2p
    check_microbatches("Interleaved1F1B", 4, 10, 2)  # rounds = 2 divides 10
    check_microbatches("Interleaved1F1B", 4, 8, 1)  # torch accepts one stage per rank
    check_microbatches("ZBVZeroBubble", 4, 1, 2)
    check_microbatches("LoopedBFS", 3, 5, 4)
