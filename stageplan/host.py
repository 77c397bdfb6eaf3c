"""Whether other work on this machine distorted a run's measured times: the check run, compare, tune and the
demo print (no torch)."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterable, Mapping
from typing import Any

# A CPU's worth of slack before a figure is called distorted: the 1-minute load average lags a run by tens of
# seconds (Linux's exponential decay, kernel/sched/loadavg.c), and a shell or an editor takes a few percent.
SLACK_CPUS = 0.25


def cpus_here() -> int:
    """The CPUs this process may run on (its affinity mask, as the ranks are placed), else the CPU count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def busy_cpu_s() -> float | None:
    """CPU seconds every process on the machine has spent since boot (user, nice, system, irq, softirq, steal
    from the first line of /proc/stat, in clock ticks: proc(5)); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = sum(int(fields[i]) for i in (1, 2, 3, 6, 7, 8) if i < len(fields))
    return ticks / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and its finished children (the ranks, once waited for)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class CpuWatch:
    """What other processes take of the CPUs from its creation to :meth:`result`."""

    def __init__(self) -> None:
        self._busy0, self._own0, self._t0 = busy_cpu_s(), _own_cpu_s(), time.monotonic()

    def result(self) -> dict[str, Any]:
        """``others_cpu_s``: the machine's CPU seconds since creation less this process's and its waited-for
        children's (None without /proc/stat); ``wall_s``; ``cpus`` (:func:`cpus_here`)."""
        busy1, own1 = busy_cpu_s(), _own_cpu_s()
        others = (None if self._busy0 is None or busy1 is None
                  else max(0.0, (busy1 - self._busy0) - (own1 - self._own0)))
        return {"others_cpu_s": others, "wall_s": time.monotonic() - self._t0, "cpus": cpus_here()}


def contention(*, num_ranks: int, cpus: int | None, load_average: float | None = None,
               others_cpu_s: float | None = None, wall_s: float | None = None,
               pinned: bool = False) -> str | None:
    """Why a run's measured times are distorted by other work on the machine, or None when they are not.

    The ranks run one thread each (``torch.set_num_threads(1)``), so they leave ``cpus - num_ranks`` CPUs
    free. Other work beyond that takes CPU time the ranks needed: when the 1-minute load average, less the
    ranks' own, or the other processes' CPU seconds per second of the run, exceed the free CPUs by more than
    :data:`SLACK_CPUS`.

    >>> contention(num_ranks=2, cpus=2, load_average=2.1) is None
    True
    >>> contention(num_ranks=2, cpus=2, load_average=3.3)[:62]
    'measured figures distorted: the load average was 3.30 on 2 CPU'
    """
    if not cpus:
        return None
    free = max(0, cpus - num_ranks)
    why = []
    if load_average is not None and load_average - num_ranks > free + SLACK_CPUS:
        why.append(f"the load average was {load_average:.2f} on {cpus} CPUs")
    if others_cpu_s is not None and wall_s and others_cpu_s / wall_s > free + SLACK_CPUS:
        why.append(f"other processes used {others_cpu_s / wall_s:.2f} CPUs during the run")
    if not why:
        return None
    remedy = ("another job shares the CPUs each rank is pinned to: rerun with --no-pin, or when the machine "
              "is quiet" if pinned else "rerun when the machine is quiet")
    return (f"measured figures distorted: {' and '.join(why)}, and the {num_ranks} ranks leave "
            f"{free} free; {remedy}")


def run_contention(meta: Mapping[str, Any], num_ranks: int) -> str | None:
    """:func:`contention` from a run report's ``meta`` (what the run recorded)."""
    placed = meta.get("cpus_per_rank")
    pinned = isinstance(placed, list) and any(placed)
    return contention(num_ranks=num_ranks, cpus=meta.get("cpus"), load_average=meta.get("load_average_1min"),
                      others_cpu_s=meta.get("others_cpu_s"), wall_s=meta.get("wall_s"),
                      pinned=pinned)


def first_contention(reports: Iterable[Any]) -> str | None:
    """The first of ``reports`` (RunReports) whose run was distorted: why (:func:`run_contention`)."""
    # every process of a run: each replica's and each shard's ranks too
    found = (run_contention(r.meta, len(r.ranks) + len(getattr(r, "replicas", ()))) for r in reports)
    return next((d for d in found if d), None)


def slower_explained(measured_speedup: float | None, predicted_speedup: float | None,
                     distorted: str | None) -> str | None:
    """A line explaining a measured speed-up below 1 against a predicted one above 1 (never printed bare)."""
    if measured_speedup is None or predicted_speedup is None:
        return None
    if not (measured_speedup < 1.0 < predicted_speedup):
        return None
    if distorted:
        return (f"the measured {measured_speedup:.3f}x reverses the predicted {predicted_speedup:.3f}x "
                f"because {distorted.removeprefix('measured figures distorted: ')}")
    return (f"the measured {measured_speedup:.3f}x reverses the predicted {predicted_speedup:.3f}x with the "
            "machine quiet: the profile's times do not describe this run; stageplan calibrate PROFILE RUN "
            "-o CALIBRATED and plan again, or compare --runs 3 to see the spread")
