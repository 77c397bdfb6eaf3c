"""Profiling one layer at a time, identical layers measured once, and estimates for a GPU we do not have:
each against an independent oracle (the whole-model profile, every layer measured, hand-counted bytes)."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_one_line_error, run_cli
from torch import nn
from workloads import mlp

from stageplan import Profile, Workload, plan, profile_model
from stageplan.errors import StageplanError
from stageplan.materialize import init_empty_weights
from stageplan.zoo import gpt, hf_llama

ROOT = Path(__file__).resolve().parents[2]


# A busy 2-core machine moves a small layer's median by
# tens of percent between rounds; the spread check warns.
pytestmark = pytest.mark.filterwarnings("ignore:identical layers .* apart:UserWarning")


def _bytes(prof: Profile) -> list[tuple[str, int, int, int, int]]:
    return [(x.name, x.activation_bytes, x.output_bytes, x.param_bytes, x.param_count) for x in prof.layers]


def _sum_loss(out: torch.Tensor, target: object) -> torch.Tensor:
    return out.sum()  # saves nothing for backward


@pytest.fixture(scope="module")
def gpt4() -> Workload:
    return gpt(n_layer=4, d_model=64)


@pytest.fixture(scope="module")
def gpt_dedup(gpt4: Workload) -> Profile:
    return profile_model(gpt4, microbatch_size=2, warmup=1, repeats=5, streaming=False, order="layer")


@pytest.fixture(scope="module")
def gpt_every(gpt4: Workload) -> Profile:
    return profile_model(gpt4, microbatch_size=2, warmup=1, repeats=5, streaming=False, dedup=False,
                         order="layer")


@pytest.fixture(scope="module")
def gpt_streamed(gpt4: Workload) -> Profile:
    return profile_model(gpt4, microbatch_size=2, warmup=1, repeats=3, streaming=True)


@pytest.mark.timing
def test_dedup_keeps_bytes_names_and_plans_and_times_stay_within_noise(
    gpt_dedup: Profile, gpt_every: Profile
) -> None:
    assert _bytes(gpt_dedup) == _bytes(gpt_every)
    for p, q in [(plan(gpt_dedup, 2), plan(gpt_every, 2)),
                 (plan(gpt_dedup, 3, method="parameters"), plan(gpt_every, 3, method="parameters"))]:
        assert p.boundaries == q.boundaries
    assert gpt_dedup.meta["dedup"] is True and gpt_every.meta["dedup"] is False
    # emb, block x3, head
    assert gpt_dedup.meta["layers_measured"] == 5 and gpt_every.meta["layers_measured"] == 6
    assert all(x.measured_as is None for x in gpt_every.layers) and gpt_every.meta["dedup_spread"] is None
    # Times: the one measured block against the median of
    # the four measured separately (generous: shared cores).
    every = statistics.median(x.time_s for x in gpt_every.layers if x.name.startswith("blocks."))
    once = gpt_dedup.layers[1].time_s
    assert 0.5 < once / every < 2.0, (once, every)
    spread = gpt_dedup.meta["dedup_spread"]
    assert spread["layer"] == "blocks.2" and spread["vs"] == "blocks.1"
    assert 0.5 < spread["forward_ratio"] < 2.0 and 0.5 < spread["backward_ratio"] < 2.0


def test_measured_as_names_the_second_block_and_never_the_embedding_or_head(gpt_dedup: Profile) -> None:
    # the first block follows the embedding and keeps its own
    # figures; the rest follow a block, as the second does
    assert [x.measured_as for x in gpt_dedup.layers] == [None, None, None, "blocks.1", "blocks.1", None]
    second = gpt_dedup.layers[2]
    for x in gpt_dedup.layers[3:5]:
        assert (x.forward_s, x.backward_s, x.activation_bytes) == (second.forward_s, second.backward_s,
                                                                   second.activation_bytes)
    assert gpt_dedup.meta["distinct_layers"] == 3 and gpt_dedup.meta["layers_reused"] == 2


def test_sequential_chain_groups_by_module_input_and_loss() -> None:
    # Linear, Tanh x4: the first Linear gets no input gradient, the last Tanh the loss
    wl = mlp(width=16, depth=4)
    dedup = profile_model(wl, microbatch_size=4, warmup=0, repeats=2, order="layer")
    every = profile_model(wl, microbatch_size=4, warmup=0, repeats=2, dedup=False, order="layer")
    assert [x.measured_as for x in dedup.layers] == [None, None, None, None, None, "3", "4", None]
    assert dedup.meta["dedup_spread"]["layer"] == "5" and dedup.meta["dedup_spread"]["vs"] == "3"
    assert _bytes(dedup) == _bytes(every)
    assert plan(dedup, 2, method="parameters").boundaries == plan(every, 2, method="parameters").boundaries


def test_measured_as_loads_from_old_files_and_leaves_the_digest_alone() -> None:
    # written before measured_as existed
    old = Profile.load(ROOT / "tests" / "data" / "old-format" / "gpt.json")
    assert all(x.measured_as is None for x in old.layers)
    tagged = Profile(tuple(replace(x, measured_as="blocks.0") for x in old.layers), old.meta)
    assert tagged.digest() == old.digest()
    assert Profile.from_json(json.loads(json.dumps(tagged.to_json()))) == tagged
    bad = tagged.to_json()
    bad["layers"][0]["measured_as"] = 3
    with pytest.raises(StageplanError,
                       match=r"layer 0 \('tok_emb\+pos_emb'\) has measured_as = 3; it must be a layer name"):
        Profile.from_json(bad)


def test_streaming_gives_the_whole_model_profile_bytes(gpt4: Workload, gpt_dedup: Profile,
                                                       gpt_streamed: Profile) -> None:
    assert _bytes(gpt_streamed) == _bytes(gpt_dedup)
    assert [x.measured_as for x in gpt_streamed.layers] == [x.measured_as for x in gpt_dedup.layers]
    meta = gpt_streamed.meta
    assert meta["materialized"] == "layer-at-a-time" and gpt_dedup.meta["materialized"] == "whole-model"
    assert meta["whole_model_s"] is None and meta["whole_model"] == "skipped: layer-at-a-time"
    assert gpt_streamed.sum_vs_whole is None and meta["sum_vs_whole"] is None
    assert meta["peak_rss_bytes"] > 0 and all(x.forward_s > 0 and x.backward_s > 0
                                              for x in gpt_streamed.layers)
    # the user's model, untouched
    assert all(p.device.type == "cpu" and p.grad is None for p in gpt4.model.parameters())


def test_streaming_an_hf_model_built_on_meta_matches_the_real_one() -> None:
    # A model on meta traces with meta tensors flowing: its
    # pieces' device constants must be pointed at the CPU.
    real = hf_llama(n_layer=2, d_model=64, seq_len=32, vocab_size=512)
    from stageplan.materialize import init_empty_weights

    with init_empty_weights():
        on_meta = hf_llama(n_layer=2, d_model=64, seq_len=32, vocab_size=512)
    whole = profile_model(real, microbatch_size=2, warmup=0, repeats=1, streaming=False)
    streamed = profile_model(on_meta, microbatch_size=2, warmup=0, repeats=1, streaming=True)
    assert _bytes(streamed) == _bytes(whole)
    # a pair of blocks: both measured
    assert [x.measured_as for x in streamed.layers] == [None, None, None, None]
    assert all(p.device.type == "meta" for p in on_meta.model.parameters())


@pytest.mark.parametrize("streaming", [False, True])
def test_linear_layers_of_known_widths_have_exact_bytes(streaming: bool) -> None:
    widths, batch = [32, 64, 16, 48], 4
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
    prof = profile_model(Workload(model, torch.randn(8, widths[0]), loss_fn=_sum_loss), microbatch_size=batch,
                         warmup=0, repeats=1, streaming=streaming)
    for k, (a, b) in enumerate(zip(widths, widths[1:])):
        layer = prof.layers[k]
        assert layer.activation_bytes == 4 * batch * a  # a Linear saves its input (its weight is a parameter)
        assert (layer.param_bytes, layer.param_count) == (4 * (a * b + b), a * b + b)
        assert layer.output_bytes == (4 * batch * b if k < len(widths) - 2 else 0)
        assert layer.measured_as is None


def test_each_streamed_layer_starts_without_the_heap_the_layers_before_it_freed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor of these layers is below glibc's mmap threshold (32 MiB under measure.steady_allocator),
    so what a layer frees (its weights, gradients, activations, the optimizer step's copies and states) stays
    in the heap, never trimmed, unless the profiler hands it back between layers. Measured on a 2-core CPU
    host: the resident set at each layer's start grew 150-230 MB over four layers of 16.8 MB without that,
    by at most 7 MB with it."""
    import stageplan.profiling.streaming as streaming
    from stageplan.measure import _glibc, release_free_memory, resident_bytes

    if _glibc() is None:
        pytest.skip("only glibc keeps freed heap resident, and only glibc has malloc_trim")
    starts: list[int] = []
    materialize = streaming.materialize_piece

    def noted(*args: Any, **kwargs: Any) -> None:
        starts.append(resident_bytes())
        materialize(*args, **kwargs)

    monkeypatch.setattr(streaming, "materialize_piece", noted)
    with init_empty_weights():
        model = nn.Sequential(*[nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]) for _ in range(4)])
    layer_bytes = 4 * (1024 * 1024 + 1024) * 4  # 16.8 MB, each weight 4.2 MB
    release_free_memory()  # what earlier tests in this process freed is not this profile's
    profile_model(Workload(model, torch.randn(64, 1024), loss_fn=_sum_loss), microbatch_size=64, warmup=0,
                  repeats=1, streaming=True, dedup=False)
    assert len(starts) == 4
    # first-touched code pages and Python objects: well under one layer (7 MB measured)
    assert max(starts) - starts[0] < 2 * layer_bytes, [s - starts[0] for s in starts]


