"""Layouts of real model shapes, estimated for an H100: the reference case (LLaMA-3-70B on 64 GPUs, the
published recipe scored beside the best), LLaMA-2-70B, and the proof that pricing every candidate with no
bound picks the same best on 16 devices."""

from __future__ import annotations

import pytest

from stageplan.layouting import layout
from stageplan.planning.layouts import Network, search_layouts
from stageplan.profiling.shards import estimate_hf_profiles

GiB = 1024.0**3
# Megatron-Bridge's Llama-3-70B recipe for 64 x H100 (PR #5391): TP4, PP8, VP5, sequence parallel, with its
# hand-written layout for the embedding and loss stages
RECIPE = "tp=4,pp=8,dp=2,mbs=1,sharding=zero1,vp=5,sp=1,layout=Et*2|(t*2|)*34,t*3|(t*2|)*3,tL"


@pytest.fixture(scope="module")
def llama3_70b() -> dict[tuple[int, int], object]:
    profiles, notes = estimate_hf_profiles({"preset": "llama3-70b", "seq_len": 8192},
                                           device="estimate:h100-sxm",
                                           microbatch_sizes=[1, 2], tensor_parallel=[1, 2, 4, 8])
    assert notes == []
    return profiles  # type: ignore[return-value]


def test_reference_case_llama3_70b_on_64_h100(llama3_70b: dict) -> None:
    lay = layout(list(llama3_70b.values()), 64, global_batch_size=128, memory_limit="80GiB",
                 sequence_parallel=True, given=RECIPE)
    best = lay.best
    assert best.feasible and best.peak_memory_bytes is not None and best.peak_memory_bytes <= 80 * GiB
    assert best.pipeline_parallel * best.data_parallel * best.tensor_parallel == 64
    assert best.mfu is not None and 0.05 < best.mfu < 0.8
    given = lay.given
    assert given is not None
    assert (given.tensor_parallel, given.pipeline_parallel, given.data_parallel, given.virtual_stages) == (
        4,
        8,
        2,
        5,
    )
    assert given.boundaries is not None and len(given.boundaries) == 41  # the recipe's 40 stages
    assert given.boundaries[:3] == (0, 3, 5)  # E with two blocks, then two blocks a stage
    assert given.mfu is not None
    # the best is at least as fast as the recipe, or the recipe does not fit
    assert not given.feasible or given.step_s >= best.step_s * (1 - 1e-9)


def test_exhaustive_pricing_picks_the_same_best_on_16_devices(llama3_70b: dict) -> None:
    # 16 x 80 GiB hold no layout of this model at sequence 8192 (the smallest limit that admits one is 89.85
    # GiB): a larger device keeps the memory bound in play
    kw = dict(global_batch_size=32, network=Network(8, 450e9, 50e9), memory_limit_bytes=160 * GiB,
              sequence_parallel=True, microbatch_sizes=[1, 2], top=5)
    pruned = search_layouts(llama3_70b, 16, **kw)  # type: ignore[arg-type]
    full = search_layouts(llama3_70b, 16, bounds=False, **kw)  # type: ignore[arg-type]
    assert full.counts["priced"] == full.counts["grid"]
    assert pruned.counts["priced"] < full.counts["priced"]
    assert pruned.best.degrees == full.best.degrees
    assert pruned.best.step_s == full.best.step_s


def test_llama2_70b_at_4096_on_64_h100() -> None:
    lay = layout("hf", 64, options={"preset": "llama2-70b", "seq_len": 4096}, device="estimate:h100-sxm",
                 global_batch_size=128, memory_limit="80GiB", microbatch_sizes=[1, 2],
                 tensor_parallel=[1, 2, 4, 8],
                 sequence_parallel=True, given="tp=4,pp=8,dp=2,mbs=1,sharding=zero1,vp=5,sp=1")
    assert lay.best.feasible and lay.best.mfu is not None
    assert lay.given is not None and lay.given.mfu is not None
