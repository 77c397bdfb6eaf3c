"""RunReport: what an executed plan measured, side by side with what it predicted (no torch)."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from stageplan._io import check_schema, is_number, malformed, read_json, short_repr, write_json_atomic
from stageplan.errors import SchemaError
from stageplan.formats.plan import check_cost_options
from stageplan.formats.schedule import CALL_KINDS, RESUME_GAP_S, TRANSFER_KINDS

if TYPE_CHECKING:
    import pandas as pd

    from stageplan.formats.plan import Plan
    from stageplan.formats.timeline import Simulation

RUN_SCHEMA = "stageplan.run/4"
# run/1 named the per-rank rows "stages"; they are "ranks" since run/2. run/2's memory_ratio was the process's
# whole peak over the plan's bytes (torch's own baseline included, and retiming left out); since run/3 it is
# the run's memory over its baseline (measured_run_memory_bytes), read after retiming. All three load; an
# older report's rows keep their own memory_ratio. run/4 adds data-parallel replicas: each row's mesh
# coordinates, its data-parallel sync and its memory by kind, and the other replicas' rows; an older report
# was one replica. A tensor-parallel run's rows add measured_tp_collectives and predicted_tp_collectives, and
# its other shards' rows go with the other replicas'; other reports have neither field.
_OLD_SCHEMAS = {"stageplan.run/1": {"stages": "ranks"}, "stageplan.run/2": {}, "stageplan.run/3": {}}


_LAYER_FIELDS = {"index": int, "name": str, "stage": int, "rank": int, "measured_forward_s": float,
                 "measured_backward_s": float}


def _checked_layers(rows: Any, source: str, num_layers: int | None = None,
                    ranks: set[int] | None = None) -> list[dict[str, Any]]:
    """The per-layer rows of a run report, each with its fields of the right kinds, its times seconds >= 0,
    each layer once, within the plan's layers and on one of the report's ranks (SchemaError otherwise)."""
    if not isinstance(rows, (list, tuple)):
        raise SchemaError(f"{source}: 'layers' must be a list of per-layer rows; rerun stageplan run")
    seen: set[int] = set()
    for i, row in enumerate(rows):
        bad = [k for k,
               kind in _LAYER_FIELDS.items() if not isinstance(row, dict) or isinstance(row.get(k), bool)
               or not isinstance(row.get(k), (int, float) if kind is float else kind)]
        if bad:
            raise SchemaError(f"{source}: layer row {i} lacks or mangles {', '.join(bad)}; every row needs "
                              f"{', '.join(_LAYER_FIELDS)}; rerun stageplan run")
        times = [row[k] for k in ("measured_forward_s", "measured_backward_s")]
        if not all(math.isfinite(t) and t >= 0 for t in times):
            raise SchemaError(f"{source}: layer row {i} has forward and backward {times}; they must be "
                              "seconds >= 0; rerun stageplan run")
        for key in ("retimed_forward_s", "retimed_backward_s"):
            # the layer timed alone after the run, or null
            if row.get(key) is not None and not (is_number(row[key]) and row[key] >= 0):
                raise SchemaError(f"{source}: layer row {i} has {key} {short_repr(row[key])}; it must be "
                                  "seconds >= 0 or null; rerun stageplan run")
        index = row["index"]
        if index in seen or index < 0 or (num_layers is not None and index >= num_layers):
            raise SchemaError(f"{source}: layer row {i} has index {index}, "
                              + ("listed twice" if index in seen
                                 else f"outside the plan's layers 0..{num_layers - 1}"
                                 if num_layers is not None else "below 0")
                              + "; each layer has one row; rerun stageplan run")
        seen.add(index)
        if ranks is not None and row["rank"] not in ranks:
            raise SchemaError(f"{source}: layer row {i} ran on rank {row['rank']}, and the report's ranks "
                              f"are {sorted(ranks)}; rerun stageplan run")
    return list(rows)


def _retimed_compute(plan: Plan, rank: int, retimed: dict[int, tuple[float, float]]) -> float | None:
    """Seconds per microbatch of the rank's chunks as the cost model adds them up (its layers' forward and
    mean backward, the forward again under recomputation, PipelineStage's own code), with each layer's times
    from ``retimed`` (forward, mean backward per microbatch) instead of the profile's; None where a layer of
    the rank's lacks one (a run from before it was measured)."""
    total = 0.0
    for st in plan.stages:
        if st.rank != rank:
            continue
        if any(k not in retimed for k in range(st.first_layer, st.end_layer)):
            return None
        f = sum(retimed[k][0] for k in range(st.first_layer, st.end_layer))
        b = sum(retimed[k][1] for k in range(st.first_layer, st.end_layer))
        total += f * (2.0 if plan.cost_options.get("recompute") else 1.0) + b + st.chunk_s
    return total


