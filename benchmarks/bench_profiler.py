"""Profiler benchmark: wall time of `stageplan profile gpt --set n_layer=12 --set d_model=512` in each order
(stage, the default, and layer, in turns), the per-layer spread (IQR/median) and the sum-of-layers /
whole-model ratio; then repeatability: the skewed gpt (16384-token head, microbatch 2) profiled twice, each in
its own process, one after the other, and each layer's two figures compared (its forward and mean backward per
microbatch at the profile's m, what the planner adds up; goal: within 5% for every layer above 1 ms or above
2% of the model's time); then the same with --order layer (each backward right after its own forward,
identical layers measured once, against the default stage order's every layer in its place); and with
--all-modes (not in make bench, to keep it short) also with --min-time 20 (each profile's rounds spread over
20 s: a shared machine's speed drifts by the second) and with --processes 3, each profile the median of three
fresh processes (a process's memory layout offsets all its timings alike). Each pair is also split into what
moved every layer alike (the machine's speed: the ratio of the two sums of layers) and what moved a layer
against the others (its share of the sum: what moves a plan), with the 2- and 4-rank plans of both profiles,
and set beside fixed work with no stageplan code, shaped like the model's layers (a matmul, a block-sized
Linear, the embedding's memory-bound backward), run in a fresh process before, between and after the two
profiles: how far identical work moves between fresh processes on this host in the same minutes, the floor
under the line."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import stageplan
from stageplan import Profile
from stageplan.formats.profile import LayerProfile
from stageplan.report import format_table


def _profile(args: list[str], out: Path) -> float:
    cmd = [sys.executable, "-m", "stageplan", "profile", *args, "--quiet", "-o", str(out)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


# Fixed work with no stageplan code, near the skewed GPT's layers (width 128, a 16384-token vocabulary; 256
# rows, its microbatch of 2 x 64 tokens doubled): a 256x256 matmul; a block-sized Linear(128, 512) forward and
# backward; and the embedding's backward, which zeroes a 16384 x 128 gradient (8 MiB), adds 256 rows into it
# and adds it into the accumulated one, streaming from memory. One thread, round-robin for SECONDS, each
# figure the median of 10-call rounds.
_FIXED_WORK = """
import json, statistics, sys, time, torch
torch.set_num_threads(1)
torch.manual_seed(0)
a = torch.randn(256, 256)
idx, g, acc = torch.randint(0, 16384, (256,)), torch.randn(256, 128), torch.zeros(16384, 128)
x, lin = torch.randn(256, 128, requires_grad=True), torch.nn.Linear(128, 512)
def matmul(): a @ a
def block(): lin(x).relu().sum().backward()
def embedding():
    z = torch.zeros(16384, 128); z.index_add_(0, idx, g); acc.add_(z)
work = {"matmul": matmul, "block": block, "embedding": embedding}
for f in work.values(): f()
times = {k: [] for k in work}
end = time.perf_counter() + float(sys.argv[1])
while time.perf_counter() < end:
    for k, f in work.items():
        t0 = time.perf_counter()
        for _ in range(10): f()
        times[k].append((time.perf_counter() - t0) / 10)
