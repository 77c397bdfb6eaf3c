"""Analytic estimates for a GPU we do not have: FLOPs,
roofline time and saved bytes against hand-derived oracles."""

from __future__ import annotations

import json
import re
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stageplan.errors import StageplanError
from stageplan.profiling.estimate import (
    DEFAULT_COMPUTE_EFFICIENCY,
    DEFAULT_MEMORY_EFFICIENCY,
    GpuSpec,
    LayerEstimate,
    estimate_module,
    gpu_spec,
    known_gpus,
    parse_estimate_device,
)
from stageplan.profiling.profiler import profile_model
from stageplan.zoo import build_workload

REQUIRED_GPUS = ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "mi300x", "l4", "l40s")


ROOT = Path(__file__).resolve().parents[2]


def _on_meta(factory: Callable[[], nn.Module], dtype: torch.dtype = torch.float32) -> nn.Module:
    """Build a module on meta under ``dtype`` as the default (as a caller builds a big model)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return factory()
    finally:
        torch.set_default_dtype(prev)


def test_table_has_every_required_gpu_with_sources() -> None:
    assert set(REQUIRED_GPUS) <= set(known_gpus())
    for name in known_gpus():
        g = gpu_spec(name)
        assert isinstance(g, GpuSpec) and g.name == name and g.source
        # dense peaks only grow with lower precision; every figure is positive
        assert 0 < g.peak_fp32_flops <= g.peak_tf32_flops < g.peak_bf16_flops == g.peak_fp16_flops
        assert g.memory_bandwidth > 1e11 and g.memory_bytes >= 24 * 2**30
        for link in (g.intra_node, g.inter_node):
            assert link.bandwidth > 0 and link.name and link.source


def test_dense_bf16_peaks_match_the_published_figures() -> None:
    # bf16 dense peaks as torchtitan's get_peak_flops (torchtitan/tools/utils.py) lists them: A100 312 T,
    # H100 SXM 989 T, H100 PCIe 756 T, H200 989 T
    for name, tflops in {
        "a100-40gb": 312,
        "a100-80gb": 312,
        "h100-sxm": 989,
        "h100-pcie": 756,
        "h200": 989,
    }.items():
        assert gpu_spec(name).peak_flops("bf16") == pytest.approx(tflops * 1e12, rel=1e-3)
    assert gpu_spec("h100-sxm").peak_flops(torch.float32) == 67e12
    # 989 is with sparsity
    assert gpu_spec("h100-sxm").peak_flops("tf32") == pytest.approx(989e12 / 2, rel=1e-3)
    assert gpu_spec("h100-sxm").memory_bytes == 80 * 2**30
    assert gpu_spec("h100-sxm").inter_node.bandwidth == 50e9  # 400 Gb/s NDR per GPU


def test_table_file_is_packaged() -> None:
    assert "gpus.json" in (ROOT / "setup.cfg").read_text()
    data = json.loads((ROOT / "stageplan" / "gpus.json").read_text())
    assert all(row["source"] for row in data["gpus"].values())


def test_unknown_gpu_is_one_line_naming_the_known_ones() -> None:
    with pytest.raises(StageplanError) as info:
        gpu_spec("h300")
    msg = str(info.value)
    assert "\n" not in msg
    assert re.fullmatch(r"unknown GPU 'h300' for --device estimate:h300; known: a100-40gb, a100-80gb, .*l40s",
                        msg), msg
    with pytest.raises(StageplanError, match="unknown GPU 'h300'"):
        parse_estimate_device("estimate:h300")


def test_parse_estimate_device() -> None:
    assert parse_estimate_device("estimate:h100-sxm") == gpu_spec("h100-sxm")
    assert parse_estimate_device(" estimate:H200 ").name == "h200"
    for bad in ("cuda:0", "estimate:", "h100-sxm"):
        with pytest.raises(StageplanError, match="estimate:<gpu>"):
            parse_estimate_device(bad)


def _roofline(ops: list[tuple[int, int]], peak: float, bw: float, eta_c: float, eta_m: float) -> float:
    return sum(max(f / (eta_c * peak), b / (eta_m * bw)) for f, b in ops)


@pytest.mark.parametrize("gpu", ["h100-sxm", "l4"])
def test_linear_flops_time_and_saved_bytes_are_the_closed_forms(gpu: str) -> None:
    b, d, e = 32, 256, 4  # batch, width, bytes per fp32 element
    lin = _on_meta(lambda: nn.Linear(d, d))
    x = torch.empty(b, d, device="meta")
    est = estimate_module(lin, x, gpu=gpu, dtype="fp32", compute_efficiency=0.5, memory_efficiency=0.8)

    assert est.forward_flops == 2 * b * d * d
    # input grad + weight grad (the bias grad is a sum: 0 matmul FLOPs)
    assert est.backward_flops == 4 * b * d * d
    # Kernels, bytes read + written: forward addmm(bias, x, Wᵀ) -> y; backward mm(gy, W) -> gx,
    # mm(gyᵀ, x) -> gW, sum(gy, 0) -> gb.
    fwd = [(2 * b * d * d, e * (d + b * d + d * d + b * d))]
    bwd = [(2 * b * d * d, e * (b * d + d * d + b * d)), (2 * b * d * d, e * (b * d + b * d + d * d)),
           (0, e * (b * d + d))]
    assert est.forward_bytes_moved == sum(n for _, n in fwd)
    assert est.backward_bytes_moved == sum(n for _, n in bwd)
    g = gpu_spec(gpu)
    assert est.forward_s == pytest.approx(_roofline(fwd, g.peak_fp32_flops, g.memory_bandwidth, 0.5, 0.8),
                                          rel=1e-12)
    assert est.backward_s == pytest.approx(_roofline(bwd, g.peak_fp32_flops, g.memory_bandwidth, 0.5, 0.8),
                                           rel=1e-12)

    assert est.activation_bytes == b * d * e  # Linear saves its input; its weight is a parameter, excluded
    assert est.output_bytes == b * d * e
    assert est.param_count == d * d + d and est.param_bytes == (d * d + d) * e
    assert est.method["gpu"] == gpu and est.method["peak_flops"] == g.peak_fp32_flops
    assert (est.method["compute_efficiency"], est.method["memory_efficiency"]) == (0.5, 0.8)
    assert est.method["sources"]["gpu"] == g.source
    # nothing was moved, cast or given a gradient
    assert all(p.device.type == "meta" and p.grad is None and p.dtype == torch.float32
               for p in lin.parameters())


def test_defaults_tf32_and_loss_fn() -> None:
    lin = _on_meta(lambda: nn.Linear(64, 64))
    x = torch.empty(8, 64, device="meta")
    plain = estimate_module(lin, x, gpu="a100-80gb", dtype=None)
    assert (plain.method["compute_efficiency"], plain.method["memory_efficiency"]) == (
        DEFAULT_COMPUTE_EFFICIENCY, DEFAULT_MEMORY_EFFICIENCY)
    assert plain.method["dtype"] == "fp32"
    tf32 = estimate_module(lin, x, gpu="a100-80gb", dtype="tf32")
    assert tf32.method["peak_flops"] == 156e12 and tf32.forward_s <= plain.forward_s
    with_loss = estimate_module(lin, x, gpu="a100-80gb", dtype=None, loss_fn=lambda y: y.sum())
    assert with_loss.backward_flops == plain.backward_flops == 4 * 8 * 64 * 64
    no_input_grad = estimate_module(lin, x, gpu="a100-80gb", dtype=None, inputs_require_grad=False)
    assert no_input_grad.backward_flops == 2 * 8 * 64 * 64  # the weight grad only (a first stage)
    layer = plain.to_layer_profile("fc")
    assert (layer.name, layer.forward_s, layer.activation_bytes) == ("fc", plain.forward_s,
                                                                     plain.activation_bytes)


def test_bad_requests_are_refused() -> None:
    lin = _on_meta(lambda: nn.Linear(8, 8), torch.bfloat16)
    x = torch.empty(2, 8, device="meta", dtype=torch.bfloat16)
    with pytest.raises(StageplanError, match=r"parameters are torch.bfloat16.*set_default_dtype"):
        estimate_module(lin, x, gpu="h100-sxm", dtype="fp32")
    with pytest.raises(StageplanError, match="no peak FLOP/s for dtype 'fp8'"):
        estimate_module(lin, x, gpu="h100-sxm", dtype="fp8")
    for bad in (0, 1.5, -0.1):
        with pytest.raises(StageplanError, match="compute_efficiency must be a fraction"):
            estimate_module(lin, x, gpu="h100-sxm", dtype="bf16", compute_efficiency=bad)
    with pytest.raises(StageplanError, match="memory_efficiency"):
        estimate_module(lin, x, gpu="h100-sxm", dtype="bf16", memory_efficiency=2)
    with pytest.raises(StageplanError, match="attention must be one of flash, math"):
        estimate_module(lin, x, gpu="h100-sxm", dtype="bf16", attention="xformers")
    with pytest.raises(StageplanError, match="unknown GPU"):
        estimate_module(lin, x, gpu="v100", dtype="bf16")


class Block(nn.Module):
    """Pre-norm transformer block with causal SDPA (hand-written, so the FLOPs have a closed form)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_attention_flops_and_math_saves_the_attention_matrix(dtype: torch.dtype) -> None:
    B, S, D, H = 2, 128, 256, 4
    block = _on_meta(lambda: Block(D, H), dtype)
    x = torch.empty(B, S, D, device="meta", dtype=dtype)
    flash = estimate_module(block, x, gpu="h100-sxm", dtype=None, attention="flash")
    math = estimate_module(block, x, gpu="h100-sxm", dtype=None, attention="math")

    # matmuls 2·B·S·(3D² + D² + 8D²) plus attention 4·B·H·S²·(D/H), no causal halving; backward 2x
    fwd = 2 * B * S * (3 * D * D + D * D + 8 * D * D) + 4 * B * H * S * S * (D // H)
    for est in (flash, math):
        assert est.forward_flops == fwd and est.backward_flops == 2 * fwd
        assert est.method["sdpa_calls"] == 1 and est.method["attention_causal_halving"] is False
    # The math backend saves the B·H·S·S softmax (in fp32: it upcasts bf16); flash saves logsumexp instead.
    matrix = B * H * S * S * 4
    diff = math.activation_bytes - flash.activation_bytes
    if dtype == torch.float32:
        assert 0.9 * matrix <= diff <= 1.1 * matrix
    else:  # plus fp32 copies of q, k, v
        assert matrix <= diff <= 2 * matrix
    assert math.forward_bytes_moved > flash.forward_bytes_moved + matrix
    assert math.forward_s > flash.forward_s
    assert flash.output_bytes == B * S * D * x.element_size()


def _llama_layer(hidden: int, inter: int, heads: int, kv: int, dtype: torch.dtype) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                                   num_key_value_heads=kv, num_hidden_layers=1, vocab_size=128,
                                   attn_implementation="sdpa")
    return _on_meta(lambda: LlamaDecoderLayer(cfg, 0), dtype)


