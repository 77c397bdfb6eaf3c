"""Executor: pipeline training equals single-process training; faults end every rank; bad input is refused
before any process starts. 2 gloo ranks on CPU, one thread each."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, run_cli

from stageplan import RunError, RunReport, StageplanError
from stageplan.formats.plan import Plan
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.planning.planner import plan
from stageplan.profiling.profiler import profile_model
from stageplan.running.launch import run
from stageplan.zoo import build_workload

pytestmark = pytest.mark.slow

SMALL_GPT = {"n_layer": 3, "d_model": 32, "n_head": 2, "seq_len": 16, "vocab_size": 512, "batch_size": 8}


def _plan_for(spec: str, options: dict, p: int = 2, **kw):  # type: ignore[no-untyped-def]
    wl = build_workload(spec, options)
    prof = profile_model(wl, microbatch_size=wl.batch_size // kw.get("num_microbatches", 4), warmup=0, repeats=1)
    return prof, plan(prof, p, **kw)


@pytest.mark.parametrize(
    ("spec", "options", "schedule", "extra"),
    [
        ("gpt", {**SMALL_GPT, "tied": True}, "GPipe", {}),
        ("gpt", {**SMALL_GPT, "tied": True}, "1F1B", {}),
        ("convnet", {"batch_size": 8, "image_size": 32, "width": 4}, "GPipe", {}),
        ("convnet", {"batch_size": 8, "image_size": 32, "width": 4}, "1F1B", {}),
        ("hf-gpt2", {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16, "vocab_size": 512}, "GPipe", {}),
        ("hf-gpt2", {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16, "vocab_size": 512}, "1F1B", {}),
        ("gpt", {**SMALL_GPT, "n_layer": 4}, "Interleaved1F1B", {"virtual_stages": 2}),
        # the V puts two neighbouring chunks on one rank: torch's warm-up would message that rank itself (gloo refuses)
        ("gpt", {**SMALL_GPT, "n_layer": 4}, "ZBVZeroBubble", {"virtual_stages": 2}),
        ("convnet", {"batch_size": 8, "image_size": 32, "width": 4}, "ZBVZeroBubble", {"virtual_stages": 2}),
    ],
    ids=["gpt-tied-gpipe", "gpt-tied-1f1b", "convnet-gpipe", "convnet-1f1b", "hf-gpt2-gpipe", "hf-gpt2-1f1b",
         "gpt-interleaved-v2", "gpt-zbv", "convnet-zbv"],
)
def test_check_passes(spec: str, options: dict, schedule: str, extra: dict, tmp_path: Path) -> None:
    _prof, pl = _plan_for(spec, options, num_microbatches=4, schedule=schedule, method="uniform", optimizer="adamw", **extra)
    if options.get("tied"):
        holders = [st.index for st in pl.stages if any(n.startswith(("tok_emb", "ln_f+head")) for n in st.layers)]
        assert holders == [0, 1]  # the tied embedding/head weight lives on both ranks
    report = run(spec, pl, factory_options=options, steps=3, warmup=1, check=True, optimizer="adamw", output=tmp_path / "run.json")
    assert report.check is not None and report.check["passed"], report.check
    assert report.check["params_compared"] >= len(list(build_workload(spec, options).model.parameters()))
    assert [r["rank"] for r in report.ranks] == [0, 1]
    assert RunReport.load(tmp_path / "run.json") == report
    data = json.loads((tmp_path / "run.json").read_text())
    assert {"measured_step_s", "predicted_step_s", "ranks"} <= data.keys() and data["schema"] == "stageplan.run/2"
    # a report written before run/2 (rows under "stages", options under "options") still loads
    old = {**{k: v for k, v in data.items() if k not in ("ranks", "run_options")}, "schema": "stageplan.run/1",
           "stages": data["ranks"], "options": data["run_options"]}
    assert RunReport.from_json(old) == report
    for row in report.ranks:
        assert row["measured_compute_s"] > 0 and row["measured_peak_activation_bytes"] > 0
    # the per-layer clock: every layer once, on the rank the plan put it, and a rank's layers plus its chunks'
    # overhead make up its compute in the same steps (medians of parts against the median of the whole; against
    # the measured steps' compute a 3 ms rank missed by up to 66% on this noisy machine: other steps, other times)
    assert [x["index"] for x in report.layers] == list(range(len(pl.layer_names)))
    assert [x["rank"] for x in report.layers] == [pl.stages[x["stage"]].rank for x in report.layers]
    for row in report.ranks:
        mine = [x for x in report.layers if x["rank"] == row["rank"]]
        assert all(x["measured_forward_s"] >= 0 and x["measured_backward_s"] >= 0 for x in mine)
        parts = sum(x["measured_forward_s"] + x["measured_backward_s"] for x in mine)
        parts += row["measured_overhead_forward_s"] + row["measured_overhead_backward_s"]
        # each chunk call's clock phase encloses its timed call, so the parts never fall short of it (the medians of
        # two clocked steps are their means, so this holds per step and in the median); they exceed it by what runs in
        # a phase outside the timed call: bookkeeping, and on a loaded machine a garbage collection or preemption
        # there (+17% on a 2 ms rank once, +20-40% with a second test suite running beside this one)
        whole = row["measured_clock_compute_s"]
        assert whole * (1 - 1e-9) <= parts <= 1.5 * whole + 3 * 100e-6, (parts, whole)


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
    good = _check(wl, __import__("copy").deepcopy(reference), [{"losses": losses, "params": params}], options, 2)
    assert good["passed"], good
    params["2.weight"] += 1e-2
    bad = _check(wl, __import__("copy").deepcopy(reference), [{"losses": losses, "params": params}], options, 2)
    assert not bad["passed"] and bad["worst_param"] == "2.weight"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_failing_rank_ends_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    from stageplan.running import launch

    spawned: list[int] = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs):  # type: ignore[no-untyped-def]
        proc = real_popen(*args, **kwargs)
        spawned.append(proc.pid)
        return proc

    monkeypatch.setattr(launch.subprocess, "Popen", recording_popen)
    prof = Profile(tuple(LayerProfile(str(i), 1.0, 1.0, 0, 0, 0) for i in range(4)), {"batch_size": 8, "microbatch_size": 4})
    pl = plan(prof, 2, num_microbatches=2, method="uniform")
    start = time.monotonic()
    with pytest.raises(RunError, match=r"rank 1 failed: RuntimeError: bad layer: forward call 5; full traceback in .*rank1\.log") as info:
        run("workloads:faulty", pl, factory_options={"fail_step": 2, "num_microbatches": 2}, steps=5, warmup=0,
            log_dir=tmp_path / "logs", output=tmp_path / "run.json")
    assert time.monotonic() - start < 30
    assert info.value.rank == 1 and "Traceback" in Path(str(info.value.log_path)).read_text()
    assert len(spawned) == 2 and not any(_alive(pid) for pid in spawned)
    assert not (tmp_path / "run.json").exists()


def test_a_killed_rank_ends_every_rank(tmp_path: Path) -> None:
    prof = Profile(tuple(LayerProfile(str(i), 1.0, 1.0, 0, 0, 0) for i in range(4)), {"batch_size": 8, "microbatch_size": 4})
    pl = plan(prof, 2, num_microbatches=2, method="uniform")
    start = time.monotonic()
    with pytest.raises(RunError, match=r"rank 1 failed: killed by signal 9 \(SIGKILL\); full traceback in .*rank1\.log"):
        run("workloads:faulty", pl, factory_options={"fail_step": 1, "kill": True}, steps=4, warmup=0, log_dir=tmp_path)
    assert time.monotonic() - start < 30


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
    threads = [sorted(os.sched_getaffinity(t.tid)) for t in (old, new)]  # one started before pinning, one after
    old.stop()
    new.stop()
    queue.put({"refused": refused, "unchanged": unchanged == before, "block": block, "threads": threads,
               "main": sorted(os.sched_getaffinity(0)), "process": process_cpus()})


def test_pin_rank_cpus_moves_every_thread_and_new_ones_inherit() -> None:
    """A rank's threads, those it had and those it starts after (as gloo's are), all run on its block; with more
    ranks than CPUs nothing is pinned."""
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


def test_cli_run_table_and_failure_exit(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    prof = Profile(tuple(LayerProfile(str(i), 1.0, 1.0, 0, 0, 0) for i in range(4)), {"batch_size": 8, "microbatch_size": 4})
    plan(prof, 2, num_microbatches=2, method="uniform").save(tmp_path / "plan.json")
    code, out, _ = run_cli(["run", "workloads:faulty", "--set", "fail_step=100", "--plan", str(tmp_path / "plan.json"),
                            "--steps", "2", "--warmup", "1", "--check", "-o", str(tmp_path / "run.json")], capsys)
    assert code == 0, out
    assert "check: PASS" in out and "step: predicted" in out
    # each rank ran on its own CPUs, gloo's threads included (what the ranks read back after training)
    blocks = _blocks(2)
    report = RunReport.load(tmp_path / "run.json")
    assert report.meta["cpus_per_rank"] == blocks and report.run_options["pin_cpus"] is True
    assert "CPUs per rank: " + "; ".join(f"rank {r} on {','.join(map(str, b))}" for r, b in enumerate(blocks)) in out
    # gloo's threads ran with the short slice (the count is what the kernel read back), where the kernel has them
    assert report.meta["comm_thread_slice_us"] == 100
    if _kernel_has_custom_slices():
        assert all(n >= 1 for n in report.meta["short_slice_threads_per_rank"])
    # each rank timed its layers alone after the run: the compute ratio in two, printed
    assert all(r["retimed_compute_s"] > 0 and r["machine_ratio"] * r["pipeline_ratio"] == pytest.approx(r["compute_ratio"])
               for r in report.ranks)
    assert "compute ratio in two" in out
    monkeypatch.setenv("STAGEPLAN_COMM_SLICE_US", "0")  # the kernel's own slice: nothing set, nothing claimed
    code, out, _ = run_cli(["run", "workloads:faulty", "--set", "fail_step=100", "--plan", str(tmp_path / "plan.json"),
                            "--steps", "1", "--warmup", "0", "--no-pin", "--no-retime", "-o", str(tmp_path / "free.json")],
                           capsys)
    assert code == 0, out
    assert "CPUs per rank: not pinned" in out
    free = RunReport.load(tmp_path / "free.json")
    assert free.meta["cpus_per_rank"] == [None, None]
    # --no-retime: no layer timed alone, no split, no line
    assert free.run_options["retime"] is False and "compute ratio in two" not in out
    assert all(r["retimed_compute_s"] is None and r["machine_ratio"] is None for r in free.ranks)
    assert free.layers and all(x["retimed_forward_s"] is None for x in free.layers)
    assert free.meta["comm_thread_slice_us"] is None and free.meta["short_slice_threads_per_rank"] == [0, 0]
    monkeypatch.setenv("STAGEPLAN_COMM_SLICE_US", "50")  # below the kernel's 0.1 ms: refused before any rank starts
    code, _, err = run_cli(["run", "workloads:faulty", "--plan", str(tmp_path / "plan.json"), "--steps", "1"], capsys)
    assert_one_line_error(code, err, r"STAGEPLAN_COMM_SLICE_US must be 0 .* or 100-100000 microseconds, got '50'")
    monkeypatch.delenv("STAGEPLAN_COMM_SLICE_US")
    code, out, _ = run_cli(["show", str(tmp_path / "run.json")], capsys)
    assert code == 0 and "compute ms pred" in out
    code, _, err = run_cli(["run", "workloads:faulty", "--plan", str(tmp_path / "plan.json"), "--steps", "4", "--warmup", "0"], capsys)
    # progress lines ("run: step k/n") come first; the failure is one line, with no traceback
    errors = [ln for ln in err.strip().splitlines() if not ln.startswith("run: step ")]
    assert code == 1 and len(errors) == 1 and "rank 1 failed" in errors[0] and "Traceback" not in err


@pytest.fixture()
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    from stageplan.running import launch

    def refuse(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("a process was spawned for input that should have been refused")

    monkeypatch.setattr(launch.subprocess, "Popen", refuse)


def _toy_plan(tmp_path: Path, *, layers: int = 4, m: int = 2, schedule: str = "GPipe") -> str:
    prof = Profile(tuple(LayerProfile(str(i), 1.0, 1.0, 0, 0, 0) for i in range(layers)), {"batch_size": 8, "microbatch_size": 4})
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "plan.json"
    plan(prof, 2, num_microbatches=m, method="uniform", schedule=schedule).save(path)
    return str(path)


@pytest.mark.usefixtures("no_spawn")
def test_bad_run_input_is_refused_before_spawning(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    plan_path = _toy_plan(tmp_path)
    cases = [
        (["run", "workloads:mlp", "--plan", plan_path], r"the plan does not match this model: it has 4 layers, the model 8"),
        (["run", "workloads:faulty", "--plan", str(tmp_path / "missing.json")], r"plan file .*missing.json' does not exist"),
        (["run", "workloads:faulty", "--set", "batch_size=7", "--plan", plan_path],
         r"the batch of 7 does not divide into the plan's 2 microbatches"),
        (["run", "workloads:faulty", "--plan", plan_path, "--optimizer", "lamb"], r"unknown optimizer 'lamb'"),
        # priced at the profile's microbatch of 4 for 4 microbatches (a batch of 16): this batch of 8 would run 4 of 2
        (["run", "workloads:faulty", "--plan", _toy_plan(tmp_path / "m4", m=4)],
         r"the plan prices 4 microbatches of 4 samples \(a batch of 16\), and this model's batch of 8 makes 4 "
         r"microbatches of 2, .* plan --microbatches 2, profile at --microbatch-size 2"),
    ]
    for argv, pattern in cases:
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, pattern)
    # m < p for 1F1B: torch's Schedule1F1B refuses it; we refuse first
    data = json.loads(Path(plan_path).read_text())
    data["cost_options"].update(num_microbatches=1, schedule="1F1B")
    Path(plan_path).write_text(json.dumps(data))
    code, _, err = run_cli(["run", "workloads:faulty", "--plan", plan_path], capsys)
    assert_one_line_error(code, err, r"1F1B needs num_microbatches >= num_ranks, got num_microbatches=1 < num_ranks=2")
    # torchrun's environment half set, or out of range (tracebacks before), then a world size that does not match
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    code, _, err = run_cli(["run", "workloads:faulty", "--plan", _toy_plan(tmp_path)], capsys)
    assert_one_line_error(code, err, r"looks like a torchrun launch, but RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are "
                                     r"not set; start it with torchrun")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "3"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29999")):
        monkeypatch.setenv(key, value)
    for rank, world, pattern in (("abc", "2", r"RANK and WORLD_SIZE must be integers, got RANK='abc'"),
                                 ("3", "2", r"RANK must be in 0..WORLD_SIZE-1, got RANK=3, WORLD_SIZE=2"),
                                 ("0", "3", r"world size 3 does not match the plan's 2 pipeline ranks")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", world)
        code, _, err = run_cli(["run", "workloads:faulty", "--plan", _toy_plan(tmp_path)], capsys)
        assert_one_line_error(code, err, pattern)


def test_a_rank_that_cannot_meet_the_others_says_so_in_one_line(tmp_path: Path) -> None:
    """Rank 0 of 2 under torchrun's environment with no rank 1: the rendezvous times out as one line, exit 1 (a
    DistStoreError traceback before)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "stageplan", "run", "workloads:faulty", "--plan", _toy_plan(tmp_path),
                           "--timeout", "3", "--steps", "1"], env=env, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert re.search(r"rank 0 of 2 could not join the other ranks at 127\.0\.0\.1:\d+ within 3 s \(", lines[-1]), lines