def test_streaming_is_chosen_when_the_whole_model_would_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    import stageplan.profiling.profiler as profiler

    wl = mlp(width=16, depth=2)
    monkeypatch.setattr(profiler, "free_bytes", lambda device: 10**12)
    roomy = profile_model(wl, microbatch_size=4, warmup=0, repeats=1)
    monkeypatch.setattr(profiler, "free_bytes", lambda device: 1000)
    tight = profile_model(wl, microbatch_size=4, warmup=0, repeats=1)
    assert roomy.meta["materialized"] == "whole-model" and tight.meta["materialized"] == "layer-at-a-time"
    check = tight.meta["memory_check"]
    # 2 x parameters (copy + gradients) + what the whole forward saves, counted by hand for Linear, Tanh,
    # Linear, Tanh at 4 x 16 floats: the input, the first Tanh's output (the second Linear's input: one
    # storage), the last's.
    params, acts = 4 * 2 * (16 * 16 + 16), 3 * 4 * 4 * 16
    assert check["activation_bytes"] == acts and check["whole_model_bytes"] == 2 * params + acts
    assert check["free_bytes"] == 1000


def test_estimate_bytes_are_the_measured_bytes_and_times_are_analytic() -> None:
    wl = mlp(width=32, depth=3)
    measured = profile_model(wl, microbatch_size=4, warmup=0, repeats=1)
    est = profile_model(wl, microbatch_size=4, device="estimate:h100-sxm")
    assert _bytes(est) == _bytes(measured)  # fp32, no attention: the same saved tensors, counted two ways
    assert [x.measured_as for x in est.layers] == [x.measured_as for x in measured.layers]
    assert all(x.forward_s > 0 and x.backward_s > 0 and x.backward_accumulate_s == x.backward_s
               for x in est.layers)
    meta = est.meta
    assert (
        meta["timer"] == "analytic"
        and meta["device"] == "estimate:h100-sxm"
        and meta["whole_model_s"] is None
    )
    assert (
        meta["estimate"]["gpu"] == "h100-sxm"
        and meta["estimate"]["eta_c"] == 0.45
        and meta["estimate"]["eta_m"] == 0.7
    )
    assert (
        "not yet checked against a GPU" in meta["estimate"]["accuracy"] and meta["estimate"]["sources"]["gpu"]
    )
    faster = profile_model(wl, microbatch_size=4, device="estimate:h100-sxm", compute_efficiency=0.9,
                           memory_efficiency=1.0)
    assert faster.meta["estimate"]["eta_c"] == 0.9
    assert all(f.forward_s < e.forward_s for f, e in zip(faster.layers, est.layers))


