"""Executor benchmark: how well a plan predicts its run
on this machine, before any calibration, and after tune.

Two models on 2 CPU ranks, GPipe and 1F1B, m in {4, 8}: gpt with a skewed 16384-token vocabulary (its LM
head costs ~8 blocks) and the conv stack; with --probes also HF GPT-2 (tied embedding and head), the noise
floor and the probes after tune (make bench leaves them out to stay within half an hour). For the first two,
the cross-split section: the profile calibrated on the optimal split's run predicts other splits, each run
fresh (:func:`cross_split`). Each configuration (model, m,
schedule) is profiled just before its runs, with its rounds spread over PROFILE_S seconds, planned optimal and
uniform, and each distinct split run for at least RUN_S seconds of steps: this shared host's speed drifts by
the second (two windows of the same work differed by up to 33% over 1.7 s windows and 9% over 20 s, 98th
percentile) and over minutes (two 10 s profiles of one model two minutes apart, 15% on every layer alike).
Printed per run: predicted and measured step, and per rank measured / predicted compute by wall clock and by
thread CPU time side by side (wall above CPU is time the rank was preempted), that compute error split in two
(each rank's layers timed alone after the run, the ranks in turns, against the plan: the machine now against
at the profile; and the run against them: the pipeline's own effect), with the 1-minute load average at the
run's start and the machine's own drift (a fixed kernel timed just before the run against just after the
profile). Then the medians and worst cases against the goals (compute: median <= 10%, worst <= 20%; step:
median <= 15%, worst <= 25%), the optimal-over-uniform gains predicted and measured, and stageplan tune on the
gpt (m = 4, 8): the final plan's prediction error on fresh runs (TUNE_RUNS of them, the final plan and uniform
in turns, medians) and its measured gain over uniform (the median of the gains of runs side by side) against
the predicted one, with the spread of the final plan's own runs (the same plan run again: what no prediction
can beat). Then the noise floor: one GPT split profiled, priced and run five times over, and the least
worst-case error the pairs' spread leaves any one factor on the model's predictions. Last, the GPT's plan with
ranks pinned to their own CPUs against placed by the OS, alternating; and the optimal method's two
objectives (the least bottleneck, the lowest predicted step), run in turns where their splits differ.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import tempfile
import time

import stageplan
from stageplan.formats.schedule import RESUME_GAP_S
from stageplan.report import format_table
from stageplan.zoo import build_workload

STEPS, WARMUP = 20, 3  # the same plan's step varied 7-14% between runs of 8 steps here, 3% at 20
# at least this many seconds of measured steps per run (more steps than STEPS where a step is short)
RUN_S = 8.0
PROFILE_S = 10.0  # each profile's timed rounds span at least this (stageplan profile --min-time)
TUNE_RUNS = 3  # tune's final plan and uniform, run in turns (stageplan tune --runs)
MODELS = [("gpt", {"vocab_size": 16384}), ("convnet", {})]
# with --probes (not in make bench, which stays within half an hour): HF GPT-2 too, whose tied embedding and
# head make the only priced all-reduce
PROBE_MODELS = [("hf-gpt2", {})]


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def _steps(pl: stageplan.Plan) -> int:
    """Measured steps for a run of ``pl``: STEPS, or enough to fill RUN_S seconds at its predicted step."""
    return max(STEPS, math.ceil(RUN_S / pl.predicted_step_s))


def _machine_speed() -> float:
    """The machine's own speed now: median seconds of a fixed pair of kernels (a 256x256 matmul and a 2M-float
    multiply-sum, one thread) over half a second. Timed after each profile and before each run, its ratio says
    how much of a run's miss is the shared host itself drifting: on an idle 2-core VM here it moved 418-528 us
    and 1073-1467 us (2-second medians, 30 s) with nothing else running."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, x = torch.randn(256, 256), torch.randn(2_000_000)
    for _ in range(20):  # first touch of the buffers, untimed
        torch.mm(a, a)
        (x * 1.0001).sum()
    times = []
    end = time.perf_counter() + 0.5
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        torch.mm(a, a)
        (x * 1.0001).sum()
        times.append(time.perf_counter() - t0)
    torch.set_num_threads(threads)
    return statistics.median(times)


def _decompose(
    profile: stageplan.Profile, pl: stageplan.Plan, rep: stageplan.RunReport, link: dict | None
) -> list[str]:
    """Where measured - predicted step goes, on the rank the plan predicts busiest (ms per step): its layers
    inside the pipeline against their profiled times, its chunks' overhead outside the layers beyond what the
    plan priced for it, its optimizer step (and tied sync) against the prediction, and the rest (waiting on
    the other rank, transfers, preemption). Then the whole miss split in two by replaying the split with every
    rank's measured layer times: compute on all ranks, and the waits and transfers the simulator does not see.
    With a tie across ranks, a rank that finishes its backward first waits inside the all-reduce: the
    simulator counts that wait as idle, this split counts it under the optimizer."""
    m = pl.num_microbatches
    busy = {r["rank"]: r["predicted_compute_s"] for r in rep.ranks}
    r = max(busy, key=lambda k: busy[k])
    row = next(x for x in rep.ranks if x["rank"] == r)
    layers = [x for x in rep.layers if x["rank"] == r]
    d_layers = m * sum(x["measured_forward_s"] - profile.layers[x["index"]].forward_s
                       + x["measured_backward_s"]
                       - profile.layers[x["index"]].backward_per_microbatch_s(m) for x in layers)
    # the chunks' overhead outside their layers (the clock's
    # hooks included) beyond what the plan priced for it
    overhead = m * (row["measured_overhead_forward_s"] + row["measured_overhead_backward_s"]
                    - sum(st.chunk_s for st in pl.stages if st.rank == r))
    predicted_other = sum(st.optimizer_s + st.tied_sync_s for st in pl.stages if st.rank == r)
    d_other = row["optimizer_s"] - predicted_other
    miss = rep.measured_step_s - pl.predicted_step_s
    rest = miss - d_layers - overhead - d_other
    # the same split replayed: every rank's layers (chunk overhead shared in) at their times inside this run
    # (calibrate, per layer), simulated with the same link; what stays is waiting and transfers
    replayed = stageplan.plan(stageplan.calibrate(profile, rep), 2, num_microbatches=m, schedule=pl.schedule,
                              boundaries=pl.boundaries, link=link).predicted_step_s
    # of the rest, the rank's loop blocked on its receives
    # beyond what the simulator has it wait (timed in the run)
    d_waits = (row.get("measured_receive_wait_s") or 0.0) - (row.get("predicted_receive_wait_s") or 0.0)
    return [f"{x * 1e3:+.1f}" for x in (miss, d_layers, overhead, d_other, rest, d_waits,
                                        replayed - pl.predicted_step_s,
                                        rep.measured_step_s - replayed)] + [str(r)]


