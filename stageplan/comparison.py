"""stageplan compare: profile once, plan optimal, uniform
and parameter-balanced splits, run each in turns, measure.

Also the pieces compare and tune share: their loop options (:class:`LoopOptions`), the runs in turns, the
median run and the paired speed-up. torch is imported only when a run or a profile starts."""

from __future__ import annotations

import contextlib
import os
import pathlib
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from stageplan.errors import StageplanError
from stageplan.formats.plan import Plan
from stageplan.formats.profile import Profile
from stageplan.formats.runreport import RunReport
from stageplan.formats.schedule import normalize_schedule
from stageplan.host import first_contention
from stageplan.planning.costs import (
    check_ranks,
)
from stageplan.planning.planner import METHODS, as_profile, check_objective, estimate_label, plan
from stageplan.workload import default_microbatch_size

COMPARE_SCHEMA = "stageplan.compare/1"


def peer_plans(prof: Profile, num_chunks: int,
               make: Callable[[tuple[int, ...]], Plan]) -> tuple[dict[str, Plan], dict[str, str]]:
    """The peers' default splits of ``prof`` priced by ``make`` (boundaries -> Plan, under the options of the
    other rows), and for each rule that does not apply here, why (:func:`stageplan.planning.search.
    peer_splits`; DeepSpeed's two rules are the methods uniform and parameters)."""
    from stageplan.formats.interop import named_layers
    from stageplan.planning.search import peer_splits

    names = prof.names
    splits = peer_splits(names, named_layers(names, prof.meta), num_chunks)
    plans = {k: make(b) for k, b in splits.items() if isinstance(b, tuple)}
    return plans, {k: b for k, b in splits.items() if isinstance(b, str)}


