"""stageplan.formats.runreport: the run report's split of each rank's compute ratio (the machine now against
the profile, the pipeline's own effect), idle calls, and reports without a link still load."""

from __future__ import annotations

import pytest

from stageplan import RunReport
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.planning.planner import plan


def test_calls_after_idle_against_back_to_back_by_hand() -> None:
    """Two steps of one rank's calls (kind, stage, microbatch, seconds, idle before), planned 2 ms a forward
    and 4 ms a backward. Step 1: F0 back to back 2.2 ms, F1 after 5 ms idle 3.0 ms, B0 back to back 4.4 ms, B1
    after idle 6.0 ms: both kinds have both sorts. After idle 9.0 / 6.0 = 1.5, back to back 6.6 / 6.0 = 1.1,
    beyond that pace (3.0 - 1.1 x 2) + (6.0 - 1.1 x 4) = 2.4 ms. Step 2: the last stage's F0 comes as two
    calls (forward 1.5 ms after 2 ms idle, its loss 0.5 ms back to back): one action after idle, 2.0 ms; F1
    back to back 2.2 ms; both backwards back to back, so only the forwards compare: 2.0 / 2.0 = 1.0 against
    1.1, beyond -0.2 ms. Medians over the two steps; after idle 2 and 1 a step."""
    from stageplan.formats.runreport import _idle_split

    planned = {("F", 0): 0.002, ("B", 0): 0.004}
    steps = [
        [("F", 0, 0, 0.0022, 0.0), ("F", 0, 1, 0.003, 0.005), ("B", 0, 0, 0.0044, 0.0002),
         ("B", 0, 1, 0.006, 0.02)],
        [("F", 0, 0, 0.0015, 0.002), ("F", 0, 0, 0.0005, 0.0), ("F", 0, 1, 0.0022, 0.0003),
         ("B", 0, 0, 0.0044, 0.0), ("B", 0, 1, 0.0044, 0.0009)],
    ]
    got = _idle_split(steps, planned)
    assert got["measured_after_idle_calls"] == pytest.approx(1.5)
    assert got["after_idle_ratio"] == pytest.approx((1.5 + 1.0) / 2)
    assert got["back_to_back_ratio"] == pytest.approx(1.1)
    assert got["after_idle_excess_s"] == pytest.approx((0.0024 - 0.0002) / 2)
    # GPipe's first rank: every backward after a wait, every forward back to back: nothing like against like
    unmatched = _idle_split([[("F", 0, 0, 0.002, 0.0), ("F", 0, 1, 0.002, 0.0), ("B", 0, 0, 0.006, 0.01)]],
                            planned)
    assert unmatched == {"measured_after_idle_calls": 1, "after_idle_ratio": None, "back_to_back_ratio": None,
                         "after_idle_excess_s": None}
    assert _idle_split([], planned)["measured_after_idle_calls"] is None


def test_run_report_without_link_still_loads() -> None:
    data = {"schema": "stageplan.run/2", "measured_step_s": 1.0, "predicted_step_s": 1.0,
            "measured_step_iqr_s": 0.0,
            "samples_per_s": 1.0, "measured_bubble_fraction": 0.0, "predicted_bubble_fraction": 0.0,
            "ranks": [{"rank": 0, "stages": [0], "predicted_compute_s": 1.0, "measured_compute_s": 1.0,
                       "predicted_idle_s": 0.0, "measured_idle_s": 0.0, "predicted_peak_activation_bytes": 8,
                       "measured_peak_activation_bytes": 8}],
            "losses": [],
            "plan": {"boundaries": [0, 1], "num_ranks": 1, "num_microbatches": 1, "schedule": "GPipe"},
            "run_options": {}}
    old = RunReport.from_json(data)
    assert old.link is None
    linked = RunReport.from_json({**data, "link": {"latency_s": 1e-5}})
    assert linked.link == {"latency_s": 1e-5} and RunReport.from_json(linked.to_json()) == linked


M = 4


PROFILED = [(1e-3, 2e-3, 2.5e-3), (2e-3, 4e-3, 5e-3), (3e-3, 6e-3, 7.5e-3), (4e-3, 8e-3, 10e-3)]


# each layer alone after the run (forward, backward into empty
# grads, accumulating), and inside it (forward, backward)
ALONE = {0: [1.2e-3, 2.2e-3, 3.0e-3], 1: [2.0e-3, 4.4e-3, 5.2e-3], 2: [3.6e-3, 6.0e-3, 9.0e-3],
         3: [4.0e-3, 8.8e-3, 8.0e-3]}


