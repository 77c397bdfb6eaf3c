"""The executor's per-layer clock against layers of known cost: modules that sleep a known time in their forward
and, through a custom autograd function, in their backward. Sleeps are long (tens of ms) against the hooks'
microseconds, so the attribution, not the machine's speed, is what is checked."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from workloads import Sleeper, _SleepGrad

from stageplan.measure import LayerClock, _fill_gaps

FWD = [0.02, 0.05, 0.03]
BWD = [0.04, 0.02, 0.06]
SLACK = 0.015  # hooks, the multiply and the sleep's own overshoot


def _run(clock: LayerClock, model: nn.Module, x: torch.Tensor, glue_s: float = 0.0) -> None:
    with clock.phase("F", 0):
        time.sleep(glue_s)  # time outside every layer: the chunk's overhead
        out = model(x)
    with clock.phase("B", 0):
        out.sum().backward()


@pytest.mark.parametrize("input_grad", [True, False], ids=["input-needs-grad", "first-layer-of-the-model"])
def test_each_layer_gets_its_own_sleep_and_the_rest_is_overhead(input_grad: bool) -> None:
    model = nn.Sequential(*[Sleeper(f, b) for f, b in zip(FWD, BWD)])
    clock = LayerClock("cpu")
    for k, layer in enumerate(model):
        clock.attach(k, layer, list(layer.parameters()))
    clock.enabled = True
    _run(clock, model, torch.ones(4, requires_grad=input_grad), glue_s=0.03)
    phases = clock.drain(lambda s: range(3))
    (kf, _, fwd, over_f), (kb, _, bwd, over_b) = phases
    assert (kf, kb) == ("F", "B")
    for k in range(3):
        assert FWD[k] <= fwd[k] < FWD[k] + SLACK, (k, fwd)
        assert BWD[k] <= bwd[k] < BWD[k] + SLACK, (k, bwd)
    assert 0.03 <= over_f < 0.03 + SLACK  # the glue sleep, outside every layer
    assert 0.0 <= over_b < SLACK


def test_a_layer_without_a_module_gets_the_span_its_neighbours_leave() -> None:
    model = nn.Sequential(*[Sleeper(f, b) for f, b in zip(FWD, BWD)])
    clock = LayerClock("cpu")
    clock.attach(1, model[1], list(model[1].parameters()))  # layers 0 and 2 are code around the one module
    clock.enabled = True
    _run(clock, model, torch.ones(4, requires_grad=True))
    (_, _, fwd, over_f), (_, _, bwd, _) = clock.drain(lambda s: range(3))
    for k in range(3):
        assert FWD[k] <= fwd[k] < FWD[k] + SLACK, (k, fwd)
        assert BWD[k] <= bwd[k] < BWD[k] + SLACK, (k, bwd)
    assert over_f < 1e-9  # nothing is left outside a layer when the end layers take the edges


def test_disabled_clock_records_nothing_holds_no_hooks_and_a_loss_phase_is_the_last_layers() -> None:
    model = nn.Sequential(Sleeper(0.0, 0.0))
    clock = LayerClock("cpu")
    clock.attach(0, model[0], list(model[0].parameters()))
    _run(clock, model, torch.ones(4, requires_grad=True))
    assert clock.drain(lambda s: [0]) == []
    # hooks exist only while enabled: the measured steps run without them
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks
    clock.enabled = True
    assert len(model[0]._forward_pre_hooks) == len(model[0]._forward_hooks) == 1
    clock.enabled = False
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks
    assert not model[0].w._post_accumulate_grad_hooks
    clock.enabled = True
    with clock.phase("L", 0):
        time.sleep(0.02)
    [(kind, stage, times, rest)] = clock.drain(lambda s: [5, 6])
    assert (kind, stage, list(times), rest) == ("L", 0, [6], 0.0) and 0.02 <= times[6] < 0.02 + SLACK


def test_gaps_are_shared_between_stamped_neighbours_and_spans_never_overlap() -> None:
    # layers 0..4 in execution order; 1 and 2 unstamped between 0 (ends at 1.0) and 3 (starts at 4.0)
    times = _fill_gaps([0, 1, 2, 3, 4], {0: (0.5, 1.0), 3: (4.0, 5.0)}, 6.0)
    assert times == pytest.approx({0: 0.5, 1: 1.5, 2: 1.5, 3: 1.0, 4: 1.0})
    assert _fill_gaps([0, 1], {}, 2.0) == pytest.approx({0: 1.0, 1: 1.0})
    # a span that starts before its predecessor ended is clamped to start there
    assert _fill_gaps([0, 1], {0: (0.0, 2.0), 1: (1.0, 3.0)}, 3.0) == pytest.approx({0: 2.0, 1: 1.0})


class _Pair(nn.Module):
    """A layer with its own input and a memory shared with the other layers (as a decoder's cross-attention)."""

    def __init__(self, backward_s: float) -> None:
        super().__init__()
        self.backward_s = backward_s

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return _SleepGrad.apply(x + memory, self.backward_s)


def test_an_input_shared_with_later_layers_does_not_stretch_a_backward() -> None:
    layers = [_Pair(b) for b in BWD]
    clock = LayerClock("cpu")
    for k, layer in enumerate(layers):
        clock.attach(k, layer)
    clock.enabled = True
    memory = torch.ones(4, requires_grad=True)
    with clock.phase("F", 0):
        x = torch.ones(4, requires_grad=True)
        for layer in layers:
            x = layer(x, memory)
    with clock.phase("B", 0):
        x.sum().backward()
    (_, _, _, _), (_, _, bwd, _) = clock.drain(lambda s: range(3))
    for k in range(3):
        assert BWD[k] <= bwd[k] < BWD[k] + SLACK, (k, bwd)


def test_the_step_hooks_on_a_persistent_tensor_are_removed_at_drain() -> None:
    model = nn.Sequential(Sleeper(0.0, 0.0))
    clock = LayerClock("cpu")
    clock.attach(0, model[0])
    clock.enabled = True
    buffer = torch.ones(4, requires_grad=True)  # as a PipelineStage's receive buffer, reused every step
    for _ in range(3):
        _run(clock, model, buffer)
        clock.drain(lambda s: [0])
    assert not buffer._backward_hooks
