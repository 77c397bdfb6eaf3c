"""stageplan.formats.profile: Profile / LayerProfile round trips, refusals, merging over processes, the
optimizer and tie records, and every stored profile under profiles/ validates and plans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stageplan import LayerProfile, Profile
from stageplan.errors import SchemaError, StageplanError
from stageplan.planning.planner import plan

from .test_planner import _with_optimizer

ROOT = Path(__file__).resolve().parents[2]


FILES = sorted(x for x in (ROOT / "profiles").rglob("*.json") if "links" not in x.parts)


LINKS = sorted((ROOT / "profiles").rglob("links/*.json"))


def test_there_are_stored_profiles() -> None:
    names = {p.name for p in FILES}
    assert {"gpt.json", "gpt-large.json", "convnet.json", "hf-gpt2.json"} <= names


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_profile_validates_and_plans(path: Path) -> None:
    prof = Profile.load(path)
    assert len(prof) >= 4
    for key in ("model", "device", "dtype", "microbatch_size", "torch_version", "repeats", "date",
                "whole_model_s"):
        assert key in prof.meta, key
    assert all(x.forward_s > 0 and x.backward_s >= 0 for x in prof.layers)
    pl = plan(prof, 2)
    assert pl.boundaries[-1] == len(prof)


def test_stored_links_price_a_stored_profile() -> None:
    assert LINKS  # profiles/cpu/links/gloo-2ranks.json: stageplan link --ranks 2 on the same machine
    prof = Profile.load(ROOT / "profiles" / "cpu" / "gpt-12l-v16k.json")
    for path in LINKS:
        pl = plan(prof, 2, num_microbatches=4, link=str(path))
        assert pl.cost_options["latency_source"] and pl.cost_options["bandwidth_bytes_per_s"] > 0
        sim = pl.simulate()
        moves = [e for e in sim.timeline if e.kind in ("A", "G")]
        assert len(moves) == 2 * 4 and all(e.end_s > e.start_s for e in moves)  # each crossing costs time
        assert any(e.kind == "O" for e in sim.timeline)  # the stored profile carries its optimizer step


def _profile() -> Profile:
    layers = tuple(
        LayerProfile(name=f"l{i}", forward_s=0.001 * (i + 1), backward_s=0.002 * (i + 1),
                     activation_bytes=100 * i,
                     output_bytes=64, param_bytes=4096, param_count=1024, forward_iqr_s=1e-5)
        for i in range(4)
    )
    return Profile(layers, {"model": "toy", "whole_model_s": 0.02})


def test_round_trip(tmp_path: Path) -> None:
    p = _profile()
    path = tmp_path / "p.json"
    p.save(path)
    data = json.loads(path.read_text())
    assert data["schema"] == "stageplan.profile/1"
    assert set(data["layers"][0]) >= {"name", "forward_s", "backward_s", "activation_bytes", "output_bytes",
                                      "param_bytes"}
    q = Profile.load(path)
    assert q == p and q.digest() == p.digest()
    assert q.sum_vs_whole == pytest.approx(sum(x.time_s for x in p.layers) / 0.02)
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was replaced, not left behind


def test_newer_schema_is_refused_naming_both(tmp_path: Path) -> None:
    data = _profile().to_json()
    data["schema"] = "stageplan.profile/2"
    with pytest.raises(SchemaError,
                       match=r"schema 'stageplan.profile/2' but this stageplan reads 'stageplan.profile/1'"):
        Profile.from_json(data)
    data["schema"] = "something/1"
    with pytest.raises(SchemaError, match=r"schema 'something/1', expected 'stageplan.profile/1'"):
        Profile.from_json(data)


def test_bad_costs_are_refused() -> None:
    data = _profile().to_json()
    data["layers"][1]["forward_s"] = -1.0
    with pytest.raises(SchemaError,
                       match=r"layer 1 \('l1'\) has forward_s = -1.0; costs must be finite numbers >= 0"):
        Profile.from_json(data)
    data = _profile().to_json()
    del data["layers"][0]["output_bytes"]
    with pytest.raises(SchemaError, match=r"layer 0 lacks output_bytes"):
        Profile.from_json(data)


def test_missing_file_and_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(StageplanError, match=r"profile file .* does not exist"):
        Profile.load(tmp_path / "nope.json")
    with pytest.raises(StageplanError, match=r"output folder .* does not exist"):
        _profile().save(tmp_path / "missing" / "p.json")


def test_pandas_and_csv(tmp_path: Path) -> None:
    p = _profile()
    df = p.to_pandas()
    assert list(df["name"]) == ["l0", "l1", "l2", "l3"] and len(df) == 4
    p.to_csv(tmp_path / "p.csv")
    assert (tmp_path / "p.csv").read_text().splitlines()[0].startswith("name,forward_s,backward_s")


def test_scaled() -> None:
    p = _profile().scaled([2.0, 1.0, 1.0, 0.5])
    assert p.layers[0].forward_s == pytest.approx(0.002) and p.layers[3].backward_s == pytest.approx(0.004)


def _one_layer(forward_s: float, backward_s: float, acc: float | None, adam: float | None, load: float,
               whole: float | None) -> Profile:
    layer = LayerProfile(name="l0", forward_s=forward_s, backward_s=backward_s, activation_bytes=128,
                         output_bytes=64,
                         param_bytes=4096, param_count=1024, forward_iqr_s=forward_s / 10, backward_iqr_s=0.0,
                         backward_accumulate_s=acc,
                         optimizer_s=None if adam is None else {"adam": adam, "sgd": adam / 4})
    meta = {"model": "toy", "device": "cpu", "microbatch_size": 2, "whole_model_s": whole,
            "load_average_1min": load}
    return Profile((layer,), meta)


def test_merge_profiles_takes_each_times_median_over_processes() -> None:
    from stageplan import merge_profiles

    runs = [_one_layer(1.0, 2.0, 1.5, 0.4, 0.5, 3.0), _one_layer(1.3, 1.8, 1.2, 0.5, 1.5, 3.2),
            _one_layer(1.1, 2.6, 1.4, 0.3, 0.9, 2.9)]
    merged = merge_profiles(runs)
    (row,) = merged.layers
    # medians by hand: forward {1.0, 1.3, 1.1} -> 1.1; backward {2.0, 1.8, 2.6} -> 2.0; accumulating {1.5,
    # 1.2, 1.4} -> 1.4; adam {0.4, 0.5, 0.3} -> 0.4; forward IQR {0.1, 0.13, 0.11} -> 0.11; whole {3.0, 3.2,
    # 2.9} -> 3.0
    assert (row.forward_s, row.backward_s, row.backward_accumulate_s) == (1.1, 2.0, 1.4)
    assert row.optimizer_s == {"adam": 0.4, "sgd": 0.1}
    assert row.forward_iqr_s == pytest.approx(0.11)
    assert (row.activation_bytes, row.output_bytes, row.param_bytes) == (128, 64, 4096)
    assert merged.meta["whole_model_s"] == 3.0 and merged.sum_vs_whole == pytest.approx(3.1 / 3.0)
    assert merged.meta["load_average_1min"] == 1.5  # the highest any process started under
    assert "timed_rounds" not in merged.meta  # none of them says
    for run, rounds in zip(runs, (20, 31, 24)):  # --min-time: each process timed as many rounds as filled it
        run.meta["timed_rounds"] = rounds
    assert merge_profiles(runs).meta["timed_rounds"] == 20  # the fewest any of them timed
    procs = merged.meta["processes"]
    assert procs["count"] == 3 and procs["digests"] == [p.digest() for p in runs]
    # range = (max - min) / median: forward (1.3 - 1.0) / 1.1, backward (2.6 - 1.8) / 2.0
    assert procs["range"] == [
        {"layer": "l0", "forward": pytest.approx(0.3 / 1.1), "backward": pytest.approx(0.4)}]
    # an even count takes the middle two's mean; a profile
    # without accumulating backward or optimizer keeps None
    pair = merge_profiles([runs[0], _one_layer(1.2, 2.2, None, None, 0.0, None)])
    assert pair.layers[0].forward_s == pytest.approx(1.1) and pair.layers[0].backward_accumulate_s is None
    assert pair.layers[0].optimizer_s is None and pair.meta["whole_model_s"] is None
    assert merge_profiles(runs[:1]) is runs[0]
    # the optimizer step's fixed cost, per optimizer, is a time like the others: its median over the processes
    for run, floor in zip(runs, (0.03, 0.01, 0.02)):
        run.meta["optimizer_step"] = {"floor_s": {"adam": floor, "sgd": floor / 2},
                                      "optimizers": {"adam": "Adam"}}
    merged = merge_profiles(runs)
    assert merged.meta["optimizer_step"] == {"floor_s": {"adam": 0.02, "sgd": 0.01},
                                             "optimizers": {"adam": "Adam"}}
    # one profile without it: the first's meta stands, as for any other key
    runs[1].meta.pop("optimizer_step")
    assert merge_profiles(runs).meta["optimizer_step"]["floor_s"] == {"adam": 0.03, "sgd": 0.015}


def test_merge_profiles_refuses_profiles_of_other_models_or_conditions() -> None:
    from stageplan import merge_profiles

    base = _one_layer(1.0, 2.0, None, None, 0.0, None)
    other_mb = Profile(base.layers, {**base.meta, "microbatch_size": 4})
    with pytest.raises(SchemaError, match=r"profile 1 has microbatch_size = 4 where profile 0 has 2; merge "
                                          r"profiles taken under the same conditions"):
        merge_profiles([base, other_mb])
    renamed = Profile((LayerProfile("x", 1.0, 2.0, 0, 0, 0),), dict(base.meta))
    with pytest.raises(SchemaError, match=r"profile 1 has layers \['x'\] where profile 0 has \['l0'\]"):
        merge_profiles([base, renamed])
    with pytest.raises(SchemaError, match="needs at least one profile"):
        merge_profiles([])


GPT = ROOT / "tests" / "data" / "old-format" / "gpt-12l-v16k.json"  # written before optimizer records existed


def test_profile_json_round_trip_and_digest() -> None:
    old = Profile.load(GPT)
    new = _with_optimizer(old)
    assert Profile.from_json(json.loads(json.dumps(new.to_json()))) == new
    assert Profile.from_json(json.loads(json.dumps(old.to_json()))).layers[0].optimizer_s is None
    assert new.to_json()["schema"] == "stageplan.profile/1"
    assert old.digest() == Profile.from_json(json.loads(GPT.read_text())).digest()  # absent: digest as before
    assert new.digest() != old.digest()  # measured: a cost the plan was made from


def test_bad_optimizer_times_are_refused() -> None:
    data = Profile.load(GPT).to_json()
    data["layers"][0]["optimizer_s"] = {"adam": -1.0}
    with pytest.raises(SchemaError, match=r"layer 0 \('tok_emb\+pos_emb'\) has optimizer_s = \{'adam': "
                                          r"-1.0\}; it must map optimizer names to finite seconds >= 0, or "
                                          r"be null; re-profile the model"):
        Profile.from_json(data)
