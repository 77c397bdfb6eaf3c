"""The one instrument: timer (CPU/CUDA), per-layer clock,
median/IQR, saved-bytes tracker, microbatch slices (torch).

The profiler and the executor both measure with this module, so that a measured / predicted ratio away
from 1 is the cost model's doing, not a difference between two instruments.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from stageplan.errors import StageplanError

if TYPE_CHECKING:
    from stageplan.workload import Workload


_ALLOCATOR_STEADY = False


def steady_allocator() -> bool:
    """Keep freed multi-MiB buffers for reuse (glibc only; elsewhere a no-op returning False).

    glibc maps an allocation above ``M_MMAP_THRESHOLD`` fresh (mmap), moves that threshold at run time as such
    blocks are freed, and trims freed heap above ``M_TRIM_THRESHOLD`` (mallopt(3)). So multi-MiB buffers, such
    as the logits of a 16384-token head and their gradients, are faulted in anew on some steps and reused on
    others, differently from one process to the next, and a layer that allocates them times differently from
    one profile to the next (page faults cost kernel time on every touched page: 0 to 2,144 minor faults per
    step without fixed thresholds, 102-717 with them, measured on a 2-core CPU host). The profiler and every
    rank call it, so profile
    and run measure alike.
    """
    global _ALLOCATOR_STEADY
    if _ALLOCATOR_STEADY:
        return True
    libc = _glibc()
    if libc is None:
        return False
    try:
        m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
        # 32 MiB, glibc's own ceiling for its moving threshold: whole weight matrices above it stay mapped
        # (returned to the system when freed, as layer-at-a-time profiling needs), the activations below it
        # are reused
        ok = (
            libc.mallopt(m_mmap_threshold, 32 << 20) == 1
            and libc.mallopt(m_trim_threshold, (1 << 31) - 1) == 1
        )
    except (OSError, AttributeError):
        return False
    _ALLOCATOR_STEADY = ok
    return ok


def release_free_memory() -> bool:
    """Hand the allocator's free pages back to the system: glibc's ``malloc_trim(0)``, which since glibc 2.8
    releases free pages anywhere in the heap, not only at its top (malloc_trim(3)); elsewhere a no-op. With
    :func:`steady_allocator`'s trim threshold glibc never does this by itself. Returns whether it ran."""
    libc = _glibc()
    if libc is None:
        return False
    try:
        libc.malloc_trim(0)
    except AttributeError:
        return False
    return True


# A chunk call at least this long (seconds) hands the heap's free pages back after it. Such a call allocates
# parameter-sized tensors (a weight's gradient before it is added into .grad), which the steady allocator
# keeps in the heap; the next call's small tensors split the holes they leave, the call after finds no hole
# its size and grows the heap, and the freed pages stay resident: 0.09-0.23 GB a rank above the plan's
# tensors on a 4-rank run of a 1.97 GB fp32 GPT (benchmarks/bench_memory.py), 0.6 GB under FSDP2, measured
# with glibc's mallinfo2 on a 2-core CPU host. Trimming costs the time to find the free chunks (1.8-4 ms
# with a few thousand, 50 ms with tens of 26 MB holes) and the page faults when the pages are used again
# (a 26 MB tensor filled in 20 ms on trimmed pages, 4 ms on kept ones): 6% of that GPT's 10.5 s step, and
# under 4% of a call of 100 ms. Calls of milliseconds, whose tensors are small, keep every page.
TRIM_AFTER_CALL_S = 0.1


@dataclass
class HeapTrim:
    """After each chunk call of at least ``after_s`` seconds, :func:`release_free_memory` (CPU only: on CUDA
    the caching allocator holds the tensors, and :attr:`enabled` is False). ``count`` says how often it
    ran."""

    enabled: bool = True
    after_s: float = TRIM_AFTER_CALL_S
    count: int = 0

    def after(self, call_s: float) -> None:
        if self.enabled and call_s >= self.after_s and release_free_memory():
            self.count += 1


def _glibc() -> Any:
    """The process's C library through ctypes where it is glibc on Linux, else None."""
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def resident_bytes() -> int:
    """This process's resident set now (VmRSS of /proc/self/status, Linux); elsewhere its peak so far
    (ru_maxrss: KiB on Linux, bytes on macOS), the nearest figure the platform gives."""
    import sys

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    import resource

    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024


