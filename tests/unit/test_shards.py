"""The profiles a layout needs: a t-way shard's config, its parameters by layer, one block repeated to the
model's blocks, and the refusals (MoE, degrees that do not divide the heads)."""

from __future__ import annotations

import pytest
from torch import nn

from stageplan.errors import StageplanError
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.profiling.shards import (
    check_tensor_parallel,
    estimate_hf_profiles,
    expand_blocks,
    hf_fields,
    param_tensors,
    shard_fields,
)


def test_a_shard_divides_heads_and_mlp_and_pins_head_dim() -> None:
    fields = hf_fields({"preset": "llama3-70b"})
    shard = shard_fields(fields, 8)
    assert (shard["num_attention_heads"], shard["num_key_value_heads"]) == (8, 1)
    assert shard["intermediate_size"] == 28672 // 8
    assert shard["head_dim"] == 8192 // 64  # the full model's, not hidden / (heads / t)
    assert shard["vocab_size"] == 129024 // 8  # padded to 128 x 8 first, as Megatron pads it
    assert shard["num_hidden_layers"] == 1 and "eos_token_id" not in shard
    assert shard_fields(fields, 1)["vocab_size"] == 128256


def test_degrees_that_do_not_divide_the_heads_and_moe_models_are_refused() -> None:
    fields = hf_fields({"preset": "llama3-70b"})
    with pytest.raises(StageplanError, match=r"tensor-parallel degree 3 does not divide the model's "
                                             r"attention heads \(64\); use --tensor-parallel 1,2"):
        check_tensor_parallel(fields, [1, 2, 3])
    with pytest.raises(StageplanError, match=r"tensor-parallel degree 16 does not divide the model's "
                                             r"key/value heads \(8\)"):
        check_tensor_parallel(fields, [16])
    with pytest.raises(StageplanError, match=r"mixture-of-experts models \(num_local_experts = 8\) need "
                                             r"expert parallelism, which stageplan does not model"):
        check_tensor_parallel({**fields, "num_local_experts": 8}, [1])
    gpt2 = hf_fields({"preset": "gpt2"})
    assert check_tensor_parallel(gpt2, [1, 2]) == [
        "tensor parallelism is priced for llama, mistral, qwen2, qwen3 decoders, not gpt2: t = 1 only"]
    with pytest.raises(StageplanError, match=r"hf: unknown preset 'nope'"):
        hf_fields({"preset": "nope"})


def test_parameters_by_layer_follow_the_fqns_joined_by_plus() -> None:
    model = nn.Sequential()
    model.add_module("embed", nn.Embedding(10, 4))
    model.add_module("block", nn.Linear(4, 4))
    model.add_module("norm", nn.LayerNorm(4))
    model.add_module("head", nn.Linear(4, 10, bias=False))
    assert param_tensors(model, ["embed", "block", "norm+head"]) == [[40], [16, 4], [4, 4, 40]]


def test_one_block_is_repeated_to_the_models_blocks() -> None:
    layers = (LayerProfile("model.embed_tokens", 1.0, 1.0, 0, 8, 10, 10),
              LayerProfile("model.layers.0", 2.0, 4.0, 100, 8, 20, 20),
              LayerProfile("model.norm+lm_head", 3.0, 3.0, 50, 0, 10, 10))
    prof = Profile(layers, {"named_layers": ["model.layers.0"], "param_tensors": [[10], [15, 5], [10]]})
    big = expand_blocks(prof, 80)
    assert len(big) == 82
    assert big.names[1:4] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert big.layers[80].measured_as == "model.layers.0" and big.layers[1].measured_as is None
    assert big.meta["named_layers"] == [f"model.layers.{i}" for i in range(80)]
    assert big.meta["param_tensors"][5] == [15, 5] and len(big.meta["param_tensors"]) == 82
    assert sum(x.param_count for x in big.layers) == 10 + 80 * 20 + 10
    with pytest.raises(StageplanError, match=r"expanding blocks needs a profile of exactly one named block, "
                                             r"got 0"):
        expand_blocks(Profile(layers, {}), 4)


def test_an_hf_layout_is_estimated_for_a_gpu_or_measured_on_this_cpu() -> None:
    with pytest.raises(StageplanError, match=r"estimated for a GPU or measured on this CPU: pass --device "
                                             r"estimate:GPU .* or --device cpu, got 'cuda'"):
        estimate_hf_profiles({"preset": "llama3-8b"}, device="cuda", microbatch_sizes=[1],
                             tensor_parallel=[1])
