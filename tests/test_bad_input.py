"""Bad input found by a sweep of the CLI: each case had been a traceback, a silent wrong result or a clobbered
file, and is now one line and exit 2, or the right result."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_one_line_error, run_cli

import stageplan.comparison as comparison
from stageplan import planning
from stageplan._io import write_json_atomic

GPT = str(Path(__file__).resolve().parents[1] / "profiles" / "cpu" / "gpt.json")


@pytest.mark.parametrize("content", ["null", "42", "true", "1.5", '{"module_fqns_per_model_part": null}',
                                     '{"module_fqns_per_model_part": 5}'])
def test_fqns_that_are_not_a_list_of_lists_are_one_line(content: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "f.json").write_text(content)
    code, _, err = run_cli(["plan", GPT, "--stages", "2", "--fqns", str(tmp_path / "f.json")], capsys)
    assert_one_line_error(code, err, r"module FQNs per model part must be a list of lists of module names")


def test_an_output_through_a_symlink_writes_its_target_and_keeps_the_link(tmp_path: Path) -> None:
    """-o link.json, a link to target.json: the rename had replaced the link by a file and left the target
    unwritten."""
    (tmp_path / "target.json").write_text("old")
    os.symlink("target.json", tmp_path / "link.json")
    write_json_atomic(tmp_path / "link.json", {"a": 1})
    assert (tmp_path / "link.json").is_symlink()
    assert json.loads((tmp_path / "target.json").read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "target.json"]  # no temporary left


def test_an_output_that_is_a_pipe_is_written_to_not_replaced(tmp_path: Path) -> None:
    """-o /dev/null had replaced the device by a regular file (the rename). A pipe stands in for the device here:
    it is written through, and stays a pipe."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    write_json_atomic(fifo, {"a": 1})
    reader.join(timeout=30)
    assert not reader.is_alive() and got and json.loads(got[0]) == {"a": 1}
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


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
    """They were refused only after profiling the model (seconds on a small model, minutes on a large one), with the
    profile's progress lines before the error and an empty -o folder left behind."""
    def no_profile(*_a: object, **_k: object) -> None:
        raise AssertionError("profiled before refusing")

    monkeypatch.setattr(comparison, "measured_profile", no_profile)
    code, _, err = run_cli([command, "gpt", *args, "-o", str(tmp_path / "out")], capsys)
    assert_one_line_error(code, err, words)
    assert not (tmp_path / "out").exists()