def measured_profile(model: str, factory_options: dict[str, Any] | None, num_microbatches: int | None,
                      profile: Profile | str | os.PathLike[str] | None, progress: bool, command: str,
                      processes: int = 1, timeout_s: float = 1800.0, min_time_s: float = 0.0,
                      order: str | None = None) -> Profile:
    """``profile``, or a fresh profile of ``model`` at the microbatch size of ``num_microbatches`` (with
    ``processes`` > 1, the per-layer median of that many fresh processes:
    :func:`stageplan.running.launch.profile_in_processes`; its rounds spread over ``min_time_s``, its layers
    timed in ``order``: :func:`stageplan.profile_model`); never an analytic estimate, since the commands that
    call this measure runs on this machine."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise StageplanError(f"processes must be an integer >= 1, got {processes!r}; e.g. --processes 3")
    if processes > 1 and profile is not None:
        raise StageplanError(f"--processes {processes} profiles the model in fresh processes, and --profile "
                             "gives the profile to start from; drop one of them")
    if profile is not None and min_time_s:
        raise StageplanError(f"--min-time {min_time_s:g} spreads the rounds of the profile {command} takes, "
                             "and --profile gives the profile to start from; drop one of them")
    if profile is not None and order is not None:
        raise StageplanError(f"--order {order} sets how the profile {command} takes times its layers, and "
                             "--profile gives the profile to start from; drop one of them")
    if profile is None:
        from stageplan.zoo import build_workload

        workload = build_workload(model, factory_options)
        from stageplan.measure import microbatch_size_for

        batch = workload.batch_size
        if num_microbatches is not None and (isinstance(num_microbatches, bool)
                                             or not isinstance(num_microbatches, int)
                                             or num_microbatches < 1):
            raise StageplanError(
                f"--microbatches must be an integer >= 1, got {num_microbatches!r}; e.g. --microbatches 4")
        # refused here, before the profile, as the run would refuse it after
        mb = (
            microbatch_size_for(batch, num_microbatches)
            if num_microbatches
            else default_microbatch_size(batch)
        )
        from stageplan.profiling.profiler import check_min_time
        from stageplan.timing import check_order

        check_min_time(min_time_s)
        check_order(order)
        if processes > 1:
            from stageplan.running.launch import profile_in_processes

            del workload
            prof = profile_in_processes(model, factory_options, processes=processes, microbatch_size=mb,
                                        progress=progress,
                                        timeout_s=timeout_s, min_time_s=min_time_s, order=order)
        else:
            from stageplan.profiling.profiler import profile_model

            prof = profile_model(workload, microbatch_size=mb, progress=progress, min_time_s=min_time_s,
                                 order=order)
    else:
        prof = as_profile(profile)
    if estimate_label(prof.meta):
        raise StageplanError(f"{command} measures runs on this machine, and this profile is an analytic GPU "
                             f"estimate; {command} a profile measured here, or plan the estimate with "
                             f"stageplan plan --compare")
    return prof


@dataclass(frozen=True)
class LoopOptions:
    """What compare and tune share: the model and its options, how to profile it, how to plan and run each
    split, how often, and where to write. Their public keyword arguments fill it; each checks it before its
    profile."""

    model: str
    num_ranks: int
    factory_options: dict[str, Any] | None
    num_microbatches: int | None
    schedule: str
    steps: int
    warmup: int
    profile: Profile | str | os.PathLike[str] | None
    output_dir: str | os.PathLike[str] | None
    timeout_s: float
    progress: bool
    pin_cpus: bool
    processes: int
    runs: int
    min_time_s: float
    objective: str
    order: str | None

    def checked_output(self, *, auto_schedule: bool, written: Callable[[str], bool]) -> pathlib.Path | None:
        """Refuse bad options before the profile (it takes minutes on a large model), and return the output
        folder (None without one); a --profile that is one of the files ``written`` there is refused too.
        ``auto_schedule``: the schedule "auto" is allowed (compare's plan picks it; tune refuses it)."""
        from stageplan._io import check_output_dir

        check_objective(self.objective)
        check_runs(self.runs)
        check_loop(self.num_ranks, self.schedule, self.steps, self.warmup, self.timeout_s, auto=auto_schedule)
        out = check_output_dir(self.output_dir) if self.output_dir is not None else None
        if out is not None:
            refuse_input_among_outputs(out, self.profile, written)
        return out

    def take_profile(self, command: str) -> Profile:
        """The given profile, or a fresh one of the model (:func:`measured_profile`)."""
        return measured_profile(self.model, self.factory_options, self.num_microbatches, self.profile,
                                self.progress,
                                command, self.processes, self.timeout_s, self.min_time_s, self.order)

    def plan(self, prof: Profile, *, method: str | None = "optimal", objective: str = "bottleneck",
             boundaries: tuple[int, ...] | None = None) -> Plan:
        return plan(prof, self.num_ranks, num_microbatches=self.num_microbatches, schedule=self.schedule,
                    method=None if boundaries is not None else method, objective=objective,
                    boundaries=boundaries)

    def run(self, pl: Plan) -> RunReport:
        """One run of ``pl`` on local ranks, as ``stageplan run`` does it."""
        from stageplan.running.launch import run

        return run(self.model, pl, factory_options=self.factory_options, steps=self.steps, warmup=self.warmup,
                   timeout_s=self.timeout_s, pin_cpus=self.pin_cpus)


def compare(
    model: str,
    num_ranks: int,
    *,
    factory_options: dict[str, Any] | None = None,
    num_microbatches: int | None = None,
    schedule: str = "1F1B",
    steps: int = 10,
    warmup: int = 2,
    profile: Profile | str | os.PathLike[str] | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 300.0,
    progress: bool = False,
    pin_cpus: bool = True,
    processes: int = 1,
    runs: int = 1,
    min_time_s: float = 0.0,
    objective: str = "bottleneck",
    order: str | None = None,
) -> dict[str, Any]:
    """Profile ``model`` (or take ``profile``), plan it with optimal, uniform and parameters, run each
    distinct plan and return ``{"methods": {name: {"measured_step_s", "predicted_step_s", ...}}}``; with
    ``output_dir``, also write compare.json (schema ``stageplan.compare/1``), the plans, the run reports and
    the figures there. When every method gives the same boundaries nothing is run: ``result["identical"]``
    says so. ``processes`` > 1 profiles in that many fresh processes and keeps each layer's median
    (:func:`stageplan.profile_in_processes`); ``pin_cpus`` places the ranks as :func:`stageplan.run` does;
    ``min_time_s`` spreads the profile's rounds as
    :func:`stageplan.profile_model` does. ``runs`` > 1 runs every distinct plan that many
    times in turns (:func:`in_turns`): each method's step is the median of its runs (``measured_steps_s``
    lists them; run_NAME.json is the run of that median) and its speed-up the median of the speed-ups of runs
    side by side. ``objective`` is the optimal plan's (:func:`plan`); ``order`` the profile's
    (:func:`stageplan.profile_model`; default: stage)."""
    from pathlib import Path

    loop = LoopOptions(model, num_ranks, factory_options, num_microbatches, schedule, steps, warmup, profile,
                       output_dir,
                       timeout_s, progress, pin_cpus, processes, runs, min_time_s, objective, order)
    out = loop.checked_output(auto_schedule=True, written=_is_compare_output)
    prof = loop.take_profile("compare")
    plans = {name: loop.plan(prof, method=name, objective=objective if name == "optimal" else "bottleneck")
             for name in METHODS}
    # the peers' defaults too, each under its own name (a split equal to another row's is run once)
    peers, not_applicable = peer_plans(prof, plans["optimal"].num_ranks * plans["optimal"].virtual_stages,
                                       lambda b: loop.plan(prof, boundaries=b))
    plans.update(peers)
    identical = len({pl.boundaries for pl in plans.values()}) == 1
    result: dict[str, Any] = {
        "schema": COMPARE_SCHEMA, "model": model, "factory_options": factory_options or {},
        "num_ranks": num_ranks,
        "schedule": plans["optimal"].schedule, "num_microbatches": plans["optimal"].num_microbatches,
        "profile_digest": prof.digest(), "identical": identical, "runs": runs, "objective": objective,
        "methods": {}, "not_applicable": not_applicable}
    if out is None:
        _compare_runs(result, plans, None, loop)
        return result
    # everything is written to a staging folder inside DIR and moved in at the end: a failed compare leaves
    # DIR as it was (it had replaced plan_optimal.json beside an old compare.json), and a finished one leaves
    # no file of an earlier compare's (an old run_optimal.json beside a compare.json that ran nothing)
    import shutil
    import tempfile

    made = not out.exists()
    out.mkdir(exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".stageplan-compare-", dir=out))
    try:
        _compare_runs(result, plans, stage, loop)
        written = {f.name for f in stage.iterdir()}
        for old in out.iterdir():
            if old.is_file() and old.name not in written and _is_compare_output(old.name):
                old.unlink()
        for f in stage.iterdir():
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if made:  # a compare that failed or was interrupted leaves no empty folder of its own behind
            with contextlib.suppress(OSError):
                out.rmdir()  # only when empty: a finished compare's files stay
    return result


