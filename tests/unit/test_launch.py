"""stageplan.running.launch without starting a rank: what a run refuses before it spawns (another model's
plan, bad options, a log folder holding its files, an estimate run on the CPU), its options, and an
interrupted run's cleanup. Runs with ranks are in tests/integration/test_launch.py."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_one_line_error, run_cli

from stageplan.comparison import compare
from stageplan.errors import StageplanError
from stageplan.formats.plan import Plan
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.planning.planner import plan
from stageplan.running import launch
from stageplan.running.launch import run

from .test_cli import _plan_file, _profile


@pytest.mark.usefixtures("no_spawn")
def test_a_plan_for_other_factory_options_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pl = _plan_file(tmp_path, factory_options={"width": 16, "batch_size": 8})
    code, _, err = run_cli(["run", "workloads:faulty", "--plan", pl, "--set", "width=32"], capsys)
    assert_one_line_error(code, err,
                          r"the plan was made for workloads:faulty with other options: width=32 \(plan: 16\)")


@pytest.mark.usefixtures("no_spawn")
def test_a_plan_for_another_build_of_the_same_model_is_refused_by_the_api_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same layer names, another model: an option dropped at run time (the built-in records its defaults), an
    option that differs through the API, and a profile taken in another dtype."""
    from stageplan.zoo import build_workload

    gpt = dict(build_workload("gpt", {"n_layer": 2}).factory_options)
    pl = _plan_file(tmp_path, model="gpt", factory_options={**gpt, "vocab_size": 2048}, dtype="float32")
    code, _, err = run_cli(["run", "gpt", "--set", "n_layer=2", "--plan", pl], capsys)  # vocab_size dropped
    assert_one_line_error(code, err,
                          r"the plan was made for gpt with other options: vocab_size=8192 \(plan: 2048\)")
    with pytest.raises(StageplanError, match=r"with other options: seq_len=32 \(plan: 64\), vocab_size=8192"):
        launch.run("gpt", pl, factory_options={"n_layer": 2, "seq_len": 32})
    pl = _plan_file(tmp_path, model="gpt", factory_options=gpt, dtype="bfloat16")
    code, _, err = run_cli(["run", "gpt", "--set", "n_layer=2", "--plan", pl], capsys)
    assert_one_line_error(code, err, r"the plan was profiled in bfloat16, and this run trains the model in "
                                     r"its own float32: .* profile without --dtype")


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
    assert (
        not (tmp_path / "logs" / "payload.pt").exists()
        and not (tmp_path / "logs" / "weights.safetensors").exists()
    )


def test_a_log_dir_holding_what_a_run_writes_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run wrote its payload, weights and data into --log-dir and removed them afterwards, the user's files
    of those names included (a --weights checkpoint kept there was deleted), and a stale rank1.error was
    blamed."""
    for name in ("weights.safetensors", "rank1.error"):
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_text("the user's")
        (folder / "notes.txt").write_text("kept")
        code, _, err = run_cli(
            ["run", "workloads:faulty", "--plan", _plan_file(tmp_path), "--log-dir", str(folder)], capsys)
        assert_one_line_error(code, err, rf"--log-dir '.*' already holds {name}, which this tool did not "
                                         r"write and a run writes there .* give an empty or new folder")
        assert (folder / name).read_text() == "the user's"


def test_a_log_dir_an_earlier_run_wrote_is_taken_again_and_only_foreign_files_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rerunning with the same --log-dir was refused until the old rank logs were deleted. The tool's own
    files (its marker lists them) are replaced, a stale error of its own is removed before the ranks start
    (it would be blamed), and a file of a run's names that it did not write is still refused."""
    folder = tmp_path / "logs"
    seen: list[set[str]] = []

    def ranks_write(run_dir: Path, world: int, *a: Any, **k: Any) -> None:
        seen.append({p.name for p in run_dir.iterdir()})
        for r in range(world):
            (run_dir / f"rank{r}.log").write_text("this run's log")
        (run_dir / "rank1.error").write_text("RuntimeError: this run's error\n")
        raise launch.RunError("rank 1 failed")

    monkeypatch.setattr(launch, "_spawn_and_wait", ranks_write)
    for _ in range(2):  # the second run finds the first one's logs and error, and takes the folder again
        with pytest.raises(launch.RunError):
            launch.run("workloads:faulty", _plan_file(tmp_path), log_dir=folder)
    assert "rank1.error" not in seen[1] and "rank0.log" not in seen[1]  # removed before the ranks start
    assert (folder / "rank0.log").read_text() == "this run's log"
    (folder / "rank2.log").write_text("the user's")  # not a name this 2-rank run wrote
    with pytest.raises(StageplanError, match=r"already holds rank2.log, which this tool did not write"):
        launch.check_log_dir(folder)
    assert (folder / "rank2.log").read_text() == "the user's"
    (folder / launch.LOG_MARK).write_text("not json")  # an unreadable marker claims nothing
    with pytest.raises(StageplanError, match=r"already holds rank0.log, rank1.error, rank1.log, rank2.log"):
        launch.check_log_dir(folder)


