"""Profiler benchmark: wall time of `stageplan profile gpt --set n_layer=12 --set d_model=512`, the per-layer
spread (IQR/median) and the sum-of-layers / whole-model ratio."""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stageplan import Profile


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gpt-large.json"
        cmd = [sys.executable, "-m", "stageplan", "profile", "gpt", "--set", "n_layer=12", "--set", "d_model=512",
               "--quiet", "-o", str(out)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        prof = Profile.load(out)
    spreads = [(x.forward_iqr_s + x.backward_iqr_s) / (x.forward_s + x.backward_s) for x in prof.layers]
    print("stageplan profile gpt --set n_layer=12 --set d_model=512")
    print(f"  wall time {wall:.1f} s ({len(prof)} layers, {prof.meta['warmup']} warm-up + {prof.meta['repeats']} rounds)")
    print(f"  per-layer spread IQR/median: median {statistics.median(spreads):.1%}, max {max(spreads):.1%} (goal <= 5%)")
    print(f"  sum of layers / whole model: {prof.sum_vs_whole:.3f}; load average at the start {prof.meta['load_average_1min']:.2f}")


if __name__ == "__main__":
    main()