def _ints(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool)
                                                    for x in value)


# what show and calibrate read from each rank row: numbers, and these may be None (nothing to compare)
_RANK_NUMBERS = ("predicted_compute_s", "measured_compute_s", "predicted_idle_s", "measured_idle_s",
                 "predicted_peak_activation_bytes", "measured_peak_activation_bytes")
_RANK_OPTIONAL = ("compute_ratio", "activation_ratio", "measured_compute_cpu_s", "predicted_dp_sync_s",
                  "measured_dp_sync_s",
                  "measured_overhead_forward_s",
                  "measured_overhead_backward_s", "measured_clock_compute_s", "predicted_tied_sync_s",
                  "measured_tied_sync_s", "predicted_optimizer_step_s", "measured_optimizer_step_s",
                  "predicted_receive_wait_s", "measured_receive_wait_s", "retimed_compute_s", "machine_ratio",
                  "pipeline_ratio", "predicted_after_idle_calls", "measured_after_idle_calls",
                  "after_idle_ratio", "back_to_back_ratio", "after_idle_excess_s")


def _predicted_idle_calls(sim: Simulation) -> list[int]:
    """Per rank, its chunk calls the simulation starts after
    :data:`RESUME_GAP_S` or more without computing."""
    counts = [0] * sim.num_ranks
    for event, idle in sim.idle_before():
        counts[event.rank] += idle >= RESUME_GAP_S
    return counts


def _idle_split(calls: list[list[Any]], planned: dict[tuple[str, int], float]) -> dict[str, float | None]:
    """One rank's chunk calls over its measured steps (per step: (kind, stage, microbatch, seconds, idle
    seconds before)), in two: after idle (RESUME_GAP_S or more) and back to back. The calls of one action (the
    last stage's forward and its loss) count as one, idle as its first call was. Actions after idle a step
    (the mean). Then only like against like: within a step, each (kind, stage) that has actions of both sorts
    gives its after-idle ones' measured seconds, the back-to-back ones' measured / planned ratio (``planned``:
    the simulator's seconds per (kind, stage) action) and what the after-idle ones took beyond that ratio; per
    step summed over those, and the medians over steps with any (None where none has): a backward that always
    follows a wait is not compared with forwards run back to back, and a step the host slowed does not move a
    median."""
    counts, after_ratios, back_ratios, excess = [], [], [], []
    for step in calls:
        # (kind, stage, microbatch) -> [idle before, seconds]
        actions: dict[tuple[str, int, int], list[float]] = {}
        for kind, stage, mb, sec, idle in step:
            actions.setdefault((kind, stage, mb), [idle, 0.0])[1] += sec
        # (kind, stage) -> after idle? -> [measured, planned]
        groups: dict[tuple[str, int], dict[bool, list[float]]] = {}
        for (kind, stage, _), (idle, sec) in actions.items():
            row = groups.setdefault((kind, stage), {True: [0.0, 0.0], False: [0.0, 0.0]})[
                idle >= RESUME_GAP_S
            ]
            row[0] += sec
            row[1] += planned.get((kind, stage), 0.0)
        counts.append(sum(idle >= RESUME_GAP_S for idle, _ in actions.values()))
        matched = [(g[True], g[False]) for g in groups.values() if g[True][1] > 0 and g[False][1] > 0]
        if matched:
            after_ratios.append(sum(a[0] for a, _ in matched) / sum(a[1] for a, _ in matched))
            back_ratios.append(sum(b[0] for _, b in matched) / sum(b[1] for _, b in matched))
            excess.append(sum(a[0] - b[0] / b[1] * a[1] for a, b in matched))
    return {
        "measured_after_idle_calls": statistics.mean(counts) if counts else None,
        "after_idle_ratio": statistics.median(after_ratios) if after_ratios else None,
        "back_to_back_ratio": statistics.median(back_ratios) if back_ratios else None,
        "after_idle_excess_s": statistics.median(excess) if excess else None,
    }