def _llama_inputs(
    b: int, s: int, hidden: int, heads: int, dtype: torch.dtype
) -> tuple[torch.Tensor, dict[str, Any]]:
    cos = torch.empty(b, s, hidden // heads, device="meta", dtype=dtype)
    return torch.empty(b, s, hidden, device="meta", dtype=dtype), {"position_embeddings": (cos, cos)}


def test_tiny_hf_llama_decoder_layer_on_meta() -> None:
    h, inter, heads, b, s = 64, 128, 4, 2, 16
    layer = _llama_layer(h, inter, heads, heads, torch.float32)
    x, kw = _llama_inputs(b, s, h, heads, torch.float32)
    flash = estimate_module(layer, x, kwargs=kw, gpu="l40s", dtype=None)
    math = estimate_module(layer, x, kwargs=kw, gpu="l40s", dtype=None, attention="math")
    # q, k, v, o projections 4h², gate/up/down 3·h·inter; attention 4·b·heads·s²·(h/heads)
    fwd = 2 * b * s * (4 * h * h + 3 * h * inter) + 4 * b * heads * s * s * (h // heads)
    assert flash.forward_flops == math.forward_flops == fwd
    assert flash.backward_flops == 2 * fwd
    assert flash.method["sdpa_calls"] == 1
    assert 0 < flash.activation_bytes < math.activation_bytes
    assert flash.param_count == 4 * h * h + 3 * h * inter + 2 * h
    assert flash.forward_s > 0 and flash.backward_s > flash.forward_s


# Saved bytes of the 70B block at b=1, s=4096, bf16, flash attention, counted by hand from its saved tensors:
# per RMSNorm an fp32 upcast (128 MiB), its fp32 rsqrt (16 KiB) and two bf16 (s, h) tensors (64 MiB each);
# cos, sin (1 MiB each); q (64 MiB), k, v (8 MiB each), attention out (64 MiB) and logsumexp (1 MiB); the
# MLP's gate, up, silu(gate) and their product (224 MiB each). 1.519 GiB in all.
LLAMA70B_FLASH_SAVED = (2 * (128 + 64 + 64) + 2 + 64 + 8 + 8 + 64 + 1 + 4 * 224) * 2**20 + 2 * 4096 * 4


def _llama70b(attention: str) -> LayerEstimate:
    layer = _llama_layer(8192, 28672, 64, 8, torch.bfloat16)
    x, kw = _llama_inputs(1, 4096, 8192, 64, torch.bfloat16)
    return estimate_module(layer, x, kwargs=kw, gpu="h100-sxm", dtype="bf16", attention=attention)


def test_llama70b_block_estimates_in_little_memory() -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    flash, math = _llama70b("flash"), _llama70b("math")
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < 200e6  # a real bf16 70B layer would take 1.7 GB of parameters alone
    assert flash.param_count == 855_654_400  # q, o 8192²; k, v 8192·1024; MLP 3·8192·28672; norms 2·8192
    assert flash.activation_bytes == LLAMA70B_FLASH_SAVED
    # the math backend also saves the s x s attention matrix (64 heads x 4096² bf16 elements: 2 GiB a copy)
    assert 5.5 * 2**30 < math.activation_bytes < 6 * 2**30
    # forward+backward FLOPs: torch.utils.flop_counter.FlopCounterMode counts 22.68 TFLOP for this block under
    # sdpa_kernel(SDPBackend.MATH) (it counts 0 for the CPU flash kernel, which the estimate counts as math)
    assert flash.forward_flops + flash.backward_flops == pytest.approx(22.68e12, rel=1e-3)
    total = flash.forward_s + flash.backward_s
    mfu = (flash.forward_flops + flash.backward_flops) / total / gpu_spec("h100-sxm").peak_bf16_flops
    assert 0.3 < mfu < DEFAULT_COMPUTE_EFFICIENCY  # memory-bound ops cost on top of the matmuls
    print(f"\n70B block, h100-sxm bf16, b=1 s=4096: flash fwd {flash.forward_s * 1e3:.2f} ms "
          f"bwd {flash.backward_s * 1e3:.2f} ms saved {flash.activation_bytes / 2**30:.3f} GiB; math fwd "
          f"{math.forward_s * 1e3:.2f} ms bwd {math.backward_s * 1e3:.2f} ms saved "
          f"{math.activation_bytes / 2**30:.3f} GiB; implied MFU {mfu:.1%}")


def test_the_estimate_records_ties_in_the_profiled_dtype() -> None:
    wl = build_workload("gpt", {"tied": True, "n_layer": 2})
    prof = profile_model(wl, microbatch_size=2, device="estimate:h100-sxm", dtype="bfloat16")
    assert [(t.layers, t.bytes) for t in prof.tied] == [((0, len(prof) - 1), 8192 * 128 * 2)]


def test_llama2_7b_block_at_4096_boundary_is_32_mib_and_saves_the_hand_count(tmp_path: Path) -> None:
    """LLaMA-2-7B (preset llama2-7b's shapes, 3 of its 32 blocks: every block is the same, and each is
    estimated on its own), sequence 4096, microbatch 1, bf16, estimated for an H100: a boundary carries the
    hidden states alone, and a block saves what its tensors add up to."""
    from stageplan.profiling.profiler import build_workload_for_profile
    from stageplan.profiling.shards import hf_fields
    from unit.test_zoo import llama_block_saved_bytes

    b, s, h, f, heads = 1, 4096, 4096, 11008, 32
    fields = hf_fields({"preset": "llama2-7b"})
    assert (fields["hidden_size"], fields["intermediate_size"], fields["num_attention_heads"],
            fields["num_hidden_layers"]) == (h, f, heads, 32)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**fields, "num_hidden_layers": 3}))
    wl = build_workload_for_profile("hf", {"config": str(config), "seq_len": s, "batch_size": b},
                                    device="estimate:h100-sxm", dtype="bfloat16")
    prof = profile_model(wl, microbatch_size=b, device="estimate:h100-sxm", dtype="bfloat16")
    blocks = [x for x in prof.layers if x.name.startswith("model.layers.")]
    assert len(blocks) == 3
    # boundary: (b, s, h) bf16 hidden states, 32 MiB; no (s x s) mask, no rotary cos/sin
    assert [x.output_bytes for x in prof.layers[:-1]] == [b * s * h * 2] * 4 == [32 * 2**20] * 4
    parts = llama_block_saved_bytes(b=b, s=s, h=h, f=f, heads=heads, kv_heads=heads, e=2)
    hand = sum(parts.values())
    # Cross-check against Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
    # Models", section 4.1): a GPT layer saves s·b·h·(34 + 5·a·s/h) bytes in 16-bit, of which attention
    # 11·sbh, MLP 19·sbh and two LayerNorm inputs 4·sbh. Flash attention drops the 5·a·s/h term (no s x s
    # tensor). LLaMA has no dropout masks (-1 in attention; the flash output is the projection's input, which
    # they count), a SwiGLU MLP saving 8·f/h·sbh for gate, SiLU, up and their product where the 4h GELU MLP
    # saved 16 + 1 (mask), and RMSNorms that upcast to fp32: 4 (fp32) + 2 (normalised) per norm where a
    # LayerNorm input was 2.
    sbh = s * b * h
    adapted = (34 - 1 + (8 * f / h - 17) + 2 * (6 - 2)) * sbh  # 45.5 sbh = 728 MiB
    # what the formula leaves out: the fp32 logsumexp, rotary cos and sin, and the norms' (s, 1) rsqrt
    small = 4 * b * heads * s + 2 * 2 * s * (h // heads) + 2 * 4 * b * s
    assert adapted + small == hand == 766_017_536  # 730.53 MiB
    for x in blocks:
        assert abs(x.activation_bytes / hand - 1) < 0.05, (x.name, x.activation_bytes, hand)
    print(f"\nLLaMA-2-7B block, s=4096 bf16 estimate: saved {blocks[0].activation_bytes / 2**20:.2f} MiB "
          f"(hand count {hand / 2**20:.2f} MiB), boundary {prof.layers[1].output_bytes / 2**20:.0f} MiB")
