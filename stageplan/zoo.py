"""Built-in workloads: a skewed GPT in plain torch, a conv
stack, and HF causal LMs built from a config or a preset."""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import os
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stageplan.errors import WorkloadError
from stageplan.workload import IN_CLI, Workload, import_factory_module

__all__ = ["BUILTINS", "build_workload", "convnet", "gpt", "hf", "hf_gpt2", "hf_llama", "hf_presets"]


class _Block(nn.Module):
    """Pre-norm transformer decoder block: causal self-attention + GELU MLP (4x)."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn_qkv = nn.Linear(d_model, 3 * d_model)
        self.attn_proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp_fc = nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn_qkv(self.ln_1(x)).split(c, dim=2)
        hd = c // self.n_head
        q = q.reshape(b, t, self.n_head, hd).transpose(1, 2)
        k = k.reshape(b, t, self.n_head, hd).transpose(1, 2)
        v = v.reshape(b, t, self.n_head, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x))))


class GPT(nn.Module):
    """A GPT-style decoder: token + position embedding, a ModuleList of blocks, final norm and LM head."""

    def __init__(
        self, *, n_layer: int, d_model: int, n_head: int, seq_len: int, vocab_size: int, tied: bool
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tied:
            self.head.weight = self.tok_emb.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p,
                                std=0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = output[0] if isinstance(output, (tuple, list)) else output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def _check_positive(name: str, **values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise WorkloadError(f"{name}: option {key} must be a positive integer, got {value!r}; pass --set "
                                f"{key}=N with N >= 1")


def gpt(
    *,
    n_layer: int = 6,
    d_model: int = 128,
    n_head: int = 4,
    seq_len: int = 64,
    vocab_size: int = 8192,
    batch_size: int = 8,
    tied: bool = False,
    seed: int = 0,
) -> Workload:
    """GPT decoder whose default vocabulary makes the LM head ~5x a block's time and the embedding
    ~4x a block's parameters: the first/last-stage skew that users otherwise fix by hand."""
    _check_positive("gpt", n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len,
                    vocab_size=vocab_size, batch_size=batch_size)
    if d_model % n_head:
        raise WorkloadError(
            f"gpt: d_model ({d_model}) must be divisible by n_head ({n_head}); pick d_model = k * n_head")
    if not isinstance(tied, bool) and tied not in (0, 1):
        # bool("no") is True: a word would build a tied model
        raise WorkloadError(
            f"gpt: option tied must be true or false, got {tied!r}; pass --set tied=true or --set tied=false")
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = GPT(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len, vocab_size=vocab_size,
                tied=bool(tied))
    idx = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    target = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    options = dict(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len, vocab_size=vocab_size,
                   batch_size=batch_size, tied=bool(tied), seed=seed)
    return Workload(model, idx, target, _lm_loss, name="gpt", factory_options=options)


def convnet(*, batch_size: int = 16, image_size: int = 64, width: int = 16, num_classes: int = 10,
            seed: int = 0) -> Workload:
    """A conv stack (nn.Sequential): early layers are activation-heavy (wide maps, few channels),
    late layers parameter-heavy (narrow maps, many channels, dense head)."""
    _check_positive("convnet", batch_size=batch_size, image_size=image_size, width=width,
                    num_classes=num_classes)
    if image_size % 16:
        raise WorkloadError(f"convnet: image_size ({image_size}) must be a multiple of 16 (four 2x "
                            f"poolings); use 32, 64, ...")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)

    def block(cin: int, cout: int, pool: bool) -> nn.Sequential:
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
        if pool:
            layers.append(nn.MaxPool2d(2))
        return nn.Sequential(*layers)

    w = width
    final = image_size // 16
    model = nn.Sequential(
        block(3, w, False),
        block(w, w, True),
        block(w, 2 * w, False),
        block(2 * w, 2 * w, True),
        block(2 * w, 4 * w, True),
        block(4 * w, 8 * w, True),
        nn.Flatten(),
        nn.Sequential(nn.Linear(8 * w * final * final, 64 * w), nn.ReLU()),
        nn.Sequential(nn.Linear(64 * w, 32 * w), nn.ReLU()),
        nn.Linear(32 * w, num_classes),
    )
    x = torch.randn(batch_size, 3, image_size, image_size, generator=gen)
    y = torch.randint(0, num_classes, (batch_size,), generator=gen)
    options = dict(batch_size=batch_size, image_size=image_size, width=width, num_classes=num_classes,
                   seed=seed)
    return Workload(model, x, y, F.cross_entropy, name="convnet", factory_options=options)


