"""plan(): Profile -> Plan. Reads the options, prices the layers (costs), finds the split (search), evaluates
it and writes the evidence and the notes into the Plan (no torch)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from stageplan.errors import InfeasiblePlanError, PlanNote, StageplanError
from stageplan.formats.interop import (
    boundaries_from_megatron,
    boundaries_from_module_fqns,
    named_layers,
    read_fqns,
)
from stageplan.formats.plan import Plan
from stageplan.formats.profile import Profile
from stageplan.formats.schedule import normalize_schedule
from stageplan.planning.costs import (
    COLLECTIVE,
    OVERHEADS,
    CostOptions,
    Device,
    LayerArrays,
    data_parallel_link,
    estimated_link,
    evaluate,
    layer_time,
    make_options,
    measured_link,
)
from stageplan.planning.precision import at_precision
from stageplan.planning.search import optimal_split, split_by_method, versus_optimal
from stageplan.units import parse_bandwidth, parse_bytes

# ------------------------------------------------------------------------------------------------------
# Planning

METHODS = ("optimal", "uniform", "parameters")


def as_profile(profile: Profile | str | os.PathLike[str]) -> Profile:
    return profile if isinstance(profile, Profile) else Profile.load(profile)


def _devices(devices: Sequence[Device | float] | None) -> list[Device] | None:
    if devices is None:
        return None
    return [d if isinstance(d, Device) else Device(float(d)) for d in devices]


_FASTER_NOTE = 0.01  # objective "bottleneck" notes a faster split found when it is at least this much faster


def _one_layer_note(
    profile: Profile, arr: LayerArrays, opts: CostOptions, bubble_fraction: float
) -> str | None:
    """When one layer bounds the step (largest layer >= total / p, so the lower bound is that layer), say so:
    a balance efficiency of 1.000 then means "as good as that layer allows", not "no time lost". A note, not a
    warning: the options are valid and the plan is the best they allow (only notes about the bubble warn)."""
    from stageplan.planning.solver import lower_bound

    times = layer_time(arr, opts)
    speeds = [d.speed for d in opts.devices]
    big = int(np.argmax(times))
    largest = float(times[big]) / max(speeds)  # the lower bound's second term (solver.lower_bound)
    share = math.fsum(times.tolist()) / sum(speeds)  # and its first: total / p
    if opts.num_ranks < 2 or lower_bound(times, speeds) > largest:
        return None
    return (f"one layer bounds the step: {profile.names[big]!r} takes {largest * 1e3:.3f} ms per microbatch, "
            f"at least total / p = {share * 1e3:.3f} ms, so no split can beat it and balance efficiency is "
            f"measured against it; the ranks still sit idle {bubble_fraction:.0%} of the step; what helps: "
            f"finer --layers (profile that layer as several), fewer stages, or splitting the layer itself "
            f"(e.g. a vocabulary-parallel head)")


OBJECTIVES = ("bottleneck", "step")


def check_objective(objective: object, method: str | None = None) -> None:
    """Refuse an unknown objective, and "step" with a method that fixes the split (uniform, parameters)."""
    if objective not in OBJECTIVES:
        raise StageplanError(f"objective {objective!r} is unknown; use bottleneck (the least slowest stage, "
                             "the default) or step (the lowest predicted step), e.g. --objective step")
    if objective == "step" and method in ("uniform", "parameters"):
        raise StageplanError(f"objective 'step' chooses among splits, but method {method!r} fixes the split; "
                             "drop --objective step, or plan with --method optimal")


def _step_search_note(search: dict[str, Any]) -> str | None:
    """What the step search says in the plan's notes: under objective "step", how far it moved the split;
    under "bottleneck", a faster split it found (at least _FASTER_NOTE faster), with what it costs in
    bottleneck."""
    if not search or search["to_boundaries"] == search["from_boundaries"]:
        return None
    how = (f"{search['splits_evaluated']} splits simulated, "
           f"{'every one that could' if search['exhaustive'] else 'descents'}")
    gain = search["to_step_s"] / search["from_step_s"] if search["from_step_s"] > 0 else 1.0
    moves = (f"predicted step {search['from_step_s'] * 1e3:.3f} -> {search['to_step_s'] * 1e3:.3f} ms "
             f"({gain:.3f}x), bottleneck {search['from_bottleneck_s'] * 1e3:.3f} -> "
             f"{search['to_bottleneck_s'] * 1e3:.3f} ms")
    if search["objective"] == "step":
        return (f"objective step: the lowest predicted step, not the least bottleneck: {moves} ({how}; the "
                f"least-bottleneck split was {search['from_boundaries']})")
    if gain > 1 - _FASTER_NOTE:
        return None
    return (f"a split with a larger bottleneck predicts a faster step: {search['to_boundaries']}, {moves} "
            f"({how}); "
            "the slowest stage per microbatch is not the whole step here (the optimizer steps, the "
            "tied-gradient sync, the fill and the drain are not in it): --objective step (objective='step') "
            "plans for the step")


def make_plan(profile: Profile, arr: LayerArrays, opts: CostOptions, method: str, meta_extra: dict[str, Any],
               given: tuple[int, ...] | None = None, given_as: str = "boundaries", given_input: Any = None,
               time_limit_s: float = 2.0, objective: str = "bottleneck") -> Plan:
    tie: dict[str, Any] = {}
    search: dict[str, Any] = {}
    if method == "optimal":
        boundaries, solver_evidence, tie, search = optimal_split(arr, opts, objective, time_limit_s)
    elif method == "layout":  # the layout search's split (planning.layouts), already chosen and simulated
        assert given is not None
        boundaries, solver_evidence = tuple(given), {}
    else:
        boundaries, solver_evidence = split_by_method(method, arr, opts, given, given_as, time_limit_s)
    ev = evaluate(arr, boundaries, opts, profile.names)
    notes = list(ev.notes)
    if tie and tie["to_boundaries"] != tie["from_boundaries"]:
        how = "every one of them" if tie["exhaustive"] else "a descent from the solver's split"
        notes.append(f"tie-break among equal-bottleneck splits: predicted step "
                     f"{tie['from_step_s'] * 1e3:.3f} ms -> {tie['to_step_s'] * 1e3:.3f} ms "
                     f"({tie['splits_evaluated']} splits simulated, {how}; the solver's split was "
                     f"{tie['from_boundaries']})")
    searched = _step_search_note(search)
    if searched:
        notes.append(searched)
    one_layer = _one_layer_note(profile, arr, opts, ev.bubble_fraction)
    if one_layer:
        notes.append(one_layer)
    versus = (versus_optimal(arr, opts, ev, given_as, given_input, time_limit_s, objective)
              if method == "given" else {})
    label = estimate_label(profile.meta)
    if label:
        notes.insert(0, label)
    if solver_evidence.get("optimal") is False:
        gap = ev.bottleneck_s / solver_evidence["proven_lower_bound_s"]
        if solver_evidence.get("timed_out", True):
            notes.append(f"interleaved solve hit its time limit ({time_limit_s:g} s): within {gap:.3f}x of "
                         "the proven optimum; a longer --time-limit may close the gap")
        else:
            # HiGHS ended otherwise (numerical trouble, or its
            # split missed the exact memory check by its tolerance)
            notes.append(f"interleaved split not proven optimal: the MILP ended without a proof it could "
                         f"use, before its time limit; the split kept is within {gap:.3f}x of the proven "
                         f"lower bound")
    mb = int(meta_extra.get("microbatch_size") or profile.meta.get("microbatch_size") or 1)
    cost_options = {"method": method, **({"objective": objective} if method in ("optimal", "given") else {}),
                    **opts.to_json(), "microbatch_size": mb, **solver_evidence}
    meta_keys = ("model", "layers_arg", "named_layers", "split_method", "microbatch_size", "batch_size",
                 "device", "dtype", "timer", "estimate", "processes", "order", "input_shapes")
    pmeta = {k: profile.meta[k] for k in meta_keys if k in profile.meta}
    pmeta["param_count"] = sum(layer.param_count or 0 for layer in profile.layers)  # the report's FLOPs
    pmeta["factory_options"] = dict(profile.meta.get("factory_options", profile.meta.get("options")) or {})
    pmeta.update(meta_extra)
    step = ev.predicted_step_s
    return Plan(
        boundaries=tuple(boundaries), layer_names=tuple(profile.names),
        evidence=dataclasses.replace(ev, notes=tuple(notes)),
        # every replica trains its own m microbatches in the step
        throughput_samples_s=opts.data_parallel * opts.num_microbatches * mb / step if step > 0 else math.inf,
        cost_options=cost_options, profile_digest=profile.digest(), profile_meta=pmeta,
        tie_break=tie, step_search=search, versus_optimal=versus,
    )


def _given_split(prof: Profile, method: str | None, boundaries: Sequence[int] | None,
                 megatron_layout: str | None, fqns: Sequence[Sequence[str]] | str | os.PathLike[str] | None
                 ) -> tuple[tuple[int, ...] | None, str, Any]:
    """The split the user gave (boundaries, a Megatron layout or torchtitan FQNs) as boundaries, which of the
    three it was, and the input as given (JSON-ready); (None, "", None) when none was given."""
    named = [k for k, v in (("boundaries", boundaries), ("megatron_layout", megatron_layout), ("fqns", fqns))
             if v is not None]
    if len(named) > 1:
        raise StageplanError(f"got {' and '.join(named)}: each gives a split to score; pass only one of "
                             "boundaries, megatron_layout and fqns")
    if not named:
        return None, "", None
    if method is not None:
        raise StageplanError(f"method {method!r} chooses a split but {named[0]} gives one; drop one of them "
                             "(a given split is scored against the optimal plan in any case)")
    if boundaries is not None:
        try:
            return tuple(int(b) for b in boundaries), "boundaries", [int(b) for b in boundaries]
        except (TypeError, ValueError):
            raise StageplanError(f"boundaries must be whole numbers, got {boundaries!r}; e.g. --boundaries "
                                 f"0,5,10") from None
    if megatron_layout is not None:
        if not isinstance(megatron_layout, str):
            raise StageplanError(
                f"megatron_layout must be a string such as 'E,t*4|t*4,L', got {megatron_layout!r}")
        return (boundaries_from_megatron(megatron_layout, prof.names, named_layers(prof.names, prof.meta)),
                "megatron_layout", megatron_layout)
    assert fqns is not None
    parts = read_fqns(fqns) if isinstance(fqns, (str, os.PathLike)) else fqns
    bounds = boundaries_from_module_fqns(parts, prof.names)  # checks the shape before anything is copied
    return bounds, "fqns", [list(part) for part in parts]


def estimate_label(meta: dict[str, Any]) -> str | None:
    """The words that mark figures computed from an analytic estimate rather than measured."""
    if meta.get("timer") != "analytic":
        return None
    gpu = (meta.get("estimate") or {}).get("gpu") or str(meta.get("device", "")).removeprefix("estimate:")
    return (f"ESTIMATE: times are analytic (roofline) for {gpu or 'a GPU'}, not measured and not yet checked "
            "against a GPU; ratios between layers are steadier than absolute times")


def rescaled_profile(profile: Profile, factor: float) -> Profile:
    """The profile at ``factor`` x its microbatch size, assuming time and activations linear in the batch
    (an extrapolation: time is not linear in the batch, pipedream issue #47; re-profile at the chosen size to
    confirm)."""
    from dataclasses import replace

    layers = tuple(replace(x, forward_s=x.forward_s * factor, backward_s=x.backward_s * factor,
                           backward_accumulate_s=None if x.backward_accumulate_s is None
                           else x.backward_accumulate_s * factor,
                           activation_bytes=int(x.activation_bytes * factor),
                           output_bytes=int(x.output_bytes * factor))
                   for x in profile.layers)
    return Profile(layers, dict(profile.meta))


def plan(
    profile: Profile | str | os.PathLike[str], num_ranks: int, *, num_microbatches: int | str | None = None,
    schedule: str = "1F1B", virtual_stages: int = 1, memory_limit: float | str | None = None,
    bandwidth: float | str | None = None, optimizer: str = "adam",
    devices: Sequence[Device | float] | None = None,
    recompute: bool = False, method: str | None = None, boundaries: Sequence[int] | None = None,
    precision: str | None = None, megatron_layout: str | None = None,
    fqns: Sequence[Sequence[str]] | str | os.PathLike[str] | None = None,
    link: Mapping[str, Any] | str | os.PathLike[str] | None = None, time_limit_s: float = 2.0,
    objective: str = "bottleneck", data_parallel: int = 1, sharding: str = "ddp",
) -> Plan:
    """Choose stage boundaries for ``profile`` on ``num_ranks`` pipeline ranks and predict the step.

    ``method`` is "optimal" (the default: the exact min-max split; among splits with that bottleneck, the one
    with the lowest simulated step), "uniform" or "parameters". Or score the split you run today (method
    "given", the same evidence, plus ``plan.versus_optimal``: bottleneck and step ratios to the optimal plan
    under the same options and memory headroom per rank), given by exactly one of ``boundaries``
    (``(0, b1, ..., L)``), ``megatron_layout`` (Megatron's ``--pipeline-model-parallel-layout``, e.g.
    ``"E,t*4|t*4,L"``: E the first layer, t each named block, L the last layer) or ``fqns`` (torchtitan's
    ``module_fqns_per_model_part``, or the path of a JSON file holding it).

    ``num_microbatches`` defaults to the profiled batch / microbatch size; ``"auto"`` tries every divisor of
    the profiled batch (times scaled linearly from the profiled microbatch size) and ``schedule="auto"``
    tries GPipe, 1F1B and Interleaved1F1B; the plan keeps the fastest feasible candidate and lists them all.
    ``memory_limit`` ("40GiB" or bytes) applies to every rank without its own; ``bandwidth`` ("25GB/s" or
    bytes/s) prices boundary traffic; ``devices`` are speeds relative to the profiled device (or Device);
    ``precision`` (fp32, bf16, bf16-mixed, fp16-mixed) sets the bytes per parameter training holds (16 with
    Adam in mixed precision), else the profiled parameters' bytes are used.

    ``data_parallel`` replicates the pipeline d times (each replica trains its share of a global batch d
    times the profiled one) and ``sharding`` ("ddp", "zero1" or "fsdp") sets what each replica's rank holds
    and the gradient sync it waits for (docs/cost-model.md); a sharding other than "ddp" without a
    ``precision`` counts bytes at the profiled dtype (fp32 or bf16). ``stageplan layout`` chooses d, the
    sharding and t for N devices; this prices the ones given.

    ``link`` (a LINK.json written by ``stageplan link``, or its dict) prices the boundaries with the measured
    link instead of ``bandwidth``: its bandwidth, its fused send/receive exchange as every crossing's delay,
    and the schedule's own overheads around and inside every chunk call (docs/cost-model.md). A calibrated
    profile keeps its run's chunk overheads and tied all-reduce, and its crossing delay unless a link replaces
    it. An estimate for a GPU (``--device estimate:GPU``) planned with neither gets that GPU's link within a
    node (gpus.json), in a note.

    ``objective`` is what the optimal method minimises: "bottleneck" (the default), the slowest rank's time
    per microbatch exactly, then the lowest simulated step among splits with that bottleneck; or "step", the
    lowest simulated step whatever the bottleneck (the step also holds the optimizer steps, the tied-gradient
    sync, the fill and the drain). Both search from the bottleneck-optimal split (``plan.step_search``); under
    "bottleneck" a split at least 1% faster is named in a note. ``time_limit_s`` bounds each MILP solve of an
    interleaved or V plan (``virtual_stages`` > 1); a plan that hits it says how far from the proven optimum
    it may be.

    Example (no torch needed)::

        >>> from stageplan import LayerProfile, Profile, plan
        >>> prof = Profile(
        ...     tuple(LayerProfile(f"l{i}", t, t, 0, 0, 0) for i, t in enumerate([1, 2, 3, 4, 5, 6]))
        ... )
        >>> plan(prof, 2, num_microbatches=4).boundaries
        (0, 4, 6)
    """
    prof = as_profile(profile)
    given, given_as, given_input = _given_split(prof, method, boundaries, megatron_layout, fqns)
    method = "given" if given is not None else _checked_method(method)
    check_objective(objective, method)
    time_limit_s = _checked_time_limit(time_limit_s)
    price = _pricing(prof, bandwidth, link)
    LayerArrays.of(prof)  # refuses NaN or negative costs before any candidate is tried
    if len(prof) == 0:
        raise StageplanError(
            "the profile has no layers; profile a model first (stageplan profile MODEL -o PROFILE.json)")
    batch = int(prof.meta["batch_size"]) if prof.meta.get("batch_size") else 0
    mb0 = int(prof.meta.get("microbatch_size") or 1)
    schedules = ["1F1B", "GPipe", "Interleaved1F1B"] if schedule == "auto" else [schedule]
    ms = _microbatch_counts(num_microbatches, batch, mb0, num_ranks)
    auto = len(ms) * len(schedules) > 1
    limit = parse_bytes(memory_limit) if memory_limit is not None else None
    devs = _devices(devices)
    # activation, boundary and step bytes at --precision (without one, as profiled)
    priced_profile, precision_note = prof, None
    if precision is not None:
        priced = at_precision(prof, precision, optimizer)
        priced_profile, precision_note = priced.profile, priced.note
    # sharded replicas count bytes per parameter by kind: at the profiled dtype when no precision is given
    own = {"float32": "fp32", "bfloat16": "bf16", "float16": "bf16"}.get(str(prof.meta.get("dtype")), "fp32")
    bytes_precision = precision if precision is not None or sharding == "ddp" else own
    # the replicas' sync priced with the measured all-reduce (the link's data-parallel probe, its all-reduce
    # over the pipeline, or a calibrated run's), else the link's point-to-point figures: per-ring-step latency
    # and per-link bandwidth, which the ring formula scales to d ranks
    dp_link, dp_note = data_parallel_link(
        data_parallel, price.overheads,
        link_bandwidth_bytes_per_s=price.bandwidth_bytes_per_s if link is not None else None,
        link_latency_s=price.link_latency_s)

    def candidate(sched: str, m: int) -> Plan:
        # auto tries single-stage schedules too: they run v = 1; a schedule named by the user gets v as given
        # (refused if it cannot)
        v = virtual_stages if schedule != "auto" or normalize_schedule(sched) not in ("GPipe", "1F1B") else 1
        mb = batch // m if num_microbatches == "auto" else mb0
        prof_m = rescaled_profile(priced_profile, mb / mb0) if mb != mb0 else priced_profile
        opts = make_options(prof_m, num_ranks, num_microbatches=m, schedule=sched, virtual_stages=v,
                            optimizer=optimizer, devices=devs, memory_limit_bytes=limit,
                            recompute=recompute, precision=bytes_precision, data_parallel=data_parallel,
                            sharding=sharding, **price.options(), **dp_link)
        cand = make_plan(prof, LayerArrays.of(prof_m, m), opts, method, {"microbatch_size": mb}, given,
                          given_as, given_input, time_limit_s, objective)
        said = tuple(n for n in (precision_note, price.note, dp_note) if n)
        return cand.with_notes((*cand.notes, *said)) if said else cand

    best, candidates = _best_candidate(candidate, schedules, ms, auto, method, recompute=recompute)
    if auto:
        best = dataclasses.replace(best, candidates=tuple(candidates))
        if num_microbatches == "auto" and best.cost_options["microbatch_size"] != mb0:
            best = best.with_notes((*best.notes, f"times scaled linearly from microbatch size {mb0} to "
                                    f"{best.cost_options['microbatch_size']}; re-profile at that size to "
                                    f"confirm"))
    best = _batch_note(best, batch)
    for note in best.notes:
        if "bubble" in note:
            warnings.warn(note, PlanNote, stacklevel=2)
    return best


def _checked_method(method: str | None) -> str:
    if method is None:
        return "optimal"
    if method not in METHODS:
        raise StageplanError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    return method


def _checked_time_limit(time_limit_s: float) -> float:
    if (
        isinstance(time_limit_s, bool)
        or not isinstance(time_limit_s, numbers.Real)
        or not 0 < time_limit_s < math.inf
    ):
        raise StageplanError(f"the solver's time limit must be a finite number of seconds > 0, got "
                             f"{time_limit_s!r}; "
                             "e.g. --time-limit 20 (time_limit_s=20)")
    return float(time_limit_s)


@dataclasses.dataclass(frozen=True)
class _Pricing:
    """How the boundaries and the chunks are priced: the bandwidth (bytes/s, None = free), the delay of a
    crossing (s) and where it came from, the link's one-way latency (s) and the schedule probe's overheads (s,
    or None where the all-reduce was not timed), and the note that says which link it is."""

    bandwidth_bytes_per_s: float | None
    boundary_latency_s: float
    latency_source: str
    link_latency_s: float
    overheads: dict[str, Any]
    note: str | None

    def options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`make_options` that price the link."""
        return {"bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "boundary_latency_s": self.boundary_latency_s,
                "latency_source": self.latency_source, "link_latency_s": self.link_latency_s,
                **{k: self.overheads[k] for k in (*OVERHEADS, *COLLECTIVE)}}


