"""Spawning, watching, blaming and ending the ranks of a run; torchrun detection (torch).

Local runs start one process per pipeline rank on localhost (gloo on CPU with one intra-op thread each, NCCL
on CUDA with one GPU per rank) and watch them: if any rank fails or is killed, every rank is ended at once and
the failure is reported with the rank and its log. Every run has a timeout. Under torchrun each process runs
:func:`torchrun_main` itself, taking rank and world size from the environment.

Ranks normally start as fresh interpreters (``python -m stageplan.running.rank``) that load the workload
from a payload file. A workload whose model or loss is defined in the caller's script or notebook
(``__main__``)
cannot be unpickled there, so those ranks are forked instead: a forked rank sees the caller's definitions.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from stageplan._io import check_output_dir, check_output_path, save_or_keep
from stageplan._progress import Progress, duration
from stageplan.errors import RunError, RunInterrupted, StageplanError, WorkloadError
from stageplan.formats.link import load_link, save_link
from stageplan.formats.plan import Plan
from stageplan.formats.profile import Profile, merge_profiles
from stageplan.formats.runreport import RunReport
from stageplan.host import CpuWatch
from stageplan.materialize import (
    Checkpoint,
    init_empty_weights,
    meta_model,
    parameter_bytes,
    real_model,
    save_checkpoint,
    save_tensors,
)
from stageplan.running.executor import comm_slice_ns, worker_main
from stageplan.running.rank import rank_entry, train_rank
from stageplan.running.stages import DEFAULT_LR, OPTIMIZERS, validate
from stageplan.running.tensor import check_tensor_parallel_run, plan_tensor_parallel
from stageplan.units import format_bytes
from stageplan.workload import Workload, default_microbatch_size

PROGRESS_PREFIX = "stageplan-progress: "


def load_plan(plan: Plan | str | os.PathLike[str]) -> Plan:
    """A Plan, or a plan file, or a layout file's best layout (its plan)."""
    if isinstance(plan, Plan):
        loaded = plan
    else:
        from stageplan._io import read_json

        data = read_json(plan, "plan")
        if str(data.get("schema", "")).startswith("stageplan.layout/"):
            from stageplan.formats.layout import Layout

            layout = Layout.from_json(data, source=str(plan))
            if layout.plan is None:
                raise StageplanError(
                    f"{str(plan)!r} holds no plan of its best layout; run stageplan layout again")
            loaded = layout.plan
        else:
            loaded = Plan.from_json(data, source=f"plan {str(plan)!r}")
    return loaded


