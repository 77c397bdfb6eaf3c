"""The profiles a layout search needs, one per (microbatch size b, tensor-parallel degree t): for an HF
decoder, one block of the t-way shard, the embedding and the head, estimated for a GPU (or measured on this
CPU) and repeated to the model's blocks; for any other model, the whole model profiled once (t = 1, other b
scaled by the search)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from torch import nn

from stageplan.errors import StageplanError
from stageplan.formats.profile import Profile
from stageplan.planning.sharding import padded_vocab

# The HF decoders whose blocks shard as Megatron shards a LLaMA block: attention heads, key/value heads and
# the MLP's intermediate size divided by t (Shoeybi et al. 2019, section 3).
TP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Fields that name a mixture of experts in an HF config (transformers' Mixtral, Qwen2-MoE, DeepSeek configs).
MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def hf_fields(options: dict[str, Any]) -> dict[str, Any]:
    """The config fields of an ``hf`` model spec's ``preset`` or ``config`` option."""
    preset, config = options.get("preset"), options.get("config")
    if (preset is None) == (config is None):
        raise StageplanError("hf: give exactly one of --set preset=NAME or --set config=PATH/config.json")
    if preset is not None:
        path = resources.files("stageplan").joinpath(f"presets/{preset}.json")
        if not path.is_file():
            raise StageplanError(f"hf: unknown preset {preset!r}; see stageplan/presets for the names")
        text = path.read_text(encoding="utf-8")
    else:
        try:
            text = Path(str(config)).read_text(encoding="utf-8")
        except OSError as exc:
            raise StageplanError(
                f"hf: cannot read config {config!r} ({exc.strerror}); check the path"
            ) from None
    fields = dict(json.loads(text))
    fields.pop("_source", None)
    return fields


def check_tensor_parallel(fields: dict[str, Any], degrees: Sequence[int]) -> list[str]:
    """Refuse an MoE model, and a degree that does not divide the heads, key/value heads or the MLP (one line
    with the remedy); return notes on degrees left out for models that do not shard this way."""
    moe = [k for k in MOE_FIELDS if fields.get(k)]
    if moe:
        raise StageplanError(f"mixture-of-experts models ({moe[0]} = {fields[moe[0]]}) need expert "
                             "parallelism, which stageplan does not model; lay out a dense model")
    model_type = str(fields.get("model_type", ""))
    if model_type not in TP_MODEL_TYPES:
        if any(t > 1 for t in degrees):
            return [f"tensor parallelism is priced for {', '.join(TP_MODEL_TYPES)} decoders, not "
                    f"{model_type or 'this model'}: t = 1 only"]
        return []
    heads = int(fields["num_attention_heads"])
    kv = int(fields.get("num_key_value_heads") or heads)
    inter = int(fields["intermediate_size"])
    for t in degrees:
        for what, n in (("attention heads", heads), ("key/value heads", kv), ("intermediate size", inter)):
            if n % t:
                ok = [d for d in degrees if heads % d == 0 and kv % d == 0 and inter % d == 0]
                raise StageplanError(f"tensor-parallel degree {t} does not divide the model's {what} ({n}); "
                                     f"use --tensor-parallel {','.join(str(d) for d in ok) or '1'}")
    return []


