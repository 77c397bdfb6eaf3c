"""The runnable examples in the docstrings of the torch-free modules run and give what they show."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "stageplan"


# every module with an example, outside the torch edge (the torch modules' examples need a model)
MODULES = sorted(
    ".".join(p.relative_to(PKG.parent).with_suffix("").parts)
    for folder in (PKG, PKG / "formats", PKG / "planning")
    for p in folder.glob("*.py")
    if ">>>" in p.read_text() and p.stem not in ("measure",)
)


def test_the_examples_are_found() -> None:
    assert {"stageplan.planning.solver", "stageplan.planning.planner", "stageplan.units"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