_HF_CLASSES: dict[str, type] = {}
# The first two wrappers' names, kept so that existing pickles and FQNs stay valid.
_HF_ALIASES = {"HFGPT2": "GPT2LMHeadModel", "HFLlama": "LlamaForCausalLM"}


def _hf_class(name: str) -> type:
    """A subclass of an HF causal LM whose forward returns the logits tensor (keeps the HF FQNs).

    ``name`` is ``"HF"`` + the transformers class name (``HFLlamaForCausalLM``), or an alias above. The
    class lives in this module under that name (PEP 562 ``__getattr__``), so pickle finds it.
    """
    if name not in _HF_CLASSES:
        tf = _transformers()
        base_name = _HF_ALIASES.get(name, name[2:] if name.startswith("HF") else "")
        found = getattr(tf, base_name, None) if base_name.isidentifier() else None
        if not (isinstance(found, type) and issubclass(found, tf.PreTrainedModel)):
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        base: Any = found

        def forward(self: Any, input_ids: torch.Tensor) -> torch.Tensor:
            return base.forward(self, input_ids=input_ids).logits

        namespace: dict[str, Any] = {"forward": forward, "__module__": __name__, "__qualname__": name}
        # transformers reads a class's module to judge it (custom code? may it pick attention and MoE-experts
        # kernels?). This class lives here, so answer as the wrapped class would: otherwise MoE models fall
        # back to a per-expert Python loop that torch.export cannot trace, and init skips parameter-free
        # modules.
        namespace["is_custom_code"] = classmethod(lambda cls: base.is_custom_code())
        for probe in ("_can_set_attn_implementation", "_can_set_experts_implementation"):
            if hasattr(base, probe):
                namespace[f"{probe}_cached_value"] = bool(getattr(base, probe)())
        cls = type(name, (base,), namespace)
        _HF_CLASSES[name] = cls
    return _HF_CLASSES[name]


def __getattr__(name: str) -> Any:  # PEP 562: lets pickle find the lazily built HF classes
    if name.startswith(_BLOCK_PREFIX) and name[len(_BLOCK_PREFIX):].isidentifier():
        return _hf_block_class(_transformers_class(name[len(_BLOCK_PREFIX):], name))
    if name.startswith("HF") and name[2:].isidentifier():
        return _hf_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_HF_BLOCKS: dict[str, type] = {}
_BLOCK_PREFIX = "HFBlock_"


def _transformers_class(base_name: str, name: str) -> type:
    """The transformers module class ``base_name`` (a decoder layer), from a modeling module already imported:
    unpickling a model loads its causal-LM class, and with it its modeling module, before its layers."""
    import sys

    for mod_name, mod in list(sys.modules.items()):
        found = getattr(mod, base_name, None) if mod_name.startswith("transformers.models.") else None
        if isinstance(found, type) and issubclass(found, nn.Module):
            return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _hf_block_class(base: type) -> type:
    """A subclass of an HF decoder layer that runs as a pipeline trainer runs it (torchtitan's stages): it
    takes its input hidden states and nothing else that crosses a stage boundary.

    - ``attention_mask`` is dropped where ``_stageplan_is_causal`` says the layer's SDPA attention may take
      ``is_causal`` instead: transformers' ``sdpa_attention_forward`` (integrations/sdpa_attention.py) sets
      ``is_causal = q_length > 1 and attention_mask is None and module.is_causal``, the same causal attention
      without a (seq x seq) mask crossing the boundary, and on CUDA the flash kernel, which an explicit mask
      rules out.
    - ``position_embeddings`` (rotary cos and sin) are recomputed from the layer's own ``rotary_emb`` (a copy
      of the model's: non-persistent ``inv_freq``, no parameters) at positions 0..seq-1, as the model computes
      them without a cache: they carry no gradient and never cross a boundary.

    Parameters keep their FQNs: the layer gains a parameter-free submodule and nothing else. The class lives
    in this module under ``HFBlock_<base name>`` (PEP 562 ``__getattr__``), so pickle finds it.
    """
    name = _BLOCK_PREFIX + base.__name__
    if name not in _HF_BLOCKS:
        signature = inspect.signature(base.forward)  # type: ignore[attr-defined]
        first = next(iter(signature.parameters.values()))  # self

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(self, *args, **kwargs)
            if self._stageplan_is_causal and "attention_mask" in signature.parameters:
                bound.arguments["attention_mask"] = None
            rotary = self._modules.get("rotary_emb")
            if rotary is not None:
                hidden = next(v for k, v in bound.arguments.items() if k != first.name)
                positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
                bound.arguments["position_embeddings"] = rotary(hidden, positions)
            return base.forward(*bound.args, **bound.kwargs)  # type: ignore[attr-defined]

        _HF_BLOCKS[name] = type(name, (base,), {"forward": forward, "__module__": __name__,
                                                "__qualname__": name, "_stageplan_is_causal": False})
    return _HF_BLOCKS[name]


