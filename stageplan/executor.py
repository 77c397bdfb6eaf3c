"""Train with a Plan across processes on torch.distributed.pipelining, check it, measure it -> RunReport.

Local runs: this module spawns one process per pipeline rank on localhost (gloo on CPU with one intra-op
thread each, NCCL on CUDA with one GPU per rank) and watches them: if any rank fails or is killed, every
rank is ended at once and the failure is reported with the rank and its log. Under torchrun each process
runs :func:`worker_main` itself, taking rank and world size from the environment.

The executor takes a Plan and nothing else from the planning side (it never imports solver, costmodel or api).
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import io
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stageplan.errors import RunError, StageplanError, WorkloadError
from stageplan.layers import cut_layers, cut_stages, used_parameters
from stageplan.plan import Plan
from stageplan.runreport import RunReport
from stageplan.schedules import check_microbatches
from stageplan.workload import Workload

OPTIMIZERS = ("sgd", "adamw")
DEFAULT_LR = {"sgd": 0.05, "adamw": 1e-3}


# --------------------------------------------------------------------------------------------------
# Validation before any process starts


def _load_plan(plan: Plan | str | os.PathLike[str]) -> Plan:
    return plan if isinstance(plan, Plan) else Plan.load(plan)


def _microbatch_args(workload: Workload, m: int) -> tuple[Any, ...]:
    batch = workload.batch_size
    if batch % m:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        raise StageplanError(
            f"the batch of {batch} does not divide into the plan's {m} microbatches (torch would fail deep inside the "
            f"loss and the other ranks would hang); use a batch that is a multiple of {m}, or plan with one of {divisors} microbatches"
        )
    mb = batch // m
    return tuple(a[:mb] if isinstance(a, torch.Tensor) else a for a in workload.input_tuple())


def validate(workload: Workload, plan: Plan, *, world_size: int | None = None) -> None:
    """Refuse, before spawning anything, what would otherwise fail deep inside torch or hang a rank."""
    if world_size is not None and world_size != plan.num_ranks:
        raise StageplanError(
            f"world size {world_size} does not match the plan's {plan.num_ranks} pipeline ranks; "
            f"launch {plan.num_ranks} processes (torchrun --nproc-per-node {plan.num_ranks}) or re-plan with --stages {world_size}"
        )
    check_microbatches(plan.schedule, plan.num_ranks, plan.num_microbatches, plan.virtual_stages)
    args = _microbatch_args(workload, plan.num_microbatches)
    layers_arg = plan.profile_meta.get("layers_arg")
    names = cut_layers(copy.deepcopy(workload.model), args, layers_arg).names
    if list(names) != list(plan.layer_names):
        diff = next((i for i, (a, b) in enumerate(zip(names, plan.layer_names)) if a != b), min(len(names), len(plan.layer_names)))
        got = names[diff] if diff < len(names) else "(none)"
        want = plan.layer_names[diff] if diff < len(plan.layer_names) else "(none)"
        raise StageplanError(
            f"the plan does not match this model: it has {len(plan.layer_names)} layers, the model {len(names)}; "
            f"layer {diff} is {got!r} in the model but {want!r} in the plan (plan made for "
            f"{plan.profile_meta.get('model')!r}); profile and plan this model, with the same --set options"
        )


# --------------------------------------------------------------------------------------------------
# Measurement helpers (inside a rank)


class _ActivationTracker:
    """Live saved-for-backward bytes: +storage bytes when autograd saves a tensor, - when the graph frees it
    (deduplicated by storage with a refcount; parameters excluded)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.live = 0
        self.peak = 0
        self.refs: dict[int, int] = {}

    def reset_peak(self) -> None:
        self.peak = self.live

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude:
            return t
        if self.refs.get(ptr, 0) == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        return _Held(self, t, ptr, storage.nbytes())

    @staticmethod
    def unpack(h: Any) -> torch.Tensor:
        return h.t if isinstance(h, _Held) else h

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    __slots__ = ("nbytes", "ptr", "t", "tracker")

    def __init__(self, tracker: _ActivationTracker, t: torch.Tensor, ptr: int, nbytes: int) -> None:
        self.tracker, self.t, self.ptr, self.nbytes = tracker, t, ptr, nbytes

    def __del__(self) -> None:
        refs = self.tracker.refs
        refs[self.ptr] -= 1
        if refs[self.ptr] == 0:
            del refs[self.ptr]
            self.tracker.live -= self.nbytes


