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


# The data-parallel group's all-reduce (stageplan link --data-parallel D)

DP_SIZES = [4096, 64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20]
DP_FIXED_S, DP_RATE = 4e-4, 8e8  # the fit a + n / B the synthetic probe times lie on


def _dp_link(ranks: int = 2, **extra: object) -> dict:  # type: ignore[type-arg]
    from stageplan.running.link import dp_allreduce_fields

    times = [DP_FIXED_S + n / DP_RATE for n in DP_SIZES]
    return {"schema": LINK_SCHEMA, "backend": "gloo", "latency_s": 5e-5, "bandwidth_bytes_per_s": 2e9,
            **dp_allreduce_fields(DP_SIZES, times, ranks, 2), **extra}


def _grads_profile(grad_bytes: int) -> Profile:
    """Two layers, the first holding ``grad_bytes`` of fp32 parameters (so of gradients), the second none."""
    layers = (LayerProfile("l0", 1e-3, 2e-3, 0, 1024, grad_bytes, param_count=grad_bytes // 4),
              LayerProfile("l1", 1e-3, 2e-3, 0, 1024, 0))
    return Profile(layers, {"batch_size": 8, "microbatch_size": 1, "dtype": "float32"})


def test_a_link_without_the_data_parallel_probe_still_loads_and_a_bad_one_is_refused_in_one_line() -> None:
    base = {"schema": LINK_SCHEMA, "latency_s": LATENCY, "bandwidth_bytes_per_s": BANDWIDTH}
    assert not any(k.startswith("dp_") for k in load_link(base))  # links from before the probe
    good = _dp_link()
    assert load_link(good)["dp_allreduce_sizes"] == DP_SIZES
    fit_keys = ("dp_allreduce_latency_s", "dp_allreduce_bandwidth_bytes_per_s")
    for bad in ({"dp_allreduce_latency_s": None}, {"dp_allreduce_bandwidth_bytes_per_s": None},
                {"dp_allreduce_latency_s": -1e-4}, {"dp_allreduce_bandwidth_bytes_per_s": 0.0},
                {"dp_allreduce_latency_s": "1ms"}):
        row = {k: v for k, v in {**good, **bad}.items() if v is not None}
        shown = tuple(row.get(k) for k in fit_keys)
        with pytest.raises(SchemaError, match=rf"dp_allreduce_latency_s = {shown[0]!r} and "
                                              rf"dp_allreduce_bandwidth_bytes_per_s = {shown[1]!r}; both "
                                              r"must be numbers .* stageplan link --data-parallel D$"):
            load_link(row)
    for ranks in (1, True, 2.0):
        with pytest.raises(SchemaError, match=rf"dp_allreduce_ranks = {ranks!r}; .* integer >= 2"):
            load_link({**good, "dp_allreduce_ranks": ranks})
    for sizes, times in ((DP_SIZES[:2], good["dp_allreduce_s"]), (DP_SIZES, None),
                         ([0, *DP_SIZES[1:]], good["dp_allreduce_s"]), (DP_SIZES, [-1.0] * 5)):
        row = {k: v for k, v in {**good, "dp_allreduce_sizes": sizes, "dp_allreduce_s": times}.items()
               if v is not None}
        with pytest.raises(SchemaError, match=r"dp_allreduce_sizes = .* and dp_allreduce_s = .*; both must "
                                              r"be lists of as many positive numbers"):
            load_link(row)


def test_a_bad_data_parallel_probe_is_one_line_and_exit_2_from_plan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "link.json"
    path.write_text(json.dumps({**_dp_link(), "dp_allreduce_bandwidth_bytes_per_s": -1.0}))
    code, _, err = run_cli(["plan", str(GPT), "--stages", "2", "--data-parallel", "2", "--link", str(path)],
                           capsys)
    assert_one_line_error(code, err, r"dp_allreduce_bandwidth_bytes_per_s = -1.0; both must be numbers")


@pytest.mark.parametrize("grad_bytes", DP_SIZES)
def test_the_replicas_sync_priced_with_the_data_parallel_probe_is_its_fit_at_every_probed_size(
        grad_bytes: int) -> None:
    """At the d it was timed over, a stage's DDP sync (all exposed under DDP's 25 MiB bucket) is the probe's
    own fit a + n / B on the stage's gradient bytes n: the closed form the synthetic times were made on."""
    pl = plan(_grads_profile(grad_bytes), 2, num_microbatches=4, data_parallel=2, link=_dp_link(),
              boundaries=[0, 1, 2])
    assert pl.stages[0].dp_sync_s == pytest.approx(DP_FIXED_S + grad_bytes / DP_RATE, rel=1e-9)
    note = next(n for n in pl.notes if n.startswith("the replicas' gradient sync"))
    assert "the link's data-parallel all-reduce" in note and "over 2 ranks, 2 groups at once" in note
    assert "scaled" not in note


@pytest.mark.parametrize(("measured_d", "planned_d"), [(2, 4), (2, 3), (3, 2), (4, 8)])
def test_the_data_parallel_probe_scales_to_another_replica_count_as_a_ring(measured_d: int,
                                                                         planned_d: int) -> None:
    """Timed over D replicas, the fit a + n / B is a ring of 2(D - 1) steps of a / (2(D - 1)) each, moving
    2(D - 1)/D x n over links of B x 2(D - 1)/D; over d replicas the ring takes 2(d - 1) such steps and moves
    2(d - 1)/d x n (Patarasuk and Yuan 2009)."""
    n = 2**20
    step_s = DP_FIXED_S / (2 * (measured_d - 1))
    link_rate = DP_RATE * 2 * (measured_d - 1) / measured_d
    want = 2 * (planned_d - 1) * step_s + 2 * (planned_d - 1) / planned_d * n / link_rate
    pl = plan(_grads_profile(n), 2, num_microbatches=4, data_parallel=planned_d, link=_dp_link(measured_d),
              boundaries=[0, 1, 2])
    assert pl.stages[0].dp_sync_s == pytest.approx(want, rel=1e-9)
    assert any(f"over {measured_d} ranks, 2 groups at once, scaled as a ring to {planned_d}" in x
               for x in pl.notes)


def test_the_replicas_sync_is_priced_by_the_dp_probe_then_the_pipelines_all_reduce_then_point_to_point(
) -> None:
    n, d = 2**20, 2
    prof = _grads_profile(n)
    both = _dp_link(allreduce_latency_s=1e-3, allreduce_bandwidth_bytes_per_s=1e8, allreduce_ranks=2)
    pl = plan(prof, 2, num_microbatches=4, data_parallel=d, link=both, boundaries=[0, 1, 2])
    assert pl.stages[0].dp_sync_s == pytest.approx(DP_FIXED_S + n / DP_RATE, rel=1e-9)
    pipeline_only = {k: v for k, v in both.items() if not k.startswith("dp_")}
    pl = plan(prof, 2, num_microbatches=4, data_parallel=d, link=pipeline_only, boundaries=[0, 1, 2])
    assert pl.stages[0].dp_sync_s == pytest.approx(2 * 1e-3 + n / 1e8, rel=1e-9)
    assert any("the all-reduce that prices the tied gradients" in x for x in pl.notes)
    p2p = {k: v for k, v in pipeline_only.items() if not k.startswith("allreduce_")}
    pl = plan(prof, 2, num_microbatches=4, data_parallel=d, link=p2p, boundaries=[0, 1, 2])
    # a ring of 2 over the one-way link: 2(d - 1) = 2 steps of its latency, 2(d - 1)/d = 1 x n at its rate
    assert pl.stages[0].dp_sync_s == pytest.approx(2 * 5e-5 + n / 2e9, rel=1e-9)
    assert any("point-to-point" in x for x in pl.notes)


def test_show_link_lists_the_data_parallel_all_reduce_by_size_measured_and_fitted() -> None:
    from stageplan.report import link_table

    link = _dp_link(pairs=[{"ranks": [0, 2]}], num_ranks=4, pipeline_parallel=2, data_parallel=2)
    link["dp_allreduce_s"][1] = 1.5e-3  # a measured time off the fit shows beside it
    line = link_table(link).splitlines()[-1]
    assert line.startswith("  data-parallel all-reduce over 2 replicas, 2 groups at once")
    assert "1.50 (0.48) ms at 64 KiB" in line
    largest_ms = (DP_FIXED_S + 2**24 / DP_RATE) * 1e3
    assert f"{largest_ms:.2f} ({largest_ms:.2f}) ms at 16 MiB" in line
    assert "laid out 2 pp x 2 dp, replica 0's pipeline" in link_table(link).splitlines()[0]


@pytest.mark.parametrize(("ranks", "dp", "remedy"),
                         [("4", "3", r"--ranks 6 for 3 replicas, or a divisor of 4"),
                          ("3", "0", r"a divisor of 3, e.g. --data-parallel 3")])
def test_link_refuses_replicas_that_do_not_divide_the_ranks_before_any_rank_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], ranks: str, dp: str, remedy: str) -> None:
    code, _, err = run_cli(["link", "--ranks", ranks, "--data-parallel", dp, "-o", str(tmp_path / "l.json")],
                           capsys)
    assert_one_line_error(code, err, rf"data_parallel \({dp}\) must be an integer >= 1 that divides the "
                                     rf"ranks \({ranks}\).*{remedy}")
    assert not (tmp_path / "l.json").exists()