def run(
    workload: Workload | str,
    plan: Plan | str | os.PathLike[str],
    *,
    steps: int = 20,
    warmup: int = 3,
    optimizer: str | None = None,
    lr: float | None = None,
    check: bool = False,
    backend: str | None = None,
    timeout_s: float = 300.0,
    factory_options: dict[str, Any] | None = None,
    output: str | os.PathLike[str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    weights: str | os.PathLike[str] | dict[str, torch.Tensor] | None = None,
    progress: bool = False,
    pin_cpus: bool = True,
    retime: bool = True,
    sharding: str | None = None,
) -> RunReport:
    """Train ``workload`` with ``plan`` on one local process per pipeline rank and replica; return the
    RunReport.

    A plan with ``data_parallel`` d > 1 (a layout's best, or ``plan --data-parallel``) runs p x d processes on
    a ("pp", "dp") mesh: each replica trains its contiguous share of the workload's batch (the global batch,
    d x m microbatches of the plan's size), and each stage is wrapped for ``sharding`` (default: the plan's):
    "ddp", "zero1" (DDP and ZeroRedundancyOptimizer), "fsdp" (FSDP2, parameters unsharded until the last
    microbatch) or "fsdp-reshard" (resharded after every forward). ``check`` compares with one process
    training the whole global batch. A plan of t > 1 tensor-parallel shards (a layout's best at
    ``--tensor-parallel t``, an HF decoder) runs p x t processes on a ("pp", "tp") mesh, each block sharded
    by the model's own ``base_model_tp_plan`` (:mod:`stageplan.running.tensor`), and the report counts each
    rank's all-reduces beside the plan's.

    ``workload`` is a Workload or a model spec (built-in name or ``package.module:factory``, called with
    ``factory_options``). ``optimizer`` defaults to the one the plan was made for. Each rank builds the model
    with its parameters on meta and materialises only its own stage: its tensors come from ``weights`` (a
    safetensors file, an HF folder or a state dict), else from the user's factory built once here and saved,
    else (a model too big for one process) from an initialisation keyed by FQN. Every rank gets the same data.
    A failure on any rank ends all ranks and raises :class:`stageplan.RunError` naming the rank and its log
    file; after ``timeout_s`` every rank is ended. Ctrl-C lets the ranks finish their current step and raises
    :class:`stageplan.RunInterrupted` with the steps measured as a RunReport marked partial (written to
    ``output`` when given). With ``pin_cpus`` (the default) each CPU rank runs on its
    own block of this machine's CPUs (:func:`stageplan.running.executor.pin_rank_cpus`; skipped where there
    are fewer CPUs than ranks); the report's ``meta["cpus_per_rank"]`` says where each rank ran. With
    ``retime`` (the default) each rank ends by timing its layers alone, as the profiler does (the ranks in
    turns), which splits each rank's ``compute_ratio`` into ``machine_ratio`` x ``pipeline_ratio``; a later
    rank first runs the earlier layers forward once, materialising each from ``weights``, so with a checkpoint
    far larger than a
    rank's share pass ``retime=False`` (``--no-retime``).
    """
    the_plan = load_plan(plan)
    opts = _run_options(the_plan, steps=steps, warmup=warmup, optimizer=optimizer, lr=lr, check=check,
                        backend=backend, timeout_s=timeout_s, pin_cpus=pin_cpus, retime=retime,
                        sharding=sharding)
    world = the_plan.num_ranks * the_plan.data_parallel * plan_tensor_parallel(the_plan)
    _refuse_estimate_on_cpu(the_plan, opts["backend"])
    _warn_precision(the_plan)
    if output is not None:
        check_output_path(output, (plan, weights))
    if log_dir is not None:
        check_log_dir(log_dir)
    if weights is not None:
        Checkpoint(weights)  # refuse a missing or malformed checkpoint before any work
    if not isinstance(workload, (str, Workload)):
        raise StageplanError(f"workload must be a Workload or a model spec string, got "
                             f"{type(workload).__name__}; "
                             "e.g. stageplan.run('gpt', plan) or stageplan.run(Workload(model, inputs), "
                             "plan)")
    with _run_folder(log_dir, "stageplan-run-", world) as run_dir:
        meta_wl, opts["weights"], opts["weights_from"] = _rank_workload(workload, factory_options, weights,
                                                                        run_dir, float(timeout_s))
        share = the_plan.num_microbatches * the_plan.data_parallel
        opts["microbatch_size"] = meta_wl.batch_size // share if meta_wl.batch_size % share == 0 else None
        # before the model's checks: what cannot run at all
        check_tensor_parallel_run(meta_wl.model, the_plan)
        validate(meta_wl, the_plan)
        if check and 2 * parameter_bytes(meta_wl.model) > _available_bytes() // 2:
            raise StageplanError("--check trains the whole model in one process, and this model's parameters "
                                 f"({format_bytes(parameter_bytes(meta_wl.model))}, twice that with "
                                 f"gradients) would not fit in the {format_bytes(_available_bytes())} "
                                 f"available here; run without --check")
        _warn_oversubscribed(world, opts["backend"])
        others = CpuWatch()  # what other processes take of the CPUs during the run (host.run_contention)
        stop = run_dir / STOP_FILE
        opts["stop_file"] = str(stop)
        if _needs_fork(meta_wl):
            _spawn_and_wait(run_dir, world, float(timeout_s), progress, forked=(meta_wl, the_plan, opts),
                            stop=stop)
        else:
            payload = {"plan": the_plan.to_json(), "options": opts, "workload": meta_wl}
            try:
                torch.save(payload, run_dir / "payload.pt")
            except Exception as exc:  # unpicklable workload (a lambda loss, a local class)
                raise WorkloadError(
                    f"the workload cannot be sent to the rank processes ({type(exc).__name__}: {exc}); pass "
                    "a model spec 'package.module:factory' instead, or use module-level functions and classes"
                ) from exc
            _spawn_and_wait(run_dir, world, float(timeout_s), progress, stop=stop)
        interrupted = stop.exists()
        if interrupted and not (run_dir / "report.json").exists():
            raise RunInterrupted("interrupted before the first measured step: nothing was measured")
        report = RunReport.load(run_dir / "report.json")
        report.meta.update(others.result())
    if output is not None:
        save_or_keep(report, output)
    if interrupted:
        part = report.meta.get("partial") or {}
        raise RunInterrupted(f"interrupted after {part.get('steps_measured')} of {part.get('steps_asked')} "
                             "measured steps", report=report, output=None if output is None else str(output))
    return report


def measure_link(num_ranks: int = 2, *, backend: str | None = None, timeout_s: float = 60.0,
                 output: str | os.PathLike[str] | None = None, log_dir: str | os.PathLike[str] | None = None,
                 pin_cpus: bool = True, data_parallel: int = 1) -> dict[str, Any]:
    """Measure the links between neighbouring ranks alone:
    ``num_ranks`` local processes (spawned and watched as
    :func:`run` does them) ping-pong rank r <-> r + 1; return the LINK.json dict (schema stageplan.link/1:
    backend, latency_s, bandwidth_bytes_per_s, sizes, pairs), written to ``output`` when given. A failure on
    any rank ends all ranks and raises :class:`stageplan.RunError`; so does ``timeout_s``. ``pin_cpus``: CPU
    ranks
    on their own CPUs, as :func:`run` puts them.

    ``data_parallel`` D > 1 (dividing ``num_ranks``) lays the ranks out as :func:`run` lays out
    num_ranks / D pipeline ranks x D replicas: the pipeline probes run on replica 0's pipeline, and every
    stage's replicas then time their all-reduce at once, by message size (``dp_allreduce_*``, which
    ``plan --link`` prices the replicas' sync with).
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 2:
        raise StageplanError(f"the link is measured between neighbouring ranks: num_ranks must be an integer "
                             f">= 2, got {num_ranks!r}; e.g. --ranks 2")
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1 or (
            num_ranks % data_parallel):
        # the ranks are (num_ranks / D) pipeline ranks x D replicas
        whole = isinstance(data_parallel, int) and not isinstance(data_parallel, bool) and data_parallel >= 1
        fits = (f"--ranks {-(-num_ranks // data_parallel) * data_parallel} for {data_parallel} replicas, or "
                if whole else "")
        raise StageplanError(f"data_parallel ({data_parallel!r}) must be an integer >= 1 that divides the "
                             f"ranks ({num_ranks}), which are pipeline ranks x replicas; use {fits}a divisor "
                             f"of {num_ranks}, e.g. --data-parallel {2 if num_ranks % 2 == 0 else num_ranks}")
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise StageplanError(f"timeout must be > 0 seconds, got {timeout_s}; e.g. --timeout 60")
    the_backend = _backend(backend, num_ranks)
    opts: dict[str, Any] = {"backend": the_backend, "timeout_s": float(timeout_s), "pin_cpus": bool(pin_cpus),
                            "comm_slice_ns": comm_slice_ns(), "data_parallel": data_parallel}
    if output is not None:
        check_output_path(output)
    if log_dir is not None:
        check_log_dir(log_dir)
    _warn_oversubscribed(num_ranks, the_backend)
    with _run_folder(log_dir, "stageplan-link-", num_ranks) as run_dir:
        torch.save({"task": "link", "options": opts}, run_dir / "payload.pt")
        _spawn_and_wait(run_dir, num_ranks, float(timeout_s), progress=False)
        link = load_link(run_dir / "link.json")
    if output is not None:
        save_link(link, output)
    return link


def profile_in_processes(model: str, factory_options: dict[str, Any] | None = None, *, processes: int,
                         microbatch_size: int | None = None, timeout_s: float = 1800.0,
                         progress: bool = False, **profile_options: Any) -> Profile:
    """Profile the model spec ``model`` ``processes`` times, each in a fresh process, one after the other (so
    they never share the cores), and merge them (:func:`stageplan.formats.profile.merge_profiles`: per layer,
    the median of each time). ``profile_options`` are :func:`stageplan.profiling.profiler.profile_model`'s
    (device, dtype, warmup, repeats, layers, streaming, dedup). Each process is watched as a run's ranks are:
    ``timeout_s`` bounds each one, and
    a failure or a timeout ends it and raises :class:`stageplan.RunError` with its error line.
    """
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise StageplanError(f"processes must be an integer >= 1, got {processes!r}; e.g. --processes 3")
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise StageplanError(f"timeout must be > 0 seconds, got {timeout_s}; e.g. --timeout 600")
    from stageplan.profiling.profiler import is_estimate_device

    if is_estimate_device(str(profile_options.get("device", "cpu"))):
        raise StageplanError("--processes repeats a measurement in fresh processes, and an estimate device "
                             "measures nothing (an estimate comes out the same every time); drop --processes")
    from stageplan.timing import check_order

    # the one process would refuse these as profile does: refused here, at once
    check_order(profile_options.get("order"), profile_options.get("streaming"))
    for name in ("compute_efficiency", "memory_efficiency"):
        # the one process would refuse them as profile does
        if profile_options.get(name) is not None:
            raise StageplanError(f"{name} ({profile_options[name]}) applies to estimates only; use it with "
                                 "--device estimate:GPU (e.g. estimate:h100-sxm), or drop it when measuring")
    from stageplan.measure import check_microbatch_size
    from stageplan.profiling.profiler import build_workload_for_profile

    # built here once (on meta where it would not fit), so that a wrong spec, option or microbatch size is
    # refused at once rather than in the first process
    workload = build_workload_for_profile(model, factory_options,
                                          device=str(profile_options.get("device", "cpu")),
                                          dtype=profile_options.get("dtype"),
                                          streaming=profile_options.get("streaming"))
    batch = workload.batch_size
    del workload
    mb = check_microbatch_size(batch,
                               default_microbatch_size(batch) if microbatch_size is None else microbatch_size)
    task = {"task": "profile", "model": model, "factory_options": dict(factory_options or {}),
            "microbatch_size": mb, "options": profile_options}
    profiles = []
    with _run_folder(None, "stageplan-profile-") as run_dir:
        bar = Progress(processes, "profiling in fresh processes", enabled=progress, interval_s=0.0)
        for k in range(processes):
            bar.update(k, f"process {k + 1} running")  # each line says how long the rest take at this pace
            torch.save(task, run_dir / "payload.pt")
            _spawn_and_wait(run_dir, 1, float(timeout_s), progress=False)
            profiles.append(Profile.load(run_dir / "profile.json"))
            (run_dir / "profile.json").unlink()
        bar.update(processes, "done")
    return merge_profiles(profiles)


def _warn_precision(plan: Plan) -> None:
    import warnings

    precision = plan.cost_options.get("precision")
    # a plan of sharded replicas counts bytes at the profiled dtype's own precision (fp32 for float32): what
    # the run trains in
    own = {"float32": "fp32", "bfloat16": "bf16"}.get(str(plan.profile_meta.get("dtype")))
    if precision and precision != own:
        warnings.warn(f"the plan counts memory for {precision} training; this run trains the model in its "
                      "own dtype without mixed precision, so measured memory is not comparable with the "
                      "plan's", stacklevel=3)


def torchrun_rank() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) from torchrun's environment, refusing one that is half set or out of range in one
    line (a KeyError or int() traceback before)."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [k for k in names if not os.environ.get(k)]
    if missing:
        raise StageplanError(f"this looks like a torchrun launch, but {', '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} "
                             "not set; start it with torchrun --nproc-per-node N -m stageplan run ..., or "
                             "unset RANK, LOCAL_RANK and TORCHELASTIC_RUN_ID to run on local processes")
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise StageplanError(f"RANK and WORLD_SIZE must be integers, got RANK={os.environ['RANK']!r}, "
                             f"WORLD_SIZE={os.environ['WORLD_SIZE']!r}; let torchrun set them") from None
    if not 0 <= rank < world:
        raise StageplanError(
            f"RANK must be in 0..WORLD_SIZE-1, got RANK={rank}, WORLD_SIZE={world}; let torchrun set them")
    return rank, world


def _refuse_estimate_on_cpu(plan: Plan, backend: str) -> None:
    """A plan made from an analytic GPU estimate predicts that GPU; a CPU run would be compared with it as if
    the estimate were a measurement of this machine."""
    if plan.profile_meta.get("timer") == "analytic" and backend != "nccl":
        gpu = (plan.profile_meta.get("estimate") or {}).get("gpu", "a GPU")
        raise StageplanError(f"this plan was made from an analytic estimate for {gpu}, not from a "
                             "measurement of this machine; profile the model here (stageplan profile MODEL "
                             "-o PROFILE.json) and plan that, or run the plan on that GPU with --backend "
                             "nccl")
    measured_on = str(plan.profile_meta.get("device") or "")
    runs_on = "cuda" if backend == "nccl" else "cpu"
    if plan.profile_meta.get("timer") != "analytic" and measured_on.split(":")[0] in ("cpu", "cuda") \
            and measured_on.split(":")[0] != runs_on:
        raise StageplanError(f"this plan was made from a profile measured on {measured_on}, and this run "
                             f"trains on {runs_on} ({backend}): its predictions are for the other device; "
                             f"profile the model on {runs_on} and plan that, or run with --backend "
                             f"{'gloo' if runs_on == 'cuda' else 'nccl'}")


_RUN_FILES = ("payload.pt", "weights.safetensors", "data.pt", "report.json", "profile.json", "link.json")
STOP_FILE = "stop"  # created by the launcher on Ctrl-C: the ranks stop after their current step
# in a --log-dir, the names of the files a run of this tool writes there: a later run replaces those and
# refuses any other file of the same names (the user's own, which would be lost, or read back as a rank's)
LOG_MARK = ".stageplan-run"


def _is_run_file(name: str) -> bool:
    return name in _RUN_FILES or name == STOP_FILE or (
        name.startswith("rank") and name.endswith((".log", ".error")))


def _marked(folder: Path) -> set[str]:
    """The file names the marker of an earlier run in ``folder`` lists (none without a readable marker)."""
    import json

    try:
        names = json.loads((folder / LOG_MARK).read_text()).get("files", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {n for n in names if isinstance(n, str)}


def check_log_dir(log_dir: str | os.PathLike[str]) -> None:
    """Refuse a --log-dir holding files of the names a run writes there and removes (its payload, weights,
    data, report) or reads back (rank logs and errors) that an earlier run of this tool did not write: the
    user's own would be lost, or a stale error blamed. An earlier run's own files (its marker lists them) are
    replaced."""
    check_output_dir(log_dir)
    folder = Path(log_dir)
    if not folder.is_dir():
        return
    ours = _marked(folder)
    taken = sorted(p.name for p in folder.iterdir() if _is_run_file(p.name) and p.name not in ours)
    if taken:
        raise StageplanError(f"--log-dir {str(folder)!r} already holds {', '.join(taken[:4])}"
                             f"{' ...' if len(taken) > 4 else ''}, which this tool did not write and a run "
                             "writes there (and removes or reads back); move them, or give an empty or new "
                             "folder")


def _claim_log_dir(folder: Path, world: int) -> None:
    """Remove an earlier run's files from ``folder`` (its marker lists them; :func:`check_log_dir` refused
    any other file of those names) and mark the names this run of ``world`` ranks may write."""
    import json

    for name in _marked(folder):
        if _is_run_file(name):
            with contextlib.suppress(OSError):
                (folder / name).unlink()
    names = [*_RUN_FILES, STOP_FILE, *(f"rank{r}{ext}" for r in range(world) for ext in (".log", ".error"))]
    (folder / LOG_MARK).write_text(json.dumps({"files": names}) + "\n")


@contextlib.contextmanager
def _run_folder(log_dir: str | os.PathLike[str] | None, prefix: str, world: int = 1) -> Iterator[Path]:
    """The folder the ranks share (payload, logs, report): ``log_dir``, or a temporary one. Weights and
    payload never stay (a Ctrl-C included); the logs stay when asked for, or when the ranks failed (the
    RunError names them)."""
    run_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=prefix))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if log_dir:
            _claim_log_dir(run_dir, world)
        yield run_dir
    except BaseException as exc:
        _clean_run_dir(run_dir, keep=log_dir is not None or isinstance(exc, RunError))
        raise
    _clean_run_dir(run_dir, keep=log_dir is not None)


def _clean_run_dir(run_dir: Path, *, keep: bool) -> None:
    """Never leave the weights behind (a Ctrl-C included); keep the logs when asked or when a rank failed."""
    for name in ("payload.pt", "weights.safetensors", "data.pt", STOP_FILE):
        with contextlib.suppress(OSError):
            (run_dir / name).unlink()
    if not keep:
        shutil.rmtree(run_dir, ignore_errors=True)


def _available_bytes() -> int:
    """Memory the machine can give now (MemAvailable), or all of it where /proc/meminfo is missing."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines()
                    if ln.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _given_weights(weights: Any, run_dir: Path) -> str | None:
    """A path the ranks can read: the given file or folder, or a given state dict written as safetensors."""
    if weights is None:
        return None
    if isinstance(weights, dict):
        # a state dict's tied aliases stored once
        save_tensors(weights.items(), run_dir / "weights.safetensors")
        return str(run_dir / "weights.safetensors")
    return str(weights)


