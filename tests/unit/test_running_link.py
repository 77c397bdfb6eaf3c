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


def test_the_replicas_line_runs_through_the_ends_and_holds_its_fixed_cost_at_zero_or_above() -> None:
    """The line through the smallest and the largest size's times; one that would cross zero below the
    smallest size starts at 0 and still meets the largest; a large message no slower falls back to the
    ping-pong's two-point fit."""
    from stageplan.running.link import fit, line_through_ends

    largest = 2e-3 + SIZES[-1] / 2e9
    a, bandwidth = line_through_ends(SIZES, [1e-3, 5.0, 5.0, 5.0, largest])  # the middle sizes play no part
    assert (a + SIZES[0] / bandwidth, a + SIZES[-1] / bandwidth) == pytest.approx((1e-3, largest))
    steep = [1e-6, 0.0, 0.0, 0.0, 0.02]  # the line through both ends crosses zero above 4 KiB
    fixed, rate = line_through_ends(SIZES, steep)
    assert fixed == 0.0 and SIZES[-1] / rate == pytest.approx(0.02)
    assert line_through_ends([4096, 2**22], [2e-3, 1e-3]) == fit([4096, 2**22], [2e-3, 1e-3])


def test_an_fsdp_units_fixed_cost_is_what_each_unit_more_adds_at_a_size_of_mibs() -> None:
    """Synthetic times on a known model, u units of n bytes in all: t = u c(n) + n / B, where a unit costs
    0.5 ms at the smallest size and 1.5 ms at 16 MiB. From the ends alone an FSDP2 unit's fixed cost is the
    line's a / 4; timed once more over 16 units at 16 MiB, it is (t16 - t4) / 12 = 1.5 ms, the rate still the
    line's; a count that added nothing (or less than nothing) keeps a / 4; DDP and ZeRO-1 are untouched."""
    from stageplan.formats.link import DP_SYNC_KINDS
    from stageplan.running.link import dp_sync_fields, line_through_ends

    sizes = [64 * 2**10, 2**20, 16 * 2**20, 32 * 2**20]
    rate = 1e9

    def c(n: int) -> float:
        return 0.5e-3 if n <= 2**20 else 1.5e-3

    four = {k: [4 * c(n) + n / rate for n in sizes] for k in DP_SYNC_KINDS}
    a, b = line_through_ends(sizes, four["fsdp_gather"])
    plain = dp_sync_fields(sizes, four, 2, 4)
    assert plain["dp_sync_fit"]["fsdp_gather"] == pytest.approx([a / 4, b])
    assert "dp_sync_many_s" not in plain
    many = {k: 16 * c(2**24) + 2**24 / rate for k in ("fsdp_reduce", "fsdp_gather")}
    f = dp_sync_fields(sizes, four, 2, 4, (16, 2**24, many))
    for k in ("fsdp_reduce", "fsdp_gather"):
        assert f["dp_sync_fit"][k] == pytest.approx([1.5e-3, b], rel=1e-9)
    assert f["dp_sync_fit"]["ddp"] == plain["dp_sync_fit"]["ddp"]
    assert (f["dp_sync_many_units"], f["dp_sync_many_size"], f["dp_sync_many_s"]) == (16, 2**24, many)
    slower = {"fsdp_gather": four["fsdp_gather"][2] - 1e-3}  # 16 units no slower than 4: a / 4 stays
    assert dp_sync_fields(sizes, four, 2, 4, (16, 2**24, slower))["dp_sync_fit"]["fsdp_gather"] == \
        pytest.approx([a / 4, b])
