"""Calibration against closed forms: a run report built from known per-layer measurements (no processes), the
calibrated profile's layers and ranks then predict exactly what the run measured."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli

from stageplan import StageplanError
from stageplan.calibration import calibrate
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.formats.runreport import RunReport
from stageplan.planning.planner import plan

M = 4


def _profile() -> Profile:
    layers = [LayerProfile(name=f"l{i}", forward_s=f, backward_s=2 * f, activation_bytes=1000,
                           output_bytes=100, param_bytes=400, backward_accumulate_s=2.5 * f)
              for i, f in enumerate([1e-3, 2e-3, 3e-3, 4e-3, 5e-3])]
    return Profile(tuple(layers), {"model": "toy", "microbatch_size": 1})


# what the run measured per microbatch, per layer (forward, backward), and each rank's chunk overhead
LAYERS = {0: (1.5e-3, 2.0e-3), 1: (2.0e-3, 6.0e-3), 2: (3.3e-3, 6.0e-3), 3: (4.0e-3, 9.0e-3),
          4: (6.0e-3, 12.0e-3)}


OVERHEAD = {0: (0.3e-3, 0.4e-3), 1: (0.0, 0.6e-3)}


def _report(pl, with_layers: bool = True) -> RunReport:  # type: ignore[no-untyped-def]
    ranks = []
    for r in (0, 1):
        mine = [i for s, st in enumerate(pl.stages) if st.rank == r
                for i in range(pl.boundaries[s], pl.boundaries[s + 1])]
        f = sum(LAYERS[i][0] for i in mine) + OVERHEAD[r][0]
        b = sum(LAYERS[i][1] for i in mine) + OVERHEAD[r][1]
        ranks.append({"rank": r, "stages": [r], "step_s": [0.2], "forward_s": f * M, "forward_iqr_s": 0.0,
                      "backward_s": b * M, "backward_iqr_s": 0.0, "other_s": 0.0,
                      "compute_cpu_s": (f + b) * M,
                      "losses": [], "timeline": [], "peak_activation_bytes": 1, "peak_memory_bytes": 1,
                      "layer_s": {i: list(LAYERS[i]) for i in mine} if with_layers else {},
                      "overhead_s": {r: list(OVERHEAD[r])} if with_layers else {}})
    return RunReport.from_measurements(pl, ranks, step_s=0.2, step_iqr_s=0.0,
                                       run_options={"optimizer": "none"}, check=None, meta={})


def test_each_layer_takes_what_the_run_measured_of_it_plus_its_share_of_the_chunk_overhead() -> None:
    prof = _profile()
    pl = plan(prof, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none")
    cal = calibrate(prof, _report(pl))
    assert cal.meta["calibration"]["per"] == "layer"
    for r, layers in ((0, [0, 1]), (1, [2, 3, 4])):
        tf = sum(LAYERS[i][0] for i in layers)
        tb = sum(LAYERS[i][1] for i in layers)
        for i in layers:
            x = cal.layers[i]
            share_f = LAYERS[i][0] / tf * OVERHEAD[r][0]
            share_b = LAYERS[i][1] / tb * OVERHEAD[r][1]
            assert x.forward_s == pytest.approx(LAYERS[i][0] + share_f)
            assert x.backward_per_microbatch_s(M) == pytest.approx(LAYERS[i][1] + share_b)
            # the backward's two measured parts keep their ratio
            # (first microbatch into empty grads, the rest adding)
            assert x.backward_accumulate_s / x.backward_s == pytest.approx(1.25)
    # the same split, planned from the calibrated profile, predicts each rank's measured compute
    again = plan(cal, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none")
    for row in _report(pl).ranks:
        st = again.stages[row["rank"]]
        assert st.forward_s + st.backward_s == pytest.approx(row["measured_compute_s"])


def test_repeated_calibration_keeps_the_raw_digest_and_counts_rounds() -> None:
    prof = _profile()
    pl = plan(prof, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none")
    once = calibrate(prof, _report(pl))
    pl2 = plan(once, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none")
    twice = calibrate(once, _report(pl2))
    c1, c2 = once.meta["calibration"], twice.meta["calibration"]
    assert c1["raw_profile_digest"] == c2["raw_profile_digest"] == prof.digest()
    assert c2["from_profile_digest"] == once.digest() != prof.digest()
    assert (c1["rounds"], c2["rounds"]) == (1, 2)
    # calibrating to the same measurements twice changes nothing the second time
    assert [x.forward_s for x in twice.layers] == pytest.approx([x.forward_s for x in once.layers])


def test_a_report_without_layer_times_is_calibrated_per_rank() -> None:
    prof = _profile()
    pl = plan(prof, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none")
    rep = _report(pl, with_layers=False)
    assert rep.layers == ()
    cal = calibrate(prof, rep)
    assert cal.meta["calibration"]["per"] == "rank"
    for row in rep.ranks:
        k = row["measured_compute_s"] / row["predicted_compute_s"]
        assert cal.meta["calibration"]["rank_factors"][row["rank"]] == pytest.approx(k)
        for i in ([0, 1] if row["rank"] == 0 else [2, 3, 4]):
            assert cal.layers[i].forward_s == pytest.approx(prof.layers[i].forward_s * k)


def test_cli_calibrate_says_per_layer_and_refuses_another_models_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof = _profile()
    prof.save(tmp_path / "p.json")
    pl = plan(prof, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none")
    _report(pl).save(tmp_path / "run.json")
    code, out, err = run_cli(["calibrate", str(tmp_path / "p.json"), str(tmp_path / "run.json"), "-o",
                              str(tmp_path / "c.json")], capsys)
    assert code == 0, err
    assert "each layer's forward and backward scaled" in out
    assert Profile.load(tmp_path / "c.json").meta["calibration"]["per"] == "layer"
    code, out, err = run_cli(["show", str(tmp_path / "run.json"), "--explain"], capsys)
    assert code == 0, err
    assert "layers inside the schedule" in out and "chunk overhead outside the layers" in out
    row = next(ln for ln in out.splitlines() if ln.split()[:2] == ["3", "l3"])
    assert row.split()[-2:] == ["4.000", "9.000"]  # the layer's measured forward and backward, ms
    other = Profile(tuple(LayerProfile(name=f"x{i}", forward_s=1e-3, backward_s=1e-3, activation_bytes=1,
                                       output_bytes=1, param_bytes=1) for i in range(5)), {})
    other.save(tmp_path / "other.json")
    code, out, err = run_cli(["calibrate", str(tmp_path / "other.json"), str(tmp_path / "run.json"), "-o",
                              str(tmp_path / "c2.json")], capsys)
    assert_one_line_error(code, err, "other layers than this profile")
    assert not (tmp_path / "c2.json").exists()
    with pytest.raises(StageplanError):
        calibrate(other, tmp_path / "run.json")


def test_a_run_on_devices_of_different_speeds_calibrates_to_the_profile_it_confirms() -> None:
    # each rank ran its layers exactly as the plan priced them (profile / device speed): every factor is 1
    prof = _profile()
    pl = plan(prof, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none", devices=[2.0, 1.0])
    speed = {0: 2.0, 1: 1.0}
    ranks = []
    for r in (0, 1):
        mine = range(pl.boundaries[r], pl.boundaries[r + 1])
        lay = {i: [prof.layers[i].forward_s / speed[r],
                   prof.layers[i].backward_per_microbatch_s(M) / speed[r]] for i in mine}
        f, b = sum(v[0] for v in lay.values()), sum(v[1] for v in lay.values())
        ranks.append({"rank": r, "stages": [r], "step_s": [0.2], "forward_s": f * M, "forward_iqr_s": 0.0,
                      "backward_s": b * M, "backward_iqr_s": 0.0, "other_s": 0.0,
                      "compute_cpu_s": (f + b) * M,
                      "losses": [], "timeline": [], "peak_activation_bytes": 1, "peak_memory_bytes": 1,
                      "layer_s": lay, "overhead_s": {r: [0.0, 0.0]}})
    rep = RunReport.from_measurements(pl, ranks, step_s=0.2, step_iqr_s=0.0,
                                      run_options={"optimizer": "none"}, check=None, meta={})
    cal = calibrate(prof, rep)
    assert cal.meta["calibration"]["forward_factors"] == pytest.approx([1.0] * 5)
    assert cal.meta["calibration"]["backward_factors"] == pytest.approx([1.0] * 5)


def test_a_recompute_run_is_calibrated_per_rank_and_says_why() -> None:
    prof = _profile()
    pl = plan(prof, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none", recompute=True)
    cal = calibrate(prof, _report(pl))
    assert cal.meta["calibration"]["per"] == "rank"
    assert "recomputation" in cal.meta["calibration"]["why"]


def test_a_mangled_layer_table_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    prof = _profile()
    pl = plan(prof, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none")
    data = _report(pl).to_json()
    data["layers"] = [{"index": 0}]
    (tmp_path / "run.json").write_text(json.dumps(data))
    code, _out, err = run_cli(["show", str(tmp_path / "run.json")], capsys)
    assert_one_line_error(code, err, r"layer row 0 lacks or mangles name, stage, rank")


def _set(*path_then_value: object):  # type: ignore[no-untyped-def]
    *path, value = path_then_value

    def edit(d: dict) -> None:  # type: ignore[type-arg]
        for key in path[:-1]:
            d = d[key]  # type: ignore[index]
        d[path[-1]] = value  # type: ignore[index]
    return edit


def _drop(*path: object):  # type: ignore[no-untyped-def]
    def edit(d: dict) -> None:  # type: ignore[type-arg]
        for key in path[:-1]:
            d = d[key]  # type: ignore[index]
        del d[path[-1]]  # type: ignore[arg-type]
    return edit


# each edit of a run report that show and calibrate read, and the words of the one line that refuses it;
# before, each went through as a traceback (KeyError, TypeError, IndexError, AttributeError) or, the last
# four, as a calibrated profile silently wrong (a NaN layer left at factor 1, a layer counted twice, an
# infinite prediction)
MANGLED_RUNS = [
    (_set("ranks", []), r"'ranks' must hold one row for each of the plan's 2 ranks, got \[\]"),
    (_set("ranks", [1, 2]), r"rank row 0 must be an object, got 1"),
    (
        _drop("ranks", 0, "predicted_compute_s"),
        r"rank row 0's predicted_compute_s must be a finite number, got None",
    ),
    (
        _set("ranks", 0, "measured_compute_s", "1"),
        r"rank row 0's measured_compute_s must be a finite number, got '1'",
    ),
    (_set("ranks", 1, "rank", 0), r"the rank rows must be ranks 0..1, each once, got \[0, 0\]"),
    (_set("plan", None), r"'plan' must be the executed plan's object, got None"),
    (
        _drop("plan", "num_microbatches"),
        r"num_ranks and num_microbatches must be integers >= 1, got \(2, None\)",
    ),
    (
        _set("plan", "boundaries", [0, 9, 5]),
        r"boundaries must be increasing cut points from 0, got \[0, 9, 5\]",
    ),
    (_set("plan", "stage_ranks", [0, 3]), r"stage_ranks must give a rank 0..1 for each of its 2 stages"),
    (_set("layers", 4, "index", 99), r"layer row 4 has index 99, outside the plan's layers 0..4"),
    (_set("layers", 4, "rank", 5), r"layer row 4 ran on rank 5, and the report's ranks are \[0, 1\]"),
    (_set("link", "x"), r"'link' must be the run's link probe"),
    (
        _set("link", {"allreduce_latency_s": 1e-4}),
        r"its link has allreduce_latency_s = 0.0001 and "
        r"allreduce_bandwidth_bytes_per_s = None; both must be "
        r"numbers",
    ),
    (_set("measured_step_s", "0.2"), r"measured_step_s must be seconds .* got '0.2'"),
    (
        _set("run_options", "microbatch_size", "x"),
        r"microbatch_size must be an integer >= 1 or null, got 'x'",
    ),
    (_set("layers", 2, "measured_forward_s", float("nan")), r"layer row 2 has forward and backward \[nan, "),
    (_set("layers", 2, "measured_backward_s", -1.0), r"layer row 2 has forward and backward .*-1.0\]"),
    (lambda d: d["layers"].__setitem__(4, dict(d["layers"][3])), r"layer row 4 has index 3, listed twice"),
    (
        _set("ranks", 0, "predicted_compute_s", float("inf")),
        r"predicted_compute_s must be a finite number, got inf",
    ),
    (
        _set("check", "yes"),
        r"'check' must be the --check verdict \(an object with passed true/false\) or null, got 'yes'",
    ),
    (
        _set("check", {"passed": True, "max_loss_diff": "0", "max_param_diff": 0.0, "params_compared": 3}),
        r"check's max_loss_diff must be a number or null, got '0'",
    ),
    (
        _set("check", {"passed": False, "max_loss_diff": None, "max_param_diff": None}),
        r"check's params_compared must be an integer >= 0, got None",
    ),
    (
        _set("meta", "load_average_1min", "high"),
        r"meta's load_average_1min must be a number or null, got 'high'",
    ),
    (
        _set("ranks", 1, "measured_receive_wait_s", "3 ms"),
        r"rank row 1's measured_receive_wait_s must be a number or null, got '3 ms'",
    ),
    (
        _set("ranks", 0, "machine_ratio", [1.2]),
        r"rank row 0's machine_ratio must be a number or null, got \[1.2\]",
    ),
    (
        _set("layers", 1, "retimed_backward_s", -0.5),
        r"layer row 1 has retimed_backward_s -0.5; it must be seconds >= 0 or null",
    ),
    # tracebacks before (a sweep of hand-edited files): the
    # executed plan's options, and the timeline show --plot draws
    (
        _set("plan", "cost_options", "virtual_stages", None),
        r"the plan's cost_options' virtual_stages must be an integer >= 1, got None",
    ),
    (
        _set("plan", "cost_options", "bandwidth_bytes_per_s", []),
        r"the plan's cost_options' bandwidth_bytes_per_s must be bytes/s > 0 or null \(not modelled\), got "
        r"\[\]",
    ),
    (_set("plan", "cost_options", "devices", "x"), r"the plan's cost_options' devices must be a list of"),
    (
        _set("plan", "cost_options", "precision", {}),
        r"the plan's cost_options' precision must be a name or null",
    ),
    # null is allowed: loads, shows and calibrates
    (_set("plan", "cost_options", "link_latency_s", None), None),
    (
        _set("plan", "cost_options", "action_s", "x"),
        r"the plan's cost_options' action_s must be seconds >= 0 or null",
    ),
    (
        _set("timeline", "x"),
        r"'timeline' must be a list of calls \(rank, stage, kind, start_s, end_s\), got 'x'",
    ),
    (_set("timeline", [{"rank": 0}]), r"'timeline' must be a list of calls .*, got \{'rank': 0\}"),
    (_set("ranks", 0, "measured_overhead_forward_s", None), None),
    (_set("plan", "virtual_stages", None), r"the plan's virtual_stages must be an integer >= 1, got None"),
]


@pytest.mark.parametrize("edit,words", MANGLED_RUNS)
def test_a_mangled_run_report_is_refused_in_one_line_by_show_and_calibrate(
        edit, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    import json

    from stageplan.errors import SchemaError

    prof = _profile()
    prof.save(tmp_path / "prof.json")
    pl = plan(prof, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none")
    data = json.loads(json.dumps(_report(pl).to_json()))
    RunReport.from_json(data)  # the unedited report loads
    edit(data)
    (tmp_path / "run.json").write_text(json.dumps(data))
    if words is None:
        # a null the loader allows: show and calibrate read it (calibrate crashed on the overheads')
        RunReport.from_json(data)
        assert run_cli(["show", str(tmp_path / "run.json")], capsys)[0] == 0
        assert run_cli(["calibrate", str(tmp_path / "prof.json"), str(tmp_path / "run.json"), "-o",
                        str(tmp_path / "cal.json")], capsys)[0] == 0
        return
    with pytest.raises(SchemaError, match=words):
        RunReport.from_json(data)
    code, _out, err = run_cli(["show", str(tmp_path / "run.json")], capsys)
    assert_one_line_error(code, err, words)
    code, _out, err = run_cli(["calibrate", str(tmp_path / "prof.json"), str(tmp_path / "run.json"), "-o",
                               str(tmp_path / "cal.json")], capsys)
    assert_one_line_error(code, err, words)
    assert not (tmp_path / "cal.json").exists()


def test_calibrate_refuses_a_report_whose_plan_covers_other_layers_than_the_profile() -> None:
    prof = _profile()
    pl = plan(prof, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none")
    data = _report(pl).to_json()
    data["plan"].pop("layer_names")  # a report written before the names were kept
    data["plan"]["boundaries"] = [0, 2, 4]
    data["layers"] = data["layers"][:4]
    with pytest.raises(StageplanError, match="other layers than this profile's"):
        calibrate(prof, RunReport.from_json(data))


def test_a_run_at_a_rescaled_microbatch_calibrates_to_a_profile_that_reproduces_it() -> None:
    """A plan of --microbatches auto prices the profile rescaled to its own microbatch size (here 1, profiled
    at 2): the per-crossing delay calibrate fits must be fitted at that size too, so that the calibrated
    profile, priced as the plan priced it, predicts the step the run measured (fitted at the profile's size it
    gave 0 ms)."""
    from stageplan.planning.planner import rescaled_profile

    base = _profile()
    prof = Profile(base.layers, {"model": "toy", "microbatch_size": 2, "batch_size": 8})
    pl = plan(prof, 2, num_microbatches="auto", schedule="GPipe", boundaries=[0, 2, 5], optimizer="none")
    m, mb = pl.num_microbatches, pl.cost_options["microbatch_size"]
    assert mb != 2  # the plan rescaled the profile
    ranks = []
    for r in (0, 1):
        mine = range(pl.boundaries[r], pl.boundaries[r + 1])
        f, b = sum(LAYERS[i][0] for i in mine), sum(LAYERS[i][1] for i in mine)
        ranks.append({"rank": r, "stages": [r], "step_s": [1.0], "forward_s": f * m, "forward_iqr_s": 0.0,
                      "backward_s": b * m, "backward_iqr_s": 0.0, "other_s": 0.0,
                      "compute_cpu_s": (f + b) * m,
                      "losses": [], "timeline": [], "peak_activation_bytes": 1, "peak_memory_bytes": 1,
                      "layer_s": {i: list(LAYERS[i]) for i in mine}, "overhead_s": {r: [0.0, 0.0]}})
    rep = RunReport.from_measurements(pl, ranks, step_s=1.0, step_iqr_s=0.0,
                                      run_options={"optimizer": "none", "microbatch_size": mb}, check=None,
                                      meta={})
    cal = calibrate(prof, rep)
    assert cal.meta["calibration"]["boundary_latency_s"] > 0
    again = plan(rescaled_profile(cal, mb / 2), 2, num_microbatches=m, schedule="GPipe", boundaries=[0, 2, 5],
                 optimizer="none")
    assert again.predicted_step_s == pytest.approx(1.0, rel=1e-6)


def test_calibrate_refuses_a_profile_of_another_footing(tmp_path: Path) -> None:
    """Same layer names, another footing: an analytic GPU estimate, or a profile in another dtype than the one
    the run's plan was made from (factors of 857-4097x were written before)."""
    prof = Profile(_profile().layers,
                   {"model": "toy", "microbatch_size": 1, "dtype": "float32", "device": "cpu"})
    rep = _report(plan(prof, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none"))
    calibrate(prof, rep)  # its own profile
    for meta, pattern in (
        (
            {"dtype": "bfloat16"},
            r"the run's plan was made from a profile with dtype = 'float32', and "
            r"this profile has dtype = 'bfloat16'",
        ),
        ({"device": "cuda"}, r"with device = 'cpu', and this profile has device = 'cuda'"),
        ({"timer": "analytic", "estimate": {"gpu": "h100-sxm"}}, r"this profile is an analytic estimate"),
    ):
        other = Profile(prof.layers, {**prof.meta, **meta})
        with pytest.raises(StageplanError, match=pattern):
            calibrate(other, rep)


def test_calibrate_keeps_the_runs_schedule_loop_and_fits_the_latency_with_it() -> None:
    """The run's plan priced torch's loop per chunk action (its link's action_s): the calibrated profile keeps
    that figure, and the latency it fits leaves it out (no double count), so the same split planned from the
    calibrated profile on the run's bandwidth predicts the measured step exactly; a run whose plan had no loop
    figure takes its own link probe's."""
    import dataclasses

    prof = _profile()
    link = {"schema": "stageplan.link/1", "latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9}
    kw = dict(num_microbatches=M, boundaries=[0, 2, 5], optimizer="none")
    pl = plan(prof, 2, link={**link, "action_s": 1e-3}, **kw)  # type: ignore[arg-type]
    cal = calibrate(prof, _report(pl))
    assert cal.meta["calibration"]["action_s"] == 1e-3
    again = plan(cal, 2, bandwidth=1e9, **kw)  # type: ignore[arg-type]
    assert again.cost_options["action_s"] == 1e-3 and again.stages[0].action_s == 2e-3
    assert again.predicted_step_s == pytest.approx(0.2, rel=1e-6)  # the run's measured step
    bare = plan(prof, 2, link=link, **kw)  # type: ignore[arg-type]
    probed = dataclasses.replace(_report(bare), link={**link, "action_s": 2e-3})
    assert calibrate(prof, probed).meta["calibration"]["action_s"] == 2e-3
    assert any("schedule probe has no action_s" in n for n in bare.notes)


@pytest.mark.parametrize("priced", [True, False])
def test_calibrate_takes_the_priced_chunk_overhead_off_the_layers_once(priced: bool) -> None:
    """Closed form: the chunk overhead the plan prices (its link's chunk_forward_s / chunk_backward_s), or
    that the run's own link probe measured where the plan priced none, comes off each rank's layers in
    proportion to their measured time; planned again with it, the same split predicts each rank's measured
    compute exactly (it is not counted twice), and the calibrated profile keeps the figures for plans made
    without a link."""
    import dataclasses

    prof = _profile()
    link = {"schema": "stageplan.link/1", "latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9}
    over = {"chunk_forward_s": 0.2e-3, "chunk_backward_s": 0.5e-3}
    kw = dict(num_microbatches=M, boundaries=[0, 2, 5], optimizer="none")
    pl = plan(prof, 2, link={**link, **over} if priced else link, **kw)  # type: ignore[arg-type]
    rep = _report(pl) if priced else dataclasses.replace(_report(pl), link={**link, **over})
    cal = calibrate(prof, rep)
    assert {k: cal.meta["calibration"][k] for k in over} == over
    for r, layers in ((0, [0, 1]), (1, [2, 3, 4])):
        tf, tb = sum(LAYERS[i][0] for i in layers), sum(LAYERS[i][1] for i in layers)
        for i in layers:
            share_f, share_b = LAYERS[i][0] / tf, LAYERS[i][1] / tb
            assert cal.layers[i].forward_s == pytest.approx(LAYERS[i][0] + share_f
                                                            * (OVERHEAD[r][0] - over["chunk_forward_s"]))
            assert cal.layers[i].backward_per_microbatch_s(M) == pytest.approx(
                LAYERS[i][1] + share_b * (OVERHEAD[r][1] - over["chunk_backward_s"]))
    for again in (plan(cal, 2, link={**link, **over}, **kw), plan(cal, 2, **kw)):  # type: ignore[arg-type]
        for row in rep.ranks:
            st = again.stages[row["rank"]]
            assert st.chunk_s == pytest.approx(sum(over.values()))
            assert st.forward_s + st.backward_s == pytest.approx(row["measured_compute_s"])


def test_calibrate_keeps_the_all_reduce_the_run_timed_for_the_next_plan() -> None:
    """A run's link probe times the tied gradient's all-reduce; the calibrated profile keeps those constants
    (as it keeps the link's latency), so the next plan prices the sync as that run's collective ran, and the
    latency fit replays the run with them; a run whose plan priced its own keeps the plan's."""
    prof = _profile()
    pl = plan(prof, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none")
    data = _report(pl).to_json()
    data["link"] = {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9, "allreduce_latency_s": 2e-4,
                    "allreduce_bandwidth_bytes_per_s": 5e8}
    cal = calibrate(prof, RunReport.from_json(data))
    assert cal.meta["calibration"]["allreduce_latency_s"] == 2e-4
    assert cal.meta["calibration"]["allreduce_bandwidth_bytes_per_s"] == 5e8
    again = plan(cal, 2, num_microbatches=M, optimizer="none")
    assert (
        again.cost_options["allreduce_latency_s"] == 2e-4
        and again.cost_options["allreduce_bandwidth_bytes_per_s"] == 5e8
    )
    data["plan"]["cost_options"].update(allreduce_latency_s=3e-4, allreduce_bandwidth_bytes_per_s=7e8)
    assert (
        calibrate(prof, RunReport.from_json(data)).meta["calibration"]["allreduce_bandwidth_bytes_per_s"]
        == 7e8
    )
    del data["link"]["allreduce_latency_s"], data["link"]["allreduce_bandwidth_bytes_per_s"]
    data["plan"]["cost_options"].update(allreduce_latency_s=None, allreduce_bandwidth_bytes_per_s=None)
    assert calibrate(prof, RunReport.from_json(data)).meta["calibration"]["allreduce_latency_s"] is None


def test_a_tie_priced_from_the_runs_all_reduce_is_not_also_fitted_into_the_latency() -> None:
    """A run planned without a bandwidth (its tied sync unpriced) whose link probe timed the all-reduce: the
    latency fit replays the run with the tie priced from the probe's constants, so the fitted delay is only
    what the ranks waited beyond it, and the next plan, without a link or with a bandwidth, prices the tie
    once, as the ring's closed form of those constants."""
    import dataclasses

    from stageplan.planning.costs import LayerArrays, evaluate, make_options

    tie_bytes, ar_latency, ar_bandwidth, delay = 2_000_000, 2e-4, 5e8, 1.5e-3
    prof = dataclasses.replace(_profile(), meta={**_profile().meta, "tied": [
        {"names": ["emb.weight", "head.weight"], "layers": [0, 4], "bytes": tie_bytes}]})
    pl = plan(prof, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none")
    assert pl.tied_sync_s == 0.0 and any("tied parameter(s)" in n for n in pl.notes)  # unpriced, and said so
    data = _report(pl).to_json()
    data["link"] = {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9, "allreduce_latency_s": ar_latency,
                    "allreduce_bandwidth_bytes_per_s": ar_bandwidth}
    first = calibrate(prof, RunReport.from_json(data))  # the layers as the run measured them
    ring = 2 * (2 - 1) / 2 * tie_bytes / ar_bandwidth + 2 * (2 - 1) * ar_latency  # the oracle: 4.4 ms
    opts = make_options(first, 2, num_microbatches=M, optimizer="none", allreduce_latency_s=ar_latency,
                        allreduce_bandwidth_bytes_per_s=ar_bandwidth, boundary_latency_s=delay)
    ev = evaluate(LayerArrays.of(first, M), (0, 2, 5), opts)
    assert ev.tied_sync_s == pytest.approx(ring, rel=1e-12)
    assert not any("tied parameter(s)" in n for n in ev.notes)  # priced from the all-reduce alone: no note
    # the run took the layers, the tie at its price, and the delay
    data["measured_step_s"] = ev.predicted_step_s
    cal = calibrate(prof, RunReport.from_json(data))
    assert cal.meta["calibration"]["boundary_latency_s"] == pytest.approx(delay, rel=1e-6)
    for again in (
        plan(cal, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none"),
        plan(cal, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none", bandwidth="1GB/s"),
    ):
        assert again.tied_sync_s == pytest.approx(ring, rel=1e-12)
    assert plan(
        cal, 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none"
    ).predicted_step_s == pytest.approx(ev.predicted_step_s, rel=1e-6)


def test_show_prints_a_dash_where_a_run_report_holds_null(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose loss diverged writes its NaN loss difference as null (JSON has no NaN), and a report from a
    machine without os.getloadavg has no load average: show prints '-' for each (it raised TypeError on
    None)."""
    import json

    pl = plan(_profile(), 2, num_microbatches=M, boundaries=[0, 2, 5], optimizer="none")
    data = json.loads(json.dumps(_report(pl).to_json()))
    data["check"] = {"passed": False, "hint": None, "max_loss_diff": float("nan"), "max_param_diff": None,
                     "worst_param": None, "params_compared": 7}
    data["meta"]["load_average_1min"] = None
    RunReport.from_json(data).save(tmp_path / "run.json")
    # NaN written as null
    assert json.loads((tmp_path / "run.json").read_text())["check"]["max_loss_diff"] is None
    code, out, err = run_cli(["show", str(tmp_path / "run.json")], capsys)
    assert code == 0, err
    assert "load average -" in out
    assert "check: FAIL (max loss diff -, max param diff - at -, 7 parameters compared)" in out


@pytest.mark.parametrize("priced_by", ["all-reduce probe", "point-to-point link"])
def test_calibrate_scales_the_all_reduce_to_the_tied_sum_the_run_measured(
        priced_by: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The rank that reaches the tied sum last waits for no one: its measured_tied_sync_s (the least over the
    ranks) is the collective's own time. calibrate scales the all-reduce's constants by it over the run's
    price, so the next plan prices the sum as the run took it (the oracle: that rank's figure), and the
    latency fit replays the run with it (the oracle: the delay the measured step was built with)."""
    import dataclasses

    from stageplan.planning.costs import LayerArrays, evaluate, make_options

    tie_bytes, delay = 2_000_000, 1.5e-3
    prof = dataclasses.replace(_profile(), meta={**_profile().meta, "tied": [
        {"names": ["emb.weight", "head.weight"], "layers": [0, 4], "bytes": tie_bytes}]})
    link = {"schema": "stageplan.link/1", "latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9}
    if priced_by == "all-reduce probe":
        link.update(allreduce_latency_s=2e-4, allreduce_bandwidth_bytes_per_s=5e8)
        price = 2 * (2 - 1) / 2 * tie_bytes / 5e8 + 2 * (2 - 1) * 2e-4  # 4.4 ms
    else:
        price = 2 * (2 - 1) / 2 * tie_bytes / 1e9 + 2 * (2 - 1) * 1e-4  # 2.2 ms
    kw = dict(num_microbatches=M, boundaries=[0, 2, 5], optimizer="none")
    pl = plan(prof, 2, link=link, **kw)  # type: ignore[arg-type]
    assert pl.tied_sync_s == pytest.approx(price, rel=1e-12)
    last, waiting = 1.6 * price, 1.6 * price + 9e-3  # rank 1 gets there first and waits 9 ms for rank 0
    rows = _report(pl).to_json()
    for row, took in zip(rows["ranks"], (last, waiting)):
        row["measured_tied_sync_s"] = took
    first = calibrate(prof, RunReport.from_json(rows))
    c = first.meta["calibration"]
    prof.save(tmp_path / "prof.json")
    RunReport.from_json(rows).save(tmp_path / "run.json")
    code, out, err = run_cli(["calibrate", str(tmp_path / "prof.json"), str(tmp_path / "run.json"), "-o",
                              str(tmp_path / "cal.json")], capsys)
    assert code == 0, err
    assert (
        f"the tied gradients' all-reduce at 1.600x its price, as the run's last rank to reach it took it "
        f"({last * 1e3:.3f} ms)" in out
    )
    assert c["tied_sync_ratio"] == pytest.approx(1.6) and c["tied_sync_measured_s"] == pytest.approx(last)
    again = plan(first, 2, **kw)  # type: ignore[arg-type]
    assert again.tied_sync_s == pytest.approx(last, rel=1e-9)
    assert plan(first, 2, bandwidth="1GB/s", **kw).tied_sync_s == pytest.approx(last, rel=1e-9)  # type: ignore[arg-type]
    # the step the run measured: its layers, the sum as it
    # took it, and the delay; the fit gives back the delay
    opts = make_options(first, 2, num_microbatches=M, optimizer="none", bandwidth_bytes_per_s=1e9,
                        link_latency_s=1e-4,
                        allreduce_latency_s=c["allreduce_latency_s"], boundary_latency_s=delay,
                        allreduce_bandwidth_bytes_per_s=c["allreduce_bandwidth_bytes_per_s"])
    ev = evaluate(LayerArrays.of(first, M), (0, 2, 5), opts)
    assert ev.tied_sync_s == pytest.approx(last, rel=1e-9)
    rows["measured_step_s"] = ev.predicted_step_s
    cal = calibrate(prof, RunReport.from_json(rows))
    assert cal.meta["calibration"]["boundary_latency_s"] == pytest.approx(delay, rel=1e-6)
    # a report that did not time the sum keeps the constants the run had, unscaled
    for row in rows["ranks"]:
        row["measured_tied_sync_s"] = None
    plain = calibrate(prof, RunReport.from_json(rows)).meta["calibration"]
    assert "tied_sync_ratio" not in plain
    assert plain["allreduce_bandwidth_bytes_per_s"] == link.get("allreduce_bandwidth_bytes_per_s")


def test_a_new_link_prices_a_calibrated_profiles_boundaries_and_keeps_what_its_layers_were_calibrated_with(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A calibrated profile planned with another link (stageplan plan cal.json --link LINK.json): the link's
    bandwidth and crossing delay price the boundaries, but each rank's compute stays what the run measured
    (the oracle: the run's chunk overheads, not the new probe's, on top of layers calibrated net of them), and
    the tied sum stays what the run's last-arriving rank took (the oracle), not the new probe's price; a sum
    calibrate did not scale is priced from the new probe."""
    import dataclasses
    import json

    tie_bytes = 2_000_000
    prof = dataclasses.replace(_profile(), meta={**_profile().meta, "tied": [
        {"names": ["emb.weight", "head.weight"], "layers": [0, 4], "bytes": tie_bytes}]})
    run_link = {"schema": "stageplan.link/1", "latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9,
                "chunk_forward_s": 0.2e-3, "chunk_backward_s": 0.5e-3, "action_s": 0.1e-3,
                "allreduce_latency_s": 2e-4, "allreduce_bandwidth_bytes_per_s": 5e8}
    new_link = {**run_link, "latency_s": 3e-4, "bandwidth_bytes_per_s": 2e9, "chunk_forward_s": 0.05e-3,
                "chunk_backward_s": 0.1e-3, "action_s": 0.3e-3, "allreduce_latency_s": 1e-4,
                "allreduce_bandwidth_bytes_per_s": 2e9}
    kw = dict(num_microbatches=M, boundaries=[0, 2, 5], optimizer="none")
    pl = plan(prof, 2, link=run_link, **kw)  # type: ignore[arg-type]
    last = 1.6 * pl.tied_sync_s
    rows = _report(pl).to_json()
    for row, took in zip(rows["ranks"], (last, last + 9e-3)):
        row["measured_tied_sync_s"] = took
    rep = RunReport.from_json(rows)
    cal = calibrate(prof, rep)
    again = plan(cal, 2, link=new_link, **kw)  # type: ignore[arg-type]
    assert again.tied_sync_s == pytest.approx(last, rel=1e-9)
    assert again.cost_options["bandwidth_bytes_per_s"] == 2e9
    assert again.cost_options["action_s"] == run_link["action_s"]
    for row in rep.ranks:
        st = again.stages[row["rank"]]
        assert st.chunk_s == pytest.approx(run_link["chunk_forward_s"] + run_link["chunk_backward_s"])
        assert st.forward_s + st.backward_s == pytest.approx(row["measured_compute_s"])
    note = next(n for n in again.notes if n.startswith("link bandwidth"))
    assert "the chunk overheads stay the calibrating run's" in note
    assert "as the calibrating run's last rank to reach the sum took it (1.600x its price then)" in note
    # the boundaries are the new link's: the same profile with the run's link differs only in comm
    with_run_link = plan(cal, 2, link=run_link, **kw)  # type: ignore[arg-type]
    assert [st.comm_s for st in again.stages] != [st.comm_s for st in with_run_link.stages]
    # a run that did not time the sum: calibrate kept the
    # probe's constants unscaled, and the new probe prices it
    for row in rows["ranks"]:
        row["measured_tied_sync_s"] = None
    unscaled = calibrate(prof, RunReport.from_json(rows))
    fresh = plan(unscaled, 2, link=new_link, **kw)  # type: ignore[arg-type]
    # the new probe's ring
    assert fresh.tied_sync_s == pytest.approx(2 * (2 - 1) / 2 * tie_bytes / 2e9 + 2 * (2 - 1) * 1e-4,
                                              rel=1e-12)
    assert any("from the link's own all-reduce" in n for n in fresh.notes)
    # and the CLI says so in its plan notes
    cal.save(tmp_path / "cal.json")
    (tmp_path / "link.json").write_text(json.dumps(new_link))
    code, out, err = run_cli(["plan", str(tmp_path / "cal.json"), "--stages", "2", "--microbatches", str(M),
                              "--boundaries", "0,2,5", "--optimizer", "none", "--link",
                              str(tmp_path / "link.json"), "--explain"],
                             capsys)
    assert code == 0, err
    assert "the chunk overheads stay the calibrating run's" in out


def test_calibrate_scales_each_ranks_optimizer_step_to_what_the_run_took(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank steps all its layers in one optimizer.step(), which the run times apart
    (measured_optimizer_step_s): calibrate scales the rank's layers' figures above the fixed cost so that the
    next plan prices each rank's step as the run took it (the oracle: the measured figures), keeps the floor
    once per rank and a layer without parameters at 0, leaves the other optimizers' figures alone, and fits
    the latency with the scaled step (the oracle: the delay the measured step was built with). An older report
    gives the step as its time after the schedule less its timed tied sum; one without either is left
    unscaled."""
    import dataclasses

    from stageplan.planning.costs import LayerArrays, evaluate, make_options

    floor, opt = 0.3e-3, [2e-3, 1e-3, 0.0, 1.5e-3, 4e-3]  # layer 2 has nothing to step
    base = _profile()
    prof = Profile(tuple(dataclasses.replace(x, optimizer_s={"adam": o, "sgd": o / 2}) for x,
                         o in zip(base.layers, opt)),
                   {**base.meta, "optimizer_step": {"floor_s": {"adam": floor, "sgd": floor}}})
    kw = dict(num_microbatches=M, boundaries=[0, 2, 5], optimizer="adam")
    pl = plan(prof, 2, **kw)  # type: ignore[arg-type]
    # sum above the floor, plus it once
    assert [st.optimizer_s for st in pl.stages] == pytest.approx([2.7e-3, 5.2e-3])
    took = [1.8e-3, 7.0e-3]
    rows = _report(pl).to_json()
    rows["run_options"]["optimizer"] = "adam"
    for row, t in zip(rows["ranks"], took):
        row["measured_optimizer_step_s"] = t
    cal = calibrate(prof, RunReport.from_json(rows))
    c = cal.meta["calibration"]
    assert c["optimizer"] == "adam" and c["optimizer_measured_s"] == took
    assert c["optimizer_factors"] == pytest.approx([(1.8e-3 - floor) / 2.4e-3, (7.0e-3 - floor) / 4.9e-3])
    again = plan(cal, 2, **kw)  # type: ignore[arg-type]
    assert [st.optimizer_s for st in again.stages] == pytest.approx(took)
    assert cal.layers[2].optimizer_s["adam"] == 0.0  # type: ignore[index]
    assert [x.optimizer_s["sgd"] for x in cal.layers] == [o / 2 for o in opt]  # type: ignore[index]
    # the measured step: the calibrated layers, the step as the
    # run took it, and a delay; the fit gives back the delay
    delay = 1.2e-3
    ev = evaluate(LayerArrays.of(cal, M), (0, 2, 5), make_options(cal, 2, num_microbatches=M,
                                                                  optimizer="adam", boundary_latency_s=delay))
    rows["measured_step_s"] = ev.predicted_step_s
    assert calibrate(prof, RunReport.from_json(rows)).meta["calibration"][
        "boundary_latency_s"
    ] == pytest.approx(delay, rel=1e-6)
    # an older report: the rank's time after the schedule less its timed tied sum
    for row, t in zip(rows["ranks"], took):
        row.update(measured_optimizer_step_s=None, measured_tied_sync_s=2e-3, optimizer_s=t + 2e-3)
    older = calibrate(prof, RunReport.from_json(rows))
    assert [st.optimizer_s for st in plan(older, 2, **kw).stages] == pytest.approx(took)  # type: ignore[arg-type]
    for row in rows["ranks"]:
        row["measured_tied_sync_s"] = None
    unscaled = calibrate(prof, RunReport.from_json(rows))
    assert "optimizer_factors" not in unscaled.meta["calibration"]
    assert [x.optimizer_s for x in unscaled.layers] == [x.optimizer_s for x in prof.layers]
    # the CLI's line says it, and show prints both figures
    rows["ranks"][0].update(measured_optimizer_step_s=took[0])
    rows["ranks"][1].update(measured_optimizer_step_s=took[1])
    prof.save(tmp_path / "prof.json")
    RunReport.from_json(rows).save(tmp_path / "run.json")
    code, out, err = run_cli(["calibrate", str(tmp_path / "prof.json"), str(tmp_path / "run.json"), "-o",
                              str(tmp_path / "cal.json")], capsys)
    assert code == 0, err
    assert "the adam step per rank at 0.625x, 1.367x its profile above the fixed cost, as the run's ranks " \
           "took it (1.800, 7.000 ms)" in out
    code, out, err = run_cli(["show", str(tmp_path / "run.json"), "--explain"], capsys)
    assert code == 0, err
    said = [ln for ln in out.splitlines() if ln.startswith("  rank ") and "predicted" in ln]
    assert said == ["  rank 0 predicted 2.700, measured 1.800", "  rank 1 predicted 5.200, measured 7.000"]
