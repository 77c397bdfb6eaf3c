"""The timed step loop of one pipeline rank: build its stages, train, measure with measure.py (torch).

Rank 0 gathers every rank's measurements, runs the single-process check when asked (check.py) and writes the
RunReport (runreport.py). Spawning and watching the ranks is launch.py's job. The executor takes a Plan and
nothing else from the planning side (it never imports stageplan.planning).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import gc
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from stageplan.errors import RunError, StageplanError, WorkloadError
from stageplan.formats.link import save_link
from stageplan.formats.plan import Plan
from stageplan.formats.runreport import RunReport
from stageplan.formats.schedule import TRANSFER_KINDS
from stageplan.materialize import Checkpoint
from stageplan.measure import (
    HeapTrim,
    LayerClock,
    SavedTensorTracker,
    Timer,
    median_iqr,
    microbatch_size_for,
    release_free_memory,
    resident_bytes,
    steady_allocator,
)
from stageplan.running.link import dp_allreduce_probe, dp_sync_probe, ping_pong, probe_sizes
from stageplan.running.replicas import (
    Mesh,
    SyncClock,
    ddp_exposed,
    full_value,
    local_bytes,
    make_mesh,
    make_replica_optimizer,
    no_sync_inference,
    optimizer_state_bytes,
    replica_share,
    wrap_stage,
)
from stageplan.running.stages import (
    RankStages,
    batch_target,
    build_rank_stages,
    cut_rank_stages,
    first_microbatch_of_plan,
    reference_model,
    sync_tied_grads,
)
from stageplan.running.tensor import (
    CollectiveCounter,
    base_prefix,
    model_tp_plan,
    parallelize_stage,
    plan_tensor_parallel,
)
from stageplan.workload import Workload


def _thread_ids() -> list[int]:
    """Every thread of this process (Linux: /proc/self/task); elsewhere 0, the calling thread."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def pin_rank_cpus(local_rank: int, local_world: int) -> list[int] | None:
    """Give this rank's process its own block of the CPUs it may use: local rank r gets ``cpus[r*k:(r+1)*k]``,
    k = len(cpus) // local_world. Every thread it has now is moved, and threads it starts later (gloo's)
    inherit the block. Returns the block; None where affinity is not available (not Linux) or cannot be set,
    and, with nothing changed, where there are fewer CPUs than local ranks.

    Why: unpinned, the kernel can queue a rank's gloo thread behind the other rank's compute thread on the
    other core. Measured on a 2-core CPU host, posting a send or receive then blocked 2.7-6.3 ms and a gpt
    1F1B m=8 step ranged over 140-168 ms; pinned, the same run's steps were 142.7-145.6 ms (README,
    limitations)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if local_world < 1 or len(cpus) < local_world or not 0 <= local_rank < local_world:
        return None
    k = len(cpus) // local_world
    block = cpus[local_rank * k:(local_rank + 1) * k]
    try:
        for tid in _thread_ids():
            os.sched_setaffinity(tid, block)
    except OSError:
        return None
    return block


COMM_SLICE_NS = 100_000  # 0.1 ms, the kernel's shortest custom slice
SLICE_ENV = "STAGEPLAN_COMM_SLICE_US"


def comm_slice_ns() -> int:
    """The slice the backend's threads get (:func:`short_comm_slices`), in ns: ``$STAGEPLAN_COMM_SLICE_US``
    microseconds, 0 to leave the kernel's own, unset for 100 (0.1 ms)."""
    text = os.environ.get(SLICE_ENV, "").strip()
    if not text:
        return COMM_SLICE_NS
    try:
        us = float(text)
    except ValueError:
        us = float("nan")
    if not (us == 0 or 100 <= us <= 100_000):  # the kernel takes custom slices of 0.1-100 ms
        raise StageplanError(f"{SLICE_ENV} must be 0 (the kernel's own slice) or 100-100000 microseconds, "
                             f"got {text!r}; unset it for the default 100")
    return round(us * 1e3)


class _SchedAttr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32),
                ("sched_flags", ctypes.c_uint64),
                ("sched_nice", ctypes.c_int32), ("sched_priority", ctypes.c_uint32),
                ("sched_runtime", ctypes.c_uint64),
                ("sched_deadline", ctypes.c_uint64), ("sched_period", ctypes.c_uint64),
                ("sched_util_min", ctypes.c_uint32), ("sched_util_max", ctypes.c_uint32)]


_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}  # sched_getattr is the next number on both


def short_comm_slices(slice_ns: int = COMM_SLICE_NS) -> int:
    """Give every thread of this process but the calling one (the compute thread; the others are the
    backend's: gloo's loop and worker threads) a short scheduler slice, and return how many threads now have
    it (0 where the kernel or platform has no per-thread slice: Linux before 6.12 ignores it for normal tasks,
    and reads it back as 0, so nothing is claimed there).

    Why: Linux's EEVDF scheduler lets a running thread finish its slice (the base slice of
    kernel/sched/fair.c, which grows with the CPU count: 1.4 ms on a 2-CPU host) before a thread that wakes on
    its CPU may run, unless the waking thread's own slice is shorter (per-thread slices since Linux 6.12, set
    through ``sched_setattr``). A gloo send posted before its receiver was ready waits for the receiver's
    "ready" message, which gloo's loop thread on the sender handles; with the sender's compute thread busy on
    the same CPU, that took up to a slice or more. Measured on a 2-core CPU host by ``make bench`` (sender
    busy 10 ms after posting, receiver posting 0.5 ms later, 3 alternations of 20 crossings): at the kernel's
    slice 31-57 of 60 crossings took over 1 ms (medians 1.3-3.2 ms, worst 5.2 ms); at 0.1 ms 0-1 of 60
    (medians 0.11-0.13 ms). In a traced convnet GPipe step the receiving rank sat idle 1.6-2.6 ms on such
    crossings; the bench's whole steps moved 0.92-1.03x, inside the noise (README, limitations)."""
    import platform

    number = _SYS_SCHED_SETATTR.get(platform.machine())
    if slice_ns <= 0 or number is None or not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    me = threading.get_native_id()
    done = 0
    for tid in _thread_ids():
        if tid in (me, 0):
            continue
        attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_policy=0, sched_runtime=int(slice_ns))
        if libc.syscall(number, tid, ctypes.byref(attr), 0) != 0:
            continue  # the thread ended meanwhile, or the kernel refuses the attribute
        back = _SchedAttr()
        if libc.syscall(number + 1, tid, ctypes.byref(back), ctypes.sizeof(_SchedAttr), 0) == 0 \
                and back.sched_runtime == int(slice_ns):
            done += 1
    return done