def _pricing(prof: Profile, bandwidth: float | str | None,
             link: Mapping[str, Any] | str | os.PathLike[str] | None) -> _Pricing:
    """The link's pricing: a measured LINK.json, else ``bandwidth``, else (for a GPU estimate) that GPU's link
    within a node; a calibrated profile brings its run's crossing delay and overheads (see :func:`plan`)."""
    calibration = prof.meta.get("calibration", {})
    bw = parse_bandwidth(bandwidth) if bandwidth is not None else None
    # the run's schedule probe
    overheads: dict[str, Any] = {k: float(calibration.get(k, 0.0)) for k in OVERHEADS}
    overheads.update({k: calibration.get(k) for k in COLLECTIVE})  # and its all-reduce
    if link is not None:
        if bandwidth is not None:
            raise StageplanError("link and bandwidth both price the boundaries (--link and --bandwidth); "
                                 "give one: --link LINK.json for the measured link, or --bandwidth RATE")
        bw, latency_s, source, said, link_latency_s, overheads = measured_link(link, calibration)
        return _Pricing(bw, latency_s, source, link_latency_s, overheads, said)
    estimated: str | None = None
    if bw is None and estimate_label(prof.meta):
        bw, estimated = estimated_link(prof.meta)
    return _Pricing(bw, float(calibration.get("boundary_latency_s", 0.0)), "fitted by calibrate from a run",
                    # the calibrating run's link
                    float(calibration.get("link_latency_s", 0.0)), overheads, estimated)


