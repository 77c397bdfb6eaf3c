"""Tests for stageplan.planning.search: DeepSpeed's partition rules against literal ports of deepspeed/runtime/utils.py."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stageplan.errors import StageplanError
from stageplan.planning.search import partition_balanced, partition_uniform

# --------------------------------------------------------------------------------------------------
# DeepSpeed baselines against literal ports of deepspeed/runtime/utils.py (0.19)
# --------------------------------------------------------------------------------------------------


def ds_partition_uniform(num_items: int, num_parts: int) -> list[int]:
    parts = [0] * (num_parts + 1)
    if num_items <= num_parts:
        for p in range(num_parts + 1):
            parts[p] = min(p, num_items)
        return parts
    chunksize = num_items // num_parts
    residual = num_items - (chunksize * num_parts)
    arr = np.arange(0, (num_parts + 1) * chunksize, chunksize)
    for i in range(residual):
        arr[i + 1 :] += 1
    return arr.tolist()


def ds_partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    n = len(weights)
    m = num_parts
    if n <= m:
        return ds_partition_uniform(n, m)
    dp_max = np.full((n + 1, m + 1), np.inf)
    dp_min = np.full((n + 1, m + 1), np.inf)
    dp_cost = np.full((n + 1, m + 1), np.inf)
    position = np.zeros((n + 1, m + 1), dtype=int)
    prefix_sum = np.zeros(n + 1)
    prefix_sum[1:] = np.cumsum(weights)
    dp_max[0, 0] = 0
    dp_cost[0, 0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                max_sum = max(dp_max[k, j - 1], prefix_sum[i] - prefix_sum[k])
                min_sum = min(dp_min[k, j - 1], prefix_sum[i] - prefix_sum[k])
                cost = max_sum - min_sum
                if dp_cost[i, j] >= cost:
                    dp_cost[i, j] = cost
                    dp_max[i, j] = max_sum
                    dp_min[i, j] = min_sum
                    position[i, j] = k
    parts = [n]
    for i in reversed(range(1, m + 1)):
        parts.append(position[parts[-1], i])
    parts.reverse()
    return [int(x) for x in parts]


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 60), st.integers(1, 12))
def test_partition_uniform_matches_deepspeed(n: int, p: int) -> None:
    assert partition_uniform(n, p) == tuple(ds_partition_uniform(n, p))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 6).map(float) | st.floats(0, 10, allow_nan=False), min_size=1, max_size=9),
    st.integers(1, 6),
)
def test_partition_balanced_matches_deepspeed(weights: list[float], p: int) -> None:
    assert partition_balanced(weights, p) == tuple(ds_partition_balanced(weights, p))


def test_partition_balanced_integer_weights_and_examples() -> None:
    assert partition_balanced([1, 1, 1, 1, 4], 2) == (0, 4, 5)
    assert partition_balanced([5, 1, 1, 1, 1, 1], 3) == tuple(ds_partition_balanced([5, 1, 1, 1, 1, 1], 3))
    assert partition_balanced([3, 4], 5) == (0, 1, 2, 2, 2, 2)
    assert partition_uniform(10, 4) == (0, 3, 6, 8, 10)
    assert partition_uniform(3, 5) == (0, 1, 2, 3, 3, 3)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: partition_uniform(4, 0), r"num_parts \(0\) must be at least 1"),
        (lambda: partition_uniform(-1, 2), r"num_items must be an integer >= 0, got -1"),
        (lambda: partition_balanced([1, float("nan")], 2), r"weights\[1\] is nan; every weight must be finite"),
        (lambda: partition_balanced([[1, 2]], 2), r"weights must be one-dimensional .* got shape \(1, 2\)"),
        (lambda: partition_balanced([1, 2], 0), r"num_parts \(0\) must be at least 1"),
    ],
)
def test_baseline_errors(call: object, match: str) -> None:
    with pytest.raises(StageplanError, match=match):
        call()  # type: ignore[operator]


