"""What a first-time user hits: each item of the first-use review reproduced, now behaving.

Output paths that would lose finished work, runs without a target, script-defined models, plans used for another
model, interrupted runs, option sets that disagree between commands, exports mixed into tables, oversubscribed
cores, silent long commands, and the help text. CLI cases go through ``main(argv)``; multi-process ones are slow.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_one_line_error, run_cli
from torch import nn

import stageplan
from stageplan.cli import build_parser, main
from stageplan.comparison import compare
from stageplan.errors import StageplanError
from stageplan.formats.plan import Plan
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.planning.planner import METHODS, plan
from stageplan.running import launch

ROOT = Path(__file__).resolve().parents[1]


def _profile(tmp_path: Path, n: int = 4, **meta: Any) -> str:
    prof = Profile(tuple(LayerProfile(str(i), 1.0 + i, 1.0, 0, 8, 4) for i in range(n)),
                   {"batch_size": 8, "microbatch_size": 4, "model": "workloads:faulty", **meta})
    path = tmp_path / "prof.json"
    prof.save(path)
    return str(path)


def _plan_file(tmp_path: Path, **kw: Any) -> str:
    path = tmp_path / "plan.json"
    plan(_profile(tmp_path, **kw), 2, num_microbatches=2, method="uniform").save(path)
    return str(path)


@pytest.fixture()
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("a process was started for input that should have been refused")

    monkeypatch.setattr(launch.subprocess, "Popen", refuse)
    monkeypatch.setattr(launch, "_spawn_and_wait", refuse)


# -- 1. an unwritable output fails before any work, in under 2 s -----------------------------------------


@pytest.mark.usefixtures("no_spawn")
def test_unwritable_outputs_fail_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof, pl = _profile(tmp_path), _plan_file(tmp_path)
    cases = [
        ["profile", "gpt", "-o", "/proc/x.json"],
        ["profile", "gpt", "-o", str(tmp_path / "ok.json"), "--csv", "/proc/x.csv"],
        ["plan", prof, "--stages", "2", "-o", "/proc/p.json"],
        ["run", "workloads:faulty", "--plan", pl, "-o", "/proc/r.json"],
        ["run", "workloads:faulty", "--plan", pl, "--log-dir", "/proc/logs"],
        ["calibrate", prof, str(tmp_path / "run.json"), "-o", "/proc/c.json"],
        ["compare", "gpt", "--stages", "2", "-o", "/proc/cmp"],
        ["show", pl, "--plot", "/proc/plan.png"],
    ]
    for argv in cases:
        start = time.monotonic()
        code, _, err = run_cli(argv, capsys)
        assert time.monotonic() - start < 2.0, argv
        assert_one_line_error(code, err, r"cannot write .* in (the )?folder|does not exist")
        assert "/proc" in err or "run.json" in err, argv
    assert not (tmp_path / "ok.json").exists()


def test_a_write_that_fails_at_the_end_keeps_the_result(tmp_path: Path) -> None:
    from stageplan._io import save_or_keep

    prof = Profile.load(_profile(tmp_path))
    target = tmp_path / "gone" / "p.json"  # the folder disappeared while the work ran
    with pytest.raises(StageplanError, match=r"could not write .*p\.json.*; the result was kept in (/\S+\.json)") as info:
        save_or_keep(prof, target)
    kept = str(info.value).rsplit(" ", 1)[-1]
    assert Profile.load(kept) == prof
    Path(kept).unlink()


# -- 2. and 3. no target; a model defined in a script -----------------------------------------------------


@pytest.mark.slow
def test_run_without_a_target_uses_the_default_loss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from stageplan.profiling.profiler import profile_model
    from stageplan.zoo import build_workload

    prof = profile_model(build_workload("workloads:notarget", {}), microbatch_size=2, warmup=0, repeats=1)
    plan(prof, 2, num_microbatches=4).save(tmp_path / "plan.json")
    code, out, err = run_cli(["run", "workloads:notarget", "--plan", str(tmp_path / "plan.json"), "--steps", "2",
                              "--warmup", "1", "--check"], capsys)
    assert code == 0, err
    assert "check: PASS" in out


@pytest.mark.slow
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
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "passed True the workload's model" in done.stdout
    assert list(tmp_path.iterdir()) == [script]  # nothing left behind


# -- 4. a plan used for another model ---------------------------------------------------------------------


@pytest.mark.usefixtures("no_spawn")
def test_a_plan_for_other_factory_options_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pl = _plan_file(tmp_path, factory_options={"width": 16, "batch_size": 8})
    code, _, err = run_cli(["run", "workloads:faulty", "--plan", pl, "--set", "width=32"], capsys)
    assert_one_line_error(code, err, r"the plan was made for workloads:faulty with other options: width=32 \(plan: 16\)")


@pytest.mark.usefixtures("no_spawn")
def test_a_plan_for_another_build_of_the_same_model_is_refused_by_the_api_too(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Same layer names, another model: an option dropped at run time (the built-in records its defaults), an option
    that differs through the API, and a profile taken in another dtype."""
    from stageplan.zoo import build_workload

    gpt = dict(build_workload("gpt", {"n_layer": 2}).factory_options)
    pl = _plan_file(tmp_path, model="gpt", factory_options={**gpt, "vocab_size": 2048}, dtype="float32")
    code, _, err = run_cli(["run", "gpt", "--set", "n_layer=2", "--plan", pl], capsys)  # vocab_size dropped
    assert_one_line_error(code, err, r"the plan was made for gpt with other options: vocab_size=8192 \(plan: 2048\)")
    with pytest.raises(StageplanError, match=r"with other options: seq_len=32 \(plan: 64\), vocab_size=8192"):
        launch.run("gpt", pl, factory_options={"n_layer": 2, "seq_len": 32})
    pl = _plan_file(tmp_path, model="gpt", factory_options=gpt, dtype="bfloat16")
    code, _, err = run_cli(["run", "gpt", "--set", "n_layer=2", "--plan", pl], capsys)
    assert_one_line_error(code, err, r"the plan was profiled in bfloat16, and this run trains the model in its own "
                                     r"float32: .* profile without --dtype")


