"""stageplan.report: the run table names each rank's CPUs."""

from __future__ import annotations

import dataclasses

import pytest

from stageplan.planning.planner import plan
from stageplan.report import run_table

from .test_calibration import _profile, _report


@pytest.mark.parametrize(("placed", "line"), [
    ([[0, 1], [2, 3]], "CPUs per rank: rank 0 on 0,1; rank 1 on 2,3"),
    ([[0], None], "CPUs per rank: rank 0 on 0; rank 1 not pinned"),  # one rank could not set its affinity
    ([None, None], "CPUs per rank: not pinned (the OS places the ranks)"),
])
def test_run_table_names_each_ranks_cpus(placed: list, line: str) -> None:  # type: ignore[type-arg]
    pl = plan(_profile(), 2, num_microbatches=4, boundaries=[0, 2, 5], optimizer="none")
    report = dataclasses.replace(_report(pl), meta={"cpus_per_rank": placed})
    assert line in run_table(report).splitlines()


def test_a_report_from_before_pinning_prints_no_placement_line() -> None:
    pl = plan(_profile(), 2, num_microbatches=4, boundaries=[0, 2, 5], optimizer="none")
    assert "CPUs per rank" not in run_table(_report(pl))
