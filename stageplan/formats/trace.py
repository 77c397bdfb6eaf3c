"""Chrome trace-event JSON of one step's timeline, predicted (a plan's simulation) or measured (a run), for
Perfetto (ui.perfetto.dev) and chrome://tracing (no torch).

The format is Google's "Trace Event Format"
(docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU): a ``traceEvents`` list of complete
events (``"ph": "X"``, start ``ts`` and duration ``dur`` in microseconds) on tracks named by metadata events
(``"ph": "M"``). Each rank gets a track of what it computes (forward, backward, input and weight gradients,
the optimizer step, the tied-gradient sync, the data-parallel replicas' sync) and a second track for the
transfers that arrive at it (activations and gradients move on the link, while the rank may compute)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from stageplan.formats.timeline import TimelineEvent

# A timeline event's kind, as the trace names it (TimelineEvent's kinds; the run and the simulator share them)
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient",
              "O": "optimizer step",
              "T": "tied-gradient sync", "D": "data-parallel sync", "A": "activation transfer",
              "G": "gradient transfer"}
_TRANSFERS = ("A", "G")
# Track ids: a rank's compute on tid = rank, the transfers arriving at it on tid = _LINK_TID + rank
_LINK_TID = 10_000


def chrome_trace(events: Iterable[TimelineEvent | Mapping[str, Any]], *, title: str,
                 meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The trace of ``events`` (a Simulation's TimelineEvents or a RunReport's timeline rows), one process
    named ``title``, a compute track and a transfer track per rank. ``meta`` goes into ``otherData``.

    >>> ev = TimelineEvent(rank=1, stage=1, microbatch=0, kind="F", start_s=0.002, end_s=0.005)
    >>> t = chrome_trace([ev], title="predicted")
    >>> [(e["name"], e["tid"], e["ts"], e["dur"]) for e in t["traceEvents"] if e["ph"] == "X"]
    [('forward mb0 stage1', 1, 2000.0, 3000.0)]
    """
    rows = [_row(e) for e in events]
    ranks = sorted({int(r["rank"]) for r in rows})
    out: list[dict[str, Any]] = [
        {"ph": "M", "pid": 0, "tid": 0, "name": "process_name", "args": {"name": title}}]
    for r in ranks:
        out.append({"ph": "M", "pid": 0, "tid": r, "name": "thread_name", "args": {"name": f"rank {r}"}})
        out.append(
            {"ph": "M", "pid": 0, "tid": r, "name": "thread_sort_index", "args": {"sort_index": 2 * r}})
        if any(x["kind"] in _TRANSFERS and x["rank"] == r for x in rows):
            out.append({"ph": "M", "pid": 0, "tid": _LINK_TID + r, "name": "thread_name",
                        "args": {"name": f"rank {r} receives"}})
            out.append({"ph": "M", "pid": 0, "tid": _LINK_TID + r, "name": "thread_sort_index",
                        "args": {"sort_index": 2 * r + 1}})
    for x in sorted(rows, key=lambda x: (x["start_s"], x["rank"])):
        kind = str(x["kind"])
        name = KIND_NAMES.get(kind, kind)
        if int(x["microbatch"]) >= 0:
            name += f" mb{int(x['microbatch'])} stage{int(x['stage'])}"
        out.append({"ph": "X", "pid": 0, "tid": (_LINK_TID if kind in _TRANSFERS else 0) + int(x["rank"]),
                    "name": name, "cat": KIND_NAMES.get(kind, kind), "ts": float(x["start_s"]) * 1e6,
                    "dur": max(0.0, float(x["end_s"]) - float(x["start_s"])) * 1e6,
                    "args": {"rank": int(x["rank"]), "stage": int(x["stage"]),
                             "microbatch": int(x["microbatch"]), "kind": kind}})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": dict(meta or {})}


def _row(event: TimelineEvent | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(event, TimelineEvent):
        return {"rank": event.rank, "stage": event.stage, "microbatch": event.microbatch, "kind": event.kind,
                "start_s": event.start_s, "end_s": event.end_s}
    return dict(event)