class _Clock:
    """Intervals of a rank's own compute: perf_counter on CPU; CUDA events on CUDA, read after the step."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.events: list[tuple[str, int, int, Any, Any, float, float]] = []  # kind, stage, mb, start, end, wall, cpu

    def timed(self, kind: str, stage: int, mb: int, fn: Callable[[], Any]) -> Any:
        wall = time.time()
        cpu0 = time.thread_time()
        start: Any
        end: Any
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
        else:
            start = time.perf_counter()
            out = fn()
            end = time.perf_counter()
        self.events.append((kind, stage, mb, start, end, wall, time.thread_time() - cpu0))
        return out

    def drain(self) -> list[tuple[str, int, int, float, float, float]]:
        """(kind, stage, microbatch, wall start, seconds, thread CPU seconds) of the step's intervals."""
        if self.cuda:
            torch.cuda.synchronize()
        out = []
        for kind, stage, mb, start, end, wall, cpu in self.events:
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            out.append((kind, stage, mb, wall, seconds, cpu))
        self.events = []
        return out


def _median_iqr(xs: Sequence[float]) -> tuple[float, float]:
    if not xs:
        return float("nan"), float("nan")
    if len(xs) == 1:
        return xs[0], 0.0
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return statistics.median(xs), q[2] - q[0]


def _make_optimizer(name: str, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr)


def _tie_groups(model: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """FQN groups that name one shared parameter (e.g. an embedding tied to the LM head), with the parameter."""
    by_id: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), ([], p))[0].append(name)
    return [group for group in by_id.values() if len(group[0]) > 1]


# --------------------------------------------------------------------------------------------------
# One rank


