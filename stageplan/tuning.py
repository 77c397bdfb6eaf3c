"""stageplan tune: run the plan, calibrate the profile
from the run, plan again, until the split stops moving."""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable
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
from stageplan.planning.planner import plan

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

    Two errors judge the result (:func:`judged`): ``repeatability_error``, the final plan's fresh runs
    against its prediction (the split calibrate was fit to, so this is how far one run lands from the next),
    and ``prediction_errors``, every other split tune ran (the uniform split, earlier rounds) priced from the
    final profile against its own measurement, with their median and worst.

    Returns ``{"rounds": [{"boundaries", "predicted_step_s", "measured_step_s"}, ...], "final": {...},
    "uniform": {...}, "repeatability_error", "prediction_errors": [...], ...}``; with ``output_dir``,
    writes there ``plan.json`` (the final plan), ``profile.json`` (the calibrated profile it and the uniform
    reference were priced from), ``run_final.json`` and ``run_uniform.json`` (each plan's median fresh run:
    ``stageplan show``/``calibrate`` read them) and ``tune.json``.
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
    errors = judged(rows, final, uniform,
                    lambda bounds: plan(prof, num_ranks, num_microbatches=current.num_microbatches,
                                        schedule=current.schedule, boundaries=bounds).predicted_step_s)
    result = {"schema": TUNE_SCHEMA, "model": model, "factory_options": factory_options or {},
              "num_ranks": num_ranks,
              "schedule": current.schedule, "num_microbatches": current.num_microbatches, "rounds": rows,
              "final": final, "uniform": uniform, "runs": runs, "objective": objective,
              "final_over_uniform_measured": paired_speedup(uniform_runs, final_runs),
              "final_prediction_error": final["error"], **errors}
    if out is not None:
        out.mkdir(exist_ok=True)
        current.save(out / "plan.json")
        prof.save(out / "profile.json")  # what the final plan and the uniform reference were priced from
        median_run(final_runs).save(out / "run_final.json")
        median_run(uniform_runs).save(out / "run_uniform.json")
        write_json_atomic(out / "tune.json", result)
    return result


def judged(rounds: list[dict[str, Any]], final: dict[str, Any], uniform: dict[str, Any],
           priced: Callable[[list[int]], float]) -> dict[str, Any]:
    """tune's two errors, from its rows (each ``{"boundaries", "predicted_step_s", "measured_step_s"}``).

    The last round's run is the one the final profile was calibrated on, and calibrate fits a crossing delay
    so that the profile predicts that run's step exactly; the same split run again therefore measures how
    far one run of a plan lands from the next, not how well the model predicts. So:

    - ``repeatability_error``: the final plan's fresh runs against its prediction, where the final split is
      the calibrating split (else None: the final plan is then a prediction and is judged with the others);
    - ``prediction_errors``: every other split tune ran (the uniform split's fresh runs, earlier rounds,
      the final plan where it moved after the last calibration), each priced again from the final profile
      (``priced(boundaries)``, its predicted step in seconds) against that split's own measurement, which
      the final profile was not fit to; with their median and worst |measured / predicted - 1|
      (``prediction_error_median``, ``prediction_error_worst``; None where tune ran no other split).

    >>> r = [{"boundaries": [0, 2, 4], "measured_step_s": 1.2}, {"boundaries": [0, 3, 4],
    ...      "measured_step_s": 1.0}]
    >>> out = judged(r, {"boundaries": [0, 3, 4], "predicted_step_s": 1.0, "measured_step_s": 1.05},
    ...              {"boundaries": [0, 2, 4], "measured_step_s": 1.1}, lambda b: {2: 1.0, 3: 1.0}[b[1]])
    >>> round(out["repeatability_error"], 3), [round(e["error"], 3) for e in out["prediction_errors"]]
    (0.05, [0.1, 0.2])
    """
    fit = list(rounds[-1]["boundaries"])
    others = [("uniform", uniform)] + [(f"round {k}", r) for k, r in enumerate(rounds[:-1], 1)]
    same = list(final["boundaries"]) == fit
    if not same:
        others.insert(0, ("final", final))
    errors = []
    for name, r in others:
        if list(r["boundaries"]) == fit:  # a fresh run of the calibrating split: repeatability
            continue
        predicted = priced(list(r["boundaries"]))
        errors.append({"split": name, "boundaries": list(r["boundaries"]), "predicted_step_s": predicted,
                       "measured_step_s": r["measured_step_s"],
                       "error": r["measured_step_s"] / predicted - 1.0})
    size = [abs(e["error"]) for e in errors]
    repeat = final["measured_step_s"] / final["predicted_step_s"] - 1.0 if same else None
    return {"calibrated_on": fit, "repeatability_error": repeat,
            "prediction_errors": errors,
            "prediction_error_median": statistics.median(size) if size else None,
            "prediction_error_worst": max(size) if size else None}