def _tied_sync(rep: stageplan.RunReport) -> list[str] | None:
    """The tied gradients' sum where the plan priced one: its price, each rank's measured time, and the least
    of them (the rank that reached the all-reduce last, so its time is the collective's own) over the price;
    None where no sync was priced."""
    predicted = max((r.get("predicted_tied_sync_s") or 0.0) for r in rep.ranks)
    measured = [r.get("measured_tied_sync_s") for r in rep.ranks]
    if predicted <= 0 or any(x is None for x in measured):
        return None
    return [f"{predicted * 1e3:.2f}", " ".join(f"{x * 1e3:.2f}" for x in measured),
            f"{min(measured) / predicted:.3f}"]


def _floor(values: list[float]) -> float:
    """The least worst-case error any one correction can leave over ``values`` (measured / predicted ratios of
    the same procedure repeated): scaling every prediction by c, the worst |v/c - 1| is least at c = the
    midpoint of the smallest and largest ratio, which leaves (max - min) / (max + min). A goal's worst-case
    line below this cannot hold on these pairs for any one factor applied to the model's predictions."""
    return (max(values) - min(values)) / (max(values) + min(values))


def noise_floor(link: dict, pairs: int = 5) -> None:
    """The bench's own procedure repeated on one split: ``pairs`` times, profile the gpt (vocab 16384,
    microbatch for m = 4, rounds over PROFILE_S), price the same split (GPipe m = 4, the first pair's optimal)
    from that profile, and run it at once. Each rank's compute and the step as measured / predicted per pair,
    the fixed kernel at each run, and the floor (:func:`_floor`) that the pairs' spread puts under any model's
    worst case."""
    model, options = MODELS[0]
    workload = build_workload(model, options)
    rows, per_rank, steps, split = [], {}, [], None
    for i in range(pairs):
        profile = stageplan.profile_model(workload, microbatch_size=workload.batch_size // 4,
                                          min_time_s=PROFILE_S)
        pl = stageplan.plan(profile, 2, num_microbatches=4, schedule="GPipe", link=link, boundaries=split)
        split = pl.boundaries
        kernel = _machine_speed()
        rep = stageplan.run(model, pl, steps=_steps(pl), warmup=WARMUP, factory_options=options)
        for r in rep.ranks:
            per_rank.setdefault(r["rank"], []).append(r["compute_ratio"])
        steps.append(rep.step_ratio)
        rows.append([i + 1, f"{kernel * 1e6:.0f}", f"{pl.predicted_step_s * 1e3:.1f}",
                     f"{rep.measured_step_s * 1e3:.1f}",
                     _pct(rep.step_ratio - 1), " ".join(_pct(r["compute_ratio"] - 1) for r in rep.ranks)])
    print(f"\nnoise floor: {model} {options} GPipe m = 4, split {' '.join(map(str, split or ()))}: {pairs} "
          f"times, profiled (rounds over >= {PROFILE_S:g} s), priced and run at once, as each configuration "
          f"above")
    print(format_table(["pair", "fixed kernel us", "predicted ms", "measured ms", "step error",
                        "compute error per rank (wall)"], rows))
    for rank, ratios in sorted(per_rank.items()):
        print(f"  rank {rank} compute: measured / predicted {min(ratios):.3f}-{max(ratios):.3f}; the least "
              f"worst error any fixed correction leaves over these pairs: {_floor(ratios):.1%} (goal line: "
              f"worst <= 20%)")
    print(f"  step: measured / predicted {min(steps):.3f}-{max(steps):.3f}; the least worst error any fixed "
          f"correction leaves: {_floor(steps):.1%} (goal line: worst <= 25%)")


# the models the cross-split section calibrates (the skewed GPT and the conv stack), each under GPipe and 1F1B
# at m = 4 and 8, 2 ranks
CALIBRATION_MODELS = ("gpt", "convnet")


@dataclasses.dataclass(frozen=True)
class Judged:
    """One split judged by the cross-split section: what it was calibrated on, the split's plan priced from
    the calibrated profile with the fitted crossing delay (``plan``) and with the link instead (``no_fit_s``),
    and its fresh run."""

    model: str
    m: int  # the calibrating run's microbatches
    split: str  # "uniform", "p = 1", "m = 8", or "same plan"
    calibrated_on: tuple[int, ...]
    calibrating_s: float
    plan: stageplan.Plan
    no_fit_s: float
    report: stageplan.RunReport