def test_compare_still_takes_schedule_auto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The early check must not refuse what compare accepted: --schedule auto reaches the profile (tune refuses it,
    as it did)."""
    class Reached(Exception):
        pass

    def reached(*_a: object, **_k: object) -> None:
        raise Reached

    monkeypatch.setattr(comparison, "measured_profile", reached)
    with pytest.raises(Reached):
        run_cli(["compare", "gpt", "--stages", "2", "--schedule", "auto"], capsys)


def test_show_draws_no_figure_when_its_table_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """show --plot had drawn the figure first, so a table that then failed had already replaced the old figure."""
    from stageplan import report
    from stageplan.errors import StageplanError

    def fails(_obj: object) -> str:
        raise StageplanError("the table failed")

    monkeypatch.setattr(report, "profile_table", fails)
    (tmp_path / "fig.png").write_text("PRECIOUS")
    code, _, err = run_cli(["show", GPT, "--plot", str(tmp_path / "fig.png")], capsys)
    assert_one_line_error(code, err, r"the table failed")
    assert (tmp_path / "fig.png").read_text() == "PRECIOUS"


@pytest.mark.parametrize("field", ["rank_time_s", "stages", "boundaries"])
def test_a_plan_file_without_a_field_is_one_line_naming_it(field: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from stageplan import Profile

    data = planning.plan(Profile.load(Path(__file__).resolve().parents[1] / "profiles" / "cpu" / "gpt.json"), 2).to_json()
    del data[field]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    code, _, err = run_cli(["show", str(tmp_path / "plan.json")], capsys)
    assert_one_line_error(code, err, rf"lacks field '{field}'; regenerate it with stageplan plan")


@pytest.mark.parametrize(("edit", "says"), [
    (lambda d: d.update(rank_time_s=5), r"rank_time_s must be a list, got 5"),
    (lambda d: d.update(boundaries="0,4,8"), r"boundaries must be a list, got '0,4,8'"),
    (lambda d: d.update(notes={"a": 1}), r"notes must be a list, got \{'a': 1\}"),
    (lambda d: d.update(stages=3), r"stages must be a list, got 3"),
    (lambda d: d["stages"].__setitem__(1, 7), r"stages\[1\] must be an object with a list of layers, got 7"),
    (lambda d: d["stages"][0].update(colour="red"), r"stages\[0\] does not match a stage's fields \(.*'colour'"),
    (lambda d: d["stages"][1].pop("rank"), r"stages\[1\] does not match a stage's fields \(.*'rank'"),
])
def test_a_plan_field_of_the_wrong_kind_is_one_line_naming_it(edit: Any, says: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A list field holding a scalar had been refused with Python's own words ("'int' object is not iterable"), a
    stage of the wrong shape with StagePlan's alone: now the line names the field (and the stage)."""
    from stageplan import Profile

    data = planning.plan(Profile.load(GPT), 2).to_json()
    edit(data)
    (tmp_path / "plan.json").write_text(json.dumps(data))
    code, _, err = run_cli(["show", str(tmp_path / "plan.json")], capsys)
    assert_one_line_error(code, err, rf"plan '.*plan.json': {says}.*; regenerate it with stageplan plan")


def test_a_step_past_the_simulators_limit_is_refused_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    """--microbatches 100000000 (a slip of the finger) had planned for hours: a step's microbatches x stages is at
    most costmodel.MAX_STEP_PAIRS, and the line gives the most microbatches these stages take."""
    from stageplan import Profile
    from stageplan.errors import StageplanError
    from stageplan.planning.costs import MAX_STEP_PAIRS, make_options

    prof = Profile.load(GPT)
    most = MAX_STEP_PAIRS // 8
    assert make_options(prof, 4, num_microbatches=most, schedule="Interleaved1F1B").num_microbatches == most
    with pytest.raises(StageplanError, match=rf"got {most + 1:,} x 8 = {8 * most + 8:,}; use --microbatches {most} "):
        make_options(prof, 4, num_microbatches=most + 1, schedule="Interleaved1F1B")
    # 3 ranks x 2 chunks: 166,666 would not divide into Interleaved1F1B's rounds; the line gives a multiple of 3
    with pytest.raises(StageplanError, match=r"use --microbatches 166665 or fewer"):
        make_options(prof, 3, num_microbatches=10**6, schedule="Interleaved1F1B")
    assert make_options(prof, 3, num_microbatches=166665, schedule="Interleaved1F1B").num_microbatches == 166665
    code, _, err = run_cli(["plan", GPT, "--stages", "2", "--microbatches", "100000000"], capsys)
    assert_one_line_error(code, err, r"a step's timeline is at most 1,000,000 forward/backward pairs \(microbatches x "
                                     r"stages\), got 100,000,000 x 2 = 200,000,000; use --microbatches 500000 or fewer")


@pytest.mark.parametrize(("argv", "says"), [
    (["plan", GPT, "--stages", "20"], r"num_ranks \(20\) exceeds the number of layers \(8\), one stage a rank; use "
                                      r"--stages 8 or fewer"),
    (["plan", GPT, "--stages", "2", "--virtual-stages", "2"], r"1F1B runs one stage per rank, got virtual_stages=2; "
                                                              r"use virtual_stages=1 \(--virtual-stages 1\)"),
])
def test_a_count_refused_through_the_cli_names_its_flag(argv: list[str], says: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The remedy names the CLI flag as well as the API name (these had said num_stages, which neither has, and
    virtual_stages=1 alone; compare's and tune's --stages 0, tested above, gave no flag)."""
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, says)