def worker_main(workload: Workload, plan: Plan, *, rank: int, world_size: int, options: dict[str, Any],
                report_path: str | None) -> None:
    """Run this rank's stages of ``plan``; rank 0 gathers the measurements and writes the RunReport."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    backend = options["backend"]
    timeout = _dt.timedelta(seconds=float(options["timeout_s"]))
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    if "weights_checksum" in options:  # torchrun: every rank built its own model; they must agree
        sums: list[Any] = [None] * world_size
        dist.all_gather_object(sums, options["weights_checksum"])
        if len({round(float(x), 6) for x in sums}) != 1:
            raise WorkloadError(
                f"ranks built different initial weights (checksums {sums}); seed the model factory "
                "(torch.manual_seed) so every rank builds the same model"
            )

    model = workload.model.to(device)
    model.train()
    m = plan.num_microbatches
    inputs = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in workload.input_tuple())
    target = workload.target.to(device) if isinstance(workload.target, torch.Tensor) else workload.target
    mb_args = _microbatch_args(workload, m)
    mb_args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in mb_args)
    check = bool(options.get("check"))
    reference = copy.deepcopy(model) if (check and rank == 0) else None
    ties = _tie_groups(model)

    S = plan.num_stages
    stage_rank = [st.rank for st in plan.stages]
    mine = [s for s in range(S) if stage_rank[s] == rank]
    cut = cut_stages(model, mb_args, plan.layer_names, plan.boundaries, plan.profile_meta.get("layers_arg"))
    stages = []
    for s in mine:
        if cut.method == "export":
            stages.append(cut.pipe.build_stage(s, device))  # type: ignore[attr-defined]
        else:
            stages.append(PipelineStage(cut.pieces[s].module.to(device), s, S, device))

    clock = _Clock(device.type == "cuda")
    params: dict[str, nn.Parameter] = {}
    all_params: list[nn.Parameter] = []
    for st in stages:
        params.update(used_parameters(st.submod))
        all_params.extend(st.submod.parameters())
    unique = list({id(p): p for p in all_params}.values())
    tracker = _ActivationTracker({p.untyped_storage().data_ptr() for p in unique})
    # The saved-tensor hooks cost Python time per saved tensor (~6% of a small stage, seen here), so they run
    # in the warm-up steps only (activation peaks repeat every step) and the timed steps run without them.
    tracking = [True]

    for st in stages:
        fwd, bwd = st.forward_one_chunk, st.backward_one_chunk
        bwd_w = getattr(st, "backward_weight_one_chunk", None)

        def forward_one_chunk(chunk: int, *a: Any, _f: Any = fwd, _s: int = st.stage_index, **k: Any) -> Any:
            with tracker.hooks() if tracking[0] else contextlib.nullcontext():
                return clock.timed("F", _s, chunk, lambda: _f(chunk, *a, **k))

        def backward_one_chunk(chunk: int, *a: Any, _b: Any = bwd, _s: int = st.stage_index, **k: Any) -> Any:
            return clock.timed("B", _s, chunk, lambda: _b(chunk, *a, **k))

        st.forward_one_chunk = forward_one_chunk
        st.backward_one_chunk = backward_one_chunk
        if bwd_w is not None:
            def backward_weight_one_chunk(chunk: int, *a: Any, _w: Any = bwd_w, _s: int = st.stage_index, **k: Any) -> Any:
                return clock.timed("W", _s, chunk, lambda: _w(chunk, *a, **k))

            st.backward_weight_one_chunk = backward_weight_one_chunk

    last_stage = S - 1
    loss_counter = [0]

    def loss_fn(output: Any, tgt: Any) -> Any:
        mb = loss_counter[0] % m
        loss_counter[0] += 1
        with tracker.hooks() if tracking[0] else contextlib.nullcontext():
            return clock.timed("F", last_stage, mb, lambda: workload.compute_loss(output, tgt))

    cls = get_schedule_class(plan.schedule)
    single = issubclass(cls, PipelineScheduleSingle)
    schedule = cls(stages[0] if single else stages, n_microbatches=m, loss_fn=loss_fn)
    opt_name = options["optimizer"]
    lr = float(options["lr"])
    optimizer = _make_optimizer(opt_name, unique, lr)
    has_first = 0 in mine
    has_last = last_stage in mine
    steps, warmup = int(options["steps"]), int(options["warmup"])

    step_times: list[float] = []
    compute_f: list[float] = []
    compute_b: list[float] = []
    other_times: list[float] = []
    losses_per_step: list[float] = []
    peaks: list[int] = []
    timeline: list[dict[str, Any]] = []
    compute_cpu: list[float] = []
    for step in range(warmup + steps):
        tracking[0] = step < warmup or warmup == 0
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        tracker.reset_peak()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        wall0 = time.time()
        losses: list[Any] = []
        kwargs: dict[str, Any] = {"return_outputs": False}
        if has_last:
            kwargs.update(target=target, losses=losses)
        schedule.step(*(inputs if has_first else ()), **kwargs)
        t_other = time.perf_counter()
        _sum_tied_grads(ties, params, device)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        intervals = clock.drain()
        if device.type == "cuda":
            peaks.append(int(torch.cuda.max_memory_allocated(device) - base))
        elif tracking[0]:
            peaks.append(tracker.peak)
        if step >= warmup:
            step_times.append(t1 - t0)
            compute_f.append(sum(sec for kind, _, _, _, sec, _ in intervals if kind == "F"))
            compute_b.append(sum(sec for kind, _, _, _, sec, _ in intervals if kind in ("B", "W")))
            compute_cpu.append(sum(cpu for *_, cpu in intervals))
            other_times.append(t1 - t_other)
            if step == warmup + steps - 1:
                timeline = [{"rank": rank, "stage": s, "microbatch": mb, "kind": kind, "start_wall": w, "duration_s": sec,
                             "step_wall": wall0} for kind, s, mb, w, sec, _ in intervals]
        if has_last:
            losses_per_step.append(float(torch.stack([x.detach().float() for x in losses]).mean()))

    result = {
        "rank": rank, "stages": mine, "step_s": step_times, "forward_s": compute_f, "backward_s": compute_b,
        "other_s": other_times, "peak_activation_bytes": peaks, "compute_cpu_s": compute_cpu, "losses": losses_per_step, "timeline": timeline,
        "params": {k: v.detach().cpu().clone() for k, v in params.items()} if check else {},
    }
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    if rank == 0:
        assert gathered is not None
        check_result = _check(workload, reference, gathered, options, m) if check and reference is not None else None
        report = _report(plan, gathered, options, check_result, device)
        if report_path:
            report.save(report_path)
    dist.barrier()
    dist.destroy_process_group()


def _sum_tied_grads(ties: list[tuple[list[str], nn.Parameter]], params: dict[str, nn.Parameter],
                    device: torch.device) -> None:
    """Sum a tied parameter's gradients over every stage that holds a copy (each copy's own gradient is only
    its stage's share: 2e-2 off, seen here). Ranks without a copy contribute zeros, so every rank joins."""
    import torch.distributed as dist

    for names, original in ties:
        local = [params[n] for n in names if n in params]
        buf = torch.zeros(original.shape, dtype=original.dtype, device=device)
        for p in {id(p): p for p in local}.values():
            if p.grad is not None:
                buf += p.grad
        dist.all_reduce(buf)
        for p in {id(p): p for p in local}.values():
            p.grad = buf.clone()


