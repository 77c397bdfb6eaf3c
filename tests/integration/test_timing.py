"""A run retimes its layers alone in the profile's order."""

from __future__ import annotations

from pathlib import Path

import pytest
from unit.test_profiler import COLD, HOT, _between, _evictees

from stageplan import plan
from stageplan.profiling.profiler import profile_model


@pytest.mark.timing
def test_a_run_retimes_its_layers_in_the_profiles_order(tmp_path: Path) -> None:
    """Each rank times its layers alone after the run in the order its plan's profile was taken in: in a
    stage's order, rank 0's layers 0 and 1 (1 after 2, the next rank's first) and rank 1's layer 2 are cold,
    layer 3 (the loss's) hot; from a profile timed layer by layer, every one hot."""
    from stageplan.running.launch import run

    wl = _evictees(4)
    for order, backward in (("stage", [COLD, COLD, COLD, HOT]), ("layer", [HOT] * 4)):
        prof = profile_model(wl, microbatch_size=2, warmup=1, repeats=5, order=order)
        pl = plan(prof, 2, num_microbatches=2, boundaries=[0, 2, 4])
        report = run("workloads:evictees", pl, factory_options={"layers": 4}, steps=1, warmup=0,
                     timeout_s=120, output=tmp_path / f"{order}.json")
        rows = {x["index"]: x for x in report.layers}
        assert sorted(rows) == [0, 1, 2, 3]
        for k, row in rows.items():
            assert _between(row["retimed_backward_s"], backward[k]), (order, k, row)
