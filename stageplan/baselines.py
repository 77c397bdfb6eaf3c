"""The peers' partition rules, ported faithfully: DeepSpeed's uniform and parameter-balanced splits (no torch)."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from stageplan.errors import StageplanError
from stageplan.solver import _shape_text, _validate_count

__all__ = ["partition_balanced", "partition_uniform"]


def partition_uniform(num_items: int, num_parts: int) -> tuple[int, ...]:
    """DeepSpeed's ``partition_uniform``: equal layer counts, the first ``n % p`` parts one larger.

    With ``num_items <= num_parts`` part k ends at ``min(k, num_items)`` (so some parts are empty).

    >>> partition_uniform(10, 4)
    (0, 3, 6, 8, 10)
    """
    n = _validate_count_zero("num_items", num_items)
    p = _validate_count("num_parts", num_parts, "parts")
    if n <= p:
        return tuple(min(k, n) for k in range(p + 1))
    chunksize = n // p
    residual = n - chunksize * p
    # DeepSpeed: arange(0, (p+1)*chunksize, chunksize), then parts[i+1:] += 1 for i < residual
    return tuple(k * chunksize + min(k, residual) for k in range(p + 1))


def _validate_count_zero(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 0:
        raise StageplanError(f"{name} must be an integer >= 0, got {value!r}; pass a count of layers")
    return int(value)


def partition_balanced(weights: ArrayLike, num_parts: int) -> tuple[int, ...]:
    """DeepSpeed's ``partition_balanced``: the O(n^2 p) DP minimising (max part sum - min part sum).

    Same results as DeepSpeed's triple loop, ties included (``if dp_cost[i, j] >= cost`` keeps the
    last k with the minimal cost); only the innermost loop over k is vectorised, and over j too.
    With ``n <= num_parts`` it falls back to :func:`partition_uniform`.

    >>> partition_balanced([1, 1, 1, 1, 4], 2)
    (0, 4, 5)
    """
    w = np.asarray(weights)
    if w.ndim != 1:
        raise StageplanError(
            f"weights must be one-dimensional (one value per layer), got shape {_shape_text(w.shape)}; "
            "pass a flat sequence"
        )
    try:
        wf = w.astype(np.float64)
    except (TypeError, ValueError) as exc:
        raise StageplanError(f"weights must be numeric, got {weights!r}; pass numbers") from exc
    if not np.all(np.isfinite(wf)):
        k = int(np.flatnonzero(~np.isfinite(wf))[0])
        raise StageplanError(f"weights[{k}] is {float(wf[k])!r}; every weight must be finite; check the weights")
    m = _validate_count("num_parts", num_parts, "parts")
    n = w.size
    if n <= m:
        return partition_uniform(n, m)
    dp_max = np.full((n + 1, m + 1), np.inf)
    dp_min = np.full((n + 1, m + 1), np.inf)
    dp_cost = np.full((n + 1, m + 1), np.inf)
    position = np.zeros((n + 1, m + 1), dtype=np.int64)
    prefix_sum = np.zeros(n + 1)
    prefix_sum[1:] = np.cumsum(w) if w.size else []  # as DeepSpeed: cumsum in the input dtype
    dp_max[0, 0] = 0
    dp_cost[0, 0] = 0
    for i in range(1, n + 1):
        jm = min(i, m)
        seg = (prefix_sum[i] - prefix_sum[:i])[:, None]  # (k, 1)
        max_sum = np.maximum(dp_max[:i, :jm], seg)  # column j-1 for j = 1..jm
        min_sum = np.minimum(dp_min[:i, :jm], seg)
        cost = max_sum - min_sum
        # the last k attaining the minimum (DeepSpeed updates on >=)
        k = i - 1 - np.argmin(cost[::-1], axis=0)
        cols = np.arange(jm)
        dp_cost[i, 1 : jm + 1] = cost[k, cols]
        dp_max[i, 1 : jm + 1] = max_sum[k, cols]
        dp_min[i, 1 : jm + 1] = min_sum[k, cols]
        position[i, 1 : jm + 1] = k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(int(position[parts[-1], j]))
    parts.reverse()
    return tuple(parts)