def test_estimate_of_a_gpt_in_bfloat16_from_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["profile", "gpt", "--set", "n_layer=3", "--set", "d_model=64", "--device", "estimate:h100-sxm",
            "--quiet"]
    assert run_cli([*base, "-o", str(tmp_path / "f32.json")], capsys)[0] == 0
    assert run_cli([*base, "--dtype", "bfloat16", "-o", str(tmp_path / "bf16.json")], capsys)[0] == 0
    f32, bf16 = Profile.load(tmp_path / "f32.json"), Profile.load(tmp_path / "bf16.json")
    assert bf16.meta["dtype"] == "bfloat16" and bf16.meta["materialized"].startswith("none")
    # built in bf16: exact
    assert [2 * x.param_bytes for x in bf16.layers] == [x.param_bytes for x in f32.layers]
    assert [x.measured_as for x in bf16.layers] == [None, None, None, "blocks.1", None]
    assert torch.get_default_dtype() == torch.float32  # restored after the build
    assert all(x.forward_s > 0 for x in bf16.layers)


def test_unknown_gpu_and_misplaced_options_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "x.json")
    code, _, err = run_cli(["profile", "gpt", "--device", "estimate:h300", "-o", out], capsys)
    assert_one_line_error(code, err,
                          r"unknown GPU 'h300' for --device estimate:h300; known: a100-40gb, .*h100-sxm")
    code, _, err = run_cli(["profile", "gpt", "--compute-efficiency", "0.5", "-o", out], capsys)
    assert_one_line_error(
        code, err, r"compute_efficiency \(0.5\) applies to estimates only; use it with --device estimate:GPU")
    code, _, err = run_cli(
        ["profile", "gpt", "--device", "estimate:h100-sxm", "--memory-efficiency", "2", "-o", out], capsys)
    assert_one_line_error(code, err, r"memory_efficiency must be a fraction in \(0, 1\], got 2.0")
    with pytest.raises(StageplanError, match=r"streaming must be True, False or None and dedup True or "
                                             r"False, got streaming='yes'"):
        profile_model(mlp(), microbatch_size=2, streaming="yes")  # type: ignore[arg-type]


