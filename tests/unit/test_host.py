"""stageplan.host: the busy-machine check that run, compare, tune and the demo print, from injected
load figures."""

from __future__ import annotations

import dataclasses
import time

import pytest

from stageplan.host import busy_cpu_s, contention, first_contention, run_contention, slower_explained
from stageplan.planning.planner import plan

from .test_calibration import _profile, _report


@pytest.mark.parametrize(("ranks", "cpus", "load", "others", "distorted"), [
    (2, 2, 2.1, None, False),   # the ranks alone: a load of about 2 on 2 CPUs
    (2, 2, 3.3, None, True),    # the trial's machine: 1.3 CPUs of other work with none free
    (2, 8, 3.3, None, False),   # 6 CPUs free hold the 1.3 others took
    (2, 8, 9.0, None, True),    # 7 others on 6 free
    (2, 4, None, 1.0, False),   # others used 1 CPU per second of 2 free
    (2, 4, None, 3.0, True),    # 3 of 2 free
    (2, 2, 2.2, 0.2, False),    # within the slack (a shell, an editor)
])
def test_contention_flags_other_work_beyond_what_the_ranks_leave_free(
        ranks: int, cpus: int, load: float | None, others: float | None, distorted: bool) -> None:
    why = contention(num_ranks=ranks, cpus=cpus, load_average=load,
                     others_cpu_s=None if others is None else others * 10.0, wall_s=10.0)
    assert (why is not None) == distorted
    if why is not None:
        assert why.startswith("measured figures distorted: ")
        assert f"the {ranks} ranks leave {cpus - ranks} free" in why


def test_pinned_ranks_are_pointed_at_no_pin() -> None:
    pinned = contention(num_ranks=2, cpus=2, load_average=3.3, pinned=True)
    loose = contention(num_ranks=2, cpus=2, load_average=3.3, pinned=False)
    assert pinned is not None and "--no-pin" in pinned and "load average was 3.30 on 2 CPUs" in pinned
    assert loose is not None and "--no-pin" not in loose and "rerun when the machine is quiet" in loose


def test_a_run_report_carries_what_the_check_reads_and_the_run_table_warns() -> None:
    pl = plan(_profile(), 2, num_microbatches=4, boundaries=[0, 2, 5], optimizer="none")
    busy = dataclasses.replace(_report(pl), meta={"load_average_1min": 3.3, "cpus": 2,
                                                  "cpus_per_rank": [[0], [1]], "others_cpu_s": 6.0,
                                                  "wall_s": 4.0})
    quiet = dataclasses.replace(_report(pl), meta={"load_average_1min": 1.9, "cpus": 2, "others_cpu_s": 0.1,
                                                   "wall_s": 4.0})
    why = run_contention(busy.meta, 2)
    assert why is not None and "other processes used 1.50 CPUs" in why and "--no-pin" in why
    assert run_contention(quiet.meta, 2) is None
    assert first_contention([quiet, busy]) == why
    from stageplan.report import run_table

    assert f"warning: {why}" in run_table(busy).splitlines()
    assert "warning:" not in run_table(quiet)


def test_a_measured_slow_down_against_a_predicted_speed_up_is_explained() -> None:
    distorted = contention(num_ranks=2, cpus=2, load_average=3.3)
    why = slower_explained(0.651, 1.127, distorted)
    assert why is not None and why.startswith("the measured 0.651x reverses the predicted 1.127x because the "
                                              "load average was 3.30")
    quiet = slower_explained(0.9, 1.1, None)
    assert quiet is not None and "calibrate" in quiet
    assert slower_explained(1.05, 1.127, distorted) is None  # no reversal: nothing to explain
    assert slower_explained(0.95, 0.98, None) is None


def test_the_machines_busy_time_counts_this_process() -> None:
    """/proc/stat's busy seconds rise by at least most of the CPU time this process spends (the oracle:
    time.process_time over the same spin)."""
    start = busy_cpu_s()
    if start is None:
        pytest.skip("no /proc/stat here")
    cpu0 = time.process_time()
    while time.process_time() - cpu0 < 0.3:
        pass
    spent = time.process_time() - cpu0
    end = busy_cpu_s()
    assert end is not None and end - start >= 0.5 * spent