def _build_and_save(
    spec: str, factory_options: dict[str, Any], path: Path, timeout_s: float = 1800.0
) -> None:
    """Build the model exactly as the user's factory does and write it as a checkpoint, in a forked child
    where fork exists: its memory goes back to the system when it exits (freed tensors in this process would
    stay in the allocator's arenas), so the launcher never holds a model while the ranks run."""
    import multiprocessing

    if "fork" in multiprocessing.get_all_start_methods():
        proc = multiprocessing.get_context("fork").Process(target=_save_factory_build,
                                                           args=(spec, factory_options, str(path)))
        proc.start()
        proc.join(timeout_s)
        if proc.is_alive():  # a factory that never returns is bounded by the run's timeout, as the ranks are
            proc.kill()
            proc.join()
            raise RunError(f"building {spec!r} to write its weights did not finish within the {timeout_s:g} "
                           "s timeout; raise --timeout, or run stageplan profile on it to see where it stops")
        if proc.exitcode == 0 and path.exists():
            return
        raise WorkloadError(f"building {spec!r} to write its weights failed (exit code {proc.exitcode}); "
                            "run stageplan profile on it to see the error")
    _save_factory_build(spec, factory_options, str(path))


def _save_factory_build(spec: str, factory_options: dict[str, Any], path: str) -> None:
    from stageplan.zoo import build_workload

    torch.set_num_threads(1)
    wl = build_workload(spec, factory_options)
    save_checkpoint(wl.model, path)
    torch.save({"inputs": wl.inputs, "target": wl.target}, Path(path).with_name("data.pt"))


