"""LLaMA-2-70B planned from its stored analytic estimate (profiles/estimate/llama2-70b-h100-sxm.json, bf16, sequence
4096, microbatch 1) the way a Megatron user would expect: 80 GiB devices, bf16 mixed precision, Adam."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import stageplan
from stageplan import InfeasiblePlanError, Profile

PROFILE = Path(__file__).resolve().parents[1] / "profiles" / "estimate" / "llama2-70b-h100-sxm.json"
GiB = 2**30
OPTIONS = {"memory_limit": "80GiB", "precision": "bf16-mixed", "optimizer": "adam"}


def _profile() -> Profile:
    return Profile.load(PROFILE)


def test_eight_stages_cannot_hold_70b_and_the_smallest_cap_is_named() -> None:
    # pure pipelining: 69B parameters x 16 bytes / 8 stages is about 140 GB of weights and states per stage
    prof = _profile()
    per_param = 16
    static_per_stage = sum(x.param_count for x in prof.layers) * per_param / 8
    assert static_per_stage > 128 * 1e9
    with pytest.raises(InfeasiblePlanError, match=r"no partition of 82 layers into 8 stages fits the memory limit of "
                                                  r"80.00 GiB per stage; the smallest limit that admits a plan is") as info:
        stageplan.plan(prof, 8, num_microbatches=64, **OPTIONS)
    assert info.value.min_memory_limit_bytes is not None and info.value.min_memory_limit_bytes > static_per_stage


def test_sixteen_stages_with_recompute_fit_80_gib() -> None:
    prof = _profile()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl = stageplan.plan(prof, 16, num_microbatches=64, recompute=True, **OPTIONS)
    assert max(pl.rank_memory_bytes) <= 80 * GiB
    block = next(x for x in prof.layers if x.name.endswith("layers.0"))
    assert block.param_count == 855_654_400
    for st in pl.stages:  # 16 bytes per parameter, as ZeRO counts mixed precision with Adam
        static = st.memory["params"] + st.memory["grads"] + st.memory["master"] + st.memory["optimizer"]
        assert static == 16 * sum(x.param_count for x in prof.layers[st.first_layer:st.end_layer])
    # five blocks a stage for most stages: 5 x 855.6M x 16 B = 63.7 GiB, plus the recomputed activations
    assert sorted(len(st.layers) for st in pl.stages)[len(pl.stages) // 2] == 5
    assert any("ESTIMATE" in n for n in pl.notes)


def test_model_flops_utilisation_is_in_a_plausible_band() -> None:
    """A sanity band, not an oracle (the efficiencies are ours): Megatron's model FLOPs per step,
    72 B s L h^2 (1 + s/6h + V/12hL) (Narayanan et al. 2021), over 16 x peak x the predicted step. Published MFU:
    41-48% (Megatron, H100), 33-39% (torchtitan). Recomputation (a third more compute) and the 1F1B bubble at
    m = 64, p = 16 (19%) come off the estimate's 45% compute efficiency."""
    prof = _profile()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl = stageplan.plan(prof, 16, num_microbatches=64, recompute=True, **OPTIONS)
    B, s, L, h, V = 64, 4096, 80, 8192, 32000
    flops = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L))
    mfu = flops / (16 * 989e12 * pl.predicted_step_s)
    assert 0.15 <= mfu <= 0.60, mfu
