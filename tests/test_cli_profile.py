"""CLI: stageplan profile / show, and every bad input as one line with exit 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli


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


def test_profile_in_processes_merges_fresh_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import stageplan
    from stageplan.zoo import build_workload

    out = tmp_path / "p.json"
    tiny = ["gpt", "--set", "n_layer=2", "--set", "d_model=64"]
    code, stdout, _ = run_cli(["profile", *tiny, "--warmup", "1", "--repeats", "2", "--processes", "2", "--quiet",
                               "-o", str(out)], capsys)
    assert code == 0, stdout
    merged = stageplan.Profile.load(out)
    procs = merged.meta["processes"]
    assert procs["count"] == 2 and len(procs["digests"]) == 2 and len(set(procs["digests"])) == 2  # two measurements
    assert [r["layer"] for r in procs["range"]] == merged.names
    # what is not a time comes out as one process measures it here
    here = stageplan.profile_model(build_workload("gpt", {"n_layer": 2, "d_model": 64}), microbatch_size=2, warmup=0,
                                   repeats=1)
    assert merged.names == here.names
    assert [(x.activation_bytes, x.output_bytes, x.param_bytes) for x in merged.layers] == [
        (x.activation_bytes, x.output_bytes, x.param_bytes) for x in here.layers]
    assert merged.meta["microbatch_size"] == 2 and merged.meta["threads"] == 1
    code, stdout, _ = run_cli(["show", str(out)], capsys)
    assert code == 0 and "median over 2 processes" in stdout


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["profile", "gpt", "--processes", "0", "-o", "{tmp}/x.json"], r"processes must be an integer >= 1, got 0"),
        (["profile", "gpt", "--processes", "2", "--device", "estimate:h100-sxm", "-o", "{tmp}/x.json"],
         r"an estimate device measures nothing .*drop --processes"),
        (["profile", "gpt", "--processes", "2", "--microbatch-size", "3", "-o", "{tmp}/x.json"],
         r"does not divide the batch of 8"),
        (["profile", "nope", "--processes", "2", "-o", "{tmp}/x.json"], r"unknown model 'nope'"),
        (["profile", "gpt", "--processes", "2", "--compute-efficiency", "0.5", "-o", "{tmp}/x.json"],  # was dropped
         r"compute_efficiency \(0.5\) applies to estimates only"),
        (["profile", "nope", "-o", "{tmp}/x.json"], r"unknown model 'nope'.*use a built-in name"),
        (["profile", "gpt", "--set", "n_layer", "-o", "{tmp}/x.json"], r"--set expects key=value"),
        (["profile", "gpt", "--microbatch-size", "0", "-o", "{tmp}/x.json"], r"microbatch size must be a positive integer, got 0"),
        (["profile", "gpt", "--microbatch-size", "3", "-o", "{tmp}/x.json"], r"does not divide the batch of 8"),
        (["profile", "gpt", "--layers", "nothing.*", "-o", "{tmp}/x.json"], r"matches no module"),
        (["profile", "gpt", "-o", "{tmp}/missing/x.json"], r"output folder .* does not exist"),
        (["profile", "gpt", "--set", "colour=3", "-o", "{tmp}/x.json"], r"takes no option 'colour'; its options are"),
        (["profile", "no_such_module_xyz:make", "-o", "{tmp}/x.json"], r"cannot import module 'no_such_module_xyz'"),
        (["profile", "badfactory:wrong_type", "-o", "{tmp}/x.json"], r"returned int, not a stageplan.Workload"),
        (["profile", "badfactory:missing", "-o", "{tmp}/x.json"], r"has no callable 'missing'"),
        (["profile", "badfactory:unsplittable", "-o", "{tmp}/x.json"], r"torch.export cannot split .*--layers"),
        (["show", "{tmp}/none.json"], r"does not exist"),
        (["show", "{tmp}"], r"input '.*' is a folder, not a file; give the file inside it"),  # said "does not exist"
        (["show", "{tmp}/cmp.json"], r"compare result '.*cmp.json' has no 'methods'; each method needs boundaries"),
        (["show", "{tmp}/cmp2.json"], r"method 'optimal' lacks or mangles predicted_step_s"),  # were KeyError tracebacks
        (["plan", str(Path(__file__).resolve().parents[1] / "profiles" / "cpu" / "gpt.json"), "--stages", "2", "--bandwidth", "0GB/s"], r"bandwidth must be a positive rate, got "
                                                                             r"'0GB/s'; use .* such as 25GB/s"),
        (["profile", "gpt"], r"required: -o/--output"),
        (["profile", "gpt", "--min-time", "-1", "-o", "{tmp}/x.json"],
         r"min_time_s must be a finite number of seconds >= 0, got -1.0; e\.g\. --min-time 20"),
        (["profile", "gpt", "--min-time", "5", "--device", "estimate:h100-sxm", "-o", "{tmp}/x.json"],
         r"min_time_s \(5.0\) spreads measured rounds over time, and an estimate measures nothing"),
        (["compare", "gpt", "--stages", "2", "--runs", "0"], r"runs must be an integer >= 1, got 0; e\.g\. --runs 3"),
        (["tune", "gpt", "--stages", "2", "--runs", "0", "-o", "{tmp}/t"], r"runs must be an integer >= 1, got 0"),
        (["compare", "gpt", "--stages", "2", "--min-time", "5", "--profile",
          str(Path(__file__).resolve().parents[1] / "profiles" / "cpu" / "gpt.json")],
         r"--min-time 5 spreads the rounds of the profile compare takes, and --profile gives the profile to start "
         r"from; drop one of them"),
        (["tune", "gpt", "--stages", "2", "--min-time", "-2", "-o", "{tmp}/t"],
         r"min_time_s must be a finite number of seconds >= 0, got -2.0"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv: list[str], pattern: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "badfactory.py").write_text(
        "import torch\nfrom torch import nn\nimport stageplan\n"
        "def wrong_type():\n    return 3\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))\n"
        "    def forward(self, x):\n"
        "        for m in self.layers:\n            x = m(x)\n            if x.sum() > 0:\n                x = x * 2\n"
        "        return x\n"
        "def unsplittable():\n    return stageplan.Workload(M(), torch.randn(8, 4))\n"
    )
    (tmp_path / "cmp.json").write_text('{"schema": "stageplan.compare/1"}')
    (tmp_path / "cmp2.json").write_text('{"schema": "stageplan.compare/1", "methods": {"optimal": {"boundaries": [0, 2, 4], '
                                        '"balance_efficiency": 1.0, "peak_memory_bytes": [1, 1]}}}')
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("badfactory", None)
    code, _, err = run_cli([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert_one_line_error(code, err, pattern)


def test_profile_refuses_one_path_for_the_profile_and_its_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """-o X --csv X wrote the profile, then replaced it with the CSV, and exited 0 (show then called X invalid JSON):
    refused before any work, naming the path, and whatever X held stays as it was (also spelled another way)."""
    (tmp_path / "same.json").write_text("what the user had")
    for csv in (str(tmp_path / "same.json"), str(tmp_path / "." / "same.json")):
        code, _, err = run_cli(["profile", "gpt", "-o", str(tmp_path / "same.json"), "--csv", csv], capsys)
        assert_one_line_error(code, err, r"-o and --csv both name '.*same.json', and the CSV would replace the profile")
        assert (tmp_path / "same.json").read_text() == "what the user had"


def test_a_json_file_nested_past_pythons_depth_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """json.loads recurses once per level: a file nested 100,000 deep raised RecursionError through every input."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    gpt = str(Path(__file__).resolve().parents[1] / "profiles" / "cpu" / "gpt.json")
    for argv in (["show", str(deep)], ["plan", str(deep), "--stages", "2"], ["plan", gpt, "--stages", "2", "--link", str(deep)]):
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, r"'.*deep.json' nests its JSON deeper than Python reads")
    code, _, err = run_cli(["plan", gpt, "--stages", "2", "--fqns", str(deep)], capsys)
    assert_one_line_error(code, err, r"FQN file '.*deep.json' nests deeper than Python reads")


@pytest.mark.skipif("torch" in sys.modules and __import__("torch").cuda.is_available(), reason="no-GPU message")
def test_cuda_without_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["profile", "gpt", "--device", "cuda", "-o", str(tmp_path / "x.json")], capsys)
    assert_one_line_error(code, err, r"no CUDA GPU")
    assert not (tmp_path / "x.json").exists()


def test_hf_workloads_without_transformers_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from stageplan.errors import WorkloadError
    from stageplan.zoo import hf_gpt2, hf_llama

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    for factory in (hf_gpt2, hf_llama):
        with pytest.raises(WorkloadError, match=r"need the 'transformers' package.*pip install 'stageplan\[hf\]'"):
            factory()
