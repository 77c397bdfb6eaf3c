"""Cut-and-chain equals the whole model; stage cuts equal it too."""

from __future__ import annotations

import pytest
import torch

from stageplan.layers import cut_layers, cut_stages, resolve_layer_names
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


def test_hf_skip_tensors_cross_every_boundary() -> None:
    wl = hf_gpt2(n_layer=2)
    cut = cut_layers(wl.model, (wl.inputs[:2],))
    # HF GPT-2 hands a mask-like tensor from the embedding piece to every block: a skip connection.
    assert len(cut.crossing_refs(1)) == 2
