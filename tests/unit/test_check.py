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
