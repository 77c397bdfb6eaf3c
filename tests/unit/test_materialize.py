"""Meta-first building: parameters on meta, ties kept, only a piece materialised, its tensors exactly the
checkpoint's (or the same FQN-keyed initialisation everywhere)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_cli
from torch import nn

from stageplan.errors import StageplanError, WorkloadError
from stageplan.formats.profile import Profile
from stageplan.layers import cut_stages
from stageplan.materialize import (
    Checkpoint,
    init_empty_weights,
    initialize_by_fqn,
    materialize_,
    meta_copy,
    meta_model,
    meta_parameter_names,
    parameter_bytes,
    real_parameters,
    save_checkpoint,
)
from stageplan.running.stages import reference_model
from stageplan.workload import Workload
from stageplan.zoo import gpt

from .test_streaming import Looped


def test_the_cli_profiles_a_model_fn_factory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # small enough to fit: materialised whole from meta (initialised by FQN); --streaming: one layer at a time
    for flags, how in (([], "whole-model"), (["--streaming"], "layer-at-a-time")):
        code, _, err = run_cli(["profile", "workloads:big", *flags, "--warmup", "0", "--repeats", "1",
                                "--quiet", "-o", str(tmp_path / "big.json")], capsys)
        assert code == 0, err
        prof = Profile.load(tmp_path / "big.json")
        assert len(prof) == 4 and prof.meta["materialized"] == how
        assert [x.param_bytes for x in prof.layers] == [(32 * 32 + 32) * 4] * 4


SMALL = {"n_layer": 3, "d_model": 32, "n_head": 2, "seq_len": 8, "vocab_size": 64, "tied": True}


def test_init_empty_weights_keeps_ties_and_inputs() -> None:
    real = gpt(**SMALL)
    with init_empty_weights():
        meta = gpt(**SMALL)
    assert all(p.device.type == "meta" for p in meta.model.parameters())
    # tied: one parameter under two names, as in the real model (accelerate's patch would untie it)
    assert len(list(meta.model.parameters())) == len(list(real.model.parameters()))
    assert meta.model.head.weight is meta.model.tok_emb.weight
    # the inputs a factory builds beside its model stay real (gpt draws them from its own seeded generator)
    assert torch.equal(meta.inputs, real.inputs) and torch.equal(meta.target, real.target)
    assert parameter_bytes(meta.model) == parameter_bytes(real.model)


def test_only_one_piece_is_materialised_with_the_checkpoints_tensors(tmp_path: Path) -> None:
    real = gpt(**SMALL)
    save_checkpoint(real.model, tmp_path / "w.safetensors")
    ckpt = Checkpoint(tmp_path / "w.safetensors")
    stored = ckpt.keys()
    assert "head.weight" not in stored and "tok_emb.weight" in stored  # a tie is stored once
    meta = meta_copy(real.model)
    names = ["tok_emb+pos_emb", "blocks.0", "blocks.1", "blocks.2", "ln_f+head"]
    cut = cut_stages(meta, (real.inputs[:2],), names, (0, 2, 5))
    last = cut.pieces[1].module
    materialize_(last, real_parameters(meta, meta_parameter_names(last), "cpu", weights=ckpt))
    assert not meta_parameter_names(last)
    assert meta_parameter_names(cut.pieces[0].module)  # the other stage stays weightless
    got = dict(last.named_parameters(remove_duplicate=False))
    want = dict(real.model.named_parameters(remove_duplicate=False))
    for name, p in got.items():
        # the head reads the embedding through the tie
        torch.testing.assert_close(p, want[name], rtol=0, atol=0)
    # the materialised stage computes what the real model's layers compute
    with torch.no_grad():
        pos = torch.arange(SMALL["seq_len"])
        hidden = real.model.blocks[0](real.model.tok_emb(real.inputs[:2]) + real.model.pos_emb(pos))
        torch.testing.assert_close(last(hidden), real.model.head(
            real.model.ln_f(real.model.blocks[2](real.model.blocks[1](hidden)))))


def test_fqn_init_is_the_same_wherever_it_runs_and_defined() -> None:
    with init_empty_weights():
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    names = [n for n, _ in model.named_parameters()]
    a = initialize_by_fqn(model, names, "cpu", seed=1)
    b = initialize_by_fqn(model, list(reversed(names)), "cpu", seed=1)  # order and subset do not matter
    c = initialize_by_fqn(model, ["2.weight"], "cpu", seed=1)
    assert all(torch.equal(a[n], b[n]) for n in names) and torch.equal(c["2.weight"], a["2.weight"])
    assert not torch.equal(initialize_by_fqn(model, names, "cpu", seed=2)["0.weight"], a["0.weight"])
    # LayerNorm's own rule
    assert torch.equal(a["1.weight"], torch.ones(4)) and torch.equal(a["1.bias"], torch.zeros(4))
    assert all(torch.isfinite(t).all() for t in a.values())
    ref = reference_model(model, torch.device("cpu"), seed=1)
    assert all(torch.equal(p, a[n]) for n, p in ref.named_parameters())


def test_fqn_init_draws_an_fp32_matrix_in_place_with_the_values_of_a_drawn_copy() -> None:
    """A CPU fp32 matrix is drawn into its own storage: the only allocation of its size is the parameter (a
    drawn temporary beside it had held 2.18 GB more while a 152k x 3584 fp32 head was initialised), and the
    values are those of the fp32 draw that was copied in before."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from stageplan.materialize import _fqn_seed

    class NewStorages(TorchDispatchMode):
        """The bytes of every CPU storage an op returns that none of its inputs holds."""

        def __init__(self) -> None:
            super().__init__()
            self.nbytes: list[int] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            held = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
            self.nbytes += [t.untyped_storage().nbytes() for t in tree_leaves(out)
                            if isinstance(t, torch.Tensor) and t.device.type == "cpu"
                            and t.untyped_storage().data_ptr() not in held]
            return out

    with init_empty_weights():
        model = nn.Sequential(nn.Linear(512, 256))
    weight_bytes = 512 * 256 * 4
    with NewStorages() as new:
        # no model rule after the defined draw: the weight keeps the draw's values
        made = initialize_by_fqn(model, ["0.weight", "0.bias"], "cpu", seed=3, init_fn=lambda module: None)
    assert [b for b in new.nbytes if b >= weight_bytes] == [weight_bytes]
    drawn = torch.randn((256, 512), generator=torch.Generator().manual_seed(_fqn_seed(3, "0"))).mul_(0.02)
    assert torch.equal(made["0.weight"], drawn) and torch.equal(made["0.bias"], torch.zeros(256))