def last_level_cache_bytes(device: torch.device | str) -> int:
    """The device's last-level cache: CUDA's L2; on CPU the largest cache sysfs lists for cpu0 (64 MiB when it
    cannot be read)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or (64 << 20))
    from pathlib import Path

    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=64 << 20)


# Bytes (2 x 128 MiB). A process holds only its share of a large shared L3, and a virtual machine's sysfs can
# list its host's whole L3 (480 MiB on a 2-vCPU guest), shared with every other core of the socket. Uncapped,
# the flush wrote 960 MiB there before each timed step (119 ms a flush against 33 ms at 256 MiB) and lifted a
# streamed profile's peak to 1.7 GB against 0.37 GB resident. A layer whose optimizer states exceed the buffer
# is not flushed at all (it fits no cache).
FLUSH_CAP_BYTES = 256 << 20


class CacheFlush:
    """Evict the last-level cache before a timed call whose working set would otherwise stay in it from the
    last repeat: an optimizer step over one layer's parameters, gradients and states (3 MiB for a GPT block),
    timed 5 times in a row, ran from cache at 8.4 ms summed over GPT's layers, where the pipeline rank's one
    step over the same parameters, after a backward that evicted them, took 11.8 ms; with a flush the sum is
    13.7 ms and one step over all of them 13.1 ms (README, Limitations). Writes a buffer twice the cache's
    size, at most ``FLUSH_CAP_BYTES``: a VM can see its host's whole shared L3 (480 MiB on a 2-vCPU guest),
    and twice that, written before every timed step, made a profile's peak memory 1.3 GB above its model and
    cost about 0.1 s a flush."""

    def __init__(self, device: torch.device | str) -> None:
        self.size_bytes = min(2 * last_level_cache_bytes(device), FLUSH_CAP_BYTES)
        self._buffer: torch.Tensor | None = None
        self._device = torch.device(device)

    def __call__(self) -> None:
        if self._buffer is None:
            self._buffer = torch.empty(self.size_bytes, dtype=torch.uint8, device=self._device)
        self._buffer.fill_(1)

    def release(self) -> None:
        self._buffer = None


def median_iqr(xs: Sequence[float]) -> tuple[float, float]:
    """Median and inter-quartile range (seconds in, seconds out); (nan, nan) for no samples.

    >>> median_iqr([1.0, 2.0, 3.0, 4.0, 100.0])
    (3.0, 2.0)
    """
    if not xs:
        return float("nan"), float("nan")
    if len(xs) == 1:
        return float(xs[0]), 0.0
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return statistics.median(xs), q[2] - q[0]


MAX_LAYER_S = 30.0  # profile --max-time's default: a layer's timed rounds stop past this many seconds
MIN_TIMED_ROUNDS = 5  # the fewest timed rounds a layer's cap (max_time_s) leaves: a median and quartiles
WARMUP_SHARE = 0.25  # the warm-up rounds stop early once they span this share of max_time_s (at least one)


def timed_rounds(warmup: int, repeats: int, min_time_s: float = 0.0,
                 max_time_s: float = math.inf) -> Iterator[tuple[int, bool]]:
    """``(round number, timed?)`` for rounds 0, 1, 2, ...: ``warmup`` warm-up rounds, then timed rounds, at
    least ``repeats`` of them and more until the timed ones have spanned ``min_time_s`` seconds of wall clock
    (what ``profile --min-time`` asks for: a shared machine's speed drifts by the second, and medians over
    rounds spread further apart average more of it out).

    ``max_time_s`` caps a slow layer's rounds (``profile --max-time``): the warm-up stops after its first
    round once it has spanned ``WARMUP_SHARE`` of it, and the timed rounds stop once they have spanned it and
    number at least ``MIN_TIMED_ROUNDS`` (or ``repeats``, if fewer). A round of a Qwen2-7B block takes about
    3 s on one CPU core, and its 2.2 GB head about 9 s: 25 rounds of each spent 15 minutes on a profile whose
    medians need far fewer; a layer of milliseconds never reaches the cap. ``min_time_s`` wins over it.

    >>> list(timed_rounds(2, 3))
    [(0, False), (1, False), (2, True), (3, True), (4, True)]
    """
    rnd = 0
    warm_start = time.perf_counter()
    while rnd < warmup and (rnd == 0 or time.perf_counter() - warm_start < WARMUP_SHARE * max_time_s):
        yield rnd, False
        rnd += 1
    least = min(repeats, MIN_TIMED_ROUNDS)
    started = time.perf_counter()
    timed = 0
    while True:
        spent = time.perf_counter() - started
        if not ((timed < repeats and (timed < least or spent < max_time_s)) or spent < min_time_s):
            return
        yield rnd, True
        rnd += 1
        timed += 1


class DeviceClock:
    """A point in time on the device's own clock, and the seconds between two: ``time.perf_counter`` on CPU;
    on CUDA an event recorded on the current stream (read after a synchronisation), so intervals are the
    stream's."""

    cuda: bool

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) / 1e3 if self.cuda else float(b - a)