def _check(workload: Workload, reference: nn.Module, gathered: list[Any], options: dict[str, Any], m: int) -> dict[str, Any]:
    """Train the uncut model on one process: same data, same initial weights, the same microbatches with
    gradient accumulation; compare each step's loss and every parameter by FQN at the end."""
    optimizer = _make_optimizer(options["optimizer"], list(reference.parameters()), float(options["lr"]))
    inputs = workload.input_tuple()
    batch = workload.batch_size
    mb = batch // m
    dev = next(reference.parameters()).device
    ref_losses: list[float] = []
    for _ in range(int(options["warmup"]) + int(options["steps"])):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(m):
            sl = slice(i * mb, (i + 1) * mb)
            args = tuple(a[sl].to(dev) if isinstance(a, torch.Tensor) else a for a in inputs)
            tgt = workload.target[sl].to(dev) if isinstance(workload.target, torch.Tensor) else workload.target
            loss = workload.compute_loss(reference(*args), tgt)
            (loss / m).backward()
            total += float(loss.detach())
        optimizer.step()
        ref_losses.append(total / m)
    pipe_losses = next(g["losses"] for g in gathered if g["losses"])
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
    passed = (not missing and not uncovered and loss_diff <= atol + rtol * max(abs(x) for x in ref_losses)
              and worst <= atol + rtol * scale)
    return {"passed": bool(passed), "max_loss_diff": loss_diff, "max_param_diff": worst, "worst_param": worst_name,
            "params_compared": compared, "missing_in_reference": missing, "not_trained_by_pipeline": uncovered,
            "reference_losses": ref_losses, "rtol": rtol, "atol": atol}


