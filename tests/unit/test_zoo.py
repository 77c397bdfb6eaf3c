"""The generic Hugging Face workload: configs and presets,
meta builds, layers found without patterns, bad input."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_one_line_error, run_cli

from stageplan.errors import StageplanError, WorkloadError
from stageplan.layers import cut_layers, resolve, store_outputs
from stageplan.zoo import build_workload, hf, hf_presets


def test_hf_workloads_without_transformers_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from stageplan.errors import WorkloadError
    from stageplan.zoo import hf_gpt2, hf_llama

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    for factory in (hf_gpt2, hf_llama):
        with pytest.raises(WorkloadError,
                           match=r"need the 'transformers' package.*pip install 'stageplan\[hf\]'"):
            factory()


_DECODER = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, vocab_size=256, max_position_embeddings=128)


# Tiny configs (hidden 64, 2 layers, vocabulary 256) and the layers cut_layers must find in each, unaided.
TINY: dict[str, tuple[dict[str, Any], list[str]]] = {
    "llama": (_DECODER, ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm+lm_head"]),
    "mistral": ({**_DECODER, "sliding_window": 8},
                ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm+lm_head"]),
    "qwen2": (_DECODER, ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm+lm_head"]),
    "gemma": ({**_DECODER, "head_dim": 16},
              ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm+lm_head"]),
    "gpt2": (dict(n_embd=64, n_head=4, n_layer=2, vocab_size=256, n_positions=128, bos_token_id=0,
                  eos_token_id=0, attn_pdrop=0.1, embd_pdrop=0.1, resid_pdrop=0.1),
             ["transformer.wte+transformer.wpe", "transformer.h.0", "transformer.h.1",
              "transformer.ln_f+lm_head"]),
    "mixtral": ({**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2},
                ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm+lm_head"]),
    "opt": (dict(hidden_size=64, ffn_dim=128, num_attention_heads=4, num_hidden_layers=2, vocab_size=256,
                 word_embed_proj_dim=64,
                 max_position_embeddings=128, pad_token_id=1, bos_token_id=2, eos_token_id=2, dropout=0.1),
            ["model.decoder.embed_tokens+model.decoder.embed_positions", "model.decoder.layers.0",
             "model.decoder.layers.1", "model.decoder.final_layer_norm+lm_head"]),
}


# Parameter counts of the shipped shapes, as published
# (Llama 2 paper / model cards: 6.74B, 13.0B, 68.98B; ...).
PRESET_PARAMETERS = {
    "gpt2": 124_439_808,
    "gpt2-xl": 1_557_611_200,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "qwen2-7b": 7_615_616_512,
    "opt-175b": 174_604_468_224,
}


def tiny_config(tmp_path: Path, model_type: str) -> str:
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps({"model_type": model_type, **TINY[model_type][0]}))
    return str(path)


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_layers_are_found_unaided_and_chain_to_the_whole_model(model_type: str, tmp_path: Path) -> None:
    wl = hf(config=tiny_config(tmp_path, model_type), seq_len=16, batch_size=4)
    args = tuple(a[:2] for a in wl.input_tuple())
    cut = cut_layers(wl.model, args)
    assert cut.names == TINY[model_type][1]
    with torch.no_grad():
        torch.testing.assert_close(cut.run(args), wl.model(*args))
        assert wl.model(*args).shape == (2, 16, 256)  # forward returns the logits tensor


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_meta_build_has_the_real_shapes_buffers_and_inputs(model_type: str, tmp_path: Path) -> None:
    path = tiny_config(tmp_path, model_type)
    real = hf(config=path, seq_len=16, batch_size=4, seed=3)
    meta = hf(config=path, seq_len=16, batch_size=4, seed=3, meta=True)
    assert num_parameters(meta.model) == num_parameters(real.model)
    real_params = dict(real.model.named_parameters())
    assert {n: p.shape for n, p in meta.model.named_parameters()} == {n: p.shape for n,
                                                                      p in real_params.items()}
    assert all(p.device.type == "meta" for p in meta.model.parameters())
    real_buffers = dict(real.model.named_buffers())
    for name, buf in meta.model.named_buffers():  # RoPE inv_freq and friends stay real, with the same values
        torch.testing.assert_close(buf, real_buffers[name], rtol=0, atol=0)
    assert torch.equal(meta.inputs, real.inputs) and torch.equal(meta.target, real.target)
    if model_type == "gpt2":  # tied weights stay tied on meta
        assert meta.model.lm_head.weight is meta.model.transformer.wte.weight


def test_a_model_without_sdpa_falls_back_to_eager_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "bloom.json"
    path.write_text(
        json.dumps({"model_type": "bloom", "hidden_size": 64, "n_head": 4, "n_layer": 2, "vocab_size": 256}))
    with pytest.warns(UserWarning, match=r"BloomForCausalLM does not support attn_implementation='sdpa' .* "
                                         r"built with 'eager'"):
        wl = hf(config=str(path), seq_len=16, batch_size=2)
    assert wl.model.config._attn_implementation == "eager"
    cut = cut_layers(wl.model, (wl.inputs,))
    assert cut.names == ["transformer.word_embeddings+transformer.word_embeddings_layernorm",
                         "transformer.h.0", "transformer.h.1", "transformer.ln_f+lm_head"]
    with torch.no_grad():
        torch.testing.assert_close(cut.run((wl.inputs,)), wl.model(wl.inputs))


def test_inputs_are_token_ids_and_the_target_is_the_next_token(tmp_path: Path) -> None:
    wl = hf(config=tiny_config(tmp_path, "llama"), seq_len=32, batch_size=3, seed=1)
    assert wl.inputs.shape == wl.target.shape == (3, 32)
    assert wl.inputs.dtype == torch.long and int(wl.inputs.min()) >= 0 and int(wl.inputs.max()) < 256
    assert torch.equal(wl.inputs[:, 1:], wl.target[:, :-1])
    assert not torch.equal(wl.inputs,
                           hf(config=tiny_config(tmp_path, "llama"), seq_len=32, batch_size=3, seed=2).inputs)
    with torch.no_grad():
        loss = wl.compute_loss(wl.model(wl.inputs), wl.target)
    assert loss.shape == () and 4.0 < float(loss) < 7.0  # about log(256) = 5.5 for an untrained model


def test_options_are_recorded_and_dropout_is_off(tmp_path: Path) -> None:
    path = tiny_config(tmp_path, "gpt2")
    wl = build_workload("hf", {"config": path, "seq_len": 16})
    assert wl.name == "hf"
    assert wl.factory_options == dict(config=path, preset=None, seq_len=16, batch_size=8, seed=0,
                                      dtype="float32", meta=False)
    cfg = wl.model.config
    assert (cfg.attn_pdrop, cfg.embd_pdrop, cfg.resid_pdrop, cfg.use_cache) == (0.0, 0.0, 0.0, False)
    assert cfg._attn_implementation == "sdpa"
    assert wl.model.training  # dropout is off by configuration, not by eval mode: two forwards agree
    torch.testing.assert_close(wl.model(wl.inputs[:2]), wl.model(wl.inputs[:2]), rtol=0, atol=0)


def test_build_leaves_the_global_rng_and_default_dtype_as_they_were(tmp_path: Path) -> None:
    state = torch.get_rng_state()
    wl = hf(config=tiny_config(tmp_path, "llama"), seq_len=8, batch_size=2, dtype="bfloat16")
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.get_default_dtype() == torch.float32
    with pytest.raises(WorkloadError):
        hf(config=tiny_config(tmp_path, "llama"), seq_len=999, dtype="float16")
    assert torch.get_default_dtype() == torch.float32
    assert {p.dtype for p in wl.model.parameters()} == {torch.bfloat16}


def test_dtype_is_the_build_default_so_rope_buffers_stay_exact(tmp_path: Path) -> None:
    path = tiny_config(tmp_path, "llama")
    fp32 = hf(config=path, seq_len=8, batch_size=2)
    bf16 = hf(config=path, seq_len=8, batch_size=2, dtype="bfloat16", meta=True)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    inv_freq = dict(bf16.model.named_buffers())["model.rotary_emb.inv_freq"]
    assert inv_freq.dtype == torch.float32  # not cast, unlike .to(bfloat16)
    torch.testing.assert_close(inv_freq, dict(fp32.model.named_buffers())["model.rotary_emb.inv_freq"],
                               rtol=0, atol=0)


def test_model_pickles_through_its_module_level_class(tmp_path: Path) -> None:
    wl = hf(config=tiny_config(tmp_path, "qwen2"), seq_len=8, batch_size=2)
    copy = pickle.loads(pickle.dumps(wl.model))
    assert type(copy).__name__ == "HFQwen2ForCausalLM" and type(copy).__module__ == "stageplan.zoo"
    with torch.no_grad():
        torch.testing.assert_close(copy(wl.inputs), wl.model(wl.inputs))


def test_llama2_7b_preset_on_meta_has_6_74e9_parameters() -> None:
    wl = build_workload("hf", {"preset": "llama2-7b", "meta": True, "seq_len": 128, "batch_size": 1})
    assert num_parameters(wl.model) == pytest.approx(6.74e9, rel=1e-3)
    assert wl.inputs.shape == (1, 128) and int(wl.inputs.max()) < 32000


@pytest.mark.parametrize("preset", sorted(PRESET_PARAMETERS))
def test_every_preset_names_its_source_and_builds_on_meta_to_the_published_count(preset: str) -> None:
    assert preset in hf_presets()
    fields = json.loads((Path(__file__).parents[2] / "stageplan" / "presets" / f"{preset}.json").read_text())
    assert fields["_source"] and fields["model_type"] and fields["architectures"]
    wl = hf(preset=preset, meta=True, seq_len=16, batch_size=1)
    assert type(wl.model).__name__ == "HF" + fields["architectures"][0]
    assert num_parameters(wl.model) == PRESET_PARAMETERS[preset]


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        (
            {},
            r"give exactly one of config and preset, got neither .*--set preset=NAME \(one of: .*llama2-70b",
        ),
        ({"config": "x.json", "preset": "gpt2"}, r"give exactly one of config and preset, got both"),
        (
            {"preset": "llama9-1t"},
            r"unknown preset 'llama9-1t'; known presets: gpt2, gpt2-xl, llama2-13b, .*opt-175b",
        ),
        ({"preset": "../presets/gpt2"}, r"unknown preset '../presets/gpt2'"),
        (
            {"config": "{tmp}/missing.json"},
            r"config file '.*missing.json' does not exist; pass the path of a local config.json",
        ),
        ({"config": "{tmp}/notjson.json"}, r"cannot read config '.*notjson.json' as JSON \(JSONDecodeError"),
        (
            {"config": "{tmp}/unknown.json"},
            r"model_type 'no-such-model', which transformers 5\.\d+\.\d+ does not know",
        ),
        ({"config": "{tmp}/untyped.json"}, r"has no model_type field; add one"),
        ({"config": "{tmp}/t5.json"}, r"describes a t5 model, which is not a causal language model"),
        (
            {"config": "{tmp}/badheads.json"},
            r"cannot build a llama config from config '.*badheads.json' "
            r"\(.*The hidden size \(64\) is not a multiple of the number "
            r"of attention heads \(5\)\.\); fix that field",
        ),
        (
            {"config": "{tmp}/badsize.json"},
            r"transformers cannot build LlamaForCausalLM from config "
            r".*negative dimension -5.*; fix the config, or pick a preset",
        ),
        (
            {"preset": "gpt2", "seq_len": 2048},
            r"seq_len \(2048\) exceeds the model's max_position_embeddings \(1024\)",
        ),
        (
            {"preset": "gpt2", "dtype": "float64"},
            r"option dtype must be one of float32, bfloat16, float16, got 'float64'",
        ),
        ({"preset": "gpt2", "meta": "yes"}, r"option meta must be true or false"),
        ({"preset": "gpt2", "batch_size": 0}, r"option batch_size must be a positive integer"),
    ],
)
def test_bad_input_is_a_workload_error(options: dict[str, Any], pattern: str, tmp_path: Path) -> None:
    (tmp_path / "notjson.json").write_text("{model_type: llama")
    (tmp_path / "unknown.json").write_text(json.dumps({"model_type": "no-such-model", "hidden_size": 64}))
    (tmp_path / "untyped.json").write_text(json.dumps({"hidden_size": 64}))
    (tmp_path / "t5.json").write_text(json.dumps({"model_type": "t5", "d_model": 64, "num_layers": 2}))
    (tmp_path / "badheads.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                        "num_attention_heads": 5,
                                                         "num_key_value_heads": 5, "vocab_size": 256}))
    (tmp_path / "badsize.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                       "num_attention_heads": 4,
                                                        "intermediate_size": -5, "vocab_size": 256}))
    options = {k: v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v for k, v in options.items()}
    with pytest.raises(WorkloadError, match=pattern) as info:
        build_workload("hf", options)
    assert isinstance(info.value, StageplanError) and "\n" not in str(info.value)


def test_cli_refuses_an_unknown_preset_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(["profile", "hf", "--set", "preset=nope", "-o", str(tmp_path / "p.json")], capsys)
    assert_one_line_error(code, err, r"unknown preset 'nope'; known presets: .*llama2-70b")


def test_cli_profiles_a_local_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    code, _, err = run_cli(["profile", "hf", "--set", f"config={tiny_config(tmp_path, 'llama')}", "--set",
                            "seq_len=16",
                            "--warmup", "1", "--repeats", "2", "--quiet", "-o", str(out)], capsys)
    assert code == 0, err
    data = json.loads(out.read_text())
    assert [layer["name"] for layer in data["layers"]] == TINY["llama"][1]
    assert data["meta"]["factory_options"]["seq_len"] == 16


def test_gpt_refuses_a_word_for_tied(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--set tied=no reached the factory as the string 'no', and bool('no') built a tied model."""
    assert build_workload("gpt", {"tied": True, "n_layer": 1}).factory_options["tied"] is True
    assert build_workload("gpt", {"tied": False, "n_layer": 1}).factory_options["tied"] is False
    with pytest.raises(WorkloadError,
                       match=r"gpt: option tied must be true or false, got 'no'; pass --set tied=true"):
        build_workload("gpt", {"tied": "no"})
    code, _, err = run_cli(["profile", "gpt", "--set", "tied=no", "-o", str(tmp_path / "p.json")], capsys)
    assert_one_line_error(code, err, r"option tied must be true or false, got 'no'")