# Each sharding mode's own sync (stageplan link --data-parallel D: link.dp_sync_probe)

SYNC_SIZES = [64 * 2**10, 2**20, 16 * 2**20, 32 * 2**20]
# the lines the synthetic probe times lie on, per kind: (fixed seconds for the probe's whole module, bytes/s)
SYNC_LINES = {"ddp": (2e-3, 4e8), "zero1_broadcast": (3e-4, 9e8), "fsdp_reduce": (8e-3, 3e8),
              "fsdp_gather": (6e-3, 5e8)}
SYNC_UNITS = 4


def _sync_link(ranks: int = 2) -> dict:  # type: ignore[type-arg]
    from stageplan.running.link import dp_sync_fields

    times = {k: [a + n / b for n in SYNC_SIZES] for k, (a, b) in SYNC_LINES.items()}
    return {**_dp_link(ranks), **dp_sync_fields(SYNC_SIZES, times, ranks, SYNC_UNITS)}


def _units_profile(unit_bytes: int, units: int) -> Profile:
    """``units`` layers of ``unit_bytes`` fp32 parameters each, then one layer without parameters."""
    layers = tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 0, 1024, unit_bytes, param_count=unit_bytes // 4)
                   for i in range(units))
    return Profile((*layers, LayerProfile("head", 1e-3, 2e-3, 0, 1024, 0)),
                   {"batch_size": 8, "microbatch_size": 1, "dtype": "float32"})