def _as_trained(model: nn.Module, *, seq_len: int, attention: str) -> None:
    """Make each decoder layer of an HF causal LM (the children of its largest ModuleList, which the cut
    names) take only its hidden states across a stage boundary (see :func:`_hf_block_class`). Done in place,
    on a model built from a config (parameters real or on meta; buffers are real either way).

    The mask is kept where dropping it would change the attention: eager attention (``is_causal`` is SDPA's
    flag), and a sliding window shorter than ``seq_len`` (Mistral's 4096 at a longer sequence)."""
    from stageplan.layers import resolve_layer_names

    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    windowed = isinstance(window, int) and getattr(config, "use_sliding_window", True) is not False \
        and window < seq_len
    is_causal = attention == "sdpa" and not windowed
    base_model = getattr(model, "base_model", model)
    rotary = getattr(base_model, "rotary_emb", None)
    for fqn in resolve_layer_names(model, None):
        layer = model.get_submodule(fqn)
        params = inspect.signature(type(layer).forward).parameters
        owns_rotary = isinstance(rotary, nn.Module) and "position_embeddings" in params
        if not (owns_rotary or (is_causal and "attention_mask" in params)):
            continue
        layer.__class__ = _hf_block_class(type(layer))
        vars(layer)["_stageplan_is_causal"] = is_causal and "attention_mask" in params
        if owns_rotary:
            # one config shared by every copy: the copies differ in nothing, so dedup sees identical layers
            shared = getattr(rotary, "config", None)
            layer.add_module("rotary_emb", copy.deepcopy(rotary, memo={id(shared): shared}))


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise WorkloadError(
            "the hf, hf-gpt2 and hf-llama workloads need the 'transformers' package, which is not installed; "
            "install the hf extra: pip install 'stageplan[hf]'"
        ) from exc
    return transformers


def hf_gpt2(
    *, n_layer: int = 4, d_model: int = 128, n_head: int = 4, seq_len: int = 64, vocab_size: int = 8192,
    batch_size: int = 8, seed: int = 0,
) -> Workload:
    """HF GPT2LMHeadModel built from a small GPT2Config (never downloaded), use_cache=False."""
    options = dict(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len, vocab_size=vocab_size,
                   batch_size=batch_size)
    _check_positive("hf-gpt2", **options)
    options["seed"] = seed
    config = _transformers().GPT2Config(n_layer=n_layer, n_embd=d_model, n_head=n_head, n_positions=seq_len,
                                        vocab_size=vocab_size, use_cache=False, attn_pdrop=0.0,
                                        embd_pdrop=0.0, resid_pdrop=0.0)
    config.bos_token_id = config.eos_token_id = 0
    return _small_hf("hf-gpt2", "HFGPT2", config, options)


def hf_llama(
    *, n_layer: int = 4, d_model: int = 128, n_head: int = 4, seq_len: int = 64, vocab_size: int = 8192,
    batch_size: int = 8, seed: int = 0,
) -> Workload:
    """HF LlamaForCausalLM built from a small LlamaConfig (never downloaded), use_cache=False."""
    options = dict(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len, vocab_size=vocab_size,
                   batch_size=batch_size)
    _check_positive("hf-llama", **options)
    options["seed"] = seed
    config = _transformers().LlamaConfig(num_hidden_layers=n_layer, hidden_size=d_model,
                                         num_attention_heads=n_head,
                                         num_key_value_heads=n_head, intermediate_size=4 * d_model,
                                         max_position_embeddings=seq_len, vocab_size=vocab_size,
                                         use_cache=False, tie_word_embeddings=False)
    return _small_hf("hf-llama", "HFLlama", config, options)


