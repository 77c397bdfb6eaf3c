"""Calibrate a profile from a run: each layer scaled to its time
inside the pipeline, the run's overheads kept (no torch)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from stageplan._io import is_number
from stageplan.errors import StageplanError
from stageplan.formats.profile import Profile
from stageplan.formats.runreport import RunReport
from stageplan.formats.schedule import normalize_schedule
from stageplan.planning.costs import (
    COLLECTIVE,
    OVERHEADS,
    CostOptions,
    Device,
    LayerArrays,
    evaluate,
    make_options,
    tied_sync_rank_time,
    tied_sync_time,
)
from stageplan.planning.planner import as_profile, estimate_label, rescaled_profile

# ------------------------------------------------------------------------------------------------------
# Running and calibrating


def calibrate(
    profile: Profile | str | os.PathLike[str], report: RunReport | str | os.PathLike[str]
) -> Profile:
    """Rescale each layer's forward and backward times to what the run measured of that layer inside the real
    schedule (the executor's per-layer clock), so the next plan starts from the run.

    A rank's time outside its layers (PipelineStage's receive, flatten, detach, send) is shared out over its
    layers in proportion to their measured time, so a rank's calibrated compute equals its measured compute. A
    report without per-layer figures (written before the clock existed), a run with recomputation and a
    zero-bubble run are calibrated per rank: every layer of a rank by that rank's measured / predicted
    compute. The result's ``meta["calibration"]`` says which, gives the factors, and keeps the raw (never
    calibrated) profile's digest through repeated calibrations. Where the run timed a priced tied-gradient
    sum, the all-reduce's constants are scaled to what it took on the rank that reached it last
    (``tied_sync_ratio``; :func:`_tied_sync_as_run`)."""
    prof = as_profile(profile)
    rep = report if isinstance(report, RunReport) else RunReport.load(report)
    names = rep.plan.get("layer_names")
    if (names is not None and list(names) != prof.names) or rep.plan["boundaries"][-1] != len(prof):
        raise StageplanError(
            "the run report was made from a plan over other layers than this profile's; "
            "calibrate the profile that the run's plan was made from"
        )
    label = estimate_label(prof.meta)
    if label:
        raise StageplanError(f"calibrate puts a run's measured times on the footing of a profile measured "
                             f"alike, and this profile is an analytic estimate ({label}); calibrate the "
                             "profile measured here that the run's plan was made from")
    planned = rep.plan.get("profile_meta") or {}
    for key in ("model", "device", "dtype", "factory_options"):  # same layer names, another model or footing
        if (
            key in planned
            and key in prof.meta
            and json.dumps(planned[key], sort_keys=True, default=str)
            != json.dumps(prof.meta[key], sort_keys=True, default=str)
        ):
            raise StageplanError(f"the run's plan was made from a profile with {key} = {planned[key]!r}, and "
                                 f"this profile has {key} = {prof.meta[key]!r}; calibrate the profile that "
                                 f"the run's plan was made from")
    for row in rep.ranks:
        pred, meas = row["predicted_compute_s"], row["measured_compute_s"]
        if not (pred > 0 and meas > 0 and math.isfinite(meas)):
            raise StageplanError(f"rank {row['rank']} has no usable measurement (predicted {pred}, measured "
                                 f"{meas}); rerun with more --steps")
    m = int(rep.plan["num_microbatches"])
    why_not = _why_not_per_layer(prof, rep)
    if why_not is None:
        fwd, bwd = _layer_factors(prof, rep, m)
        how: dict[str, Any] = {"per": "layer", "forward_factors": fwd, "backward_factors": bwd}
    else:
        fwd = bwd = _rank_factors(prof, rep)
        how = {"per": "rank", "why": why_not, "rank_factors": [row["measured_compute_s"]
                                                               / row["predicted_compute_s"]
                                                               for row
                                                               in sorted(rep.ranks, key=lambda r: r["rank"])]}
    out, stepped = _optimizer_as_run(prof.scaled(fwd, bwd), rep)
    arr, opts = _replay_options(out, rep)
    opts, collective = _tied_sync_as_run(arr, opts, rep)
    latency = _fit_boundary_latency(arr, opts, rep)
    meta = dict(out.meta)
    before = prof.meta.get("calibration") or {}
    link_latency = float((rep.link or {}).get("latency_s") or 0.0)
    meta["calibration"] = {**how, "boundary_latency_s": latency, "link_latency_s": link_latency,
                           **_run_overheads(rep), **collective, **stepped,
                           "from_profile_digest": prof.digest(),
                           # a profile calibrated before raw_profile_digest
                           # existed names only what it came from
                           "raw_profile_digest": before.get("raw_profile_digest",
                                                            before.get("from_profile_digest", prof.digest())),
                           "rounds": int(before.get("rounds", 0)) + 1, "run_plan": rep.plan}
    return Profile(out.layers, meta)


def _optimizer_as_run(prof: Profile, rep: RunReport) -> tuple[Profile, dict[str, Any]]:
    """The profile with the run's optimizer's per-layer step figures scaled, rank by rank, to what each rank's
    ``optimizer.step()`` took in the run, and what calibrate records of it.

    A rank steps all its layers in one call, so the run gives one figure per rank: each of its layers' figure
    above the step's fixed cost (the profile's ``floor_s``, which the rank pays once) is scaled by (measured -
    floor) / the sum of those figures, so the rank's priced step equals the measured one (on the profile's
    footing: times the rank's device speed). The profiler times each layer's step alone from a flushed cache,
    and inside a run the step reads off that in either direction (docs/accuracy.md), which is why the run's
    figure replaces it. Only the optimizer the run used is scaled (a plan of the calibrated profile with
    another optimizer prices the profiled figures). Nothing changes where the run used no optimizer, the
    profile did not measure it, or the report did not time the step apart: ``measured_optimizer_step_s``, else
    the rank's time after its schedule less its timed tied sum."""
    opt = str(rep.run_options.get("optimizer") or (rep.plan.get("cost_options") or {}).get("optimizer")
              or "sgd").lower()
    if opt == "none" or any(x.optimizer_s is None or not is_number(x.optimizer_s.get(opt))
                            for x in prof.layers):
        return prof, {}
    measured: dict[int, float] = {}
    for row in rep.ranks:
        took = row.get("measured_optimizer_step_s")
        if (
            took is None
            and row.get("measured_tied_sync_s") is not None
            and row.get("optimizer_s") is not None
        ):
            took = float(row["optimizer_s"]) - float(row["measured_tied_sync_s"])
        if took is None or not is_number(took) or float(took) < 0:
            return prof, {}
        measured[int(row["rank"])] = float(took)
    cost = rep.plan.get("cost_options") or {}
    speeds = [float(d.get("speed", 1.0)) for d in cost.get("devices") or []]
    # as planning.costs.optimizer_floor reads it
    floor = float(LayerArrays.of(prof).optimizer_floor_s.get(opt, 0.0))
    p = int(rep.plan["num_ranks"])
    mine: dict[int, list[int]] = {}
    for layer, r in enumerate(_layer_ranks(rep)):
        mine.setdefault(r, []).append(layer)
    raw = [float(x.optimizer_s[opt]) for x in prof.layers]  # type: ignore[index]
    new = list(raw)
    factors: dict[int, float] = {}
    for r, indices in mine.items():
        trained = [i for i in indices if raw[i] > 0]
        above = sum(max(raw[i] - floor, 0.0) for i in trained)
        if not trained or above <= 0:
            continue
        # the profile's footing, less the floor
        target = measured[r] * (speeds[r] if r < len(speeds) else 1.0) - floor
        factors[r] = max(target, 0.0) / above
        for i in trained:
            new[i] = floor + factors[r] * max(raw[i] - floor, 0.0)
    if not factors:
        return prof, {}
    stepped = tuple(dataclasses.replace(x, optimizer_s={**(x.optimizer_s or {}), opt: t}) for x,
                    t in zip(prof.layers, new))
    return Profile(stepped, dict(prof.meta)), {
        "optimizer": opt, "optimizer_factors": [factors.get(r) for r in range(p)],
        "optimizer_measured_s": [measured[r] for r in range(p)]}


