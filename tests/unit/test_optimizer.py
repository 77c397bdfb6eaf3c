"""stageplan.profiling.optimizer: each layer's optimizer step timed on its own parameters and the gradient its
backward made, reused for identical layers, and priced by bytes moved in an estimate."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from stageplan import Profile, Workload, profile_model
from stageplan.profiling.optimizer import OPTIMIZER_PASSES


def _sum_loss(out: torch.Tensor, target: object) -> torch.Tensor:
    return out.sum()


def _big_linear_profile() -> tuple[Profile, nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU())
    before = [p.detach().clone() for p in model.parameters()]
    prof = profile_model(Workload(model, torch.randn(4, 1024), loss_fn=_sum_loss), microbatch_size=4,
                         warmup=1, repeats=5, streaming=False)
    return prof, model, before


def test_profiler_times_every_optimizer_per_layer_and_leaves_the_model_alone() -> None:
    prof, model, before = _big_linear_profile()
    lin, relu = prof.layers
    assert lin.optimizer_s is not None and set(lin.optimizer_s) == {"sgd", "momentum", "adam", "adamw"}
    assert all(t > 0 for t in lin.optimizer_s.values())
    assert relu.optimizer_s == {"sgd": 0.0, "momentum": 0.0, "adam": 0.0, "adamw": 0.0}  # no parameters
    assert all(p.grad is None and torch.equal(p, q) for p, q in zip(model.parameters(), before))
    floors = prof.meta["optimizer_step"]["floor_s"]  # one step's fixed cost, timed on a single tiny parameter
    assert set(floors) == {"sgd", "momentum", "adam", "adamw"} and all(t > 0 for t in floors.values())


@pytest.mark.timing
def test_profiler_times_adam_above_sgd_and_a_big_layer_above_the_floor() -> None:
    """Speed ratios: Adam reads and writes two more states than SGD, and a 1M-parameter layer's step costs
    more than one step's fixed cost (timed on a single tiny parameter); a busy machine can swap two
    medians."""
    prof, _, _ = _big_linear_profile()
    lin = prof.layers[0]
    assert lin.optimizer_s is not None and 0 < lin.optimizer_s["sgd"] < lin.optimizer_s["adam"]
    floors = prof.meta["optimizer_step"]["floor_s"]
    assert all(0 < floors[k] < lin.optimizer_s[k] for k in floors)


class _Detached(nn.Module):
    """A linear layer plus a parameter its backward never
    reaches (used detached): that parameter gets no gradient."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 3)
        self.offset = nn.Parameter(torch.zeros(1, 1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.offset.detach()


@pytest.mark.parametrize(("streaming", "sparse"), [(False, False), (True, False), (False, True)])
def test_each_layers_step_is_timed_on_the_gradient_its_own_backward_made(
    monkeypatch: pytest.MonkeyPatch, streaming: bool, sparse: bool
) -> None:
    """An embedding's gradient is zero on the rows its batch does not use, and a CPU Adam step over those
    zeros costs twice one over ones (torch's sqrt of 0): so the profiler steps the layer's own gradient.
    Oracle: with the output's gradient all ones, row r of the table's gradient is (times r occurs in the
    batch) x ones; a sparse table's gradient is stepped as its dense equal (torch's dense optimizers refuse
    sparse ones); a parameter the backward does not reach is not stepped, as torch's optimizers skip a None
    gradient."""
    from stageplan.profiling import optimizer as profiler

    seen: list[list[torch.Tensor]] = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[no-untyped-def,override]
            seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
            return super().step(closure)

    monkeypatch.setattr(profiler, "_OPTIMIZERS",
                        {**profiler._OPTIMIZERS, "sgd": lambda ps: Recording(ps, lr=1e-3)})
    torch.manual_seed(0)
    vocab, dim = 64, 4
    model = nn.Sequential(nn.Embedding(vocab, dim, sparse=sparse), _Detached(dim))
    idx = torch.randint(0, vocab // 4, (4, 6))  # rows 16..63 unused: their gradient is 0
    profile_model(Workload(model, idx, loss_fn=_sum_loss), microbatch_size=4, warmup=0, repeats=2,
                  streaming=streaming)
    table = [g for grads in seen for g in grads if g.shape == (vocab, dim)]
    assert table, "the embedding's step was not timed"
    expected = torch.bincount(idx.flatten(), minlength=vocab).float()[:, None].expand(vocab, dim)
    for g in table:
        torch.testing.assert_close(g, expected)
    # the last layer: the loss's own gradient
    head = [g for grads in seen for g in grads if g.shape == (3, dim)]
    expected_head = torch.ones(3, 1) * model[0](idx).detach().sum(dim=(0, 1))[None, :]
    assert head
    for g in head:
        torch.testing.assert_close(g, expected_head)
    # the detached parameter: never stepped
    assert not [g for grads in seen for g in grads if g.shape == (1, 1, 3)]


def test_identical_layers_reuse_the_measured_optimizer_step() -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])  # 1..4 alike: 3 and 4 reuse 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the spread of two tiny layers on a shared machine
        prof = profile_model(Workload(model, torch.randn(4, 64), loss_fn=_sum_loss), microbatch_size=4,
                             warmup=0, repeats=2, streaming=True)
    rows = {x.name: x for x in prof.layers}
    assert any(x.measured_as is not None for x in prof.layers)
    for x in prof.layers:
        assert x.optimizer_s is not None
        if x.measured_as is not None:
            assert x.optimizer_s == rows[x.measured_as].optimizer_s


def test_estimate_prices_the_optimizer_step_by_bytes_moved() -> None:
    from stageplan.profiling.estimate import gpu_spec

    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    prof = profile_model(Workload(model, torch.randn(4, 256), loss_fn=_sum_loss), microbatch_size=4,
                         device="estimate:h100-sxm")
    rate = 0.7 * gpu_spec("h100-sxm").memory_bandwidth  # the default eta_m
    for x in prof.layers:
        assert x.optimizer_s == pytest.approx(
            {k: n * x.param_bytes / rate for k, n in OPTIMIZER_PASSES.items()})


class _LinearCostTimer:
    """A timer whose step costs exactly 1 ms + 2 us per tensor + 1 ns per element stepped (the step's own
    optimizer says which tensors), recording the largest number of elements any step copied."""

    def __init__(self) -> None:
        self.largest = 0

    def __call__(self, fn):  # type: ignore[no-untyped-def]
        tensors = [p for group in fn.__self__.param_groups for p in group["params"]]
        elements = sum(p.numel() for p in tensors)
        self.largest = max(self.largest, elements)
        return 1e-3 + 2e-6 * len(tensors) + 1e-9 * elements, fn()


def test_a_large_layers_step_is_timed_on_strided_samples_and_extrapolated_by_element_count() -> None:
    """Oracle: a step that costs a fixed part plus a part per element (the linear timer above) extrapolates
    exactly from two samples to the whole layer; no step copies more than the slice's elements (plus one per
    tensor, the ceiling of each stride), and a gradient's zero rows keep their share in the sample."""
    from stageplan.profiling.optimizer import optimizer_times

    weight, bias = nn.Parameter(torch.randn(1000, 70)), nn.Parameter(torch.randn(70))
    grad = torch.zeros(1000, 70)
    grad[::4] = 1.0  # a quarter of the rows used, as an embedding's batch leaves most rows zero
    timer = _LinearCostTimer()
    got = optimizer_times([weight, bias], timer, 3, [grad, torch.ones(70)], slice_elements=4096)
    want = 1e-3 + 2e-6 * 2 + 1e-9 * (70_000 + 70)
    assert got == pytest.approx(dict.fromkeys(["sgd", "momentum", "adam", "adamw"], want), rel=1e-9)
    assert 2048 < timer.largest <= 4096 + 2
    assert weight.grad is None and bias.grad is None  # the layer itself untouched
    seen: list[torch.Tensor] = []

    class Recording(_LinearCostTimer):
        def __call__(self, fn):  # type: ignore[no-untyped-def]
            seen.extend(p.grad.clone() for group in fn.__self__.param_groups for p in group["params"][:1])
            return super().__call__(fn)

    optimizer_times([weight], Recording(), 1, [grad], slice_elements=4096)
    share = [float((g != 0).float().mean()) for g in seen]
    assert all(abs(x - 0.25) < 0.05 for x in share), share


def test_a_layer_within_the_slice_is_stepped_whole() -> None:
    from stageplan.profiling.optimizer import optimizer_times

    weight = nn.Parameter(torch.randn(64, 64))
    timer = _LinearCostTimer()
    got = optimizer_times([weight], timer, 3, [torch.ones(64, 64)], slice_elements=4096)
    assert timer.largest == 4096
    assert got == pytest.approx(dict.fromkeys(["sgd", "momentum", "adam", "adamw"], 1e-3 + 2e-6 + 4.096e-6),
                                rel=1e-12)


def test_a_layer_up_to_four_slices_is_stepped_whole() -> None:
    """Sampling only pays above 4 slices: a layer of 3 slices' elements is stepped whole (one copy of all of
    it), where two samples of other sizes had left more of the heap resident."""
    from stageplan.profiling.optimizer import optimizer_times

    weight = nn.Parameter(torch.randn(96, 128))  # 12,288 elements: 3 slices of 4096
    timer = _LinearCostTimer()
    optimizer_times([weight], timer, 3, [torch.ones(96, 128)], slice_elements=4096)
    assert timer.largest == 96 * 128