print(json.dumps({k: statistics.median(v) for k, v in times.items()}))
"""


def _fixed_work(seconds: float) -> dict[str, float]:
    """Median seconds of each piece of _FIXED_WORK over ``seconds`` in a fresh process. Run before, between
    and after a pair of profiles, its neighbouring readings are two fresh processes doing identical work in
    the same minutes: the floor under two profiles' agreement on this host. Measured on a 2-core CPU host, of
    19 neighbouring pairs of twenty default profiles with this work between them, 7 agreed within 5% on every
    counted layer, and the work itself held 5% on all three pieces in 7 of 19."""
    out = subprocess.run([sys.executable, "-c", _FIXED_WORK, str(seconds)], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout)


def _planned_s(layer: LayerProfile, m: int) -> float:
    """What the planner adds up for a layer per microbatch: its forward and its mean backward over m
    microbatches (one into empty grads, m - 1 accumulating)."""
    return layer.forward_s + layer.backward_per_microbatch_s(m)


def _compare(a: Profile, b: Profile) -> tuple[list[list[str]], float, float, float, float]:
    """Each layer's figures side by side, over the layers that count (above 1 ms, or above 2% of the model's
    time): the worst difference of a layer's time as the planner adds it up (forward and mean backward per
    microbatch at the profile's m); the worst of its forward, backward and accumulating backward taken apart
    (stricter: a 0.4 ms forward counts with its layer); and the pair split in two. A profile's rounds time
    every layer in turn, so a change in the machine's speed moves all its layers alike: the ratio of the two
    sums - 1. What is left, the worst relative change of a layer's share of its profile's sum, is what moves a
    plan's boundaries."""
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
        rows.append([x.name, f"{x.forward_s * 1e3:.2f}", f"{y.forward_s * 1e3:.2f}", f"{f:+.1%}",
                     f"{x.backward_s * 1e3:.2f}",
                     f"{y.backward_s * 1e3:.2f}", f"{bw:+.1%}", f"{acc:+.1%}", f"{t:+.1%}",
                     "yes" if counts else "no"])
    return rows, worst, worst_part, total_b / total_a - 1, worst_share


# the repeatability modes: (processes, --min-time, --order) and the record's key for each; make bench runs the
# first two (about 2 minutes each here), --all-modes the four (the other two about 4 minutes each)
MODES = {"repeat_default": (1, 0, None), "repeat_order_layer": (1, 0, "layer"),
         "repeat_min_time_20": (1, 20, None), "repeat_processes_3": (3, 0, None)}


def repeatability(tmp: Path, modes: list[str]) -> dict[str, float]:
    """Prints each mode's pair of profiles side by side and returns each mode's worst difference (keyed as
    :data:`MODES`), the fixed work's largest move between neighbouring processes and how many pairs held."""
    figures: dict[str, float] = {}
    args = ["gpt", "--set", "vocab_size=16384", "--microbatch-size", "2"]
    headers = ["layer", "forward 1", "forward 2", "diff", "backward 1", "backward 2", "diff",
               "accumulating diff", "layer diff", "counts"]
    # each piece's moves between neighbouring fixed-work processes, in order
    floors: dict[str, list[float]] = {}
    worsts: list[float] = []
    for mode in modes:
        processes, spread, order = MODES[mode]
        more = (["--processes", str(processes)] if processes > 1 else []) + (["--min-time", str(spread)]
                                                                             if spread else []) \
            + (["--order", order] if order else [])
        a_path, b_path = tmp / f"a{processes}-{spread}-{order}.json", tmp / (f"b{processes}-{spread}-{order}"
                                                                             f".json")
        window = float(max(10, spread))  # a profile's length in this mode (each process's, with --processes)
        kernel = [_fixed_work(window)]
        wall = _profile(args + more, a_path)
        kernel.append(_fixed_work(window))
        _profile(args + more, b_path)
        kernel.append(_fixed_work(window))
        a, b = Profile.load(a_path), Profile.load(b_path)
        rows, worst, worst_part, host, worst_share = _compare(a, b)
        how = "each in its own process" if processes == 1 else (f"each the median of {processes} fresh "
                                                                f"processes")
        how += f", rounds over >= {spread} s" if spread else ""
        print(f"\nrepeatability: stageplan profile {' '.join(args + more)}, twice, {how} ({wall:.0f} s each; "
              f"ms)")
        print(format_table(headers, rows))
        print(f"  worst difference of a counted layer's time: {worst:.1%} (goal <= 5%); of its forward or "
              f"backwards apart: {worst_part:.1%}; load average at the starts "
              f"{a.meta['load_average_1min']:.2f}, {b.meta['load_average_1min']:.2f}")
        print(f"  split into what moved every layer alike and what moved one layer: the second profile's sum "
              f"of layers {host:+.1%} on the first's; a counted layer's share of the sum moved by at most "
              f"{worst_share:.1%}")
        print(f"  fixed work (no stageplan code) over {window:.0f} s in a fresh process before, between and "
              f"after the two profiles (us; the moves between neighbours):")
        for name in kernel[0]:
            reads = [k[name] for k in kernel]
            moves = [reads[i + 1] / reads[i] - 1 for i in range(2)]
            floors.setdefault(name, []).extend(moves)
            print(f"    {name:<9} {', '.join(f'{r * 1e6:.0f}' for r in reads)} ({moves[0]:+.1%}, "
                  f"{moves[1]:+.1%})")
        worsts.append(worst)
        figures[mode] = worst
        for ranks in (2, 4):
            pa, pb = stageplan.plan(a, ranks), stageplan.plan(b, ranks)
            same = "the same" if pa.boundaries == pb.boundaries else "different"
            print(f"  plan, {ranks} ranks 1F1B: {list(pa.boundaries)} and {list(pb.boundaries)} ({same}); "
                  f"predicted step {pa.predicted_step_s * 1e3:.1f} and {pb.predicted_step_s * 1e3:.1f} ms")
    # each neighbouring pair's worst piece
    together = [max(map(abs, moves)) for moves in zip(*floors.values())]
    print(
        f"\nrepeatability over the {len(worsts)} pairs: a counted layer's worst difference "
        f"{min(worsts):.1%}-{max(worsts):.1%}, within 5% in {sum(w <= 0.05 for w in worsts)} of "
        f"{len(worsts)}; identical work in neighbouring fresh processes beside them within 5% in: "
        + ", ".join(
            f"{name} {sum(abs(x) <= 0.05 for x in xs)} of {len(xs)} (at most {max(map(abs, xs)):.1%} apart)"
            for name, xs in floors.items()
        )
        + f"; all three at once {sum(x <= 0.05 for x in together)} of "
        f"{len(together)}"
    )
    figures.update({"pairs_within_5pct": sum(w <= 0.05 for w in worsts), "pairs": len(worsts),
                    "fixed_work_worst_move": max(together),
                    "fixed_work_within_5pct": sum(x <= 0.05 for x in together),
                    "fixed_work_pairs": len(together)})
    return figures


