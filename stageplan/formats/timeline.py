"""Timelines: the simulator's step (Simulation) and the events
of one (TimelineEvent), predicted or measured (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stageplan.formats.schedule import CALL_KINDS, TRANSFER_KINDS

if TYPE_CHECKING:
    import pandas


@dataclass(frozen=True)
class TimelineEvent:
    """One executed action: on ``rank``, ``kind`` of ``microbatch`` on ``stage`` from start_s to end_s.

    Kind "O" is the rank's optimizer step (over all its stages' parameters, once per step, after its last
    backward or W), kind "T" its part in the all-reduce of the tied parameters' gradients (before the
    optimizer step) and kind "D" the data-parallel replicas' sync it waits for (predicted: between the two;
    measured: where torch ran it, DDP's exposed all-reduce at the end of the last backward, FSDP2's
    reduce-scatter after it, ZeRO-1's broadcast inside the optimizer step): their ``stage`` is the rank's
    first stage (a measured DDP or FSDP2 sync, the stage it syncs) and their ``microbatch`` is -1 (they have
    none). Kinds "A" and "G" are a crossing's transfer, an activation (to the receiver's forward) or a
    gradient (to its backward) moving between ranks: ``rank``, ``stage`` and ``microbatch`` are the receiving
    action's, from when the message starts to move to when it arrives. It occupies the link, not the rank, so
    it is not busy time and a rank may compute meanwhile; a plan without a link or bandwidth has none."""

    rank: int
    stage: int
    microbatch: int
    kind: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Simulation:
    """One simulated training step: makespan, per-rank busy/idle time, bubble, in-flight peaks, timeline."""

    schedule: str
    num_ranks: int
    num_microbatches: int
    virtual_stages: int
    step_s: float
    busy_s: tuple[float, ...]
    idle_s: tuple[float, ...]
    bubble_fraction: float
    peak_inflight: tuple[int, ...]
    timeline: tuple[TimelineEvent, ...]
    # per rank, seconds its loop waits on receives: for each action fed across ranks, from the moment the rank
    # posts (GPipe, 1F1B) or reaches (the looped schedules) that receive to the action's start (the input's
    # arrival, and in torch's fused 1F1B batches the rank's own sends posted with it); part of its idle time
    receive_wait_s: tuple[float, ...] = ()

    def idle_before(self) -> tuple[tuple[TimelineEvent, float], ...]:
        """Each chunk call (:data:`CALL_KINDS`) with the seconds its rank computed nothing before it: since
        the rank's previous busy event ended (a call, its tied sum or optimizer step). A rank's first call of
        the step counts from where its previous step ended, as in a run of many steps: the step's length less
        the rank's last busy end, plus the call's start."""
        out = []
        for rank in range(self.num_ranks):
            busy = sorted((e for e in self.timeline if e.rank == rank and e.kind not in TRANSFER_KINDS),
                          key=lambda e: e.start_s)
            # the previous step's, on this step's clock
            last = max((e.end_s for e in busy), default=0.0) - self.step_s
            for e in busy:
                if e.kind in CALL_KINDS:
                    out.append((e, max(e.start_s - last, 0.0)))
                last = max(last, e.end_s)
        return tuple(out)

    def to_pandas(self) -> pandas.DataFrame:
        """One row per timeline event, columns rank, stage, microbatch, kind, start_s, end_s."""
        import pandas as pd

        columns = ["rank", "stage", "microbatch", "kind", "start_s", "end_s"]
        return pd.DataFrame(
            [(e.rank, e.stage, e.microbatch, e.kind, e.start_s, e.end_s) for e in self.timeline],
            columns=columns,
        )