def cross_split(model: str, options: dict, batch: int, profile: stageplan.Profile,
                plans: dict[str, stageplan.Plan], reports: dict[str, stageplan.RunReport], link: dict,
                turn: int, kernels: list[float]) -> list[Judged]:
    """Calibrate ``profile`` on the optimal split's run (``reports["optimal"]``) and judge the calibrated
    model on runs it was not fit to: the uniform split (already run, fresh, just after), the same model on 1
    rank (the only other p this 2-core host holds at one rank per core), and the other m of {4, 8} at the same
    microbatch size (the model built with that batch: calibrate's factors are per microbatch), each run
    fresh now; and the calibrating split run again (the same plan: what one run of a plan says of the next).
    The three new runs go in a turn that rotates from one configuration to the next (``turn``), each after
    the fixed kernel (appended to ``kernels``).

    Each is priced twice from the calibrated profile: as calibrate leaves it (the crossing delay fitted so
    the calibrating run's step is matched exactly), and with the measured link pricing the crossings instead
    (no fitted delay; the chunk overheads stay the run's)."""
    m, schedule = plans["optimal"].num_microbatches, plans["optimal"].schedule
    other_m = 8 if m == 4 else 4
    calibrated = stageplan.calibrate(profile, reports["optimal"])

    mb = batch // m

    def priced(p: int, m_: int, bounds: tuple[int, ...] | None) -> tuple[stageplan.Plan, float]:
        prof = calibrated
        if m_ != m:  # m_ microbatches of the same size: the model built with a batch of m_ of them
            meta = {**prof.meta, "batch_size": mb * m_,
                    "factory_options": {**prof.meta.get("factory_options", {}), "batch_size": mb * m_}}
            prof = stageplan.Profile(prof.layers, meta)
        fit = stageplan.plan(prof, p, num_microbatches=m_, schedule=schedule, boundaries=bounds)
        no_fit = stageplan.plan(prof, p, num_microbatches=m_, schedule=schedule, boundaries=fit.boundaries,
                                link=link)
        return fit, no_fit.predicted_step_s

    def judged(split: str, pl: stageplan.Plan, no_fit: float, rep: stageplan.RunReport) -> Judged:
        return Judged(model, m, split, plans["optimal"].boundaries, reports["optimal"].measured_step_s, pl,
                      no_fit, rep)

    rows = []
    if plans["uniform"].boundaries != plans["optimal"].boundaries:
        rows.append(judged("uniform", *priced(2, m, plans["uniform"].boundaries), reports["uniform"]))
    # the other m: the calibrated profile's optimal plan there (its split may move), run with a batch of
    # other_m microbatches of the profiled size
    fresh = [("same plan", *priced(2, m, plans["optimal"].boundaries), options),
             ("p = 1", *priced(1, m, None), options),
             (f"m = {other_m}", *priced(2, other_m, None), {**options, "batch_size": mb * other_m})]
    k = turn % len(fresh)
    for name, pl, no_fit, opts in fresh[k:] + fresh[:k]:
        kernels.append(_machine_speed())
        rep = stageplan.run(model, pl, steps=_steps(pl), warmup=WARMUP, factory_options=opts, retime=False)
        rows.append(judged(name, pl, no_fit, rep))
    return rows


def print_cross_split(rows: list[Judged], kernels: list[float]) -> dict[str, float | None]:
    """The cross-split table, its medians and worst cases beside the same plan's and the fixed kernel's
    floor (|reading / median - 1| over the readings before each run of the section), and the record's
    figures."""
    table, cross, cross_no_fit, same, same_no_fit = [], [], [], [], []
    for r in rows:
        fit, meas = r.plan.predicted_step_s, r.report.measured_step_s
        e_fit, e_no = meas / fit - 1, meas / r.no_fit_s - 1
        split = f"{r.plan.num_ranks} x {r.plan.num_microbatches}: {' '.join(map(str, r.plan.boundaries))}"
        table.append([r.model, r.plan.schedule, r.m, " ".join(map(str, r.calibrated_on)),
                      f"{r.calibrating_s * 1e3:.1f}", r.split, split,
                      f"{fit * 1e3:.1f}", f"{r.no_fit_s * 1e3:.1f}", f"{meas * 1e3:.1f}", _pct(e_fit),
                      _pct(e_no)])
        (same if r.split == "same plan" else cross).append(abs(e_fit))
        (same_no_fit if r.split == "same plan" else cross_no_fit).append(abs(e_no))
    floor = [abs(k / statistics.median(kernels) - 1) for k in kernels] if kernels else []
    print("\ncross-split prediction after one calibration: each configuration's profile calibrated on its "
          "optimal split's run, then the uniform split (run just after it), 1 rank, and the other m (same "
          "microbatch size), each measured fresh, and the calibrating split run again (same plan); priced "
          "with calibrate's fitted crossing delay (fit) and with the measured link instead (no fit)")
    print(format_table(["model", "schedule", "m", "calibrated on", "its step ms", "judged",
                        "ranks x m: split",
                        "predicted ms (fit)", "(no fit)", "measured ms", "error (fit)", "(no fit)"], table))

    def line(name: str, errs: list[float]) -> str:
        return (f"{name}: median {statistics.median(errs):.1%}, worst {max(errs):.1%} over {len(errs)}"
                if errs else f"{name}: none")

    print(f"  {line('cross-split, fit', cross)} (goal: median <= 10%, worst <= 20%, or the floor)")
    print(f"  {line('cross-split, no fit', cross_no_fit)}")
    print(f"  {line('same plan, fit', same)}; {line('no fit', same_no_fit)}")
    print(f"  {line('fixed kernel before each run, |reading / median - 1| (the floor)', floor)}")

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    return {"cross_median": med(cross), "cross_worst": max(cross, default=None),
            "cross_no_fit_median": med(cross_no_fit), "cross_no_fit_worst": max(cross_no_fit, default=None),
            "cross_count": len(cross), "same_median": med(same), "same_worst": max(same, default=None),
            "same_no_fit_median": med(same_no_fit), "same_no_fit_worst": max(same_no_fit, default=None),
            "floor_median": med(floor), "floor_worst": max(floor, default=None), "floor_count": len(floor)}


ORDER_CASES = [("gpt", {"vocab_size": 16384}, "1F1B", 4, (0, 4, 8)), ("hf-gpt2", {}, "1F1B", 8, (0, 3, 6))]
# profiles per order, in turns, merged per layer (the host swung 25% between two 10 s profiles)
ORDER_TURNS = 4


