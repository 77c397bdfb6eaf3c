"""stageplan.running.executor in this process and a forked child (no ranks): a rank's threads
pinned to its block of CPUs, the backend threads' short scheduler slice, and the heap trimmed after long chunk
calls."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest


def _blocks(world: int) -> list[list[int]]:
    """Each local rank's CPUs, worked out from this process's own affinity: equal consecutive blocks."""
    cpus = sorted(os.sched_getaffinity(0))
    k = len(cpus) // world
    return [cpus[r * k:(r + 1) * k] for r in range(world)]


class _ParkedThread:
    """A thread that records its native id and waits until stopped (as gloo's threads wait for messages)."""

    def __init__(self) -> None:
        self._started, self._stop = threading.Event(), threading.Event()
        self.tid = 0
        self._thread = threading.Thread(target=self._park)
        self._thread.start()
        self._started.wait()

    def _park(self) -> None:
        self.tid = threading.get_native_id()
        self._started.set()
        self._stop.wait()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _pin_in_child(queue) -> None:  # type: ignore[no-untyped-def]
    from stageplan.running.executor import pin_rank_cpus, process_cpus

    before = sorted(os.sched_getaffinity(0))
    refused = pin_rank_cpus(0, len(before) + 1)  # more local ranks than CPUs: nothing changes
    unchanged = sorted(os.sched_getaffinity(0))
    old = _ParkedThread()
    block = pin_rank_cpus(1, 2)
    new = _ParkedThread()
    # one started before pinning, one after
    threads = [sorted(os.sched_getaffinity(t.tid)) for t in (old, new)]
    old.stop()
    new.stop()
    queue.put({"refused": refused, "unchanged": unchanged == before, "block": block, "threads": threads,
               "main": sorted(os.sched_getaffinity(0)), "process": process_cpus()})


def test_pin_rank_cpus_moves_every_thread_and_new_ones_inherit() -> None:
    """A rank's threads, those it had and those it starts after (as gloo's are), all run on its block; with
    more ranks than CPUs nothing is pinned."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_pin_in_child, args=(queue,))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=60)
    want = _blocks(2)[1]
    assert got["refused"] is None and got["unchanged"]
    assert got["block"] == want and got["main"] == want and got["process"] == want
    assert got["threads"] == [want, want]
    assert sorted(os.sched_getaffinity(0)) == sorted(set().union(*_blocks(1)))  # this process was left alone


def _slice_ns(tid: int) -> int | None:
    """The thread's scheduler slice as the kernel reports it (/proc/<pid>/task/<tid>/sched, ``se.slice``)."""
    try:
        text = Path(f"/proc/{os.getpid()}/task/{tid}/sched").read_text()
    except OSError:
        return None
    found = re.search(r"^se\.slice\s*:\s*(\d+)", text, re.M)
    return int(found.group(1)) if found else None


def _slices_in_child(queue) -> None:  # type: ignore[no-untyped-def]
    from stageplan.running.executor import COMM_SLICE_NS, short_comm_slices

    other = _ParkedThread()
    me = threading.get_native_id()
    before = {"main": _slice_ns(me), "other": _slice_ns(other.tid)}
    done = short_comm_slices()
    after = {"main": _slice_ns(me), "other": _slice_ns(other.tid)}
    other.stop()
    queue.put({"before": before, "after": after, "done": done, "want": COMM_SLICE_NS})


def test_the_backend_threads_get_a_short_slice_and_the_compute_thread_keeps_its_own() -> None:
    """Every thread but the caller (the compute thread) gets the short slice, as the kernel itself reports it;
    the count returned is what the kernel took."""
    import multiprocessing

    if _slice_ns(threading.get_native_id()) is None:
        pytest.skip("this kernel does not report per-thread slices (/proc/.../sched has no se.slice)")
    ctx = multiprocessing.get_context("fork")  # a child: the test process keeps its own slices
    queue = ctx.Queue()
    child = ctx.Process(target=_slices_in_child, args=(queue,))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=60)
    assert got["after"]["main"] == got["before"]["main"] != got["want"]
    if _kernel_has_custom_slices():
        assert got["done"] == 1 and got["after"]["other"] == got["want"] != got["before"]["other"]
    else:  # before 6.12 a normal task's slice is the kernel's: nothing is set, so nothing may be claimed
        assert got["done"] == 0 and got["after"]["other"] == got["before"]["other"]