def refuse_input_among_outputs(out: pathlib.Path, given: Any, written: Callable[[str], bool]) -> None:
    """Refuse a --profile that is one of the files the command writes into its output folder (compare -o DIR
    with --profile DIR/compare.json replaced the profile)."""
    if isinstance(given, (str, os.PathLike)) and pathlib.Path(given).is_file() and out.is_dir() \
            and written(pathlib.Path(given).name) and os.path.samefile(pathlib.Path(given).parent, out):
        raise StageplanError(f"--profile {str(given)!r} is one of the files this command writes into "
                             f"{str(out)!r}; "
                             "writing them would replace it: move the profile, or give another -o folder")


def _is_compare_output(name: str) -> bool:
    return name in ("compare.json", "balance.png") or (
        name.startswith(("plan_", "run_")) and name.endswith(".json")) or (
        name.startswith("timeline_") and name.endswith(".png"))


def _compare_runs(
    result: dict[str, Any], plans: dict[str, Plan], out: pathlib.Path | None, loop: LoopOptions
) -> None:
    """Run each distinct plan of ``plans`` ``loop.runs`` times, in turns, into ``result``; with ``out``, write
    the plans, the run reports (each method's median run), compare.json and the figures there."""
    identical = bool(result["identical"])
    rows: dict[str, dict[str, Any]] = result["methods"]
    same: dict[str, str | None] = {}
    for name, pl in plans.items():
        if out is not None:
            pl.save(out / f"plan_{name}.json")
        rows[name] = {"predicted_step_s": pl.predicted_step_s, "balance_efficiency": pl.balance_efficiency,
                      "boundaries": list(pl.boundaries), "peak_memory_bytes": list(pl.rank_memory_bytes)}
        # an identical split is the same run: measure it once
        same[name] = next((other for other in same if same[other] is None
                           and plans[other].boundaries == pl.boundaries), None)
    reports = {} if identical else _measured_in_turns(rows, plans, same, out, loop.runs, loop.progress,
                                                      loop.run)
    if out is not None:
        from stageplan._io import write_json_atomic
        from stageplan.plots import plot_stage_balance, plot_timeline, save

        write_json_atomic(out / "compare.json", result)
        save(plot_stage_balance(plans), str(out / "balance.png"))
        for name in ("optimal", "uniform"):
            if name in reports:
                save(plot_timeline(reports[name], title=f"{name}: measured timeline (last step)"),
                     str(out / f"timeline_{name}.png"))
        import matplotlib.pyplot as plt

        plt.close("all")