def _rank_workload(workload: Workload | str, factory_options: dict[str, Any] | None, weights: Any,
                   run_dir: Path, timeout_s: float = 1800.0) -> tuple[Workload, str | None, str]:
    """The workload the ranks get: its model with parameters on meta, its inputs real. Where the weights come
    from: ``weights`` when given; else, when the whole model fits here, the user's own factory build written
    as a checkpoint (built once, freed before the ranks start); else each rank initialises its tensors by
    FQN."""
    import dataclasses

    given = _given_weights(weights, run_dir)
    if isinstance(workload, Workload):
        meta = dataclasses.replace(workload, model=meta_model(workload), model_fn=None)
        if given is not None:
            return meta, given, "the given weights"
        if workload.model is not None:
            save_checkpoint(workload.model, run_dir / "weights.safetensors")
            return meta, str(run_dir / "weights.safetensors"), "the workload's model"
        if parameter_bytes(meta.model) * 2 < _available_bytes() // 2:
            save_checkpoint(real_model(workload), run_dir / "weights.safetensors")
            return meta, str(run_dir / "weights.safetensors"), "the workload's model_fn (built once, saved)"
        return meta, None, "initialised by FQN (the model does not fit in one process)"
    from stageplan.zoo import build_workload

    with init_empty_weights():
        meta = build_workload(workload, factory_options or {})
    if given is not None:
        return meta, given, "the given weights"
    if parameter_bytes(meta.model) * 2 < _available_bytes() // 2:
        _build_and_save(workload, factory_options or {}, run_dir / "weights.safetensors", timeout_s)
        # the real build's data: a factory drawing its inputs from the global RNG after building its model
        # would draw other numbers when the model's initialisation ran on meta, where initialising draws no
        # random numbers
        data = torch.load(run_dir / "data.pt", weights_only=False)
        meta.inputs, meta.target = data["inputs"], data["target"]
        return meta, str(run_dir / "weights.safetensors"), "the factory (built once, saved, freed)"
    return meta, None, "initialised by FQN (the model does not fit in one process)"


