"""Profiler benchmark: wall time of `stageplan profile gpt --set n_layer=12 --set d_model=512`, the per-layer
spread (IQR/median) and the sum-of-layers / whole-model ratio; then repeatability: the skewed gpt (16384-token head,
microbatch 2) profiled twice, each in its own process, one after the other, and each layer's two figures compared
(goal: within 5% for every layer above 1 ms or above 2% of the model's time); then the same with --min-time 20 (each
profile's rounds spread over 20 s: a shared machine's speed drifts by the second) and with --processes 3, each profile
the median of three fresh processes (a process's memory layout offsets all its timings alike)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stageplan import Profile
from stageplan.report import format_table


def _profile(args: list[str], out: Path) -> float:
    cmd = [sys.executable, "-m", "stageplan", "profile", *args, "--quiet", "-o", str(out)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _compare(a: Profile, b: Profile) -> tuple[list[list[str]], float, float]:
    """Each layer's two figures side by side; the worst difference of a layer's time (forward + backward, what the
    planner adds up) over the layers that count (above 1 ms, or above 2% of the model's time), and the worst of its
    forward and backward taken apart (stricter: a 0.4 ms forward counts with its layer)."""
    total = sum(x.time_s for x in a.layers)
    rows, worst, worst_part = [], 0.0, 0.0
    for x, y in zip(a.layers, b.layers):
        counts = x.time_s > 1e-3 or x.time_s > 0.02 * total
        f = y.forward_s / x.forward_s - 1 if x.forward_s > 0 else 0.0
        bw = y.backward_s / x.backward_s - 1 if x.backward_s > 0 else 0.0
        t = y.time_s / x.time_s - 1 if x.time_s > 0 else 0.0
        if counts:
            worst, worst_part = max(worst, abs(t)), max(worst_part, abs(f), abs(bw))
        rows.append([x.name, f"{x.forward_s * 1e3:.2f}", f"{y.forward_s * 1e3:.2f}", f"{f:+.1%}", f"{x.backward_s * 1e3:.2f}",
                     f"{y.backward_s * 1e3:.2f}", f"{bw:+.1%}", f"{t:+.1%}", "yes" if counts else "no"])
    return rows, worst, worst_part


def repeatability(tmp: Path) -> None:
    args = ["gpt", "--set", "vocab_size=16384", "--microbatch-size", "2"]
    headers = ["layer", "forward 1", "forward 2", "diff", "backward 1", "backward 2", "diff", "layer diff", "counts"]
    for processes, spread in ((1, 0), (1, 20), (3, 0)):
        more = (["--processes", str(processes)] if processes > 1 else []) + (["--min-time", str(spread)] if spread else [])
        a_path, b_path = tmp / f"a{processes}-{spread}.json", tmp / f"b{processes}-{spread}.json"
        wall = _profile(args + more, a_path)
        _profile(args + more, b_path)
        a, b = Profile.load(a_path), Profile.load(b_path)
        rows, worst, worst_part = _compare(a, b)
        how = "each in its own process" if processes == 1 else f"each the median of {processes} fresh processes"
        how += f", rounds over >= {spread} s" if spread else ""
        print(f"\nrepeatability: stageplan profile {' '.join(args + more)}, twice, {how} ({wall:.0f} s each; ms)")
        print(format_table(headers, rows))
        print(f"  worst difference of a counted layer's time: {worst:.1%} (goal <= 5%); of its forward or backward "
              f"apart: {worst_part:.1%}; load average at the starts "
              f"{a.meta['load_average_1min']:.2f}, {b.meta['load_average_1min']:.2f}")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gpt-large.json"
        wall = _profile(["gpt", "--set", "n_layer=12", "--set", "d_model=512"], out)
        prof = Profile.load(out)
        spreads = [(x.forward_iqr_s + x.backward_iqr_s) / (x.forward_s + x.backward_s) for x in prof.layers]
        print("stageplan profile gpt --set n_layer=12 --set d_model=512")
        print(f"  wall time {wall:.1f} s ({len(prof)} layers, {prof.meta['warmup']} warm-up + {prof.meta['repeats']} rounds)")
        print(f"  per-layer spread IQR/median: median {statistics.median(spreads):.1%}, max {max(spreads):.1%} (goal <= 5%)")
        print(f"  sum of layers / whole model: {prof.sum_vs_whole:.3f}; load average at the start {prof.meta['load_average_1min']:.2f}")
        repeatability(Path(tmp))


if __name__ == "__main__":
    main()