INSIDE = {0: (1.5e-3, 3.0e-3), 1: (2.4e-3, 6.0e-3), 2: (3.3e-3, 9.0e-3), 3: (5.0e-3, 9.5e-3)}


def _plan(recompute: bool = False):  # type: ignore[no-untyped-def]
    layers = [LayerProfile(name=f"l{i}", forward_s=f, backward_s=b, activation_bytes=1000, output_bytes=100,
                           param_bytes=400, backward_accumulate_s=acc) for i,
              (f, b, acc) in enumerate(PROFILED)]
    return plan(Profile(tuple(layers), {"model": "toy", "microbatch_size": 1}), 2, num_microbatches=M,
                boundaries=[0, 1, 4], optimizer="none", recompute=recompute)


def _report(pl, alone: dict[int, list[float]]) -> RunReport:  # type: ignore[no-untyped-def]
    ranks = []
    for r, mine in ((0, [0]), (1, [1, 2, 3])):
        f, b = sum(INSIDE[i][0] for i in mine), sum(INSIDE[i][1] for i in mine)
        ranks.append({"rank": r, "stages": [r], "step_s": [0.2], "forward_s": f * M, "forward_iqr_s": 0.0,
                      "backward_s": b * M, "backward_iqr_s": 0.0, "other_s": 0.0,
                      "compute_cpu_s": (f + b) * M,
                      "losses": [], "timeline": [], "peak_activation_bytes": 1, "peak_memory_bytes": 1,
                      "layer_s": {i: list(INSIDE[i]) for i in mine}, "overhead_s": {},
                      "retimed_layer_s": {i: alone[i] for i in mine if i in alone}})
    return RunReport.from_measurements(pl, ranks, step_s=0.2, step_iqr_s=0.0,
                                       run_options={"optimizer": "none"}, check=None, meta={})


@pytest.mark.parametrize("recompute", [False, True])
def test_the_compute_ratio_splits_into_the_machine_now_and_the_pipeline(recompute: bool) -> None:
    pl = _plan(recompute)
    report = _report(pl, ALONE)
    for r, mine in ((0, [0]), (1, [1, 2, 3])):
        row = next(x for x in report.ranks if x["rank"] == r)
        # the plan's sum with each layer's alone figures: forward, (first + (m - 1) x accumulating) / m, the
        # forward again under recomputation
        f = sum(ALONE[i][0] for i in mine)
        b = sum((ALONE[i][1] + (M - 1) * ALONE[i][2]) / M for i in mine)
        expected = f * (2 if recompute else 1) + b
        assert row["retimed_compute_s"] == pytest.approx(expected, rel=1e-12)
        predicted = sum(PROFILED[i][0] * (2 if recompute else 1) + (PROFILED[i][1] + (M - 1) * PROFILED[i][2])
                        / M for i in mine)
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
    assert (
        rank1["retimed_compute_s"] is None
        and rank1["machine_ratio"] is None
        and rank1["pipeline_ratio"] is None
    )
    assert next(x for x in report.layers if x["index"] == 2)["retimed_forward_s"] is None


def test_the_memory_ratio_is_the_runs_own_memory_over_the_plans() -> None:
    """Oracle: (peak - baseline) / the plan's bytes for the rank, by hand; without a baseline (a report's rows
    from before run/3) there is no ratio; a run/2 report still loads."""
    pl = _plan()
    report = _report(pl, ALONE)
    assert report.to_json()["schema"] == "stageplan.run/4"
    gathered = []
    for r, (peak, base) in enumerate(((5_000, 1_000), (9_000, None))):
        gathered.append({"rank": r, "stages": [r], "step_s": [0.2], "forward_s": 1e-3, "forward_iqr_s": 0.0,
                         "backward_s": 1e-3, "backward_iqr_s": 0.0, "other_s": 0.0, "compute_cpu_s": 2e-3,
                         "losses": [], "timeline": [], "peak_activation_bytes": 1, "peak_memory_bytes": peak,
                         "baseline_memory_bytes": base, "layer_s": {}, "overhead_s": {}})
    rep = RunReport.from_measurements(pl, gathered, step_s=0.2, step_iqr_s=0.0, run_options={}, check=None,
                                      meta={})
    first, second = rep.ranks
    assert first["measured_run_memory_bytes"] == 4_000 and first["measured_baseline_memory_bytes"] == 1_000
    assert first["memory_ratio"] == pytest.approx(4_000 / pl.rank_memory_bytes[0], rel=1e-12)
    assert second["measured_peak_memory_bytes"] == 9_000 and second["memory_ratio"] is None
    old = RunReport.from_json({**rep.to_json(), "schema": "stageplan.run/2"})
    assert old.ranks == rep.ranks and old.run_options == rep.run_options
