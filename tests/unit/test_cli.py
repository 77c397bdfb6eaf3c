"""stageplan.cli: every command through ``main(argv)``: outputs checked before any work, one-line errors with
exit 2 that name the flag, exports alone on stdout, warnings in one line, help text and the version."""

from __future__ import annotations

import json
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_one_line_error, run_cli

import stageplan
import stageplan.comparison as comparison
from stageplan import LayerProfile, Profile
from stageplan.cli import build_parser, main
from stageplan.planning.planner import METHODS, plan

from .test_planner import make_profile


def _write(tmp_path: Path, prof: Profile) -> str:
    path = tmp_path / "prof.json"
    prof.save(path)
    return str(path)


def test_cli_plan_compare_export_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, make_profile([1, 2, 3, 4, 5, 6]))
    code, out, err = run_cli(["plan", path, "--stages", "2", "--microbatches", "4", "--compare", "--export",
                              "megatron", "-o", str(tmp_path / "plan.json")], capsys)
    assert code == 0
    # with --export, stdout carries only the export (so `> layout.txt` captures it); the tables go to stderr
    assert out == "Ettt|tL\n"
    assert "balance efficiency" in err and "x optimal" in err and "--pipeline-model-parallel-layout" in err
    code, out, _ = run_cli(["show", str(tmp_path / "plan.json")], capsys)
    assert code == 0 and "boundaries [0, 4, 6]" in out


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--stages", "9"],
         r"num_ranks \(9\) exceeds the number of layers \(6\), one stage a rank; use --stages 6 or fewer"),
        (["--stages", "0"], r"num_ranks must be an integer >= 1, got 0"),
        (["--stages", "2", "--microbatches", "0"], r"num_microbatches must be an integer >= 1, got 0"),
        (["--stages", "2", "--schedule", "Zigzag"], r"unknown schedule 'Zigzag'"),
        (["--stages", "2", "--method", "random"],
         r"unknown method 'random'; use one of optimal, uniform, parameters"),
        (["--stages", "2", "--memory-limit", "40 gigs"], r"cannot read memory limit '40 gigs'"),
        (["--stages", "2", "--schedule", "Interleaved1F1B", "--virtual-stages", "4"],
         r"needs at least 8 layers, the profile has 6"),
        (["--stages", "2", "--device-speeds", "1,1,0.5"],
         r"got 3 device entries for 2 ranks; give one speed per rank, not per chunk"),
        (["--stages", "2", "--memory-limit", "1KiB", "--microbatches", "4"],
         r"smallest limit that admits a plan is"),
        (["--stages", "4", "--microbatches", "2"], r"1F1B needs num_microbatches >= num_ranks"),
        (["--stages", "2", "--export", "nope"], r"unknown export 'nope'"),
        (["--stages", "2", "--schedule", "Interleaved1F1B", "--virtual-stages", "2", "--export", "deepspeed"],
         r"deepspeed places one stage on each rank, and this Interleaved1F1B plan has 2 chunks on each of "
         r"its 2 ranks"),
        (["--stages", "2", "--schedule", "ZBVZeroBubble", "--virtual-stages", "2", "--export", "torchgpipe"],
         r"torchgpipe places one stage on each rank"),
        (["--stages", "2", "--schedule", "ZBVZeroBubble", "--virtual-stages", "2", "--export", "megatron"],
         r"Megatron places virtual stages round-robin \(stage s on rank s mod 2\), and this ZBVZeroBubble "
         r"plan places them otherwise \(ranks \[0, 1, 1, 0\]\); export torchtitan"),
        # every auto candidate of a fixed split over the limit (was an AssertionError); with 1F1B the m = 1
        # candidate's own error used to stand in for the memory limit
        *[(["--stages", "2", "--method", "uniform", "--memory-limit", "1KiB", "--microbatches", "auto",
            "--schedule", s],
           rf"no candidate of the 4 tried \({s}; m in \[1, 2, 4, 8\]\) fits the memory limits with method "
           rf"uniform; the closest, {s} with \d+ microbatch(es)?: rank 0 needs .* over its limit of 1.00 "
           rf"KiB.*raise --memory-limit")
          for s in ("GPipe", "1F1B")],
    ],
)
def test_cli_plan_bad_input(
    args: list[str], pattern: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, make_profile([1, 2, 3, 4, 5, 6], act=[1000] * 6))
    code, _, err = run_cli(["plan", path, *args], capsys)
    assert_one_line_error(code, err, pattern)


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (
            lambda d: d["layers"][0].update(forward_s=float("nan")),
            r"has forward_s = None; costs must be finite",
        ),
        (
            lambda d: d["layers"][1].update(backward_s=-1),
            r"has backward_s = -1; costs must be finite numbers >= 0",
        ),
        (lambda d: d.update(layers=[]), r"the profile has no layers"),
        (
            lambda d: d.update(schema="stageplan.profile/2"),
            r"schema 'stageplan.profile/2' but this stageplan reads",
        ),
        # beyond the required costs: each of these went through as a traceback or a wrong reading before
        (
            lambda d: d["layers"][1].update(backward_accumulate_s="x"),
            r"layer 1 \('blocks.0'\) has "
            r"backward_accumulate_s = 'x'; it must "
            r"be a finite number >= 0 or null",
        ),
        (
            lambda d: d["layers"][1].update(forward_iqr_s=-1),
            r"has forward_iqr_s = -1; it must be a finite number >= 0;",
        ),
        (
            lambda d: d["layers"][2].update(name="blocks.0"),
            r"layer 2 has name 'blocks.0', as layer 1 has; each layer needs",
        ),
        (
            lambda d: d["layers"][2].update(name=5),
            r"layer 2 has name 5; each layer needs its own non-empty name",
        ),
        (lambda d: d["meta"].update(batch_size="x"), r"meta batch_size = 'x'; it must be an integer >= 1"),
        (
            lambda d: d["meta"].update(microbatch_size=-8),
            r"meta microbatch_size = -8; it must be an integer >= 1",
        ),
        (
            lambda d: d["meta"].update(named_layers="blocks.0"),
            r"meta named_layers = 'blocks.0'; it must be a list of",
        ),
        (
            lambda d: d["meta"].update(optimizer_step={"floor_s": "x"}),
            r"meta optimizer_step = .*its floor_s must map",
        ),
        (
            lambda d: d["meta"].update(
                calibration={"allreduce_latency_s": "x", "allreduce_bandwidth_bytes_per_s": 1e9}
            ),
            r"meta calibration has allreduce_latency_s = 'x' and allreduce_bandwidth_bytes_per_s = "
            r"1000000000.0",
        ),
    ],
)
def test_cli_plan_bad_profiles(mutate: Any, pattern: str, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    data = make_profile([1, 2, 3, 4]).to_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data).replace("NaN", "null"))
    code, _, err = run_cli(["plan", str(path), "--stages", "2", "--microbatches", "2"], capsys)
    assert_one_line_error(code, err, pattern)


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--bandwidth", "1e-300"], r"bandwidth must be at least 1 kB/s, got '1e-300'"),
        (["--device-speeds", "1e-320,1"], r"device 0 speed must be between 1e-06 and 1e\+06, got 1e-320"),
        (["--megatron-layout", ""], r"Megatron layout '' holds no layers"),
        (["--megatron-layout", "(" * 100_000], r"groups nest deeper than 64 levels"),  # was a RecursionError
        (["--megatron-layout", "E,t*99999999999999|t,L"], r"repeats to more than 1,000,000 symbols"),
        (["--megatron-layout", "E" + "(t*999999)" * 3 + "|tL"], r"writes out to more than 1,000,000 symbols"),
        # was int()'s ValueError
        (["--megatron-layout", "t*" + "9" * 5000 + "|tL"],
         r"the count '9{20}.*repeats to more than 1,000,000"),
        (["--fqns", ""], r"--fqns '' is empty; give the JSON file of the parts"),
        (["--fqns", "{tmp}"], r"--fqns '.*' is a folder; give the JSON file of the parts"),
        (["--link", "{tmp}/none.json"],
         r"^stageplan: error: link file '.*none.json' does not exist; check the path"),
        (["--link", "{tmp}"],
         r"link '.*' is a folder, not a file; give the file inside it \(it holds bad.json, prof.json\)"),
    ],
)
def test_cli_plan_refuses_out_of_range_and_empty_inputs(args: list[str], pattern: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, make_profile([1, 2, 3, 4, 5, 6]))
    (tmp_path / "bad.json").write_text("{}")
    code, _, err = run_cli(
        ["plan", path, "--stages", "2", *[a.replace("{tmp}", str(tmp_path)) for a in args]], capsys)
    assert_one_line_error(code, err, pattern)