def join_process_group(backend: str, rank: int, world_size: int, timeout_s: float) -> None:
    """init_process_group, with a failure to meet the other ranks (a missing peer past the timeout, an
    unreachable or mistyped MASTER_ADDR) said in one line as a RunError (the original stays its cause)."""
    import torch.distributed as dist

    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=_dt.timedelta(seconds=timeout_s))
    except (dist.DistError, ValueError, RuntimeError) as exc:
        where = (f"{os.environ.get('MASTER_ADDR', '(no MASTER_ADDR)')}:"
                 f"{os.environ.get('MASTER_PORT', '(no MASTER_PORT)')}")
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise RunError(f"rank {rank} of {world_size} could not join the other ranks at {where} within "
                       f"{timeout_s:g} s ({type(exc).__name__}: {first}); start every rank with the same "
                       "MASTER_ADDR, MASTER_PORT and WORLD_SIZE (torchrun sets them), and check that rank 0 "
                       "is reachable", rank=rank) from exc


def process_cpus() -> list[int] | None:
    """The CPUs any thread of this process may run on now
    (gloo's threads included); None where not knowable."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus: set[int] = set()
    for tid in _thread_ids():
        try:
            cpus |= os.sched_getaffinity(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(cpus)


def _device(backend: str, rank: int, world_size: int, pin: bool) -> tuple[torch.device, list[int] | None]:
    """This rank's device, and the CPUs it was pinned to (None: not pinned). CPU ranks (gloo) are pinned,
    before the process group so gloo's threads start on the rank's own CPUs; CUDA ranks are left as the
    launcher bound them (numactl, srun --cpu-bind), which knows the machine's NUMA layout."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device, None
    cpus = pin_rank_cpus(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))) if pin else None
    # ranks share the cores: one intra-op thread each (with two busy ranks on two cores, a rank ran 2.2x
    # slower with two intra-op threads than with one, measured on a 2-core CPU host)
    torch.set_num_threads(1)
    steady_allocator()  # the profiler measured with large buffers reused; so does the run
    return torch.device("cpu"), cpus


def _check_same_weights(options: dict[str, Any], world_size: int) -> None:
    """Under torchrun every rank built its own model; their initial weights must agree."""
    import torch.distributed as dist

    if "weights_checksum" not in options:
        return
    sums: list[Any] = [None] * world_size
    dist.all_gather_object(sums, options["weights_checksum"])
    if len({round(float(x), 6) for x in sums}) != 1:
        raise WorkloadError(
            f"ranks built different initial weights (checksums {sums}); seed the model factory "
            "(torch.manual_seed) so every rank builds the same model"
        )


# on a receive's P2POp: (kind, stage, microbatch) of the chunk call it feeds
_RECEIVE_TAG = "_stageplan_receive"


class _Works(list[Any]):
    """The works torch's ``_batch_p2p`` returned for one batch of P2P ops, and the receives among them:
    (kind, stage, microbatch, wall time of the post)."""

    receives: tuple[tuple[str, int, int, float], ...] = ()


@dataclass
class _Instruments:
    """The rank's timer, per-layer clock and saved-bytes tracker, wrapped around its stages'
    forward/backward/loss calls, and the waits of its loop on receives."""

    timer: Timer
    tracker: SavedTensorTracker
    clock: LayerClock
    # the hooks run in warm-up steps only (they cost about 6%
    # of a small stage's time, measured on a 2-core CPU host)
    tracking: bool = True
    # per receive waited on, the wall time torch posted it: (kind, stage, microbatch) -> time.time()
    posted: dict[tuple[str, int, int], float] = field(default_factory=dict)
    # the heap's free pages handed back after long chunk calls (CPU)
    trim: HeapTrim = field(default_factory=HeapTrim)

    def saving(self) -> Any:
        return self.tracker.hooks() if self.tracking else contextlib.nullcontext()

    @contextlib.contextmanager
    def receive_waits(self) -> Any:
        """Time each wait of torch's schedule loop on a receive, as an interval of kind "A" (an activation,
        for the stage's forward) or "G" (a gradient, for its backward), labelled with the receiving chunk
        call's stage and microbatch: the receive's P2POps carry the label from :meth:`wrap`, ``_batch_p2p``
        (every batch of P2P ops goes through it) keeps the labels and the post's wall time with its works, and
        ``_wait_batch_p2p`` is timed where they have one. On CUDA the timer's events bracket the wait on the
        stream, so the interval is how long the stream waited for the message. Within the block only; torch's
        module is restored after."""
        from torch.distributed.pipelining import schedules as sched

        batch, wait = sched._batch_p2p, sched._wait_batch_p2p

        def _batch_p2p(p2p_ops: Any, *a: Any, **k: Any) -> Any:
            tags = list(
                dict.fromkeys(getattr(op, _RECEIVE_TAG) for op in p2p_ops if hasattr(op, _RECEIVE_TAG)))
            posted = time.time()
            works = _Works(batch(p2p_ops, *a, **k))
            works.receives = tuple((*t, posted) for t in tags)
            return works

        def _wait_batch_p2p(work: Any, *a: Any, **k: Any) -> Any:
            receives = getattr(work, "receives", ())
            if not receives:
                return wait(work, *a, **k)
            (kind, s, mb, posted), *more = receives
            self.posted[(kind, s, mb)] = posted
            out = self.timer.record(kind, s, mb, lambda: wait(work, *a, **k))
            for kind, s, mb, posted in more:
                # one wait for several chunks' inputs: the others arrived with it
                self.posted[(kind, s, mb)] = posted
                self.timer.record(kind, s, mb, lambda: None)
            return out

        sched._batch_p2p, sched._wait_batch_p2p = _batch_p2p, _wait_batch_p2p
        try:
            yield
        finally:
            sched._batch_p2p, sched._wait_batch_p2p = batch, wait

    def wrap(self, st: Any) -> None:
        """Time each chunk's forward (F), backward (B) and weight-gradient (W) call on this PipelineStage, and
        label its receives' P2POps for :meth:`receive_waits`."""
        fwd, bwd = st.forward_one_chunk, st.backward_one_chunk
        bwd_w = getattr(st, "backward_weight_one_chunk", None)
        s = st.stage_index
        fwd_recv, bwd_recv = st.get_fwd_recv_ops, st.get_bwd_recv_ops

        def get_fwd_recv_ops(chunk: int, *a: Any, **k: Any) -> Any:
            ops = fwd_recv(chunk, *a, **k)
            for op in ops:
                setattr(op, _RECEIVE_TAG, ("A", s, chunk))
            return ops

        def get_bwd_recv_ops(chunk: int, *a: Any, **k: Any) -> Any:
            ops = bwd_recv(chunk, *a, **k)
            for op in ops:
                setattr(op, _RECEIVE_TAG, ("G", s, chunk))
            return ops

        st.get_fwd_recv_ops = get_fwd_recv_ops
        st.get_bwd_recv_ops = get_bwd_recv_ops

        def trimmed(kind: str, chunk: int, call: Callable[[], Any]) -> Any:
            t0 = time.perf_counter()
            out = self.timer.record(kind, s, chunk, call)
            self.trim.after(time.perf_counter() - t0)  # outside the timed call: see measure.HeapTrim
            return out

        def forward_one_chunk(chunk: int, *a: Any, **k: Any) -> Any:
            with self.saving(), self.clock.phase("F", s):
                return trimmed("F", chunk, lambda: fwd(chunk, *a, **k))

        def backward_one_chunk(chunk: int, *a: Any, **k: Any) -> Any:
            with self.clock.phase("B", s):
                return trimmed("B", chunk, lambda: bwd(chunk, *a, **k))

        st.forward_one_chunk = forward_one_chunk
        st.backward_one_chunk = backward_one_chunk
        if bwd_w is not None:
            def backward_weight_one_chunk(chunk: int, *a: Any, **k: Any) -> Any:
                with self.clock.phase("W", s):
                    return trimmed("W", chunk, lambda: bwd_w(chunk, *a, **k))

            st.backward_weight_one_chunk = backward_weight_one_chunk


