"""Profile data: JSON round trip, schema refusal, DataFrame/CSV views, atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stageplan import LayerProfile, Profile
from stageplan.errors import SchemaError, StageplanError


def _profile() -> Profile:
    layers = tuple(
        LayerProfile(name=f"l{i}", forward_s=0.001 * (i + 1), backward_s=0.002 * (i + 1), activation_bytes=100 * i,
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
    assert set(data["layers"][0]) >= {"name", "forward_s", "backward_s", "activation_bytes", "output_bytes", "param_bytes"}
    q = Profile.load(path)
    assert q == p and q.digest() == p.digest()
    assert q.sum_vs_whole == pytest.approx(sum(x.time_s for x in p.layers) / 0.02)
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was replaced, not left behind


def test_newer_schema_is_refused_naming_both(tmp_path: Path) -> None:
    data = _profile().to_json()
    data["schema"] = "stageplan.profile/2"
    with pytest.raises(SchemaError, match=r"schema 'stageplan.profile/2' but this stageplan reads 'stageplan.profile/1'"):
        Profile.from_json(data)
    data["schema"] = "something/1"
    with pytest.raises(SchemaError, match=r"schema 'something/1', expected 'stageplan.profile/1'"):
        Profile.from_json(data)


def test_bad_costs_are_refused() -> None:
    data = _profile().to_json()
    data["layers"][1]["forward_s"] = -1.0
    with pytest.raises(SchemaError, match=r"layer 1 \('l1'\) has forward_s = -1.0; costs must be finite numbers >= 0"):
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