def _small_hf(name: str, class_name: str, config: Any, options: dict[str, int]) -> Workload:
    """The small HF builders' shared part: the model (weights
    seeded), a random token batch and its targets."""
    seed, batch, seq, vocab = (
        options["seed"],
        options["batch_size"],
        options["seq_len"],
        options["vocab_size"],
    )
    torch.manual_seed(seed)
    model = _hf_class(class_name)(config)
    _as_trained(model, seq_len=seq, attention=str(getattr(model.config, "_attn_implementation", "")))
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, seq), generator=gen)
    target = torch.randint(0, vocab, (batch, seq), generator=gen)
    return Workload(model, idx, target, _lm_loss, name=name, factory_options=options)


_PRESETS_DIR = Path(__file__).resolve().parent / "presets"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Config fields that switch on randomness in training: dropout probabilities and OPT's layerdrop.
_DROPOUT_FIELD = re.compile(r"dropout|pdrop|layerdrop")


def hf_presets() -> list[str]:
    """Names of the published model shapes shipped in ``stageplan/presets`` (``--set preset=NAME``)."""
    return sorted(p.stem for p in _PRESETS_DIR.glob("*.json"))


def _one_line(exc: BaseException, limit: int = 240) -> str:
    """An exception's message on one line, cut to ``limit`` characters (for one-line errors)."""
    line = " ".join(part.strip() for part in str(exc).splitlines() if part.strip()) or type(exc).__name__
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + " ..."