def _kernel_has_custom_slices() -> bool:
    """Linux 6.12 and later take a per-thread slice for normal tasks (sched_attr.sched_runtime)."""
    import platform

    found = re.match(r"(\d+)\.(\d+)", platform.release())
    return platform.system() == "Linux" and found is not None and (int(found[1]), int(found[2])) >= (6, 12)


def test_retiming_starts_from_a_released_stage() -> None:
    """Before retiming rebuilds the rank's layers, the stage's own storage and gradients go, even where
    another object still holds the parameter (the instruments do), and its modules get meta parameters of the
    same shapes back (a second copy of the stage had stayed resident beside the retimed one)."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from stageplan.running.executor import _release_stages
    from stageplan.running.stages import RankStages

    module = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 64))
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    held = list(module.parameters())  # as the layer clock's targets hold them
    weights_and_grads = sum(2 * p.numel() * p.element_size() for p in held)
    rs = RankStages([SimpleNamespace(submod=module)], [0], dict(module.named_parameters()), list(held), [],
                    [])
    freed = _release_stages(rs)
    assert freed == weights_and_grads == 2 * 4 * (64 * 32 + 32 + 32 * 64 + 64)
    assert all(p.numel() == 0 and p.grad is None for p in held)
    assert [(n, p.device.type, tuple(p.shape)) for n, p in module.named_parameters()] == [
        ("0.weight", "meta", (32, 64)), ("0.bias", "meta", (32,)), ("1.weight", "meta", (64, 32)),
        ("1.bias", "meta", (64,))]
    assert rs.params == {} and rs.unique_params == []


def test_a_released_stage_hands_its_pages_back_to_the_system() -> None:
    """The stage's freed weights and gradients leave the resident set at once, where the steady allocator
    would keep them (its trim threshold is 2 GiB, and 4 MiB tensors are under its 32 MiB mmap threshold, so
    they sit in the heap): retiming's copy then starts from what the rank still holds, not on top of the
    holes of its steps."""
    import platform
    from types import SimpleNamespace

    import torch
    from torch import nn

    from stageplan.measure import resident_bytes, steady_allocator
    from stageplan.running.executor import _release_stages
    from stageplan.running.stages import RankStages

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or not steady_allocator():
        pytest.skip("glibc's heap only")
    module = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(16)])  # 16 x 4 MiB
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(1.0)  # touched: resident
            p.grad = torch.ones_like(p)
    rs = RankStages([SimpleNamespace(submod=module)], [0], dict(module.named_parameters()),
                    list(module.parameters()), [], [])
    before = resident_bytes()
    freed = _release_stages(rs)
    assert freed == 2 * 16 * 4 * 2**20
    # most of the 128 MiB goes (a page or so at each chunk's edges may stay)
    assert before - resident_bytes() >= 0.9 * freed


def test_a_rank_trims_its_heap_after_long_chunk_calls_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk calls the executor wraps hand the heap back after a call of 0.1 s or more (forward, backward
    and weight-gradient alike) and never after a call of milliseconds, outside the call the timer records."""
    import time

    import torch

    from stageplan import measure
    from stageplan.measure import HeapTrim, LayerClock, SavedTensorTracker, Timer
    from stageplan.running.executor import _Instruments

    trims: list[float] = []
    monkeypatch.setattr(measure, "release_free_memory", lambda: trims.append(time.perf_counter()) or True)

    class Stage:  # the PipelineStage methods the instruments wrap
        stage_index = 0

        def __init__(self) -> None:
            self.ended: list[float] = []

        def _call(self, chunk: int, *a: object, **k: object) -> None:
            time.sleep(0.12 if chunk == 1 else 0.002)
            self.ended.append(time.perf_counter())

        forward_one_chunk = backward_one_chunk = backward_weight_one_chunk = _call

        def get_fwd_recv_ops(self, chunk: int) -> list[object]:
            return []

        get_bwd_recv_ops = get_fwd_recv_ops

    cpu = torch.device("cpu")
    ins = _Instruments(Timer(cpu), SavedTensorTracker(set()), LayerClock(cpu), trim=HeapTrim())
    st = Stage()
    ins.wrap(st)
    for call in (st.forward_one_chunk, st.backward_one_chunk, st.backward_weight_one_chunk):
        call(0)
        call(1)
    assert ins.trim.count == len(trims) == 3
    assert all(end <= t for end, t in zip(st.ended[1::2], trims))  # each after its long call had ended
    intervals = ins.timer.drain()
    assert [round(sec, 1) for _, _, mb, _, sec, *_ in intervals if mb == 1] == [0.1, 0.1, 0.1]
