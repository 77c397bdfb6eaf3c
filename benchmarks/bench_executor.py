"""Executor benchmark: gpt with a skewed 16384-token vocabulary (its LM head costs ~8 blocks) on 2 CPU ranks,
GPipe and 1F1B, m in {4, 8}.

Prints, per configuration: measured step time per method and the ratios uniform/optimal and
parameters/optimal; predicted vs measured per-rank compute and step; measured vs predicted peak activation
bytes; and the step prediction error before and after calibration (re-plan from the calibrated profile, run again).
"""

from __future__ import annotations

import statistics
import time

import stageplan
from stageplan.api import METHODS, build_workload
from stageplan.report import format_table

STEPS, WARMUP = 8, 2
OPTIONS = {"vocab_size": 16384}


def main() -> None:
    start = time.perf_counter()
    workload = build_workload("gpt", OPTIONS)
    rows, err_compute, err_step, act_ratio, calib = [], [], [], [], []
    for m in (4, 8):
        profile = stageplan.profile_model(workload, microbatch_size=workload.batch_size // m)
        for schedule in ("GPipe", "1F1B"):
            plans = {k: stageplan.plan(profile, 2, num_microbatches=m, schedule=schedule, method=k) for k in METHODS}
            reports = {}
            for name, pl in plans.items():
                same = next((o for o in reports if plans[o].boundaries == pl.boundaries), None)
                reports[name] = reports[same] if same else stageplan.run("gpt", pl, steps=STEPS, warmup=WARMUP, factory_options=OPTIONS)
            opt = reports["optimal"]
            rows.append([schedule, m, " ".join(map(str, plans["optimal"].boundaries)), " ".join(map(str, plans["uniform"].boundaries)),
                         f"{opt.measured_step_s * 1e3:.1f}", f"{reports['uniform'].measured_step_s * 1e3:.1f}",
                         f"{reports['parameters'].measured_step_s * 1e3:.1f}",
                         f"{reports['uniform'].measured_step_s / opt.measured_step_s:.3f}",
                         f"{reports['parameters'].measured_step_s / opt.measured_step_s:.3f}",
                         f"{plans['uniform'].predicted_step_s / plans['optimal'].predicted_step_s:.3f}"])
            for rep in {id(r): r for r in reports.values()}.values():
                err_step.append(abs(rep.step_ratio - 1))
                for r in rep.ranks:
                    err_compute.append(abs(r["compute_ratio"] - 1))
                    act_ratio.append(r["activation_ratio"])
            calibrated = stageplan.calibrate(profile, opt)
            replanned = stageplan.plan(calibrated, 2, num_microbatches=m, schedule=schedule)
            after = stageplan.run("gpt", replanned, steps=STEPS, warmup=WARMUP, factory_options=OPTIONS)
            calib.append([schedule, m, f"{opt.step_ratio:.3f}", f"{abs(opt.step_ratio - 1):.1%}",
                          " ".join(map(str, replanned.boundaries)), f"{after.step_ratio:.3f}", f"{abs(after.step_ratio - 1):.1%}"])
    print(f"gpt {OPTIONS}, 2 ranks: measured step time (ms, median of {STEPS} steps) per method; ratio = method / optimal")
    print(format_table(["schedule", "m", "optimal split", "uniform split", "optimal", "uniform", "parameters",
                        "uniform/optimal", "parameters/optimal", "predicted uniform/optimal"], rows))
    print(f"\nper-rank compute, |measured/predicted - 1|: median {statistics.median(err_compute):.1%}, "
          f"max {max(err_compute):.1%} over {len(err_compute)} rank runs")
    print(f"step time, |measured/predicted - 1|: median {statistics.median(err_step):.1%}, max {max(err_step):.1%} "
          f"over {len(err_step)} runs")
    print(f"peak activation bytes, measured/predicted: median {statistics.median(act_ratio):.4f}, "
          f"range {min(act_ratio):.4f}..{max(act_ratio):.4f}")
    print("\ncalibration: measured/predicted step before, and after re-planning from the calibrated profile")
    print(format_table(["schedule", "m", "before", "error", "re-planned split", "after", "error"], calib))
    print(f"\nexecutor benchmark took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
