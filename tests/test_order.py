"""The order a profile times its layers in (profile_model's ``order``): as a stage runs them (every forward in
turn, then every backward in reverse) or each backward right after its own forward. Oracle: layers whose backward
sleeps a known time that depends only on what ran just before it (tests/workloads.py's Evictee: hot right after its
own forward, cold after anything else), so each order's figures follow from the order alone."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli

from stageplan import StageplanError, plan
from stageplan.errors import SchemaError
from stageplan.formats.profile import merge_profiles
from stageplan.profiling.profiler import profile_model
from stageplan.report import profile_table
from stageplan.timing import retime_layers
from stageplan.zoo import build_workload

FWD, HOT, COLD = 1e-3, 2e-3, 6e-3
SLACK = 2e-3  # a sleep overshoots a little, never undershoots


def _evictees(layers: int = 6):  # type: ignore[no-untyped-def]
    return build_workload("workloads:evictees", {"layers": layers, "forward_ms": FWD * 1e3, "hot_ms": HOT * 1e3,
                                                 "cold_ms": COLD * 1e3})


def _between(value: float | None, low: float) -> bool:
    return value is not None and low <= value <= low + SLACK


def test_stage_order_times_each_backward_after_the_next_layers_and_every_layer_in_its_place() -> None:
    wl = _evictees()
    stage = profile_model(wl, microbatch_size=2, warmup=1, repeats=5)  # the whole model fits: stage order
    layer = profile_model(wl, microbatch_size=2, warmup=1, repeats=5, order="layer")
    assert stage.meta["order"] == "stage" and layer.meta["order"] == "layer"
    assert "in a stage's order" in stage.meta["method"] and "right after its own forward" in layer.meta["method"]
    n = len(stage.layers)
    for k, (s, x) in enumerate(zip(stage.layers, layer.layers)):
        # each alone: every backward right after its own forward, hot, into empty grads and accumulating
        assert _between(x.backward_s, HOT) and _between(x.backward_accumulate_s, HOT), (k, x)
        # a stage's order: each backward after the next layer's, cold; the last layer's right after its forward
        want = HOT if k == n - 1 else COLD
        assert _between(s.backward_s, want) and _between(s.backward_accumulate_s, want), (k, s)
        assert _between(s.forward_s, FWD) and _between(x.forward_s, FWD)
    # identical layers (1-4; layer 0 gets no input gradient, layer 5 the loss): alone, the last two reuse the
    # second's figures; in a stage's order each is timed in its own place in the chain
    assert [x.measured_as for x in layer.layers] == [None, None, None, "2", "2", None]
    assert all(x.measured_as is None for x in stage.layers)
    # of them, those between identical neighbours (2 and 3: 1 follows layer 0, 4 precedes the loss layer) take the
    # medians over both's rounds; without dedup each keeps its own
    assert stage.meta["pooled_layers"] == [["2", "3"]] and layer.meta["pooled_layers"] == []
    assert "pooled: 2, 3 (identical layers between identical neighbours" in profile_table(stage)
    assert "pooled:" not in profile_table(layer)
    assert (stage.layers[2].forward_s, stage.layers[2].backward_s) == (stage.layers[3].forward_s, stage.layers[3].backward_s)
    every = profile_model(wl, microbatch_size=2, warmup=1, repeats=5, dedup=False)
    assert every.meta["pooled_layers"] == [] and all(_between(x.backward_s, COLD) for x in every.layers[:-1])
    assert stage.meta["layers_measured"] == n and stage.meta["layers_reused"] == 0 and stage.meta["dedup_spread"] is None
    # the identical layers still share what does not depend on the order: saved bytes and the optimizer step
    assert [x.activation_bytes for x in stage.layers] == [x.activation_bytes for x in layer.layers]
    assert stage.layers[4].optimizer_s == stage.layers[2].optimizer_s  # (3 is timed too: the third checks the second)


def test_the_orders_price_a_split_as_their_figures_say() -> None:
    """A split's compute under each order, against the closed form over the sleeps (m = 4: forward plus the mean
    of one backward into empty grads and three accumulating)."""
    wl = _evictees(4)
    for order, backward in (("stage", [COLD, COLD, COLD, HOT]), ("layer", [HOT] * 4)):
        prof = profile_model(wl, microbatch_size=2, warmup=1, repeats=5, order=order)
        pl = plan(prof, 2, num_microbatches=2, boundaries=[0, 2, 4])
        for st, (lo, hi) in zip(pl.stages, ((0, 2), (2, 4))):
            known = sum(FWD + backward[k] for k in range(lo, hi))
            assert known <= st.forward_s + st.backward_s <= known + 2 * SLACK, (order, st)


def test_retime_follows_the_profiles_order_with_the_next_layer_in_the_chain() -> None:
    wl = _evictees(4)
    names = ["0", "1", "2", "3"]
    # a rank's layers in a stage's order run with the layer after them (timed, not returned): layer 1 follows 2
    got = retime_layers(wl, names, [0, 1], 2, "cpu", warmup=1, repeats=5, order="stage")
    assert sorted(got) == [0, 1] and all(_between(got[k][1], COLD) and _between(got[k][2], COLD) for k in got), got
    got = retime_layers(wl, names, [1, 3], 2, "cpu", warmup=1, repeats=5, order="stage")  # layer 2 joins 1's chain
    assert sorted(got) == [1, 3] and _between(got[1][1], COLD) and _between(got[3][1], HOT), got
    got = retime_layers(wl, names, [0, 1], 2, "cpu", warmup=1, repeats=5)  # the default: each alone
    assert all(_between(got[k][1], HOT) and _between(got[k][2], HOT) for k in got), got
    with pytest.raises(StageplanError, match=r"order must be one of stage, layer, got 'diagonal'; e\.g\. --order stage"):
        retime_layers(wl, names, [0], 2, "cpu", order="diagonal")


def test_order_refusals_and_the_layer_at_a_time_default(capsys: pytest.CaptureFixture[str]) -> None:
    wl = _evictees(3)
    with pytest.raises(StageplanError, match=r"order must be one of stage, layer, got 'diagonal'; e\.g\. --order stage"):
        profile_model(wl, microbatch_size=2, order="diagonal")
    with pytest.raises(StageplanError, match=r"order 'stage' times every layer in one chain, and a layer-at-a-time "
                                             r"profile holds one layer at a time; use --order layer with --streaming"):
        profile_model(wl, microbatch_size=2, order="stage", streaming=True)
    with pytest.raises(StageplanError, match=r"order \(layer\) is the order layers are timed in, and an estimate times "
                                             r"nothing; drop --order"):
        profile_model(wl, microbatch_size=2, order="layer", device="estimate:h100-sxm")
    streamed = profile_model(wl, microbatch_size=2, warmup=0, repeats=2, streaming=True)
    assert streamed.meta["order"] == "layer" and all(_between(x.backward_s, HOT) for x in streamed.layers)
    code, _, err = run_cli(["profile", "workloads:evictees", "--order", "stage", "--streaming", "-o", "never.json"], capsys)
    assert_one_line_error(code, err, r"order 'stage' times every layer in one chain")
    assert not Path("never.json").exists()
    # in fresh processes too, refused before any starts
    from stageplan.running.launch import profile_in_processes

    with pytest.raises(StageplanError, match=r"order must be one of stage, layer, got 'diagonal'"):
        profile_in_processes("workloads:evictees", processes=2, order="diagonal")
    with pytest.raises(StageplanError, match=r"order 'stage' times every layer in one chain"):
        profile_in_processes("workloads:evictees", processes=2, order="stage", streaming=True)


def test_cli_order_and_merging_refuses_two_orders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    code, stdout, _ = run_cli(["profile", "workloads:evictees", "--set", "layers=3", "--order", "layer", "--warmup", "0",
                               "--repeats", "2", "-o", str(out)], capsys)
    assert code == 0 and "order=layer" in stdout  # the table's last line says how the layers were timed
    data = json.loads(out.read_text())
    assert data["meta"]["order"] == "layer" and all(_between(x["backward_s"], HOT) for x in data["layers"])
    wl = _evictees(3)
    a = profile_model(wl, microbatch_size=2, warmup=0, repeats=2)
    b = profile_model(wl, microbatch_size=2, warmup=0, repeats=2, order="layer")
    with pytest.raises(SchemaError, match=r"profile 1 has order = 'layer' where profile 0 has 'stage'"):
        merge_profiles([a, b])
    assert merge_profiles([a, replace(a)]).meta["order"] == "stage"


@pytest.mark.slow
def test_a_run_retimes_its_layers_in_the_profiles_order(tmp_path: Path) -> None:
    """Each rank times its layers alone after the run in the order its plan's profile was taken in: in a stage's
    order, rank 0's layers 0 and 1 (1 after 2, the next rank's first) and rank 1's layer 2 are cold, layer 3 (the
    loss's) hot; from a profile timed layer by layer, every one hot."""
    from stageplan.running.launch import run

    wl = _evictees(4)
    for order, backward in (("stage", [COLD, COLD, COLD, HOT]), ("layer", [HOT] * 4)):
        prof = profile_model(wl, microbatch_size=2, warmup=1, repeats=5, order=order)
        pl = plan(prof, 2, num_microbatches=2, boundaries=[0, 2, 4])
        report = run("workloads:evictees", pl, factory_options={"layers": 4}, steps=1, warmup=0, timeout_s=120,
                     output=tmp_path / f"{order}.json")
        rows = {x["index"]: x for x in report.layers}
        assert sorted(rows) == [0, 1, 2, 3]
        for k, row in rows.items():
            assert _between(row["retimed_backward_s"], backward[k]), (order, k, row)


