"""stageplan.profiling.profiler: profile_model against layers of known cost and known saved bytes, the model
left unchanged, refusals, the order layers are timed in, ties, and --min-time."""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, run_cli
from torch import nn

from stageplan import Workload
from stageplan.errors import SchemaError, StageplanError, WorkloadError
from stageplan.formats.profile import Profile, TiedParameter, merge_profiles
from stageplan.planning.planner import plan
from stageplan.profiling.profiler import profile_model
from stageplan.report import profile_table
from stageplan.zoo import build_workload, gpt


def test_half_precision_on_cpu_warns() -> None:
    from stageplan.profiling.profiler import profile_model
    from stageplan.zoo import build_workload

    with pytest.warns(UserWarning, match=r"profiling in float16 on the CPU"):
        profile_model(build_workload("workloads:mlp", {}), microbatch_size=4, dtype="float16", warmup=0,
                      repeats=1)


@pytest.mark.parametrize("streaming", [False, True])
def test_the_profiler_records_the_tied_embedding_and_head(streaming: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # two tiny identical blocks timed once each on a shared machine
        wl = build_workload("gpt", {"tied": True, "n_layer": 2})
        prof = profile_model(wl, microbatch_size=2, warmup=0, repeats=1, streaming=streaming)
        untied = profile_model(build_workload("gpt", {"n_layer": 2}), microbatch_size=2, warmup=0, repeats=1,
                               streaming=streaming)
    assert prof.names[0] == "tok_emb+pos_emb" and prof.names[-1] == "ln_f+head"
    assert prof.tied == (
        TiedParameter(("tok_emb.weight", "head.weight"), (0, len(prof) - 1), 8192 * 128 * 4),)
    assert untied.meta["tied"] == [] and untied.tied == ()
    assert Profile.from_json(json.loads(json.dumps(prof.to_json()))).tied == prof.tied


FWD, HOT, COLD = 1e-3, 2e-3, 6e-3


SLACK = 2e-3  # a sleep overshoots a little, never undershoots


def _evictees(layers: int = 6):  # type: ignore[no-untyped-def]
    return build_workload("workloads:evictees", {"layers": layers, "forward_ms": FWD * 1e3,
                                                 "hot_ms": HOT * 1e3, "cold_ms": COLD * 1e3})


def _between(value: float | None, low: float) -> bool:
    return value is not None and low <= value <= low + SLACK


@pytest.mark.timing
def test_stage_order_times_each_backward_after_the_next_layers_and_every_layer_in_its_place() -> None:
    wl = _evictees()
    stage = profile_model(wl, microbatch_size=2, warmup=1, repeats=5)  # the whole model fits: stage order
    layer = profile_model(wl, microbatch_size=2, warmup=1, repeats=5, order="layer")
    assert stage.meta["order"] == "stage" and layer.meta["order"] == "layer"
    assert (
        "in a stage's order" in stage.meta["method"] and "right after its own forward" in layer.meta["method"]
    )
    n = len(stage.layers)
    for k, (s, x) in enumerate(zip(stage.layers, layer.layers)):
        # each alone: every backward right after its own forward, hot, into empty grads and accumulating
        assert _between(x.backward_s, HOT) and _between(x.backward_accumulate_s, HOT), (k, x)
        # a stage's order: each backward after the next layer's,
        # cold; the last layer's right after its forward
        want = HOT if k == n - 1 else COLD
        assert _between(s.backward_s, want) and _between(s.backward_accumulate_s, want), (k, s)
        assert _between(s.forward_s, FWD) and _between(x.forward_s, FWD)
    # identical layers (1-4; layer 0 gets no input gradient, layer 5 the loss): alone, the last two reuse the
    # second's figures; in a stage's order each is timed in its own place in the chain
    assert [x.measured_as for x in layer.layers] == [None, None, None, "2", "2", None]
    assert all(x.measured_as is None for x in stage.layers)
    # of them, those between identical neighbours (2 and 3: 1 follows layer 0, 4 precedes the loss layer) take
    # the medians over both's rounds; without dedup each keeps its own
    assert stage.meta["pooled_layers"] == [["2", "3"]] and layer.meta["pooled_layers"] == []
    assert "pooled: 2, 3 (identical layers between identical neighbours" in profile_table(stage)
    assert "pooled:" not in profile_table(layer)
    assert (stage.layers[2].forward_s, stage.layers[2].backward_s) == (stage.layers[3].forward_s,
                                                                       stage.layers[3].backward_s)
    every = profile_model(wl, microbatch_size=2, warmup=1, repeats=5, dedup=False)
    assert every.meta["pooled_layers"] == [] and all(_between(x.backward_s, COLD) for x in every.layers[:-1])
    assert (
        stage.meta["layers_measured"] == n
        and stage.meta["layers_reused"] == 0
        and stage.meta["dedup_spread"] is None
    )
    # the identical layers still share what does not depend on the order: saved bytes and the optimizer step
    assert [x.activation_bytes for x in stage.layers] == [x.activation_bytes for x in layer.layers]
    # (3 is timed too: the third checks the second)
    assert stage.layers[4].optimizer_s == stage.layers[2].optimizer_s


@pytest.mark.timing
def test_the_orders_price_a_split_as_their_figures_say() -> None:
    """A split's compute under each order, against the closed form over the sleeps (m = 4: forward plus the
    mean of one backward into empty grads and three accumulating)."""
    wl = _evictees(4)
    for order, backward in (("stage", [COLD, COLD, COLD, HOT]), ("layer", [HOT] * 4)):
        prof = profile_model(wl, microbatch_size=2, warmup=1, repeats=5, order=order)
        pl = plan(prof, 2, num_microbatches=2, boundaries=[0, 2, 4])
        for st, (lo, hi) in zip(pl.stages, ((0, 2), (2, 4))):
            known = sum(FWD + backward[k] for k in range(lo, hi))
            assert known <= st.forward_s + st.backward_s <= known + 2 * SLACK, (order, st)


@pytest.mark.timing
def test_order_refusals_and_the_layer_at_a_time_default(capsys: pytest.CaptureFixture[str]) -> None:
    wl = _evictees(3)
    with pytest.raises(StageplanError,
                       match=r"order must be one of stage, layer, got 'diagonal'; e\.g\. --order stage"):
        profile_model(wl, microbatch_size=2, order="diagonal")
    with pytest.raises(StageplanError, match=r"order 'stage' times every layer in one chain, and a "
                                             r"layer-at-a-time profile holds one layer at a time; use "
                                             r"--order layer with --streaming"):
        profile_model(wl, microbatch_size=2, order="stage", streaming=True)
    with pytest.raises(StageplanError, match=r"order \(layer\) is the order layers are timed in, and an "
                                             r"estimate times nothing; drop --order"):
        profile_model(wl, microbatch_size=2, order="layer", device="estimate:h100-sxm")
    streamed = profile_model(wl, microbatch_size=2, warmup=0, repeats=2, streaming=True)
    assert streamed.meta["order"] == "layer" and all(_between(x.backward_s, HOT) for x in streamed.layers)
    code, _, err = run_cli(
        ["profile", "workloads:evictees", "--order", "stage", "--streaming", "-o", "never.json"], capsys)
    assert_one_line_error(code, err, r"order 'stage' times every layer in one chain")
    assert not Path("never.json").exists()
    # in fresh processes too, refused before any starts
    from stageplan.running.launch import profile_in_processes

    with pytest.raises(StageplanError, match=r"order must be one of stage, layer, got 'diagonal'"):
        profile_in_processes("workloads:evictees", processes=2, order="diagonal")
    with pytest.raises(StageplanError, match=r"order 'stage' times every layer in one chain"):
        profile_in_processes("workloads:evictees", processes=2, order="stage", streaming=True)


@pytest.mark.timing
def test_cli_order_and_merging_refuses_two_orders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    code, stdout, _ = run_cli(["profile", "workloads:evictees", "--set", "layers=3", "--order", "layer",
                               "--warmup", "0", "--repeats", "2", "-o", str(out)], capsys)
    assert code == 0 and "order=layer" in stdout  # the table's last line says how the layers were timed
    data = json.loads(out.read_text())
    assert data["meta"]["order"] == "layer" and all(_between(x["backward_s"], HOT) for x in data["layers"])
    wl = _evictees(3)
    a = profile_model(wl, microbatch_size=2, warmup=0, repeats=2)
    b = profile_model(wl, microbatch_size=2, warmup=0, repeats=2, order="layer")
    with pytest.raises(SchemaError, match=r"profile 1 has order = 'layer' where profile 0 has 'stage'"):
        merge_profiles([a, b])
    assert merge_profiles([a, replace(a)]).meta["order"] == "stage"


class Sleep(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x * self.scale


@pytest.mark.timing
def test_sleep_layers_measure_their_known_time() -> None:
    model = nn.Sequential(Sleep(0.02), Sleep(0.04))
    wl = Workload(model, torch.randn(4, 8), loss_fn=_sum_loss)
    prof = profile_model(wl, microbatch_size=4, warmup=1, repeats=5)
    assert prof.layers[0].forward_s == pytest.approx(0.02, rel=0.10)
    assert prof.layers[1].forward_s == pytest.approx(0.04, rel=0.10)


@pytest.mark.timing
def test_matmul_layers_scale_with_flops() -> None:
    # 256x256, 256x512, 512x512 weights: 1x, 2x, 4x the FLOPs per row.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.Linear(256, 512, bias=False),
                          nn.Linear(512, 512, bias=False))
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
    assert p1.layers[-1].forward_s + p1.layers[-1].backward_s > 2 * (blocks[0].forward_s
                                                                     + blocks[0].backward_s)
    assert p1.layers[0].param_bytes > 2 * blocks[0].param_bytes
    for key in ("model", "factory_options", "device", "dtype", "microbatch_size", "input_shapes",
                "torch_version",
                "stageplan_version", "threads", "warmup", "repeats", "date", "method", "whole_model_s"):
        assert key in p1.meta


@pytest.mark.timing
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
    with pytest.raises(StageplanError,
                       match=r"microbatch size 3 does not divide the batch of 8; use one of \[1, 2, 4, 8\]"):
        profile_model(wl, microbatch_size=3)


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
    with pytest.raises(WorkloadError, match=r"torch.export cannot split DataDependent \(.+\); name layers "
                                            r"explicitly with --layers"):
        profile_model(wl, microbatch_size=2, warmup=0, repeats=1)


def test_layer_pattern_matching_nothing_is_refused() -> None:
    with pytest.raises(WorkloadError, match=r"layer pattern 'decoder\.\*' matches no module of GPT; "
                                            r"top-level modules are: tok_emb"):
        profile_model(gpt(n_layer=1), microbatch_size=2, layers=["decoder.*"])


def _sum_loss(out, _target):  # type: ignore[no-untyped-def]
    return out.sum()


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


@pytest.mark.timing
def test_min_time_times_rounds_until_they_span_it() -> None:
    """Rounds of sleep layers of known cost: each alone, a round sleeps 30 ms per layer (a forward, then two
    forward-backward pairs) and 20 ms for the whole model, 80 ms in all, so 0.5 s takes at most ceil(0.5 /
    0.08) = 7 rounds, and at least 5 unless a round overran its sleeps by half (0.12 s); in a stage's order
    two forwards per layer (40 ms) and the whole model, 60 ms: at most 9 rounds, at least 6 (0.09 s rounds);
    without min_time_s, exactly the repeats."""
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
        with pytest.raises(StageplanError, match=r"min_time_s must be a finite number of seconds >= 0, got "
                                                 r".*; e\.g\. --min-time 20"):
            profile_model(wl, microbatch_size=4, min_time_s=bad)  # type: ignore[arg-type]
    with pytest.raises(StageplanError, match=r"min_time_s \(5\) spreads measured rounds over time, and an "
                                             r"estimate measures nothing; drop --min-time"):
        profile_model(wl, microbatch_size=4, device="estimate:h100-sxm", min_time_s=5)