def _layer_ranks(rep: RunReport) -> list[int]:
    """Per layer of the run's plan: the rank that ran it (its
    stage's; stage s on rank s mod p in older plans)."""
    bounds = rep.plan["boundaries"]
    p = int(rep.plan["num_ranks"])
    stage_rank = [int(r) for r in rep.plan.get("stage_ranks") or [s % p for s in range(len(bounds) - 1)]]
    return [stage_rank[s] for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]


def _rank_factors(prof: Profile, rep: RunReport) -> list[float]:
    """Per layer: the measured / predicted compute of the rank that ran it."""
    by_rank = {int(row["rank"]): row["measured_compute_s"] / row["predicted_compute_s"] for row in rep.ranks}
    return [by_rank[r] for r in _layer_ranks(rep)]


def _why_not_per_layer(prof: Profile, rep: RunReport) -> str | None:
    """Why a run cannot be calibrated per layer (then it is per rank), or None."""

    if len(rep.layers) != len(prof):
        return "the run report has no per-layer times (written before the per-layer clock)"
    if (rep.plan.get("cost_options") or {}).get("recompute"):
        return "under recomputation a chunk's whole forward runs again inside its last layer's backward"
    if normalize_schedule(str(rep.plan["schedule"])) in ("InterleavedZeroBubble", "ZBVZeroBubble"):
        return "a zero-bubble schedule computes weight gradients outside the layers' backward spans"
    return None


