"""Every stored profile gives the boundaries recorded in tests/data/golden_boundaries.json (p = 2, 4, 8 under
GPipe, 1F1B and Interleaved1F1B with v = 2, m = 2p, the planner's default options).

The data were recorded before the house was rebuilt, so that the rebuild provably changed no plan. A change to
the cost model that moves boundaries on purpose regenerates them with
``python tests/unit/test_golden.py --regenerate`` and says in its commit which boundaries moved and why.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from stageplan import Profile, plan

ROOT = Path(__file__).resolve().parents[2]


GOLDEN = ROOT / "tests" / "data" / "golden_boundaries.json"


def _cases() -> list[tuple[str, str, int, int, int]]:
    cases = []
    for path in sorted(x for x in (ROOT / "profiles").rglob("*.json") if "links" not in x.parts):
        n = len(Profile.load(path))
        for p in (2, 4, 8):
            for schedule, v in (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)):
                if p * v <= n:
                    cases.append((path.relative_to(ROOT).as_posix(), schedule, p, 2 * p, v))
    return cases


def _key(path: str, schedule: str, p: int, m: int, v: int) -> str:
    return f"{path}|{schedule}|p={p}|m={m}|v={v}"


def _boundaries(path: str, schedule: str, p: int, m: int, v: int) -> list[int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl = plan(Profile.load(ROOT / path), p, num_microbatches=m, schedule=schedule, virtual_stages=v)
    return list(pl.boundaries)


def test_every_stored_profile_is_covered() -> None:
    assert {_key(*c) for c in _cases()} == set(json.loads(GOLDEN.read_text()))


@pytest.mark.parametrize("case", _cases(), ids=lambda c: _key(*c))
def test_boundaries_unchanged(case: tuple[str, str, int, int, int]) -> None:
    assert _boundaries(*case) == json.loads(GOLDEN.read_text())[_key(*case)]