def _measured_in_turns(rows: dict[str, dict[str, Any]], plans: dict[str, Plan], same: dict[str, str | None],
                       out: pathlib.Path | None, runs: int, progress: bool,
                       measure: Callable[[Plan], RunReport]) -> dict[str, RunReport]:
    """Compare's runs: every distinct plan ``runs`` times in turns; each method's row gets its median step,
    every run's step and its speed-up over uniform; returns each method's median run (written to ``out`` as
    run_NAME.json, once per distinct split)."""
    from stageplan._progress import Progress

    distinct = [name for name in plans if same[name] is None]
    bar = Progress(len(distinct) * runs, "compare", enabled=progress, interval_s=0.0)
    done = [0]

    def one(name: str) -> RunReport:
        bar.update(done[0],
                   f"running {name}" + (f" ({done[0] // len(distinct) + 1} of {runs})" if runs > 1 else ""))
        rep = measure(plans[name])
        done[0] += 1
        return rep

    measured = dict(zip(distinct, in_turns(distinct, runs, one)))
    bar.close()
    reports: dict[str, RunReport] = {}
    for name in plans:
        reps = measured[same[name] or name]
        reports[name] = median_run(reps)
        if out is not None and same[name] is None:
            reports[name].save(out / f"run_{name}.json")
        rows[name].update({"measured_step_s": statistics.median(r.measured_step_s for r in reps),
                           "measured_steps_s": [r.measured_step_s for r in reps],
                           "measured_step_iqr_s": reports[name].measured_step_iqr_s,
                           "measured_peak_activation_bytes": [r["measured_peak_activation_bytes"]
                                                              for r in reports[name].ranks],
                           "same_run_as": same[name],
                           "distorted": first_contention(reps)})
    base = measured[same["uniform"] or "uniform"]
    for name, row in rows.items():
        row["speedup_over_uniform"] = paired_speedup(base, measured[same[name] or name])
    return reports


def check_loop(num_ranks: object, schedule: str, steps: object, warmup: object, timeout_s: object,
                auto: bool = False) -> None:
    """compare's and tune's ranks, schedule, steps and timeout, refused before their profile (they were
    refused only after it: minutes on a large model)."""
    from stageplan.running.launch import check_steps_and_timeout

    check_ranks(num_ranks)  # as plan refuses it
    if not (auto and schedule == "auto"):
        # compare's plan() picks the schedule itself; tune refuses it, as before
        normalize_schedule(schedule)
    check_steps_and_timeout(steps, warmup, timeout_s)


def check_runs(runs: object) -> None:
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise StageplanError(f"runs must be an integer >= 1, got {runs!r}; e.g. --runs 3")


def in_turns(items: Sequence[Any], runs: int, measure: Callable[[Any], RunReport]) -> list[list[RunReport]]:
    """Each of ``items`` measured ``runs`` times in turns (A B A B ...), one list of reports per item: a
    shared machine's speed drifts over the minutes this takes (docs/accuracy.md), and in turns the drift falls
    on every item alike instead of on whichever ran last."""
    out: list[list[RunReport]] = [[] for _ in items]
    for _ in range(runs):
        for reps, item in zip(out, items):
            reps.append(measure(item))
    return out


def median_run(reports: Sequence[RunReport]) -> RunReport:
    """The run whose step is the median of ``reports``' (the lower of the two middle ones for an even count).

    >>> from types import SimpleNamespace as R
    >>> median_run([R(measured_step_s=3.0), R(measured_step_s=1.0), R(measured_step_s=2.0)]).measured_step_s
    2.0
    """
    ordered = sorted(reports, key=lambda r: r.measured_step_s)
    return ordered[(len(ordered) - 1) // 2]


def paired_speedup(base: Sequence[RunReport], other: Sequence[RunReport]) -> float | None:
    """The median over turns of base step / other step, each
    pair run side by side (a single run each: their ratio).

    >>> from types import SimpleNamespace as R
    >>> paired_speedup(
    ...     [R(measured_step_s=2.0), R(measured_step_s=3.0)], [R(measured_step_s=1.0), R(measured_step_s=3.0)]
    ... )
    1.5
    """
    ratios = [b.measured_step_s / o.measured_step_s for b, o in zip(base, other) if o.measured_step_s]
    return statistics.median(ratios) if ratios else None