def test_a_workload_with_only_a_model_fn_builds_on_meta() -> None:
    wl = Workload(None, torch.randn(4, 8), model_fn=lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)))
    model = meta_model(wl)
    assert all(p.device.type == "meta" for p in model.parameters()) and wl.batch_size == 4
    with pytest.raises(WorkloadError, match=r"a Workload needs a model, or model_fn"):
        Workload(None, torch.randn(4, 8))


def test_checkpoint_refusals(tmp_path: Path) -> None:
    (tmp_path / "junk.safetensors").write_text("not a checkpoint")
    with pytest.raises(StageplanError, match=r"is not a safetensors file"):
        Checkpoint(tmp_path / "junk.safetensors")
    with pytest.raises(StageplanError, match=r"neither model.safetensors.index.json nor model.safetensors"):
        Checkpoint(tmp_path)
    with init_empty_weights():
        model = nn.Linear(2, 3)
    with pytest.raises(StageplanError,
                       match=r"weights tensor 'weight' has shape \(2, 2\), the model's 'weight' \(3, 2\)"):
        real_parameters(model, ["weight"], "cpu",
                        weights=Checkpoint({"weight": torch.zeros(2, 2), "bias": torch.zeros(3)}))


def test_an_hf_folder_with_an_index_reads_only_what_is_asked(tmp_path: Path) -> None:
    import json

    from safetensors.torch import save_file

    save_file({"a": torch.ones(2)}, str(tmp_path / "part-1.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "part-2.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "part-1.safetensors", "b": "part-2.safetensors"}}))
    ckpt = Checkpoint(tmp_path)
    assert ckpt.keys() == {"a", "b"} and list(ckpt.read(["b"])) == ["b"]


def test_safetensors_are_read_exactly_without_mapping_the_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {"a": torch.randn(3, 4), "b": torch.randn(5).bfloat16(), "c": torch.tensor(3),
               "d": torch.zeros(0),
               "e": torch.tensor([True, False]), "f": torch.arange(6, dtype=torch.int64).reshape(2, 3)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    got = Checkpoint(tmp_path / "t.safetensors").read(["f", "b", "a", "c", "d", "e"])
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "t.safetensors").read_bytes()[:-8])
    with pytest.raises(StageplanError,
                       match=r"cut.safetensors' is not a safetensors file .*not fully covered"):
        Checkpoint(tmp_path / "cut.safetensors")


