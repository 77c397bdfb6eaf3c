"""make bench: every benchmark (or the sections named on the command line), each printing medians and ratios
against a reference in the same run; then the run's figures are appended to benchmarks/results/ and
docs/accuracy.md's tables regenerated from every record there (benchmarks/results.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_executor
import bench_layout
import bench_profiler
import bench_replicas
import bench_simulator
import bench_solver
import results

if __name__ == "__main__":
    start, t0 = results.host(), time.perf_counter()
    sections: dict[str, dict[str, float | int | None]] = {}
    benches = {"solver": bench_solver, "simulator": bench_simulator, "profiler": bench_profiler,
               "executor": bench_executor, "layout": bench_layout, "replicas": bench_replicas}
    # `python benchmarks/run_all.py layout` runs (and records) only the named sections; `make bench` runs all
    wanted = sys.argv[1:] or list(benches)
    unknown = [w for w in wanted if w not in benches]
    if unknown:
        sys.exit(f"run_all: unknown section(s) {unknown}; use some of {', '.join(benches)}")
    for name, module in [(w, benches[w]) for w in wanted]:
        print(f"\n===== {name} =====", flush=True)
        t1 = time.perf_counter()
        figures = module.main()
        # the executor bench returns its two record sections (executor, calibration), the others one
        sections.update(figures if name == "executor" else {name: figures})
        sections[name]["wall_s"] = time.perf_counter() - t1
    path = results.record(sections, start=start, wall_s=time.perf_counter() - t0)
    results.regenerate()
    print(f"\nrecorded {path.relative_to(results.ROOT)}; regenerated {results.DOC.relative_to(results.ROOT)} "
          f"from {len(results.load_records())} records (load average at the start "
          f"{start['load_average'][0]:.2f})")