def orders(link: dict, pairs: int = 2) -> None:
    """The profile's two orders (stageplan profile --order) against the same runs: for each case (the splits
    whose first rank missed most in earlier benches), ``pairs`` times, ORDER_TURNS short profiles per order
    (rounds over PROFILE_S / ORDER_TURNS seconds each) taken in turns and merged per layer (the median), so
    that the host's swings fall on both orders alike; then the split priced from each and run once. Per rank,
    its layers' forward and backward inside the run (the layer clock) against each profile's: the forwards are
    timed alike in both orders and show the host's level, the backwards show what the order changes."""
    from stageplan.formats.profile import merge_profiles

    rows, errors = [], {"stage": [], "layer": []}
    for model, options, schedule, m, split in ORDER_CASES:
        workload = build_workload(model, options)
        for _ in range(pairs):
            taken: dict[str, list[stageplan.Profile]] = {"stage": [], "layer": []}
            for _turn in range(ORDER_TURNS):
                for order in taken:
                    taken[order].append(stageplan.profile_model(workload,
                                                                microbatch_size=workload.batch_size // m,
                                                                min_time_s=PROFILE_S / ORDER_TURNS,
                                                                order=order))
            profiles = {order: merge_profiles(ps) for order, ps in taken.items()}
            plans = {order: stageplan.plan(p, 2, num_microbatches=m, schedule=schedule, link=link,
                                           boundaries=list(split)) for order, p in profiles.items()}
            rep = stageplan.run(model, plans["stage"], steps=_steps(plans["stage"]), warmup=WARMUP,
                                factory_options=options, retime=False)
            row = [model, schedule, m, " ".join(map(str, split))]
            for order, p in profiles.items():
                pl = plans[order]
                priced = [sum(st.forward_s + st.backward_s for st in pl.stages if st.rank == r["rank"])
                          for r in rep.ranks]
                ratios = [r["measured_compute_s"] / x for r, x in zip(rep.ranks, priced)]
                errors[order] += [abs(x - 1) for x in ratios]
                inside = {r["rank"]: [0.0, 0.0, 0.0, 0.0] for r in rep.ranks}
                for x in rep.layers:
                    layer = p.layers[int(x["index"])]
                    t = inside[int(x["rank"])]
                    t[0] += x["measured_forward_s"]
                    t[1] += layer.forward_s
                    t[2] += x["measured_backward_s"]
                    t[3] += layer.backward_per_microbatch_s(m)
                row += [" ".join(_pct(x - 1) for x in ratios),
                        " ".join(f"{t[0] / t[1]:.2f}/{t[2] / t[3]:.2f}" for _, t in sorted(inside.items()))]
            rows.append(row)
    print(f"\norders: each split profiled {ORDER_TURNS} times in each order (stageplan profile --order), in "
          f"turns, rounds over >= {PROFILE_S / ORDER_TURNS:g} s each, merged per order (median per layer), "
          "and run once; each rank's compute error against each order's price, and its layers' forward / "
          "backward inside the run against each")
    print(format_table(["model", "schedule", "m", "split", "against --order stage", "inside / stage fwd/bwd",
                        "against --order layer", "inside / layer fwd/bwd"], rows))
    for order, errs in errors.items():
        print(f"  --order {order}: |measured/predicted - 1| median {statistics.median(errs):.1%}, worst "
              f"{max(errs):.1%} over {len(errs)} rank runs")


# The objectives' cases: (model, options, schedule, m, virtual stages); each is run only where the two
# objectives split it differently
OBJECTIVE_CASES = [("convnet", {}, "1F1B", 4, 1), ("convnet", {}, "GPipe", 4, 1),
                   ("gpt", {"vocab_size": 16384}, "1F1B", 4, 1),
                   ("gpt", {"vocab_size": 16384}, "Interleaved1F1B", 4, 2)]


def objectives(link: dict, pairs: int = 5) -> None:
    """The optimal method's two objectives (stageplan plan --objective) on the same profile: where the lowest
    predicted step is another split than the least bottleneck, predicted at least 1% faster (a smaller gain is
    within the runs' spread here), both run ``pairs`` times in turns. Printed: each plan's predicted step and
    every run's measured step, and the step plan's gain over the bottleneck plan, predicted and measured (the
    median of the gains of runs side by side, and the ratio of the two median steps)."""
    rows = []
    for model, options, schedule, m, v in OBJECTIVE_CASES:
        workload = build_workload(model, options)
        profile = stageplan.profile_model(workload, microbatch_size=workload.batch_size // m,
                                          min_time_s=PROFILE_S)
        plans = {o: stageplan.plan(profile, 2, num_microbatches=m, schedule=schedule, virtual_stages=v,
                                   link=link, objective=o) for o in ("bottleneck", "step")}
        row = [model, schedule, m, *(" ".join(map(str, pl.boundaries)) for pl in plans.values()),
               *(f"{pl.predicted_step_s * 1e3:.1f}" for pl in plans.values())]
        predicted = plans["bottleneck"].predicted_step_s / plans["step"].predicted_step_s
        same = plans["bottleneck"].boundaries == plans["step"].boundaries
        if same or predicted < 1.01:  # a smaller gain is too close to measure here
            rows.append([*row, "same split" if same else "not run", "", f"{predicted:.3f}", "", ""])
            continue
        measured: dict[str, list[float]] = {o: [] for o in plans}
        for _ in range(pairs):
            for o, pl in plans.items():
                measured[o].append(stageplan.run(model, pl, steps=_steps(pl), warmup=WARMUP,
                                                 factory_options=options, retime=False).measured_step_s)
        gain = statistics.median(b / s for b, s in zip(measured["bottleneck"], measured["step"]))
        medians = statistics.median(measured["bottleneck"]) / statistics.median(measured["step"])
        rows.append([*row, *(" ".join(f"{x * 1e3:.1f}" for x in measured[o]) for o in plans),
                     f"{predicted:.3f}", f"{gain:.3f}", f"{medians:.3f}"])
    print(f"\nobjectives: the optimal method's least bottleneck (default) against its lowest predicted step "
          f"(--objective step), one profile each (rounds over >= {PROFILE_S:g} s), both splits run {pairs} "
          "times in turns where the step split is predicted >= 1% faster; gain = bottleneck plan's step / "
          "step plan's (measured: the median of the pairs' gains, and the ratio of the two plans' median "
          "steps)")
    print(format_table(["model", "schedule", "m", "bottleneck split", "step split", "predicted ms",
                        "predicted ms",
                        "measured ms, each run", "measured ms, each run", "predicted gain",
                        "measured gain (pairs)", "(medians)"], rows))