def test_hand_edited_boundaries_are_refused_and_given_ones_are_evaluated(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    prof = _profile(tmp_path, n=6)
    plan(prof, 2, num_microbatches=2).save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    data["boundaries"] = [0, 2, 6]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    code, _, err = run_cli(["show", str(tmp_path / "plan.json")], capsys)
    assert_one_line_error(code, err, r"has boundaries \[0, 2, 6\] but its evidence was computed for stages .* "
                                     r"re-evaluate that split with: stageplan plan PROFILE.json --boundaries 0,2,6")
    code, _, _ = run_cli(["plan", prof, "--stages", "2", "--microbatches", "2", "--boundaries", "0,2,6",
                            "-o", str(tmp_path / "given.json")], capsys)
    given = Plan.load(tmp_path / "given.json")
    assert code == 0 and given.boundaries == (0, 2, 6) and given.method == "given"
    # the evidence is the cost model's, the same as for any method: stage 1 holds layers 2..5
    assert given.stages[1].forward_s == pytest.approx(sum(1.0 + i for i in range(2, 6)))
    code, _, err = run_cli(["plan", prof, "--stages", "2", "--boundaries", "0,7,6"], capsys)
    assert_one_line_error(code, err, r"boundaries \[0, 7, 6\] must be 3 increasing cut points from 0 to 6")


# -- 6. an interrupted run leaves nothing behind ------------------------------------------------------------


def test_an_interrupted_run_removes_the_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Path] = []

    def interrupted(run_dir: Path, *a: Any, **k: Any) -> None:
        seen.append(run_dir)
        assert (run_dir / "payload.pt").exists() and (run_dir / "weights.safetensors").exists()
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "_spawn_and_wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        launch.run("workloads:faulty", _plan_file(tmp_path))
    assert not seen[0].exists()  # the temporary folder is gone
    with pytest.raises(KeyboardInterrupt):
        launch.run("workloads:faulty", _plan_file(tmp_path), log_dir=tmp_path / "logs")
    assert not (tmp_path / "logs" / "payload.pt").exists() and not (tmp_path / "logs" / "weights.safetensors").exists()