def _report(plan: Plan, gathered: list[Any], options: dict[str, Any], check: dict[str, Any] | None,
            device: torch.device) -> RunReport:
    p = plan.num_ranks
    m = plan.num_microbatches
    # the step ends when the slowest rank ends: per measured step, the max over ranks
    per_step = [max(g["step_s"][i] for g in gathered) for i in range(len(gathered[0]["step_s"]))]
    step, step_iqr = _median_iqr(per_step)
    rows = []
    busy_total = 0.0
    for g in sorted(gathered, key=lambda g: g["rank"]):
        r = g["rank"]
        pf = sum(st.forward_s for st in plan.stages if st.rank == r)
        pb = sum(st.backward_s for st in plan.stages if st.rank == r)
        f, f_iqr = _median_iqr(g["forward_s"])
        b, b_iqr = _median_iqr(g["backward_s"])
        other, _ = _median_iqr(g["other_s"])
        busy_total += f + b
        peak = max(g["peak_activation_bytes"]) if g["peak_activation_bytes"] else 0
        rows.append({
            "rank": r, "stages": g["stages"],
            "predicted_forward_s": pf, "predicted_backward_s": pb, "predicted_compute_s": pf + pb,
            "measured_forward_s": f / m, "measured_backward_s": b / m, "measured_compute_s": (f + b) / m,
            "measured_compute_iqr_s": (f_iqr + b_iqr) / m,
            # thread CPU time of the same spans: wall minus CPU is time the rank was preempted by other processes
            "measured_compute_cpu_s": _median_iqr(g["compute_cpu_s"])[0] / m,
            "compute_ratio": ((f + b) / m) / (pf + pb) if pf + pb > 0 else None,
            "measured_idle_s": max(step - (f + b) - other, 0.0), "optimizer_s": other,
            "predicted_idle_s": plan.predicted_step_s - m * (pf + pb),
            "predicted_peak_activation_bytes": plan.rank_peak_activation_bytes[r],
            "measured_peak_activation_bytes": peak,
            "activation_ratio": peak / plan.rank_peak_activation_bytes[r] if plan.rank_peak_activation_bytes[r] else None,
        })
    t0 = min((e["start_wall"] for g in gathered for e in g["timeline"]), default=0.0)
    timeline = tuple(
        {"rank": e["rank"], "stage": e["stage"], "microbatch": e["microbatch"], "kind": e["kind"],
         "start_s": e["start_wall"] - t0, "end_s": e["start_wall"] - t0 + e["duration_s"]}
        for g in gathered for e in g["timeline"]
    )
    losses: list[float] = next((g["losses"] for g in gathered if g["losses"]), [])
    batch = m * int(options.get("microbatch_size", 1))
    return RunReport(
        measured_step_s=step, predicted_step_s=plan.predicted_step_s, measured_step_iqr_s=step_iqr,
        samples_per_s=batch / step if step > 0 else 0.0,
        measured_bubble_fraction=max(0.0, 1.0 - busy_total / (p * step)) if step > 0 else 0.0,
        predicted_bubble_fraction=plan.bubble_fraction, stages=tuple(rows), losses=tuple(losses),
        plan={"boundaries": list(plan.boundaries), "schedule": plan.schedule, "num_microbatches": m,
              "num_ranks": p, "virtual_stages": plan.virtual_stages, "method": plan.method,
              "stage_ranks": [st.rank for st in plan.stages],
              "profile_digest": plan.profile_digest, "layer_names": list(plan.layer_names)},
        options=dict(options),
        meta={"torch_version": torch.__version__, "device": str(device), "world_size": p,
              "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "timer": "cuda_event" if device.type == "cuda" else "perf_counter",
              "load_average_1min": os.getloadavg()[0],
              "activation_measure": "max_memory_allocated" if device.type == "cuda" else "saved_tensors_hooks live bytes"},
        check=check, timeline=timeline,
    )