def placement(link: dict, pairs: int = 2) -> None:
    """Ranks pinned to their own CPUs against placed by the OS: one GPT plan (vocab 16384, m = 8, optimal),
    run pinned and unpinned alternately, ``pairs`` times per schedule, so the machine's drift falls on both
    alike."""
    options = MODELS[0][1]
    workload = build_workload("gpt", options)
    profile = stageplan.profile_model(workload, microbatch_size=workload.batch_size // 8)
    rows, ratios = [], []
    for schedule in ("GPipe", "1F1B"):
        pl = stageplan.plan(profile, 2, num_microbatches=8, schedule=schedule, link=link)
        errors: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(pairs):
            for pin in (True, False):
                rep = stageplan.run("gpt", pl, steps=STEPS, warmup=WARMUP, factory_options=options,
                                    pin_cpus=pin)
                errors[pin].append(rep.step_ratio - 1)
        ratios.append(statistics.median(1 + e for e in errors[False])
                      / statistics.median(1 + e for e in errors[True]))
        rows.append([schedule, " ".join(map(str, pl.boundaries)), f"{pl.predicted_step_s * 1e3:.1f}",
                     " ".join(map(_pct, errors[True])), " ".join(map(_pct, errors[False])),
                     f"{ratios[-1]:.3f}"])
    print(f"\nplacement: gpt {options} m = 8 optimal, each rank pinned to its own CPUs (the default) or "
          f"placed by the OS (--no-pin), alternating, {pairs} runs each; step error = measured / predicted - "
          f"1")
    print(format_table(
        ["schedule", "split", "predicted ms", "pinned", "unpinned", "unpinned / pinned (median step)"], rows))


def _crossing_rank(
    rank: int, slice_ns: int, port: int, out: object, crossings: int = 20, warmup: int = 5
) -> None:
    """One side of :func:`crossings`: rank 0 posts a 4 KiB send and computes for 10 ms; rank 1 posts its
    receive 0.5 ms after the send and records how long the message took from then (ms)."""
    import torch
    import torch.distributed as dist

    from stageplan.running.executor import pin_rank_cpus, short_comm_slices

    pin_rank_cpus(rank, 2)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    short_comm_slices(slice_ns)
    msg, stamp, a = torch.zeros(1024), torch.zeros(1, dtype=torch.float64), torch.randn(256, 256)
    delays = []
    for i in range(warmup + crossings):
        dist.barrier()
        if rank == 0:
            time.sleep(0.002)
            stamp[0] = time.perf_counter()
            work = dist.isend(msg, 1)
            end = time.perf_counter() + 0.010
            while time.perf_counter() < end:
                torch.mm(a, a)
            work.wait()
            dist.send(stamp, 1)
        else:
            time.sleep(0.0025)
            posted = time.perf_counter()
            dist.irecv(msg, 0).wait()
            arrived = time.perf_counter()
            dist.recv(stamp, 0)
            if i >= warmup:
                delays.append(1e3 * (arrived - max(posted, float(stamp[0]))))
    dist.destroy_process_group()
    if rank == 1:
        out.put(delays)  # type: ignore[attr-defined]


def _crossing_run(slice_ns: int, port: int, timeout_s: float = 120.0) -> list[float]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_crossing_rank, args=(r, slice_ns, port, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        return out.get(timeout=timeout_s)
    finally:  # a hung or failed side ends both
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def crossings(pairs: int = 3) -> None:
    """A send posted while its receiver is not ready yet, the sender then computing: how long the message
    takes from the moment the receiver posts, with gloo's threads at the kernel's slice and at the executor's
    0.1 ms (stageplan.running.executor.short_comm_slices), alternating ``pairs`` times; 20 crossings per
    run."""
    from stageplan.running.executor import COMM_SLICE_NS

    got: dict[int, list[float]] = {0: [], COMM_SLICE_NS: []}
    port = 29700 + os.getpid() % 200
    for k in range(pairs):
        for j, ns in enumerate(got):
            got[ns] += _crossing_run(ns, port + 2 * k + j)
    rows = [[name, f"{statistics.median(d):.3f}", f"{sum(x > 1.0 for x in d)} of {len(d)}", f"{max(d):.2f}"]
            for name, d in (("kernel's slice", got[0]), ("0.1 ms (the default)", got[COMM_SLICE_NS]))]
    ratio = statistics.median(got[0]) / statistics.median(got[COMM_SLICE_NS])
    print("\ncrossings: a 4 KiB send posted 0.5 ms before its receive, the sender computing 10 ms; time from "
          f"the receive's post to the message (ms), gloo's threads at each slice, alternating, {pairs} runs "
          f"of 20 each")
    print(format_table(["comm threads' slice", "median ms", "over 1 ms", "worst ms"], rows))
    print(f"kernel's slice / 0.1 ms, median: {ratio:.2f}")


def slices_in_pipelines(pairs: int = 2) -> None:
    """The same plans run with gloo's threads at the kernel's slice and at 0.1 ms, alternating: the step and
    its error against the prediction (the plans' crossings are priced the same either way)."""
    from stageplan.running.launch import measure_link

    link = measure_link(2)
    rows = []
    for model, m, schedule, method in (
        ("convnet", 8, "GPipe", "uniform"),
        ("hf-gpt2", 8, "GPipe", "optimal"),
    ):
        options = dict(MODELS)[model]
        workload = build_workload(model, options)
        profile = stageplan.profile_model(workload, microbatch_size=workload.batch_size // m)
        pl = stageplan.plan(profile, 2, num_microbatches=m, schedule=schedule, method=method, link=link)
        steps: dict[str, list[float]] = {"0": [], "": []}
        for _ in range(pairs):
            for value in steps:
                os.environ["STAGEPLAN_COMM_SLICE_US"] = value
                try:
                    rep = stageplan.run(model, pl, steps=STEPS, warmup=WARMUP, factory_options=options)
                finally:
                    os.environ.pop("STAGEPLAN_COMM_SLICE_US", None)
                steps[value].append(rep.measured_step_s)
        kernel, short = statistics.median(steps["0"]), statistics.median(steps[""])
        rows.append([model, schedule, m, method, f"{pl.predicted_step_s * 1e3:.1f}",
                     " ".join(f"{x * 1e3:.1f}" for x in steps["0"]),
                     " ".join(f"{x * 1e3:.1f}" for x in steps[""]),
                     f"{kernel / short:.3f}", _pct(short / pl.predicted_step_s - 1)])
    print(f"\nslices in pipelines: each plan run with gloo's threads at the kernel's slice and at 0.1 ms, "
          f"alternating, {pairs} runs each")
    print(format_table(["model", "schedule", "m", "method", "predicted ms", "kernel's slice ms", "0.1 ms ms",
                        "kernel's / 0.1 ms (median step)", "step error at 0.1 ms"], rows))


def main(probes: bool = False) -> dict[str, dict[str, float | None]]:
    """Prints every table and returns the figures by record section: "executor" (the runs without
    calibration, tune) and "calibration" (cross-split predictions after one calibration). ``probes`` adds
    HF GPT-2's configurations, the noise floor and the probes (orders, objectives, placement, crossings,
    slices), which make bench leaves out to stay within half an hour on a 2-core host."""
    start = time.perf_counter()
    from stageplan.running.launch import measure_link

    link = measure_link(2)  # what a user runs first (stageplan link): the plans price boundaries with it
    runs, gains, parts, speeds, syncs = [], [], [], [], []
    idle_rows: list[list[object]] = []
    idle_pairs: list[tuple[float, float, float]] = []
    err_wall, err_cpu, err_step, err_machine, err_pipe = [], [], [], [], []
    tune_steps: dict[int, int] = {}
    cross: list[dict[str, object]] = []
    kernels: list[float] = []  # the fixed kernel before each run the calibration section measures
    gain_ratios: list[float] = []
    for model, options in MODELS + (PROBE_MODELS if probes else []):
        workload = build_workload(model, options)
        for m in (4, 8):
            for schedule in ("GPipe", "1F1B"):
                profile = stageplan.profile_model(workload, microbatch_size=workload.batch_size // m,
                                                  min_time_s=PROFILE_S)
                at_profile = _machine_speed()
                speeds.append(at_profile)
                plans = {k: stageplan.plan(profile, 2, num_microbatches=m, schedule=schedule, method=k,
                                           link=link)
                         for k in ("optimal", "uniform")}
                if model == MODELS[0][0] and schedule == "1F1B":
                    tune_steps[m] = _steps(plans["optimal"])
                reports, at_runs = {}, {}
                for name, pl in plans.items():
                    same = next((o for o in reports if plans[o].boundaries == pl.boundaries), None)
                    if same:
                        reports[name] = reports[same]
                        continue
                    at_run = _machine_speed()
                    speeds.append(at_run)
                    at_runs[name] = at_run
                    reports[name] = stageplan.run(model, pl, steps=_steps(pl), warmup=WARMUP,
                                                  factory_options=options)
                    rep = reports[name]
                    err_step.append(abs(rep.step_ratio - 1))
                    walls, cpus, machines, pipes = [], [], [], []
                    for r in rep.ranks:
                        walls.append(r["compute_ratio"] - 1)
                        cpus.append(r["measured_compute_cpu_s"] / r["predicted_compute_s"] - 1)
                        machines.append(r["machine_ratio"] - 1)
                        pipes.append(r["pipeline_ratio"] - 1)
                    err_wall += [abs(x) for x in walls]
                    err_cpu += [abs(x) for x in cpus]
                    err_machine += [abs(x) for x in machines]
                    err_pipe += [abs(x) for x in pipes]
                    runs.append([model, schedule, m, name, " ".join(map(str, pl.boundaries)),
                                 f"{pl.predicted_step_s * 1e3:.1f}",
                                 f"{rep.measured_step_s * 1e3:.1f}", _pct(rep.step_ratio - 1),
                                 " ".join(map(_pct, walls)),
                                 " ".join(map(_pct, cpus)), " ".join(map(_pct, machines)),
                                 " ".join(map(_pct, pipes)), _pct(at_run / at_profile - 1),
                                 f"{rep.meta.get('load_average_1min', float('nan')):.2f}"])
                    parts.append([model, schedule, m, name, *_decompose(profile, pl, rep, link)])
                    for r in rep.ranks:
                        beyond = r.get("after_idle_excess_s")
                        excess = (r["measured_compute_s"] - r["predicted_compute_s"]) * m
                        idle_rows.append([model, schedule, m, name, r["rank"],
                                          r.get("predicted_after_idle_calls"),
                                          _x(r.get("measured_after_idle_calls")),
                                          _x(r.get("after_idle_ratio")),
                                          _x(r.get("back_to_back_ratio")), _x(r["compute_ratio"]),
                                          "-" if beyond is None else f"{beyond * 1e3:+.2f}",
                                          f"{excess * 1e3:+.2f}"])
                        if beyond is not None:
                            idle_pairs.append(
                                (r["after_idle_ratio"] / r["back_to_back_ratio"], beyond, excess))
                    tied = _tied_sync(rep)
                    if tied is not None:
                        syncs.append([model, schedule, m, name, *tied])
                opt, uni = reports["optimal"], reports["uniform"]
                gains.append([model, schedule, m,
                              f"{plans['uniform'].predicted_step_s / plans['optimal'].predicted_step_s:.3f}",
                              f"{uni.measured_step_s / opt.measured_step_s:.3f}"])
                gain_ratios.append(uni.measured_step_s / opt.measured_step_s)
                if model in CALIBRATION_MODELS:
                    kernels.append(at_runs["optimal"])
                    if "uniform" in at_runs:
                        kernels.append(at_runs["uniform"])
                    cross += cross_split(model, options, workload.batch_size, profile, plans, reports, link,
                                         len(cross), kernels)
    print(f"2 ranks, each configuration profiled just before its runs (rounds over >= {PROFILE_S:g} s), runs "
          f"of >= {STEPS} measured steps and >= {RUN_S:g} s after {WARMUP} warm-up; no calibration; plans "
          f"priced with the link measured first ({link['latency_s'] * 1e6:.0f} us, "
          f"{link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; a crossing priced at the larger of that latency "
          f"and the fused exchange's {link.get('exchange_s', 0.0) * 1e6:.0f} us; torch's loop "
          f"{link.get('action_s', 0.0) * 1e6:.0f} us a chunk action, PipelineStage "
          f"{link.get('chunk_forward_s', 0.0) * 1e6:.0f} / {link.get('chunk_backward_s', 0.0) * 1e6:.0f} us "
          f"a forward / backward: the "
          "replays below price crossings and loop with these); load = 1-minute load average at the run's "
          "start; compute error in two per rank: the rank's layers timed alone after the run (ranks in "
          "turns, as the profiler times them) against the plan (the machine now against at the profile), and "
          "the run against them (the pipeline's own effect; the two multiply to the compute error); "
          "kernel = a fixed kernel's time just before the run / just after the profile (the host's own "
          "drift)")
    print(format_table(["model", "schedule", "m", "method", "split", "predicted ms", "measured ms",
                        "step error",
                        "compute error per rank (wall)", "(thread CPU)", "machine now", "pipeline", "kernel",
                        "load"],
                       runs))
    print(f"\nper-rank compute, |measured/predicted - 1| by wall clock: median "
          f"{statistics.median(err_wall):.1%}, worst {max(err_wall):.1%} over {len(err_wall)} rank runs "
          f"(goal: median <= 10%, worst <= 20%)")
    print(f"per-rank compute, |thread CPU/predicted - 1|:             median "
          f"{statistics.median(err_cpu):.1%}, worst {max(err_cpu):.1%}")
    print(f"  of it, the machine now against at the profile, |alone after the run/predicted - 1|: median "
          f"{statistics.median(err_machine):.1%}, worst {max(err_machine):.1%}; the pipeline, "
          f"|measured/alone after the run - 1|: median {statistics.median(err_pipe):.1%}, worst "
          f"{max(err_pipe):.1%}")
    print(f"step, |measured/predicted - 1|: median {statistics.median(err_step):.1%}, worst "
          f"{max(err_step):.1%} over {len(err_step)} runs (goal: median <= 15%, worst <= 25%)")
    print(f"the machine's fixed kernel over the bench: {min(speeds) * 1e6:.0f}-{max(speeds) * 1e6:.0f} us "
          f"(median {statistics.median(speeds) * 1e6:.0f} us; slowest / fastest "
          f"{max(speeds) / min(speeds):.2f})")
    print("\nwhere measured - predicted step goes (ms per step), on the rank the plan predicts busiest: its "
          "layers inside the pipeline minus their profiled times, its chunks' overhead outside the layers "
          "minus the priced, its optimizer step and tied sync minus the predicted, and the rest (waiting, "
          "transfers, preemption), of which its loop's timed waits on receives minus the simulator's")
    print("then the whole miss in two: the split replayed with every rank's layers at their measured times "
          "(calibrate, per layer) minus the prediction, and the measured step minus that replay (waits and "
          "transfers)")
    print(format_table(["model", "schedule", "m", "method", "miss", "layers", "chunk overhead", "optimizer",
                        "rest", "of it, receive waits", "compute, all ranks", "waits", "rank"], parts))
    print(f"\neach rank's chunk calls after >= {RESUME_GAP_S * 1e3:g} ms without computing (a receive's "
          "wait, the barrier) against those back to back, in the same runs: calls a step (predicted, "
          "measured); where a stage's forwards or backwards ran both ways in a step, measured / planned "
          "seconds of each (medians over steps) and what the calls after idle took a step beyond the "
          "back-to-back pace; the rank's compute ratio and its whole compute excess a step (ms)")
    print(format_table(["model", "schedule", "m", "method", "rank", "after idle pred", "meas", "after idle x",
                        "back to back x", "compute x", "beyond ms", "excess ms"], idle_rows))
    if idle_pairs:
        ratio = statistics.median(a for a, _, _ in idle_pairs)
        print(f"  over {len(idle_pairs)} rank runs with both sorts: a run's after-idle median over its "
              f"back-to-back median, the median of those {ratio:.3f} "
              f"({min(a for a, _, _ in idle_pairs):.3f}-{max(a for a, _, _ in idle_pairs):.3f}); beyond the "
              f"pace median {statistics.median(b for _, b, _ in idle_pairs) * 1e3:+.2f} ms a step, against a "
              f"compute excess median {statistics.median(c for _, _, c in idle_pairs) * 1e3:+.2f} ms")
    if syncs:
        ratios = [float(row[-1]) for row in syncs]
        print("\nthe tied gradients' all-reduce per step, priced from the link's all-reduce probe: measured "
              "on the rank that reaches it last (it waits for no one), and on each rank (the others' include "
              "their wait for it)")
        print(format_table(["model", "schedule", "m", "method", "predicted ms", "measured ms per rank",
                            "last rank's / predicted"],
                           syncs))
        print(f"  last rank's / predicted: median {statistics.median(ratios):.3f}, "
              f"{min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} runs")
    print("\noptimal over uniform: predicted and measured step ratio")
    print(format_table(["model", "schedule", "m", "predicted", "measured"], gains))

    tuned, tune_parts, tune_errors = [], [], []
    figures: dict[str, float | None] = {
        "compute_median": statistics.median(err_wall), "compute_worst": max(err_wall),
        "compute_cpu_median": statistics.median(err_cpu), "compute_cpu_worst": max(err_cpu),
        "machine_median": statistics.median(err_machine), "pipeline_median": statistics.median(err_pipe),
        "step_median": statistics.median(err_step), "step_worst": max(err_step), "runs": len(err_step),
        "rank_runs": len(err_wall), "fixed_kernel_spread": max(speeds) / min(speeds),
        "gain_measured_median": statistics.median(gain_ratios),
        "tied_sync_ratio_median": statistics.median(float(r[-1]) for r in syncs) if syncs else None}
    for m in (4, 8):
        with tempfile.TemporaryDirectory() as tmp:
            result = stageplan.tune("gpt", 2, factory_options=MODELS[0][1], num_microbatches=m,
                                    schedule="1F1B",
                                    steps=tune_steps[m], warmup=WARMUP, runs=TUNE_RUNS, min_time_s=PROFILE_S,
                                    output_dir=tmp)
            # where each plan's median fresh run left tune's calibrated prediction (tune prices without a
            # link: its calibration fits the crossings' delay from the runs)
            calibrated = stageplan.Profile.load(os.path.join(tmp, "profile.json"))
            for name in ("final", "uniform"):
                pl = stageplan.plan(calibrated, 2, num_microbatches=m, schedule="1F1B",
                                    boundaries=result[name]["boundaries"])
                rep = stageplan.RunReport.load(os.path.join(tmp, f"run_{name}.json"))
                tune_parts.append(
                    [m, name, _pct(result[name]["error"]), *_decompose(calibrated, pl, rep, None)])
        first, final, uni = result["rounds"][0], result["final"], result["uniform"]
        predicted_gain = uni["predicted_step_s"] / final["predicted_step_s"]
        measured_gain = result["final_over_uniform_measured"]
        same = result["repeatability_error"]
        figures.update({f"tune_m{m}_final_error": final["error"],
                        f"tune_m{m}_repeatability": None if same is None else abs(same),
                        f"tune_m{m}_prediction_median": result["prediction_error_median"],
                        f"tune_m{m}_prediction_worst": result["prediction_error_worst"],
                        f"tune_m{m}_predictions": len(result["prediction_errors"]),
                        f"tune_m{m}_gain_predicted": predicted_gain,
                        f"tune_m{m}_gain_measured": measured_gain,
                        f"tune_m{m}_rounds": len(result["rounds"])})
        tune_errors += [[m, e["split"], " ".join(map(str, e["boundaries"])),
                         f"{e['predicted_step_s'] * 1e3:.1f}",
                         f"{e['measured_step_s'] * 1e3:.1f}", _pct(e["error"])]
                        for e in result["prediction_errors"]]
        again = final.get("measured_steps_s") or [final["measured_step_s"]]
        tuned.append([m, tune_steps[m], len(result["rounds"]), " ".join(map(str, first["boundaries"])),
                      _pct(first["error"]),
                      " ".join(map(str, final["boundaries"])), f"{final['predicted_step_s'] * 1e3:.1f}",
                      " ".join(f"{x * 1e3:.1f}" for x in again), _pct(final["error"]),
                      f"{max(again) / min(again) - 1:.1%}", f"{predicted_gain:.3f}",
                      f"{measured_gain:.3f}",
                      f"{(measured_gain - 1) / (predicted_gain - 1):.0%}" if predicted_gain > 1 else "-"])
    print(f"\nstageplan tune gpt {MODELS[0][1]} --stages 2 --schedule 1F1B --runs {TUNE_RUNS} --min-time "
          f"{PROFILE_S:g}: the final plan measured on {TUNE_RUNS} fresh runs in turns with uniform (goal: "
          "|error| <= 5%, the median run's; measured gain >= 90% of predicted where the prediction is >= "
          "1.2x; same plan: its fresh runs' slowest / fastest - 1)")
    print(format_table(["m", "steps", "rounds", "first split", "first error", "final split",
                        "final predicted ms",
                        "final measured ms", "final error", "same plan", "predicted gain", "measured gain",
                        "gain realised"], tuned))
    print("\nwhere tune's gain went: each plan's median fresh run against tune's calibrated prediction (ms "
          "per step, as the decomposition above; measured / predicted gain is about (1 + uniform error) / (1 "
          "+ final error))")
    print(format_table(["m", "plan", "error", "miss", "layers", "chunk overhead", "optimizer", "rest",
                        "of it, receive waits", "compute, all ranks", "waits", "rank"], tune_parts))
    print("\ntune's prediction: every other split it ran (the uniform split, earlier rounds), priced from "
          "the "
          "final calibrated profile, against that split's own runs (the final plan's error above is "
          "repeatability: calibrate fits the split it ran)")
    print(format_table(["m", "split", "boundaries", "predicted ms", "measured ms", "error"], tune_errors))
    calibration = print_cross_split(cross, kernels)
    if probes:
        noise_floor(link)
        orders(link)
        objectives(link)
        placement(link)
        crossings()
        slices_in_pipelines()
    print(f"\nexecutor benchmark took {time.perf_counter() - start:.0f} s (load average now "
          f"{os.getloadavg()[0]:.2f})")
    return {"executor": figures, "calibration": calibration}


if __name__ == "__main__":
    import sys

    main(probes="--probes" in sys.argv[1:])