def _ranks_of(folder: Path) -> list[int]:
    """Processes whose command line names ``folder`` (the ranks: python -m stageplan.running.rank RUN_DIR ...)."""
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
def test_a_terminated_or_killed_launcher_leaves_no_rank_running(tmp_path: Path) -> None:
    """SIGTERM ends every rank and removes the run folder, as Ctrl-C does (they kept running, with the weights in
    /tmp); after a SIGKILL of the launcher, which can clean nothing, the ranks still end (PR_SET_PDEATHSIG)."""
    import signal

    from stageplan.profiling.profiler import profile_model
    from stageplan.zoo import build_workload

    options = {"n_layer": 2, "vocab_size": 512}
    prof = profile_model(build_workload("gpt", options), microbatch_size=2, warmup=0, repeats=1)
    plan(prof, 2, num_microbatches=4).save(tmp_path / "plan.json")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    argv = [sys.executable, "-m", "stageplan", "run", "gpt", "--set", "n_layer=2", "--set", "vocab_size=512", "--plan",
            str(tmp_path / "plan.json"), "--steps", "100000", "--quiet"]
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
            assert err.strip().splitlines()[-1] == "stageplan: terminated by SIGTERM; any rank processes it started were ended"
            assert not list(tmp_path.glob("stageplan-run-*"))


def test_profiling_processes_are_bounded_by_the_timeout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """compare/tune --processes profiled under a fixed 1800 s limit whatever --timeout said, and profile
    --processes had no --timeout: a layer that never returns hung them."""
    from stageplan import RunError

    start = time.monotonic()
    with pytest.raises(RunError, match=r"did not finish within the 6 s timeout"):
        compare("workloads:faulty", 2, factory_options={"hang": True}, processes=2, timeout_s=6)
    code, _, err = run_cli(["profile", "workloads:faulty", "--set", "hang=true", "--processes", "2", "--timeout", "6",
                            "-o", str(tmp_path / "p.json")], capsys)
    assert code == 1 and "did not finish within the 6 s timeout" in err and "Traceback" not in err
    assert time.monotonic() - start < 60
    assert not (tmp_path / "p.json").exists()


@pytest.mark.usefixtures("no_spawn")
def test_an_output_that_is_the_commands_own_input_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """plan -o PROFILE replaced the profile with a plan, run -o PLAN the plan with a report, calibrate -o PROFILE
    the raw profile."""
    prof, pl = _profile(tmp_path), _plan_file(tmp_path)
    before = {prof: Path(prof).read_text(), pl: Path(pl).read_text()}
    for argv, given in ((["plan", prof, "--stages", "2", "-o", prof], prof),
                        (["run", "workloads:faulty", "--plan", pl, "-o", pl], pl),
                        (["calibrate", prof, pl, "-o", str(Path(prof).parent / "." / Path(prof).name)], prof)):
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, rf"output '.*' is this command's input '{re.escape(given)}'; writing it would "
                                         r"replace what it was made from")
    assert {prof: Path(prof).read_text(), pl: Path(pl).read_text()} == before


def test_a_factory_build_that_never_ends_is_bounded_by_the_timeout(tmp_path: Path) -> None:
    """The launcher builds the user's factory once, in a forked child, to write the weights; it waited for it
    without a limit."""
    from stageplan import RunError

    start = time.monotonic()
    with pytest.raises(RunError, match=r"building 'workloads:sleepy' to write its weights did not finish within the 2 s"):
        launch._build_and_save("workloads:sleepy", {}, tmp_path / "weights.safetensors", 2.0)
    assert time.monotonic() - start < 20 and not (tmp_path / "weights.safetensors").exists()