def check_steps_and_timeout(steps: object, warmup: object, timeout_s: object) -> None:
    """A run's counts and its timeout: refused before any process starts, and by compare and tune before their
    profile."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1 or isinstance(warmup, bool) \
            or not isinstance(warmup, int) or warmup < 0:
        raise StageplanError(f"steps must be an integer >= 1 and warmup >= 0, got steps={steps}, "
                             f"warmup={warmup}; e.g. --steps 20 --warmup 3")
    if isinstance(timeout_s, bool) or not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s)
                                           and timeout_s > 0):
        raise StageplanError(f"timeout must be > 0 seconds, got {timeout_s}; e.g. --timeout 300")


def _run_options(
    plan: Plan,
    *,
    steps: int,
    warmup: int,
    optimizer: str | None,
    lr: float | None,
    check: bool,
    backend: str | None,
    timeout_s: float,
    pin_cpus: bool = True,
    retime: bool = True,
    sharding: str | None = None,
) -> dict[str, Any]:
    """Validate every run option before any process starts."""
    from stageplan.running.replicas import check_replicas

    check_steps_and_timeout(steps, warmup, timeout_s)
    planned_sharding = str(plan.cost_options.get("sharding") or "ddp")
    the_sharding = sharding or planned_sharding
    check_replicas(plan, the_sharding)
    opt = (optimizer or str(plan.cost_options.get("optimizer", "sgd"))).lower()
    if opt not in OPTIMIZERS:
        raise StageplanError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise StageplanError(f"learning rate must be a finite number > 0, got {lr!r}; e.g. --lr 0.01")
    planned = str(plan.cost_options.get("optimizer") or opt).lower()
    if opt != planned:
        import warnings

        warnings.warn(f"the plan priced a {planned} step and this run steps {opt}: the report's predicted "
                      f"step and idle times still hold the {planned} step; plan with --optimizer {opt} to "
                      f"compare like with like",
                      stacklevel=3)
    backend = _backend(backend, plan.num_ranks * plan.data_parallel * plan_tensor_parallel(plan))
    # after the measured steps, a few more with the per-layer clock's hooks on (about 11 us per layer and
    # microbatch, measured on a 2-core CPU host): the step and compute medians come from steps without them
    clock_steps = min(5, max(2, steps // 4))
    if the_sharding.split("-")[0] != planned_sharding and plan.data_parallel > 1:
        import warnings

        warnings.warn(f"the plan priced {planned_sharding} replicas and this run shards them as "
                      f"{the_sharding}: the report's predicted memory and sync are the plan's; plan with "
                      f"--sharding {the_sharding.split('-')[0]} to compare like with like", stacklevel=3)
    return {"steps": steps, "warmup": warmup, "clock_steps": clock_steps, "optimizer": opt,
            "sharding": the_sharding,
            "lr": float(lr) if lr is not None else DEFAULT_LR[opt], "check": bool(check), "backend": backend,
            "timeout_s": float(timeout_s), "pin_cpus": bool(pin_cpus), "comm_slice_ns": comm_slice_ns(),
            "retime": bool(retime)}


def _backend(backend: str | None, num_ranks: int) -> str:
    backend = backend or "gloo"
    if backend not in ("gloo", "nccl"):
        raise StageplanError(f"unknown backend {backend!r}; use gloo (CPU) or nccl (CUDA)")
    if backend == "nccl" and torch.cuda.device_count() < num_ranks:
        raise StageplanError(f"backend nccl needs one CUDA GPU per rank ({num_ranks}) and this machine has "
                             f"{torch.cuda.device_count()}; use --backend gloo")
    return backend


def _warn_oversubscribed(num_ranks: int, backend: str) -> None:
    import warnings

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if backend == "gloo" and num_ranks > cores:
        warnings.warn(f"{num_ranks} local ranks share {cores} CPU cores: ranks will wait for each other and "
                      "the measured step will exceed the prediction; use at most one rank per core",
                      stacklevel=3)


def _needs_fork(wl: Workload) -> bool:
    """True when the workload refers to code in ``__main__`` (a script or notebook): a fresh interpreter
    could not unpickle it."""
    try:
        data = pickle.dumps(wl)
    except Exception:
        return False  # the payload path reports what cannot be pickled
    if b"__main__" not in data:
        return False
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        raise WorkloadError(
            "the workload uses classes or functions defined in __main__ (a script or notebook), which rank "
            "processes cannot import on this platform (no fork); move them into a module and pass "
            "'package.module:factory'"
        )
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Forked:
    """A forked rank, with Popen's poll()/pid/wait() so the watcher treats both kinds alike."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc
        self.pid = proc.pid

    def poll(self) -> int | None:
        return None if self.proc.exitcode is None else int(self.proc.exitcode)

    def wait(self, timeout: float | None = None) -> None:
        self.proc.join(timeout)


