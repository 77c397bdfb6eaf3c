"""The runnable examples in the public docstrings (no torch needed) run and give what they show."""

from __future__ import annotations

import doctest

import pytest

import stageplan.api
import stageplan.solver


@pytest.mark.parametrize("module", [stageplan.api, stageplan.solver], ids=["api", "solver"])
def test_docstring_examples(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)  # type: ignore[arg-type]
    assert result.attempted > 0 and result.failed == 0