@dataclass
class _Samples:
    """Per measured step: the rank's step time, compute by
    kind, thread CPU, the rest (tied sync + optimizer)."""

    step_s: list[float] = field(default_factory=list)
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)
    compute_cpu_s: list[float] = field(default_factory=list)
    other_s: list[float] = field(default_factory=list)
    # of other_s, the tied gradients' sum (the all-reduce, and
    # on a rank that gets there first its wait for the others)
    tied_sync_s: list[float] = field(default_factory=list)
    # of other_s, optimizer.step() alone (after the tied sum)
    optimizer_step_s: list[float] = field(default_factory=list)
    # the loop's waits on receives (inside step(), outside the chunk calls)
    receive_wait_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    peak_activation_bytes: list[int] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    # per clocked step, seconds per microbatch: {layer: [forward,
    # backward]} and {stage: [forward, backward]} overhead
    layer_s: list[dict[int, list[float]]] = field(default_factory=list)
    overhead_s: list[dict[int, list[float]]] = field(default_factory=list)
    # the chunks' calls in the clock's steps, as compute_s
    clock_compute_s: list[float] = field(default_factory=list)
    # per measured step, each chunk call as (kind, stage,
    # microbatch, seconds, idle seconds before it: Timer.drain)
    calls: list[list[tuple[str, int, int, float, float]]] = field(default_factory=list)
    # the launcher asked the ranks to stop (Ctrl-C): the loop ended after the step it was in
    interrupted: bool = False
    # with replicas: per measured step, the data-parallel sync the rank waited for (replicas.SyncClock)
    dp_sync_s: list[float] = field(default_factory=list)
    # the bytes the rank held by kind after a warm-up step's backward (the most over the steps read)
    held: dict[str, int] = field(default_factory=dict)
    reading: bool = False  # hold() is called within this step

    def hold(self, rs: RankStages, sharding: str) -> None:
        """Read what the rank holds now: its modules' parameters and gradients as they stand (read after the
        schedule's step, and for FSDP2 also as its reduce begins, while they are still unsharded), and
        FSDP2's shards apart (the parameters its optimizer steps); each kind keeps the most read."""
        modules = [p for piece in rs.pieces for p in piece.parameters()]
        self._max("params", local_bytes(modules))
        self._max("grads", local_bytes([p.grad for p in modules]))
        if sharding.startswith("fsdp"):
            self._max("master", local_bytes(rs.unique_params))

    def _max(self, kind: str, value: int) -> None:
        self.held[kind] = max(self.held.get(kind, 0), value)

    def add_layers(self, phases: list[tuple[str, int, dict[int, float], float]], m: int) -> None:
        """One step's LayerClock phases, as seconds per microbatch
        (a weight-gradient phase counts as backward)."""
        layers: dict[int, list[float]] = {}
        overhead: dict[int, list[float]] = {}
        for kind, stage, times, rest in phases:
            j = 0 if kind in ("F", "L") else 1
            for layer, sec in times.items():
                layers.setdefault(layer, [0.0, 0.0])[j] += sec / m
            overhead.setdefault(stage, [0.0, 0.0])[j] += rest / m
        self.layer_s.append(layers)
        self.overhead_s.append(overhead)

    def layer_medians(self) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
        """Medians over the clocked steps of :attr:`layer_s` and :attr:`overhead_s`."""
        def med(rows: list[dict[int, list[float]]]) -> dict[int, list[float]]:
            keys = sorted({k for r in rows for k in r})
            return {k: [median_iqr([r.get(k, [0.0, 0.0])[j] for r in rows])[0] for j in (0, 1)] for k in keys}
        return med(self.layer_s), med(self.overhead_s)


