"""stageplan.running.link without ranks: the docstring
examples, and an estimated profile gets its GPU's link."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest

import stageplan.running.link
from stageplan.formats.link import LINK_SCHEMA
from stageplan.planning.planner import plan

from .test_link import OUT_BYTES, _profile


def test_docstring_examples() -> None:
    result = doctest.testmod(stageplan.running.link, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(("gpu", "bandwidth", "name"),
                         [("h100-sxm", 450e9, "NVLink"), ("mi300x", None, "xGMI")])
def test_estimated_profile_gets_its_gpus_link_within_a_node(
    gpu: str, bandwidth: float | None, name: str
) -> None:
    table = json.loads((Path(stageplan.running.link.__file__).parents[1] / "gpus.json").read_text())
    row = table["gpus"][gpu]["intra_node"]
    bandwidth = bandwidth or float(row["bandwidth"])
    prof = _profile({"timer": "analytic", "estimate": {"gpu": gpu}})
    pl = plan(prof, 2, num_microbatches=4)
    assert pl.cost_options["bandwidth_bytes_per_s"] == bandwidth
    assert pl.stages[0].comm_s == pytest.approx(2 * OUT_BYTES / bandwidth)
    note = next(n for n in pl.notes if n.startswith("no link given"))
    assert name in note and row["source"] in note and f"{bandwidth / 1e9:.0f} GB/s" in note
    assert "InfiniBand" in note and table["inter_node_default"]["source"] in note
    assert not any("communication between stages is not modelled" in n for n in pl.notes)
    # a bandwidth or a link given replaces the default
    given = plan(prof, 2, num_microbatches=4, bandwidth="25GB/s")
    assert given.cost_options["bandwidth_bytes_per_s"] == 25e9 and not any("no link given" in n
                                                                           for n in given.notes)
    linked = plan(prof, 2, num_microbatches=4,
                  link={"schema": LINK_SCHEMA, "latency_s": 1e-5, "bandwidth_bytes_per_s": 1e9})
    assert linked.cost_options["bandwidth_bytes_per_s"] == 1e9 and not any("no link given" in n
                                                                           for n in linked.notes)


SIZES = [4096, 64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20]


def test_the_hockney_fit_gives_back_a_line_and_weighs_each_size_by_its_relative_error() -> None:
    import numpy as np

    from stageplan.running.link import fit, hockney_fit

    a, bandwidth = 2e-4, 1.5e9
    exact = [a + n / bandwidth for n in SIZES]
    assert hockney_fit(SIZES, exact) == pytest.approx((a, bandwidth), rel=1e-9)
    # noisy times: the oracle is numpy's least squares on (a + n c - t) / t, i.e. rows [1/t, n/t] against 1
    noisy = [t * f for t, f in zip(exact, [1.3, 0.8, 1.1, 0.95, 1.05])]
    t, n = np.array(noisy), np.array(SIZES, dtype=float)
    (a_ls, c_ls), *_ = np.linalg.lstsq(np.stack([1 / t, n / t], axis=1), np.ones_like(t), rcond=None)
    assert hockney_fit(SIZES, noisy) == pytest.approx((a_ls, 1 / c_ls), rel=1e-9)
    # a fixed cost that comes out negative is held at 0: the slope through the origin, as least squares says
    through = [n / 1e9 - 1e-5 if n > 4096 else 1e-7 for n in SIZES]
    t = np.array(through)
    (c_0,), *_ = np.linalg.lstsq((n / t)[:, None], np.ones_like(t), rcond=None)
    assert hockney_fit(SIZES, through) == pytest.approx((0.0, 1 / c_0), rel=1e-9)
    # through two sizes, the line through both
    a2, b2 = hockney_fit([4096, 2**22], [1e-4, 3e-3])
    assert (a2 + 4096 / b2, a2 + 2**22 / b2) == pytest.approx((1e-4, 3e-3), rel=1e-9)
    # no positive slope (the large message no slower): the ping-pong's two-point fit
    assert hockney_fit([4096, 2**22], [2e-3, 1e-3]) == fit([4096, 2**22], [2e-3, 1e-3])


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_the_data_parallel_fields_are_ring_constants_that_give_back_the_fit_at_their_rank_count(
        ranks: int) -> None:
    from stageplan.planning.sharding import ring_time
    from stageplan.running.link import dp_allreduce_fields

    a, bandwidth = 3e-4, 2e9
    f = dp_allreduce_fields(SIZES, [a + n / bandwidth for n in SIZES], ranks, 2)
    assert (f["dp_allreduce_ranks"], f["dp_allreduce_groups"], f["dp_allreduce_sizes"]) == (ranks, 2, SIZES)
    for n in SIZES:
        priced = ring_time(n, ranks, f["dp_allreduce_bandwidth_bytes_per_s"], f["dp_allreduce_latency_s"])
        assert priced == pytest.approx(a + n / bandwidth, rel=1e-9)
