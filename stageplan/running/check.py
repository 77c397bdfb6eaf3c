"""The single-process reference: train the uncut model
the same way and compare losses and gradients (torch)."""

from __future__ import annotations

from typing import Any

from torch import nn

from stageplan.measure import microbatch
from stageplan.running.stages import batch_target, make_optimizer
from stageplan.workload import Workload


def compare_with_single_process(workload: Workload, reference: nn.Module, gathered: list[Any],
                                options: dict[str, Any], num_microbatches: int) -> dict[str, Any]:
    """Train the uncut model on one process: same data, same initial weights, the same microbatches with
    gradient accumulation (with d replicas, the whole global batch as d x m microbatches:
    ``num_microbatches`` is d x m); compare each step's loss (the mean of the replicas' losses), every
    parameter by FQN at the end, and every parameter's gradient by FQN in the last step, every replica's
    (``grads``, where the ranks sent them). The gradients are compared apart from the parameters because an
    update can hide a wrong gradient: Adam divides each gradient by its own running size, so replicas that
    summed their gradients instead of averaging them would step the parameters almost as one process does.
    """
    m = num_microbatches
    optimizer = make_optimizer(options["optimizer"], list(reference.parameters()), float(options["lr"]))
    inputs = workload.input_tuple()
    target = batch_target(workload)
    mb = workload.batch_size // m
    dev = next(reference.parameters()).device
    ref_losses: list[float] = []
    ref_grads: dict[str, Any] = {}
    steps = int(options["warmup"]) + int(options["steps"]) + int(options.get("clock_steps", 0))
    for step in range(steps):
        for p in reference.parameters():
            p.grad = None
        total = 0.0
        for i in range(m):
            args = tuple(a.to(dev) if hasattr(a, "to") else a for a in microbatch(inputs, i, mb))
            tgt = microbatch(target, i, mb).to(dev) if workload.target is not None else None
            loss = workload.compute_loss(reference(*args), tgt)
            (loss / m).backward()
            total += float(loss.detach())
        if step == steps - 1:  # the last step's gradients, before its update (a tie's one under each name)
            ref_grads = {name: p.grad.detach().cpu().clone() for name, p
                         in reference.named_parameters(remove_duplicate=False) if p.grad is not None}
        if optimizer is not None:
            optimizer.step()
        ref_losses.append(total / m)
    last = [g["losses"] for g in gathered if g["losses"]]
    pipe_losses = [sum(x) / len(x) for x in zip(*last)]
    loss_diff = max((abs(a - b) for a, b in zip(pipe_losses, ref_losses)), default=0.0)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    worst_name, worst = "", 0.0
    compared = 0
    missing = []
    for g in gathered:
        for name, value in g["params"].items():
            if name not in ref_params:
                missing.append(name)
                continue
            diff = float((value - ref_params[name].detach().cpu()).abs().max())
            compared += 1
            if diff > worst:
                worst_name, worst = name, diff
    uncovered = sorted(set(ref_params) - {n for g in gathered for n in g["params"]})
    rtol, atol = 1e-4, 1e-5
    scale = max((float(p.detach().abs().max()) for p in ref_params.values()), default=1.0)
    grad_name, grad_worst, grads_compared, grads_missing = _compare_grads(gathered, ref_grads)
    # the gradients' own scale: they are orders of magnitude below the weights, so the parameters' absolute
    # floor would pass a gradient twice its size
    grad_scale = max((float(g.abs().max()) for g in ref_grads.values()), default=0.0)
    grads_ok = not grads_missing and grad_worst <= rtol * grad_scale + 1e-9
    passed = (not missing and not uncovered and loss_diff <= atol + rtol * max(abs(x) for x in ref_losses)
              and worst <= atol + rtol * scale and grads_ok)
    dropout = sorted({f"{name} (p={m.p})" for name, m in reference.named_modules()
                      if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0})
    hint = None
    losses_agree = loss_diff <= atol + rtol * max(abs(x) for x in ref_losses)
    if not passed and losses_agree and not missing and not uncovered \
            and options["optimizer"] in ("adam", "adamw"):
        hint = (f"the losses agree and the parameters differ (most at {worst_name}): Adam divides each "
                "gradient by its own running size, so a gradient that is only rounding noise (a bias before "
                "a BatchNorm has none) moves by the learning rate whatever its sign, and replicas or another "
                "split round it differently; rerun --check with --optimizer sgd")
    if not passed and dropout:
        hint = (f"the model has dropout ({', '.join(dropout[:3])}{', ...' if len(dropout) > 3 else ''}): the "
                "pipeline's ranks and the single-process reference draw different random numbers, so results "
                "differ; set dropout to 0 (e.g. --set dropout=0) for --check")
    return {"passed": bool(passed), "hint": hint, "max_loss_diff": loss_diff, "max_param_diff": worst,
            "worst_param": worst_name, "max_grad_diff": grad_worst if grads_compared else None,
            "worst_grad": grad_name or None, "grads_compared": grads_compared,
            "grads_missing": grads_missing,
            "params_compared": compared, "missing_in_reference": missing,
            "not_trained_by_pipeline": uncovered, "reference_losses": ref_losses, "rtol": rtol, "atol": atol}


def _compare_grads(gathered: list[Any], ref_grads: dict[str, Any]) -> tuple[str, float, int, list[str]]:
    """(the worst gradient's FQN, its largest absolute difference, gradients compared, FQNs whose gradient
    one side has and the other lacks) over every rank's ``grads`` against the reference's last step's."""
    worst_name, worst, compared, missing = "", 0.0, 0, []
    for g in gathered:
        grads = g.get("grads")
        if grads is None:  # a rank that sent no gradients (a run without --check sends none)
            continue
        for name in g["params"]:
            mine, ref = grads.get(name), ref_grads.get(name)
            if mine is None and ref is None:
                continue  # a parameter no loss reaches, on both sides
            if mine is None or ref is None:
                missing.append(name)
                continue
            diff = float((mine - ref).abs().max())
            compared += 1
            if diff > worst:
                worst_name, worst = name, diff
    return worst_name, worst, compared, sorted(set(missing))
