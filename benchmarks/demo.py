"""make demo: profile the built-in skewed GPT, measure the link between 2 local ranks, plan 2 stages (optimal
and uniform) priced with it, run both on 2 local CPU processes, and print predicted vs measured plus the
measured speed-up of optimal over uniform."""

from __future__ import annotations

import time
from pathlib import Path

import stageplan
from stageplan.comparison import peer_plans
from stageplan.host import first_contention, slower_explained
from stageplan.planning.planner import METHODS
from stageplan.report import compare_table, profile_table, run_table
from stageplan.zoo import build_workload

OUT = Path("out/demo")
OPTIONS = {"vocab_size": 16384}  # a skewed vocabulary: the LM head costs about eight blocks


def main() -> None:
    start = time.perf_counter()
    OUT.mkdir(parents=True, exist_ok=True)
    print("== 1. profile the built-in 'gpt' (embedding, 6 blocks, LM head over a 16384-token vocabulary)")
    workload = build_workload("gpt", OPTIONS)
    profile = stageplan.profile_model(workload, microbatch_size=2, progress=True)
    profile.save(OUT / "profile.json")
    print(profile_table(profile))

    print("\n== 1b. measure the link between 2 local ranks (stageplan link --ranks 2 -o out/demo/link.json)")
    from stageplan.running.launch import measure_link

    link = measure_link(2, output=OUT / "link.json")
    print(f"latency {link['latency_s'] * 1e6:.0f} us, bandwidth {link['bandwidth_bytes_per_s'] / 1e9:.2f} "
          f"GB/s, fused exchange {link['exchange_s'] * 1e6:.0f} us, torch's schedule loop "
          f"{link.get('action_s', 0.0) * 1e6:.0f} us per chunk action")

    print("\n== 2. plan 2 stages, 1F1B, 4 microbatches, priced with that link: optimal vs the baselines")
    plans = {m: stageplan.plan(profile, 2, num_microbatches=4, schedule="1F1B", method=m, link=link)
             for m in METHODS}
    peers, not_applicable = peer_plans(profile, 2, lambda b: stageplan.plan(
        profile, 2, num_microbatches=4, schedule="1F1B", boundaries=b, link=link))
    print(compare_table({**plans, **peers}, not_applicable))

    reports = {}
    for step, method in (("3a", "optimal"), ("3b", "uniform")):
        print(f"\n== {step}. run the {method} plan on 2 CPU processes (gloo, one thread each), checked "
              f"against one process")
        plans[method].save(OUT / f"plan_{method}.json")
        reports[method] = stageplan.run("gpt", plans[method], steps=8, warmup=2, check=True,
                                        factory_options=OPTIONS, output=OUT / f"run_{method}.json")
        print(run_table(reports[method]))

    opt, uni = reports["optimal"], reports["uniform"]
    print("\n== 4. predicted vs measured")
    for method, rep in reports.items():
        print(f"{method:>8}: step predicted {rep.predicted_step_s * 1e3:7.2f} ms, measured "
              f"{rep.measured_step_s * 1e3:7.2f} ms, measured/predicted {rep.step_ratio:.3f}")
    measured = uni.measured_step_s / opt.measured_step_s
    predicted = uni.predicted_step_s / opt.predicted_step_s
    print(f"measured speed-up of optimal over uniform (DeepSpeed's equal layers): {measured:.3f}x "
          f"(predicted {predicted:.3f}x)")
    distorted = first_contention(reports.values())
    if distorted:
        print(f"warning: {distorted}")
    why = slower_explained(measured, predicted, distorted)
    if why:
        print(f"note: {why}")
    print(f"files in {OUT}/; demo took {time.perf_counter() - start:.0f} s")
    print("\nnext: look at the plan's figure (stageplan show out/demo/plan_optimal.json --plot "
          "out/demo/plan.png),\nthe measured timeline (stageplan show out/demo/run_optimal.json --plot "
          "out/demo/run.png), and\nnotebooks/03_predicted_vs_measured.ipynb (make jupyter); "
          "measured/predicted far from 1 means the\nprofile's conditions differ from the run's: stageplan "
          "calibrate PROFILE RUN -o CALIBRATED closes the loop")


if __name__ == "__main__":
    main()