def _check_report(data: dict[str, Any], source: str) -> None:
    """Refuse (SchemaError, one line naming the field and value) a run report whose parts show and calibrate
    read are missing or of the wrong kind: the step figures, the plan's split, the per-rank rows, the link,
    the options."""
    def bad(what: str, value: Any) -> SchemaError:
        return SchemaError(
            f"{source}: {what}, got {short_repr(value)}; rerun stageplan run to write it again")

    for key in ("measured_step_s", "predicted_step_s", "measured_step_iqr_s", "samples_per_s"):
        if not (is_number(data.get(key)) and data[key] >= 0):
            raise bad(f"{key} must be seconds (or samples/s) >= 0", data.get(key))
    for key in ("measured_bubble_fraction", "predicted_bubble_fraction"):
        if not is_number(data.get(key), finite=False):
            raise bad(f"{key} must be a number", data.get(key))
    plan = data.get("plan")
    _, p = _check_executed_plan(plan, bad)
    _check_rank_rows(data.get("ranks"), p, bad)
    _check_run_parts(data, plan, bad, source)


def _check_executed_plan(plan: Any, bad: Callable[[str, Any], SchemaError]) -> tuple[list[int], int]:
    """The run report's plan: its split, ranks, microbatches,
    schedule and options; returns the split and p."""
    if not isinstance(plan, dict):
        raise bad("'plan' must be the executed plan's object", plan)
    bounds: Any = plan.get("boundaries")
    p: Any = plan.get("num_ranks")
    if not (_ints(bounds) and len(bounds) >= 2 and bounds[0] == 0
            and all(a < b for a, b in zip(bounds, bounds[1:]))):
        raise bad("the plan's boundaries must be increasing cut points from 0", bounds)
    if not (_ints([p]) and p >= 1) or not (_ints([plan.get("num_microbatches")])
                                           and plan["num_microbatches"] >= 1):
        raise bad("the plan's num_ranks and num_microbatches must be integers >= 1",
                  (p, plan.get("num_microbatches")))
    if not isinstance(plan.get("schedule"), str):
        raise bad("the plan's schedule must be a name such as '1F1B'", plan.get("schedule"))
    if not (_ints([plan.get("virtual_stages", 1)]) and plan.get("virtual_stages", 1) >= 1):
        raise bad("the plan's virtual_stages must be an integer >= 1", plan.get("virtual_stages"))
    stage_ranks = plan.get("stage_ranks")
    if stage_ranks is not None and not (_ints(stage_ranks) and len(stage_ranks) == len(bounds) - 1
                                        and all(0 <= r < p for r in stage_ranks)):
        raise bad(f"the plan's stage_ranks must give a rank 0..{p - 1} for each of its {len(bounds) - 1} "
                  f"stages",
                  stage_ranks)
    names = plan.get("layer_names")
    if names is not None and not (isinstance(names, list) and len(names) == bounds[-1]
                                  and all(isinstance(n, str) for n in names)):
        raise bad(f"the plan's layer_names must name its {bounds[-1]} layers", names)
    for key in ("cost_options", "profile_meta"):
        if plan.get(key) is not None and not isinstance(plan[key], dict):
            raise bad(f"the plan's {key} must be an object", plan[key])
    if plan.get("cost_options") is not None:
        check_cost_options(plan["cost_options"], lambda what, value: bad(f"the plan's {what}", value))
    return bounds, p


def _check_rank_rows(rows: Any, p: int, bad: Callable[[str, Any], SchemaError]) -> None:
    """One row per rank, ranks 0..p-1 each once, with their stages and figures."""
    if not isinstance(rows, (list, tuple)) or len(rows) != p:
        raise bad(f"'ranks' must hold one row for each of the plan's {p} ranks", rows)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise bad(f"rank row {i} must be an object", row)
    got = [row.get("rank") for row in rows]
    if not (_ints(got) and sorted(got) == list(range(p))):
        raise bad(f"the rank rows must be ranks 0..{p - 1}, each once", got)
    for i, row in enumerate(rows):
        if not _ints(row.get("stages")):
            raise bad(f"rank row {i}'s stages must be a list of stage indices", row.get("stages"))
        for key in _RANK_NUMBERS:
            if not is_number(row.get(key)):
                raise bad(f"rank row {i}'s {key} must be a finite number", row.get(key))
        for key in _RANK_OPTIONAL:
            if row.get(key) is not None and not is_number(row[key], finite=False):
                raise bad(f"rank row {i}'s {key} must be a number or null", row[key])


