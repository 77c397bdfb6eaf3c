"""A layout's replicas run against their prediction: time on 2 ranks, memory on 4.

Time: the skewed GPT (gpt --set vocab_size=16384, microbatch 2), 1F1B, m = 4, on 2 local ranks, one per
core: pp x dp = 2 x 1, and 1 x 2 under ddp, zero1 and fsdp, the replicas' sync priced with the link
measured here (stageplan link --ranks 2 --data-parallel 2: the replicas' own all-reduce). Each run's
|measured / predicted - 1| of the step, and of each rank's data-parallel sync.
The 2 x 2 runs (four ranks on two cores) are printed as information.

Memory: a 12-block GPT of width 1280 (about 1 GB of fp32 weights, estimated on fake tensors: its bytes are
exact) planned 2 x 2 with Adam under each sharding, run 1 step after 1 warm-up: each rank's parameters,
gradients, shards and optimizer states held against the plan's, by kind, and its resident memory above its
baseline against the plan's total.

Ranking: the 4-rank layouts of the skewed GPT (4 x 1; 2 x 2 and 1 x 4 under each sharding), each run 3
times round-robin; every pair predicted apart by more than twice its measured spread, measured in the
predicted order or not.

Run alone: python benchmarks/bench_replicas.py [--no-memory] [--no-ranking] [--only-ranking]."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

from stageplan.planning.planner import plan
from stageplan.profiling.profiler import profile_model
from stageplan.running.launch import measure_link, run
from stageplan.zoo import build_workload

SKEWED = {"vocab_size": 16384}
SHARDINGS = ("ddp", "zero1", "fsdp")
KINDS = ("params", "grads", "master", "optimizer")


def _err(measured: float | None, predicted: float | None) -> float | None:
    return abs(measured / predicted - 1) if measured is not None and predicted else None


def _time(tmp: Path) -> dict[str, float | int | None]:
    figures: dict[str, float | int | None] = {}
    prof = profile_model(build_workload("gpt", SKEWED), microbatch_size=2, warmup=2, repeats=5)
    link = measure_link(2, data_parallel=2, output=tmp / "link.json")
    steps, syncs = [], []
    for p, d, sharding in [(2, 1, "ddp"), *((1, 2, s) for s in SHARDINGS)]:
        pl = plan(prof, p, num_microbatches=4, data_parallel=d, sharding=sharding, link=link)
        report = run("gpt", pl, factory_options={**SKEWED, "batch_size": 8 * d}, steps=10, warmup=2,
                     retime=False, timeout_s=600)
        step = _err(report.measured_step_s, report.predicted_step_s)
        steps.append(step)
        rows = [*report.ranks, *report.replicas]
        if d > 1:
            sync = [_err(r.get("measured_dp_sync_s"), r.get("predicted_dp_sync_s")) for r in rows]
            syncs += [s for s in sync if s is not None]
        print(f"{p} x {d} {sharding}: step predicted {report.predicted_step_s * 1e3:.1f} ms, measured "
              f"{report.measured_step_s * 1e3:.1f} ms (|error| {step:.1%}); sync measured/predicted ms "
              + ", ".join(f"{(r.get('measured_dp_sync_s') or 0) * 1e3:.2f}/"
                          f"{(r.get('predicted_dp_sync_s') or 0) * 1e3:.2f}" for r in rows)
              + f"; load {report.meta.get('load_average_1min', 0):.2f}", flush=True)
        figures[f"step_error_{p}x{d}_{sharding}"] = step
    figures["step_error_median"] = statistics.median(s for s in steps if s is not None)
    figures["sync_error_median"] = statistics.median(syncs) if syncs else None
    print(f"step |error| median over the 2-rank runs {figures['step_error_median']:.1%} (goal 15%); sync "
          f"|error| median {figures['sync_error_median']:.1%} (goal 25%)", flush=True)
    for sharding in SHARDINGS:  # information: four ranks share two cores
        pl = plan(prof, 2, num_microbatches=4, data_parallel=2, sharding=sharding, link=link)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the oversubscription warning: said in the line below
            report = run("gpt", pl, factory_options={**SKEWED, "batch_size": 16}, steps=6, warmup=2,
                         retime=False, timeout_s=600)
        cpu = statistics.median(r["measured_compute_cpu_s"] for r in report.ranks)
        wall = statistics.median(r["measured_compute_s"] for r in report.ranks)
        figures[f"step_ratio_2x2_{sharding}"] = report.step_ratio
        print(f"2 x 2 {sharding} (information: 4 ranks on 2 cores): step ratio {report.step_ratio:.2f}, "
              f"compute per microbatch wall {wall * 1e3:.2f} ms, thread CPU {cpu * 1e3:.2f} ms, load "
              f"{report.meta.get('load_average_1min', 0):.2f}", flush=True)
    return figures


def _memory(tmp: Path) -> dict[str, float | int | None]:
    figures: dict[str, float | int | None] = {}
    options = {"n_layer": 12, "d_model": 1280, "n_head": 16, "seq_len": 64, "batch_size": 8}
    # estimated on fake tensors (exact bytes, GPU times that do not matter here), labelled as this CPU's so
    # that run takes it: this bench reads memory only
    from stageplan.profiling.profiler import build_workload_for_profile

    workload = build_workload_for_profile("gpt", options, device="estimate:h100-sxm", dtype="float32")
    prof = profile_model(workload, microbatch_size=2, device="estimate:h100-sxm", dtype="float32")
    data = prof.to_json()
    data["meta"].update(device="cpu", timer="perf_counter")
    (tmp / "big.json").write_text(json.dumps(data))
    weights = sum(x.param_bytes for x in prof.layers)
    print(f"memory: gpt {options}: {weights / 1e9:.2f} GB of fp32 weights, 2 x 2 ranks, Adam", flush=True)
    kind_errors, rss_errors = [], []
    for sharding in SHARDINGS:
        pl = plan(str(tmp / "big.json"), 2, num_microbatches=4, data_parallel=2, sharding=sharding,
                  optimizer="adam")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = run("gpt", pl, factory_options={**options, "batch_size": 16}, steps=1, warmup=1,
                         retime=False, timeout_s=1800)
        for r in sorted([*report.ranks, *report.replicas], key=lambda r: r["global_rank"]):
            held, want = r["measured_memory_by_kind"], r["predicted_memory_by_kind"]
            errors = {k: _err(float(held.get(k, 0)), want.get(k)) for k in KINDS if want.get(k)}
            kind_errors += [e for e in errors.values() if e is not None]
            rss = _err(r.get("measured_run_memory_bytes"), r.get("predicted_memory_bytes"))
            if rss is not None:
                rss_errors.append(rss)
            print(f"  {sharding} rank ({r['mesh']['pp']},{r['mesh']['dp']}): "
                  + ", ".join(f"{k} {float(held.get(k, 0)) / 2**20:.0f}/{want.get(k, 0) / 2**20:.0f} MiB"
                              for k in KINDS)
                  + f"; RSS above baseline {(r.get('measured_run_memory_bytes') or 0) / 2**20:.0f} MiB, plan "
                  f"{r['predicted_memory_bytes'] / 2**20:.0f} MiB", flush=True)
    figures["memory_kind_error_worst"] = max(kind_errors) if kind_errors else None
    figures["memory_rss_error_worst"] = max(rss_errors) if rss_errors else None
    print(f"memory by kind: worst |held / plan - 1| {figures['memory_kind_error_worst']:.1%} (goal 15%); RSS "
          f"above baseline: worst {figures['memory_rss_error_worst']:.1%} (goal 20%)", flush=True)
    return figures


# The ranking check: every 4-rank layout of the skewed GPT (pp x dp = 4 x 1; 2 x 2 and 1 x 4 under each
# sharding) at one global batch of 16 samples in microbatches of 2, each run REPEATS times, round-robin (a
# slow spell of the host then touches every layout alike).
RANKING_LAYOUTS = ((4, 1, "ddp"), *((2, 2, s) for s in SHARDINGS), *((1, 4, s) for s in SHARDINGS))
RANKING_BATCH = 16
REPEATS = 3


def _on_this_host(pl: Any, cores: int) -> float:
    """The plan's step on this host's ``cores``, where its p x d ranks share them: the simulated step, or the
    ranks' busy time (every replica's, forward, backward, sync and optimizer) spread over the cores if that
    is longer. A layout whose ranks idle in a pipeline bubble leaves their core to the others; one without
    a bubble keeps every core busy and takes about p x d / cores times its step."""
    sim = pl.simulate()
    return max(sim.step_s, pl.data_parallel * sum(sim.busy_s) / cores)


def _pairs(predicted: dict[Any, float], steps: dict[Any, list[float]]) -> tuple[int, int, list[str]]:
    """(pairs checked, pairs in the predicted order, the swapped pairs' lines): the pairs whose predicted
    steps differ by more than twice the larger of their two measured spreads (max - min over the repeats)."""
    checked = in_order = 0
    swapped = []
    keys = list(predicted)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            spread = max(max(steps[k]) - min(steps[k]) for k in (a, b))
            if abs(predicted[a] - predicted[b]) <= 2 * spread:
                continue
            checked += 1
            fast, slow = (a, b) if predicted[a] < predicted[b] else (b, a)
            measured = statistics.median(steps[fast]), statistics.median(steps[slow])
            if measured[0] < measured[1]:
                in_order += 1
            else:
                swapped.append(f"{fast[0]}x{fast[1]} {fast[2]} < {slow[0]}x{slow[1]} {slow[2]} predicted "
                               f"({predicted[fast] * 1e3:.1f} < {predicted[slow] * 1e3:.1f} ms), measured "
                               f"{measured[0] * 1e3:.1f} >= {measured[1] * 1e3:.1f} ms")
    return checked, in_order, swapped


def _ranking(tmp: Path) -> dict[str, float | int | None]:
    """Among the 4-rank layouts, every pair whose predicted steps differ by more than twice the pair's
    measured spread: measured in the predicted order or not. Four ranks share two cores here, so the check
    is made against each plan's step on this host (:func:`_on_this_host`), and shown against its step on
    four devices too, as information: there a layout whose ranks idle in a pipeline bubble gives their core
    to the others, and the pairs swap."""
    # profiled at the global batch, as the 4 x 1 run takes it (the replicas' runs share it out)
    prof = profile_model(build_workload("gpt", {**SKEWED, "batch_size": RANKING_BATCH}), microbatch_size=2,
                         warmup=2, repeats=5)
    # each mesh's own link: its replicas' all-reduce timed as that mesh places them
    links = {d: measure_link(4, data_parallel=d, output=tmp / f"link4-dp{d}.json") for d in (1, 2, 4)}
    plans = {}
    for p, d, sharding in RANKING_LAYOUTS:
        m = RANKING_BATCH // (2 * d)
        plans[(p, d, sharding)] = plan(prof, p, num_microbatches=m, data_parallel=d, sharding=sharding,
                                       link=links[d])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    host = {k: _on_this_host(pl, cores) for k, pl in plans.items()}
    steps: dict[tuple[int, int, str], list[float]] = {k: [] for k in plans}
    loads = []
    for _ in range(REPEATS):
        for key, pl in plans.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # four ranks on two cores: priced by _on_this_host
                report = run("gpt", pl, factory_options={**SKEWED, "batch_size": RANKING_BATCH}, steps=6,
                             warmup=2, retime=False, timeout_s=600, sharding=key[2])
            steps[key].append(report.measured_step_s)
            loads.append(float(report.meta.get("load_average_1min", 0.0)))
    for key, pl in plans.items():
        print(f"ranking {key[0]} x {key[1]} {key[2]}: predicted {pl.predicted_step_s * 1e3:.1f} ms on 4 "
              f"devices, {host[key] * 1e3:.1f} ms on this host's {cores} cores; measured "
              + ", ".join(f"{x * 1e3:.1f}" for x in steps[key]) + " ms", flush=True)
    pairs = len(plans) * (len(plans) - 1) // 2
    figures: dict[str, float | int | None] = {}
    for name, predicted in (("host", host), ("devices", {k: pl.predicted_step_s for k, pl in plans.items()})):
        checked, in_order, swapped = _pairs(predicted, steps)
        prefix = "ranking_host" if name == "host" else "ranking"
        figures.update({f"{prefix}_pairs_checked": checked, f"{prefix}_pairs_in_order": in_order,
                        f"{prefix}_in_order_share": in_order / checked if checked else None})
        where = f"on this host's {cores} cores" if name == "host" else "on 4 devices (information)"
        print(f"ranking priced {where}: {checked} of {pairs} pairs predicted apart by more than twice their "
              f"spread; {in_order} measured in the predicted order; load {statistics.median(loads):.2f}"
              + "".join(f"\n  swapped: {x}" for x in swapped), flush=True)
    return figures


def main(memory: bool = True, ranking: bool = True) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        figures = _time(Path(tmp))
        if ranking:
            figures.update(_ranking(Path(tmp)))
        if memory:
            figures.update(_memory(Path(tmp)))
    return figures


if __name__ == "__main__":
    if "--only-ranking" in sys.argv:
        with tempfile.TemporaryDirectory() as scratch:
            _ranking(Path(scratch))
    else:
        main(memory="--no-memory" not in sys.argv, ranking="--no-ranking" not in sys.argv)
