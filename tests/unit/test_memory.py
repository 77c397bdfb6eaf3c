"""stageplan.profiling.memory: what profiling the whole model at once would hold, counted on fake tensors
without data, against hand-counted bytes."""

from __future__ import annotations

import torch
from torch import nn

from stageplan.profiling.memory import whole_model_bytes


class _DataDependent(nn.Module):
    """Keeps as many rows as its input's sign says: a shape
    that depends on values, so no fake tensor can run it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[: int(x.sum() > 0) + 1] * 2


def test_the_whole_model_holds_its_parameters_twice_and_its_saved_activations() -> None:
    # Linear(16, 32) -> ReLU -> Linear(32, 8) on a batch of 4: parameters (16*32 + 32 + 32*8 + 8) x 4 B = 3232
    # B, held with their gradients; saved for backward: the input (4*16*4 = 256 B) and the ReLU's output,
    # which the second Linear saves as its input, once (4*32*4 = 512 B)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    assert whole_model_bytes(model, (x,)) == (2 * 3232 + 768, 768)
    assert whole_model_bytes(model, (x,), "bfloat16") == ((2 * 3232 + 768) // 2, 768 // 2)  # 2-byte elements
    # a copy was counted
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())


def test_a_model_that_cannot_run_without_data_is_counted_by_its_parameters_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 4), _DataDependent())
    assert whole_model_bytes(model, (torch.randn(3, 4),)) == (2 * (16 + 4) * 4, None)