def test_cli_streaming_and_no_dedup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    small = ["profile", "gpt", "--set", "n_layer=3", "--set", "d_model=64", "--set", "vocab_size=512",
             "--warmup", "0", "--repeats", "1"]
    code, stdout, _ = run_cli([*small, "--streaming", "-o", str(out)], capsys)
    assert code == 0
    assert "whole model not timed (skipped: layer-at-a-time)" in stdout and "= blocks.1" in stdout
    data: dict[str, Any] = json.loads(out.read_text())
    assert data["meta"]["materialized"] == "layer-at-a-time" and data["meta"]["dedup"] is True
    assert [x["measured_as"] for x in data["layers"]] == [None, None, None, "blocks.1", None]
    code, stdout, _ = run_cli([*small, "--no-dedup", "-o", str(out)], capsys)
    assert code == 0 and "= blocks.0" not in stdout and "sum of layers / whole" in stdout
    data = json.loads(out.read_text())
    assert data["meta"]["dedup"] is False and data["meta"]["materialized"] == "whole-model"
    assert all(x["measured_as"] is None for x in data["layers"])


def test_the_fake_chain_gives_each_layers_inputs_and_the_bytes_crossing_each_boundary() -> None:
    from stageplan.layers import cut_layers
    from stageplan.profiling.streaming import fake_chain

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    inputs, crossing = fake_chain(cut_layers(model, (x,)), (x,), torch.device("cpu"))
    assert [[tuple(v.shape) for v in values] for values in inputs] == [[(4, 16)], [(4, 32)], [(4, 32)]]
    # float32 activations; nothing crosses after the last layer
    assert crossing == [4 * 32 * 4, 4 * 32 * 4, 0]