def test_an_interrupted_compare_leaves_no_output_folder_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compare interrupted during its runs left an empty output folder: the folder it made goes; a folder the
    user had, and a finished compare's output, stay."""
    from stageplan import comparison

    def interrupted(*a: Any, **k: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(comparison, "_compare_runs", interrupted)
    for folder, kept in ((tmp_path / "new", False), (tmp_path / "had", True)):
        if kept:
            folder.mkdir()
        with pytest.raises(KeyboardInterrupt):
            compare("workloads:faulty", 2, profile=_profile(tmp_path), output_dir=folder, steps=1, warmup=0)
        assert folder.exists() == kept
        assert not kept or list(folder.iterdir()) == []


def test_run_takes_the_plans_optimizer_and_every_optimizer_word(tmp_path: Path) -> None:
    prof = Profile.load(_profile(tmp_path))
    for word in ("none", "sgd", "momentum", "adam", "adamw"):
        pl = plan(prof, 2, num_microbatches=2, optimizer=word)
        opts = launch._run_options(pl, steps=1, warmup=0, optimizer=None, lr=None, check=False, backend=None,
                                   timeout_s=10)
        assert opts["optimizer"] == word
        assert launch._run_options(pl, steps=1, warmup=0, optimizer=word, lr=None, check=False, backend=None,
                                   timeout_s=10)["optimizer"] == word


def test_more_local_ranks_than_cores_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda _pid: {0, 1})
    with pytest.warns(UserWarning, match=r"8 local ranks share 2 CPU cores"):
        launch._warn_oversubscribed(8, "gloo")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch._warn_oversubscribed(2, "gloo")


