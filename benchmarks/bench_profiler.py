"""Profiler benchmark: wall time of `stageplan profile gpt --set n_layer=12 --set d_model=512` in each order (stage,
the default, and layer, in turns), the per-layer spread (IQR/median) and the sum-of-layers / whole-model ratio; then
repeatability: the skewed gpt (16384-token head, microbatch 2) profiled twice, each in its own process, one after the
other, and each layer's two figures compared (its forward and mean backward per microbatch at the profile's m, what
the planner adds up; goal: within 5% for every layer above 1 ms or above 2% of the model's time); then the same with
--min-time 20 (each profile's rounds spread over 20 s: a shared machine's speed drifts by the second), with
--processes 3, each profile the median of three fresh processes (a process's memory layout offsets all its timings
alike), and with --order layer (each backward right after its own forward, identical layers measured once, against
the default stage order's every layer in its place). Each pair is also split into what moved every layer alike (the
machine's speed: the ratio of the two sums of layers) and what moved a layer against the others (its share of the
sum: what moves a plan), with the 2- and 4-rank plans of both profiles."""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import stageplan
from stageplan import Profile
from stageplan.profile import LayerProfile
from stageplan.report import format_table


def _profile(args: list[str], out: Path) -> float:
    cmd = [sys.executable, "-m", "stageplan", "profile", *args, "--quiet", "-o", str(out)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _planned_s(layer: LayerProfile, m: int) -> float:
    """What the planner adds up for a layer per microbatch: its forward and its mean backward over m microbatches
    (one into empty grads, m - 1 accumulating)."""
    return layer.forward_s + layer.backward_per_microbatch_s(m)


def _compare(a: Profile, b: Profile) -> tuple[list[list[str]], float, float, float, float]:
    """Each layer's figures side by side, over the layers that count (above 1 ms, or above 2% of the model's time):
    the worst difference of a layer's time as the planner adds it up (forward and mean backward per microbatch at
    the profile's m); the worst of its forward, backward and accumulating backward taken apart (stricter: a 0.4 ms
    forward counts with its layer); and the pair split in two. A profile's rounds time every layer in turn, so a
    change in the machine's speed moves all its layers alike: the ratio of the two sums - 1. What is left, the worst
    relative change of a layer's share of its profile's sum, is what moves a plan's boundaries."""
    m = max(1, int(a.meta["batch_size"]) // int(a.meta["microbatch_size"]))  # the plan's default
    total_a, total_b = sum(_planned_s(x, m) for x in a.layers), sum(_planned_s(y, m) for y in b.layers)
    rows, worst, worst_part, worst_share = [], 0.0, 0.0, 0.0

    def diff(x: float | None, y: float | None) -> float:
        return y / x - 1 if x and y is not None else 0.0

    for x, y in zip(a.layers, b.layers):
        t_x, t_y = _planned_s(x, m), _planned_s(y, m)
        counts = t_x > 1e-3 or t_x > 0.02 * total_a
        f, bw = diff(x.forward_s, y.forward_s), diff(x.backward_s, y.backward_s)
        acc, t = diff(x.backward_accumulate_s, y.backward_accumulate_s), diff(t_x, t_y)
        if counts:
            worst, worst_part = max(worst, abs(t)), max(worst_part, abs(f), abs(bw), abs(acc))
            worst_share = max(worst_share, abs((t_y / total_b) / (t_x / total_a) - 1))
        rows.append([x.name, f"{x.forward_s * 1e3:.2f}", f"{y.forward_s * 1e3:.2f}", f"{f:+.1%}", f"{x.backward_s * 1e3:.2f}",
                     f"{y.backward_s * 1e3:.2f}", f"{bw:+.1%}", f"{acc:+.1%}", f"{t:+.1%}", "yes" if counts else "no"])
    return rows, worst, worst_part, total_b / total_a - 1, worst_share


def repeatability(tmp: Path) -> None:
    args = ["gpt", "--set", "vocab_size=16384", "--microbatch-size", "2"]
    headers = ["layer", "forward 1", "forward 2", "diff", "backward 1", "backward 2", "diff", "accumulating diff",
               "layer diff", "counts"]
    for processes, spread, order in ((1, 0, None), (1, 20, None), (3, 0, None), (1, 0, "layer")):
        more = (["--processes", str(processes)] if processes > 1 else []) + (["--min-time", str(spread)] if spread else []) \
            + (["--order", order] if order else [])
        a_path, b_path = tmp / f"a{processes}-{spread}-{order}.json", tmp / f"b{processes}-{spread}-{order}.json"
        wall = _profile(args + more, a_path)
        _profile(args + more, b_path)
        a, b = Profile.load(a_path), Profile.load(b_path)
        rows, worst, worst_part, host, worst_share = _compare(a, b)
        how = "each in its own process" if processes == 1 else f"each the median of {processes} fresh processes"
        how += f", rounds over >= {spread} s" if spread else ""
        print(f"\nrepeatability: stageplan profile {' '.join(args + more)}, twice, {how} ({wall:.0f} s each; ms)")
        print(format_table(headers, rows))
        print(f"  worst difference of a counted layer's time: {worst:.1%} (goal <= 5%); of its forward or backwards "
              f"apart: {worst_part:.1%}; load average at the starts "
              f"{a.meta['load_average_1min']:.2f}, {b.meta['load_average_1min']:.2f}")
        print(f"  split into what moved every layer alike and what moved one layer: the second profile's sum of layers "
              f"{host:+.1%} on the first's; a counted layer's share of the sum moved by at most {worst_share:.1%}")
        for ranks in (2, 4):
            pa, pb = stageplan.plan(a, ranks), stageplan.plan(b, ranks)
            same = "the same" if pa.boundaries == pb.boundaries else "different"
            print(f"  plan, {ranks} ranks 1F1B: {list(pa.boundaries)} and {list(pb.boundaries)} ({same}); predicted "
                  f"step {pa.predicted_step_s * 1e3:.1f} and {pb.predicted_step_s * 1e3:.1f} ms")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        walls: dict[str, list[float]] = {"stage": [], "layer": []}
        for i in range(2):  # the two orders in turns, twice: the machine's drift falls on both alike
            for order in walls:
                out = Path(tmp) / f"gpt-large-{order}-{i}.json"
                walls[order].append(_profile(["gpt", "--set", "n_layer=12", "--set", "d_model=512", "--order", order], out))
                prof = Profile.load(out)
                spreads = [(x.forward_iqr_s + x.backward_iqr_s) / (x.forward_s + x.backward_s) for x in prof.layers]
                print(f"stageplan profile gpt --set n_layer=12 --set d_model=512 --order {order}")
                print(f"  wall time {walls[order][-1]:.1f} s ({len(prof)} layers, {prof.meta['warmup']} warm-up + "
                      f"{prof.meta['repeats']} rounds)")
                print(f"  per-layer spread IQR/median: median {statistics.median(spreads):.1%}, max {max(spreads):.1%} "
                      "(goal <= 5%)")
                print(f"  sum of layers / whole model: {prof.sum_vs_whole:.3f}; load average at the start "
                      f"{prof.meta['load_average_1min']:.2f}")
        print(f"wall time, --order stage / --order layer (medians of 2): "
              f"{statistics.median(walls['stage']) / statistics.median(walls['layer']):.2f}")
        repeatability(Path(tmp))


if __name__ == "__main__":
    main()
