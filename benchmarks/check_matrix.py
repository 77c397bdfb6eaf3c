"""--check over the replicas' matrix: every sharding (ddp, zero1, fsdp) x schedule (1F1B, Interleaved1F1B with
v = 2) x mesh pp x dp (2 x 2, 1 x 4, 4 x 1) on the tied GPT (vocab 512, microbatch 2, m = 4, Adam), each run
of 2 steps after 1 warm-up compared with one process training the whole global batch.

The model has n_layer = 2 (4 profiled layers: embedding, two blocks, head) except 4 x 1 Interleaved1F1B, whose
8 stages need 8 layers: n_layer = 6 there. One line a combination: the mesh, sharding, schedule, n_layer,
whether --check passed, the largest gradient difference in the last step and the largest parameter
difference after the steps (both by FQN, on every replica), the largest loss difference, and the run's wall
seconds. Exits 1 when any combination fails or is refused.

The gradients are compared on their own because Adam (the default, as the integration tests) divides each
gradient by its own running size: a gradient off by a constant factor (summed over the replicas instead of
averaged) steps the parameters the same. --optimizer sgd (lr 0.05) runs the sweep with plain SGD.

Run alone (about 7 minutes on 2 cores): python benchmarks/check_matrix.py [--mesh 2x2 ...]
[--sharding ddp ...] [--schedule 1F1B ...] [--optimizer sgd]."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

from stageplan.errors import RunError, StageplanError
from stageplan.planning.planner import plan
from stageplan.profiling.profiler import profile_model
from stageplan.running.launch import run
from stageplan.zoo import build_workload

MESHES = {"2x2": (2, 2), "1x4": (1, 4), "4x1": (4, 1)}
SHARDINGS = ("ddp", "zero1", "fsdp")
SCHEDULES = {"1F1B": 1, "Interleaved1F1B": 2}  # schedule: virtual stages a rank
MICROBATCHES, MICROBATCH_SIZE = 4, 2
BASE = {"vocab_size": 512, "tied": True}


def n_layer_for(p: int, v: int) -> int:
    # the profile has n_layer + 2 layers (embedding and head besides the blocks) and each of the p x v
    # stages needs one; the test's two blocks wherever they are enough
    return max(2, p * v - 2)


def check_one(profiles: dict[int, Path], p: int, d: int, sharding: str, schedule: str,
              optimizer: str = "adam") -> dict[str, object]:
    v = SCHEDULES[schedule]
    n_layer = n_layer_for(p, v)
    options = {**BASE, "n_layer": n_layer}
    row: dict[str, object] = {"mesh": f"{p}x{d}", "sharding": sharding, "schedule": schedule,
                              "n_layer": n_layer}
    t0 = time.perf_counter()
    try:
        pl = plan(str(profiles[n_layer]), p, num_microbatches=MICROBATCHES, schedule=schedule,
                  virtual_stages=v, data_parallel=d, sharding=sharding, optimizer=optimizer)
        with warnings.catch_warnings():
            # "4 local ranks share 2 CPU cores": a fact of this machine, not of the check
            warnings.filterwarnings("ignore", message=r".*local ranks share .* CPU cores")
            batch = MICROBATCH_SIZE * MICROBATCHES * d
            report = run("gpt", pl, factory_options={**options, "batch_size": batch}, steps=2,
                         warmup=1, check=True, retime=False, timeout_s=600)
    except (StageplanError, RunError) as e:  # a refusal or a rank's failure: a line, not the end of the sweep
        row.update(passed=False, error=f"{type(e).__name__}: {e}", wall_s=time.perf_counter() - t0)
        return row
    check = report.check or {}
    row.update(passed=bool(check.get("passed")), max_param_diff=check.get("max_param_diff"),
               max_grad_diff=check.get("max_grad_diff"), worst_grad=check.get("worst_grad"),
               worst_param=check.get("worst_param"), max_loss_diff=check.get("max_loss_diff"),
               params_compared=check.get("params_compared"), hint=check.get("hint"),
               wall_s=time.perf_counter() - t0)
    return row


def _e(x: object) -> str:
    return f"{x:.2e}" if isinstance(x, float) else "-"


def line(row: dict[str, object]) -> str:
    head = (f"{row['mesh']:>4} {row['sharding']:<5} {row['schedule']:<15} n_layer={row['n_layer']} "
            f"{'PASS' if row['passed'] else 'FAIL'}")
    if "error" in row:
        return f"{head}  refused or failed in {row['wall_s']:.1f} s: {row['error']}"
    return (f"{head}  max|grad diff| {_e(row['max_grad_diff'])} ({row['worst_grad'] or '-'})  "
            f"max|param diff| {_e(row['max_param_diff'])} ({row['worst_param'] or '-'})  "
            f"max|loss diff| {_e(row['max_loss_diff'])}  params compared {row['params_compared']}  "
            f"wall {row['wall_s']:.1f} s" + (f"  hint: {row['hint']}" if row["hint"] else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", nargs="+", choices=list(MESHES), default=list(MESHES))
    ap.add_argument("--sharding", nargs="+", choices=SHARDINGS, default=list(SHARDINGS))
    ap.add_argument("--schedule", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    ap.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    args = ap.parse_args(argv)
    cases = [(*MESHES[m], s, sched) for m in args.mesh for sched in args.schedule for s in args.sharding]
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="check-matrix-") as tmp:
        profiles: dict[int, Path] = {}
        for n_layer in sorted({n_layer_for(p, SCHEDULES[sched]) for p, _, _, sched in cases}):
            profiles[n_layer] = Path(tmp) / f"gpt{n_layer}.json"
            profile_model(build_workload("gpt", {**BASE, "n_layer": n_layer}),
                          microbatch_size=MICROBATCH_SIZE, warmup=0, repeats=1).save(profiles[n_layer])
        for p, d, sharding, schedule in cases:
            rows.append(check_one(profiles, p, d, sharding, schedule, args.optimizer))
            print(line(rows[-1]), flush=True)
    failed = [r for r in rows if not r["passed"]]
    measured = [x for r in rows if isinstance(x := r.get("max_param_diff"), float)]
    grads = [x for r in rows if isinstance(x := r.get("max_grad_diff"), float)]
    print(f"{args.optimizer}: {len(rows) - len(failed)} of {len(rows)} passed; largest gradient difference "
          f"{max(grads, default=0.0):.2e}, parameter difference {max(measured, default=0.0):.2e}; "
          f"{time.perf_counter() - t0:.0f} s in all", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