def _schedule(plan: Plan, rs: RankStages, workload: Workload, ins: _Instruments) -> tuple[Any, float]:
    """The rank's torch schedule, and the factor that turns
    its recorded losses back into the microbatches' own.

    The step's gradient is the mean over microbatches. torch's schedules get it by dividing every parameter's
    gradient by m after the last backward (``scale_grads=True``, their default in
    torch/distributed/pipelining/schedules.py): one more pass over all of a rank's gradients, inside
    ``step()`` and outside any chunk call, which the cost model does not price (1.3-2.9 ms a step over the
    bench models' gradients, measured on a 2-core CPU host). Dividing each microbatch's loss by m instead
    gives the same gradient, as the single-process reference computes it (``(loss / m).backward()``), at the
    cost of one scalar op. Where a torch release has no ``scale_grads``, the schedule is built as torch builds
    it, and the factor is 1."""
    import inspect

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    m = plan.num_microbatches
    last_stage = plan.num_chunks - 1
    calls = [0]
    cls = get_schedule_class(plan.schedule)
    by_loss = "scale_grads" in inspect.signature(cls.__init__).parameters
    divisor = float(m) if by_loss else 1.0

    initializing = [False]

    def loss_fn(output: Any, target: Any) -> Any:
        tgt = target if workload.target is not None else None
        if initializing[0]:  # torch's shape inference on the first step, not a microbatch's loss: not counted
            return workload.compute_loss(output, tgt) / divisor
        mb = calls[0] % m
        calls[0] += 1
        with ins.saving(), ins.clock.phase("L", last_stage):
            return ins.timer.record("F", last_stage, mb, lambda: workload.compute_loss(output, tgt) / divisor)

    single = issubclass(cls, PipelineScheduleSingle)
    extra = {"scale_grads": False} if by_loss else {}
    schedule = cls(rs.stages[0] if single else rs.stages, n_microbatches=m, loss_fn=loss_fn, **extra)
    # torch 2.13 infers the stages' gradient shapes on the first step by computing one loss on the last stage
    # (_initialize_stage(s) -> _prepare_backward_infra): counted, it would shift every later loss's microbatch
    # label by one
    for name in ("_initialize_stage", "_initialize_stages"):
        initialize = getattr(schedule, name, None)
        if initialize is not None:
            def flagged(*a: Any, _initialize: Any = initialize, **k: Any) -> Any:
                initializing[0] = True
                try:
                    return _initialize(*a, **k)
                finally:
                    initializing[0] = False

            setattr(schedule, name, flagged)
    return schedule, divisor