def _layer_factors(prof: Profile, rep: RunReport, m: int) -> tuple[list[float], list[float]]:
    """Per layer: measured / profiled forward and backward
    (per microbatch, the backward as a step of m blends it).

    The measured times are put on the profile's footing first: times the rank's device speed (the plan divided
    by it) and scaled to the profile's microbatch size when the plan rescaled it (``--microbatches auto``).
    Each rank's chunk overhead is shared over its layers by their measured time, and a rank's layers are then
    scaled together so that they add up to the rank's measured compute (the clock's steps against the measured
    steps' median). A layer the profile or the run put at zero keeps factor 1. Last, the chunk overhead that
    later plans price (:func:`_run_overheads`) is taken off each rank's layers in proportion, as they will add
    it back."""
    cost = rep.plan.get("cost_options") or {}
    speeds = [float(d.get("speed", 1.0)) for d in cost.get("devices") or []]
    mb_run, mb_prof = rep.run_options.get("microbatch_size"), prof.meta.get("microbatch_size")
    size = float(mb_prof) / float(mb_run) if mb_run and mb_prof else 1.0
    parts: dict[int, list[float]] = {}
    for x in rep.layers:
        t = parts.setdefault(int(x["rank"]), [0.0, 0.0])
        t[0] += x["measured_forward_s"]
        t[1] += x["measured_backward_s"]
    # per rank: what multiplies a layer's measured forward, backward
    scale: dict[int, tuple[float, float]] = {}
    for row in rep.ranks:
        r = int(row["rank"])
        tf, tb = parts.get(r, (0.0, 0.0))
        over_f, over_b = (
            row.get("measured_overhead_forward_s") or 0.0,
            row.get("measured_overhead_backward_s") or 0.0,
        )
        clocked = tf + tb + over_f + over_b
        footing = (row["measured_compute_s"] / clocked if clocked > 0 else 1.0) * size * (
            speeds[r] if r < len(speeds) else 1.0)
        scale[r] = ((1.0 + over_f / tf if tf > 0 else 1.0) * footing,
                    (1.0 + over_b / tb if tb > 0 else 1.0) * footing)
    # what later plans price per chunk (PipelineStage's overhead, :func:`_run_overheads`) comes off the rank's
    # layers again, in proportion, so that layers and priced overhead add up to the measured compute, not more
    over = _run_overheads(rep)
    chunks: dict[int, int] = {}
    for r in rep.plan.get("stage_ranks") or range(int(rep.plan["num_ranks"])):
        chunks[int(r)] = chunks.get(int(r), 0) + 1
    scaled: dict[int, list[float]] = {}
    for x in rep.layers:
        t = scaled.setdefault(int(x["rank"]), [0.0, 0.0])
        t[0] += x["measured_forward_s"] * scale[int(x["rank"])][0]
        t[1] += x["measured_backward_s"] * scale[int(x["rank"])][1]
    for r, (sf, sb) in scaled.items():
        # the sums are on the profile's footing: the priced seconds go there too
        on_footing = chunks.get(r, 0) * size * (speeds[r] if r < len(speeds) else 1.0)
        priced = over["chunk_forward_s"] * on_footing, over["chunk_backward_s"] * on_footing
        net = [max(1.0 - p / t, NET_OF_OVERHEAD_MIN) if t > 0 else 1.0 for p, t in zip(priced, (sf, sb))]
        scale[r] = (scale[r][0] * net[0], scale[r][1] * net[1])
    fwd, bwd = [1.0] * len(prof), [1.0] * len(prof)
    for x in rep.layers:
        i, r = int(x["index"]), int(x["rank"])
        f, b = x["measured_forward_s"] * scale[r][0], x["measured_backward_s"] * scale[r][1]
        pf, pb = prof.layers[i].forward_s, prof.layers[i].backward_per_microbatch_s(m)
        if pf > 0 and f > 0:
            fwd[i] = f / pf
        if pb > 0 and b > 0:
            bwd[i] = b / pb
    return fwd, bwd