# ----------------------------------------------------------------------------------------------------------
# HF models cut as a trainer runs them: only hidden states cross a boundary


def _plain_transformers_twin(wl: Any) -> torch.nn.Module:
    """The same model as transformers builds it (no stageplan wrapping), holding ``wl.model``'s weights."""
    import transformers

    config = wl.model.config
    plain = transformers.AutoModelForCausalLM.from_config(config,
                                                          attn_implementation=config._attn_implementation)
    plain.load_state_dict(wl.model.state_dict())
    return plain.train()


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_hf_boundaries_carry_only_hidden_states_and_compute_as_transformers(model_type: str,
                                                                            tmp_path: Path) -> None:
    wl = hf(config=tiny_config(tmp_path, model_type), seq_len=16, batch_size=2)
    args = (wl.inputs,)
    cut = cut_layers(wl.model, args)
    hidden = wl.model.config.get_text_config().hidden_size
    with torch.no_grad():
        env: dict[Any, Any] = {}
        for k, piece in enumerate(cut.pieces):
            store_outputs(env, k, piece.module(*[resolve(r, args, env) for r in piece.inputs]))
    crossing = [[tuple(resolve(r, args, env).shape) for r in cut.crossing_refs(k)]
                for k in range(len(cut.pieces) - 1)]
    if model_type == "mistral":
        # its sliding window (8) is shorter than the sequence (16): the causal mask alone would attend further
        # back than the model does, so the window's mask still crosses (not the rotary cos and sin)
        assert crossing == [[(2, 16, hidden), (2, 1, 16, 16)]] * 2 + [[(2, 16, hidden)]]
    else:
        assert crossing == [[(2, 16, hidden)]] * (len(cut.pieces) - 1)
    # oracle: transformers' own model with the same weights, logits and every gradient
    plain = _plain_transformers_twin(wl)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in wl.model.named_parameters()]
    assert plain.state_dict().keys() == wl.model.state_dict().keys()  # the rotary copies are not persistent
    ours = wl.model(wl.inputs)
    theirs = plain(input_ids=wl.inputs).logits
    torch.testing.assert_close(ours, theirs)
    ours.square().mean().backward()
    theirs.square().mean().backward()
    grads = dict(plain.named_parameters())
    for name, p in wl.model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)


