"""The integration tier: spawned ranks, torchrun, fresh interpreters. Every test here is marked slow, so `make
test` (the fast tier, tests/unit) never collects them by accident and nothing here needs the marker by
hand."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # a conftest's hook sees every collected item, not only this folder's
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.slow)
