"""Memory of a multi-rank run: each rank's measured memory against the plan's, and the whole process tree's
resident memory, sampled from outside, against one model's weights.

A 24-block GPT with d = 1280 (1.97 GB of fp32 parameters, untied) is profiled analytically in fp32 (an
estimate on fake tensors: its parameter and saved-activation bytes are exact, its times do not matter here),
planned uniformly on 4 ranks with 4 microbatches, and run on local gloo ranks for 2 steps, retiming included
(on by default). While it runs, the memory of `stageplan run` and all its children is summed every 50 ms
(each process's anonymous pages, and the file-backed pages such as torch's libraries once: checked once a
second against the kernel's proportional set sizes); the peak of that sum is the memory the run needed at
once. Two bounds, printed with pass/fail and recorded (section "memory" of a record in benchmarks/results/,
from which docs/accuracy.md's table is regenerated):

- each rank's RunReport memory_ratio, (its peak - its baseline before its stage) / the plan's memory, within
  1.15 either way;
- the tree's peak <= 2.2 x the weights + 0.6 GB per rank (weights, gradients and some slack, and torch's own
  baseline per process).

    python benchmarks/bench_memory.py                       # this checkout
    python benchmarks/bench_memory.py --reference-repo DIR  # and an older checkout, for the ratio
    python benchmarks/bench_memory.py --timeline            # and each process's resident set once a second
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results

ROOT = Path(__file__).resolve().parents[1]


def _options(d_model: int) -> list[str]:
    return ["--set", "n_layer=24", "--set", f"d_model={d_model}", "--set", "n_head=16", "--set", "seq_len=64",
            "--set", "batch_size=8"]


def _tree_memory(pid: int) -> dict[int, tuple[int, int]]:
    """``pid`` and each of its descendants: (anonymous and shared-memory bytes resident, file-backed bytes
    resident), from /proc/PID/status (RssAnon + RssShmem, RssFile: proc(5))."""
    sizes = {}
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            fields = dict(ln.split(":", 1) for ln in Path(f"/proc/{p}/status").read_text().splitlines()
                          if ln.startswith(("RssAnon:", "RssShmem:", "RssFile:")))
            kib = {k: int(v.split()[0]) * 1024 for k, v in fields.items()}
            sizes[p] = (kib["RssAnon"] + kib.get("RssShmem", 0), kib["RssFile"])
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except (OSError, KeyError, ValueError):
            continue
        stack.extend(int(c) for c in children)
    return sizes


def _tree_bytes(sizes: dict[int, tuple[int, int]]) -> int:
    """The tree's memory at once: every process's anonymous pages (its own: the ranks are spawned, not forked
    from one another) and the file-backed pages once, as the largest process's. Summing each process's
    resident set would count torch's libraries, mapped by all five processes, five times (about 0.08 GB
    each). :func:`_tree_pss` checks this against the kernel's proportional set sizes."""
    return sum(a for a, _ in sizes.values()) + max((f for _, f in sizes.values()), default=0)


def _tree_pss(pids: list[int]) -> dict[int, int]:
    """Each process's proportional set size (a page shared by n processes counts 1/n in each:
    /proc/PID/smaps_rollup, proc(5)), where it could be read; slower to read than status, so read once a
    second."""
    out = {}
    for p in pids:
        try:
            line = next(ln for ln in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()
                        if ln.startswith("Pss:"))
            out[p] = int(line.split()[1]) * 1024
        except (OSError, StopIteration):
            continue
    return out


RATIO_BOUND = 1.15  # each rank's measured / predicted memory, either way
TREE_WEIGHTS_BOUND = 2.2  # the tree's peak, in weights ...
TREE_PER_RANK_BYTES = 0.6e9  # ... plus this per rank


