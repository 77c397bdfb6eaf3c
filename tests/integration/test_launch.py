"""The launcher with real processes: failing, killed and hung ranks end every rank, a launcher killed by a
signal leaves none, timeouts bound profiling processes and factory builds, and profiles in fresh processes
merge."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import run_cli
from unit.test_launch import _toy_plan

from stageplan import RunError
from stageplan.comparison import compare
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.planning.planner import plan
from stageplan.running import launch
from stageplan.running.launch import run


def test_profile_in_processes_merges_fresh_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import stageplan
    from stageplan.zoo import build_workload

    out = tmp_path / "p.json"
    tiny = ["gpt", "--set", "n_layer=2", "--set", "d_model=64"]
    code, stdout, _ = run_cli(["profile", *tiny, "--warmup", "1", "--repeats", "2", "--processes", "2",
                               "--quiet", "-o", str(out)], capsys)
    assert code == 0, stdout
    merged = stageplan.Profile.load(out)
    procs = merged.meta["processes"]
    # two measurements
    assert procs["count"] == 2 and len(procs["digests"]) == 2 and len(set(procs["digests"])) == 2
    assert [r["layer"] for r in procs["range"]] == merged.names
    # what is not a time comes out as one process measures it here
    here = stageplan.profile_model(build_workload("gpt", {"n_layer": 2, "d_model": 64}), microbatch_size=2,
                                   warmup=0, repeats=1)
    assert merged.names == here.names
    assert [(x.activation_bytes, x.output_bytes, x.param_bytes) for x in merged.layers] == [
        (x.activation_bytes, x.output_bytes, x.param_bytes) for x in here.layers]
    assert merged.meta["microbatch_size"] == 2 and merged.meta["threads"] == 1
    code, stdout, _ = run_cli(["show", str(out)], capsys)
    assert code == 0 and "median over 2 processes" in stdout


def test_a_model_defined_in_a_script_runs(tmp_path: Path) -> None:
    script = tmp_path / "mine.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        import stageplan

        class Net(nn.Module):  # lives in __main__: a fresh process could not unpickle it
            def __init__(self):
                super().__init__()
                self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
                self.head = nn.Linear(32, 1)

            def forward(self, x):
                return self.head(self.layers(x))

        torch.manual_seed(0)
        wl = stageplan.Workload(Net(), torch.randn(8, 32), torch.randn(8, 1), nn.functional.mse_loss)
        prof = stageplan.profile_model(wl, microbatch_size=2, warmup=0, repeats=1)
        report = stageplan.run(wl, stageplan.plan(prof, 2, num_microbatches=4), steps=2, warmup=1, check=True)
        print("passed", report.check["passed"], report.run_options["weights_from"])
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "passed True the workload's model" in done.stdout
    assert list(tmp_path.iterdir()) == [script]  # nothing left behind


def _ranks_of(folder: Path) -> list[int]:
    """Processes whose command line names ``folder`` (the
    ranks: python -m stageplan.running.rank RUN_DIR ...)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "stageplan.running.rank" in cmd and str(folder) in cmd:
                pids.append(int(proc.name))
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_keeps_the_steps_measured_as_a_partial_report_and_the_log_dir_can_be_used_again(
    tmp_path: Path,
) -> None:
    """Ctrl-C during a run lost the 46 of 50 steps already done. Now the ranks stop together after their
    current step; the report of the steps measured is written, marked partial, the CLI exits 130 and no rank
    is left. The same --log-dir then takes the next run (it had been refused until its logs were deleted)."""
    import json
    import signal

    from stageplan.profiling.profiler import profile_model
    from stageplan.zoo import build_workload

    options = {"n_layer": 2, "vocab_size": 512}
    prof = profile_model(build_workload("gpt", options), microbatch_size=2, warmup=0, repeats=1)
    plan(prof, 2, num_microbatches=4).save(tmp_path / "plan.json")
    argv = [sys.executable, "-m", "stageplan", "run", "gpt", "--set", "n_layer=2", "--set", "vocab_size=512",
            "--plan", str(tmp_path / "plan.json"), "--warmup", "1", "--log-dir", str(tmp_path / "logs"),
            "-o", str(tmp_path / "run.json")]
    proc = subprocess.Popen([*argv, "--steps", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:  # the progress lines, a step a line
        lines.append(line)
        if line.startswith("run: step 3/100000"):
            break
    proc.send_signal(signal.SIGINT)  # a terminal's Ctrl-C reaches the launcher; the ranks have their session
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, "".join(lines) + err
    assert _ranks_of(tmp_path / "logs") == []
    part = json.loads((tmp_path / "run.json").read_text())["meta"]["partial"]
    assert 3 <= part["steps_measured"] < 100000 and part["steps_asked"] == 100000
    last = err.strip().splitlines()[-1]
    assert last == (f"stageplan: interrupted after {part['steps_measured']} of 100000 measured steps; "
                    f"partial report written to {tmp_path / 'run.json'}")
    assert f"partial: interrupted (Ctrl-C) after {part['steps_measured']} of 100000 measured steps" in out
    again = subprocess.run([*argv, "--steps", "1", "--no-retime", "--quiet"], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr
    assert "partial" not in json.loads((tmp_path / "run.json").read_text())["meta"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
def test_a_terminated_or_killed_launcher_leaves_no_rank_running(tmp_path: Path) -> None:
    """SIGTERM ends every rank and removes the run folder, as Ctrl-C does (they kept running, with the weights
    in /tmp); after a SIGKILL of the launcher, which can clean nothing, the ranks still end
    (PR_SET_PDEATHSIG)."""
    import signal

    from stageplan.profiling.profiler import profile_model
    from stageplan.zoo import build_workload

    options = {"n_layer": 2, "vocab_size": 512}
    prof = profile_model(build_workload("gpt", options), microbatch_size=2, warmup=0, repeats=1)
    plan(prof, 2, num_microbatches=4).save(tmp_path / "plan.json")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    argv = [sys.executable, "-m", "stageplan", "run", "gpt", "--set", "n_layer=2", "--set", "vocab_size=512",
            "--plan", str(tmp_path / "plan.json"), "--steps", "100000", "--quiet"]
    for sig, code in ((signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)):
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while len(_ranks_of(tmp_path)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert len(_ranks_of(tmp_path)) == 2, proc.communicate()
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode == code, err
        deadline = time.monotonic() + 15
        while _ranks_of(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _ranks_of(tmp_path) == []
        if sig == signal.SIGTERM:
            assert err.strip().splitlines()[-1] == ("stageplan: terminated by SIGTERM; any rank processes it "
                                                    "started were ended")
            assert not list(tmp_path.glob("stageplan-run-*"))


def test_profiling_processes_are_bounded_by_the_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """compare/tune --processes profiled under a fixed 1800 s limit whatever --timeout said, and profile
    --processes had no --timeout: a layer that never returns hung them."""
    from stageplan import RunError

    start = time.monotonic()
    with pytest.raises(RunError, match=r"did not finish within the 6 s timeout"):
        compare("workloads:faulty", 2, factory_options={"hang": True}, processes=2, timeout_s=6)
    code, _, err = run_cli(["profile", "workloads:faulty", "--set", "hang=true", "--processes", "2",
                            "--timeout", "6", "-o", str(tmp_path / "p.json")], capsys)
    assert code == 1 and "did not finish within the 6 s timeout" in err and "Traceback" not in err
    assert time.monotonic() - start < 60
    assert not (tmp_path / "p.json").exists()


def test_a_factory_build_that_never_ends_is_bounded_by_the_timeout(tmp_path: Path) -> None:
    """The launcher builds the user's factory once, in a forked child, to write the weights; it waited for it
    without a limit."""
    from stageplan import RunError

    start = time.monotonic()
    with pytest.raises(RunError, match=r"building 'workloads:sleepy' to write its weights did not finish "
                                       r"within the 2 s"):
        launch._build_and_save("workloads:sleepy", {}, tmp_path / "weights.safetensors", 2.0)
    assert time.monotonic() - start < 20 and not (tmp_path / "weights.safetensors").exists()


def test_a_rendezvous_port_taken_after_it_was_chosen_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process can take the free port between the launcher choosing it and rank 0 listening on it:
    that start fails with EADDRINUSE before any work, and the launcher starts again on a new port (a bounded
    number of times)."""
    import socket

    from stageplan import RunError
    from stageplan.running import launch

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = int(taken.getsockname()[1])
    real = launch._free_port
    chosen: list[int] = []

    def first_taken() -> int:
        chosen.append(busy if not chosen else real())
        return chosen[-1]

    try:
        monkeypatch.setattr(launch, "_free_port", first_taken)
        link = launch.measure_link(2, timeout_s=120)
        assert link["latency_s"] > 0 and len(chosen) == 2 and chosen[0] == busy != chosen[1]
        monkeypatch.setattr(launch, "_free_port", lambda: chosen.append(busy) or busy)
        chosen.clear()
        with pytest.raises(RunError, match="EADDRINUSE"):
            launch.measure_link(2, timeout_s=120)
        assert chosen == [busy] * launch.PORT_TRIES
    finally:
        taken.close()


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
    prof = Profile(tuple(LayerProfile(str(i), 1.0, 1.0, 0, 0, 0) for i in range(4)),
                   {"batch_size": 8, "microbatch_size": 4})
    pl = plan(prof, 2, num_microbatches=2, method="uniform")
    start = time.monotonic()
    with pytest.raises(RunError, match=r"rank 1 failed: RuntimeError: bad layer: forward call 5; full "
                                       r"traceback in .*rank1\.log") as info:
        run("workloads:faulty", pl, factory_options={"fail_step": 2, "num_microbatches": 2}, steps=5,
            warmup=0, log_dir=tmp_path / "logs", output=tmp_path / "run.json")
    assert time.monotonic() - start < 30
    assert info.value.rank == 1 and "Traceback" in Path(str(info.value.log_path)).read_text()
    assert len(spawned) == 2 and not any(_alive(pid) for pid in spawned)
    assert not (tmp_path / "run.json").exists()


def test_a_killed_rank_ends_every_rank(tmp_path: Path) -> None:
    prof = Profile(tuple(LayerProfile(str(i), 1.0, 1.0, 0, 0, 0) for i in range(4)),
                   {"batch_size": 8, "microbatch_size": 4})
    pl = plan(prof, 2, num_microbatches=2, method="uniform")
    start = time.monotonic()
    with pytest.raises(
            RunError, match=r"rank 1 failed: killed by signal 9 \(SIGKILL\); full traceback in .*rank1\.log"):
        run("workloads:faulty", pl, factory_options={"fail_step": 1, "kill": True}, steps=4, warmup=0,
            log_dir=tmp_path)
    assert time.monotonic() - start < 30


def test_a_rank_that_cannot_meet_the_others_says_so_in_one_line(tmp_path: Path) -> None:
    """Rank 0 of 2 under torchrun's environment with no rank 1: the rendezvous times out as one line, exit 1
    (a DistStoreError traceback before)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "stageplan", "run", "workloads:faulty", "--plan",
                           _toy_plan(tmp_path),
                           "--timeout", "3", "--steps", "1"], env=env, capture_output=True, text=True,
                          timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert re.search(r"rank 0 of 2 could not join the other ranks at 127\.0\.0\.1:\d+ within 3 s \(",
                     lines[-1]), lines


def test_a_failed_run_without_a_log_dir_keeps_the_logs_it_names(tmp_path: Path) -> None:
    prof = Profile(tuple(LayerProfile(str(i), 1.0, 1.0, 0, 0, 0) for i in range(4)),
                   {"batch_size": 8, "microbatch_size": 4})
    pl = plan(prof, 2, num_microbatches=2, method="uniform")
    with pytest.raises(RunError) as info:
        run("workloads:faulty", pl, factory_options={"fail_step": 1}, steps=3, warmup=0)
    log = Path(str(info.value.log_path))
    assert log.exists() and "Traceback" in log.read_text()
    assert not (log.parent / "payload.pt").exists() and not (log.parent / "weights.safetensors").exists()
    import shutil

    shutil.rmtree(log.parent)