def _forked_rank(wl: Workload, plan: Plan, opts: dict[str, Any], run_dir: str, rank: int, world: int,
                 env: dict[str, str], log: str) -> None:
    os.setsid()  # its own process group, as the spawned ranks have: the watcher ends a rank with killpg
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
    sys.stderr = sys.stdout
    os.environ.update(env)
    rank_entry(run_dir, rank, lambda: train_rank(run_dir, rank, world, (wl, plan, opts)))


# the rendezvous port is free when chosen, but another process can take it before rank 0 binds it
PORT_TRIES = 3


def _spawn_and_wait(run_dir: Path, world: int, timeout_s: float, progress: bool,
                    forked: tuple[Workload, Plan, dict[str, Any]] | None = None,
                    stop: Path | None = None) -> None:
    """Start ``world`` ranks on a free local port and watch them until all exit 0 (see :func:`_watch`). When
    rank 0 could not listen on the port because something took it after it was chosen (EADDRINUSE: no rank has
    started any work yet), start again on another port, up to ``PORT_TRIES`` times within the one
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for attempt in range(1, PORT_TRIES + 1):
        try:
            _watch(run_dir, world, deadline, timeout_s, progress, forked, _free_port(), stop)
            return
        except RunError as exc:
            if attempt == PORT_TRIES or "EADDRINUSE" not in str(exc):
                raise
            for stale in run_dir.glob("rank*.error"):
                stale.unlink()


# after a Ctrl-C, how long the ranks get to finish their step and write what they measured
STOP_GRACE_S = 60.0


def _watch(run_dir: Path, world: int, deadline: float, timeout_s: float, progress: bool,
           forked: tuple[Workload, Plan, dict[str, Any]] | None, port: int, stop: Path | None = None) -> None:
    """Watch the ranks until every one exits 0. A rank that fails ends them all (RunError naming it), and so
    does the deadline. With ``stop`` (a training run's stop file), a first Ctrl-C creates it, and the ranks
    stop together after their current step (:func:`stageplan.running.executor._stop_requested`) and exit 0
    within ``STOP_GRACE_S``; a second Ctrl-C, or the grace running out, ends them at once."""
    procs: list[Any] = []
    logs = [run_dir / f"rank{r}.log" for r in range(world)]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", "STAGEPLAN_PARENT_PID": str(os.getpid()),
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "PYTHONUNBUFFERED": "1"}
    forward = _ProgressForwarder(logs[0], enabled=progress)
    try:
        for r in range(world):
            env_r = dict(env, RANK=str(r), LOCAL_RANK=str(r))
            if forked is not None:
                import multiprocessing

                ctx = multiprocessing.get_context("fork")
                proc = ctx.Process(target=_forked_rank,
                                   args=(*forked, str(run_dir), r, world, env_r, str(logs[r])))
                proc.start()
                procs.append(_Forked(proc))
            else:
                with open(logs[r], "wb") as log:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "stageplan.running.rank", str(run_dir), str(r), str(world)],
                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        env={**os.environ, **env_r}, start_new_session=True,
                    ))
        stopping = False
        while True:
            try:
                forward.poll()
                time.sleep(0.05)
            except KeyboardInterrupt:
                if stop is None or stopping:
                    raise  # a second Ctrl-C, or a task that cannot stop between steps: end every rank now
                stopping = True
                stop.touch()
                deadline = min(deadline, time.monotonic() + STOP_GRACE_S)
                print(f"stageplan: interrupted: the ranks stop after their current step and write what they "
                      f"measured (at most {STOP_GRACE_S:g} s; Ctrl-C again ends them at once)",
                      file=sys.stderr, flush=True)
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # A rank that fails often takes its peers down with it (their sockets close): give them a
                # moment to exit, then blame the root cause: a rank killed by a signal, else the earliest
                # error that is not a lost connection.
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
                forward.poll()
                return
            if time.monotonic() > deadline:
                _kill_all(procs)
                if stopping:
                    raise KeyboardInterrupt
                raise RunError(f"the run did not finish within the {timeout_s:g} s timeout; all {world} "
                               f"ranks were ended; logs in {run_dir}; raise --timeout, or ask for less work "
                               f"(fewer --steps)", log_path=str(run_dir))
    finally:
        _kill_all(procs)


class _ProgressForwarder:
    """Copies rank 0's progress lines from its log to stderr (plain lines: a step a line)."""

    def __init__(self, log: Path, *, enabled: bool) -> None:
        self.log, self.enabled, self.offset = log, enabled, 0

    def poll(self) -> None:
        if not self.enabled or not self.log.exists():
            return
        with open(self.log, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        for line in chunk[:end].decode(errors="replace").splitlines():
            if line.startswith(PROGRESS_PREFIX):
                text = line[len(PROGRESS_PREFIX):]
                step = re.fullmatch(r"step (\d+)/(\d+) ([\d.]+) ms", text)  # steps left at this pace
                left = (int(step[2]) - int(step[1])) * float(step[3]) / 1e3 if step else None
                print(f"run: {text}" + (f" (about {duration(left)} left)" if left else ""), file=sys.stderr,
                      flush=True)


_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed",
              "timed out")


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


def _kill_all(procs: list[Any]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                # a forked rank killed before its setsid() has no group of its own yet: end the process itself
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=10)


def torchrun_main(workload: Workload, plan: Plan | str | os.PathLike[str], *, steps: int = 20,
                  warmup: int = 3,
                  optimizer: str | None = None, lr: float | None = None, check: bool = False,
                  backend: str | None = None,
                  timeout_s: float = 300.0, output: str | os.PathLike[str] | None = None,
                  weights: str | os.PathLike[str] | None = None, pin_cpus: bool = True,
                  retime: bool = True, sharding: str | None = None) -> RunReport | None:
    """One rank under torchrun (rank and world size from the environment); rank 0 returns the RunReport.

    Every rank builds the workload itself: its model with parameters on meta (build it inside
    :func:`stageplan.materialize.init_empty_weights`), materialising only its own stage from ``weights``, or
    initialised by FQN, identically on every rank. A model built with real parameters is used as it is; then
    the factory must be seeded, and a checksum of the initial weights is compared across ranks.
    """
    the_plan = load_plan(plan)
    rank, world = torchrun_rank()
    opts = _run_options(the_plan, steps=steps, warmup=warmup, optimizer=optimizer, lr=lr, check=check,
                        backend=backend, timeout_s=timeout_s, pin_cpus=pin_cpus, retime=retime,
                        sharding=sharding)
    _refuse_estimate_on_cpu(the_plan, opts["backend"])
    if rank == 0:
        _warn_precision(the_plan)
    share = the_plan.num_microbatches * the_plan.data_parallel
    opts["microbatch_size"] = workload.batch_size // share if workload.batch_size % share == 0 else None
    if workload.model is None:  # a model_fn workload: build it weightless here
        import dataclasses

        workload = dataclasses.replace(workload, model=meta_model(workload), model_fn=None)
    real = [p for p in workload.model.parameters() if p.device.type != "meta"]
    if weights is not None:
        Checkpoint(weights)
        if real:
            raise StageplanError("the workload's model was built with real parameters, so --weights would "
                                 "not be read; build it inside stageplan.materialize.init_empty_weights() "
                                 "(the CLI does) to load them")
    opts["weights"] = None if weights is None else str(weights)
    opts["weights_from"] = ("the given weights" if weights is not None else
                            "each rank's own factory build" if real else "initialised by FQN")
    if output is not None and rank == 0:
        check_output_path(output, (plan, weights))
    check_tensor_parallel_run(workload.model, the_plan)
    validate(workload, the_plan, world_size=world)
    if real:
        opts["weights_checksum"] = float(sum(float(p.detach().double().sum()) for p in real))
    with tempfile.TemporaryDirectory(prefix="stageplan-torchrun-") as tmp:
        report_path = str(Path(tmp) / "report.json") if rank == 0 else None
        worker_main(workload, the_plan, rank=rank, world_size=world, options=opts, report_path=report_path)
        if report_path is None:
            return None
        report = RunReport.load(report_path)
    if output is not None:
        save_or_keep(report, output)
    return report
