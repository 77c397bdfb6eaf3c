"""Built-in workloads: a skewed GPT in plain torch, a conv stack, and HF GPT-2/LLaMA built from config."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stageplan.errors import WorkloadError
from stageplan.workload import Workload

__all__ = ["BUILTINS", "build_workload", "convnet", "gpt", "hf_gpt2", "hf_llama"]


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

    def __init__(self, *, n_layer: int, d_model: int, n_head: int, seq_len: int, vocab_size: int, tied: bool) -> None:
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
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02)

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
            raise WorkloadError(f"{name}: option {key} must be a positive integer, got {value!r}; pass --set {key}=N with N >= 1")


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
        raise WorkloadError(f"gpt: d_model ({d_model}) must be divisible by n_head ({n_head}); pick d_model = k * n_head")
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = GPT(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len, vocab_size=vocab_size, tied=bool(tied))
    idx = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    target = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    options = dict(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len, vocab_size=vocab_size,
                   batch_size=batch_size, tied=bool(tied), seed=seed)
    return Workload(model, idx, target, _lm_loss, name="gpt", factory_options=options)


def convnet(*, batch_size: int = 16, image_size: int = 64, width: int = 16, num_classes: int = 10, seed: int = 0) -> Workload:
    """A conv stack (nn.Sequential): early layers are activation-heavy (wide maps, few channels),
    late layers parameter-heavy (narrow maps, many channels, dense head)."""
    _check_positive("convnet", batch_size=batch_size, image_size=image_size, width=width, num_classes=num_classes)
    if image_size % 16:
        raise WorkloadError(f"convnet: image_size ({image_size}) must be a multiple of 16 (four 2x poolings); use 32, 64, ...")
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
    options = dict(batch_size=batch_size, image_size=image_size, width=width, num_classes=num_classes, seed=seed)
    return Workload(model, x, y, F.cross_entropy, name="convnet", factory_options=options)


_HF_CLASSES: dict[str, type] = {}


def _hf_class(name: str) -> type:
    """A subclass of an HF causal-LM whose forward returns the logits tensor (keeps the HF FQNs)."""
    if name not in _HF_CLASSES:
        tf = _transformers()
        base = {"HFGPT2": tf.GPT2LMHeadModel, "HFLlama": tf.LlamaForCausalLM}[name]

        def forward(self: Any, input_ids: torch.Tensor) -> torch.Tensor:
            return base.forward(self, input_ids=input_ids).logits

        cls = type(name, (base,), {"forward": forward, "__module__": __name__, "__qualname__": name})
        _HF_CLASSES[name] = cls
    return _HF_CLASSES[name]


def __getattr__(name: str) -> Any:  # PEP 562: lets pickle find the lazily built HF classes
    if name in ("HFGPT2", "HFLlama"):
        return _hf_class(name)
    raise AttributeError(name)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise WorkloadError(
            "the hf-gpt2 and hf-llama workloads need the 'transformers' package, which is not installed; "
            "install the hf extra: pip install 'stageplan[hf]'"
        ) from exc
    return transformers


def hf_gpt2(
    *, n_layer: int = 4, d_model: int = 128, n_head: int = 4, seq_len: int = 64, vocab_size: int = 8192,
    batch_size: int = 8, seed: int = 0,
) -> Workload:
    """HF GPT2LMHeadModel built from a small GPT2Config (never downloaded), use_cache=False."""
    _check_positive("hf-gpt2", n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len,
                    vocab_size=vocab_size, batch_size=batch_size)
    tf = _transformers()
    torch.manual_seed(seed)
    config = tf.GPT2Config(n_layer=n_layer, n_embd=d_model, n_head=n_head, n_positions=seq_len, vocab_size=vocab_size,
                           use_cache=False, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    config.bos_token_id = config.eos_token_id = 0
    model = _hf_class("HFGPT2")(config)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    target = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    options = dict(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len, vocab_size=vocab_size,
                   batch_size=batch_size, seed=seed)
    return Workload(model, idx, target, _lm_loss, name="hf-gpt2", factory_options=options)


def hf_llama(
    *, n_layer: int = 4, d_model: int = 128, n_head: int = 4, seq_len: int = 64, vocab_size: int = 8192,
    batch_size: int = 8, seed: int = 0,
) -> Workload:
    """HF LlamaForCausalLM built from a small LlamaConfig (never downloaded), use_cache=False."""
    _check_positive("hf-llama", n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len,
                    vocab_size=vocab_size, batch_size=batch_size)
    tf = _transformers()
    torch.manual_seed(seed)
    config = tf.LlamaConfig(num_hidden_layers=n_layer, hidden_size=d_model, num_attention_heads=n_head,
                            num_key_value_heads=n_head, intermediate_size=4 * d_model, max_position_embeddings=seq_len,
                            vocab_size=vocab_size, use_cache=False, tie_word_embeddings=False)
    model = _hf_class("HFLlama")(config)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    target = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    options = dict(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len, vocab_size=vocab_size,
                   batch_size=batch_size, seed=seed)
    return Workload(model, idx, target, _lm_loss, name="hf-llama", factory_options=options)


BUILTINS: dict[str, Callable[..., Workload]] = {
    "gpt": gpt,
    "convnet": convnet,
    "hf-gpt2": hf_gpt2,
    "hf-llama": hf_llama,
}


def build_workload(spec: str, options: dict[str, Any] | None = None) -> Workload:
    """Build a workload from a built-in name or ``package.module:factory``, calling it with ``options``."""
    import importlib
    import inspect

    options = dict(options or {})
    factory: Any
    if spec in BUILTINS:
        factory = BUILTINS[spec]
    elif ":" in spec:
        mod_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(mod_name)
        except Exception as exc:  # any import-time failure is the user's module's problem
            raise WorkloadError(
                f"cannot import module {mod_name!r} for model {spec!r}: {type(exc).__name__}: {exc}; "
                "check the module is on PYTHONPATH (run from its folder) and imports cleanly"
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
            f"model {spec!r} takes no option {', '.join(map(repr, unknown))}; its options are: {', '.join(allowed) or '(none)'}"
        )
    try:
        workload = factory(**options)
    except WorkloadError:
        raise
    except TypeError as exc:
        raise WorkloadError(f"model {spec!r} could not be built with options {options}: {exc}; check the --set values") from exc
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