def _check_run_parts(data: dict[str, Any], plan: Any, bad: Callable[[str, Any], SchemaError],
                     source: str) -> None:
    """The rest a reader reads: the link, the timeline, the options and meta, and the check's verdict."""
    link = data.get("link")
    if link is not None and not (isinstance(link, dict) and all(
            is_number(link[k]) for k in ("latency_s", "bandwidth_bytes_per_s", "exchange_s")
            if link.get(k) is not None)):
        raise bad("'link' must be the run's link probe (latency_s, bandwidth_bytes_per_s as numbers) or null",
                  link)
    from stageplan.formats.link import check_allreduce

    for part, fields_ in (("its link", link), ("its plan's cost_options", plan.get("cost_options"))):
        if isinstance(fields_, dict):
            check_allreduce(fields_, f"{source}: {part}", "rerun stageplan run to write it again")

    def call_ok(e: Any) -> bool:
        return (isinstance(e, dict) and _ints([e.get("rank"), e.get("stage")])
                and isinstance(e.get("kind"), str)
                and is_number(e.get("start_s")) and is_number(e.get("end_s")))

    timeline = data.get("timeline", [])
    odd = [timeline] if not isinstance(timeline, list) else [e for e in timeline if not call_ok(e)]
    if odd:
        raise bad("'timeline' must be a list of calls (rank, stage, kind, start_s, end_s)", odd[0])
    for key in ("run_options", "meta"):
        if not isinstance(data.get(key, {}), dict):
            raise bad(f"'{key}' must be an object", data.get(key))
    mb = (data.get("run_options") or {}).get("microbatch_size")
    if mb is not None and not (_ints([mb]) and mb >= 1):
        raise bad("run_options' microbatch_size must be an integer >= 1 or null", mb)
    load = data.get("meta", {}).get("load_average_1min")
    if load is not None and not is_number(load):
        raise bad("meta's load_average_1min must be a number or null", load)
    check = data.get("check")
    if check is not None:
        if not (isinstance(check, dict) and isinstance(check.get("passed"), bool)):
            raise bad("'check' must be the --check verdict (an object with passed true/false) or null", check)
        for key in ("max_loss_diff", "max_param_diff", "max_grad_diff"):  # a diverged run's NaN: null
            if check.get(key) is not None and not is_number(check[key], finite=False):
                raise bad(f"check's {key} must be a number or null", check[key])
        if not (_ints([check.get("params_compared")]) and check["params_compared"] >= 0):
            raise bad("check's params_compared must be an integer >= 0", check.get("params_compared"))
        if check.get("grads_compared") is not None and not (_ints([check["grads_compared"]])
                                                             and check["grads_compared"] >= 0):
            raise bad("check's grads_compared must be an integer >= 0", check["grads_compared"])
        for key in ("worst_param", "worst_grad", "hint"):
            if check.get(key) is not None and not isinstance(check[key], str):
                raise bad(f"check's {key} must be text or null", check[key])


def _transfer_starts(events: list[dict[str, Any]]) -> list[float]:
    """Each event's start (wall seconds): a compute event's own; a receive's wait ("A", "G") becomes the
    crossing as the simulator draws it, from when the message could start to move, the later of its post and
    the end of the chunk call that produced it (the forward of the stage before, or the backward of the stage
    after, on the sending rank: torch posts the send right after it), to the wait's end. The ranks' wall
    clocks are one clock on one host; across hosts, a start past the wait's end is clamped to it."""
    ends = {(e["kind"], e["stage"], e["microbatch"]): e["start_wall"] + e["duration_s"] for e in events
            if e["kind"] in ("F", "B")}
    starts = []
    for e in events:
        if e["kind"] not in TRANSFER_KINDS or "post_wall" not in e:
            starts.append(e["start_wall"])
            continue
        producer = ("F", e["stage"] - 1, e["microbatch"]) if e["kind"] == "A" else ("B", e["stage"] + 1,
                                                                                    e["microbatch"])
        moves = max(e["post_wall"], ends.get(producer, e["post_wall"]))
        starts.append(min(moves, e["start_wall"] + e["duration_s"]))
    return starts


