"""make bench: every benchmark, each printing medians and ratios against a reference in the same run."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_executor
import bench_profiler
import bench_simulator
import bench_solver

if __name__ == "__main__":
    for name, module in [("solver", bench_solver), ("simulator", bench_simulator),
                         ("profiler", bench_profiler), ("executor", bench_executor)]:
        print(f"\n===== {name} =====", flush=True)
        module.main()
