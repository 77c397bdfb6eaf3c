"""stageplan.formats.link: LINK.json loaded and checked, and plan --link priced exactly as --bandwidth with
the measured latency per crossing and the schedule's overheads around each chunk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli

from stageplan import StageplanError
from stageplan.errors import SchemaError
from stageplan.formats.link import LINK_SCHEMA, load_link
from stageplan.formats.plan import Plan
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.planning.planner import plan
from stageplan.report import plan_table

from .test_costs import BANDWIDTH, LATENCY

ROOT = Path(__file__).resolve().parents[2]


GPT = ROOT / "profiles" / "cpu" / "gpt.json"


def test_a_link_with_half_an_all_reduce_fit_is_refused() -> None:
    from stageplan.errors import StageplanError
    from stageplan.formats.link import load_link

    base = {"schema": "stageplan.link/1", "latency_s": LATENCY, "bandwidth_bytes_per_s": BANDWIDTH}
    for extra in ({"allreduce_latency_s": 1e-4}, {"allreduce_bandwidth_bytes_per_s": 1e9},
                  {"allreduce_latency_s": -1.0, "allreduce_bandwidth_bytes_per_s": 1e9},
                  {"allreduce_latency_s": 1e-4, "allreduce_bandwidth_bytes_per_s": 0.0}):
        with pytest.raises(StageplanError, match=r"allreduce_latency_s = .* both must be numbers"):
            load_link({**base, **extra})
    fit = {"allreduce_latency_s": 1e-4, "allreduce_bandwidth_bytes_per_s": 1e9}
    assert load_link({**base, **fit, "allreduce_ranks": 3})["allreduce_ranks"] == 3
    for ranks in (1, 0, True, "x", 2.5, [2]):  # the plan divides by p - 1: refused before it does
        with pytest.raises(StageplanError, match=r"allreduce_ranks = .* must be an integer >= 2, or absent"):
            load_link({**base, **fit, "allreduce_ranks": ranks})


def test_a_link_file_with_a_bad_all_reduce_rank_count_is_one_line_from_plan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import assert_one_line_error, run_cli

    link = tmp_path / "LINK.json"
    link.write_text(json.dumps({"schema": "stageplan.link/1", "latency_s": LATENCY,
                                "bandwidth_bytes_per_s": BANDWIDTH,
                                "allreduce_latency_s": 1e-4, "allreduce_bandwidth_bytes_per_s": 1e9,
                                "allreduce_ranks": 1}))
    code, _, err = run_cli(["plan", str(GPT), "--stages", "2", "--link", str(link)], capsys)
    assert_one_line_error(code, err, "allreduce_ranks = 1; .* integer >= 2")


OUT_BYTES = 1e6


def _profile(meta: dict | None = None) -> Profile:  # type: ignore[type-arg]
    """Two layers: forward 1 s, backward 2 s, 1 MB out each."""
    layers = tuple(LayerProfile(f"l{i}", 1.0, 2.0, 0, int(OUT_BYTES), 0) for i in range(2))
    return Profile(layers, {"batch_size": 1, "microbatch_size": 1, "model": "toy", **(meta or {})})


def _link_file(tmp_path: Path, latency_s: float = 0.5, bandwidth: float = 1e6) -> Path:
    path = tmp_path / "link.json"
    path.write_text(json.dumps({"schema": LINK_SCHEMA, "backend": "gloo", "latency_s": latency_s,
                                "bandwidth_bytes_per_s": bandwidth, "sizes": [4096, 4194304], "pairs": []}))
    return path


def test_plan_link_prices_bytes_as_bandwidth_and_adds_the_latency(tmp_path: Path) -> None:
    link = _link_file(tmp_path, latency_s=0.5, bandwidth=1e6)
    with pytest.warns(UserWarning, match="bubble"):  # m = 1 < p = 2
        linked = plan(_profile(), 2, num_microbatches=1, schedule="GPipe", link=link)
        priced = plan(_profile(), 2, num_microbatches=1, schedule="GPipe", bandwidth=1e6)
        bare = plan(_profile(), 2, num_microbatches=1, schedule="GPipe")
    # closed form: 2 * output_bytes / bandwidth per boundary, both directions
    assert linked.stages[0].comm_s == priced.stages[0].comm_s == pytest.approx(2 * OUT_BYTES / 1e6)
    assert linked.stages[1].comm_s == 0.0
    # GPipe, p = 2, m = 1: F0, hop, F1, B1, hop, B0; each hop = one way (1 s) + latency (0.5 s)
    assert bare.predicted_step_s == pytest.approx(1 + 1 + 2 + 2)
    assert priced.predicted_step_s == pytest.approx(6 + 2 * 1.0)
    assert linked.predicted_step_s == pytest.approx(6 + 2 * (1.0 + 0.5))
    assert linked.simulate().step_s == pytest.approx(linked.predicted_step_s)  # the stored plan replays it
    assert linked.cost_options["boundary_latency_s"] == 0.5
    assert linked.cost_options["bandwidth_bytes_per_s"] == 1e6
    assert ("boundary latency 500.000 ms per crossing, the one-way latency measured by stageplan link (gloo, "
            "0 pairs) in"
            in "\n".join(linked.notes))
    assert any(n.startswith("link bandwidth 0.001 GB/s one way prices the boundary bytes")
               for n in linked.notes)
    assert not any("not modelled" in n for n in linked.notes)
    assert any("not modelled" in n for n in bare.notes)
    # a dict works as the file does
    with pytest.warns(UserWarning, match="bubble"):
        as_dict = plan(_profile(), 2, num_microbatches=1, schedule="GPipe", link=json.loads(link.read_text()))
    assert as_dict.predicted_step_s == linked.predicted_step_s
    # a link that timed the schedule's fused send/receive prices each crossing at it (here 0.75 s > 0.5 s)
    fused = {**json.loads(link.read_text()), "exchange_s": 0.75}
    with pytest.warns(UserWarning, match="bubble"):
        exchanged = plan(_profile(), 2, num_microbatches=1, schedule="GPipe", link=fused)
    assert exchanged.predicted_step_s == pytest.approx(6 + 2 * (1.0 + 0.75))
    assert exchanged.cost_options["boundary_latency_s"] == 0.75
    assert "750.000 ms per crossing, a fused send/receive exchange measured by stageplan link" in "\n".join(
        exchanged.notes
    )


def test_cli_plan_link(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "prof.json"
    _profile().save(prof)
    code, out, err = run_cli(["plan", str(prof), "--stages", "2", "--microbatches", "4", "--link",
                              str(_link_file(tmp_path)), "-o", str(tmp_path / "plan.json")], capsys)
    assert code == 0, err
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["cost_options"]["boundary_latency_s"] == 0.5
    assert data["stages"][0]["comm_s"] == pytest.approx(2.0)
    assert "measured by stageplan link" in out


def test_refusals_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "prof.json"
    _profile().save(prof)
    link = _link_file(tmp_path)
    code, _, err = run_cli(["plan", str(prof), "--stages", "2", "--link", str(link), "--bandwidth", "1GB/s"],
                           capsys)
    assert_one_line_error(code, err, r"--link and --bandwidth.*give one")
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({"schema": "stageplan.link/9", "latency_s": 1e-5, "bandwidth_bytes_per_s": 1e9}))
    code, _, err = run_cli(["plan", str(prof), "--stages", "2", "--link", str(bad)], capsys)
    assert_one_line_error(code, err, r"'stageplan.link/9'.*'stageplan.link/1'")
    neg = tmp_path / "neg.json"
    neg.write_text(json.dumps({"schema": LINK_SCHEMA, "latency_s": 1e-5, "bandwidth_bytes_per_s": 0}))
    code, _, err = run_cli(["plan", str(prof), "--stages", "2", "--link", str(neg)], capsys)
    assert_one_line_error(code, err, r"bandwidth_bytes_per_s > 0.*stageplan link")
    code, _, err = run_cli(["plan", str(prof), "--stages", "2", "--link", str(tmp_path / "missing.json")],
                           capsys)
    assert_one_line_error(code, err, r"does not exist")
    code, _, err = run_cli(["link", "--ranks", "1", "-o", str(tmp_path / "l.json")], capsys)
    assert_one_line_error(code, err, r"num_ranks must be an integer >= 2, got 1; e.g. --ranks 2")
    code, _, err = run_cli(["link", "--backend", "mpi", "-o", str(tmp_path / "l.json")], capsys)
    assert_one_line_error(code, err, r"unknown backend 'mpi'")
    code, _, err = run_cli(["link", "--timeout", "0", "-o", str(tmp_path / "l.json")], capsys)
    assert_one_line_error(code, err, r"timeout must be > 0")
    code, _, err = run_cli(["link", "-o", str(tmp_path / "no" / "l.json")], capsys)
    assert_one_line_error(code, err, r"does not exist")


def test_load_link_refuses_a_mangled_exchange() -> None:
    for bad in (True, -1.0, float("nan"), "fast"):
        with pytest.raises(StageplanError, match="exchange_s"):
            load_link({"schema": "stageplan.link/1", "latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9,
                       "exchange_s": bad})


def test_load_link_checks_the_figures() -> None:
    assert load_link({"schema": LINK_SCHEMA, "latency_s": 0, "bandwidth_bytes_per_s": 5})["latency_s"] == 0.0
    with pytest.raises(SchemaError, match=r"link lacks latency_s; measure it again with stageplan link"):
        load_link({"schema": LINK_SCHEMA, "bandwidth_bytes_per_s": 5})
    with pytest.raises(Exception, match=r"latency_s >= 0"):
        load_link({"schema": LINK_SCHEMA, "latency_s": -1, "bandwidth_bytes_per_s": 5})
    # true read as 1 s of latency, and a number where the pairs go broke the plan's note (len of an int)
    with pytest.raises(SchemaError,
                       match=r"has latency_s = True and bandwidth_bytes_per_s = 5; both must be numbers"):
        load_link({"schema": LINK_SCHEMA, "latency_s": True, "bandwidth_bytes_per_s": 5})
    # the exception's text had stood where the field's name
    # goes: "mangles field could not convert string to float"
    with pytest.raises(SchemaError, match=r"has latency_s = 0 and bandwidth_bytes_per_s = 'fast'; both must "
                                          r"be numbers \(seconds, bytes/s\)"):
        load_link({"schema": LINK_SCHEMA, "latency_s": 0, "bandwidth_bytes_per_s": "fast"})
    for field, value in (("pairs", 5), ("backend", 3)):
        with pytest.raises(SchemaError,
                           match=rf"{field} = {value}\b.*; pairs must be a list and backend a name"):
            load_link({"schema": LINK_SCHEMA, "latency_s": 0, "bandwidth_bytes_per_s": 5, field: value})


def test_a_link_with_the_schedules_action_time_prices_it_around_every_chunk(tmp_path: Path) -> None:
    """Closed form: GPipe, p = 2, m = 1, forward 1 s, backward 2 s, one layer per rank; the loop's 0.25 s per
    action lengthens each of the four actions on the critical path, and each stage's time by 0.5 s."""
    base = json.loads(_link_file(tmp_path, latency_s=0.5, bandwidth=1e6).read_text())
    with pytest.warns(UserWarning, match="bubble"):
        bare = plan(_profile(), 2, num_microbatches=1, schedule="GPipe", link=base)
        timed = plan(_profile(), 2, num_microbatches=1, schedule="GPipe", link={**base, "action_s": 0.25})
    assert bare.predicted_step_s == pytest.approx(6 + 2 * (1.0 + 0.5))
    assert timed.predicted_step_s == pytest.approx(bare.predicted_step_s + 4 * 0.25)
    assert timed.simulate().step_s == pytest.approx(timed.predicted_step_s)  # the stored plan replays it
    for st, was in zip(timed.stages, bare.stages):
        # what a run's chunk timers see
        assert (st.forward_s, st.backward_s) == (was.forward_s, was.backward_s)
        assert st.action_s == 0.5 and st.time_s == pytest.approx(was.time_s + 0.5)
    assert timed.bottleneck_s == pytest.approx(bare.bottleneck_s + 0.5)
    assert timed.lower_bound_s == pytest.approx(bare.lower_bound_s + 0.5)
    assert timed.cost_options["action_s"] == 0.25 and bare.cost_options["action_s"] == 0.0
    assert any("250.000 ms around each chunk's forward and backward" in n for n in timed.notes)
    assert "loop ms" in plan_table(timed) and "loop ms" not in plan_table(bare)
    assert list(timed.to_pandas()["action_s"]) == [0.5, 0.5]
    assert Plan.from_json(timed.to_json()) == timed
    for bad in (True, -1.0, float("nan"), "slow"):
        with pytest.raises(StageplanError, match="action_s"):
            load_link({**base, "action_s": bad})