def _train(plan: Plan, workload: Workload, rs: RankStages, device: torch.device, options: dict[str, Any],
           ins: _Instruments, mesh: Mesh | None = None, counter: CollectiveCounter | None = None) -> _Samples:
    import torch.distributed as dist

    mesh = mesh or Mesh(dist.get_rank(), 0, plan.num_ranks, 1)
    sharding = str(options.get("sharding") or "ddp")
    schedule, loss_divisor = _schedule(plan, rs, workload, ins)
    optimizer = make_replica_optimizer(options["optimizer"], rs.unique_params, float(options["lr"]), sharding,
                                       mesh)
    # ZeRO-1's bucket views moved the parameters into its buckets: their new storages are parameters too
    ins.tracker.exclude.update(_local(p).untyped_storage().data_ptr() for p in rs.unique_params)
    # what building the stage freed goes back to the system once, before the first step: the parameters'
    # first storages where ZeRO-1 copied them into its buckets or FSDP2 into its shards (in the heap below
    # the steady allocator's 32 MiB mmap threshold), which later tensors of other sizes reuse only in part
    if ins.trim.enabled:
        release_free_memory()
    sync = SyncClock(device)
    sync.attach(rs.stages, optimizer)
    d = mesh.data_parallel
    # DDP's gradients are views into its buckets (gradient_as_bucket_view): set to None, the next step's
    # microbatches under no_sync accumulate into fresh tensors beside the buckets until the last one's
    # reduction copies them in, a second copy of the stage's gradients that the plan does not count (2 x 2
    # DDP of a 1 GB GPT: 0.5 GB a rank above its plan, measured on a 2-core CPU host). Zeroed in place, they
    # stay the buckets' views, as DistributedDataParallel's gradient_as_bucket_view documents.
    in_place = d > 1 and sharding in ("ddp", "zero1")
    # FSDP2's all-gather, timed at the step's start (SyncClock.gather); resharded after every forward, it
    # gathers again inside each forward and backward, which the plan does not price as sync
    gather = d > 1 and sharding == "fsdp"
    out = _Samples()
    if d > 1 and sharding.startswith("fsdp"):
        for st in rs.stages:  # FSDP2's unsharded parameters and gradients, read as its reduce begins
            def reduce(*a: Any, _reduce: Any = st.perform_reduce_grad, **k: Any) -> Any:
                if out.reading:
                    out.hold(rs, sharding)
                return _reduce(*a, **k)

            st.perform_reduce_grad = reduce
    # each replica trains its own share of the global batch
    inputs = tuple(replica_share(a.to(device), mesh.dp_rank, d) if isinstance(a, torch.Tensor) else a
                   for a in workload.input_tuple())
    target = batch_target(workload)
    target = replica_share(target.to(device), mesh.dp_rank, d) if isinstance(target, torch.Tensor) else target
    has_first = 0 in rs.indices
    has_last = plan.num_chunks - 1 in rs.indices
    steps, warmup, clocked = int(options["steps"]), int(options["warmup"]), int(options.get("clock_steps", 0))
    rank = dist.get_rank()
    bounds = plan.boundaries
    # the ties this rank sums with other ranks (one it does not hold costs it nothing)
    summing = any(a and any(n in rs.params for n in names) for a, (names, _) in zip(rs.ties_across, rs.ties))
    # on CUDA, where this rank sums a tie with others, the sum is timed apart between two synchronisations
    sync_apart = device.type == "cuda" and summing
    # the parameters' storages: a step's gathered FSDP2 parameters join them for that step only
    own_storages = set(ins.tracker.exclude)
    # the first step's first chunk call counts from here, as every later one from its step's mark
    ins.timer.mark()
    for step in range(warmup + steps + clocked):
        ins.tracking = step < warmup or warmup == 0
        # the clock's own steps come last, outside the measured ones
        ins.clock.enabled = step >= warmup + steps
        for p in rs.unique_params:
            if in_place and p.grad is not None:
                p.grad.zero_()  # DDP's bucket view: kept, so the next backward accumulates into it
            else:
                p.grad = None
        # every rank gets the same answer, so they stop together
        if _stop_requested(options.get("stop_file"), device):
            out.interrupted = True
            break
        ins.tracker.reset_peak()
        ins.tracker.exclude.intersection_update(own_storages)
        sync.spans.clear()
        out.reading = step < max(warmup, 1)  # warm-up steps (the first step when there is none)
        if counter is not None:
            # the tensor-parallel all-reduces of one whole step: the last warm-up step (the first step when
            # there is none), so that the counting dispatch mode slows no measured step
            counter.enabled = step == max(warmup, 1) - 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        wall0 = time.time()
        if gather:
            sync.gather()
        losses: list[Any] = []
        kwargs: dict[str, Any] = {"return_outputs": False}
        if has_last:
            kwargs.update(target=target, losses=losses)
        with ins.receive_waits():
            schedule.step(*(inputs if has_first else ()), **kwargs)
        if step == 0 and in_place:
            _rebuild_ddp_buckets(rs)
        if out.reading:  # what the rank holds by kind, once the backward has made its gradients
            out.hold(rs, sharding)
        if sync_apart:  # the backward's queued kernels end before the sum
            torch.cuda.synchronize(device)
        t_other = time.perf_counter()
        sync_tied_grads(rs.ties, rs.params, device, across=rs.ties_across, groups=rs.tie_groups)
        if sync_apart:  # the all-reduce's own end
            torch.cuda.synchronize(device)
        t_sync = time.perf_counter()
        if optimizer is not None:
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        if out.reading:
            out._max("optimizer", optimizer_state_bytes(optimizer))
        # after a long sync and optimizer step as after a long chunk call (measure.HeapTrim): FSDP2's gathered
        # parameters and whole gradients, freed by then; outside the step's time (t0 comes after the
        # barrier that starts the next step, where every rank waits for the last: _stop_requested)
        ins.trim.after(t1 - t_other)
        ins.timer.mark()  # the next step's first chunk call is idle from here, through the barrier
        intervals = ins.timer.drain()
        phases = ins.clock.drain(lambda s: range(bounds[s], bounds[s + 1]))
        if ins.tracking:
            # the profiler's instrument, on every device (max allocated would add grads and states)
            out.peak_activation_bytes.append(ins.tracker.peak)
        if ins.clock.enabled:
            out.add_layers(phases, plan.num_microbatches)
            out.clock_compute_s.append(
                sum(sec for kind, _, _, _, sec, *_ in intervals if kind in Timer.BUSY_KINDS))
        elif step >= warmup:
            out.step_s.append(t1 - t0)
            out.forward_s.append(sum(sec for kind, _, _, _, sec, *_ in intervals if kind == "F"))
            out.backward_s.append(sum(sec for kind, _, _, _, sec, *_ in intervals if kind in ("B", "W")))
            out.compute_cpu_s.append(
                sum(cpu for kind, _, _, _, _, cpu, _ in intervals if kind in Timer.BUSY_KINDS))
            out.receive_wait_s.append(
                sum(sec for kind, _, _, _, sec, *_ in intervals if kind in TRANSFER_KINDS))
            out.calls.append(
                [(kind, s, mb, sec, idle) for kind, s, mb, _, sec, _, idle in intervals if idle is not None])
            out.other_s.append(t1 - t_other)
            exposed: dict[int, float] = {}
            if d > 1:  # DDP reduces inside the last backward; FSDP2 and ZeRO-1 where SyncClock times them
                backwards = [(s, mb, sec) for kind, s, mb, _, sec, *_ in intervals if kind == "B"]
                if sharding in ("ddp", "zero1"):
                    exposed = ddp_exposed(backwards, plan.num_microbatches)
                out.dp_sync_s.append(sync.seconds + sum(exposed.values()))
            out.tied_sync_s.append(t_sync - t_other)
            out.optimizer_step_s.append(t1 - t_sync)
            # every measured step's timeline replaces the one before (an interrupted run keeps its last
            # step's); a receive's wait also keeps when torch posted it, which the report's transfer bar
            # starts from
            out.timeline = [{"rank": rank, "stage": s, "microbatch": mb, "kind": kind, "start_wall": w,
                             "duration_s": sec, "step_wall": wall0,
                             **({"post_wall": ins.posted[(kind, s, mb)]} if kind in TRANSFER_KINDS
                                else {})}
                            for kind, s, mb, w, sec, *_ in intervals]
            # the step's tail as the simulator draws it: the tied all-reduce ("T", where a tie spans
            # ranks) and the optimizer step ("O"), on the rank's first stage, with no microbatch
            tail = [("T", t_other, t_sync)] if summing else []
            tail += [("O", t_sync, t1)] if optimizer is not None else []
            out.timeline += [{"rank": rank, "stage": min(rs.indices), "microbatch": -1, "kind": kind,
                              "start_wall": wall0 + (begin - t0), "duration_s": end - begin,
                              "step_wall": wall0}
                             for kind, begin, end in tail]
            if d > 1:
                out.timeline += _sync_events(rank, min(rs.indices), intervals, exposed, sync, wall0, t0,
                                             t_other, plan.num_microbatches)
            if rank == 0:  # the launcher forwards these lines of rank 0's log to the user
                print(f"stageplan-progress: step {step - warmup + 1}/{steps} {1e3 * (t1 - t0):.1f} ms",
                      flush=True)
        if has_last:
            out.losses.append(float(torch.stack([x.detach().float() for x in losses]).mean()) * loss_divisor)
    return out


def _sync_events(rank: int, first_stage: int, intervals: list[Any], exposed: dict[int, float],
                 sync: SyncClock, wall0: float, t0: float, t_other: float, m: int) -> list[dict[str, Any]]:
    """The step's data-parallel sync as timeline rows of kind "D", where torch ran it: DDP's exposed
    all-reduce (``exposed``, per stage) as the tail of that stage's last backward, and what SyncClock timed
    (a stage's ``perform_reduce_grad``, FSDP2's reduce-scatter after that stage's last backward, on the stage
    it reduces; FSDP2's all-gather of that stage's units at the step's start; ZeRO-1's broadcast inside
    the optimizer step, on the rank's first stage) at its own place on
    the CPU's clock; on CUDA, whose events carry no host time, those end where the schedule's step
    returned."""
    rows: list[dict[str, Any]] = []
    for kind, s, mb, w, sec, *_ in intervals:
        if kind == "B" and mb == m - 1 and exposed.get(s, 0.0) > 0:
            rows.append({"rank": rank, "stage": s, "microbatch": -1, "kind": "D",
                         "start_wall": w + sec - exposed[s], "duration_s": exposed[s], "step_wall": wall0})
    for a, b, stage in sync.spans:
        took = sync._seconds(a, b)
        begin = t_other - took if sync.cuda else a
        rows.append({"rank": rank, "stage": first_stage if stage is None else stage, "microbatch": -1,
                     "kind": "D", "start_wall": wall0 + (begin - t0), "duration_s": took, "step_wall": wall0})
    return rows


