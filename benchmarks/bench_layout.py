"""The layout search's speed and proof: LLaMA-3-70B (82 layers) estimated for the H100 per (b, t), then the
default grid at global batch 1024 on 64 and 512 devices (medians of 3 searches), the counts it prints, and on
64 devices the same search with every bound off (the proof: the same best).

Run alone: python benchmarks/bench_layout.py [--no-proof]."""

from __future__ import annotations

import resource
import statistics
import sys
import time
from typing import Any

from stageplan.planning.layouts import Network, search_layouts
from stageplan.profiling.shards import estimate_hf_profiles

GiB = 1024.0**3
NET = Network(8, 450e9, 50e9)  # H100 SXM: NVLink 450 GB/s and one 400 Gb/s NIC per GPU, one way (gpus.json)


def _search(profiles: dict, n: int, **kw: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    lay = search_layouts(profiles, n, global_batch_size=1024, network=NET, memory_limit_bytes=80 * GiB,
                         sequence_parallel=True, **kw)
    return time.perf_counter() - t0, lay


def main(proof: bool = True) -> dict[str, float | int | None]:
    figures: dict[str, float | int | None] = {}
    t0 = time.perf_counter()
    profiles, _ = estimate_hf_profiles({"preset": "llama3-70b", "seq_len": 8192}, device="estimate:h100-sxm",
                                       microbatch_sizes=[1, 2, 4, 8], tensor_parallel=[1, 2, 4, 8])
    figures["estimate_s"] = time.perf_counter() - t0
    figures["estimate_peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"estimating the {len(profiles)} (b, t) profiles of LLaMA-3-70B: {figures['estimate_s']:.1f} s, "
          f"peak RSS {figures['estimate_peak_rss_gb']:.2f} GB", flush=True)
    for n in (64, 512):
        runs = [_search(profiles, n) for _ in range(3)]
        times = [t for t, _ in runs]
        lay = runs[0][1]
        figures[f"search_{n}_s"] = statistics.median(times)
        for key in ("grid", "priced", "pruned_by_time", "pruned_by_memory", "infeasible"):
            figures[f"search_{n}_{key}"] = lay.counts[key]
        figures[f"search_{n}_best_step_s"] = lay.best.step_s
        each = ", ".join(f"{t:.2f}" for t in times)
        print(f"N = {n}: search median {statistics.median(times):.2f} s (runs {each}); {lay.counts}; best "
              f"{lay.best.degrees}, step {lay.best.step_s:.3f} s, MFU {lay.best.mfu:.1%}", flush=True)
    if proof:
        took, full = _search(profiles, 64, bounds=False)
        _, pruned = _search(profiles, 64)
        same = full.best.degrees == pruned.best.degrees and full.best.step_s == pruned.best.step_s
        figures["proof_64_same_best"] = int(same)
        figures["proof_64_exhaustive_s"] = took
        verdict = "the same best" if same else "A DIFFERENT BEST"
        print(f"N = 64, every bound off: {full.counts['priced']} priced in {took:.1f} s; best "
              f"{full.best.degrees} -> {verdict}", flush=True)
    return figures


if __name__ == "__main__":
    main(proof="--no-proof" not in sys.argv[1:])
