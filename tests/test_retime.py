"""A rank's layers timed alone after its run (profiler.retime_layers), and the run report's split of each rank's
compute ratio into the machine's speed now against the profile's and the pipeline's own effect. Oracles: layers that
sleep a known time (tests/workloads.py), and closed forms over known per-layer figures (no processes)."""

from __future__ import annotations

import pytest
import torch

from stageplan import StageplanError
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.formats.runreport import RunReport
from stageplan.planning.planner import plan
from stageplan.profiling.profiler import profile_model
from stageplan.timing import retime_layers
from stageplan.zoo import build_workload

FWD_MS, BWD_MS = (6.0, 2.0, 4.0), (8.0, 3.0, 5.0)


def _sleepers():  # type: ignore[no-untyped-def]
    return build_workload("workloads:sleepers", {"forward_ms": ",".join(map(str, FWD_MS)),
                                                 "backward_ms": ",".join(map(str, BWD_MS))})


def test_retime_times_only_the_layers_asked_for_at_their_known_cost_as_the_profile_does() -> None:
    wl = _sleepers()
    before = {k: v.clone() for k, v in wl.model.state_dict().items()}
    prof = profile_model(wl, microbatch_size=2, warmup=1, repeats=5, dedup=False)
    names = [x.name for x in prof.layers]
    # layers 1 and 2: layer 0 runs forward once to give them their inputs, and is not timed
    got = retime_layers(wl, names, [2, 1], 2, "cpu", warmup=1, repeats=5)
    assert sorted(got) == [1, 2]
    for k, (f, b, acc) in got.items():
        # a sleep overshoots a little, never undershoots
        assert FWD_MS[k] / 1e3 <= f <= FWD_MS[k] / 1e3 + 2e-3, (k, f)
        assert BWD_MS[k] / 1e3 <= b <= BWD_MS[k] / 1e3 + 2e-3, (k, b)
        assert BWD_MS[k] / 1e3 <= acc <= BWD_MS[k] / 1e3 + 2e-3, (k, acc)
        # the profile's figures for the same layer, timed the same way
        assert f == pytest.approx(prof.layers[k].forward_s, abs=2e-3)
        assert b == pytest.approx(prof.layers[k].backward_s, abs=2e-3)
    # it times a weightless copy: the workload's own model keeps its weights, untouched
    after = wl.model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert retime_layers(wl, names, [], 2, "cpu") == {}  # nothing asked for, nothing built


def test_retime_refuses_a_plan_whose_layers_are_not_this_models_cut() -> None:
    wl = _sleepers()
    with pytest.raises(StageplanError, match=r"the model cuts into 3 layers here \(0, 1, 2\) and the plan has 2 \(a, b\): "
                                             r"its profile is of another model.*profile this model and plan again"):
        retime_layers(wl, ["a", "b"], [0], 2, "cpu")


M = 4
PROFILED = [(1e-3, 2e-3, 2.5e-3), (2e-3, 4e-3, 5e-3), (3e-3, 6e-3, 7.5e-3), (4e-3, 8e-3, 10e-3)]
# each layer alone after the run (forward, backward into empty grads, accumulating), and inside it (forward, backward)
ALONE = {0: [1.2e-3, 2.2e-3, 3.0e-3], 1: [2.0e-3, 4.4e-3, 5.2e-3], 2: [3.6e-3, 6.0e-3, 9.0e-3], 3: [4.0e-3, 8.8e-3, 8.0e-3]}
INSIDE = {0: (1.5e-3, 3.0e-3), 1: (2.4e-3, 6.0e-3), 2: (3.3e-3, 9.0e-3), 3: (5.0e-3, 9.5e-3)}