@pytest.mark.parametrize("sharding", ["ddp", "zero1", "fsdp"])
@pytest.mark.parametrize("unit_bytes", [2**20, 16 * 2**20])
def test_each_sharding_modes_sync_is_priced_from_its_own_probe_at_the_probed_replica_count(
        sharding: str, unit_bytes: int) -> None:
    """At the d it was timed over, each mode's sync is its own probe's line a + n / B on the stage's bytes n
    (the closed forms the synthetic times were made on): DDP's whole, exposed beyond the last backward but
    never below its last 25 MiB bucket; ZeRO-1's broadcast added; FSDP2's reduce and gather with their fixed
    cost once per unit (the probe's a / 4 units, times the stage's 3 layers holding parameters)."""
    units = 3
    grads = units * unit_bytes
    pl = plan(_units_profile(unit_bytes, units), 2, num_microbatches=4, data_parallel=2, link=_sync_link(),
              boundaries=[0, units, units + 1], sharding=sharding, optimizer="sgd")
    line = {k: (lambda n, a=a, b=b, k=k: (a / SYNC_UNITS * units if k.startswith("fsdp") else a) + n / b)
            for k, (a, b) in SYNC_LINES.items()}
    last_backward = units * 2e-3
    ddp = max(line["ddp"](grads) - last_backward, line["ddp"](min(grads, 25 * 2**20)))
    want = {"ddp": ddp, "zero1": ddp + line["zero1_broadcast"](grads),
            "fsdp": line["fsdp_reduce"](grads) + line["fsdp_gather"](grads)}[sharding]
    assert pl.stages[0].dp_sync_s == pytest.approx(want, rel=1e-9)
    assert pl.stages[1].dp_sync_s == 0.0  # no parameters, nothing to sync
    assert any("a sharding mode's own sync over 2 replicas" in n for n in pl.notes)
    again = Plan.from_json(json.loads(json.dumps(pl.to_json())))  # the fits travel in the plan's options
    assert again == pl


