"""The run table says where each rank ran: a report built from known measurements (no processes)."""

from __future__ import annotations

import dataclasses

import pytest
from test_calibrate import _profile, _report

from stageplan.planning.planner import plan
from stageplan.report import run_table


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


def test_calls_after_idle_against_back_to_back_by_hand() -> None:
    """Two steps of one rank's calls (kind, stage, microbatch, seconds, idle before), planned 2 ms a forward and 4 ms
    a backward. Step 1: F0 back to back 2.2 ms, F1 after 5 ms idle 3.0 ms, B0 back to back 4.4 ms, B1 after idle
    6.0 ms: both kinds have both sorts. After idle 9.0 / 6.0 = 1.5, back to back 6.6 / 6.0 = 1.1, beyond that pace
    (3.0 - 1.1 x 2) + (6.0 - 1.1 x 4) = 2.4 ms. Step 2: the last stage's F0 comes as two calls (forward 1.5 ms
    after 2 ms idle, its loss 0.5 ms back to back): one action after idle, 2.0 ms; F1 back to back 2.2 ms; both
    backwards back to back, so only the forwards compare: 2.0 / 2.0 = 1.0 against 1.1, beyond -0.2 ms. Medians
    over the two steps; after idle 2 and 1 a step."""
    from stageplan.formats.runreport import _idle_split

    planned = {("F", 0): 0.002, ("B", 0): 0.004}
    steps = [
        [("F", 0, 0, 0.0022, 0.0), ("F", 0, 1, 0.003, 0.005), ("B", 0, 0, 0.0044, 0.0002), ("B", 0, 1, 0.006, 0.02)],
        [("F", 0, 0, 0.0015, 0.002), ("F", 0, 0, 0.0005, 0.0), ("F", 0, 1, 0.0022, 0.0003),
         ("B", 0, 0, 0.0044, 0.0), ("B", 0, 1, 0.0044, 0.0009)],
    ]
    got = _idle_split(steps, planned)
    assert got["measured_after_idle_calls"] == pytest.approx(1.5)
    assert got["after_idle_ratio"] == pytest.approx((1.5 + 1.0) / 2)
    assert got["back_to_back_ratio"] == pytest.approx(1.1)
    assert got["after_idle_excess_s"] == pytest.approx((0.0024 - 0.0002) / 2)
    # GPipe's first rank: every backward after a wait, every forward back to back: nothing like against like
    unmatched = _idle_split([[("F", 0, 0, 0.002, 0.0), ("F", 0, 1, 0.002, 0.0), ("B", 0, 0, 0.006, 0.01)]], planned)
    assert unmatched == {"measured_after_idle_calls": 1, "after_idle_ratio": None, "back_to_back_ratio": None,
                         "after_idle_excess_s": None}
    assert _idle_split([], planned)["measured_after_idle_calls"] is None