def _plan(recompute: bool = False):  # type: ignore[no-untyped-def]
    layers = [LayerProfile(name=f"l{i}", forward_s=f, backward_s=b, activation_bytes=1000, output_bytes=100,
                           param_bytes=400, backward_accumulate_s=acc) for i, (f, b, acc) in enumerate(PROFILED)]
    return plan(Profile(tuple(layers), {"model": "toy", "microbatch_size": 1}), 2, num_microbatches=M,
                boundaries=[0, 1, 4], optimizer="none", recompute=recompute)


def _report(pl, alone: dict[int, list[float]]) -> RunReport:  # type: ignore[no-untyped-def]
    ranks = []
    for r, mine in ((0, [0]), (1, [1, 2, 3])):
        f, b = sum(INSIDE[i][0] for i in mine), sum(INSIDE[i][1] for i in mine)
        ranks.append({"rank": r, "stages": [r], "step_s": [0.2], "forward_s": f * M, "forward_iqr_s": 0.0,
                      "backward_s": b * M, "backward_iqr_s": 0.0, "other_s": 0.0, "compute_cpu_s": (f + b) * M,
                      "losses": [], "timeline": [], "peak_activation_bytes": 1, "peak_memory_bytes": 1,
                      "layer_s": {i: list(INSIDE[i]) for i in mine}, "overhead_s": {},
                      "retimed_layer_s": {i: alone[i] for i in mine if i in alone}})
    return RunReport.from_measurements(pl, ranks, step_s=0.2, step_iqr_s=0.0, run_options={"optimizer": "none"},
                                       check=None, meta={})


@pytest.mark.parametrize("recompute", [False, True])
def test_the_compute_ratio_splits_into_the_machine_now_and_the_pipeline(recompute: bool) -> None:
    pl = _plan(recompute)
    report = _report(pl, ALONE)
    for r, mine in ((0, [0]), (1, [1, 2, 3])):
        row = next(x for x in report.ranks if x["rank"] == r)
        # the plan's sum with each layer's alone figures: forward, (first + (m - 1) x accumulating) / m, the forward
        # again under recomputation
        f = sum(ALONE[i][0] for i in mine)
        b = sum((ALONE[i][1] + (M - 1) * ALONE[i][2]) / M for i in mine)
        expected = f * (2 if recompute else 1) + b
        assert row["retimed_compute_s"] == pytest.approx(expected, rel=1e-12)
        predicted = sum(PROFILED[i][0] * (2 if recompute else 1) + (PROFILED[i][1] + (M - 1) * PROFILED[i][2]) / M
                        for i in mine)
        assert row["predicted_compute_s"] == pytest.approx(predicted, rel=1e-12)
        assert row["machine_ratio"] == pytest.approx(expected / predicted, rel=1e-12)
        measured = sum(INSIDE[i][0] + INSIDE[i][1] for i in mine)
        assert row["pipeline_ratio"] == pytest.approx(measured / expected, rel=1e-12)
        assert row["machine_ratio"] * row["pipeline_ratio"] == pytest.approx(row["compute_ratio"], rel=1e-12)
        for x in (x for x in report.layers if x["rank"] == r):
            i = x["index"]
            assert (x["retimed_forward_s"], x["retimed_backward_s"]) == pytest.approx(
                (ALONE[i][0], (ALONE[i][1] + (M - 1) * ALONE[i][2]) / M), rel=1e-12)
    # it survives the file
    again = RunReport.from_json(report.to_json())
    assert [x["machine_ratio"] for x in again.ranks] == [x["machine_ratio"] for x in report.ranks]


def test_a_rank_without_every_layer_timed_alone_has_no_split() -> None:
    report = _report(_plan(), {k: v for k, v in ALONE.items() if k != 2})  # rank 1 lacks layer 2
    rank0, rank1 = report.ranks
    assert rank0["machine_ratio"] is not None
    assert rank1["retimed_compute_s"] is None and rank1["machine_ratio"] is None and rank1["pipeline_ratio"] is None
    assert next(x for x in report.layers if x["index"] == 2)["retimed_forward_s"] is None