def test_hf_blocks_keep_parameter_counts_and_pickle(tmp_path: Path) -> None:
    wl = hf(config=tiny_config(tmp_path, "qwen2"), seq_len=8, batch_size=2)
    layer = wl.model.model.layers[0]
    assert type(layer).__name__ == "HFBlock_Qwen2DecoderLayer" and type(layer).__module__ == "stageplan.zoo"
    assert layer.rotary_emb.inv_freq.dtype == torch.float32 and not list(layer.rotary_emb.parameters())
    assert num_parameters(wl.model) == num_parameters(_plain_transformers_twin(wl))
    copy = pickle.loads(pickle.dumps(wl.model))
    assert type(copy.model.layers[1]) is type(layer)
    with torch.no_grad():
        torch.testing.assert_close(copy(wl.inputs), wl.model(wl.inputs))


def llama_block_saved_bytes(*, b: int, s: int, h: int, f: int, heads: int, kv_heads: int,
                            e: int) -> dict[str, int]:
    """Bytes an HF LLaMA decoder layer saves for backward, tensor by tensor, with SDPA on its flash kernel
    (``is_causal``, no mask), parameters excluded; ``e`` bytes per element of the model's dtype.

    - LlamaRMSNorm (modeling_llama.py) upcasts to fp32: ``pow`` and the ``rsqrt`` multiply save the fp32 input
      (4 bytes; in an fp32 model the upcast is the input itself), ``rsqrt`` its (s, 1) fp32 output, and the
      weight's multiply the normalised tensor back in the model's dtype.
    - Linear layers save their input: the norm's output feeds q, k, v (one tensor) and gate, up (another).
    - Rotary: cos and sin of shape (1, s, head_dim), computed inside the layer from positions that need no
      gradient, so ``q * cos`` saves cos but not q; q and k after rotary are saved by SDPA.
    - Flash SDPA saves q, k, v, its output (which o_proj's input shares: the kernel writes (b, s, heads, d))
      and the fp32 logsumexp (b, heads, s).
    - MLP: SiLU saves its input (gate's output), the product saves SiLU's output and up's output, down_proj
      its input.
    """
    d = h // heads
    norm = {"fp32 upcast": 4 * b * s * h, "rsqrt": 4 * b * s, "normalised": e * b * s * h}
    return {
        **{f"input_layernorm {k}": v for k, v in norm.items()},
        "q/k/v input": e * b * s * h,
        "cos": e * s * d, "sin": e * s * d,
        "q after rotary": e * b * s * h, "k after rotary": e * b * s * kv_heads * d,
        "v": e * b * s * kv_heads * d, "attention output (o_proj input)": e * b * s * h,
        "logsumexp": 4 * b * heads * s,
        **{f"post_attention_layernorm {k}": v for k, v in norm.items()},
        "gate/up input": e * b * s * h,
        "gate output (SiLU input)": e * b * s * f, "SiLU output": e * b * s * f, "up output": e * b * s * f,
        "down_proj input": e * b * s * f,
    }