def _layer_rows(
    plan: Plan, g: dict[str, Any], retimed: dict[int, tuple[float, float]]
) -> list[dict[str, Any]]:
    """One row per layer rank ``g`` ran: its seconds per microbatch inside the schedule, and alone after the
    run (``retimed``: forward, mean backward per microbatch; None where it was not retimed)."""
    rows = []
    for layer, (lf, lb) in sorted((int(k), v) for k, v in (g.get("layer_s") or {}).items()):
        stage = next(s for s in range(plan.num_chunks)
                     if plan.boundaries[s] <= layer < plan.boundaries[s + 1])
        rows.append({"index": layer, "name": plan.layer_names[layer], "stage": stage, "rank": g["rank"],
                     "measured_forward_s": lf, "measured_backward_s": lb,
                     "retimed_forward_s": retimed[layer][0] if layer in retimed else None,
                     "retimed_backward_s": retimed[layer][1] if layer in retimed else None})
    return rows


def _rank_row(plan: Plan, g: dict[str, Any], retimed: dict[int, tuple[float, float]], *, step_s: float,
              predicted_wait_s: float, predicted_idle_calls: int,
              planned: dict[tuple[str, int], float]) -> dict[str, Any]:
    """Rank ``g``'s row: the plan's prediction beside the
    run's medians, per microbatch (compute) or per step."""
    m = plan.num_microbatches
    r = g["rank"]
    retimed_compute = _retimed_compute(plan, r, retimed)
    overhead = g.get("overhead_s") or {}
    pf = sum(st.forward_s for st in plan.stages if st.rank == r)
    pb = sum(st.backward_s for st in plan.stages if st.rank == r)
    f, b, other = g["forward_s"], g["backward_s"], g["other_s"]
    peak = g["peak_activation_bytes"]
    predicted_peak = plan.rank_peak_activation_bytes[r]
    baseline = g.get("baseline_memory_bytes")
    run_bytes = (max(g["peak_memory_bytes"] - baseline, 0) if g.get("peak_memory_bytes") is not None
                 and baseline is not None else None)
    return {
        "rank": r, "stages": g["stages"],
        "predicted_forward_s": pf, "predicted_backward_s": pb, "predicted_compute_s": pf + pb,
        "measured_forward_s": f / m, "measured_backward_s": b / m, "measured_compute_s": (f + b) / m,
        "measured_compute_iqr_s": (g["forward_iqr_s"] + g["backward_iqr_s"]) / m,
        # thread CPU time of the same spans: wall minus CPU is time the rank was preempted by other processes
        "measured_compute_cpu_s": g["compute_cpu_s"] / m,
        # the chunks' time outside their layers (PipelineStage's
        # receive, flatten, detach, send), per microbatch
        "measured_overhead_forward_s": sum(v[0] for v in overhead.values()),
        "measured_overhead_backward_s": sum(v[1] for v in overhead.values()),
        # the same compute over the clock's own steps (hooks on), which its layers and overhead make up
        "measured_clock_compute_s": g["clock_compute_s"] / m if g.get("clock_compute_s") is not None
        else None, "compute_ratio": ((f + b) / m) / (pf + pb) if pf + pb > 0 else None,
        # the rank's compute per microbatch as the plan adds it up, from its layers timed alone in the rank's
        # process after the run: compute_ratio = machine_ratio x pipeline_ratio, the machine's speed now
        # against the profile's, and the pipeline's own effect (inside the schedule against alone, now)
        "retimed_compute_s": retimed_compute,
        "machine_ratio": retimed_compute / (pf + pb) if retimed_compute and pf + pb > 0 else None,
        "pipeline_ratio": ((f + b) / m) / retimed_compute if retimed_compute else None,
        "measured_idle_s": max(step_s - (f + b) - other, 0.0), "optimizer_s": other,
        # of it, the tied gradients' sum: the all-reduce, and a rank's wait in it for the last rank to arrive
        "predicted_tied_sync_s": sum(st.tied_sync_s for st in plan.stages if st.rank == r),
        "measured_tied_sync_s": g.get("tied_sync_s"),
        # and the optimizer's step() alone, after the sum (the plan's: the rank's layers' figures)
        "predicted_optimizer_step_s": sum(st.optimizer_s for st in plan.stages if st.rank == r),
        "measured_optimizer_step_s": g.get("optimizer_step_s"),
        # the loop's waits on its receives (activations and gradients from other ranks), per step: the
        # simulator's from each post to the input's arrival, the run's timed around torch's wait
        "predicted_receive_wait_s": predicted_wait_s,
        "measured_receive_wait_s": g.get("receive_wait_s"),
        # the step less the rank's chunk calls and its tied sum and optimizer step, as measured_idle_s counts
        # it: waits for messages and torch's loop between the calls
        "predicted_idle_s": plan.predicted_step_s - m * (pf + pb)
        - sum(st.optimizer_s + st.tied_sync_s for st in plan.stages if st.rank == r),
        # the chunk calls after idle (RESUME_GAP_S or more without computing) against those back to back:
        # how many a step; where a (kind, stage) has both, each sort's measured / planned seconds and what the
        # first took beyond the pace of the second (seconds a step)
        "predicted_after_idle_calls": predicted_idle_calls,
        **_idle_split(g.get("calls") or [], planned),
        "predicted_peak_activation_bytes": predicted_peak,
        "measured_peak_activation_bytes": peak,
        # under recomputation torch.utils.checkpoint keeps the stage inputs out of the saved-tensor hooks and
        # recomputes inside the backward, so the hooks see only part of what the plan counts: no ratio
        "activation_ratio": (peak / predicted_peak if predicted_peak
                             and not plan.cost_options.get("recompute") else None),
        "predicted_memory_bytes": plan.rank_memory_bytes[r],
        # the process's peak (CPU: resident set; CUDA: max allocated), read after everything the rank did
        # (retiming included), and its memory before it built its stage (torch's libraries, the process
        # group, the meta model and its cut at the plan's boundaries: a few hundred MiB per CPU process, which
        # the plan does not count); the ratio compares what the run added on top of that with the plan
        "measured_peak_memory_bytes": g.get("peak_memory_bytes"),
        "measured_baseline_memory_bytes": baseline,
        "measured_run_memory_bytes": run_bytes,
        "memory_ratio": (run_bytes / plan.rank_memory_bytes[r]
                         if run_bytes and plan.rank_memory_bytes[r] else None),
        # CPU: how often the rank handed its heap's free pages back after a chunk call of 0.1 s or more
        # (stageplan.measure.HeapTrim); None in a report made before it
        "heap_trims": g.get("heap_trims"),
        # where the rank sits in the ("pp", "dp") mesh, its global rank, the data-parallel sync it waited for
        # (the plan's exposed sync beside the run's, per step) and its memory by kind (the plan's bytes
        # beside what the rank held: parameters, gradients, the FSDP shard or master copy, optimizer states)
        "mesh": g.get("mesh", {"pp": r, "dp": 0}),
        "global_rank": g.get("global_rank", r),
        "predicted_dp_sync_s": sum(st.dp_sync_s for st in plan.stages if st.rank == r),
        "measured_dp_sync_s": g.get("dp_sync_s"),
        "predicted_memory_by_kind": {
            k: sum(float(st.memory.get(k, 0.0)) for st in plan.stages if st.rank == r)
            for k in ("params", "grads", "master", "optimizer", "activations")},
        "measured_memory_by_kind": g.get("memory_by_kind"),
        # with tensor-parallel shards: the all-reduces the rank's chunk calls issued in one step, forward and
        # backward (counted in its last warm-up step), beside the plan's count of them (the cost model's
        # closed form, planning.sharding.tensor_parallel_collectives; None in a plan made before it)
        **_tp_counts(plan, g, r),
    }


