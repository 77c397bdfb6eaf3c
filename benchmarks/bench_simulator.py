"""Simulator against the closed-form bubble (p-1)/(m+p-1) for balanced GPipe and 1F1B stages."""

from __future__ import annotations

import statistics
import time

from stageplan.planning.schedules import bubble_closed_form, simulate
from stageplan.report import format_table


def main() -> dict[str, float]:
    rows, diffs = [], []
    for p, m in [(8, 8), (8, 64), (2, 4), (4, 8), (4, 16), (16, 32)]:
        closed = bubble_closed_form(p, m)
        sims = {s: simulate(s, [1.0] * p, [2.0] * p, m).bubble_fraction for s in ("GPipe", "1F1B")}
        diffs += [abs(x - closed) for x in sims.values()]
        rows.append([p, m, f"{closed:.4%}", f"{sims['GPipe']:.4%}", f"{sims['1F1B']:.4%}"])
    print("bubble fraction, balanced stages (f=1, b=2): closed form vs simulator")
    print(format_table(["p", "m", "closed form", "GPipe sim", "1F1B sim"], rows))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        simulate("Interleaved1F1B", [1.0] * 16, [2.0] * 16, 64, virtual_stages=2)
        times.append(time.perf_counter() - t0)
    print(f"simulate Interleaved1F1B p=8 v=2 m=64: median {statistics.median(times) * 1e3:.1f} ms")
    return {"bubble_max_abs_diff": max(diffs), "interleaved_p8_v2_m64_s": statistics.median(times)}


if __name__ == "__main__":
    main()
