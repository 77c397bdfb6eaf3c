"""Every stored profile in profiles/ loads under the current schema and carries its provenance."""

from __future__ import annotations

from pathlib import Path

import pytest

from stageplan import Profile
from stageplan.api import plan

FILES = sorted((Path(__file__).resolve().parents[1] / "profiles").rglob("*.json"))


def test_there_are_stored_profiles() -> None:
    names = {p.name for p in FILES}
    assert {"gpt.json", "gpt-large.json", "convnet.json", "hf-gpt2.json"} <= names


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_profile_validates_and_plans(path: Path) -> None:
    prof = Profile.load(path)
    assert len(prof) >= 4
    for key in ("model", "device", "dtype", "microbatch_size", "torch_version", "repeats", "date", "whole_model_s"):
        assert key in prof.meta, key
    assert all(x.forward_s > 0 and x.backward_s >= 0 for x in prof.layers)
    pl = plan(prof, 2)
    assert pl.boundaries[-1] == len(prof)