def test_the_modes_own_sync_prices_only_the_replica_count_it_was_timed_at() -> None:
    """Over another d, the modes' probe says nothing (their code around the collective does not scale as a
    ring): the sync is the all-reduce probe's ring, and the note says to measure at that d."""
    n = 2**20
    pl = plan(_grads_profile(n), 2, num_microbatches=4, data_parallel=4, link=_sync_link(2),
              boundaries=[0, 1, 2], sharding="ddp")
    ring = plan(_grads_profile(n), 2, num_microbatches=4, data_parallel=4, link=_dp_link(2),
                boundaries=[0, 1, 2], sharding="ddp")
    assert pl.stages[0].dp_sync_s == pytest.approx(ring.stages[0].dp_sync_s, rel=1e-12)
    assert any("timed the sharding modes' own sync over 2 replicas, not 4: measure it again with stageplan "
               "link --data-parallel 4" in x for x in pl.notes)


def test_a_bad_sharding_sync_probe_is_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _sync_link()
    assert load_link(good)["dp_sync_fit"]["fsdp_reduce"][0] == pytest.approx(8e-3 / SYNC_UNITS)
    for bad in ({"dp_sync_fit": {"ddp": [1e-3, 0.0]}}, {"dp_sync_fit": {"allgather": [1e-3, 1e9]}},
                {"dp_sync_fit": {"ddp": [-1.0, 1e9]}}, {"dp_sync_fit": [["ddp", 1e-3, 1e9]]},
                {"dp_sync_ranks": 1}, {"dp_sync_units": 0}):
        with pytest.raises(SchemaError, match=r"dp_sync_fit = .*; it must map ddp, zero1_broadcast, "
                                              r"fsdp_reduce or fsdp_gather to .* --data-parallel D$"):
            load_link({**good, **bad})
    many = {"dp_sync_many_units": 16, "dp_sync_many_size": 2**24, "dp_sync_many_s": {"fsdp_gather": 0.03}}
    assert load_link({**good, **many})["dp_sync_many_s"] == {"fsdp_gather": 0.03}
    for bad in ({"dp_sync_many_s": {"ddp": 0.03}}, {"dp_sync_many_s": {"fsdp_gather": -1.0}},
                {"dp_sync_many_s": [0.03]}, {"dp_sync_many_units": 1}, {"dp_sync_many_size": None}):
        with pytest.raises(SchemaError, match=r"dp_sync_many_s = .*; it must map fsdp_reduce or "
                                              r"fsdp_gather to seconds >= 0, with dp_sync_many_units .* "
                                              r"--data-parallel D$"):
            load_link({**good, **many, **bad})
    path = tmp_path / "link.json"
    path.write_text(json.dumps({**good, "dp_sync_fit": {"ddp": [1e-3, -5]}}))
    code, _, err = run_cli(["plan", str(GPT), "--stages", "2", "--data-parallel", "2", "--link", str(path)],
                           capsys)
    assert_one_line_error(code, err, r"dp_sync_fit = \{'ddp': \[0.001, -5\]\}; it must map")


def test_show_link_lists_each_modes_sync_measured_and_fitted() -> None:
    from stageplan.report import link_table

    link = _sync_link()
    link["dp_sync_s"]["fsdp_gather"][1] = 0.05  # off its line: shown beside the fit
    lines = link_table(link).splitlines()
    assert "each sharding mode's own sync over 2 replicas, a module of 4 units" in lines[-5]
    gather = next(x for x in lines if x.strip().startswith("fsdp_gather:"))
    fit_ms = (6e-3 + 2**20 / 5e8) * 1e3
    assert f"50.00 ({fit_ms:.2f}) at 1 MiB" in gather
    assert "units:" not in gather
    # FSDP2's kinds timed once more over 16 units: shown after the sizes, beside the fit at 16 units
    link.update(dp_sync_many_units=16, dp_sync_many_size=2**24, dp_sync_many_s={"fsdp_gather": 0.07})
    fixed, rate = link["dp_sync_fit"]["fsdp_gather"]
    gather = next(x for x in link_table(link).splitlines() if x.strip().startswith("fsdp_gather:"))
    assert gather.endswith(f"; 16 units: 70.00 ({(16 * fixed + 2**24 / rate) * 1e3:.2f}) at 16 MiB")
