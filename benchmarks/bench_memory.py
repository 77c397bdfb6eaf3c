"""Memory of a multi-rank run: the whole process tree's resident memory, sampled, against one model's weights.

A 24-block GPT with d = 1280 (about 1.9 GB of fp32 parameters) runs a uniform 4-rank plan on local gloo ranks,
2 steps. While it runs, the resident set (VmRSS) of `stageplan run` and all its children is summed every 50
ms; the peak of that sum is the memory the run needed at once. Before the house's meta-first ranks, every rank
built the whole model, so the sum was about four models; now each rank materialises only its own stage.

    python benchmarks/bench_memory.py                       # this checkout
    python benchmarks/bench_memory.py --reference-repo DIR  # and an older checkout, for the ratio
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ["--set", "n_layer=24", "--set", "d_model=1280", "--set", "n_head=16", "--set", "seq_len=64",
           "--set", "batch_size=8"]
NAMES = ["tok_emb+pos_emb", *[f"blocks.{i}" for i in range(24)], "ln_f+head"]


def _tree_rss(pid: int) -> int:
    """Bytes resident in ``pid`` and all its descendants."""
    total = 0
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1]) * 1024
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except (OSError, StopIteration):
            continue
        stack.extend(int(c) for c in children)
    return total


def measure(repo: Path, ranks: int, optimizer: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        prof = {"schema": "stageplan.profile/1", "meta": {"batch_size": 8, "microbatch_size": 2,
                                                          "model": "gpt", "named_layers": NAMES[1:-1]},
                "layers": [{"name": n, "forward_s": 1.0, "backward_s": 1.0, "activation_bytes": 0,
                            "output_bytes": 0, "param_bytes": 0} for n in NAMES]}
        (Path(tmp) / "prof.json").write_text(json.dumps(prof))
        subprocess.run([sys.executable, "-m", "stageplan", "plan", "prof.json", "--stages", str(ranks),
                        "--microbatches",
                        "4", "--method", "uniform", "-o", "plan.json"], cwd=tmp, env=env, check=True,
                       capture_output=True)
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "stageplan", "run", "gpt", *OPTIONS, "--plan",
                                 "plan.json", "--steps", "2", "--warmup", "1", "--timeout", "900",
                                 "--optimizer", optimizer], cwd=tmp, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _tree_rss(proc.pid))
            time.sleep(0.05)
        out = proc.stdout.read().decode() if proc.stdout else ""
        failed = out.strip().splitlines()[-1] if proc.returncode != 0 and out.strip() else ""
    baseline = subprocess.run([sys.executable, "-c", "import resource, torch, torch.distributed; "
                               "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"],
                              capture_output=True, text=True, env=env, check=True)
    return {"peak_tree_rss_bytes": peak, "wall_s": time.perf_counter() - start,
            "torch_baseline_bytes": float(baseline.stdout.strip()), "failed": failed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference-repo", type=Path, default=None)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--optimizer", default="sgd",
                        help="sgd keeps no state: ranks hold weights and gradients")
    a = parser.parse_args()
    params = 24 * 12 * 1280 * 1280 + 8192 * 1280 * 2 + 64 * 1280  # blocks, embedding + head, positions
    model_bytes = 4.0 * params
    rows = [("this checkout", measure(ROOT, a.ranks, a.optimizer))]
    if a.reference_repo is not None:
        rows.append((f"reference {a.reference_repo}", measure(a.reference_repo, a.ranks, a.optimizer)))
    print(f"{a.ranks}-rank run of gpt n_layer=24 d_model=1280 with {a.optimizer}: {params / 1e6:.0f} M "
          f"parameters, {model_bytes / 2**30:.2f} GiB fp32 weights (+ the same again in gradients)")
    for name, r in rows:
        peak = r["peak_tree_rss_bytes"]
        print(f"{name:>40}: peak resident (all processes at once) {peak / 2**30:.2f} GiB = "
              f"{peak / model_bytes:.2f} models; one torch process alone "
              f"{r['torch_baseline_bytes'] / 2**30:.2f} GiB; wall {r['wall_s']:.0f} s"
              + (f"; FAILED at that peak: {r['failed']}" if r["failed"] else ""))
    if len(rows) == 2:
        print(f"ratio reference / this checkout: "
              f"{rows[1][1]['peak_tree_rss_bytes'] / rows[0][1]['peak_tree_rss_bytes']:.2f}x")


if __name__ == "__main__":
    main()