def shard_fields(fields: dict[str, Any], t: int, num_layers: int = 1) -> dict[str, Any]:
    """The config of one t-way shard of the model with ``num_layers`` blocks: heads, key/value heads and the
    intermediate size divided by t, ``head_dim`` pinned to the full model's (HF derives it from hidden_size //
    num_attention_heads), the vocabulary padded as Megatron pads it and divided by t.

    >>> f = shard_fields({"hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
    ...                   "intermediate_size": 28672, "vocab_size": 128256, "num_hidden_layers": 80}, 4)
    >>> (
    ...     f["num_attention_heads"],
    ...     f["num_key_value_heads"],
    ...     f["intermediate_size"],
    ...     f["head_dim"],
    ...     f["vocab_size"],
    ... )
    (16, 2, 7168, 128, 32128)
    """
    out = dict(fields)
    heads = int(fields["num_attention_heads"])
    out["num_hidden_layers"] = num_layers
    if t > 1:
        out["head_dim"] = int(fields.get("head_dim") or int(fields["hidden_size"]) // heads)
        out["num_attention_heads"] = heads // t
        out["num_key_value_heads"] = int(fields.get("num_key_value_heads") or heads) // t
        out["intermediate_size"] = int(fields["intermediate_size"]) // t
        out["vocab_size"] = padded_vocab(int(fields["vocab_size"]), t) // t
        # token ids past the shard's vocabulary would be refused by transformers' config checks
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            out.pop(key, None)
    return out


def expand_blocks(profile: Profile, num_blocks: int) -> Profile:
    """A profile of one block (its named layer) between the layers before and after it, repeated to
    ``num_blocks`` blocks named as the model names them: what an estimate of a one-block model of identical
    blocks stands for. Each copy is marked ``measured_as`` the first."""
    named = list(profile.meta.get("named_layers") or [])
    if len(named) != 1:
        raise StageplanError(f"expanding blocks needs a profile of exactly one named block, got "
                             f"{len(named)}; "
                             "estimate the model with num_hidden_layers=1")
    i = profile.names.index(named[0])
    block = profile.layers[i]
    stem = named[0].rsplit(".", 1)[0]
    blocks = [replace(block, name=f"{stem}.{k}", measured_as=None if k == 0 else f"{stem}.0")
              for k in range(num_blocks)]
    layers = (*profile.layers[:i], *blocks, *profile.layers[i + 1:])
    meta = {**profile.meta, "named_layers": [x.name for x in blocks]}
    tensors = meta.get("param_tensors")
    if isinstance(tensors, list) and len(tensors) == len(profile):
        meta["param_tensors"] = [*tensors[:i], *([tensors[i]] * num_blocks), *tensors[i + 1:]]
    meta.pop("tied", None)  # layer indices moved; a one-block estimate has no ties across blocks
    return Profile(tuple(layers), meta)


def param_tensors(model: nn.Module, names: Sequence[str]) -> list[list[int]]:
    """Per profile layer (a module FQN, or several joined by '+'), the element counts of its parameters: what
    zero1's partition of whole tensors gives out."""
    params = list(model.named_parameters())
    out = []
    for name in names:
        parts = name.split("+")
        out.append([int(p.numel()) for fqn, p in params
                    if any(fqn == part or fqn.startswith(part + ".") for part in parts)])
    return out


def estimate_hf_profiles(
    options: dict[str, Any],
    *,
    device: str,
    microbatch_sizes: Sequence[int],
    tensor_parallel: Sequence[int],
    dtype: str = "bfloat16",
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[tuple[int, int], Profile], list[str]]:
    """The (b, t) profiles of an HF decoder given by ``options`` (preset or config, seq_len), estimated for
    ``device`` ("estimate:GPU"), or measured on this machine's CPU ("cpu", in float32 as a CPU run trains):
    one block of each t-way shard with its embedding and head, repeated to the model's blocks. Each carries
    ``meta["layout_model"]`` (the full model's parameters, layers, hidden size and sequence, for tensor
    parallelism's traffic and MFU) and ``meta["param_tensors"]``."""
    from stageplan.profiling.device import is_estimate_device
    from stageplan.profiling.profiler import profile_model
    from stageplan.zoo import hf

    measured = device == "cpu"
    if not is_estimate_device(device) and not measured:
        raise StageplanError(f"a layout of an HF model spec is estimated for a GPU or measured on this CPU: "
                             f"pass --device estimate:GPU (e.g. estimate:h100-sxm) or --device cpu, got "
                             f"{device!r}; or profile the model and pass the profiles")
    if measured:
        # measured on this machine, in the dtype a CPU run trains in (stageplan run builds hf in float32)
        dtype = "float32"
    fields = hf_fields(options)
    notes = check_tensor_parallel(fields, tensor_parallel)
    degrees = [t for t in tensor_parallel if t == 1 or not notes]
    seq_len = int(options.get("seq_len", 128))
    blocks = int(fields["num_hidden_layers"])
    out: dict[tuple[int, int], Profile] = {}
    full_params: float | None = None
    with tempfile.TemporaryDirectory(prefix="stageplan-shard-") as tmp:
        for t in sorted(degrees):
            path = os.path.join(tmp, f"config-t{t}.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(shard_fields(fields, t), f)
            for b in microbatch_sizes:
                if progress:
                    progress(f"estimating tp={t} b={b}")
                work = hf(config=path, seq_len=seq_len, batch_size=b, dtype=dtype, meta=not measured)
                prof = profile_model(work, microbatch_size=b, device=device)
                tensors = param_tensors(work.model, prof.names)
                prof = Profile(prof.layers, {**prof.meta, "param_tensors": tensors,
                                             "factory_options": {**options, "tensor_parallel": t}})
                prof = expand_blocks(prof, blocks)
                if t == 1 and full_params is None:
                    full_params = float(sum(x.param_count for x in prof.layers))
                out[(b, t)] = prof
    element = 2 if dtype in ("bfloat16", "float16") else 4
    model = {"params": full_params if full_params is not None else float(_full_params(fields, blocks)),
             "num_layers": blocks, "hidden_size": int(fields["hidden_size"]), "seq_len": seq_len,
             "activation_element_bytes": element}
    return {k: Profile(p.layers, {**p.meta, "layout_model": model}) for k, p in out.items()}, notes


def _full_params(fields: dict[str, Any], blocks: int) -> int:
    """The parameter count of a LLaMA-style decoder from its config, where no t = 1 profile was made: the
    embedding and head (vocab x hidden each, one when tied) and per block the attention's q, k, v, o, the
    MLP's gate, up and down, and two norms."""
    h, v = int(fields["hidden_size"]), int(fields["vocab_size"])
    heads = int(fields["num_attention_heads"])
    hd = int(fields.get("head_dim") or h // heads)
    kv = int(fields.get("num_key_value_heads") or heads)
    inter = int(fields["intermediate_size"])
    block = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * inter + 2 * h
    return v * h * (1 if fields.get("tie_word_embeddings") else 2) + blocks * block + h


def profile_for_layout(spec: str, options: dict[str, Any], *, device: str, microbatch_size: int,
                       progress: bool = False) -> Profile:
    """Any other model: the whole model profiled (or estimated) once at ``microbatch_size`` (t = 1)."""
    from stageplan.profiling.profiler import profile_model
    from stageplan.zoo import build_workload

    work = build_workload(spec, options)
    return profile_model(work, microbatch_size=microbatch_size, device=device, progress=progress)
