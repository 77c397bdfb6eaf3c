"""stageplan.formats.plan: the Plan record: JSON round trips, old plans load, a mangled or hand-edited plan
file is refused in one line naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_one_line_error, run_cli

from stageplan import LayerProfile, Profile, plan, planning
from stageplan.errors import SchemaError
from stageplan.formats.plan import Plan

from .test_cli import _profile
from .test_planner import make_profile, quiet_plan, xyz


def test_the_plan_file_keeps_the_search(tmp_path: Path) -> None:
    pl = quiet_plan(xyz(3.0), 2, num_microbatches=1, schedule="GPipe", objective="step")
    again = Plan.from_json(json.loads(json.dumps(pl.to_json())))
    assert again.step_search == pl.step_search and again.cost_options["objective"] == "step"
    older = {k: v for k, v in pl.to_json().items() if k != "step_search"}  # plans written before the search
    assert Plan.from_json(older).step_search == {}
    with pytest.raises(SchemaError, match=r"step_search must be an object"):
        Plan.from_json({**pl.to_json(), "step_search": 5})


def test_json_round_trip_and_schema(tmp_path: Path) -> None:
    pl = plan(make_profile([1, 2, 3, 4, 5, 6]), 2, num_microbatches=4)
    assert pl.boundaries == (0, 4, 6)
    pl.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["schema"] == "stageplan.plan/2" and data["boundaries"] == [0, 4, 6]
    assert Plan.load(tmp_path / "plan.json") == pl
    data["schema"] = "stageplan.plan/9"
    with pytest.raises(SchemaError,
                       match=r"schema 'stageplan.plan/9' but this stageplan reads 'stageplan.plan/2'"):
        Plan.from_json(data)
    df = pl.to_pandas()
    assert list(df["stage"]) == [0, 1] and "activations_bytes" in df.columns


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda d: d.update(cost_options=None), r"cost_options must be an object, got None"),
        (lambda d: d.update(bottleneck_s=float("nan")), r"bottleneck_s must be a finite number, got nan"),
        (lambda d: d.update(rank_time_s=[1.0]),
         r"rank_time_s must hold a finite number for each of its 2 ranks"),
        (lambda d: d.update(boundaries=["0", "2", "4"]),
         r"boundaries must be integers, got \['0', '2', '4'\]"),
        (lambda d: d["stages"][1].update(rank=7), r"stage 1 must run on a rank 0..1 with finite times"),
        (lambda d: d["stages"][0].update(comm_s="x"), r"stage 0 must run on a rank 0..1 with finite times"),
        # each of these had been a traceback in show, run or calibrate (a sweep of hand-edited files)
        (lambda d: d["stages"][0].update(memory=None),
         r"stage 0's memory must map each kind to bytes, got None"),
        (lambda d: d["stages"][0].update(layers=[]), r"stage 0's layers must name its layers, got \[\]"),
        (lambda d: d["stages"][0].update(memory_limit_bytes="x"),
         r"stage 0's memory_limit_bytes must be bytes > 0 or null, got 'x'"),
        (lambda d: d["cost_options"].update(virtual_stages=None),
         r"cost_options' virtual_stages must be an integer >= 1, got None"),
        (lambda d: d["cost_options"].update(num_microbatches="x"),
         r"cost_options' num_microbatches must be an integer >= 1, got 'x'"),
        (lambda d: d["cost_options"].update(bandwidth_bytes_per_s="x"),
         r"cost_options' bandwidth_bytes_per_s must be bytes/s > 0 or null \(not modelled\), got 'x'"),
        (lambda d: d["cost_options"].update(devices=-1),
         r"cost_options' devices must be a list of \{speed > 0"),
        (lambda d: d["cost_options"].update(precision=[]),
         r"cost_options' precision must be a name or null, got \[\]"),
        (lambda d: d["cost_options"].update(link_latency_s="x"),
         r"cost_options' link_latency_s must be seconds >= 0 or null, got 'x'"),
        (lambda d: d["cost_options"].update(microbatch_size="x"),
         r"cost_options' microbatch_size must be an integer >= 1, got 'x'"),
        (lambda d: d.update(candidates="xy"), r"candidates must be a list, got 'xy'"),
        (lambda d: d.update(candidates=["xy"]), r"candidates must be a list of objects \(boundaries, "
                                                r"predicted_step_s\), got 'xy'"),
    ],
)
def test_show_and_run_refuse_a_mangled_plan_file(mutate, pattern: str, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A plan file whose figures are of the wrong kind: one line naming the field, for show (which crashed on
    a null cost_options) and for the API's loader (which printed a NaN bottleneck as 'nan')."""
    data = plan(make_profile([1, 2, 3, 4]), 2, num_microbatches=2).to_json()
    Plan.from_json(json.loads(json.dumps(data)))  # the unedited plan loads
    mutate(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaError, match=pattern):
        Plan.load(path)
    code, _, err = run_cli(["show", str(path)], capsys)
    assert_one_line_error(code, err, pattern)


