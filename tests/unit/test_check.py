"""stageplan.running.check: the single-process reference a run is compared with; it fails on a wrong result
and says why when dropout makes the two differ."""

from __future__ import annotations

import torch
from torch import nn

from stageplan.zoo import build_workload


def test_a_failed_check_with_dropout_says_why() -> None:
    from stageplan.running.check import compare_with_single_process
    from stageplan.workload import Workload

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    wl = Workload(model, torch.randn(4, 8), torch.randn(4, 8), nn.functional.mse_loss)
    params = {k: v.detach().clone() + 1.0 for k, v in model.named_parameters()}
    result = compare_with_single_process(wl, model, [{"losses": [0.0], "params": params}],
                                         {"optimizer": "sgd", "lr": 0.1, "warmup": 0, "steps": 1}, 2)
    assert not result["passed"]
    assert "dropout (1 (p=0.5))" in result["hint"] and "set dropout to 0" in result["hint"]


def test_check_detects_a_wrong_result() -> None:
    """The comparator is not vacuous: a one-ulp-free perturbation of one parameter fails the check."""
    from stageplan.running.check import compare_with_single_process as _check

    wl = build_workload("workloads:mlp", {})
    reference = __import__("copy").deepcopy(wl.model)
    options = {"optimizer": "sgd", "lr": 0.05, "warmup": 0, "steps": 1}
    # what a correct pipeline would have gathered: run the same training on a copy
    twin = __import__("copy").deepcopy(wl.model)
    opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    losses = []
    opt.zero_grad()
    total = 0.0
    for i in range(2):
        loss = wl.compute_loss(twin(wl.inputs[i * 4:(i + 1) * 4]), wl.target[i * 4:(i + 1) * 4])
        (loss / 2).backward()
        total += float(loss.detach())
    opt.step()
    losses.append(total / 2)
    params = {k: v.detach().clone() for k, v in twin.named_parameters()}
    good = _check(wl, __import__("copy").deepcopy(reference), [{"losses": losses, "params": params}], options,
                  2)
    assert good["passed"], good
    params["2.weight"] += 1e-2
    bad = _check(wl, __import__("copy").deepcopy(reference), [{"losses": losses, "params": params}], options,
                 2)
    assert not bad["passed"] and bad["worst_param"] == "2.weight"


def test_check_compares_the_last_steps_gradients_by_fqn_and_fails_a_summed_one() -> None:
    """Adam all but hides a gradient that replicas summed instead of averaging (2x): it divides each gradient
    by its own running size, so the parameters land within the check's tolerance. The gradients, gathered
    from the ranks, are compared on their own: the reference's last step's, taken before its update, is the
    oracle, and a 2x gradient fails and is named."""
    import copy

    from stageplan.running.check import compare_with_single_process as _check

    wl = build_workload("workloads:mlp", {})
    options = {"optimizer": "adam", "lr": 1e-3, "warmup": 0, "steps": 1}
    twin = copy.deepcopy(wl.model)
    opt = torch.optim.Adam(twin.parameters(), lr=1e-3)
    total = 0.0
    for i in range(2):
        loss = wl.compute_loss(twin(wl.inputs[i * 4:(i + 1) * 4]), wl.target[i * 4:(i + 1) * 4])
        (loss / 2).backward()
        total += float(loss.detach())
    grads = {k: v.grad.detach().clone() for k, v in twin.named_parameters()}
    opt.step()
    params = {k: v.detach().clone() for k, v in twin.named_parameters()}
    rank = {"losses": [total / 2], "params": params, "grads": grads}
    good = _check(wl, copy.deepcopy(wl.model), [rank], options, 2)
    assert good["passed"] and good["grads_compared"] == len(params), good
    assert good["max_grad_diff"] <= 1e-6
    summed = {**grads, "2.weight": 2 * grads["2.weight"]}
    # what Adam's first step does with it: the same update, to rounding (m / sqrt(v) is the sign of g)
    twin2 = copy.deepcopy(wl.model)
    for p, g in zip(twin2.parameters(), summed.values()):
        p.grad = g.clone()
    torch.optim.Adam(twin2.parameters(), lr=1e-3).step()
    stepped = {k: v.detach().clone() for k, v in twin2.named_parameters()}
    assert max(float((stepped[k] - params[k]).abs().max()) for k in params) < 1e-5
    bad = _check(wl, copy.deepcopy(wl.model), [{**rank, "params": stepped, "grads": summed}], options, 2)
    assert not bad["passed"] and bad["worst_grad"] == "2.weight", bad
    assert bad["max_param_diff"] < 1e-5  # the parameters alone would have passed
    lost = _check(wl, copy.deepcopy(wl.model), [{**rank, "grads": {**grads, "2.weight": None}}], options, 2)
    assert not lost["passed"] and lost["grads_missing"] == ["2.weight"]