def test_tied_weights_initialised_by_fqn_start_equal_everywhere() -> None:
    with init_empty_weights():
        meta = gpt(**SMALL).model
    state = torch.get_rng_state()
    # the head's stage and the embedding's stage ask separately; both get the embedding's initial values
    head = real_parameters(meta, ["head.weight"], "cpu")["head.weight"]
    emb = real_parameters(meta, ["tok_emb.weight", "pos_emb.weight"], "cpu")["tok_emb.weight"]
    assert torch.equal(head, emb)
    assert torch.equal(torch.get_rng_state(), state)  # the user's RNG is left as it was
    ref = reference_model(meta, torch.device("cpu"))
    assert ref.head.weight is ref.tok_emb.weight and torch.equal(ref.tok_emb.weight, emb)


def test_a_tied_state_dict_is_stored_once_and_read_through_the_tie(tmp_path: Path) -> None:
    from stageplan.materialize import save_tensors

    real = gpt(**SMALL).model
    # detached aliases of one tied weight
    save_tensors(real.state_dict().items(), tmp_path / "sd.safetensors")
    ckpt = Checkpoint(tmp_path / "sd.safetensors")
    got = real_parameters(meta_copy(real), ["head.weight"], "cpu", weights=ckpt)["head.weight"]
    assert torch.equal(got, real.tok_emb.weight)


def test_an_index_with_a_malformed_weight_map_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": null}')
    with pytest.raises(StageplanError,
                       match=r"is not an HF safetensors index \(weight_map is NoneType, not an object\)"):
        Checkpoint(tmp_path)


def test_a_model_fn_workload_is_profiled_layer_at_a_time_without_building_it() -> None:
    from stageplan.profiling.profiler import profile_model

    torch.manual_seed(0)
    wl = Workload(None, torch.randn(8, 16), torch.randn(8, 16), nn.functional.mse_loss,
                  model_fn=lambda: nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)))
    prof = profile_model(wl, microbatch_size=4, warmup=0, repeats=1, streaming=True)
    assert prof.names == ["0", "1", "2"] and prof.meta["materialized"] == "layer-at-a-time"
    assert [x.param_bytes for x in prof.layers] == [272 * 4, 0, 272 * 4]
    assert wl.model is None  # the caller's workload is untouched


class _LoopedNet(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Looped(width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_stage_that_calls_a_module_three_times_gets_its_one_parameter(tmp_path: Path) -> None:
    """An exported piece names the second and third calls of ``blocks.1.lin`` ``blocks.1.lin@1`` and
    ``blocks.1.lin@2``; each is the model's ``blocks.1.lin`` (initialised by FQN, or read from a checkpoint),
    one tensor: giving them real tensors had raised KeyError 'blocks.1.lin@1.weight'."""
    from stageplan.materialize import model_fqn

    torch.manual_seed(0)
    real = _LoopedNet()
    x = torch.randn(4, 8)
    save_checkpoint(real, tmp_path / "w.safetensors")
    assert model_fqn(real, "blocks.1.lin@2.weight") == "blocks.1.lin.weight"
    assert model_fqn(real, "blocks.1.lin.bias") == "blocks.1.lin.bias"
    for weights in (None, Checkpoint(tmp_path / "w.safetensors")):
        meta = meta_copy(real)
        cut = cut_stages(meta, (x,), ["blocks.0", "blocks.1", "blocks.2"], (0, 1, 3))
        stage = cut.pieces[1].module
        names = meta_parameter_names(stage)
        assert {"blocks.1.lin@1.weight", "blocks.1.lin@2.bias"} <= set(names)
        tensors = real_parameters(meta, names, "cpu", weights=weights)
        assert tensors["blocks.1.lin@1.weight"] is tensors["blocks.1.lin.weight"]  # one tensor, not three
        materialize_(stage, tensors)
        assert not meta_parameter_names(stage)
        # the oracle: the whole model, initialised by FQN as every rank does, or the checkpoint's own model
        ref = real if weights is not None else reference_model(meta, torch.device("cpu"))
        assert len({id(p) for p in stage.parameters()}) == 4  # blocks.1.lin and blocks.2.lin, weight and bias
        with torch.no_grad():
            hidden = ref.blocks[0](x)
            torch.testing.assert_close(stage(hidden), ref.blocks[2](ref.blocks[1](hidden)))
