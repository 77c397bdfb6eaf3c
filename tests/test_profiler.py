"""Profiler against layers of known cost, known saved bytes and the whole model."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from stageplan import Workload, profile_model
from stageplan.errors import StageplanError, WorkloadError
from stageplan.profiling.device import DeviceError
from stageplan.zoo import gpt


class Sleep(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x * self.scale


def _sum_loss(out: torch.Tensor, target: object) -> torch.Tensor:
    return out.sum()  # sum saves no tensor for backward


def test_sleep_layers_measure_their_known_time() -> None:
    model = nn.Sequential(Sleep(0.02), Sleep(0.04))
    wl = Workload(model, torch.randn(4, 8), loss_fn=_sum_loss)
    prof = profile_model(wl, microbatch_size=4, warmup=1, repeats=5)
    assert prof.layers[0].forward_s == pytest.approx(0.02, rel=0.10)
    assert prof.layers[1].forward_s == pytest.approx(0.04, rel=0.10)


def test_matmul_layers_scale_with_flops() -> None:
    # 256x256, 256x512, 512x512 weights: 1x, 2x, 4x the FLOPs per row.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.Linear(256, 512, bias=False), nn.Linear(512, 512, bias=False))
    wl = Workload(model, torch.randn(1024, 256), loss_fn=_sum_loss)
    prof = profile_model(wl, microbatch_size=1024, warmup=3, repeats=15)
    f = [layer.forward_s for layer in prof.layers]
    assert f[1] / f[0] == pytest.approx(2.0, rel=0.25)
    assert f[2] / f[0] == pytest.approx(4.0, rel=0.25)


def test_activation_bytes_of_linear_gelu_linear_is_analytic() -> None:
    a, b, c, batch = 24, 40, 8, 6
    model = nn.Sequential(nn.Sequential(nn.Linear(a, b), nn.GELU(), nn.Linear(b, c)))
    wl = Workload(model, torch.randn(batch, a), loss_fn=_sum_loss)
    prof = profile_model(wl, microbatch_size=batch, warmup=0, repeats=1)
    # saved: the first Linear's input (B*a), GELU's input (B*b), the second Linear's input (B*b); float32.
    assert prof.layers[0].activation_bytes == 4 * batch * (a + 2 * b)
    assert prof.layers[0].param_bytes == 4 * (a * b + b + b * c + c)
    assert prof.layers[0].param_count == a * b + b + b * c + c


def test_output_bytes_are_the_boundary_tensor() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    wl = Workload(model, torch.randn(8, 16), loss_fn=_sum_loss)
    prof = profile_model(wl, microbatch_size=2, warmup=0, repeats=1)
    assert [layer.output_bytes for layer in prof.layers] == [2 * 32 * 4, 2 * 32 * 4, 0]
    assert prof.meta["microbatch_size"] == 2 and prof.meta["input_shapes"] == [[2, 16]]


def test_gpt_profile_bytes_are_deterministic_and_sum_matches_whole() -> None:
    wl = gpt(n_layer=3)
    p1 = profile_model(wl, microbatch_size=2, warmup=3, repeats=15)
    p2 = profile_model(wl, microbatch_size=2, warmup=1, repeats=3)
    assert [x.activation_bytes for x in p1.layers] == [x.activation_bytes for x in p2.layers]
    assert p1.names == ["tok_emb+pos_emb", "blocks.0", "blocks.1", "blocks.2", "ln_f+head"]
    blocks = [x for x in p1.layers if x.name.startswith("blocks.")]
    assert len({x.activation_bytes for x in blocks}) == 1 and blocks[0].activation_bytes > 0
    # The skew users fight: the LM head outweighs a block in time, the embedding in parameters.
    assert p1.layers[-1].forward_s + p1.layers[-1].backward_s > 2 * (blocks[0].forward_s + blocks[0].backward_s)
    assert p1.layers[0].param_bytes > 2 * blocks[0].param_bytes
    for key in ("model", "factory_options", "device", "dtype", "microbatch_size", "input_shapes", "torch_version",
                "stageplan_version", "threads", "warmup", "repeats", "date", "method", "whole_model_s"):
        assert key in p1.meta


def test_sum_of_layers_matches_the_whole_model() -> None:
    # A 2048-token vocabulary: the 8192 default's LM head swings +-30% between runs on this shared machine
    # (allocation/page-fault noise of its 4 MiB logits), which says nothing about the profiler's method.
    prof = profile_model(gpt(n_layer=4, vocab_size=2048), microbatch_size=2, warmup=3, repeats=15)
    assert prof.sum_vs_whole is not None and 0.8 <= prof.sum_vs_whole <= 1.25, prof.sum_vs_whole


def test_model_is_unchanged_by_profiling() -> None:
    wl = gpt(n_layer=2, tied=True)
    model = wl.model
    model.eval()
    model.blocks[0].ln_1.weight.requires_grad_(False)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    flags = {k: p.requires_grad for k, p in model.named_parameters()}
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    threads = torch.get_num_threads()
    profile_model(wl, microbatch_size=4, warmup=1, repeats=2)
    assert not model.training
    assert all(p.grad is None for p in model.parameters())
    assert {k: p.requires_grad for k, p in model.named_parameters()} == flags
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.get_num_threads() == threads
    assert model.head.weight is model.tok_emb.weight


def test_bad_microbatch_sizes_are_refused() -> None:
    wl = gpt(n_layer=1)
    with pytest.raises(StageplanError, match=r"microbatch size must be a positive integer, got 0"):
        profile_model(wl, microbatch_size=0)
    with pytest.raises(StageplanError, match=r"microbatch size 3 does not divide the batch of 8; use one of \[1, 2, 4, 8\]"):
        profile_model(wl, microbatch_size=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_is_refused() -> None:
    with pytest.raises(DeviceError, match=r"no CUDA GPU .* use --device cpu"):
        profile_model(gpt(n_layer=1), microbatch_size=2, device="cuda")


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            if x.sum() > 0:  # data-dependent control flow: torch.export cannot capture it
                x = x * 2
        return x


def test_unsplittable_model_names_the_reason_and_the_remedy() -> None:
    wl = Workload(DataDependent(), torch.randn(4, 4))
    with pytest.raises(WorkloadError, match=r"torch.export cannot split DataDependent \(.+\); name layers explicitly with --layers"):
        profile_model(wl, microbatch_size=2, warmup=0, repeats=1)


def test_layer_pattern_matching_nothing_is_refused() -> None:
    with pytest.raises(WorkloadError, match=r"layer pattern 'decoder\.\*' matches no module of GPT; top-level modules are: tok_emb"):
        profile_model(gpt(n_layer=1), microbatch_size=2, layers=["decoder.*"])


def _sum_loss(out, _target):  # type: ignore[no-untyped-def]
    return out.sum()


class _Act(nn.Module):
    def __init__(self, act, loop_num: int = 1) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.act = act
        self.loop_num = loop_num

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.loop_num):
            x = self.act(self.lin(x))
        return x


@pytest.mark.parametrize("last", [_Act(lambda x: x), _Act(torch.tanh, loop_num=4)], ids=["lambda", "loop_num"])
def test_dedup_measures_apart_what_an_attribute_changes(last: nn.Module) -> None:
    """Blocks that differ only in a function attribute (torch.tanh against a lambda: saves 256 B, not 512), or in
    an attribute named like a layer index but used as a count (loop_num), were taken as one layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _Act(torch.tanh), _Act(torch.tanh), _Act(torch.tanh), last, nn.Linear(16, 16))
    wl = Workload(model, torch.randn(4, 16), loss_fn=_sum_loss)
    every = profile_model(wl, microbatch_size=4, warmup=0, repeats=1, dedup=False, order="layer")
    dedup = profile_model(wl, microbatch_size=4, warmup=0, repeats=1, order="layer")
    assert dedup.layers[3].measured_as == "2"  # the identical ones are still measured once
    assert dedup.layers[4].measured_as is None
    assert dedup.layers[4].activation_bytes == every.layers[4].activation_bytes != every.layers[3].activation_bytes