def main(all_modes: bool = False) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        walls: dict[str, list[float]] = {"stage": [], "layer": []}
        for i in range(2):  # the two orders in turns, twice: the machine's drift falls on both alike
            for order in walls:
                out = Path(tmp) / f"gpt-large-{order}-{i}.json"
                walls[order].append(
                    _profile(["gpt", "--set", "n_layer=12", "--set", "d_model=512", "--order", order], out))
                prof = Profile.load(out)
                spreads = [(x.forward_iqr_s + x.backward_iqr_s) / (x.forward_s + x.backward_s)
                           for x in prof.layers]
                print(f"stageplan profile gpt --set n_layer=12 --set d_model=512 --order {order}")
                print(f"  wall time {walls[order][-1]:.1f} s ({len(prof)} layers, {prof.meta['warmup']} "
                      f"warm-up + {prof.meta['repeats']} rounds)")
                print(f"  per-layer spread IQR/median: median {statistics.median(spreads):.1%}, max "
                      f"{max(spreads):.1%} "
                      "(goal <= 5%)")
                print(f"  sum of layers / whole model: {prof.sum_vs_whole:.3f}; load average at the start "
                      f"{prof.meta['load_average_1min']:.2f}")
        ratio = statistics.median(walls['stage']) / statistics.median(walls['layer'])
        print(f"wall time, --order stage / --order layer (medians of 2): {ratio:.2f}")
        figures = repeatability(Path(tmp), list(MODES) if all_modes else list(MODES)[:2])
        return {"wall_stage_s": statistics.median(walls["stage"]), "wall_layer_s": statistics.median(
            walls["layer"]), "wall_stage_over_layer": ratio, **figures}


if __name__ == "__main__":
    main(all_modes="--all-modes" in sys.argv[1:])