# --------------------------------------------------------------------------------------------------
# Launcher


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(
    workload: Workload | str,
    plan: Plan | str | os.PathLike[str],
    *,
    steps: int = 20,
    warmup: int = 3,
    optimizer: str = "sgd",
    lr: float | None = None,
    check: bool = False,
    backend: str | None = None,
    timeout_s: float = 300.0,
    options: dict[str, Any] | None = None,
    output: str | os.PathLike[str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
) -> RunReport:
    """Train ``workload`` with ``plan`` on one local process per pipeline rank; return the RunReport.

    ``workload`` is a Workload or a model spec (built-in name or ``package.module:factory``, called with
    ``options``). Every rank gets the same initial weights and data. A failure on any rank ends all ranks
    and raises :class:`stageplan.RunError` naming the rank and its log file.
    """
    spec = workload if isinstance(workload, str) else None
    if spec is not None:
        from stageplan.zoo import build_workload

        wl = build_workload(spec, options or {})
    else:
        assert isinstance(workload, Workload)
        wl = workload
    the_plan = _load_plan(plan)
    opts = _run_options(the_plan, wl, steps=steps, warmup=warmup, optimizer=optimizer, lr=lr, check=check,
                        backend=backend, timeout_s=timeout_s)
    if output is not None:
        from stageplan._io import check_output_path

        check_output_path(output)
    validate(wl, the_plan)

    run_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="stageplan-run-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    payload = {"plan": the_plan.to_json(), "options": opts, "spec": spec, "model_options": options or {},
               "state_dict": wl.model.state_dict(), "inputs": wl.inputs, "target": wl.target,
               "workload": None if spec else wl}
    try:
        torch.save(payload, run_dir / "payload.pt")
    except Exception as exc:  # unpicklable workload (a lambda loss, a local class)
        raise WorkloadError(
            f"the workload cannot be sent to the rank processes ({type(exc).__name__}: {exc}); pass a model spec "
            "'package.module:factory' instead, or use module-level functions and classes"
        ) from exc
    report_path = run_dir / "report.json"
    _spawn_and_wait(run_dir, the_plan.num_ranks, float(timeout_s), opts)  # on failure the logs stay for the user
    report = RunReport.load(report_path)
    if output is not None:
        report.save(output)
    if log_dir is None:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
    return report


def _run_options(plan: Plan, wl: Workload, *, steps: int, warmup: int, optimizer: str, lr: float | None, check: bool,
                 backend: str | None, timeout_s: float) -> dict[str, Any]:
    if steps < 1 or warmup < 0:
        raise StageplanError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}; e.g. --steps 20 --warmup 3")
    if optimizer not in OPTIMIZERS:
        raise StageplanError(f"unknown optimizer {optimizer!r} for run; use one of {', '.join(OPTIMIZERS)}")
    if timeout_s <= 0:
        raise StageplanError(f"timeout must be > 0 seconds, got {timeout_s}; e.g. --timeout 300")
    backend = backend or "gloo"
    if backend not in ("gloo", "nccl"):
        raise StageplanError(f"unknown backend {backend!r}; use gloo (CPU) or nccl (CUDA)")
    if backend == "nccl" and torch.cuda.device_count() < 1:
        raise StageplanError("backend nccl needs CUDA GPUs and this machine has none; use --backend gloo")
    return {"steps": steps, "warmup": warmup, "optimizer": optimizer, "lr": lr if lr is not None else DEFAULT_LR[optimizer],
            "check": check, "backend": backend, "timeout_s": timeout_s,
            "microbatch_size": wl.batch_size // plan.num_microbatches if wl.batch_size % plan.num_microbatches == 0 else None}


def _spawn_and_wait(run_dir: Path, world: int, timeout_s: float, opts: dict[str, Any]) -> None:
    port = _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    logs = [run_dir / f"rank{r}.log" for r in range(world)]
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTHONUNBUFFERED="1")
    deadline = time.monotonic() + timeout_s
    try:
        for r in range(world):
            env_r = dict(env, RANK=str(r), LOCAL_RANK=str(r))
            with open(logs[r], "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "stageplan.executor", str(run_dir), str(r), str(world)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env_r, start_new_session=True,
                ))
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # A rank that fails often takes its peers down with it (their sockets close): give them a moment
                # to exit, then blame the root cause: a rank killed by a signal, else the earliest error that is
                # not a lost connection.
                grace = time.monotonic() + 1.0
                while time.monotonic() < grace and any(p.poll() is None for p in procs):
                    time.sleep(0.05)
                codes = [p.poll() for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                first = min(failed, key=lambda r: _blame_order(run_dir, r, codes[r]))
                _kill_all(procs)
                raise RunError(f"rank {first} failed: {_error_line(run_dir, first, codes[first])}; "
                               f"full traceback in {logs[first]}", rank=first, log_path=str(logs[first]))
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                _kill_all(procs)
                raise RunError(f"the run did not finish within the {timeout_s:g} s timeout; all {world} ranks were ended; "
                               f"logs in {run_dir}; raise --timeout or run fewer --steps", log_path=str(run_dir))
            time.sleep(0.05)
    finally:
        _kill_all(procs)


_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed", "timed out")


def _blame_order(run_dir: Path, rank: int, code: int | None) -> tuple[int, float]:
    """Sort key for the failing rank to report: killed by a signal, then own errors, then lost peers."""
    if code is not None and code < 0:
        return (0, 0.0)
    path = run_dir / f"rank{rank}.error"
    if not path.exists():
        return (1, float("inf"))
    text = path.read_text()
    return (2 if any(s in text for s in _LOST_PEER) else 1, path.stat().st_mtime)


def _error_line(run_dir: Path, rank: int, code: int | None) -> str:
    path = run_dir / f"rank{rank}.error"
    if path.exists():
        return path.read_text().strip().splitlines()[0] if path.read_text().strip() else "unknown error"
    if code is not None and code < 0:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with code {code}"


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=10)


