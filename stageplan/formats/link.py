"""LINK.json: a measured link between pipeline ranks (latency, bandwidth, the schedule's overheads, the
all-reduce), read and checked without torch; :mod:`stageplan.running.link` measures it."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from stageplan._io import check_schema, is_number, read_json, short_repr, write_json_atomic
from stageplan.errors import SchemaError, StageplanError

LINK_SCHEMA = "stageplan.link/1"


def crossing_s(link: Mapping[str, Any]) -> float:
    """Seconds one boundary crossing costs beyond its bytes: the fused exchange where the link measured it
    (the schedule's own way of crossing), else the one-way latency; never less than the latency.

    >>> crossing_s({"latency_s": 7e-5, "exchange_s": 3e-4}), crossing_s({"latency_s": 7e-5})
    (0.0003, 7e-05)
    """
    latency = float(link["latency_s"])
    exchange = link.get("exchange_s")
    return (
        max(latency, float(exchange))
        if isinstance(exchange, (int, float)) and math.isfinite(exchange)
        else latency
    )


# ------------------------------------------------------------------------------------------------------
# LINK.json (no torch)


def save_link(link: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``link`` as a versioned LINK.json, atomically."""
    write_json_atomic(path, {"schema": LINK_SCHEMA, **{k: v for k, v in link.items() if k != "schema"}})


def _seconds(value: Any) -> bool:
    return is_number(value) and value >= 0


def check_allreduce(fields: Mapping[str, Any], source: str, remedy: str, *, prefix: str = "") -> None:
    """Refuse (SchemaError, one line) the all-reduce's ring constants (``allreduce_latency_s``,
    ``allreduce_bandwidth_bytes_per_s``) unless both are absent (or null) or both numbers, the latency seconds
    >= 0 and the bandwidth bytes/s > 0, and the rank count they were timed at (``allreduce_ranks``), where
    given, an integer >= 2: wherever they are read (a LINK.json, a run report's link or plan, a calibrated
    profile, the cost model's options). ``prefix`` "dp_" checks the data-parallel group's own
    (``dp_allreduce_latency_s``, ...), and with it the sizes and times they were fitted to
    (``dp_allreduce_sizes``, ``dp_allreduce_s``): both absent, or lists of as many positive numbers."""
    lat_key, bw_key, ranks_key = (f"{prefix}allreduce_{k}" for k in ("latency_s", "bandwidth_bytes_per_s",
                                                                      "ranks"))
    latency: Any = fields.get(lat_key)
    bandwidth: Any = fields.get(bw_key)
    if (latency is None) != (bandwidth is None) or (latency is not None and not (
            _seconds(latency) and _seconds(bandwidth) and bandwidth > 0)):
        raise SchemaError(f"{source} has {lat_key} = {short_repr(latency)} and {bw_key} = "
                          f"{short_repr(bandwidth)}; both must be numbers (seconds >= 0 and bytes/s > 0), or "
                          f"both absent; {remedy}")
    ranks: Any = fields.get(ranks_key)
    if ranks is not None and (isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2):
        raise SchemaError(f"{source} has {ranks_key} = {short_repr(ranks)}; the all-reduce is timed over "
                          f"2 or more ranks, so it must be an integer >= 2, or absent; {remedy}")
    if not prefix:
        return
    sizes: Any = fields.get(f"{prefix}allreduce_sizes")
    times: Any = fields.get(f"{prefix}allreduce_s")
    if (sizes is None) != (times is None) or (sizes is not None and not (
            isinstance(sizes, list) and isinstance(times, list) and len(sizes) == len(times) > 0
            and all(is_number(n) and n > 0 for n in sizes) and all(_seconds(t) and t > 0 for t in times))):
        raise SchemaError(f"{source} has {prefix}allreduce_sizes = {short_repr(sizes)} and "
                          f"{prefix}allreduce_s = {short_repr(times)}; both must be lists of as many "
                          f"positive numbers (bytes, seconds), or both absent; {remedy}")


def load_link(link: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """A LINK.json (path) or its dict, checked: schema stageplan.link/1, a latency >= 0 seconds and a
    bandwidth > 0 bytes/s; ``exchange_s``, ``action_s`` (the schedule loop's seconds per chunk action),
    ``chunk_forward_s`` and ``chunk_backward_s`` (PipelineStage's seconds inside each chunk call), where
    present, seconds >= 0.

    >>> load_link({"schema": LINK_SCHEMA, "latency_s": 2e-5, "bandwidth_bytes_per_s": 1e9})[
    ...     "bandwidth_bytes_per_s"
    ... ]
    1000000000.0
    """
    if isinstance(link, Mapping):
        data, source = dict(link), "link"
    else:
        data, source = read_json(link, "link"), f"link file {str(link)!r}"
    check_schema(data, LINK_SCHEMA, source)
    missing = [k for k in ("latency_s", "bandwidth_bytes_per_s") if k not in data]
    if missing:
        raise SchemaError(f"{source} lacks {' and '.join(missing)}; measure it again with stageplan link")
    if not all(is_number(data[k], finite=False) for k in ("latency_s", "bandwidth_bytes_per_s")):
        raise SchemaError(f"{source} has latency_s = {short_repr(data['latency_s'])} and "
                          f"bandwidth_bytes_per_s = {short_repr(data['bandwidth_bytes_per_s'])}; both must "
                          "be numbers (seconds, bytes/s); measure it again with stageplan link")
    latency, bandwidth = float(data["latency_s"]), float(data["bandwidth_bytes_per_s"])
    if not (math.isfinite(latency) and latency >= 0 and math.isfinite(bandwidth) and bandwidth > 0):
        raise StageplanError(f"{source} needs latency_s >= 0 and bandwidth_bytes_per_s > 0, got {latency!r} "
                             f"and {bandwidth!r}; measure it again with stageplan link")
    for key in ("exchange_s", "action_s", "chunk_forward_s", "chunk_backward_s"):
        value = data.get(key)
        if value is not None and not _seconds(value):
            raise StageplanError(f"{source} has {key} = {value!r}; it must be seconds >= 0, or absent; "
                                 "measure it again with stageplan link")
    check_allreduce(data, source, "measure it again with stageplan link")
    # the data-parallel group's own all-reduce (stageplan link --data-parallel D); optional, so links measured
    # before it load as they are, with the same schema version
    check_allreduce(data, source, "measure it again with stageplan link --data-parallel D", prefix="dp_")
    check_dp_sync(data, source)
    if not isinstance(data.get("pairs", []), list) or not isinstance(data.get("backend", ""), str):
        raise SchemaError(f"{source} has pairs = {data.get('pairs')!r} and backend = "
                          f"{data.get('backend')!r}; pairs "
                          "must be a list and backend a name such as 'gloo'; measure it again with stageplan "
                          "link")
    return {**data, "latency_s": latency, "bandwidth_bytes_per_s": bandwidth}


# The sharding modes' own sync (stageplan.running.link.dp_sync_probe): the kinds it times
DP_SYNC_KINDS = ("ddp", "zero1_broadcast", "fsdp_reduce", "fsdp_gather")


def check_dp_sync(data: Mapping[str, Any], source: str) -> None:
    """Refuse (SchemaError, one line) the sharding modes' sync fits unless absent, or ``dp_sync_fit`` a
    mapping of known kinds to [fixed seconds >= 0, bytes/s > 0] with ``dp_sync_ranks`` an integer >= 2 and
    ``dp_sync_units`` an integer >= 1 beside it.

    >>> check_dp_sync({"dp_sync_fit": {"ddp": [1e-3, 0]}, "dp_sync_ranks": 2, "dp_sync_units": 4},
    ...               "link")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    stageplan.errors.SchemaError: link has dp_sync_fit = {'ddp': [0.001, 0]}; it must map ddp, ...
    """
    fits: Any = data.get("dp_sync_fit")
    if fits is None:
        return
    ranks, units = data.get("dp_sync_ranks"), data.get("dp_sync_units")

    def whole(x: Any, least: int) -> bool:
        return not isinstance(x, bool) and isinstance(x, int) and x >= least

    good = isinstance(fits, Mapping) and whole(ranks, 2) and whole(units, 1) and all(
        k in DP_SYNC_KINDS and isinstance(v, (list, tuple)) and len(v) == 2 and _seconds(v[0])
        and is_number(v[1]) and v[1] > 0 for k, v in fits.items())
    many = data.get("dp_sync_many_s")
    if good and many is not None and not (
            isinstance(many, Mapping) and whole(data.get("dp_sync_many_units"), 2)
            and whole(data.get("dp_sync_many_size"), 1)
            and all(k in DP_SYNC_KINDS[2:] and _seconds(v) for k, v in many.items())):
        raise SchemaError(f"{source} has dp_sync_many_s = {short_repr(many)}; it must map "
                          f"{DP_SYNC_KINDS[2]} or {DP_SYNC_KINDS[3]} to seconds >= 0, with "
                          "dp_sync_many_units an integer >= 2 and dp_sync_many_size bytes >= 1 beside it, or "
                          "be absent; measure it again with stageplan link --data-parallel D")
    if not good:
        raise SchemaError(f"{source} has dp_sync_fit = {short_repr(fits)}; it must map "
                          f"{', '.join(DP_SYNC_KINDS[:-1])} or {DP_SYNC_KINDS[-1]} to [fixed seconds >= 0, "
                          "bytes/s > 0] with dp_sync_ranks an integer >= 2 and dp_sync_units >= 1 beside it, "
                          "or be absent; measure it again with stageplan link --data-parallel D")


def ring_constants(fixed_s: float, bandwidth_bytes_per_s: float, ranks: int) -> tuple[float, float]:
    """An all-reduce timed as a + n / B over ``ranks`` as the ring model's constants
    (:func:`stageplan.planning.sharding.ring_time`): per-step latency a / (2(p - 1)) and per-link bandwidth
    B x 2(p - 1) / p, so that the ring gives back a + n / B at p ranks and scales it to another p.
    :func:`ring_fit` is its inverse.

    >>> ring_constants(1e-3, 1e9, 2), ring_fit(*ring_constants(1e-3, 1e9, 4), 4)
    ((0.0005, 1000000000.0), (0.001, 1000000000.0))
    """
    steps = 2.0 * (ranks - 1)
    return fixed_s / steps, bandwidth_bytes_per_s * steps / ranks


def ring_fit(latency_s: float, bandwidth_bytes_per_s: float, ranks: int) -> tuple[float, float]:
    """The all-reduce's a + n / B over ``ranks`` from the ring model's per-step latency and per-link bandwidth
    (the inverse of :func:`ring_constants`)."""
    steps = 2.0 * (ranks - 1)
    return latency_s * steps, bandwidth_bytes_per_s * ranks / steps