# The least share of a rank's measured layer time that calibrate keeps when it takes the priced chunk overhead
# off (a link whose probe read more overhead than the run's chunks spent in all)
NET_OF_OVERHEAD_MIN = 0.05


def _run_overheads(rep: RunReport) -> dict[str, float]:
    """The schedule probe's seconds per chunk a run paid (:data:`OVERHEADS`): its plan's where the plan priced
    them (with a measured link), else what the run's own link probe timed. The calibrated layers, the latency
    fit and the calibrated profile's later plans use the same figures, so that neither counts them again."""
    planned = rep.plan.get("cost_options") or {}
    priced = any(planned.get(k) for k in OVERHEADS)
    return {k: float((planned.get(k) if priced else (rep.link or {}).get(k)) or 0.0) for k in OVERHEADS}


def _run_collective(rep: RunReport) -> dict[str, float | None]:
    """The all-reduce's constants (:data:`COLLECTIVE`) a run's tied sync was priced with: its plan's where the
    plan had them (from a measured link), else what the run's own link probe timed, else None (the
    point-to-point link)."""
    planned = rep.plan.get("cost_options") or {}
    source = planned if planned.get("allreduce_bandwidth_bytes_per_s") is not None else (rep.link or {})
    if source.get("allreduce_bandwidth_bytes_per_s") is None:
        return {k: None for k in COLLECTIVE}
    return {k: float(source[k]) for k in COLLECTIVE}


def _replay_options(profile: Profile, rep: RunReport) -> tuple[LayerArrays, CostOptions]:
    """The run's own conditions, to replay its plan on ``profile``: its optimizer (its step is in the measured
    step), the plan's cost options, the schedule probe's overheads and the all-reduce's constants it ran with
    (:func:`_run_overheads`, :func:`_run_collective`), at its microbatch size (a plan of --microbatches auto
    rescaled the profile to it)."""
    plan_json = rep.plan
    cost = plan_json.get("cost_options") or {}
    mb_plan, mb_prof = cost.get("microbatch_size"), profile.meta.get("microbatch_size")
    if mb_plan and mb_prof and int(mb_plan) != int(mb_prof):
        profile = rescaled_profile(profile, int(mb_plan) / int(mb_prof))
    arr = LayerArrays.of(profile, int(plan_json["num_microbatches"]))
    devices = [
        Device(float(d["speed"]), None, str(d.get("name", ""))) for d in cost.get("devices") or []
    ] or None
    over, collective = _run_overheads(rep), _run_collective(rep)
    opts = make_options(profile, int(plan_json["num_ranks"]),
                        num_microbatches=int(plan_json["num_microbatches"]),
                        schedule=plan_json["schedule"],
                        virtual_stages=int(plan_json.get("virtual_stages", 1)),
                        optimizer=str(rep.run_options.get("optimizer") or cost.get("optimizer") or "sgd"),
                        bandwidth_bytes_per_s=cost.get("bandwidth_bytes_per_s"), devices=devices,
                        recompute=bool(cost.get("recompute", False)), precision=cost.get("precision"),
                        link_latency_s=float(cost.get("link_latency_s") or 0.0), action_s=over["action_s"],
                        chunk_forward_s=over["chunk_forward_s"], chunk_backward_s=over["chunk_backward_s"],
                        allreduce_latency_s=collective["allreduce_latency_s"],
                        allreduce_bandwidth_bytes_per_s=collective["allreduce_bandwidth_bytes_per_s"])
    return arr, opts