def _rebuild_ddp_buckets(rs: RankStages) -> None:
    """DDP rebuilds its gradient buckets once, in the order the first step's gradients became ready, at the
    next forward, allocating the new buckets (and copying the gradients into them) before freeing the old
    (torch/nn/parallel/distributed.py, ``_pre_forward``): at the second step's start that holds the
    parameters, the optimizer states and two copies of the gradients at once (0.49 GB of gradients a rank on a
    2 x 2 DDP run of a 1 GB GPT, whose resident set grew 0.44-0.58 GB in its second step with this and the
    gradients set to None, on a 2-core CPU host). Rebuilt here instead, after the first
    step's backward and before its optimizer step has made any state, where the two copies fit within the
    peak the plan prices; DDP's own call then finds the buckets rebuilt."""
    from torch.nn.parallel import DistributedDataParallel

    for st in rs.stages:
        module = st.submod
        if isinstance(module, DistributedDataParallel) and module.reducer._rebuild_buckets():
            module._has_rebuilt_buckets = True


def _local(t: torch.Tensor) -> torch.Tensor:
    """An FSDP2 shard's local tensor (a DTensor's), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _exclude_gathered_parameters(rs: RankStages, tracker: SavedTensorTracker) -> None:
    """FSDP2 gathers each unit's parameters into new storage before its forward; the backward saves them as a
    matmul's inputs, and they are parameters (the plan counts them as such), not activations: each module's
    forward adds its current parameters' storages to the tracker's exclusions (after FSDP2's own pre-forward
    hook, registered first, has gathered them); _train puts the set back to the shards' at each step."""
    def exclude(mod: torch.nn.Module, _args: Any) -> None:
        for prm in mod.parameters(recurse=False):
            tracker.exclude.add(_local(prm).untyped_storage().data_ptr())

    for piece in rs.pieces:
        for mod in piece.modules():
            if any(True for _ in mod.parameters(recurse=False)):
                mod.register_forward_pre_hook(exclude)


def _stop_requested(stop_file: str | None, device: torch.device) -> bool:
    """The step's opening barrier, which also tells every rank whether the launcher asked the run to stop
    (Ctrl-C): rank 0 looks for the launcher's stop file and an all-reduce (MAX) of its answer is the barrier
    itself, so all ranks break out of the loop at the same step. Without a stop file (torchrun, whose agent
    handles signals itself), a plain barrier."""
    import torch.distributed as dist

    if not stop_file:
        dist.barrier()
        return False
    asked = dist.get_rank() == 0 and os.path.exists(stop_file)
    flag = torch.tensor([1 if asked else 0], dtype=torch.int32,
                        device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _attach_layer_clock(clock: LayerClock, rs: RankStages, plan: Plan) -> None:
    """Hook the clock on each of the rank's layers that is a module of its stage (a layer of code around the
    named modules, such as an embedding sum before the first block, is timed as the span its neighbours
    leave)."""
    from stageplan.layers import used_parameters

    for piece, s in zip(rs.pieces or [st.submod for st in rs.stages], rs.indices):
        modules = {}
        for layer in range(plan.boundaries[s], plan.boundaries[s + 1]):
            try:
                modules[layer] = piece.get_submodule(plan.layer_names[layer])
            except AttributeError:
                continue
        owners: dict[int, int] = {}
        for mod in modules.values():
            for p in mod.parameters():
                owners[id(p)] = owners.get(id(p), 0) + 1
        for layer, mod in modules.items():
            # only the model's first layer has an input without
            # a gradient: its backward ends at its parameters'
            first = s == 0 and layer == min(modules)
            own = [p for p in used_parameters(mod).values() if owners.get(id(p)) == 1] if first else []
            clock.attach(layer, mod, own)


def _release_stages(rs: RankStages) -> int:
    """Give back the rank's stage once its run is over: every parameter's storage and gradient is freed, and
    the stage's modules get meta parameters back (shapes kept). The objects themselves may live on (the
    instruments' wrappers and the layer clock hold them), so their storage is what goes, not a reference.
    The freed pages go back to the system too (:func:`release_free_memory`): weight matrices under the steady
    allocator's 32 MiB mmap threshold live in the heap, which it never trims, so retiming's copy had to fit in
    among the holes the steps left there, and where it did not, the heap grew past the run's own peak (by
    0.01-0.05 GB a rank on the 1.97 GB GPT of benchmarks/bench_memory.py, measured on a 2-core CPU host).
    Returns the bytes freed."""
    from stageplan.timing import release_

    freed = 0
    for p in rs.unique_params:
        freed += p.numel() * p.element_size() + (p.grad.numel() * p.grad.element_size() if p.grad is not None
                                                 else 0)
    old = list(rs.unique_params)
    for piece in rs.pieces or [st.submod for st in rs.stages]:
        release_(piece)
    for p in old:
        p.grad = None
        if not hasattr(p, "to_local"):  # an FSDP2 shard (a DTensor) goes with its module
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    rs.params.clear()
    rs.unique_params.clear()
    gc.collect()
    release_free_memory()
    return freed


def _retime(workload: Workload, plan: Plan, rs: RankStages, device: torch.device, weights: Checkpoint | None,
            seed: int, mesh: Mesh | None = None) -> dict[int, list[float]]:
    """The rank's layers timed after its run as the profiler timed them (in its order), in this process
    (:func:`retime_layers`):
    {layer: [forward_s, backward_s, backward_accumulate_s]}, medians of 10 rounds. The ranks take turns, each
    alone on the machine as the profile was taken: ranks timed at the same time share the cores and the memory
    bandwidth, and read slower than both the profile and the run (a GPT's first rank read its blocks 1.41x the
    profile while the second rank timed its LM head beside it, and its run 0.80x that; measured on a 2-core
    CPU host). The run's stage goes first (:func:`_release_stages`; the optimizer and its states went with
    :func:`_train`), so the copy retiming materialises takes the stage's place rather than adding to it: held
    beside the stage, it had put a second copy of the rank's weights and gradients on top of the run's."""
    import torch.distributed as dist

    from stageplan.timing import retime_layers

    _release_stages(rs)
    mine = [k for s in rs.indices for k in range(plan.boundaries[s], plan.boundaries[s + 1])]
    size = microbatch_size_for(workload.batch_size, plan.num_microbatches)
    times: dict[int, list[float]] = {}
    for turn in range(dist.get_world_size()):
        # one replica's ranks retime (the others run the same layers): the rest wait at the barrier
        if turn == dist.get_rank() and (mesh is None or mesh.dp_rank == 0):
            times = retime_layers(workload, plan.layer_names, mine, size, device,
                                  layers_arg=plan.profile_meta.get("layers_arg"), weights=weights, seed=seed,
                                  repeats=10, order=plan.profile_meta.get("order"))
        dist.barrier()
    return times


def _peak_memory_bytes(device: torch.device) -> int:
    """The rank's peak memory: max allocated on CUDA; on CPU the process's peak resident set (ru_maxrss, KiB
    on Linux), which includes torch's own baseline (a few hundred MiB per process: :func:`_memory_now_bytes`
    before the stage is built says how much)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _memory_now_bytes(device: torch.device) -> int:
    """The rank's memory now, before its stage exists: allocated on CUDA (the context is not counted, as
    max_memory_allocated does not count it); on CPU the resident set, which holds torch's libraries, the
    process group and the meta model, cut: what the run's own memory (the plan's prediction) comes on top
    of."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return resident_bytes()