def test_a_run_stepping_another_optimizer_than_the_plan_priced_says_so(tmp_path: Path) -> None:
    from stageplan.running.launch import _run_options

    pl = Plan.load(_toy_plan(tmp_path))  # priced with plan's default, adam
    kw = dict(steps=2, warmup=0, lr=None, check=False, backend=None, timeout_s=10.0)
    with pytest.warns(UserWarning, match=r"the plan priced a adam step and this run steps sgd: .* plan with --optimizer sgd"):
        assert _run_options(pl, optimizer="sgd", **kw)["optimizer"] == "sgd"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _run_options(pl, optimizer=None, **kw)["optimizer"] == "adam"  # the plan's own: nothing to say
        _run_options(pl, optimizer="ADAM", **kw)


def test_api_refuses_too(tmp_path: Path) -> None:
    with pytest.raises(StageplanError, match=r"does not divide into the plan's 2 microbatches"):
        run("workloads:faulty", _toy_plan(tmp_path), factory_options={"batch_size": 9})


def test_a_recompute_plan_recomputes_and_still_matches_one_process(tmp_path: Path) -> None:
    """The executor runs what the plan priced: with recompute each stage keeps nothing from its forward for the
    backward but what checkpointing holds, and training still equals single-process training."""
    options = {**SMALL_GPT, "n_layer": 4}
    _prof, plain = _plan_for("gpt", options, num_microbatches=4, schedule="GPipe", method="uniform")
    _prof, recomputed = _plan_for("gpt", options, num_microbatches=4, schedule="GPipe", method="uniform", recompute=True)
    assert plain.boundaries == recomputed.boundaries
    kept = run("gpt", plain, factory_options=options, steps=2, warmup=1)
    again = run("gpt", recomputed, factory_options=options, steps=2, warmup=1, check=True)
    assert again.check is not None and again.check["passed"], again.check
    for before, after in zip(kept.ranks, again.ranks):
        # the forward keeps nothing for the backward but what checkpointing holds
        assert after["measured_peak_activation_bytes"] < 0.5 * before["measured_peak_activation_bytes"]
        assert after["activation_ratio"] is None  # the hooks cannot see all that the plan counts: no false ratio


def test_a_failed_run_without_a_log_dir_keeps_the_logs_it_names(tmp_path: Path) -> None:
    prof = Profile(tuple(LayerProfile(str(i), 1.0, 1.0, 0, 0, 0) for i in range(4)), {"batch_size": 8, "microbatch_size": 4})
    pl = plan(prof, 2, num_microbatches=2, method="uniform")
    with pytest.raises(RunError) as info:
        run("workloads:faulty", pl, factory_options={"fail_step": 1}, steps=3, warmup=0)
    log = Path(str(info.value.log_path))
    assert log.exists() and "Traceback" in log.read_text()
    assert not (log.parent / "payload.pt").exists() and not (log.parent / "weights.safetensors").exists()
    import shutil

    shutil.rmtree(log.parent)
