"""stageplan tune: run the plan, calibrate the profile
from the run, plan again, until the split stops moving."""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any

from stageplan.calibration import calibrate
from stageplan.comparison import (
    LoopOptions,
    in_turns,
    median_run,
    paired_speedup,
)
from stageplan.errors import StageplanError
from stageplan.formats.plan import Plan
from stageplan.formats.profile import Profile
from stageplan.formats.runreport import RunReport
from stageplan.host import first_contention

TUNE_SCHEMA = "stageplan.tune/1"
# what tune -o DIR writes: the final plan, the calibrated profile it was planned from, the median runs of the
# final and the uniform plans, and the record of the rounds
TUNE_OUTPUTS = ("plan.json", "profile.json", "run_final.json", "run_uniform.json", "tune.json")


def tune(
    model: str,
    num_ranks: int,
    *,
    factory_options: dict[str, Any] | None = None,
    num_microbatches: int | None = None,
    schedule: str = "1F1B",
    rounds: int = 3,
    steps: int = 20,
    warmup: int = 3,
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
    """Close the loop: profile, plan, run, calibrate, plan again, until the plan stops changing or after
    ``rounds`` rounds; then run the final plan once more (its prediction error is measured on that fresh run,
    not on the runs it was calibrated on) and the uniform split once, for reference. ``runs`` > 1 runs each
    round's plan that many times and calibrates from its median run (:func:`median_run`: one run's window
    catches one moment of a drifting machine), and runs the final and uniform plans that many times in turns
    (:func:`in_turns`): the final error is its median run's, and the final-over-uniform gain the median of the
    gains of runs side by side; ``measured_steps_s`` lists every run.

    Every run measures ``steps`` steps after ``warmup``: a step's median varies between runs of one plan (less
    over more steps: docs/accuracy.md), and the final error cannot be reliably smaller than that spread.

    ``processes`` > 1 profiles in that many fresh processes (each layer's median), ``min_time_s`` spreads the
    profile's rounds as :func:`stageplan.profile_model` does, ``pin_cpus`` places the ranks as
    :func:`stageplan.run` does. ``objective`` is every round's plan's (:func:`plan`): "step" tunes for the
    lowest predicted step. ``order`` is the first profile's (:func:`stageplan.profile_model`: stage, the
    default, or layer); each run's retiming follows it.

    Returns ``{"rounds": [{"boundaries", "predicted_step_s", "measured_step_s"}, ...], "final": {...},
    "uniform": {...}}``; with ``output_dir``, writes there ``plan.json`` (the final plan), ``profile.json``
    (the calibrated profile it and the uniform reference were priced from), ``run_final.json`` and
    ``run_uniform.json``
    (each plan's median fresh run: ``stageplan show``/``calibrate`` read them) and ``tune.json``.
    """

    from stageplan._io import write_json_atomic

    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise StageplanError(f"rounds must be an integer >= 1, got {rounds!r}; e.g. --rounds 3")
    loop = LoopOptions(model, num_ranks, factory_options, num_microbatches, schedule, steps, warmup, profile,
                       output_dir,
                       timeout_s, progress, pin_cpus, processes, runs, min_time_s, objective, order)
    out = loop.checked_output(auto_schedule=False, written=lambda name: name in TUNE_OUTPUTS)
    prof = loop.take_profile("tune")

    def row(pl: Plan, *reps: RunReport) -> dict[str, Any]:
        step = statistics.median(r.measured_step_s for r in reps)
        entry = {"boundaries": list(pl.boundaries), "predicted_step_s": pl.predicted_step_s,
                 "measured_step_s": step, "error": step / pl.predicted_step_s - 1.0,
                 "distorted": first_contention(reps)}
        return entry if len(reps) == 1 else {**entry, "measured_steps_s": [r.measured_step_s for r in reps]}

    rows: list[dict[str, Any]] = []
    current = loop.plan(prof, objective=objective)
    for k in range(rounds):
        reps = [loop.run(current) for _ in range(runs)]
        rep = median_run(reps)
        rows.append(row(current, *reps))
        if progress:  # a line per round on stderr; the caller prints the result
            print(f"tune round {k + 1}: boundaries {list(current.boundaries)}, predicted "
                  f"{current.predicted_step_s * 1e3:.1f} ms, measured "
                  f"{rows[-1]['measured_step_s'] * 1e3:.1f} ms "
                  f"({rows[-1]['error']:+.1%})", file=sys.stderr, flush=True)
        prof = calibrate(prof, rep)
        following = loop.plan(prof, objective=objective)
        changed = following.boundaries != current.boundaries
        current = following
        if not changed:
            break
    uniform_plan = loop.plan(prof, method="uniform")
    final_runs, uniform_runs = in_turns([current, uniform_plan], runs, loop.run)
    final, uniform = row(current, *final_runs), row(uniform_plan, *uniform_runs)
    result = {"schema": TUNE_SCHEMA, "model": model, "factory_options": factory_options or {},
              "num_ranks": num_ranks,
              "schedule": current.schedule, "num_microbatches": current.num_microbatches, "rounds": rows,
              "final": final, "uniform": uniform, "runs": runs, "objective": objective,
              "final_over_uniform_measured": paired_speedup(uniform_runs, final_runs),
              "final_prediction_error": final["error"]}
    if out is not None:
        out.mkdir(exist_ok=True)
        current.save(out / "plan.json")
        prof.save(out / "profile.json")  # what the final plan and the uniform reference were priced from
        median_run(final_runs).save(out / "run_final.json")
        median_run(uniform_runs).save(out / "run_uniform.json")
        write_json_atomic(out / "tune.json", result)
    return result