def _tp_counts(plan: Plan, g: dict[str, Any], r: int) -> dict[str, Any]:
    """The rank row's tensor-parallel all-reduce counts, measured and predicted ({"forward": n, "backward":
    n} each); nothing without tensor-parallel shards, so rows of other runs keep their fields."""
    if int(plan.profile_meta.get("tensor_parallel") or 1) <= 1:
        return {}
    planned = plan.profile_meta.get("tensor_parallel_collectives")
    predicted = ({"forward": int(planned[r][0]), "backward": int(planned[r][1])}
                 if isinstance(planned, list) and r < len(planned) else None)
    return {"measured_tp_collectives": g.get("tp_collectives"), "predicted_tp_collectives": predicted}


def _run_timeline(ranks: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """Every rank's timeline events, in seconds from the first event's start (receives as
    :func:`_transfer_starts` draws them)."""
    events = [e for g in ranks for e in g["timeline"]]
    t0 = min((e["start_wall"] for e in events), default=0.0)
    return tuple(
        {"rank": e["rank"], "stage": e["stage"], "microbatch": e["microbatch"], "kind": e["kind"],
         "start_s": start - t0, "end_s": e["start_wall"] - t0 + e["duration_s"]}
        for e, start in zip(events, _transfer_starts(events))
    )


def _executed_plan(plan: Plan) -> dict[str, Any]:
    """What the report keeps of the plan it ran: the split,
    the schedule, the cost options, the profile's meta."""
    return {"boundaries": list(plan.boundaries), "schedule": plan.schedule,
            "num_microbatches": plan.num_microbatches,
            "num_ranks": plan.num_ranks, "virtual_stages": plan.virtual_stages, "method": plan.method,
            "stage_ranks": [st.rank for st in plan.stages],
            "profile_digest": plan.profile_digest, "layer_names": list(plan.layer_names),
            "cost_options": dict(plan.cost_options), "profile_meta": dict(plan.profile_meta)}


@dataclass(frozen=True)
class RunReport:
    """Medians over the measured steps (after warm-up), with IQR spreads.

    ``ranks`` holds one entry per pipeline rank: its stage (chunk) indices, predicted and measured compute
    seconds per microbatch (forward, backward), idle seconds per step, and predicted and measured peak
    activation bytes. ``plan`` is what the run executed: boundaries, schedule, cost options, and the meta of
    the profile the plan was made from (model, factory options, device, dtype; absent in older reports), which
    calibrate checks. ``run_options`` are the options the run was made with (steps, optimizer, lr, backend,
    ...). ``link`` is the ping-pong between neighbouring ranks at the run's start (stageplan.running.link):
    backend, latency_s, bandwidth_bytes_per_s, the probed sizes and per-pair figures; None in reports written
    before it existed. ``layers`` holds one entry per layer: its forward and backward seconds per microbatch
    inside the real schedule (executor's per-layer clock, median over the clock's steps after the measured
    ones), the stage and rank that ran it; each rank row adds the overhead its chunks spent outside their
    layers (``measured_overhead_forward_s`` and ``measured_overhead_backward_s``, per microbatch). Empty in
    reports written before it existed. Each rank row also times, once per step, the tied gradients' sum
    (``measured_tied_sync_s``) and ``optimizer.step()`` after
    it (``measured_optimizer_step_s``; None in reports written before it), beside the plan's prices.
    """

    measured_step_s: float
    predicted_step_s: float
    measured_step_iqr_s: float
    samples_per_s: float
    measured_bubble_fraction: float
    predicted_bubble_fraction: float
    ranks: tuple[dict[str, Any], ...]
    losses: tuple[float, ...]
    plan: dict[str, Any]
    run_options: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    check: dict[str, Any] | None = None
    timeline: tuple[dict[str, Any], ...] = ()
    link: dict[str, Any] | None = None
    layers: tuple[dict[str, Any], ...] = ()
    # with data-parallel replicas or tensor-parallel shards, the rows of the replicas and shards other than
    # the first (``ranks`` is replica 0's pipeline, shard 0), each with its mesh coordinates
    replicas: tuple[dict[str, Any], ...] = ()

    @property
    def step_ratio(self) -> float:
        """measured / predicted step time."""
        return self.measured_step_s / self.predicted_step_s if self.predicted_step_s else float("nan")

    def chrome_trace(self) -> dict[str, Any]:
        """The measured step (the last one the run timed, as ``timeline`` holds it) as Chrome trace-event JSON
        (Perfetto): a compute and a transfer track per rank (:func:`stageplan.formats.trace.chrome_trace`)."""
        from stageplan.formats.trace import chrome_trace

        plan = self.plan
        return chrome_trace(self.timeline, title=f"measured: {plan.get('schedule')}, {plan.get('num_ranks')} "
                            f"ranks, median step {self.measured_step_s * 1e3:.3f} ms",
                            meta={"source": "run", "boundaries": plan.get("boundaries"),
                                  "measured_step_s": self.measured_step_s,
                                  "predicted_step_s": self.predicted_step_s})

    def to_pandas(self) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame(list(self.ranks))

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["ranks"] = list(self.ranks)
        d["losses"] = list(self.losses)
        d["timeline"] = list(self.timeline)
        d["layers"] = list(self.layers)
        d["replicas"] = list(self.replicas)
        return {"schema": RUN_SCHEMA, **d}

    @classmethod
    def from_json(cls, data: dict[str, Any], *, source: str = "run report") -> RunReport:
        renamed = _OLD_SCHEMAS.get(str(data.get("schema")))
        if renamed is not None:
            data = {renamed.get(k, k): v for k, v in data.items()}
            if "options" in data or "run_options" not in data:
                data["run_options"] = data.pop("options", {})
        else:
            check_schema(data, RUN_SCHEMA, source)
        _check_report(data, source)
        try:
            kwargs = {f.name: data[f.name] for f in fields(cls) if f.name in data}
            kwargs["ranks"] = tuple(data["ranks"])
            kwargs["losses"] = tuple(data.get("losses", ()))
            kwargs["timeline"] = tuple(data.get("timeline", ()))
            replicas = data.get("replicas", ())
            if not isinstance(replicas, (list, tuple)) or not all(isinstance(r, dict) for r in replicas):
                raise SchemaError(f"{source}: 'replicas' must be a list of rank rows, got "
                                  f"{short_repr(replicas)}; rerun stageplan run to write it again")
            kwargs["replicas"] = tuple(replicas)
            kwargs["layers"] = tuple(_checked_layers(data.get("layers", ()), source,
                                                     data["plan"]["boundaries"][-1],
                                                     {int(r["rank"]) for r in data["ranks"]}))
            return cls(**kwargs)
        except (KeyError, TypeError) as exc:
            raise malformed(source, exc, "rerun stageplan run") from exc

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunReport:
        return cls.from_json(read_json(path, "run report"), source=f"run report {str(path)!r}")

    @classmethod
    def from_measurements(cls, plan: Plan, ranks: list[dict[str, Any]], *, step_s: float, step_iqr_s: float,
                          run_options: dict[str, Any], check: dict[str, Any] | None, meta: dict[str, Any],
                          link: dict[str, Any] | None = None) -> RunReport:
        """The report of a run of ``plan``: ``ranks`` holds each rank's medians over the measured steps
        (seconds per step: forward_s, backward_s, other_s, compute_cpu_s; their IQRs; peak_activation_bytes;
        losses; timeline events); ``step_s`` is the median over steps of the slowest rank's step."""
        m = plan.num_microbatches
        rows: list[dict[str, Any]] = []
        layers: list[dict[str, Any]] = []
        busy_total = 0.0
        sim = plan.simulate()
        idle_calls = _predicted_idle_calls(sim)
        # each chunk call's seconds as the simulator prices it
        # (a zero-bubble I is the run's B: backward_one_chunk)
        planned = {("B" if e.kind == "I" else e.kind, e.stage): e.end_s - e.start_s for e in sim.timeline
                   if e.kind in CALL_KINDS}
        # the first replica's first shard of each stage makes the rows; the others' rows are kept apart
        first = [g for g in ranks
                 if g.get("mesh", {}).get("dp", 0) == 0 and g.get("mesh", {}).get("tp", 0) == 0]
        replicas: list[dict[str, Any]] = []
        for g in sorted(ranks, key=lambda g: (g.get("mesh", {}).get("dp", 0), g.get("mesh", {}).get("tp", 0),
                                              g["rank"])):
            r = g["rank"]
            if all(g is not f for f in first):  # another replica or shard of the pipeline: its own row, apart
                replicas.append(_rank_row(plan, g, {}, step_s=step_s, predicted_wait_s=sim.receive_wait_s[r],
                                          predicted_idle_calls=idle_calls[r], planned=planned))
                continue
            # the rank's layers timed alone after the run, as the profiler times them: per microbatch at m
            retimed = {int(k): (v[0], (v[1] + (m - 1) * v[2]) / m) for k,
                       v in (g.get("retimed_layer_s") or {}).items()}
            layers.extend(_layer_rows(plan, g, retimed))
            rows.append(_rank_row(plan, g, retimed, step_s=step_s, predicted_wait_s=sim.receive_wait_s[r],
                                  predicted_idle_calls=idle_calls[r], planned=planned))
            busy_total += g["forward_s"] + g["backward_s"]
        # the step's loss over the global batch: the mean of the replicas' last stages' losses
        last = [g["losses"] for g in ranks if g["losses"]]
        losses = [sum(x) / len(x) for x in zip(*last)] if last else []
        batch = m * int(run_options.get("microbatch_size") or 1) * plan.data_parallel
        p = plan.num_ranks
        return cls(
            measured_step_s=step_s, predicted_step_s=plan.predicted_step_s, measured_step_iqr_s=step_iqr_s,
            samples_per_s=batch / step_s if step_s > 0 else 0.0,
            measured_bubble_fraction=max(0.0, 1.0 - busy_total / (p * step_s)) if step_s > 0 else 0.0,
            predicted_bubble_fraction=plan.bubble_fraction, ranks=tuple(rows), losses=tuple(losses),
            plan=_executed_plan(plan), run_options=dict(run_options), meta=meta, check=check,
            timeline=_run_timeline(first), link=link, layers=tuple(sorted(layers, key=lambda x: x["index"])),
            replicas=tuple(replicas),
        )