class Timer(DeviceClock):
    """Seconds of a callable's work on ``device``.

    CPU: ``time.perf_counter`` around the call. CUDA kernels run asynchronously to the host (a host clock
    around the call times the launch, not the kernel: see "Asynchronous execution" in torch's CUDA semantics
    notes, docs/source/notes/cuda.rst), so it records CUDA events:
    ``__call__`` synchronises and returns at once (the profiler), ``record`` keeps the events and ``drain``
    reads them after the step has synchronised (the executor, which must not stall the pipeline).
    Each recorded interval also keeps its wall start and the thread's CPU seconds: wall minus CPU is time
    the process was preempted by others.
    """

    # the chunk calls, as the executor records them (the simulator's are schedules.CALL_KINDS, with a
    # zero-bubble backward's input half as "I" where the run records "B"): the rank computes; any other
    # interval is idle
    BUSY_KINDS = ("F", "B", "W")

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._events: list[tuple[str, int, int, Any, Any, float, float]] = []
        # where the rank last stopped computing: perf_counter seconds, or a CUDA event
        self._busy_end: Any = None

    def mark(self) -> None:
        """The rank's own work outside the chunk calls (its optimizer step) ends now: the idle gap of the next
        chunk call counts from here, through the barrier that starts the next step and the executor's
        bookkeeping between (draining this timer, the losses, the progress line, clearing the gradients),
        which is not the model's."""
        self._events.append(("", -1, -1, None, self._now(), time.time(), 0.0))

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3, out
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out

    def record(self, kind: str, stage: int, microbatch: int, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` and keep its interval, labelled (kind, stage, microbatch), for :meth:`drain`."""
        wall = time.time()
        cpu0 = time.thread_time()
        start: Any
        end: Any
        start = self._now()
        out = fn()
        end = self._now()
        self._events.append((kind, stage, microbatch, start, end, wall, time.thread_time() - cpu0))
        return out

    def drain(self) -> list[tuple[str, int, int, float, float, float, float | None]]:
        """(kind, stage, microbatch, wall start, seconds, thread CPU seconds, idle before) of the recorded
        intervals. Idle before, for a chunk call (:attr:`BUSY_KINDS`): the seconds since the rank's previous
        chunk call ended or its last :meth:`mark`, on the device's own clock (CUDA events: the stream's gap,
        not the host's), across drains; None for other intervals and for the first call with nothing before
        it."""
        if self.cuda:
            torch.cuda.synchronize()
        out = []
        for kind, stage, mb, start, end, wall, cpu in self._events:
            if not kind:  # a mark
                self._busy_end = end
                continue
            idle = None
            if kind in self.BUSY_KINDS:
                idle = None if self._busy_end is None else max(self._seconds(self._busy_end, start), 0.0)
                self._busy_end = end
            out.append((kind, stage, mb, wall, self._seconds(start, end), cpu, idle))
        self._events = []
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) tuple/list/dict value."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class LayerClock(DeviceClock):
    """Each layer's forward and backward seconds inside a running pipeline chunk, from hooks on its module.

    A phase (one chunk's forward, backward or loss call, opened by :meth:`phase`) collects stamps: a layer's
    forward runs from its forward pre-hook to its forward hook; its backward from the moment the gradient of
    its output is ready (a tensor hook on the output) to the moment the gradient of its input is ready (a
    tensor hook on the input; for a first layer whose input needs no gradient, the last of its parameters'
    post-accumulate hooks). Layers without a module of their own (the code before the first or after the last
    named module) get the span between their stamped neighbours, or the phase's edges. What no layer covers is
    the chunk's overhead (the
    PipelineStage machinery around the layers). CPU: ``time.perf_counter``; CUDA: events, read by
    :meth:`drain`.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._enabled = False
        self._targets: list[tuple[int, torch.nn.Module, list[torch.nn.Parameter]]] = []
        self._module_hooks: list[Any] = []  # registered only while enabled: nothing runs in the other steps
        self._stamps: list[tuple[int, str, Any]] | None = None
        self._phases: list[tuple[str, int, Any, Any, list[tuple[int, str, Any]]]] = []
        # tensor hooks of this step (a stage's receive buffers persist across steps)
        self._handles: list[Any] = []

    def _stamp(self, layer: int, edge: str) -> None:
        if self._stamps is not None:
            self._stamps.append((layer, edge, self._now()))

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """Register the attached layers' hooks when switched on, remove them when switched off."""
        if bool(on) == self._enabled:
            return
        self._enabled = bool(on)
        if on:
            for layer, module, params in self._targets:
                self._hook(layer, module, params)
        else:
            for handle in self._module_hooks:
                handle.remove()
            self._module_hooks = []

    def attach(self, layer: int, module: torch.nn.Module, params: Sequence[torch.nn.Parameter] = ()) -> None:
        """Stamp layer ``layer`` each time ``module`` runs (forward) and its gradients flow (backward), while
        the clock is enabled. ``params``: the layer's own parameters (not shared with another layer), for a
        first layer whose input needs no grad."""
        self._targets.append((layer, module, [p for p in params if p.requires_grad]))
        if self._enabled:
            self._hook(layer, module, self._targets[-1][2])

    def _hook(self, layer: int, module: torch.nn.Module, params: Sequence[torch.nn.Parameter]) -> None:
        def grad_stamp(edge: str) -> Callable[[Any], None]:
            def hook(_: Any) -> None:
                self._stamp(layer, edge)
            return hook

        def forward_edge(edge: str, tensors: Any, grad_edge: str) -> None:
            """Stamp the forward's edge; the gradients of ``tensors`` will stamp the backward's."""
            if self._stamps is None:
                return
            self._stamp(layer, edge)
            for t in _tensors(tensors):
                if t.requires_grad:
                    self._handles.append(t.register_hook(grad_stamp(grad_edge)))

        self._module_hooks += [  # inputs' gradients end the layer's backward, outputs' gradients start it
            module.register_forward_pre_hook(lambda _, args: forward_edge("f0", args, "b1")),
            module.register_forward_hook(lambda _, args, out: forward_edge("f1", out, "b0")),
        ]
        self._module_hooks += [p.register_post_accumulate_grad_hook(grad_stamp("bp")) for p in params]

    @contextmanager
    def phase(self, kind: str, stage: int) -> Iterator[None]:
        """Collect the stamps of one chunk call (kind "F", "B", "W" or "L" for the loss) while enabled."""
        if not self.enabled:
            yield
            return
        stamps: list[tuple[int, str, Any]] = []
        self._stamps = stamps
        begin = self._now()
        try:
            yield
        finally:
            end = self._now()
            self._stamps = None
            self._phases.append((kind, stage, begin, end, stamps))

    def drain(
        self, layers_of: Callable[[int], Sequence[int]]
    ) -> list[tuple[str, int, dict[int, float], float]]:
        """Per phase of the step: (kind, stage, {layer: seconds}, overhead seconds), and the step's tensor
        hooks removed. ``layers_of(stage)``: the stage's layer indices in order. A loss phase is all the last
        layer's, and on the stage that computed a loss the start of its backward (the loss's own backward) is
        its last layer's too, as the profile counts it; a weight-gradient phase is reported whole, as
        overhead."""
        if self.cuda:
            torch.cuda.synchronize()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        with_loss = {stage for kind, stage, *_ in self._phases if kind == "L"}
        out = []
        for kind, stage, begin, end, stamps in self._phases:
            total = self._seconds(begin, end)
            order = list(layers_of(stage))
            if kind == "L":
                out.append((kind, stage, {order[-1]: total}, 0.0))
                continue
            if kind == "W":
                out.append((kind, stage, {}, total))
                continue
            if kind == "B":
                order = order[::-1]
            spans = self._spans(kind, stamps, begin)
            if kind == "B" and stage in with_loss and order[0] in spans:
                spans[order[0]] = (0.0, spans[order[0]][1])
            times = _fill_gaps(order, spans, total)
            out.append((kind, stage, times, max(total - sum(times.values()), 0.0)))
        self._phases = []
        return out

    def _spans(
        self, kind: str, stamps: list[tuple[int, str, Any]], begin: Any
    ) -> dict[int, tuple[float, float]]:
        """{layer: (start, end)} seconds after the phase's begin."""
        at: dict[int, dict[str, float]] = {}
        for layer, edge, stamp in stamps:
            t = self._seconds(begin, stamp)
            edges = at.setdefault(layer, {})
            # the last of several outputs' gradients starts the backward; the first input whose gradient is
            # ready ends it (an input shared with later layers, such as an encoder's memory, is ready only
            # after them)
            pick = min if edge == "b1" else max
            edges[edge] = pick(edges.get(edge, t), t)
        spans = {}
        for layer, e in at.items():
            start, stop = (e.get("f0"), e.get("f1")) if kind == "F" else (e.get("b0"),
                                                                          e.get("b1", e.get("bp")))
            if start is not None and stop is not None and stop >= start:
                spans[layer] = (start, stop)
        return spans


def _fill_gaps(order: Sequence[int], spans: dict[int, tuple[float, float]], total: float) -> dict[int, float]:
    """Seconds per layer of one phase: stamped layers their span; each run of unstamped layers (in execution
    order) the gap between its stamped neighbours (or the phase's edges), in equal shares."""
    times: dict[int, float] = {}
    run: list[int] = []
    prev_end = 0.0

    def flush(next_start: float) -> None:
        gap = max(next_start - prev_end, 0.0)
        for i in run:
            times[i] = gap / len(run)
        run.clear()

    for layer in order:
        if layer in spans:
            start, stop = spans[layer]
            if run:
                flush(start)
            # never before the previous layer ended (spans clamped, never overlapping)
            start = max(start, prev_end)
            times[layer] = max(stop - start, 0.0)
            prev_end = max(stop, prev_end)
        else:
            run.append(layer)
    if run:
        flush(total)
    return times


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor can reach: [offset, offset + extent) (a strided view's extent is from
    its first to its last element)."""
    elem = t.element_size()
    start = int(t.storage_offset()) * elem
    if t.numel() == 0:
        return start, start
    extent = 1 + sum((int(size) - 1) * int(stride) for size, stride in zip(t.shape, t.stride()) if size > 0)
    return start, start + extent * elem


def _union_bytes(spans: dict[tuple[int, int], int]) -> int:
    total, end = 0, -1
    for lo, hi in sorted(spans):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


class SavedTensorTracker:
    """Live saved-for-backward bytes, counted at the bytes the saved tensors reach: tensors and views saved on
    one storage count once (deduplicated by storage: a saved tensor shares its original's storage, so the same
    bytes can be saved under several tensors, as ``torch.autograd.graph.saved_tensors_hooks`` shows them), and
    a view counts at its own extent, not its storage's:
    the slice of a batch's target that a microbatch's loss saves counts as the microbatch's rows, not the
    whole batch. Bytes leave when the graph frees the saved tensors. Storages in ``exclude`` (the parameters)
    are not counted. ``key`` names a storage: its data pointer by default, :func:`storage_identity` for fake
    tensors (whose data pointers are all 0)."""

    def __init__(
        self, exclude: set[int] | None = None, key: Callable[[torch.Tensor], int] | None = None
    ) -> None:
        self.exclude = exclude or set()
        self.key = key or (lambda t: t.untyped_storage().data_ptr())
        self.live = 0
        self.peak = 0
        self._spans: dict[int, dict[tuple[int, int], int]] = {}  # storage -> {byte span: saved tensors on it}

    def reset_peak(self) -> None:
        self.peak = self.live

    def _pack(self, t: torch.Tensor) -> Any:
        # a DTensor (a tensor-parallel run's) holds the bytes of its local shard; its own storage is empty
        inner = getattr(t, "_local_tensor", None)
        local = inner if isinstance(inner, torch.Tensor) else t
        ptr = self.key(local)
        if ptr in self.exclude:
            return t
        span = _byte_span(local)
        spans = self._spans.setdefault(ptr, {})
        before = _union_bytes(spans)
        spans[span] = spans.get(span, 0) + 1
        self.live += _union_bytes(spans) - before
        self.peak = max(self.peak, self.live)
        return _Held(self, t, ptr, span)

    @staticmethod
    def _unpack(held: Any) -> torch.Tensor:
        return held.t if isinstance(held, _Held) else held

    def _release(self, ptr: int, span: tuple[int, int]) -> None:
        spans = self._spans[ptr]
        before = _union_bytes(spans)
        spans[span] -= 1
        if spans[span] == 0:
            del spans[span]
        self.live -= before - _union_bytes(spans)
        if not spans:
            del self._spans[ptr]

    def hooks(self) -> Any:
        """The context in which autograd's saved tensors are counted."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @contextmanager
    def counting(self) -> Iterator[SavedTensorTracker]:
        """Like :meth:`hooks`, yielding the tracker (``live`` after the block = bytes the block saved and
        still holds)."""
        with self.hooks():
            yield self


def storage_identity(t: torch.Tensor) -> int:
    """A storage's identity that also works for fake tensors (data_ptr 0): its StorageImpl, as torch's own
    fake-tensor code keys storages. The tracker keeps saved tensors alive, so no identity is reused
    meanwhile."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return int(StorageWeakRef(t.untyped_storage()).cdata)


class _Held:
    __slots__ = ("ptr", "span", "t", "tracker")

    def __init__(self, tracker: SavedTensorTracker, t: torch.Tensor, ptr: int, span: tuple[int, int]) -> None:
        self.tracker, self.t, self.ptr, self.span = tracker, t, ptr, span

    def __del__(self) -> None:
        self.tracker._release(self.ptr, self.span)


def saved_bytes(fn: Callable[[], Any], exclude_ptrs: set[int]) -> tuple[int, Any]:
    """Bytes saved for backward by ``fn`` and still held by its output's graph (storages deduplicated,
    ``exclude_ptrs`` skipped), and the output."""
    tracker = SavedTensorTracker(exclude_ptrs)
    with tracker.hooks():
        out = fn()
    return tracker.live, out


# --------------------------------------------------------------------------------------------------
# Microbatches: slices along dim 0 of the workload's full batch


def check_microbatch_size(batch: int, microbatch_size: object) -> int:
    """Refuse a microbatch size that is not a positive divisor of the batch."""
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size < 1:
        raise StageplanError(
            f"microbatch size must be a positive integer, got {microbatch_size!r}; e.g. --microbatch-size 2")
    if batch % microbatch_size:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        raise StageplanError(
            f"microbatch size {microbatch_size} does not divide the batch of {batch}; use one of {divisors}")
    return microbatch_size


def microbatch_size_for(batch: int, num_microbatches: int) -> int:
    """The microbatch size of a plan's m microbatches, refusing a batch that m does not divide (torch would
    fail with a shape error deep inside the loss, and the other ranks would block until the process group's
    timeout)."""
    if batch % num_microbatches:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        raise StageplanError(
            f"the batch of {batch} does not divide into the plan's {num_microbatches} microbatches (torch "
            f"would fail deep inside the loss and the other ranks would hang); use a batch that is a "
            f"multiple of {num_microbatches}, or plan with one of {divisors} microbatches"
        )
    return batch // num_microbatches


def microbatch(values: Any, index: int, size: int) -> Any:
    """Microbatch ``index`` of ``values`` (a tensor, or a tuple/list of tensors and other values)."""
    sl = slice(index * size, (index + 1) * size)
    if isinstance(values, torch.Tensor):
        return values[sl]
    if isinstance(values, (tuple, list)):
        return tuple(v[sl] if isinstance(v, torch.Tensor) else v for v in values)
    return values


def first_microbatch(workload: Workload, microbatch_size: int) -> tuple[Any, ...]:
    """The workload's first microbatch of inputs, after checking the size divides the batch."""
    check_microbatch_size(workload.batch_size, microbatch_size)
    return tuple(microbatch(workload.input_tuple(), 0, microbatch_size))
