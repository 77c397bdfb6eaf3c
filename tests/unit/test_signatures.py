"""stageplan.profiling.signatures: layers are measured apart when an attribute or the wiring differs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stageplan import Workload, profile_model


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


@pytest.mark.parametrize("last", [_Act(lambda x: x), _Act(torch.tanh, loop_num=4)],
                         ids=["lambda", "loop_num"])
def test_dedup_measures_apart_what_an_attribute_changes(last: nn.Module) -> None:
    """Blocks that differ only in a function attribute (torch.tanh against a lambda: saves 256 B, not 512), or
    in an attribute named like a layer index but used as a count (loop_num), were taken as one layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _Act(torch.tanh), _Act(torch.tanh), _Act(torch.tanh), last,
                          nn.Linear(16, 16))
    wl = Workload(model, torch.randn(4, 16), loss_fn=_sum_loss)
    every = profile_model(wl, microbatch_size=4, warmup=0, repeats=1, dedup=False, order="layer")
    dedup = profile_model(wl, microbatch_size=4, warmup=0, repeats=1, order="layer")
    assert dedup.layers[3].measured_as == "2"  # the identical ones are still measured once
    assert dedup.layers[4].measured_as is None
    assert (
        dedup.layers[4].activation_bytes
        == every.layers[4].activation_bytes
        != every.layers[3].activation_bytes
    )


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
