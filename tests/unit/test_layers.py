"""Cut-and-chain equals the whole model; stage cuts equal it too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stageplan.errors import WorkloadError
from stageplan.layers import cut_layers, cut_stages, resolve_layer_names, used_parameters
from stageplan.zoo import convnet, gpt, hf_gpt2


@pytest.mark.parametrize("factory", [lambda: gpt(n_layer=3, tied=True), convnet, lambda: hf_gpt2(n_layer=2)],
                         ids=["gpt", "convnet", "hf-gpt2"])
def test_cut_layers_chain_equals_whole_model(factory) -> None:  # type: ignore[no-untyped-def]
    wl = factory()
    args = tuple(a[:2] for a in wl.input_tuple())
    cut = cut_layers(wl.model, args)
    with torch.no_grad():
        ref = wl.model(*args)
        torch.testing.assert_close(cut.run(args), ref)
        last = len(cut.names)
        for bounds in [(0, 1, last), (0, last - 1, last), (0, 1, 2, last)]:
            stages = cut_stages(wl.model, args, cut.names, bounds)
            assert len(stages.pieces) == len(bounds) - 1
            torch.testing.assert_close(stages.run(args), ref)


def test_default_layers_are_embedding_blocks_and_head() -> None:
    wl = gpt(n_layer=2)
    cut = cut_layers(wl.model, (wl.inputs[:2],))
    assert cut.names == ["tok_emb+pos_emb", "blocks.0", "blocks.1", "ln_f+head"]
    assert cut.method == "export"
    conv = convnet()
    assert cut_layers(conv.model, (conv.inputs[:2],)).names == [str(i) for i in range(10)]


def test_glob_patterns_expand_in_model_order() -> None:
    wl = gpt(n_layer=3)
    assert resolve_layer_names(wl.model, ["blocks.*"]) == ["blocks.0", "blocks.1", "blocks.2"]
    assert resolve_layer_names(wl.model, ["blocks.2", "blocks.0"]) == ["blocks.0", "blocks.2"]
    cut = cut_layers(wl.model, (wl.inputs[:2],), ["blocks.1"])
    assert cut.names == ["tok_emb+pos_emb+blocks.0", "blocks.1", "blocks.2+ln_f+head"]
    with torch.no_grad():
        torch.testing.assert_close(cut.run((wl.inputs[:2],)), wl.model(wl.inputs[:2]))


class _GateEveryBlock(nn.Module):
    """Code before the blocks makes a second tensor (a gate) that every block reads: a skip connection."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            return x + self.lin(x) * gate

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(self.Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        gate = torch.sigmoid(h.mean(-1, keepdim=True))
        for block in self.blocks:
            h = block(h, gate)
        return h


def test_skip_tensors_cross_every_boundary() -> None:
    torch.manual_seed(0)
    model, x = _GateEveryBlock(), torch.randn(2, 5, 4)
    cut = cut_layers(model, (x,))
    assert cut.names == ["emb", "blocks.0", "blocks.1", "blocks.2"]
    # the gate, made before the blocks, crosses every boundary beside the hidden states
    assert [len(cut.crossing_refs(k)) for k in range(3)] == [2, 2, 2]
    with torch.no_grad():
        torch.testing.assert_close(cut.run((x,)), model(x))


class _SequentialTrunk(nn.Module):
    """An MLP whose blocks live in a child nn.Sequential (no ModuleList anywhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


class _WrappedTrunk(nn.Module):
    """A child nn.Sequential with code around it, a skip connection over it, and small Sequentials inside its
    blocks (which must not be taken for the trunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        block = lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.LayerNorm(8))  # noqa: E731
        self.body = nn.Sequential(block(), block(), block())
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x)) * 2
        y = self.body(h)
        return self.head(self.norm(y + h)).softmax(-1)


def test_layers_in_a_child_sequential_are_found() -> None:
    torch.manual_seed(0)
    model, x = _SequentialTrunk(), torch.randn(4, 6)
    assert resolve_layer_names(model, None) == [f"layers.{i}" for i in range(5)]
    cut = cut_layers(model, (x,))
    assert cut.names == ["layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "head"]
    assert cut.named == [f"layers.{i}" for i in range(5)]
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(cut.run((x,)), ref)
        for bounds in [(0, 2, 6), (0, 5, 6), (0, 1, 3, 6)]:
            torch.testing.assert_close(cut_stages(model, (x,), cut.names, bounds).run((x,)), ref)


def test_a_child_sequential_wrapped_by_other_code() -> None:
    torch.manual_seed(0)
    model, x = _WrappedTrunk(), torch.randn(4, 6)
    assert resolve_layer_names(model, None) == ["body.0", "body.1", "body.2"]
    cut = cut_layers(model, (x,))
    assert cut.names == ["stem", "body.0", "body.1", "body.2", "norm+head"]
    assert len(cut.crossing_refs(2)) == 2  # the skip connection over the trunk crosses every boundary in it
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(cut.run((x,)), ref)
        for bounds in [(0, 1, 5), (0, 2, 4, 5), (0, 4, 5)]:
            torch.testing.assert_close(cut_stages(model, (x,), cut.names, bounds).run((x,)), ref)


def test_a_model_without_containers_is_refused_with_the_remedy() -> None:
    model = nn.Module()
    model.fc = nn.Linear(2, 2)
    with pytest.raises(WorkloadError, match=r"cannot find layers in Module: .*no nn\.ModuleList and no child "
                                            r"nn\.Sequential; name the layers explicitly"):
        resolve_layer_names(model, None)


class _LeadingActivation(nn.Module):
    """The first block has no parameters (an activation), and a head runs after the trunk."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


@pytest.mark.parametrize("layers", [None, ["layers.*"]], ids=["found", "named"])
def test_a_parameter_free_first_layer_keeps_its_name(layers: list[str] | None) -> None:
    # Whether the extra piece runs before or after the trunk was judged by parameters alone: a leading
    # Flatten made the head piece 'layers.3' and the first piece 'pre'.
    torch.manual_seed(0)
    model, x = _LeadingActivation(), torch.randn(4, 2, 3)
    cut = cut_layers(model, (x,), layers)
    assert cut.names == ["layers.0", "layers.1", "layers.2", "layers.3", "head"]
    owners = [sorted({k.rsplit(".", 1)[0] for k in used_parameters(p.module)}) for p in cut.pieces]
    assert owners == [[], ["layers.1"], [], ["layers.3"], ["head"]]
    with torch.no_grad():
        torch.testing.assert_close(cut.run((x,)), model(x))