def test_a_link_with_the_chunks_overhead_prices_it_inside_every_chunk(tmp_path: Path) -> None:
    """Closed form: GPipe, p = 2, m = 1, forward 1 s, backward 2 s, one layer per rank; PipelineStage's 0.1 s
    in each forward and 0.2 s in each backward lengthen the four actions on the critical path (F0, F1, B1, B0)
    by 0.6 s, and each stage's forward, backward and time by 0.1, 0.2 and 0.3 s; a link without the figures
    says so."""
    base = json.loads(_link_file(tmp_path, latency_s=0.5, bandwidth=1e6).read_text())
    with pytest.warns(UserWarning, match="bubble"):
        bare = plan(_profile(), 2, num_microbatches=1, schedule="GPipe", link=base)
        timed = plan(_profile(), 2, num_microbatches=1, schedule="GPipe",
                     link={**base, "chunk_forward_s": 0.1, "chunk_backward_s": 0.2})
    assert timed.predicted_step_s == pytest.approx(bare.predicted_step_s + 2 * 0.1 + 2 * 0.2)
    assert timed.simulate().step_s == pytest.approx(timed.predicted_step_s)  # the stored plan replays it
    for st, was in zip(timed.stages, bare.stages):
        assert (st.forward_s, st.backward_s) == pytest.approx((was.forward_s + 0.1, was.backward_s + 0.2))
        assert st.chunk_s == pytest.approx(0.3) and st.time_s == pytest.approx(was.time_s + 0.3)
    assert timed.bottleneck_s == pytest.approx(bare.bottleneck_s + 0.3)
    assert timed.lower_bound_s == pytest.approx(bare.lower_bound_s + 0.3)
    assert (timed.cost_options["chunk_forward_s"], timed.cost_options["chunk_backward_s"]) == (0.1, 0.2)
    assert any("100.000 ms inside each chunk's forward and 200.000 ms inside its backward" in n
               for n in timed.notes)
    assert any("has no action_s, chunk_forward_s, chunk_backward_s" in n for n in bare.notes)
    assert not any("schedule probe has no" in n for n in plan(
        _profile(), 2, num_microbatches=2, link={**base, "action_s": 0.0, "chunk_forward_s": 0.1,
                                                 "chunk_backward_s": 0.2}).notes)
    assert "chunk ms" in plan_table(timed) and "chunk ms" not in plan_table(bare)
    assert list(timed.to_pandas()["chunk_s"]) == pytest.approx([0.3, 0.3])
    assert Plan.from_json(timed.to_json()) == timed
    for key in ("chunk_forward_s", "chunk_backward_s"):
        for bad in (True, -1.0, float("nan"), "slow"):
            with pytest.raises(StageplanError, match=key):
                load_link({**base, key: bad})