def _tied_sync_as_run(
    arr: LayerArrays, opts: CostOptions, rep: RunReport
) -> tuple[CostOptions, dict[str, Any]]:
    """The run's options with the all-reduce's constants scaled to what its tied sum took, and what calibrate
    records of it. The rank that reaches the sum last waits for no one, so its ``measured_tied_sync_s`` (the
    least over the ranks; the others' add their wait for it) is the collective's own time; both constants are
    scaled by it over the price (the ring's time scales alike at every size). The price comes from the
    constants the run had, else from the point-to-point link its plan priced (its latency and bandwidth as the
    ring's). Nothing changes where the run's split kept every tie on one rank, where nothing priced the sum
    (no bandwidth, no probe) or where the report did not time it (written before it did)."""
    bounds = np.array([rep.plan["boundaries"]])
    base = opts
    if opts.allreduce_bandwidth_bytes_per_s is None and opts.bandwidth_bytes_per_s is not None:
        base = dataclasses.replace(opts, allreduce_latency_s=opts.link_latency_s,
                                   allreduce_bandwidth_bytes_per_s=opts.bandwidth_bytes_per_s)
    price = float(tied_sync_time(arr, bounds, base)[0])
    # the ranks that hold a spanning tie (a rank that holds none joins no sum)
    held = tied_sync_rank_time(arr, rep.plan["boundaries"], base) > 0
    times = [row.get("measured_tied_sync_s") for row in rep.ranks if held[int(row["rank"])]]
    timed = [float(x) for x in times if x is not None and is_number(x) and float(x) > 0]
    bandwidth = base.allreduce_bandwidth_bytes_per_s  # set wherever the price is above 0
    if not (price > 0 and bandwidth is not None and len(timed) == len(times)):
        return opts, {k: getattr(opts, k) for k in COLLECTIVE}
    last = min(timed)
    ratio = last / price
    scaled = dataclasses.replace(base, allreduce_latency_s=float(base.allreduce_latency_s or 0.0) * ratio,
                                 allreduce_bandwidth_bytes_per_s=bandwidth / ratio)
    return scaled, {**{k: getattr(scaled, k) for k in COLLECTIVE}, "tied_sync_ratio": ratio,
                    "tied_sync_measured_s": last}


def _fit_boundary_latency(arr: LayerArrays, opts: CostOptions, rep: RunReport) -> float:
    """The per-crossing delay that makes the simulated step of the run's plan (with calibrated layer times,
    under the run's options: :func:`_replay_options`) equal the measured step: what the ranks waited beyond
    compute (send/recv rendezvous, the optimizer step). Bisection: the simulated step does not decrease as the
    delay grows."""
    bounds = rep.plan["boundaries"]

    def step(latency: float) -> float:
        return evaluate(arr, bounds, dataclasses.replace(opts, boundary_latency_s=latency)).predicted_step_s

    target = rep.measured_step_s
    if not (math.isfinite(target) and target > step(0.0)):
        return 0.0
    lo, hi = 0.0, target
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < target else (lo, mid)
    return hi