def measure(repo: Path, ranks: int, optimizer: str, d_model: int) -> dict[str, Any]:
    options = _options(d_model)
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "stageplan", "profile", "gpt", *options, "--microbatch-size",
                        "2", "--device", "estimate:h100-sxm", "--dtype", "float32", "-o", "prof.json"],
                       cwd=tmp, env=env, check=True, capture_output=True)
        # a run refuses a plan of a GPU estimate on the CPU, since its times describe that GPU; this bench
        # reads memory only, whose bytes the estimate counts exactly, so the profile is labelled as this CPU's
        prof = json.loads((Path(tmp) / "prof.json").read_text())
        model_bytes = sum(row["param_bytes"] for row in prof["layers"])
        prof["meta"].update(device="cpu", timer="perf_counter")
        (Path(tmp) / "prof.json").write_text(json.dumps(prof))
        subprocess.run([sys.executable, "-m", "stageplan", "plan", "prof.json", "--stages", str(ranks),
                        "--microbatches", "4", "--method", "uniform", "--optimizer", optimizer, "-o",
                        "plan.json"], cwd=tmp, env=env, check=True, capture_output=True)
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "stageplan", "run", "gpt", *options, "--plan",
                                 "plan.json", "--steps", "2", "--warmup", "1", "--timeout", "900",
                                 "--optimizer", optimizer, "-o", "run.json"], cwd=tmp, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        peak = 0
        timeline: list[tuple[float, dict[int, int]]] = []
        checks: list[tuple[int, int]] = []  # (this bench's sum, the kernel's PSS sum), once a second
        while proc.poll() is None:
            sizes = _tree_memory(proc.pid)
            peak = max(peak, _tree_bytes(sizes))
            now = time.perf_counter() - start
            if not timeline or now - timeline[-1][0] >= 1.0:
                timeline.append((now, {p: a + f for p, (a, f) in sizes.items()}))
                pss = _tree_pss(list(sizes))
                # the same processes on both sides, read again right after their PSS (one that started or
                # ended between the two reads is left out)
                again = {p: v for p, v in _tree_memory(proc.pid).items() if p in pss}
                if again and set(again) == set(pss):
                    checks.append((_tree_bytes(again), sum(pss.values())))
            time.sleep(0.05)
        out = proc.stdout.read().decode() if proc.stdout else ""
        failed = out.strip().splitlines()[-1] if proc.returncode != 0 and out.strip() else ""
        report = json.loads((Path(tmp) / "run.json").read_text()) if not failed else {"ranks": []}
    baseline = subprocess.run([sys.executable, "-c", "import resource, torch, torch.distributed; "
                               "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"],
                              capture_output=True, text=True, env=env, check=False)
    if baseline.returncode != 0:  # said, not raised: the run's own figures above still stand
        print(f"(a bare torch process failed: {(baseline.stderr.strip().splitlines() or [''])[-1]})")
    differences = [abs(a / b - 1) for a, b in checks if b]
    # the median: a process exiting between its two reads tears its pages down in between
    pss_median = statistics.median(differences) if differences else None
    return {"peak_tree_bytes": peak, "pss_check": pss_median, "model_bytes": model_bytes,
            "wall_s": time.perf_counter() - start,
            "torch_baseline_bytes": float(baseline.stdout.strip() or "nan"), "failed": failed,
            "ranks": report["ranks"], "timeline": timeline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference-repo", type=Path, default=None)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--optimizer", default="sgd",
                        help="sgd keeps no state: ranks hold weights and gradients")
    parser.add_argument("--timeline", action="store_true",
                        help="print each process's resident set each second")
    parser.add_argument("--d-model", type=int, default=1280, help="the GPT's width (1280: 1.97 GB of fp32)")
    parser.add_argument("--no-record", action="store_true",
                        help="print only: write no record to benchmarks/results/ (a setting other than the "
                        "default's is never recorded)")
    a = parser.parse_args()
    start, t0 = results.host(), time.perf_counter()
    rows = [("this checkout", measure(ROOT, a.ranks, a.optimizer, a.d_model))]
    if a.reference_repo is not None:
        rows.append((f"reference {a.reference_repo}",
                     measure(a.reference_repo, a.ranks, a.optimizer, a.d_model)))
    model_bytes = float(rows[0][1]["model_bytes"])
    bound = TREE_WEIGHTS_BOUND * model_bytes + TREE_PER_RANK_BYTES * a.ranks
    print(f"{a.ranks}-rank run of gpt n_layer=24 d_model={a.d_model} with {a.optimizer}: "
          f"{model_bytes / 4e6:.0f} M parameters, {model_bytes / 1e9:.2f} GB fp32 weights (+ the same again "
          "in gradients)")
    for name, r in rows:
        peak = r["peak_tree_bytes"]
        print(f"{name}: wall {r['wall_s']:.0f} s; one torch process alone "
              f"{r['torch_baseline_bytes'] / 1e9:.2f} GB"
              + (f"; FAILED: {r['failed']}" if r["failed"] else ""))
        for t, sizes in r["timeline"] if a.timeline else []:
            print(f"  t={t:5.1f} s: " + " ".join(f"{pid}:{b / 1e9:.2f}" for pid, b in sorted(sizes.items())))
        for row in r["ranks"]:
            ratio = row.get("memory_ratio")
            ok = ratio is not None and 1 / RATIO_BOUND <= ratio <= RATIO_BOUND
            print(f"  rank {row['rank']}: predicted {row['predicted_memory_bytes'] / 1e9:.3f} GB, measured "
                  f"{(row.get('measured_run_memory_bytes') or 0) / 1e9:.3f} GB over a baseline of "
                  f"{(row.get('measured_baseline_memory_bytes') or 0) / 1e9:.3f} GB (peak "
                  f"{(row.get('measured_peak_memory_bytes') or 0) / 1e9:.3f} GB): ratio "
                  + (f"{ratio:.3f}" if ratio is not None else "n/a")
                  + f" (bound {1 / RATIO_BOUND:.2f}-{RATIO_BOUND:.2f}) {'pass' if ok else 'FAIL'}")
        if r["pss_check"] is not None:
            print("  the tree's sum and the kernel's PSS sum, read together once a second: median difference "
                  f"{r['pss_check']:.1%}")
        print(f"  process tree peak {peak / 1e9:.2f} GB = {peak / model_bytes:.2f} x the weights (bound "
              f"{TREE_WEIGHTS_BOUND} x weights + {TREE_PER_RANK_BYTES / 1e9:.1f} GB x {a.ranks} ranks = "
              f"{bound / 1e9:.2f} GB) {'pass' if 0 < peak <= bound else 'FAIL'}")
    if len(rows) == 2:
        print(f"ratio reference / this checkout: "
              f"{rows[1][1]['peak_tree_bytes'] / rows[0][1]['peak_tree_bytes']:.2f}x")
    default = (a.ranks, a.optimizer, a.d_model) == (4, "sgd", 1280)
    if a.no_record or not default or rows[0][1]["failed"]:
        print("(no record written: " + ("--no-record" if a.no_record else "a setting other than the default"
                                         if not default else "the run failed") + ")")
        return
    path = results.record({"memory": figures(rows[0][1], bound)}, start=start,
                          wall_s=time.perf_counter() - t0)
    results.regenerate()
    print(f"recorded {path.relative_to(results.ROOT)}; regenerated {results.DOC.relative_to(results.ROOT)}")


def figures(r: dict[str, Any], bound: float) -> dict[str, float | int | None]:
    """A run's figures for its record: each rank's measured ÷ predicted as its fold either way (max(x, 1/x),
    so 1.15 is the bound whichever side), their median and worst, and the process tree's peak against its
    bound."""
    folds = [max(x, 1 / x) for x in (row.get("memory_ratio") for row in r["ranks"]) if x]
    return {"rank_fold_median": statistics.median(folds) if folds else None,
            "rank_fold_worst": max(folds) if folds else None,
            "tree_peak_gb": r["peak_tree_bytes"] / 1e9,
            "tree_peak_over_bound": r["peak_tree_bytes"] / bound,
            "tree_pss_check_median": r["pss_check"],
            "baseline_gb": statistics.median(float(row.get("measured_baseline_memory_bytes") or 0)
                                             for row in r["ranks"]) / 1e9 if r["ranks"] else None,
            "wall_s": r["wall_s"]}


if __name__ == "__main__":
    main()