def worker_main(workload: Workload, plan: Plan, *, rank: int, world_size: int, options: dict[str, Any],
                report_path: str | None) -> None:
    """Run this rank's stages of ``plan``; rank 0 gathers the measurements and writes the RunReport."""
    import torch.distributed as dist

    device, cpus = _device(options["backend"], rank, world_size, bool(options.get("pin_cpus", True)))
    join_process_group(options["backend"], rank, world_size, float(options["timeout_s"]))
    slice_ns = int(options.get("comm_slice_ns", COMM_SLICE_NS))
    # the backend's threads exist now: let them in as soon as a message needs them
    short_comm_slices(slice_ns)
    _check_same_weights(options, world_size)
    # p pipeline ranks x d replicas (or x t tensor-parallel shards); every rank creates the mesh's groups, in
    # the same order
    t = plan_tensor_parallel(plan)
    mesh = make_mesh(rank, plan.num_ranks, plan.data_parallel, device, t)
    sharding = str(options.get("sharding") or "ddp")
    # the links between neighbouring ranks first, while nothing
    # else runs (well under a second on gloo localhost)
    largest_boundary_bytes = max((st.memory.get("buffers", 0.0) / 2.0 for st in plan.stages), default=0.0)
    link = ping_pong(device, sizes_bytes=probe_sizes(largest_boundary_bytes))
    model = workload.model  # parameters on meta: only this rank's chunks get real ones
    model.train()
    mb_args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a
                    for a in first_microbatch_of_plan(workload, plan))
    check = bool(options.get("check"))
    weights = Checkpoint(options["weights"]) if options.get("weights") else None
    seed = int(options.get("init_seed", 0))
    # the meta model cut at the plan's boundaries, before the baseline: like the meta model itself, the trace
    # is set-up, not the stage's tensors (torch.export's graph objects on meta tensors, which no gc gives
    # back: the baseline rose 0.046-0.048 GB a rank for the 24-block GPT of benchmarks/bench_memory.py,
    # measured on a 2-core CPU host), and a CUDA rank's allocated memory never counts it
    cut = cut_rank_stages(model, plan, mb_args, device)
    # read last before anything of the run's own: the link probe's buffers are gone (read right after it, the
    # resident set was 0.06 GB above where it settled, measured on a 2-core CPU host)
    gc.collect()
    baseline_bytes = _memory_now_bytes(device)
    reference = reference_model(model, device, weights=weights, seed=seed) if (check and rank == 0) else None
    if t > 1:
        tp_plan, prefix = model_tp_plan(model), base_prefix(model)

        def wrap(piece: torch.nn.Module, names: list[str]) -> torch.nn.Module:
            return parallelize_stage(piece, names, mesh.tp_mesh, tp_plan, prefix)
    else:
        def wrap(piece: torch.nn.Module, names: list[str]) -> torch.nn.Module:
            return wrap_stage(piece, names, sharding, mesh)
    rs = build_rank_stages(model, plan, mesh.pp_rank, device, mb_args, weights=weights, seed=seed,
                           group=mesh.pp_group, wrap=wrap, cut=cut)
    del cut
    for st in rs.stages:
        no_sync_inference(st)
    counter = CollectiveCounter()
    if t > 1:
        for st in rs.stages:
            counter.wrap(st)
    own = {_local(p).untyped_storage().data_ptr() for p in rs.unique_params}
    ins = _Instruments(Timer(device), SavedTensorTracker(set(own)), LayerClock(device),
                       trim=HeapTrim(enabled=device.type == "cpu"))
    if mesh.data_parallel > 1 and sharding.startswith("fsdp"):
        _exclude_gathered_parameters(rs, ins.tracker)
    for st in rs.stages:
        ins.wrap(st)
    _attach_layer_clock(ins.clock, rs, plan)
    # again, for a backend that starts threads at its first message
    short_threads = short_comm_slices(slice_ns)
    samples = _train(plan, workload, rs, device, options, ins, mesh, counter)
    interrupted = samples.interrupted  # the same on every rank (_stop_requested)
    if interrupted and not samples.step_s:  # stopped in the warm-up: nothing measured, no report
        dist.barrier()
        dist.destroy_process_group()
        return
    layer_s, overhead_s = samples.layer_medians()

    f, f_iqr = median_iqr(samples.forward_s)
    b, b_iqr = median_iqr(samples.backward_s)
    held = dict(samples.held, activations=max(samples.peak_activation_bytes, default=0))
    result = {"rank": mesh.pp_rank, "global_rank": rank, "mesh": mesh.coordinates,
              "dp_sync_s": median_iqr(samples.dp_sync_s)[0] if samples.dp_sync_s else None,
              "memory_by_kind": held, "stages": rs.indices, "step_s": samples.step_s, "forward_s": f,
              "forward_iqr_s": f_iqr,
              "backward_s": b, "backward_iqr_s": b_iqr, "other_s": median_iqr(samples.other_s)[0],
              "tied_sync_s": median_iqr(samples.tied_sync_s)[0],
              "optimizer_step_s": median_iqr(samples.optimizer_step_s)[0],
              "receive_wait_s": median_iqr(samples.receive_wait_s)[0],
              "compute_cpu_s": median_iqr(samples.compute_cpu_s)[0], "losses": samples.losses,
              "timeline": samples.timeline,
              "peak_activation_bytes": max(samples.peak_activation_bytes, default=0),
              # every replica's parameters, whole (an FSDP2 shard gathered over its replicas: collective)
              "params": {k: full_value(v) for k, v in rs.params.items()} if check else {},
              # and their last step's gradients, whole the same way (None where the backward made none)
              "grads": {k: None if v.grad is None else full_value(v.grad) for k, v in rs.params.items()}
              if check else None,
              "layer_s": layer_s, "overhead_s": overhead_s,
              "cpus": process_cpus() if cpus is not None else None,
              "clock_compute_s": median_iqr(samples.clock_compute_s)[0] if samples.clock_compute_s else None,
              "calls": samples.calls, "short_slice_threads": short_threads,
              "tp_collectives": dict(counter.counts) if t > 1 else None,
              # how often the heap's free pages went back after a long call (measure.HeapTrim)
              "heap_trims": ins.trim.count}
    steps_measured = len(samples.step_s)
    del samples
    # an interrupted run ends at once: its user is waiting, so no retiming and no single-process check
    # (a tensor-parallel rank would retime its layers whole, not its shards: not retimed)
    result["retimed_layer_s"] = (_retime(workload, plan, rs, device, weights, seed, mesh)
                                 if options.get("retime", True) and not interrupted and t == 1 else {})
    # read last: the peak covers everything the rank did, retiming included
    result["peak_memory_bytes"] = _peak_memory_bytes(device)
    result["baseline_memory_bytes"] = baseline_bytes
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    if rank == 0:
        assert gathered is not None
        check_result = None
        if check and reference is not None and not interrupted:
            from stageplan.running.check import compare_with_single_process

            check_result = compare_with_single_process(workload, reference, gathered, options,
                                                       plan.num_microbatches * plan.data_parallel)
        meta = {"torch_version": torch.__version__, "device": str(device), "world_size": world_size,
                "mesh": {"pp": plan.num_ranks, "dp": plan.data_parallel, **({"tp": t} if t > 1 else {})},
                "sharding": sharding,
                "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "timer": "cuda_event" if device.type == "cuda" else "perf_counter",
                "load_average_1min": os.getloadavg()[0], "python": sys.version.split()[0],
                "activation_measure": "saved_tensors_hooks live bytes (the profiler's tracker), warm-up "
                                      "steps",
                "cpus_per_rank": [g["cpus"] for g in gathered],
                "comm_thread_slice_us": slice_ns / 1e3 if slice_ns else None,
                "short_slice_threads_per_rank": [g["short_slice_threads"] for g in gathered]}
        if interrupted:
            skipped = (("check", check), ("retime", options.get("retime", True)),
                       ("per-layer clock", not layer_s))
            meta["partial"] = {"reason": "interrupted (Ctrl-C)", "steps_measured": steps_measured,
                               "steps_asked": int(options["steps"]),
                               "skipped": [what for what, asked in skipped if asked]}
        # the step ends when the slowest rank ends: per measured step, the max over ranks
        per_step = [max(g["step_s"][i] for g in gathered) for i in range(len(gathered[0]["step_s"]))]
        step, step_iqr = median_iqr(per_step)
        report = RunReport.from_measurements(plan, gathered, step_s=step, step_iqr_s=step_iqr,
                                             run_options=options, check=check_result, meta=meta, link=link)
        if report_path:
            report.save(report_path)
    dist.barrier()
    dist.destroy_process_group()


