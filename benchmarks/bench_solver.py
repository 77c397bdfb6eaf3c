"""Benchmark stageplan.planning.solver: speed (medians,
ratio against an O(L^2 p) DP) and plan quality vs baselines.

Run: python benchmarks/bench_solver.py  (about 10 s on 2 cores; prints plain-text tables).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from stageplan.errors import InfeasiblePlanError
from stageplan.planning.costs import CostOptions, Device, LayerArrays, solver_inputs
from stageplan.planning.search import partition_balanced, partition_uniform
from stageplan.planning.solver import Solution, solve

FloatArray = NDArray[np.float64]


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of fn() over repeats (after one warm-up call), in seconds."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(fn: Callable[[], object], ref: Callable[[], object], rounds: int,
                        per_round: int) -> tuple[float, float]:
    """Median wall times of fn() and ref() (seconds), sampled in alternating rounds after a warm-up
    of each: on a shared machine a busy spell then slows both, not just whichever was being timed.
    Each round times per_round calls of fn and keeps the faster of two back-to-back calls of ref
    (the first can pay for page faults after fn's allocations, which a lone ref loop would not)."""
    fn()
    ref()
    fn_times: list[float] = []
    ref_times: list[float] = []
    for _ in range(rounds):
        for _ in range(per_round):
            start = time.perf_counter()
            fn()
            fn_times.append(time.perf_counter() - start)
        pair = []
        for _ in range(2):
            start = time.perf_counter()
            ref()
            pair.append(time.perf_counter() - start)
        ref_times.append(min(pair))
    return statistics.median(fn_times), statistics.median(ref_times)


def planner_inputs(num_layers: int, p: int, seed: int, limit: float | None = None) -> dict[str, Any]:
    """The planner's real solver input (planning.costs.solver_inputs) for a synthetic 1F1B profile.

    1F1B with m = 2p microbatches: stage k holds min(p - k, m) microbatches of activations in flight
    (Megatron's warm-up count), so memory rows differ by stage, shape (p, L); Adam keeps 4 x parameter
    bytes; memory_end_bytes = 2 x output_bytes (the send buffer of the activation and the receive
    buffer of its gradient at the stage's last layer); boundary_costs are zeros (no bandwidth given).
    """
    rng = np.random.default_rng(seed)
    total = rng.lognormal(0.0, 0.5, num_layers) * 1e-3  # seconds per layer, forward + backward
    arrays = LayerArrays(
        forward_s=total / 3,
        backward_s=total * 2 / 3,
        activation_bytes=rng.lognormal(0.0, 0.5, num_layers) * 2e6,
        output_bytes=rng.lognormal(0.0, 0.5, num_layers) * 0.25e6,
        param_bytes=(param := rng.lognormal(0.0, 0.5, num_layers) * 12.5e6),
        param_count=param / 4,
    )
    opts = CostOptions(num_ranks=p, num_microbatches=2 * p, schedule="1F1B",
                       devices=tuple(Device(1.0, limit) for _ in range(p)))
    return solver_inputs(arrays, opts)


def solve_planner(inp: dict[str, Any], p: int) -> Solution:
    """solve() called exactly as the split search (planning.search.split_by_method) calls it."""
    return solve(inp["costs"], p, stage_speeds=inp["speeds"], boundary_costs=inp["boundary_costs"],
                 memory_bytes=inp["memory_bytes"], memory_start_bytes=inp["memory_start_bytes"],
                 memory_end_bytes=inp["memory_end_bytes"], memory_limit_bytes=inp["limits"])


def binding_limit(num_layers: int, p: int, seed: int) -> float:
    """A limit that binds: 30% of the way from the smallest
    feasible limit to the unconstrained plan's peak."""
    free = solve_planner(planner_inputs(num_layers, p, seed), p)
    peak = max(free.stage_memory or ())
    smallest = 0.0
    try:
        solve_planner(planner_inputs(num_layers, p, seed, limit=1.0), p)
    except InfeasiblePlanError as exc:  # the error carries the smallest feasible limit
        smallest = exc.min_memory_limit_bytes or 0.0
    return smallest + 0.3 * (peak - smallest)


def dp_reference(costs: FloatArray, p: int, memory: FloatArray | None = None, end: FloatArray | None = None,
                 limits: FloatArray | None = None, speeds: FloatArray | None = None) -> float:
    """Plain O(L^2 p) min-max DP (numpy over the (i, j) matrix per stage): the optimal bottleneck.

    Stage k over [i, j) takes (P[j] - P[i]) / speeds[k] and needs M_k[j] + end[j-1] - M_k[i] bytes, which
    must not exceed limits[k] (no memory check without limits). Work that does not depend on the stage is
    done once, so the reference is not slowed down artificially.
    """
    num_layers = costs.size
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    idx = np.arange(num_layers + 1)
    seg = np.where(idx[:, None] < idx[None, :], prefix[None, :] - prefix[:, None], np.inf)  # time of [i, j)
    uniform = speeds is None or bool(np.all(speeds == speeds[0]))
    if uniform and speeds is not None:
        seg = seg / speeds[0]
    end_j = np.zeros(num_layers + 1) if end is None else np.concatenate([[0.0], end])
    best = np.full(num_layers + 1, np.inf)
    best[0] = 0.0
    for k in range(p):
        cost = seg if uniform or speeds is None else seg / speeds[k]
        if memory is not None and limits is not None:
            mprefix = np.concatenate([[0.0], np.cumsum(memory[k])])
            cost = np.where((mprefix + end_j)[None, :] - mprefix[:, None] <= limits[k], cost, np.inf)
        best = np.min(np.maximum(best[:, None], cost), axis=0)
    return float(best[num_layers])


def speed_section() -> dict[str, float]:
    """Prints the speed table and returns its figures (seconds, and the DP's time over solve's)."""
    figures: dict[str, float] = {}
    num_layers, p = 1000, 64
    print("== speed (median wall time) ==")
    print(f"the planner's real input at L={num_layers} p={p}: 1F1B memory rows (p, L) + boundary buffers "
          "(memory_end_bytes = 2 x output_bytes), boundary_costs zero;")
    print(
        "medians of 45 solves and 5 runs (best of 2) of the O(L^2 p) numpy DP on the same terms, interleaved")
    limit = binding_limit(num_layers, p, seed=0)
    print(f"{'case':<26} {'solve':>9} {'DP ref':>9} {'ratio':>7} {'target':>7}  ok   same bottleneck")
    for name, lim in (("no memory limit", None), ("binding memory limit", limit)):
        inp = planner_inputs(num_layers, p, seed=0, limit=lim)
        sol = solve_planner(inp, p)
        args = (inp["costs"], p, inp["memory_bytes"], inp["memory_end_bytes"], inp["limits"], inp["speeds"])
        ref = dp_reference(*args)
        t_solve, t_ref = interleaved_medians(lambda inp=inp: solve_planner(inp, p),
                                             lambda args=args: dp_reference(*args), rounds=5, per_round=9)
        ratio = t_ref / t_solve
        same = abs(ref - sol.bottleneck) <= 1e-9 * ref
        tag = "no_limit" if lim is None else "limit"
        figures.update({f"solve_{tag}_s": t_solve, f"dp_{tag}_s": t_ref, f"speedup_{tag}": ratio})
        print(f"{name:<26} {t_solve * 1e3:>7.2f}ms {t_ref * 1e3:>7.0f}ms {ratio:>6.1f}x {15:>6}x  "
              f"{'yes' if ratio >= 15 else 'NO ':<4} {'yes' if same else 'NO'} ({sol.bottleneck:.9g} s)")
    print()

    # other paths (no target): plain 1F1B rows, the same with boundary costs (bandwidth given), start
    # terms (recomputation: O(pL log L) probes), and a large instance without memory
    inp = planner_inputs(num_layers, p, seed=0, limit=limit)
    costs, memory, end, limits = inp["costs"], inp["memory_bytes"], inp["memory_end_bytes"], inp["limits"]
    rng = np.random.default_rng(2)
    bc = rng.uniform(0.0, 1e-4, num_layers)
    start = rng.uniform(0.0, 5e6, num_layers)
    rows: list[tuple[str, float]] = [
        ("1F1B rows + limit, no end terms",
         median_time(lambda: solve(costs, p, memory_bytes=memory, memory_limit_bytes=limits), 15)),
        ("  + end terms + boundary costs",
         median_time(lambda: solve(costs, p, boundary_costs=bc, memory_bytes=memory, memory_end_bytes=end,
                                   memory_limit_bytes=limits), 7)),
        ("  + start terms (recomputation)",
         median_time(lambda: solve(costs, p, boundary_costs=bc, memory_bytes=memory, memory_end_bytes=end,
                                   memory_start_bytes=start, memory_limit_bytes=limits), 3)),
    ]
    big = np.random.default_rng(1).lognormal(0.0, 0.5, 10000)
    rows.append(("L=10000 p=128, no memory", median_time(lambda: solve(big, 128), 7)))
    print(f"{'other cases at L=1000 p=64':<42} {'median':>10}")
    for name, t in rows:
        print(f"{name:<42} {t * 1e3:>8.2f}ms")
    print()
    figures["solve_10000_s"] = rows[-1][1]
    return figures


def transformer_like(rng: np.random.Generator, num_layers: int) -> tuple[FloatArray, FloatArray]:
    """Embedding, blocks, LM head: the embedding and head hold most parameters; the head is slow."""
    hidden = float(rng.choice([1024, 2048, 4096]))
    vocab = float(rng.choice([32000, 50257, 128256, 250000]))
    blocks = num_layers - 2
    block_time = rng.normal(1.0, 0.03, blocks)  # relative units
    head_time = 2 * vocab * hidden / (24 * hidden**2) * 3  # logits + loss, forward and backward
    # embedding: a cheap gather forward, but a scatter-add backward and optimizer step over V x h
    costs = np.concatenate([[0.3], block_time, [head_time]])
    params = np.concatenate([[vocab * hidden], np.full(blocks, 12 * hidden**2), [vocab * hidden]])
    return np.maximum(costs, 1e-6), params


def quality_section() -> dict[str, float]:
    """Prints each method's bottleneck over the optimal one and returns, per method, the share of cases at
    the optimum and the median, p90 and worst ratio."""
    figures: dict[str, float] = {}
    rng = np.random.default_rng(2024)
    # uniform / parameters: DeepSpeed's partition_method="uniform" / "parameters" (the default);
    # balanced(time): DeepSpeed's max-min DP fed the time costs, for reference
    ratios: dict[str, list[float]] = {"uniform": [], "parameters": [], "balanced(time)": [], "optimal": []}
    kinds = ("uniform", "lognormal", "transformer")
    cases = 0
    for kind in kinds:
        for _ in range(70):
            num_layers = int(rng.integers(12, 201))
            p = int(rng.integers(2, min(16, num_layers - 1) + 1))
            if kind == "uniform":
                costs = rng.uniform(0.5, 1.5, num_layers)
                params = rng.uniform(0.5, 1.5, num_layers)
            elif kind == "lognormal":
                costs = rng.lognormal(0.0, 1.0, num_layers)
                params = rng.lognormal(0.0, 1.0, num_layers)
            else:
                costs, params = transformer_like(rng, num_layers)
            best = solve(costs, p).bottleneck

            def bottleneck(bounds: tuple[int, ...], costs: FloatArray = costs) -> float:
                return max(float(costs[a:b].sum()) for a, b in zip(bounds, bounds[1:]))

            ratios["uniform"].append(bottleneck(partition_uniform(num_layers, p)) / best)
            ratios["parameters"].append(bottleneck(partition_balanced(params, p)) / best)
            ratios["balanced(time)"].append(bottleneck(partition_balanced(costs, p)) / best)
            ratios["optimal"].append(solve(costs, p).bottleneck / best)
            cases += 1
    print(f"== plan quality: bottleneck / optimal bottleneck over {cases} seeded cases "
          f"({', '.join(kinds)}; L in 12..200, p in 2..16) ==")
    print(f"{'method':<15} {'% optimal':>10} {'median':>8} {'p90':>8} {'worst':>8}")
    for method, values in ratios.items():
        arr = np.asarray(values)
        share = 100.0 * float(np.mean(arr <= 1 + 1e-9))
        print(f"{method:<15} {share:>9.1f}% {np.median(arr):>8.3f} {np.quantile(arr, 0.9):>8.3f} "
              f"{arr.max():>8.3f}")
        key = method.replace("(time)", "")
        figures.update({f"{key}_share": share / 100, f"{key}_median": float(np.median(arr)),
                        f"{key}_p90": float(np.quantile(arr, 0.9)), f"{key}_worst": float(arr.max())})
    figures["cases"] = cases
    print()
    return figures


def main() -> dict[str, float]:
    start = time.perf_counter()
    figures = {**speed_section(), **quality_section()}
    print(f"total benchmark time: {time.perf_counter() - start:.1f} s")
    return figures


if __name__ == "__main__":
    main()