@pytest.mark.usefixtures("no_spawn")
def test_an_estimated_profile_is_labelled_and_not_run_on_the_cpu(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    meta = {"timer": "analytic", "estimate": {"gpu": "h100-sxm"}, "device": "estimate:h100-sxm",
            "batch_size": 8, "microbatch_size": 4, "model": "workloads:faulty"}
    prof = Profile(tuple(LayerProfile(str(i), 1e-3, 2e-3, 0, 8, 4) for i in range(4)), meta)
    prof.save(tmp_path / "est.json")
    code, out, _ = run_cli(
        ["plan", str(tmp_path / "est.json"), "--stages", "2", "-o", str(tmp_path / "plan.json")], capsys)
    assert code == 0 and "ESTIMATE: times are analytic (roofline) for h100-sxm" in out
    code, _, err = run_cli(["run", "workloads:faulty", "--plan", str(tmp_path / "plan.json")], capsys)
    assert_one_line_error(
        code, err, r"made from an analytic estimate for h100-sxm, not from a measurement of this machine")
    with pytest.raises(StageplanError, match=r"this profile is an analytic GPU estimate"):
        compare("workloads:faulty", 2, profile=tmp_path / "est.json")
    # measured on CUDA, run on CPU ranks (a CPU profile on
    # nccl ranks is refused alike, on a machine with GPUs)
    Profile(prof.layers, {**meta, "timer": "cuda-events", "estimate": None, "device": "cuda:0"}).save(
        tmp_path / "gpu.json"
    )
    code, _, _ = run_cli(
        ["plan", str(tmp_path / "gpu.json"), "--stages", "2", "-o", str(tmp_path / "gpu-plan.json")], capsys)
    code, _, err = run_cli(["run", "workloads:faulty", "--plan", str(tmp_path / "gpu-plan.json")], capsys)
    assert_one_line_error(code, err, r"made from a profile measured on cuda:0, and this run trains on cpu "
                                     r"\(gloo\): its predictions are for the other device; profile the model "
                                     r"on cpu")
    from stageplan.running.launch import _refuse_estimate_on_cpu

    on_cpu = plan(Profile(prof.layers, {**meta, "timer": "perf_counter", "estimate": None, "device": "cpu"}),
                  2)
    _refuse_estimate_on_cpu(on_cpu, "gloo")
    with pytest.raises(StageplanError,
                       match=r"measured on cpu, and this run trains on cuda \(nccl\).*--backend gloo"):
        _refuse_estimate_on_cpu(on_cpu, "nccl")
    from stageplan.plots import plot_stage_balance

    assert "ESTIMATE for h100-sxm" in plot_stage_balance(Plan.load(tmp_path / "plan.json")).get_title()


@pytest.mark.usefixtures("no_spawn")
def test_check_is_refused_when_the_reference_cannot_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # the faulty model: 3 x Linear(16, 16) = 3 x 272 x 4 B = 3.19 KiB. On a machine with 1 KiB free the
    # factory's weights are not written, the ranks initialise by FQN, and the reference that --check trains
    # would not fit
    monkeypatch.setattr(launch, "_available_bytes", lambda: 1024)
    code, _, err = run_cli(["run", "workloads:faulty", "--plan", _plan_file(tmp_path), "--check"], capsys)
    assert_one_line_error(code, err, r"--check trains the whole model in one process, and this model's "
                                     r"parameters \(3.19 KiB, twice that with gradients\) would not fit in "
                                     r"the 1.00 KiB available here; run without --check")


def _toy_plan(tmp_path: Path, *, layers: int = 4, m: int = 2, schedule: str = "GPipe") -> str:
    prof = Profile(tuple(LayerProfile(str(i), 1.0, 1.0, 0, 0, 0) for i in range(layers)),
                   {"batch_size": 8, "microbatch_size": 4})
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "plan.json"
    plan(prof, 2, num_microbatches=m, method="uniform", schedule=schedule).save(path)
    return str(path)


@pytest.mark.usefixtures("no_spawn")
def test_bad_run_input_is_refused_before_spawning(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    plan_path = _toy_plan(tmp_path)
    cases = [
        (
            ["run", "workloads:mlp", "--plan", plan_path],
            r"the plan does not match this model: it has 4 layers, the model 8",
        ),
        (
            ["run", "workloads:faulty", "--plan", str(tmp_path / "missing.json")],
            r"plan file .*missing.json' does not exist",
        ),
        (
            ["run", "workloads:faulty", "--set", "batch_size=7", "--plan", plan_path],
            r"the batch of 7 does not divide into the plan's 2 microbatches",
        ),
        (
            ["run", "workloads:faulty", "--plan", plan_path, "--optimizer", "lamb"],
            r"unknown optimizer 'lamb'",
        ),
        # priced at the profile's microbatch of 4 for 4 microbatches
        # (a batch of 16): this batch of 8 would run 4 of 2
        (
            ["run", "workloads:faulty", "--plan", _toy_plan(tmp_path / "m4", m=4)],
            r"the plan prices 4 microbatches of 4 samples \(a batch of 16\), and this model's batch of 8 "
            r"makes 4 microbatches of 2, .* plan --microbatches 2, profile at --microbatch-size 2",
        ),
    ]
    for argv, pattern in cases:
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, pattern)
    # m < p for 1F1B: torch's Schedule1F1B refuses it; we refuse first
    data = json.loads(Path(plan_path).read_text())
    data["cost_options"].update(num_microbatches=1, schedule="1F1B")
    Path(plan_path).write_text(json.dumps(data))
    code, _, err = run_cli(["run", "workloads:faulty", "--plan", plan_path], capsys)
    assert_one_line_error(code, err,
                          r"1F1B needs num_microbatches >= num_ranks, got num_microbatches=1 < num_ranks=2")
    # torchrun's environment half set, or out of range
    # (tracebacks before), then a world size that does not match
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    code, _, err = run_cli(["run", "workloads:faulty", "--plan", _toy_plan(tmp_path)], capsys)
    assert_one_line_error(code, err, r"looks like a torchrun launch, but RANK, WORLD_SIZE, MASTER_ADDR, "
                                     r"MASTER_PORT are not set; start it with torchrun")
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


def test_a_run_stepping_another_optimizer_than_the_plan_priced_says_so(tmp_path: Path) -> None:
    from stageplan.running.launch import _run_options

    pl = Plan.load(_toy_plan(tmp_path))  # priced with plan's default, adam
    kw = dict(steps=2, warmup=0, lr=None, check=False, backend=None, timeout_s=10.0)
    with pytest.warns(UserWarning, match=r"the plan priced a adam step and this run steps sgd: .* plan with "
                                         r"--optimizer sgd"):
        assert _run_options(pl, optimizer="sgd", **kw)["optimizer"] == "sgd"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _run_options(pl, optimizer=None, **kw)["optimizer"] == "adam"  # the plan's own: nothing to say
        _run_options(pl, optimizer="ADAM", **kw)


def test_api_refuses_too(tmp_path: Path) -> None:
    with pytest.raises(StageplanError, match=r"does not divide into the plan's 2 microbatches"):
        run("workloads:faulty", _toy_plan(tmp_path), factory_options={"batch_size": 9})


def test_the_runs_step_lines_say_how_long_is_left(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A step line from rank 0's log carries the time the steps left take at that step's pace (19 x 50 ms =
    0.95 s, said as 1 s; 500 steps x 1 s); the last step has nothing left to say."""
    from stageplan.running.launch import PROGRESS_PREFIX, _ProgressForwarder

    log = tmp_path / "rank0.log"
    log.write_text(f"{PROGRESS_PREFIX}step 1/20 50.0 ms\nother output\n{PROGRESS_PREFIX}step 20/20 50.0 ms\n"
                   f"{PROGRESS_PREFIX}step 100/600 1000.0 ms\n")
    _ProgressForwarder(log, enabled=True).poll()
    assert capsys.readouterr().err.splitlines() == ["run: step 1/20 50.0 ms (about 1 s left)",
                                                    "run: step 20/20 50.0 ms",
                                                    "run: step 100/600 1000.0 ms (about 8 min 20 s left)"]


def test_a_run_warns_of_memory_counted_at_another_precision_only() -> None:
    """A plan at bf16-mixed counts memory a float32 run does not hold: said. A plan of sharded replicas counts
    bytes at the profiled dtype's own precision (fp32), which the run trains in: nothing to say."""
    prof = Profile(tuple(LayerProfile(f"l{i}", 1e-3, 1e-3, 64, 256, 64) for i in range(4)),
                   meta={"batch_size": 8, "microbatch_size": 2, "dtype": "float32"})
    with pytest.warns(UserWarning, match=r"the plan counts memory for bf16-mixed training"):
        launch._warn_precision(plan(prof, 2, num_microbatches=4, precision="bf16-mixed"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch._warn_precision(plan(prof, 2, num_microbatches=4, data_parallel=2, sharding="zero1"))