def test_a_plan_of_zero_cost_layers_saves_and_loads(tmp_path: Path) -> None:
    """A step predicted at 0 s has an infinite throughput,
    written as null: the file stageplan writes loads back."""
    prof = Profile(tuple(LayerProfile(f"l{i}", 0.0, 0.0, 0, 0, 0) for i in range(4)))
    pl = plan(prof, 2, num_microbatches=2)
    pl.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").boundaries == pl.boundaries


GPT = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu" / "gpt.json")


@pytest.mark.parametrize("field", ["rank_time_s", "stages", "boundaries"])
def test_a_plan_file_without_a_field_is_one_line_naming_it(field: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from stageplan import Profile

    data = planning.plan(Profile.load(Path(__file__).resolve().parents[2] / "profiles" / "cpu" / "gpt.json"),
                         2).to_json()
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
    (lambda d: d["stages"][0].update(colour="red"),
     r"stages\[0\] does not match a stage's fields \(.*'colour'"),
    (lambda d: d["stages"][1].pop("rank"), r"stages\[1\] does not match a stage's fields \(.*'rank'"),
])
def test_a_plan_field_of_the_wrong_kind_is_one_line_naming_it(edit: Any, says: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A list field holding a scalar had been refused with Python's own words ("'int' object is not
    iterable"), a stage of the wrong shape with StagePlan's alone: now the line names the field (and the
    stage)."""
    from stageplan import Profile

    data = planning.plan(Profile.load(GPT), 2).to_json()
    edit(data)
    (tmp_path / "plan.json").write_text(json.dumps(data))
    code, _, err = run_cli(["show", str(tmp_path / "plan.json")], capsys)
    assert_one_line_error(code, err, rf"plan '.*plan.json': {says}.*; regenerate it with stageplan plan")


def test_hand_edited_boundaries_are_refused_and_given_ones_are_evaluated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof = _profile(tmp_path, n=6)
    plan(prof, 2, num_microbatches=2).save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    data["boundaries"] = [0, 2, 6]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    code, _, err = run_cli(["show", str(tmp_path / "plan.json")], capsys)
    assert_one_line_error(code, err, r"has boundaries \[0, 2, 6\] but its evidence was computed for stages "
                                     r".* re-evaluate that split with: stageplan plan PROFILE.json "
                                     r"--boundaries 0,2,6")
    code, _, _ = run_cli(["plan", prof, "--stages", "2", "--microbatches", "2", "--boundaries", "0,2,6",
                            "-o", str(tmp_path / "given.json")], capsys)
    given = Plan.load(tmp_path / "given.json")
    assert code == 0 and given.boundaries == (0, 2, 6) and given.method == "given"
    # the evidence is the cost model's, the same as for any method: stage 1 holds layers 2..5
    assert given.stages[1].forward_s == pytest.approx(sum(1.0 + i for i in range(2, 6)))
    code, _, err = run_cli(["plan", prof, "--stages", "2", "--boundaries", "0,7,6"], capsys)
    assert_one_line_error(code, err, r"boundaries \[0, 7, 6\] must be 3 increasing cut points from 0 to 6")