def _microbatch_counts(num_microbatches: int | str | None, batch: int, mb0: int, num_ranks: int) -> list[int]:
    """The microbatch counts to try: the one given, every divisor of the profiled batch for "auto", else the
    profiled batch / microbatch size (2p where the profile has no batch)."""
    if num_microbatches == "auto":
        if not batch:
            raise StageplanError("num_microbatches='auto' needs the global batch size in the profile meta "
                                 "(batch_size); pass a number of microbatches instead")
        return [m for m in range(1, batch + 1) if batch % m == 0]
    if num_microbatches is None:
        return [batch // mb0 if batch and batch % mb0 == 0 else 2 * num_ranks]
    if isinstance(num_microbatches, str):
        raise StageplanError(f"num_microbatches must be an integer or 'auto', got {num_microbatches!r}")
    return [num_microbatches]


def _best_candidate(candidate: Callable[[str, int], Plan], schedules: list[str], ms: list[int], auto: bool,
                    method: str, *, recompute: bool = False) -> tuple[Plan, list[dict[str, Any]]]:
    """The feasible candidate with the lowest predicted step over ``schedules`` x ``ms``, and a row per
    candidate tried. With one candidate its error stands; with several, one that fails or is over a memory
    limit is listed and skipped, and when none is left the error says why (a memory limit first)."""
    candidates: list[dict[str, Any]] = []
    best: Plan | None = None
    last_error: StageplanError | None = None
    for sched in schedules:
        for m in ms:
            try:
                cand = candidate(sched, m)
            except StageplanError as exc:
                if not auto:
                    raise
                # a memory limit no split meets says more than a candidate the schedule cannot run (m < p, too
                # few layers for its chunks): keep the first kind once seen
                if last_error is None or not isinstance(last_error, InfeasiblePlanError) or isinstance(
                        exc, InfeasiblePlanError):
                    last_error = exc
                candidates.append(
                    {"schedule": sched, "num_microbatches": m, "feasible": False, "reason": str(exc)})
                continue
            over = [n for n in cand.notes if "over its limit" in n]
            candidates.append({"schedule": cand.schedule, "num_microbatches": m,
                               "virtual_stages": cand.virtual_stages,
                               "microbatch_size": cand.cost_options["microbatch_size"], "feasible": not over,
                               "predicted_step_s": cand.predicted_step_s,
                               "bottleneck_s": cand.bottleneck_s, "bubble_fraction": cand.bubble_fraction,
                               **({"reason": "; ".join(over), "peak_bytes": max(cand.rank_memory_bytes)}
                                  if over else {})})
            if over and auto:
                continue
            if best is None or cand.predicted_step_s < best.predicted_step_s - 1e-15:
                best = cand
    if best is not None:
        return best, candidates
    over_limit = [c for c in candidates if "peak_bytes" in c]
    if over_limit:
        # every candidate that could be priced was over a limit: that, not the others' errors, is why
        closest = min(over_limit, key=lambda c: c["peak_bytes"])
        raise InfeasiblePlanError(
            f"no candidate of the {len(candidates)} tried ({', '.join(schedules)}; m in {ms}) fits the "
            f"memory limits with method {method}; the closest, {closest['schedule']} with "
            f"{closest['num_microbatches']} microbatch{'es' * (closest['num_microbatches'] != 1)}: "
            f"{closest['reason']}; raise --memory-limit"
            + (", or add --stages" if recompute else ", add --stages or add --recompute")
            + ("" if method == "optimal" else ", or let the optimal method move the boundaries"))
    assert last_error is not None  # every candidate raised, and auto kept the last error
    raise last_error


def _batch_note(best: Plan, batch: int) -> Plan:
    """Where the plan's microbatches do not make up the profiled model's batch, say how to run it."""
    mb_best, m_best = int(best.cost_options["microbatch_size"]), best.num_microbatches
    if not batch or mb_best * m_best == batch or best.profile_meta.get("timer") == "analytic":
        return best  # an analytic estimate is not run here: how to run it is no help
    fits = f"plan --microbatches {batch // mb_best}, or " if batch % mb_best == 0 else ""
    redo = (f"profile at --microbatch-size {batch // m_best} and plan that"
            if batch % m_best == 0 else f"build the model with a batch of {mb_best * m_best}")
    return best.with_notes((*best.notes, (
        f"this plan prices {m_best} microbatches of {mb_best} sample{'s' * (mb_best != 1)}, a batch of "
        f"{mb_best * m_best}, and the profiled model's batch is {batch}: stageplan run splits the model's "
        f"own batch, so to run this model {fits}{redo}")))