def link_main(*, rank: int, world_size: int, options: dict[str, Any], output_path: str | None) -> None:
    """Only the link probes (``stageplan link``); rank 0 writes LINK.json. With ``options["data_parallel"]``
    d > 1 the ranks sit on the ("pp", "dp") mesh as a run places them (:func:`make_mesh`): the pipeline
    probes run on replica 0's pipeline, then every stage's replicas time their all-reduce at once
    (:func:`dp_allreduce_probe`), and each sharding mode's own sync (:func:`dp_sync_probe`)."""
    import torch.distributed as dist

    device, _ = _device(options["backend"], rank, world_size, bool(options.get("pin_cpus", True)))
    join_process_group(options["backend"], rank, world_size, float(options["timeout_s"]))
    short_comm_slices(int(options.get("comm_slice_ns", COMM_SLICE_NS)))  # as a run's ranks have it
    d = int(options.get("data_parallel", 1))
    mesh = make_mesh(rank, world_size // d, d, device)
    if d == 1:
        link: dict[str, Any] | None = ping_pong(device)
    else:
        # One pipeline, not each: the ping-pong times one pair at a time so that no other traffic shares the
        # cores, and the plan prices every boundary with one figure; d pipelines probed one after another
        # would only multiply the probe's time. With one pipeline rank (p = 1) there is no boundary: stage
        # 0's replicas are the pair, which the link's point-to-point figures (the collectives' fallback) need.
        on_pipeline = mesh.dp_rank == 0 if mesh.num_ranks > 1 else True
        group = mesh.pp_group if mesh.num_ranks > 1 else mesh.dp_group
        link = ping_pong(device, group=group) if on_pipeline else None
        dist.barrier()  # the other replicas wait here, idle, while replica 0's pipeline is probed
        replicas = dp_allreduce_probe(device, mesh.dp_group)
        modes = dp_sync_probe(device, mesh)  # and each sharding mode's own sync, as a run wraps a stage
        link = None if link is None else {**link, **(replicas or {}), **(modes or {}),
                                          "pipeline_parallel": mesh.num_ranks, "data_parallel": d}
    if rank == 0 and output_path and link is not None:
        save_link({**link, "num_ranks": world_size, "torch_version": torch.__version__,
                   "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}, output_path)
    dist.barrier()
    dist.destroy_process_group()