def _read_config_fields(config: str | None, preset: str | None) -> tuple[dict[str, Any], str]:
    """The fields of a config.json (or of a preset) and how to name their origin in messages."""
    known = ", ".join(hf_presets())
    if (config is None) == (preset is None):
        given = "both config and preset" if config is not None else "neither config nor preset"
        raise WorkloadError(
            f"hf: give exactly one of config and preset, got {given}; pass --set config=PATH/TO/config.json "
            f"or --set preset=NAME (one of: {known})"
        )
    if preset is not None:
        if not isinstance(preset, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", preset) \
                or not (_PRESETS_DIR / f"{preset}.json").is_file():
            raise WorkloadError(f"hf: unknown preset {preset!r}; known presets: {known}; "
                                "or pass --set config=PATH to any config.json")
        path, where = _PRESETS_DIR / f"{preset}.json", f"preset {preset!r}"
    else:
        if not isinstance(config, str) or not config:
            raise WorkloadError(f"hf: option config must be a path to a config.json, got {config!r}; "
                                "pass --set config=PATH/TO/config.json")
        path = Path(config).expanduser()
        if path.is_dir():  # a model folder, as saved by save_pretrained
            path = path / "config.json"
        if not path.is_file():
            raise WorkloadError(f"hf: config file {str(path)!r} does not exist; pass the path of a local "
                                "config.json (or of its folder); nothing is downloaded")
        where = f"config {str(path)!r}"
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WorkloadError(f"hf: cannot read {where} as JSON ({type(exc).__name__}: {_one_line(exc)}); "
                            "pass a Hugging Face config.json") from exc
    if not isinstance(fields, dict):
        raise WorkloadError(f"hf: {where} holds a JSON {type(fields).__name__}, not an object; "
                            "pass a Hugging Face config.json")
    fields.pop("_source", None)  # the presets' provenance note, not a config field
    return fields, where


def _hf_config_and_class(tf: Any, fields: dict[str, Any], where: str) -> tuple[Any, type]:
    """The transformers config built from ``fields`` and the
    causal-LM class AutoModelForCausalLM picks for it."""
    from transformers import CONFIG_MAPPING

    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str) or not model_type:
        raise WorkloadError(f"hf: {where} has no model_type field; add one, e.g. \"model_type\": \"llama\"")
    if model_type not in CONFIG_MAPPING:
        raise WorkloadError(
            f"hf: {where} has model_type {model_type!r}, which transformers {tf.__version__} does not know; "
            "use a model type it ships (llama, mistral, qwen2, gpt2, opt, gemma, ...); remote code is never "
            "run"
        )
    try:
        hf_config = CONFIG_MAPPING[model_type].from_dict(fields)
    except Exception as exc:  # transformers validates fields with assorted exception types
        raise WorkloadError(f"hf: transformers cannot build a {model_type} config from {where} "
                            f"({type(exc).__name__}: {_one_line(exc)}); fix that field") from exc
    mapping = tf.MODEL_FOR_CAUSAL_LM_MAPPING
    if type(hf_config) not in mapping:
        raise WorkloadError(
            f"hf: {where} describes a {model_type} model, which is not a causal language model "
            f"(AutoModelForCausalLM has no class for {type(hf_config).__name__}); use a decoder-only model's "
            f"config"
        )
    candidates = mapping[type(hf_config)]
    if isinstance(candidates, (tuple, list)):  # several classes: prefer the one the config names
        named = [c for c in candidates if c.__name__ in (getattr(hf_config, "architectures", None) or [])]
        candidates = (named or list(candidates))[0]
    model_class: type = candidates
    text_config_class = getattr(hf_config, "sub_configs", {}).get("text_config")
    if text_config_class is not None and getattr(model_class, "config_class", None) is text_config_class:
        hf_config = hf_config.get_text_config()  # as AutoModelForCausalLM.from_config does
    return hf_config, model_class


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create every parameter registered inside this block on the meta device, without storage.

    Buffers stay real, so non-persistent ones computed at construction (RoPE ``inv_freq``) keep their
    values. A parameter is allocated (``torch.empty``, untouched pages) and moved to meta as it is
    registered, so its initialisation then runs on meta and costs nothing. Already-meta parameters are
    kept as they are, which preserves tied weights.
    """
    register = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        current = self._parameters.get(name)
        if current is not None and current.device.type != "meta":
            moved = nn.Parameter(current.to("meta"), requires_grad=current.requires_grad)
            moved.__dict__.update(current.__dict__)
            self._parameters[name] = moved

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build under ``dtype`` as torch's default (parameters
    are created in it; nothing is cast), then restore."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def hf(
    *,
    config: str | None = None,
    preset: str | None = None,
    seq_len: int = 128,
    batch_size: int = 8,
    seed: int = 0,
    dtype: str = "float32",
    meta: bool = False,
) -> Workload:
    """Any causal LM transformers can build from a local config.json (``config``) or a shipped preset.

    ``preset`` names a published shape in ``stageplan/presets`` (see :func:`hf_presets`); each file's
    ``_source`` says where it was published. The model is built with ``attn_implementation="sdpa"``
    (``"eager"``, with a warning, for the few models transformers offers no SDPA for), ``use_cache=False``
    and every dropout at 0, in ``dtype`` (torch's default dtype during the build; the config's own
    ``torch_dtype`` is ignored), and its forward returns the logits. With ``meta=True`` the parameters
    live on the meta device (no memory, no initialisation; buffers stay real): a 70B-parameter shape
    builds in seconds. Inputs are ``batch_size`` x ``seq_len`` random token ids from a generator seeded
    by ``seed`` (the same with and without ``meta``); the target is the next token. Nothing is downloaded.
    Each decoder layer takes only its hidden states across a stage boundary, as a pipeline trainer runs it
    (no causal mask under SDPA, rotary cos/sin recomputed inside it): see :func:`_hf_block_class`.
    """
    _check_positive("hf", seq_len=seq_len, batch_size=batch_size)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise WorkloadError(f"hf: option seed must be an integer, got {seed!r}; pass --set seed=N")
    if dtype not in _DTYPES:
        raise WorkloadError(f"hf: option dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}; "
                            "pass e.g. --set dtype=bfloat16")
    if not isinstance(meta, bool):
        raise WorkloadError(f"hf: option meta must be true or false, got {meta!r}; pass --set meta=true")
    tf = _transformers()
    fields, where = _read_config_fields(config, preset)
    hf_config, model_class = _hf_config_and_class(tf, fields, where)
    hf_config.use_cache = False
    for key, value in list(vars(hf_config).items()):
        if _DROPOUT_FIELD.search(key) and isinstance(value, float):
            setattr(hf_config, key, 0.0)
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(max_positions, int) and seq_len > max_positions:
        raise WorkloadError(f"hf: seq_len ({seq_len}) exceeds the model's max_position_embeddings "
                            f"({max_positions}) in {where}; pass --set seq_len=N with N <= {max_positions}")
    vocab_size = getattr(hf_config, "vocab_size", None)
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise WorkloadError(
            f"hf: {where} gives no positive vocab_size ({vocab_size!r}); set vocab_size in the config")
    cls = _hf_class("HF" + model_class.__name__)
    attention = "sdpa"
    if not getattr(model_class, "_supports_sdpa", False):  # e.g. Bloom, GPT-Neo, Gemma 2 in transformers 5
        attention = "eager"
        warnings.warn(f"hf: {model_class.__name__} does not support attn_implementation='sdpa' in "
                      f"transformers {tf.__version__}; built with 'eager' attention, whose saved activations "
                      "include the full attention matrix", stacklevel=2)
    torch_dtype = _DTYPES[dtype]
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))  # the caller's RNG state is left as it was
        stack.enter_context(_default_dtype(torch_dtype))
        if meta:
            stack.enter_context(_parameters_on_meta())
        torch.manual_seed(seed)
        try:
            model = cls._from_config(hf_config, attn_implementation=attention, dtype=torch_dtype)  # type: ignore[attr-defined]
        except MemoryError:
            raise
        except Exception as exc:
            # transformers refuses bad shapes and unsupported attention with assorted types
            raise WorkloadError(
                f"hf: transformers cannot build {model_class.__name__} from {where} "
                f"({type(exc).__name__}: {_one_line(exc)}); fix the config, or pick a preset"
            ) from exc
    _as_trained(model, seq_len=seq_len, attention=str(getattr(model.config, "_attn_implementation", "")))
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=gen)
    idx, target = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    options = dict(config=config, preset=preset, seq_len=seq_len, batch_size=batch_size, seed=seed,
                   dtype=dtype, meta=meta)
    return Workload(model, idx, target, _lm_loss, name="hf", factory_options=options)


BUILTINS: dict[str, Callable[..., Workload]] = {
    "gpt": gpt,
    "convnet": convnet,
    "hf": hf,
    "hf-gpt2": hf_gpt2,
    "hf-llama": hf_llama,
}


def build_workload(spec: str, options: dict[str, Any] | None = None) -> Workload:
    """Build a workload from a built-in name or ``package.module:factory``, calling it with ``options``."""
    import inspect

    options = dict(options or {})
    factory: Any
    if spec in BUILTINS:
        factory = BUILTINS[spec]
    elif ":" in spec:
        mod_name, _, attr = spec.partition(":")
        try:
            module = import_factory_module(mod_name)
        except Exception as exc:  # any import-time failure is the user's module's problem
            raise WorkloadError(
                f"cannot import module {mod_name!r} for model {spec!r}: {type(exc).__name__}: {exc}; "
                f"check that {mod_name.replace('.', '/')}.py is in the current folder ({os.getcwd()}) or on "
                "PYTHONPATH, and imports cleanly"
            ) from exc
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise WorkloadError(
                f"module {mod_name!r} has no callable {attr!r} (model {spec!r}); "
                "name a function that returns a stageplan.Workload, as package.module:function"
            )
    else:
        raise WorkloadError(
            f"unknown model {spec!r}: not a built-in ({', '.join(sorted(BUILTINS))}) and not of the form "
            "package.module:factory; use a built-in name or point at a factory function"
        )
    params: Any
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in options if params and k not in params and not has_var_kw]
    if unknown:
        allowed = [k for k, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        raise WorkloadError(
            f"model {spec!r} takes no option {', '.join(map(repr, unknown))}; its options are: "
            f"{', '.join(allowed) or '(none)'}"
        )
    try:
        workload = factory(**options)
    except WorkloadError:
        raise
    except TypeError as exc:
        raise WorkloadError(f"model {spec!r} could not be built with options {options}: {exc}; check the "
                            f"{'--set values' if IN_CLI.get() else 'factory_options'}") from exc
    if not isinstance(workload, Workload):
        raise WorkloadError(
            f"factory {spec!r} returned {type(workload).__name__}, not a stageplan.Workload; "
            "return stageplan.Workload(model, inputs, target, loss_fn)"
        )
    if not workload.name:
        workload.name = spec
    if not workload.factory_options:
        workload.factory_options = options
    return workload