class Looped(nn.Module):
    """Weight reuse inside a block, as ALBERT's shared layers or a looped block: one Linear called three times
    (torch.export names the later calls ``lin@1`` and ``lin@2``). test_materialize uses it too."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = torch.tanh(self.lin(x))
        return x


class _LoopedNet(nn.Module):
    """Not a Sequential: cut by torch.export, which names the later calls of a block's Linear lin@1, lin@2."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Looped(width) for _ in range(6))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def looped(width: int = 32, batch_size: int = 8) -> Workload:
    torch.manual_seed(0)
    return Workload(_LoopedNet(width), torch.randn(batch_size, width), loss_fn=_sum_loss, name="looped")


@pytest.mark.parametrize("mode", ["streaming", "streaming-on-meta", "stage", "layer", "no-dedup", "estimate"])
def test_a_block_that_calls_its_linear_three_times_profiles_with_its_parameters_once(mode: str) -> None:
    """Streaming had ended in KeyError 'blocks.0.lin@1.weight' (materialize.real_parameters): the exported
    piece names the second call lin@1, and nothing mapped it back to the parameter."""
    width, mb = 32, 4
    opts: dict[str, Any] = {
        "streaming": {"streaming": True}, "streaming-on-meta": {"streaming": True},
        "stage": {"streaming": False, "order": "stage"}, "layer": {"streaming": False, "order": "layer"},
        "no-dedup": {"streaming": False, "dedup": False}, "estimate": {"device": "estimate:h100-sxm"}}[mode]
    if mode == "streaming-on-meta":  # as the CLI builds it for --streaming: initialised by FQN
        from stageplan.materialize import init_empty_weights

        with init_empty_weights():
            wl = looped(width)
    else:
        wl = looped(width)
    if "device" not in opts:
        opts.update(warmup=0, repeats=1)
    prof = profile_model(wl, microbatch_size=mb, **opts)
    assert prof.names == [f"blocks.{k}" for k in range(6)] + ["out"]
    own = sum(p.numel() for p in Looped(width).parameters())  # the module's own count: width^2 + width
    assert [(x.param_count, x.param_bytes) for x in prof.layers] == [(own, 4 * own)] * 7
    # saved: the block's input and each tanh's output (each the next call's input), float32
    assert [x.activation_bytes for x in prof.layers[1:6]] == [4 * 4 * mb * width] * 5
    assert all(x.forward_s > 0 and x.backward_s > 0 for x in prof.layers)


def test_the_cli_streams_a_looped_block_from_a_model_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the issue ran it: ``stageplan profile MODULE:FACTORY --streaming`` had ended in a traceback."""
    import sys

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    out = tmp_path / "p.json"
    code, _, err = run_cli(["profile", f"{Path(__file__).stem}:looped", "--streaming", "--warmup", "0",
                            "--repeats", "1", "--quiet", "-o", str(out)], capsys)
    sys.modules.pop(Path(__file__).stem, None)  # imported again by name: leave no second copy behind
    assert code == 0, err
    data: dict[str, Any] = json.loads(out.read_text())
    assert data["meta"]["materialized"] == "layer-at-a-time"
    assert [x["param_count"] for x in data["layers"]] == [32 * 32 + 32] * 7