GPT = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu" / "gpt.json")


@pytest.mark.parametrize("content", ["null", "42", "true", "1.5", '{"module_fqns_per_model_part": null}',
                                     '{"module_fqns_per_model_part": 5}'])
def test_fqns_that_are_not_a_list_of_lists_are_one_line(content: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "f.json").write_text(content)
    code, _, err = run_cli(["plan", GPT, "--stages", "2", "--fqns", str(tmp_path / "f.json")], capsys)
    assert_one_line_error(code, err, r"module FQNs per model part must be a list of lists of module names")


def test_an_empty_output_path_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """plan -o '' and show --plot '' had written nothing and said nothing."""
    code, _, err = run_cli(["plan", GPT, "--stages", "2", "-o", ""], capsys)
    assert_one_line_error(code, err, r"the output path is empty; give a file name such as out.json")
    code, _, err = run_cli(["show", GPT, "--plot", ""], capsys)
    assert_one_line_error(code, err, r"cannot save a figure to '': it has no suffix")


def test_show_that_cannot_read_a_file_leaves_the_figure_there(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """show --plot drew the figure before the table that then failed on the file: the old figure was lost."""
    data = json.loads(Path(GPT).read_text())
    data["meta"]["whole_model_s"] = "x"
    (tmp_path / "p.json").write_text(json.dumps(data))
    (tmp_path / "fig.png").write_text("PRECIOUS")
    code, _, err = run_cli(["show", str(tmp_path / "p.json"), "--plot", str(tmp_path / "fig.png")], capsys)
    assert_one_line_error(code, err, r"meta whole_model_s = 'x'; it must be seconds >= 0 or null")
    assert (tmp_path / "fig.png").read_text() == "PRECIOUS"
    code, _, err = run_cli(["plan", str(tmp_path / "p.json"), "--stages", "2"], capsys)
    assert_one_line_error(code, err, r"meta whole_model_s = 'x'")


@pytest.mark.parametrize("command", ["compare", "tune"])
@pytest.mark.parametrize(("args", "words"), [
    (["--stages", "0"], r"num_ranks must be an integer >= 1, got 0; e.g. --stages 2"),
    (["--stages", "2", "--schedule", "foo"], r"unknown schedule 'foo'"),
    (["--stages", "2", "--steps", "0"], r"steps must be an integer >= 1 and warmup >= 0, got steps=0"),
    (["--stages", "2", "--timeout", "0"], r"timeout must be > 0 seconds, got 0.0"),
])
def test_compare_and_tune_refuse_their_loop_options_before_the_profile(
        command: str, args: list[str], words: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """They were refused only after profiling the model (seconds on a small model, minutes on a large one),
    with the profile's progress lines before the error and an empty -o folder left behind."""
    def no_profile(*_a: object, **_k: object) -> None:
        raise AssertionError("profiled before refusing")

    monkeypatch.setattr(comparison, "measured_profile", no_profile)
    code, _, err = run_cli([command, "gpt", *args, "-o", str(tmp_path / "out")], capsys)
    assert_one_line_error(code, err, words)
    assert not (tmp_path / "out").exists()


def test_compare_still_takes_schedule_auto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The early check must not refuse what compare accepted: --schedule auto reaches the profile (tune
    refuses it, as it did)."""
    class Reached(Exception):
        pass

    def reached(*_a: object, **_k: object) -> None:
        raise Reached

    monkeypatch.setattr(comparison, "measured_profile", reached)
    with pytest.raises(Reached):
        run_cli(["compare", "gpt", "--stages", "2", "--schedule", "auto"], capsys)


def test_show_draws_no_figure_when_its_table_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """show --plot had drawn the figure first, so a table
    that then failed had already replaced the old figure."""
    from stageplan import report
    from stageplan.errors import StageplanError

    def fails(_obj: object) -> str:
        raise StageplanError("the table failed")

    monkeypatch.setattr(report, "profile_table", fails)
    (tmp_path / "fig.png").write_text("PRECIOUS")
    code, _, err = run_cli(["show", GPT, "--plot", str(tmp_path / "fig.png")], capsys)
    assert_one_line_error(code, err, r"the table failed")
    assert (tmp_path / "fig.png").read_text() == "PRECIOUS"


@pytest.mark.parametrize(("argv", "says"), [
    (["plan", GPT, "--stages", "20"], r"num_ranks \(20\) exceeds the number of layers \(8\), one stage a "
                                      r"rank; use --stages 8 or fewer"),
    (["plan", GPT, "--stages", "2", "--virtual-stages", "2"], r"1F1B runs one stage per rank, got "
                                                              r"virtual_stages=2; use virtual_stages=1 "
                                                              r"\(--virtual-stages 1\)"),
])
def test_a_count_refused_through_the_cli_names_its_flag(argv: list[str], says: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The remedy names the CLI flag as well as the API name (these had said num_stages, which neither has,
    and virtual_stages=1 alone; compare's and tune's --stages 0, tested above, gave no flag)."""
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, says)


def test_profile_and_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    code, stdout, _ = run_cli(["profile", "gpt", "--set", "n_layer=2", "--set", "d_model=64", "--warmup", "1",
                               "--repeats", "2", "-o", str(out), "--csv", str(tmp_path / "p.csv")], capsys)
    assert code == 0
    assert "ln_f+head" in stdout and "sum of layers / whole" in stdout
    data = json.loads(out.read_text())
    assert data["meta"]["factory_options"]["d_model"] == 64 and data["meta"]["microbatch_size"] == 2
    code, stdout, _ = run_cli(["show", str(out)], capsys)
    assert code == 0 and "blocks.1" in stdout


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["profile", "gpt", "--processes", "0", "-o", "{tmp}/x.json"],
         r"processes must be an integer >= 1, got 0"),
        (["profile", "gpt", "--processes", "2", "--device", "estimate:h100-sxm", "-o", "{tmp}/x.json"],
         r"an estimate device measures nothing .*drop --processes"),
        (["profile", "gpt", "--processes", "2", "--microbatch-size", "3", "-o", "{tmp}/x.json"],
         r"does not divide the batch of 8"),
        (["profile", "nope", "--processes", "2", "-o", "{tmp}/x.json"], r"unknown model 'nope'"),
        # was dropped
        (["profile", "gpt", "--processes", "2", "--compute-efficiency", "0.5", "-o", "{tmp}/x.json"],
         r"compute_efficiency \(0.5\) applies to estimates only"),
        (["profile", "nope", "-o", "{tmp}/x.json"], r"unknown model 'nope'.*use a built-in name"),
        (["profile", "gpt", "--set", "n_layer", "-o", "{tmp}/x.json"], r"--set expects key=value"),
        (["profile", "gpt", "--microbatch-size", "0", "-o", "{tmp}/x.json"],
         r"microbatch size must be a positive integer, got 0"),
        (["profile", "gpt", "--microbatch-size", "3", "-o", "{tmp}/x.json"],
         r"does not divide the batch of 8"),
        (["profile", "gpt", "--layers", "nothing.*", "-o", "{tmp}/x.json"], r"matches no module"),
        (["profile", "gpt", "-o", "{tmp}/missing/x.json"], r"output folder .* does not exist"),
        (["profile", "gpt", "--set", "colour=3", "-o", "{tmp}/x.json"],
         r"takes no option 'colour'; its options are"),
        (["profile", "no_such_module_xyz:make", "-o", "{tmp}/x.json"],
         r"cannot import module 'no_such_module_xyz'"),
        (["profile", "badfactory:wrong_type", "-o", "{tmp}/x.json"],
         r"returned int, not a stageplan.Workload"),
        (["profile", "badfactory:missing", "-o", "{tmp}/x.json"], r"has no callable 'missing'"),
        (["profile", "badfactory:unsplittable", "-o", "{tmp}/x.json"],
         r"torch.export cannot split .*--layers"),
        (["show", "{tmp}/none.json"], r"does not exist"),
        # said "does not exist"
        (["show", "{tmp}"], r"input '.*' is a folder, not a file; give the file inside it"),
        (["show", "{tmp}/cmp.json"],
         r"compare result '.*cmp.json' has no 'methods'; each method needs boundaries"),
        # were KeyError tracebacks
        (["show", "{tmp}/cmp2.json"], r"method 'optimal' lacks or mangles predicted_step_s"),
        (["plan", str(Path(__file__).resolve().parents[2] / "profiles" / "cpu" / "gpt.json"), "--stages", "2",
          "--bandwidth", "0GB/s"], r"bandwidth must be a positive rate, got "
                                                                             r"'0GB/s'; use .* such as "
                                                                             r"25GB/s"),
        (["profile", "gpt"], r"required: -o/--output"),
        (["profile", "gpt", "--min-time", "-1", "-o", "{tmp}/x.json"],
         r"min_time_s must be a finite number of seconds >= 0, got -1.0; e\.g\. --min-time 20"),
        (["profile", "gpt", "--min-time", "5", "--device", "estimate:h100-sxm", "-o", "{tmp}/x.json"],
         r"min_time_s \(5.0\) spreads measured rounds over time, and an estimate measures nothing"),
        (["compare", "gpt", "--stages", "2", "--runs", "0"],
         r"runs must be an integer >= 1, got 0; e\.g\. --runs 3"),
        (["tune", "gpt", "--stages", "2", "--runs", "0", "-o", "{tmp}/t"],
         r"runs must be an integer >= 1, got 0"),
        (["compare", "gpt", "--stages", "2", "--min-time", "5", "--profile",
          str(Path(__file__).resolve().parents[2] / "profiles" / "cpu" / "gpt.json")],
         r"--min-time 5 spreads the rounds of the profile compare takes, and --profile gives the profile to "
         r"start from; drop one of them"),
        (["tune", "gpt", "--stages", "2", "--min-time", "-2", "-o", "{tmp}/t"],
         r"min_time_s must be a finite number of seconds >= 0, got -2.0"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv: list[str], pattern: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "badfactory.py").write_text(
        "import torch\nfrom torch import nn\nimport stageplan\n"
        "def wrong_type():\n    return 3\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.layers = nn.ModuleList(nn.Linear(4, 4) "
        "for _ in range(2))\n    def forward(self, x):\n"
        "        for m in self.layers:\n            x = m(x)\n            if x.sum() > 0:\n                x "
        "= x * 2\n        return x\n"
        "def unsplittable():\n    return stageplan.Workload(M(), torch.randn(8, 4))\n"
    )
    (tmp_path / "cmp.json").write_text('{"schema": "stageplan.compare/1"}')
    (tmp_path / "cmp2.json").write_text('{"schema": "stageplan.compare/1", "methods": {"optimal": '
                                        '{"boundaries": [0, 2, 4], "balance_efficiency": 1.0, '
                                        '"peak_memory_bytes": [1, 1]}}}')
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("badfactory", None)
    code, _, err = run_cli([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert_one_line_error(code, err, pattern)


def test_profile_refuses_one_path_for_the_profile_and_its_csv(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """-o X --csv X wrote the profile, then replaced it with the CSV, and exited 0 (show then called X invalid
    JSON): refused before any work, naming the path, and whatever X held stays as it was (also spelled another
    way)."""
    (tmp_path / "same.json").write_text("what the user had")
    for csv in (str(tmp_path / "same.json"), str(tmp_path / "." / "same.json")):
        code, _, err = run_cli(["profile", "gpt", "-o", str(tmp_path / "same.json"), "--csv", csv], capsys)
        assert_one_line_error(code, err,
                              r"-o and --csv both name '.*same.json', and the CSV would replace the profile")
        assert (tmp_path / "same.json").read_text() == "what the user had"


def test_a_json_file_nested_past_pythons_depth_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """json.loads recurses once per level: a file nested
    100,000 deep raised RecursionError through every input."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    gpt = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu" / "gpt.json")
    for argv in (["show", str(deep)], ["plan", str(deep), "--stages", "2"],
                 ["plan", gpt, "--stages", "2", "--link", str(deep)]):
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, r"'.*deep.json' nests its JSON deeper than Python reads")
    code, _, err = run_cli(["plan", gpt, "--stages", "2", "--fqns", str(deep)], capsys)
    assert_one_line_error(code, err, r"FQN file '.*deep.json' nests deeper than Python reads")


@pytest.mark.skipif("torch" in sys.modules and __import__("torch").cuda.is_available(),
                    reason="no-GPU message")
def test_cuda_without_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["profile", "gpt", "--device", "cuda", "-o", str(tmp_path / "x.json")], capsys)
    assert_one_line_error(code, err, r"no CUDA GPU")
    assert not (tmp_path / "x.json").exists()


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


@pytest.mark.usefixtures("no_spawn")
def test_an_output_that_is_the_commands_own_input_is_refused(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """plan -o PROFILE replaced the profile with a plan, run -o PLAN the plan with a report, calibrate -o
    PROFILE the raw profile."""
    prof, pl = _profile(tmp_path), _plan_file(tmp_path)
    before = {prof: Path(prof).read_text(), pl: Path(pl).read_text()}
    for argv, given in (
        (["plan", prof, "--stages", "2", "-o", prof], prof),
        (["run", "workloads:faulty", "--plan", pl, "-o", pl], pl),
        (["calibrate", prof, pl, "-o", str(Path(prof).parent / "." / Path(prof).name)], prof),
    ):
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, rf"output '.*' is this command's input '{re.escape(given)}'; "
                                         r"writing it would replace what it was made from")
    assert {prof: Path(prof).read_text(), pl: Path(pl).read_text()} == before


@pytest.mark.usefixtures("no_spawn")
def test_refusals_before_spawning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof, pl = _profile(tmp_path), _plan_file(tmp_path)
    cases = [
        (["run", "workloads:faulty", "--plan", pl, "--lr", "-1"],
         r"learning rate must be a finite number > 0, got -1"),
        (["run", "workloads:faulty", "--plan", pl, "--steps", "0"], r"steps must be an integer >= 1"),
        (["plan", prof, "--stages", "2", "--schedule", "1F1B", "--virtual-stages", "3"],
         r"1F1B runs one stage per rank, got virtual_stages=3"),
        (["show", pl, "--plot", str(tmp_path / "out.jpg")],
         r"suffix '.jpg' is not supported; .* use .png, .svg or .pdf"),
        (["show", pl, "--plot", str(tmp_path / "out")], r"it has no suffix"),
        (["plan", prof, "--stages", "2", "--export", "pippy"], r"unknown export 'pippy'"),
    ]
    for argv, pattern in cases:
        start = time.monotonic()
        code, _, err = run_cli(argv, capsys)
        assert time.monotonic() - start < 2.0
        assert_one_line_error(code, err, pattern)


def test_show_honours_the_suffix_and_reads_compare_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pl = _plan_file(tmp_path)
    for suffix, magic in ((".svg", b"<svg"), (".pdf", b"%PDF"), (".png", b"\x89PNG")):
        code, _, _ = run_cli(["show", pl, "--plot", str(tmp_path / f"plan{suffix}")], capsys)
        assert code == 0 and magic in (tmp_path / f"plan{suffix}").read_bytes()[:400]
    result = {"schema": "stageplan.compare/1", "identical": False, "methods": {
        m: {"boundaries": [0, 2, 4], "predicted_step_s": 0.1, "measured_step_s": 0.12,
            "speedup_over_uniform": 1.0,
            "balance_efficiency": 0.9, "peak_memory_bytes": [1.0, 2.0]} for m in METHODS}}
    (tmp_path / "compare.json").write_text(json.dumps(result))
    code, out, _ = run_cli(["show", str(tmp_path / "compare.json")], capsys)
    assert code == 0 and "speed-up vs uniform" in out and "parameters" in out


def test_an_export_alone_on_stdout_with_its_label_on_stderr(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    prof = _profile(tmp_path, n=6)
    for kind, hint in (("deepspeed", "PipelineModule parts"), ("torchtitan", "module_fqns_per_model_part"),
                       ("torchgpipe", "balance")):
        code, out, err = run_cli(["plan", prof, "--stages", "2", "--microbatches", "2", "--export", kind],
                                 capsys)
        assert code == 0 and hint in err and "balance efficiency" in err
        json.loads(out)  # stdout is exactly the export: redirect it to a file and load it


def test_cli_warnings_are_one_line_and_a_plan_note_is_not_warned_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shown = warnings.showwarning
    code, _, err = run_cli(["profile", "workloads:mlp", "--dtype", "float16", "--warmup", "0", "--repeats",
                            "1", "--quiet", "-o", str(tmp_path / "f16.json")], capsys)
    lines = err.strip().splitlines()
    assert code == 0 and len(lines) == 1, err  # no file:line, no source line, no category
    assert (
        lines[0].startswith("stageplan: warning: profiling in float16 on the CPU: ")
        and "UserWarning" not in err
    )
    assert warnings.showwarning is shown  # the caller's way of showing warnings is back
    # plan: the bubble is one of the report's notes, and not warned again above it
    code, out, err = run_cli(["plan", _profile(tmp_path), "--stages", "2", "--microbatches", "1",
                              "--schedule", "GPipe"],
                             capsys)
    assert code == 0 and "warning" not in err, err
    assert next(ln for ln in out.splitlines() if "num_microbatches (1) < num_ranks (2)" in ln).startswith(
        "note: "
    )
    assert out.count("num_microbatches (1) < num_ranks (2)") == 1
    # the API still warns it (a caller sees no report)
    with pytest.warns(stageplan.PlanNote, match=r"num_microbatches \(1\) < num_ranks \(2\): bubble"):
        plan(Profile.load(_profile(tmp_path)), 2, num_microbatches=1, schedule="GPipe")


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


def _readme_factory() -> str:
    """The README's five-line factory (the ```python block that defines build)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "def build(" in b)


def test_a_factory_in_the_current_folder_is_found_as_python_m_finds_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``stageplan profile mymodel:build`` from the folder that holds mymodel.py (the README's example), with
    no PYTHONPATH: the console script's sys.path holds its bin folder, not the current one (pytest's '' and
    cwd entries are taken out to match)."""
    import os

    (tmp_path / "mymodel.py").write_text(_readme_factory())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", os.getcwd(), str(tmp_path))])
    monkeypatch.delitem(sys.modules, "mymodel", raising=False)
    try:
        code, out, err = run_cli(["profile", "mymodel:build", "--set", "width=16", "--warmup", "0",
                                  "--repeats", "1", "--quiet", "-o", "p.json"], capsys)
        assert code == 0, err
        assert "wrote p.json (8 layers)" in out
        assert Profile.load(tmp_path / "p.json").meta["model"] == "mymodel:build"
        # a module that is in neither the folder nor the path names both
        code, _, err = run_cli(["profile", "notmymodel:build", "-o", "q.json"], capsys)
        assert code == 2 and f"check that notmymodel.py is in the current folder ({tmp_path})" in err
    finally:
        sys.modules.pop("mymodel", None)


def _tune_result(distorted: str | None) -> dict[str, Any]:
    row = {"boundaries": [0, 2, 4], "predicted_step_s": 0.1, "measured_step_s": 0.12, "error": 0.2,
           "distorted": None}
    return {"rounds": [dict(row), dict(row, distorted=distorted)], "final": dict(row),
            "uniform": dict(row, boundaries=[0, 3, 4], predicted_step_s=0.11, measured_step_s=0.11),
            "final_over_uniform_measured": 0.11 / 0.12, "final_prediction_error": 0.2}


@pytest.mark.parametrize("quiet", [False, True])
def test_tune_prints_each_round_once_and_warns_of_a_busy_machine(
        quiet: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """tune's progress prints each round as it ends; the command then printed them all again. Now they are
    printed once: by the progress lines, or with --quiet by the command. A distorted run is warned of, and the
    measured slow-down against the predicted speed-up (1.1x) is explained."""
    import stageplan.tuning as tuning

    why = "measured figures distorted: the load average was 3.30 on 2 CPUs, and the 2 ranks leave 0 free; x"

    def fake_tune(*_a: Any, progress: bool, **_k: Any) -> dict[str, Any]:
        if progress:
            print("tune round 1: ...", file=sys.stderr)
            print("tune round 2: ...", file=sys.stderr)
        return _tune_result(why)

    monkeypatch.setattr(tuning, "tune", fake_tune)
    code, out, err = run_cli(["tune", "gpt", "--stages", "2", "-o", str(tmp_path), *(["--quiet"] * quiet)],
                             capsys)
    assert code == 0
    said = [line for line in (out + err).splitlines() if re.match(r"(tune )?round \d", line)]
    assert len(said) == 2 and all(line.startswith("round" if quiet else "tune round") for line in said)
    assert f"warning: {why}" in out.splitlines()
    assert "note: the measured 0.917x reverses the predicted 1.100x because the load average was 3.30" in out


def test_show_reads_the_tune_and_link_files_the_tool_writes(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """tune.json and link.json, written as tune and link write them (tuning's schema, save_link): show prints
    each, a figure a line; a mangled one is refused in one line; --plot says they have no figure."""
    from stageplan.formats.link import save_link
    from stageplan.tuning import TUNE_SCHEMA

    tune = {"schema": TUNE_SCHEMA, **_tune_result(None)}
    (tmp_path / "tune.json").write_text(json.dumps(tune))
    code, out, _ = run_cli(["show", str(tmp_path / "tune.json")], capsys)
    assert code == 0
    assert out.splitlines()[0] == "round 1: boundaries [0, 2, 4], predicted 100.0 ms, measured 120.0 ms"
    assert "final / uniform measured: 0.917x faster (uniform: DeepSpeed's equal layers)" in out
    save_link({"backend": "gloo", "latency_s": 2.5e-5, "bandwidth_bytes_per_s": 1.5e9, "exchange_s": 4e-5,
               "pairs": [{"ranks": [0, 1]}]}, tmp_path / "link.json")
    code, out, _ = run_cli(["show", str(tmp_path / "link.json")], capsys)
    assert code == 0 and out.splitlines() == ["link (gloo, 2 ranks, median over 1 pairs):",
                                              "  latency 25.0 us", "  bandwidth 1.5 GB/s one way",
                                              "  fused send/receive exchange 40.0 us"]
    del tune["final"]
    (tmp_path / "bad.json").write_text(json.dumps(tune))
    code, _, err = run_cli(["show", str(tmp_path / "bad.json")], capsys)
    assert code == 2 and re.search(r"tune result .* lacks rounds, final or uniform", err)
    code, _, err = run_cli(["show", str(tmp_path / "link.json"), "--plot", str(tmp_path / "x.png")], capsys)
    assert code == 2 and "this file is a link result; drop --plot" in err


def test_errors_name_the_program_once_and_the_readers_own_words(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's errors said "stageplan: error: stageplan plan: ..."; a factory option's remedy says --set
    through the CLI and factory_options= through the API."""
    from stageplan.errors import StageplanError
    from stageplan.workload import options_words

    code, _, err = run_cli(["plan", "x.json", "--stages", "two"], capsys)
    assert code == 2 and err.startswith("stageplan: error: plan: argument --stages: invalid int value: "
                                        "'two'; see 'stageplan plan --help'")
    assert err.count("stageplan") == 2  # the prefix and the help command, not the program name twice
    assert options_words("tied=true", "n_layer=4", "name=x") == ("factory_options={'tied': True, 'n_layer': "
                                                                 "4, 'name': 'x'}")
    import torch

    from stageplan import Workload
    from stageplan.running.stages import check_same_model
    from stageplan.workload import IN_CLI

    wl = Workload(torch.nn.Linear(2, 2), torch.zeros(4, 2), name="gpt", factory_options={"n_layer": 4})
    meta = {"model": "gpt", "factory_options": {"n_layer": 6}}
    with pytest.raises(StageplanError, match=r"with these options \(factory_options=\{'n_layer': 4\}\)"):
        check_same_model(wl, meta, "plan")
    token = IN_CLI.set(True)
    try:
        with pytest.raises(StageplanError, match=r"with these options \(--set n_layer=4\)"):
            check_same_model(wl, meta, "plan")
    finally:
        IN_CLI.reset(token)