def test_a_log_dir_holding_what_a_run_writes_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run wrote its payload, weights and data into --log-dir and removed them afterwards, the user's files of
    those names included (a --weights checkpoint kept there was deleted), and a stale rank1.error was blamed."""
    for name in ("weights.safetensors", "rank1.error"):
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_text("the user's")
        (folder / "notes.txt").write_text("kept")
        code, _, err = run_cli(["run", "workloads:faulty", "--plan", _plan_file(tmp_path), "--log-dir", str(folder)], capsys)
        assert_one_line_error(code, err, rf"--log-dir '.*' already holds {name}, which a run writes there .* give an "
                                         r"empty or new folder")
        assert (folder / name).read_text() == "the user's"


# -- 7. the same options everywhere -------------------------------------------------------------------------


def test_run_takes_the_plans_optimizer_and_every_optimizer_word(tmp_path: Path) -> None:
    prof = Profile.load(_profile(tmp_path))
    for word in ("none", "sgd", "momentum", "adam", "adamw"):
        pl = plan(prof, 2, num_microbatches=2, optimizer=word)
        opts = launch._run_options(pl, steps=1, warmup=0, optimizer=None, lr=None, check=False, backend=None, timeout_s=10)
        assert opts["optimizer"] == word
        assert launch._run_options(pl, steps=1, warmup=0, optimizer=word, lr=None, check=False, backend=None,
                                   timeout_s=10)["optimizer"] == word


@pytest.mark.usefixtures("no_spawn")
def test_refusals_before_spawning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof, pl = _profile(tmp_path), _plan_file(tmp_path)
    cases = [
        (["run", "workloads:faulty", "--plan", pl, "--lr", "-1"], r"learning rate must be a finite number > 0, got -1"),
        (["run", "workloads:faulty", "--plan", pl, "--steps", "0"], r"steps must be an integer >= 1"),
        (["plan", prof, "--stages", "2", "--schedule", "1F1B", "--virtual-stages", "3"],
         r"1F1B runs one stage per rank, got virtual_stages=3"),
        (["show", pl, "--plot", str(tmp_path / "out.jpg")], r"suffix '.jpg' is not supported; .* use .png, .svg or .pdf"),
        (["show", pl, "--plot", str(tmp_path / "out")], r"it has no suffix"),
        (["plan", prof, "--stages", "2", "--export", "pippy"], r"unknown export 'pippy'"),
    ]
    for argv, pattern in cases:
        start = time.monotonic()
        code, _, err = run_cli(argv, capsys)
        assert time.monotonic() - start < 2.0
        assert_one_line_error(code, err, pattern)


def test_show_honours_the_suffix_and_reads_compare_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pl = _plan_file(tmp_path)
    for suffix, magic in ((".svg", b"<svg"), (".pdf", b"%PDF"), (".png", b"\x89PNG")):
        code, _, _ = run_cli(["show", pl, "--plot", str(tmp_path / f"plan{suffix}")], capsys)
        assert code == 0 and magic in (tmp_path / f"plan{suffix}").read_bytes()[:400]
    result = {"schema": "stageplan.compare/1", "identical": False, "methods": {
        m: {"boundaries": [0, 2, 4], "predicted_step_s": 0.1, "measured_step_s": 0.12, "speedup_over_uniform": 1.0,
            "balance_efficiency": 0.9, "peak_memory_bytes": [1.0, 2.0]} for m in METHODS}}
    (tmp_path / "compare.json").write_text(json.dumps(result))
    code, out, _ = run_cli(["show", str(tmp_path / "compare.json")], capsys)
    assert code == 0 and "speed-up vs uniform" in out and "parameters" in out


# -- 8. exports --------------------------------------------------------------------------------------------


def test_an_export_alone_on_stdout_with_its_label_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = _profile(tmp_path, n=6)
    for kind, hint in (("deepspeed", "PipelineModule parts"), ("torchtitan", "module_fqns_per_model_part"),
                       ("torchgpipe", "balance")):
        code, out, err = run_cli(["plan", prof, "--stages", "2", "--microbatches", "2", "--export", kind], capsys)
        assert code == 0 and hint in err and "balance efficiency" in err
        json.loads(out)  # stdout is exactly the export: redirect it to a file and load it


# -- 9. more ranks than cores; nothing to compare -------------------------------------------------------------


def test_more_local_ranks_than_cores_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda _pid: {0, 1})
    with pytest.warns(UserWarning, match=r"8 local ranks share 2 CPU cores"):
        launch._warn_oversubscribed(8, "gloo")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch._warn_oversubscribed(2, "gloo")


def test_cli_warnings_are_one_line_and_a_plan_note_is_not_warned_twice(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    shown = warnings.showwarning
    code, _, err = run_cli(["profile", "workloads:mlp", "--dtype", "float16", "--warmup", "0", "--repeats", "1",
                            "--quiet", "-o", str(tmp_path / "f16.json")], capsys)
    lines = err.strip().splitlines()
    assert code == 0 and len(lines) == 1, err  # no file:line, no source line, no category
    assert lines[0].startswith("stageplan: warning: profiling in float16 on the CPU: ") and "UserWarning" not in err
    assert warnings.showwarning is shown  # the caller's way of showing warnings is back
    # plan: the bubble is one of the report's notes, and not warned again above it
    code, out, err = run_cli(["plan", _profile(tmp_path), "--stages", "2", "--microbatches", "1", "--schedule", "GPipe"],
                             capsys)
    assert code == 0 and "warning" not in err, err
    assert next(ln for ln in out.splitlines() if "num_microbatches (1) < num_ranks (2)" in ln).startswith("note: ")
    assert out.count("num_microbatches (1) < num_ranks (2)") == 1
    # the API still warns it (a caller sees no report)
    with pytest.warns(stageplan.PlanNote, match=r"num_microbatches \(1\) < num_ranks \(2\): bubble"):
        plan(Profile.load(_profile(tmp_path)), 2, num_microbatches=1, schedule="GPipe")


def test_compare_runs_nothing_when_every_method_agrees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("identical plans were run"))
    same = Profile(tuple(LayerProfile(str(i), 1.0, 1.0, 0, 0, 4) for i in range(4)), {"batch_size": 8, "microbatch_size": 2})
    same.save(tmp_path / "same.json")
    result = compare("workloads:faulty", 2, profile=tmp_path / "same.json", output_dir=tmp_path / "cmp")
    assert result["identical"] and all("measured_step_s" not in r for r in result["methods"].values())
    code, out, _ = run_cli(["show", str(tmp_path / "cmp" / "compare.json")], capsys)
    assert code == 0 and "nothing to compare" in out


# -- 10. signs of life -----------------------------------------------------------------------------------------


def test_profile_progress_is_plain_lines_off_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["profile", "workloads:mlp", "--warmup", "1", "--repeats", "2", "-o", str(tmp_path / "p.json")],
                           capsys)
    assert code == 0
    assert "profiling 8 layers: 3/3" in err and "\r" not in err


def test_half_precision_on_cpu_warns() -> None:
    from stageplan.profiling.profiler import profile_model
    from stageplan.zoo import build_workload

    with pytest.warns(UserWarning, match=r"profiling in float16 on the CPU"):
        profile_model(build_workload("workloads:mlp", {}), microbatch_size=4, dtype="float16", warmup=0, repeats=1)


# -- 11. help and documentation ---------------------------------------------------------------------------------


def test_version_and_help_with_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from stageplan._version import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"stageplan {__version__}"
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():  # type: ignore[attr-defined]
        assert p.description, name
        for action in p._actions:
            if action.dest != "help":
                assert action.help, f"{name} {action.option_strings or action.dest} has no help"
    help_text = sub.choices["compare"].format_help()  # type: ignore[attr-defined]
    assert "(default: 10)" in help_text and "(default: 1F1B)" in help_text


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


def test_the_readme_says_how_to_open_the_notebooks_and_the_tour_uses_a_scratch_folder() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make jupyter" in readme and "jupyter:" in (ROOT / "Makefile").read_text()
    assert "notebooks =" in (ROOT / "setup.cfg").read_text()
    assert "scratch folder" in readme


# -- estimates are labelled, and never taken as measurements ------------------------------------------------------


@pytest.mark.usefixtures("no_spawn")
def test_an_estimated_profile_is_labelled_and_not_run_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    meta = {"timer": "analytic", "estimate": {"gpu": "h100-sxm"}, "device": "estimate:h100-sxm", "batch_size": 8,
            "microbatch_size": 4, "model": "workloads:faulty"}
    prof = Profile(tuple(LayerProfile(str(i), 1e-3, 2e-3, 0, 8, 4) for i in range(4)), meta)
    prof.save(tmp_path / "est.json")
    code, out, _ = run_cli(["plan", str(tmp_path / "est.json"), "--stages", "2", "-o", str(tmp_path / "plan.json")], capsys)
    assert code == 0 and "ESTIMATE: times are analytic (roofline) for h100-sxm" in out
    code, _, err = run_cli(["run", "workloads:faulty", "--plan", str(tmp_path / "plan.json")], capsys)
    assert_one_line_error(code, err, r"made from an analytic estimate for h100-sxm, not from a measurement of this machine")
    with pytest.raises(StageplanError, match=r"this profile is an analytic GPU estimate"):
        compare("workloads:faulty", 2, profile=tmp_path / "est.json")
    # measured on CUDA, run on CPU ranks (a CPU profile on nccl ranks is refused alike, on a machine with GPUs)
    Profile(prof.layers, {**meta, "timer": "cuda-events", "estimate": None, "device": "cuda:0"}).save(tmp_path / "gpu.json")
    code, _, _ = run_cli(["plan", str(tmp_path / "gpu.json"), "--stages", "2", "-o", str(tmp_path / "gpu-plan.json")], capsys)
    code, _, err = run_cli(["run", "workloads:faulty", "--plan", str(tmp_path / "gpu-plan.json")], capsys)
    assert_one_line_error(code, err, r"made from a profile measured on cuda:0, and this run trains on cpu \(gloo\): its "
                                     r"predictions are for the other device; profile the model on cpu")
    from stageplan.running.launch import _refuse_estimate_on_cpu

    on_cpu = plan(Profile(prof.layers, {**meta, "timer": "perf_counter", "estimate": None, "device": "cpu"}), 2)
    _refuse_estimate_on_cpu(on_cpu, "gloo")
    with pytest.raises(StageplanError, match=r"measured on cpu, and this run trains on cuda \(nccl\).*--backend gloo"):
        _refuse_estimate_on_cpu(on_cpu, "nccl")
    from stageplan.plots import plot_stage_balance

    assert "ESTIMATE for h100-sxm" in plot_stage_balance(Plan.load(tmp_path / "plan.json")).get_title()


@pytest.mark.usefixtures("no_spawn")
def test_check_is_refused_when_the_reference_cannot_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # the faulty model: 3 x Linear(16, 16) = 3 x 272 x 4 B = 3.19 KiB. On a machine with 1 KiB free the factory's
    # weights are not written, the ranks initialise by FQN, and the reference that --check trains would not fit
    monkeypatch.setattr(launch, "_available_bytes", lambda: 1024)
    code, _, err = run_cli(["run", "workloads:faulty", "--plan", _plan_file(tmp_path), "--check"], capsys)
    assert_one_line_error(code, err, r"--check trains the whole model in one process, and this model's parameters "
                                     r"\(3.19 KiB, twice that with gradients\) would not fit in the 1.00 KiB available "
                                     r"here; run without --check")


def test_the_cli_profiles_a_model_fn_factory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # small enough to fit: materialised whole from meta (initialised by FQN); --streaming: one layer at a time
    for flags, how in (([], "whole-model"), (["--streaming"], "layer-at-a-time")):
        code, _, err = run_cli(["profile", "workloads:big", *flags, "--warmup", "0", "--repeats", "1", "--quiet",
                                "-o", str(tmp_path / "big.json")], capsys)
        assert code == 0, err
        prof = Profile.load(tmp_path / "big.json")
        assert len(prof) == 4 and prof.meta["materialized"] == how
        assert [x.param_bytes for x in prof.layers] == [(32 * 32 + 32) * 4] * 4
