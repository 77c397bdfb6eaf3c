"""Every stored profile in profiles/ loads under the current schema and carries its provenance."""

from __future__ import annotations

from pathlib import Path

import pytest

from stageplan import Profile
from stageplan.planning.planner import plan

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(x for x in (ROOT / "profiles").rglob("*.json") if "links" not in x.parts)
LINKS = sorted((ROOT / "profiles").rglob("links/*.json"))


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
