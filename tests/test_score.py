"""Pricing many splits at once (costmodel.SplitCosts) as evaluate() prices each."""

from __future__ import annotations

import numpy as np
import pytest

from stageplan import LayerProfile, Profile
from stageplan.costmodel import LayerArrays, SplitCosts, evaluate, make_options


@pytest.mark.parametrize(("schedule", "p", "m", "v"), [("1F1B", 3, 6, 1), ("GPipe", 2, 3, 1), ("Interleaved1F1B", 2, 4, 2),
                                                       ("ZBVZeroBubble", 2, 4, 2), ("InterleavedZeroBubble", 2, 4, 2),
                                                       ("LoopedBFS", 2, 4, 2)])
def test_split_costs_price_splits_as_evaluate_does(schedule: str, p: int, m: int, v: int) -> None:
    rng = np.random.default_rng(7)
    n = 11
    layers = tuple(LayerProfile(f"l{i}", float(a), float(b), int(c), int(o), int(w)) for i, (a, b, c, o, w) in
                   enumerate(zip(rng.lognormal(0, 1, n), rng.lognormal(0, 1, n), rng.integers(0, 100, n),
                                 rng.integers(1, 100, n), rng.integers(0, 50, n))))
    prof = Profile(layers)
    for bandwidth, recompute in ((None, False), (40.0, True)):
        opts = make_options(prof, p, num_microbatches=m, schedule=schedule, virtual_stages=v,
                            bandwidth_bytes_per_s=bandwidth, recompute=recompute, boundary_latency_s=0.25)
        arr = LayerArrays.of(prof, m)
        costs = SplitCosts(arr, opts)
        S = opts.num_chunks
        splits = np.array([[0, *sorted(rng.choice(np.arange(1, n), S - 1, replace=False)), n] for _ in range(12)])
        f, b, c, mem = costs.split(splits)
        steps, loads = costs.steps(f, b, c), costs.rank_time(f, b, c)
        for row, cuts in enumerate(splits):
            ev = evaluate(arr, cuts, opts)
            assert steps[row] == pytest.approx(ev.predicted_step_s, rel=1e-12)
            assert loads[row] == pytest.approx(ev.rank_time_s, rel=1e-12)
            assert np.all(mem[row] >= np.array(ev.rank_memory_bytes) * (1 - 1e-12))  # exact with v = 1
            if v == 1:
                assert mem[row] == pytest.approx(ev.rank_memory_bytes, rel=1e-12)
