"""stageplan.timing: a rank's layers timed alone after its run (retime_layers), at their known cost and in the
profile's order."""

from __future__ import annotations

import pytest
import torch

from stageplan import StageplanError
from stageplan.profiling.profiler import profile_model
from stageplan.timing import retime_layers
from stageplan.zoo import build_workload

from .test_profiler import COLD, HOT, _between, _evictees


@pytest.mark.timing
def test_retime_follows_the_profiles_order_with_the_next_layer_in_the_chain() -> None:
    wl = _evictees(4)
    names = ["0", "1", "2", "3"]
    # a rank's layers in a stage's order run with the layer
    # after them (timed, not returned): layer 1 follows 2
    got = retime_layers(wl, names, [0, 1], 2, "cpu", warmup=1, repeats=5, order="stage")
    assert sorted(got) == [0, 1] and all(
        _between(got[k][1], COLD) and _between(got[k][2], COLD) for k in got
    ), got
    # layer 2 joins 1's chain
    got = retime_layers(wl, names, [1, 3], 2, "cpu", warmup=1, repeats=5, order="stage")
    assert sorted(got) == [1, 3] and _between(got[1][1], COLD) and _between(got[3][1], HOT), got
    got = retime_layers(wl, names, [0, 1], 2, "cpu", warmup=1, repeats=5)  # the default: each alone
    assert all(_between(got[k][1], HOT) and _between(got[k][2], HOT) for k in got), got
    with pytest.raises(StageplanError,
                       match=r"order must be one of stage, layer, got 'diagonal'; e\.g\. --order stage"):
        retime_layers(wl, names, [0], 2, "cpu", order="diagonal")


FWD_MS, BWD_MS = (6.0, 2.0, 4.0), (8.0, 3.0, 5.0)


def _sleepers():  # type: ignore[no-untyped-def]
    return build_workload("workloads:sleepers", {"forward_ms": ",".join(map(str, FWD_MS)),
                                                 "backward_ms": ",".join(map(str, BWD_MS))})


@pytest.mark.timing
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
    with pytest.raises(StageplanError, match=r"the model cuts into 3 layers here \(0, 1, 2\) and the plan "
                                             r"has 2 \(a, b\): its profile is of another model.*profile this "
                                             r"model and plan again"):
        retime_layers(wl, ["a", "b"], [0], 2, "cpu")


def test_a_profile_stops_a_slow_layers_rounds_past_max_time(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Layers that sleep 10 ms forward and 10 ms backward: a round (a forward, and a backward into empty and
    into accumulating gradients, each after its own forward) takes at least 50 ms a layer, so a cap of 0.05 s
    a layer is reached after one round and the least, 5 timed rounds, are left after 1 warm-up (a quarter of
    the cap is less than a round): whole model, layer at a time, and from the CLI (that layers of milliseconds
    keep all their rounds: test_measure's closed form). A cap <= 0 is refused in one line, and nothing is
    written."""
    from conftest import run_cli

    from stageplan.formats.profile import Profile

    wl = build_workload("workloads:sleepers", {"forward_ms": "10,10", "backward_ms": "10,10"})
    for streaming in (False, True):
        prof = profile_model(wl, microbatch_size=2, warmup=5, repeats=20, dedup=False, streaming=streaming,
                             max_time_s=0.05)
        assert prof.meta["timed_rounds"] == 5 and prof.meta["max_time_s"] == 0.05, (streaming, prof.meta)
        # the sleeps, measured from the 5 rounds (a sleep overshoots, never undershoots)
        assert all(0.010 <= x.forward_s <= 0.015 and 0.010 <= x.backward_s <= 0.015 for x in prof.layers)
    with pytest.raises(StageplanError, match=r"max_time_s must be a number of seconds > 0 \(inf for no "
                                             r"cap\), got 0; e\.g\. --max-time 30"):
        profile_model(wl, microbatch_size=2, max_time_s=0)

    out = tmp_path / "p.json"
    code, _, _ = run_cli(["profile", "workloads:sleepers", "--set", "forward_ms=10,10", "--set",
                          "backward_ms=10,10", "--no-dedup", "--max-time", "0.05", "--quiet", "-o", str(out)],
                         capsys)
    assert code == 0
    assert Profile.load(out).meta["timed_rounds"] == 5
    code, _, err = run_cli(["profile", "workloads:sleepers", "--max-time", "-1", "-o",
                            str(tmp_path / "q.json")], capsys)
    assert code == 2 and err.count("\n") == 1 and "max_time_s must be a number of seconds > 0" in err
    assert not (tmp_path / "q.json").exists()