def test_a_graph_signature_follows_the_wiring_not_only_the_ops() -> None:
    from stageplan.profiling.signatures import _graph_signature

    def squared(x: torch.Tensor) -> torch.Tensor:
        a = torch.sigmoid(x)
        return a * a

    def gated(x: torch.Tensor) -> torch.Tensor:
        a = torch.sigmoid(x)
        return a * x

    sig = [_graph_signature(torch.fx.symbolic_trace(f).graph, lambda t: t) for f in (squared, gated, squared)]
    assert sig[0] != sig[1] and sig[0] == sig[2]


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class _Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("g", torch.full((32,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g


def test_a_tie_inside_a_layer_streams_and_estimates_and_buffers_are_state() -> None:
    """A layer holding a tie could not be streamed or estimated (two fakes for one tensor); a buffer the layer
    saves for backward counted as activation bytes in a measured profile and not in an estimate."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), _Tied(), _Gain(), nn.Linear(32, 32))
    wl = Workload(model, torch.randn(8, 32), loss_fn=_sum_loss)
    whole = profile_model(wl, microbatch_size=4, warmup=0, repeats=1, streaming=False)
    streamed = profile_model(wl, microbatch_size=4, warmup=0, repeats=1, streaming=True)
    est = profile_model(wl, microbatch_size=4, device="estimate:h100-sxm")
    for p in (whole, streamed, est):
        assert [x.param_bytes for x in p.layers] == [32 * 33 * 4, 32 * 32 * 4, 0, 32 * 33 * 4]  # the tie once
        assert p.layers[2].activation_bytes == 0  # x * g saves only the buffer g: module state
    assert [x.activation_bytes for x in whole.layers] == [x.activation_bytes for x in streamed.layers] \
        == [x.activation_bytes for x in est.layers]


def test_min_time_times_rounds_until_they_span_it() -> None:
    """Rounds of sleep layers of known cost: each alone, a round sleeps 30 ms per layer (a forward, then two
    forward-backward pairs) and 20 ms for the whole model, 80 ms in all, so 0.5 s takes at most ceil(0.5 / 0.08) = 7
    rounds, and at least 5 unless a round overran its sleeps by half (0.12 s); in a stage's order two forwards per
    layer (40 ms) and the whole model, 60 ms: at most 9 rounds, at least 6 (0.09 s rounds); without min_time_s,
    exactly the repeats."""
    model = nn.Sequential(Sleep(0.01), Sleep(0.01))
    wl = Workload(model, torch.randn(4, 8), loss_fn=_sum_loss)
    plain = profile_model(wl, microbatch_size=4, warmup=0, repeats=2)
    assert plain.meta["timed_rounds"] == 2 and plain.meta["min_time_s"] == 0.0
    t0 = time.perf_counter()
    spread = profile_model(wl, microbatch_size=4, warmup=1, repeats=2, min_time_s=0.5, order="layer")
    assert time.perf_counter() - t0 >= 0.5
    assert 5 <= spread.meta["timed_rounds"] <= 7
    assert spread.meta["min_time_s"] == 0.5
    assert [x.forward_s for x in spread.layers] == pytest.approx([0.01, 0.01], rel=0.10)
    chained = profile_model(wl, microbatch_size=4, warmup=1, repeats=2, min_time_s=0.5)
    assert chained.meta["order"] == "stage" and 6 <= chained.meta["timed_rounds"] <= 9
    assert [x.forward_s for x in chained.layers] == pytest.approx([0.01, 0.01], rel=0.10)
    # one layer at a time: each of the two measured layers gets half of it, 0.25 s of 30-45 ms rounds
    streamed = profile_model(wl, microbatch_size=4, warmup=0, repeats=2, min_time_s=0.5, streaming=True)
    assert 6 <= streamed.meta["timed_rounds"] <= 9


def test_min_time_refusals() -> None:
    wl = Workload(nn.Sequential(Sleep(0.0)), torch.randn(4, 8), loss_fn=_sum_loss)
    for bad in (-1.0, float("inf"), float("nan"), True, "5"):
        with pytest.raises(StageplanError, match=r"min_time_s must be a finite number of seconds >= 0, got .*; e\.g\. --min-time 20"):
            profile_model(wl, microbatch_size=4, min_time_s=bad)  # type: ignore[arg-type]
    with pytest.raises(StageplanError, match=r"min_time_s \(5\) spreads measured rounds over time, and an estimate "
                                             r"measures nothing; drop --min-time"):
        profile_model(wl, microbatch_size=4, device="estimate:h100-sxm", min_time_s=5)