def test_compare_and_tune_profile_in_the_order_given(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """--order reaches the profile compare and tune take, in this process and in fresh ones (the profiler and the
    runs are stand-ins that record what they were asked: a stored profile, fixed steps)."""
    from types import SimpleNamespace

    import stageplan.comparison as comparison
    import stageplan.profiling.profiler
    import stageplan.running.launch
    import stageplan.tuning as tuning
    from stageplan import Profile

    stored = Profile.load(Path(__file__).resolve().parents[1] / "profiles" / "cpu" / "gpt.json")
    asked: list[object] = []

    def fake_profile(*_: object, **kw: object) -> Profile:
        asked.append(kw.get("order"))
        return stored

    monkeypatch.setattr(stageplan.profiling.profiler, "profile_model", fake_profile)
    monkeypatch.setattr(stageplan.running.launch, "profile_in_processes", fake_profile)
    monkeypatch.setattr(stageplan.running.launch, "run", lambda *a, **k: SimpleNamespace(measured_step_s=0.1))
    monkeypatch.setattr(tuning, "calibrate", lambda prof, rep: prof)
    monkeypatch.setattr(comparison, "_compare_runs", lambda *a, **k: None)
    tuning.tune("gpt", 2, rounds=1, order="layer")
    tuning.tune("gpt", 2, rounds=1, order="stage", processes=2)
    assert comparison.compare("gpt", 2, order="layer", objective="step")["objective"] == "step"
    tuning.tune("gpt", 2, rounds=1)
    assert asked == ["layer", "stage", "layer", None]  # None: profile_model's default (stage where the model fits)
    # refused before any profile: an unknown order, and an order with a profile to start from
    with pytest.raises(StageplanError, match=r"order must be one of stage, layer, got 'chain'"):
        tuning.tune("gpt", 2, order="chain")
    prof = str(Path(__file__).resolve().parents[1] / "profiles" / "cpu" / "gpt.json")
    for cmd in ("tune", "compare"):
        code, _, err = run_cli([cmd, "gpt", "--stages", "2", "--order", "layer", "--profile", prof,
                                "-o", str(tmp_path / cmd)], capsys)
        assert_one_line_error(code, err, rf"--order layer sets how the profile {cmd} takes times its layers, and "
                                         r"--profile gives the profile to start from; drop one of them")
        assert not (tmp_path / cmd).exists()
    assert len(asked) == 4