def _materialize(payload: dict[str, Any]) -> Workload:
    if payload["workload"] is not None:
        wl = payload["workload"]
        assert isinstance(wl, Workload)
        return wl
    from stageplan.zoo import build_workload

    with contextlib.redirect_stdout(io.StringIO()):
        wl = build_workload(payload["spec"], payload["model_options"])
    wl.model.load_state_dict(payload["state_dict"])
    wl.inputs, wl.target = payload["inputs"], payload["target"]
    return wl


def torchrun_main(workload: Workload, plan: Plan | str | os.PathLike[str], *, steps: int = 20, warmup: int = 3,
                  optimizer: str = "sgd", lr: float | None = None, check: bool = False, backend: str | None = None,
                  timeout_s: float = 300.0, output: str | os.PathLike[str] | None = None) -> RunReport | None:
    """One rank under torchrun (rank and world size from the environment); rank 0 returns the RunReport.

    Every rank builds the workload itself, so the factory must be deterministic (seeded); a checksum of the
    initial weights is compared across ranks and a mismatch stops the run.
    """
    the_plan = _load_plan(plan)
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    opts = _run_options(the_plan, workload, steps=steps, warmup=warmup, optimizer=optimizer, lr=lr, check=check,
                        backend=backend, timeout_s=timeout_s)
    if output is not None and rank == 0:
        from stageplan._io import check_output_path

        check_output_path(output)
    validate(workload, the_plan, world_size=world)
    checksum = float(sum(float(p.detach().double().sum()) for p in workload.model.parameters()))
    with tempfile.TemporaryDirectory(prefix="stageplan-torchrun-") as tmp:
        report_path = str(Path(tmp) / "report.json") if rank == 0 else None
        worker_main(workload, the_plan, rank=rank, world_size=world, options={**opts, "weights_checksum": checksum},
                    report_path=report_path)
        if report_path is None:
            return None
        report = RunReport.load(report_path)
    if output is not None:
        report.save(output)
    return report


def _child(run_dir: str, rank: int, world: int) -> int:
    try:
        torch.set_num_threads(1)
        payload = torch.load(Path(run_dir) / "payload.pt", weights_only=False)
        plan = Plan.from_json(payload["plan"])
        wl = _materialize(payload)
        report = str(Path(run_dir) / "report.json") if rank == 0 else None
        worker_main(wl, plan, rank=rank, world_size=world, options=payload["options"], report_path=report)
        return 0
    except BaseException as exc:
        traceback.print_exc()
        root: BaseException = exc  # torch wraps a stage's error; the innermost cause says what went wrong
        while (root.__cause__ or root.__context__) is not None and len(str(root.__cause__ or root.__context__)) > 0:
            root = root.__cause__ or root.__context__  # type: ignore[assignment]
        lines = [ln.strip() for ln in str(root).splitlines() if ln.strip()]
        msg = f"{type(root).__name__}: {lines[0]}" if lines else type(root).__name__
        (Path(run_dir) / f"rank{rank}.error").write_text(msg + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