def test_small_llama_block_measured_on_cpu_saves_the_hand_count(tmp_path: Path) -> None:
    from stageplan.profiling.profiler import profile_model
    from stageplan.zoo import hf_llama

    b, s, h, heads = 2, 32, 64, 4
    wl = hf_llama(n_layer=3, d_model=h, n_head=heads, seq_len=s, vocab_size=128, batch_size=4)
    prof = profile_model(wl, microbatch_size=b, warmup=0, repeats=1, streaming=False, dedup=False)
    hand = sum(llama_block_saved_bytes(b=b, s=s, h=h, f=4 * h, heads=heads, kv_heads=heads, e=4).values())
    blocks = [x for x in prof.layers if x.name.startswith("model.layers.")]
    assert len(blocks) == 3
    assert [x.activation_bytes for x in blocks] == [hand] * 3
    # every boundary after the embedding and between blocks is the (b, s, h) fp32 hidden states
    assert [x.output_bytes for x in prof.layers[:-1]] == [b * s * h * 4] * 4


def test_qwen2_block_saves_what_a_transformers_decoder_layer_saves(tmp_path: Path) -> None:
    """Qwen2-7B's config with its widths cut 16x (28 heads of 8, 4 key/value heads, MLP 18944/16), seq 128,
    microbatch 1: each block's measured saved bytes against one Qwen2DecoderLayer that transformers builds
    from the same config, in a one-layer model run whole (rotary cos/sin and mask as the model makes them),
    its saved tensors seen by torch.autograd.graph.saved_tensors_hooks."""
    import transformers

    from stageplan.profiling.profiler import profile_model

    fields = json.loads((Path(__file__).parents[2] / "stageplan" / "presets" / "qwen2-7b.json").read_text())
    fields.pop("_source")
    fields.update(hidden_size=224, intermediate_size=1184, num_hidden_layers=2, vocab_size=512,
                  bos_token_id=0, eos_token_id=0)
    path = tmp_path / "qwen2-small.json"
    path.write_text(json.dumps(fields))
    wl = hf(config=str(path), seq_len=128, batch_size=2)
    prof = profile_model(wl, microbatch_size=1, warmup=0, repeats=1, streaming=False, dedup=False)
    blocks = [x for x in prof.layers if x.name.startswith("model.layers.")]

    config = transformers.Qwen2Config.from_dict({**fields, "num_hidden_layers": 1, "use_cache": False})
    oracle = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    layer = oracle.model.layers[0]
    assert type(layer) is transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer
    params = {p.untyped_storage().data_ptr() for p in oracle.parameters()}
    saved: dict[int, int] = {}
    inside = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        oracle(input_ids=wl.inputs[:1])
    real = sum(saved.values())
    assert len(blocks) == 2
    for x in blocks:
        assert abs(x.activation_bytes / real - 1) < 0.05, (x.name, x.activation_bytes, real)
    assert [x.output_bytes for x in prof.layers[:-1]] == [128 * 224 * 4] * 3  # the hidden states alone
    print(f"\nQwen2 (widths / 16) block, seq 128: saved {[x.activation_bytes for x in blocks]} bytes, "
          f"transformers' Qwen2DecoderLayer {real}")
