"""Tensor-parallel runs, before any rank starts: an HF plan's styles as torch's, the refusals (one line each,
with the values and a remedy), the all-reduce count's closed form and the layout's per-rank counts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_one_line_error, run_cli
from torch import nn

from stageplan.errors import StageplanError
from stageplan.formats.plan import Plan
from stageplan.planning.layouts import search_layouts
from stageplan.planning.planner import plan as make_plan
from stageplan.planning.sharding import tensor_parallel_collectives
from stageplan.running.tensor import (
    _as_linear,
    check_tensor_parallel_run,
    model_tp_plan,
    plan_tensor_parallel,
    tp_styles,
)
from unit.test_layouts import NET, lm_profile

SMALL = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 64,
         "tie_word_embeddings": False}


def _llama(**fields: Any) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**{**SMALL, **fields}))


def _plan(t: int = 2, **changes: Any) -> Plan:
    base = make_plan(lm_profile(4), 2, num_microbatches=4)
    meta = {**base.profile_meta, "tensor_parallel": t, **changes.pop("meta", {})}
    return dataclasses.replace(base, profile_meta=meta, **changes)


def test_llamas_own_plan_maps_to_torchs_column_and_row_parallel_linears() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = tp_styles(model_tp_plan(_llama()))
    kinds = {name: type(style) for name, style in styles.items()}
    assert kinds == {"self_attn.q_proj": ColwiseParallel, "self_attn.k_proj": ColwiseParallel,
                     "self_attn.v_proj": ColwiseParallel, "self_attn.o_proj": RowwiseParallel,
                     "mlp.gate_proj": ColwiseParallel, "mlp.up_proj": ColwiseParallel,
                     "mlp.down_proj": RowwiseParallel}


def test_styles_and_patterns_it_does_not_apply_are_refused() -> None:
    with pytest.raises(StageplanError, match=r"shards 'lm_head' as 'colwise_rep', and stageplan run applies "
                                             r"only colwise and rowwise"):
        tp_styles({"lm_head": "colwise_rep"})
    with pytest.raises(StageplanError, match=r"names 'embed_tokens', outside its decoder blocks"):
        tp_styles({"embed_tokens": "colwise"})


def test_a_model_without_an_hf_plan_is_refused() -> None:
    with pytest.raises(StageplanError, match=r"Sequential has none; run it with a plan at "
                                             r"--tensor-parallel 1"):
        model_tp_plan(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.parametrize(("plan_changes", "model_fields", "pattern"), [
    ({"cost_options": "dp2"}, {},
     r"2 data-parallel replicas of 2-way tensor-parallel shards, .* with --devices 4"),
    ({"cost_options": "interleaved"}, {},
     r"tested with GPipe and 1F1B, not Interleaved1F1B; .*--schedule 1F1B"),
    ({"meta": {"sequence_parallel": True}}, {}, r"sequence parallelism .* without --sequence-parallel"),
    ({}, {"num_key_value_heads": 1}, r"degree 2 does not divide the model's key/value heads \(1\)"),
    ({}, {"intermediate_size": 129}, r"degree 2 does not divide the model's intermediate size \(129\)"),
])
def test_what_a_tensor_parallel_run_does_not_do_is_refused(
        plan_changes: dict[str, Any], model_fields: dict[str, Any], pattern: str) -> None:
    changes = dict(plan_changes)
    base = _plan()
    if changes.get("cost_options") == "dp2":
        changes["cost_options"] = {**base.cost_options, "data_parallel": 2}
    elif changes.get("cost_options") == "interleaved":
        changes["cost_options"] = {**base.cost_options, "schedule": "Interleaved1F1B", "virtual_stages": 2}
    the_plan = _plan(**changes) if changes else base
    with pytest.raises(StageplanError, match=pattern):
        check_tensor_parallel_run(_llama(**model_fields), the_plan)


def test_whole_layers_need_no_check_and_the_degree_comes_from_the_profile() -> None:
    whole = make_plan(lm_profile(4), 2, num_microbatches=4)
    assert plan_tensor_parallel(whole) == 1 and plan_tensor_parallel(_plan(4)) == 4
    check_tensor_parallel_run(nn.Sequential(nn.Linear(2, 2)), whole)  # nothing to refuse


def test_the_cli_refuses_a_tensor_parallel_plan_it_cannot_run_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_spawn: None) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    path = tmp_path / "plan.json"
    _plan(meta={"sequence_parallel": True}).save(path)
    code, _, err = run_cli(["run", "hf", "--set", f"config={config}", "--set", "seq_len=16", "--plan",
                            str(path)], capsys)
    assert_one_line_error(code, err, r"sequence parallelism")


def test_an_exported_linear_becomes_the_nn_linear_it_was_with_the_same_parameters() -> None:
    from stageplan.layers import cut_stages

    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    cut = cut_stages(model, (torch.randn(2, 4),), ["0", "1", "2"], [0, 3], ["0", "1", "2"])
    exported = cut.pieces[0].module.get_submodule("0")
    assert not isinstance(exported, nn.Linear)
    linear = _as_linear(exported, "0")
    assert isinstance(linear, nn.Linear) and linear.weight is exported.weight and linear.bias is exported.bias
    x = torch.randn(2, 4)
    torch.testing.assert_close(linear(x), model[0](x))
    with pytest.raises(StageplanError,
                       match=r"shards 1 as a linear layer, and it is a .* that does not run one"):
        _as_linear(cut.pieces[0].module.get_submodule("1"), "1")


def test_the_all_reduce_count_is_two_a_block_each_way_per_microbatch() -> None:
    """Megatron's g twice forward, f twice backward (Shoeybi et al. 2019, figure 3); recompute repeats the
    forward's, less the stage's last when nothing in the stage saves the last block's output."""
    assert tensor_parallel_collectives(3, 8, 2) == (48, 48)
    assert tensor_parallel_collectives(3, 8, 4, recompute=True) == (48, 96)
    assert tensor_parallel_collectives(3, 8, 2, recompute=True, ends_with_block=True) == (48, 88)
    assert tensor_parallel_collectives(3, 8, 1) == (0, 0)
    assert tensor_parallel_collectives(0, 8, 2) == (0, 0)


def test_a_layouts_plan_carries_each_ranks_count() -> None:
    prof = lm_profile(8)
    lay = search_layouts({(1, 2): prof}, 8, global_batch_size=8, network=NET, tensor_parallel=[2],
                         pipeline_parallel=[4], microbatch_sizes=[1], schedules=["1F1B"], recompute=[False],
                         shardings=["ddp"])
    assert lay.plan is not None
    meta = lay.plan.profile_meta
    assert meta["tensor_parallel"] == 2 and meta["sequence_parallel"] is False
    m = lay.plan.num_microbatches
    blocks = [sum(1 for k in range(st.first_layer, st.end_layer) if prof.names[k].startswith("layers."))
              for st in lay.plan.stages]
    assert sum(blocks) == 8
    assert meta["tensor_parallel_collectives"] == [[2 * n * m, 2 * n * m] for n in blocks]
