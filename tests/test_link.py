"""The link between neighbouring ranks: the ping-pong (2 gloo ranks, slow), LINK.json, and plan --link priced
exactly as --bandwidth with the measured latency added per crossing; estimated profiles get their GPU's link."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest
from conftest import SCHEDULE_CASES, assert_one_line_error, run_cli, spawn_ranks

import stageplan.running.link
from stageplan import RunReport, StageplanError
from stageplan.errors import SchemaError
from stageplan.formats.link import LINK_SCHEMA, load_link
from stageplan.formats.plan import Plan
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.planning.planner import plan
from stageplan.report import plan_table

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


def test_docstring_examples() -> None:
    result = doctest.testmod(stageplan.running.link, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


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
    assert ("boundary latency 500.000 ms per crossing, the one-way latency measured by stageplan link (gloo, 0 pairs) in"
            in "\n".join(linked.notes))
    assert any(n.startswith("link bandwidth 0.001 GB/s one way prices the boundary bytes") for n in linked.notes)
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
    assert "750.000 ms per crossing, a fused send/receive exchange measured by stageplan link" in "\n".join(exchanged.notes)


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
    code, _, err = run_cli(["plan", str(prof), "--stages", "2", "--link", str(link), "--bandwidth", "1GB/s"], capsys)
    assert_one_line_error(code, err, r"--link and --bandwidth.*give one")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "stageplan.link/9", "latency_s": 1e-5, "bandwidth_bytes_per_s": 1e9}))
    code, _, err = run_cli(["plan", str(prof), "--stages", "2", "--link", str(bad)], capsys)
    assert_one_line_error(code, err, r"'stageplan.link/9'.*'stageplan.link/1'")
    neg = tmp_path / "neg.json"
    neg.write_text(json.dumps({"schema": LINK_SCHEMA, "latency_s": 1e-5, "bandwidth_bytes_per_s": 0}))
    code, _, err = run_cli(["plan", str(prof), "--stages", "2", "--link", str(neg)], capsys)
    assert_one_line_error(code, err, r"bandwidth_bytes_per_s > 0.*stageplan link")
    code, _, err = run_cli(["plan", str(prof), "--stages", "2", "--link", str(tmp_path / "missing.json")], capsys)
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
            load_link({"schema": "stageplan.link/1", "latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9, "exchange_s": bad})


def test_load_link_checks_the_figures() -> None:
    assert load_link({"schema": LINK_SCHEMA, "latency_s": 0, "bandwidth_bytes_per_s": 5})["latency_s"] == 0.0
    with pytest.raises(SchemaError, match=r"link lacks latency_s; measure it again with stageplan link"):
        load_link({"schema": LINK_SCHEMA, "bandwidth_bytes_per_s": 5})
    with pytest.raises(Exception, match=r"latency_s >= 0"):
        load_link({"schema": LINK_SCHEMA, "latency_s": -1, "bandwidth_bytes_per_s": 5})
    # true read as 1 s of latency, and a number where the pairs go broke the plan's note (len of an int)
    with pytest.raises(SchemaError, match=r"has latency_s = True and bandwidth_bytes_per_s = 5; both must be numbers"):
        load_link({"schema": LINK_SCHEMA, "latency_s": True, "bandwidth_bytes_per_s": 5})
    # the exception's text had stood where the field's name goes: "mangles field could not convert string to float"
    with pytest.raises(SchemaError, match=r"has latency_s = 0 and bandwidth_bytes_per_s = 'fast'; both must be "
                                          r"numbers \(seconds, bytes/s\)"):
        load_link({"schema": LINK_SCHEMA, "latency_s": 0, "bandwidth_bytes_per_s": "fast"})
    for field, value in (("pairs", 5), ("backend", 3)):
        with pytest.raises(SchemaError, match=rf"{field} = {value}\b.*; pairs must be a list and backend a name"):
            load_link({"schema": LINK_SCHEMA, "latency_s": 0, "bandwidth_bytes_per_s": 5, field: value})


@pytest.mark.parametrize(("gpu", "bandwidth", "name"), [("h100-sxm", 450e9, "NVLink"), ("mi300x", None, "xGMI")])
def test_estimated_profile_gets_its_gpus_link_within_a_node(gpu: str, bandwidth: float | None, name: str) -> None:
    table = json.loads((Path(stageplan.running.link.__file__).parents[1] / "gpus.json").read_text())
    row = table["gpus"][gpu]["intra_node"]
    bandwidth = bandwidth or float(row["bandwidth"])
    prof = _profile({"timer": "analytic", "estimate": {"gpu": gpu}})
    pl = plan(prof, 2, num_microbatches=4)
    assert pl.cost_options["bandwidth_bytes_per_s"] == bandwidth
    assert pl.stages[0].comm_s == pytest.approx(2 * OUT_BYTES / bandwidth)
    note = next(n for n in pl.notes if n.startswith("no link given"))
    assert name in note and row["source"] in note and f"{bandwidth / 1e9:.0f} GB/s" in note
    assert "InfiniBand" in note and table["inter_node_default"]["source"] in note
    assert not any("communication between stages is not modelled" in n for n in pl.notes)
    # a bandwidth or a link given replaces the default
    given = plan(prof, 2, num_microbatches=4, bandwidth="25GB/s")
    assert given.cost_options["bandwidth_bytes_per_s"] == 25e9 and not any("no link given" in n for n in given.notes)
    linked = plan(prof, 2, num_microbatches=4, link={"schema": LINK_SCHEMA, "latency_s": 1e-5, "bandwidth_bytes_per_s": 1e9})
    assert linked.cost_options["bandwidth_bytes_per_s"] == 1e9 and not any("no link given" in n for n in linked.notes)


def test_run_report_without_link_still_loads() -> None:
    data = {"schema": "stageplan.run/2", "measured_step_s": 1.0, "predicted_step_s": 1.0, "measured_step_iqr_s": 0.0,
            "samples_per_s": 1.0, "measured_bubble_fraction": 0.0, "predicted_bubble_fraction": 0.0,
            "ranks": [{"rank": 0, "stages": [0], "predicted_compute_s": 1.0, "measured_compute_s": 1.0,
                       "predicted_idle_s": 0.0, "measured_idle_s": 0.0, "predicted_peak_activation_bytes": 8,
                       "measured_peak_activation_bytes": 8}],
            "losses": [], "plan": {"boundaries": [0, 1], "num_ranks": 1, "num_microbatches": 1, "schedule": "GPipe"},
            "run_options": {}}
    old = RunReport.from_json(data)
    assert old.link is None
    linked = RunReport.from_json({**data, "link": {"latency_s": 1e-5}})
    assert linked.link == {"latency_s": 1e-5} and RunReport.from_json(linked.to_json()) == linked


# ------------------------------------------------------------------------------------------------ 2 gloo ranks


@pytest.mark.slow
def test_every_run_starts_with_a_ping_pong(tmp_path: Path) -> None:
    from stageplan.profiling.profiler import profile_model
    from stageplan.running.launch import run
    from stageplan.zoo import build_workload

    wl = build_workload("workloads:mlp", {})
    prof = profile_model(wl, microbatch_size=2, warmup=0, repeats=1, dedup=False)
    report = run("workloads:mlp", plan(prof, 2, num_microbatches=4), steps=1, warmup=0, timeout_s=120,
                 output=tmp_path / "run.json")
    link = report.link
    assert link is not None and link["backend"] == "gloo"
    assert link["latency_s"] > 0 and link["bandwidth_bytes_per_s"] > 0
    assert link["exchange_s"] > 0 and link["pairs"][0]["exchange_s"] == link["exchange_s"]  # one pair: its own figure
    assert link["sizes"][0] == 4096 and link["sizes"][-1] >= 4 * 2**20
    assert [p["ranks"] for p in link["pairs"]] == [[0, 1]]
    assert 0 < link["action_s"] < 1e-2  # torch's own loop between two chunk calls, timed by the schedule probe
    # the tied gradient's all-reduce, timed itself: 4 MiB takes longer than 4 KiB, and the ring constants give back
    # the fit through both sizes at the probe's 2 ranks
    small, large = link["allreduce_s"]
    assert link["allreduce_ranks"] == 2 and link["allreduce_sizes"] == [4096, 4 * 2**20] and 0 < small < large
    fixed, rate = 2 * link["allreduce_latency_s"], link["allreduce_bandwidth_bytes_per_s"]
    assert fixed == pytest.approx(small, rel=1e-12) and fixed + 4 * 2**20 / rate == pytest.approx(large, rel=1e-12)
    assert RunReport.load(tmp_path / "run.json").link == link


@pytest.mark.slow
def test_cli_link_writes_a_loadable_link(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "link.json"
    code, stdout, err = run_cli(["link", "--backend", "gloo", "--ranks", "2", "-o", str(out), "--timeout", "60"], capsys)
    assert code == 0, err
    link = load_link(out)
    assert json.loads(out.read_text())["schema"] == "stageplan.link/1"
    assert link["latency_s"] > 0 and link["bandwidth_bytes_per_s"] > 0 and link["num_ranks"] == 2
    pair = link["pairs"][0]
    assert pair["ranks"] == [0, 1] and len(pair["one_way_s"]) == len(link["sizes"]) == 2
    assert pair["one_way_s"][1] > pair["one_way_s"][0]  # 4 MiB takes longer than 4 KiB
    assert "latency" in stdout and f"wrote {out}" in stdout and "torch's schedule" in stdout
    assert "all-reduce" in stdout and " ms at 4096 KiB" in stdout
    # what it measured plans as a link
    pl = plan(_profile(), 2, num_microbatches=4, link=out)
    assert pl.cost_options["bandwidth_bytes_per_s"] == link["bandwidth_bytes_per_s"]
    assert pl.cost_options["allreduce_bandwidth_bytes_per_s"] == link["allreduce_bandwidth_bytes_per_s"]


@pytest.mark.slow
def test_a_rendezvous_port_taken_after_it_was_chosen_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process can take the free port between the launcher choosing it and rank 0 listening on it: that
    start fails with EADDRINUSE before any work, and the launcher starts again on a new port (a bounded number of
    times)."""
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


def _probe_in_child(rank: int, port: int, where: str, delay_s: float, queue) -> None:  # type: ignore[no-untyped-def]
    """One rank of the schedule probe; with ``delay_s``, a sleep of that long put into torch's code at ``where``:
    "loop", entering each action of the schedule's loop (outside the chunk calls); "forward" or "backward", inside
    each chunk's forward or backward call, just before PipelineStage runs the module (or its gradients)."""
    import contextlib
    import os
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.pipelining import PipelineStage

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if delay_s and where == "loop":
        real = schedules.record_function

        @contextlib.contextmanager
        def slow(name: str):  # type: ignore[no-untyped-def]
            time.sleep(delay_s)
            with real(name):
                yield

        schedules.record_function = slow
    elif delay_s:
        name = f"{where}_maybe_with_nosync"
        inner = getattr(PipelineStage, name)

        def slow_chunk(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            time.sleep(delay_s)
            return inner(self, *args, **kwargs)

        setattr(PipelineStage, name, slow_chunk)
    try:
        queue.put((rank, stageplan.running.link.schedule_overheads(torch.device("cpu"), evict_bytes=2**20)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(("where", "delay_s"), [("loop", 0.0), ("loop", 0.004), ("forward", 0.004), ("backward", 0.004)])
def test_the_schedule_probe_times_what_torch_spends_around_the_chunks_layers(where: str, delay_s: float) -> None:
    """Oracle: a known delay put into torch's own code shows up in the probe's figure for that place, and only
    there: in its loop between two chunk calls (``action_s``), or in PipelineStage inside each chunk's forward or
    backward call outside the module (``chunk_forward_s``, ``chunk_backward_s``); without it each stays well under
    a millisecond here."""
    got = {rank: values[0] for rank, values in spawn_ranks(_probe_in_child, 2, where, delay_s).items()}
    assert got[0] == got[1]  # every rank gets the same figures
    figures = got[0]
    assert set(figures) == {"action_s", "chunk_forward_s", "chunk_backward_s"}
    delayed = {"loop": "action_s", "forward": "chunk_forward_s", "backward": "chunk_backward_s"}[where] if delay_s else None
    for key, value in figures.items():
        if key == delayed:
            assert delay_s < value < delay_s + 3e-3, (key, value)
        else:
            assert 0 < value < 2e-3, (key, value)


def _ping_pong_in_child(rank: int, port: int, gap_s: float, queue) -> None:  # type: ignore[no-untyped-def]
    """One rank of the ping-pong, its work before each timed message (link._compute_gap) replaced by a sleep of
    ``gap_s`` that counts its calls."""
    import os
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    calls = [0]

    def gap(_: object) -> None:
        calls[0] += 1
        time.sleep(gap_s)

    stageplan.running.link._compute_gap = gap
    try:
        link = stageplan.running.link.ping_pong(torch.device("cpu"), sizes_bytes=(4096, 2**20), warmup=2, repeats=5)
        queue.put((rank, calls[0], link["latency_s"], link["exchange_s"]))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_timed_message_follows_the_ranks_own_work_outside_the_timer() -> None:
    """Back to back with the message before, a fused exchange between two pinned gloo ranks stalled 3.7-4.0 ms on
    one VM (0.16-0.33 ms after compute, as a chunk computes between receiving and sending), so the probe works
    before every timed message: once before each of the 60 small and 5 large round trips and each of the 2 + 60
    exchanges, on both ranks, and never inside the timer (a 5 ms gap would show in every figure)."""
    got = spawn_ranks(_ping_pong_in_child, 2, 0.005)
    small = stageplan.running.link.SMALL_REPEATS
    assert [got[r][0] for r in (0, 1)] == [small + 5 + 2 + small] * 2
    for _, latency, exchange in got.values():  # under 2 ms when the host is quiet; one busy run read 2.26 ms
        assert 0 < latency < 4.5e-3 and 0 < exchange < 4.5e-3, (latency, exchange)


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
        assert (st.forward_s, st.backward_s) == (was.forward_s, was.backward_s)  # what a run's chunk timers see
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


def _one_layer_per_chunk(seed: int, count: int, extra_f: float, extra_b: float
                         ) -> tuple[Profile, Profile, list[tuple[float, float, int]]]:
    """``count`` random layers (forward, backward, output bytes), and the same layers with ``extra_f`` seconds
    added to each forward and ``extra_b`` to each backward: the fold-into-layers oracles' pair."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = [(float(f), float(b), int(o))
            for f, b, o in zip(rng.lognormal(0, 1, count), rng.lognormal(0, 1, count), rng.integers(1, 100, count))]
    prof = Profile(tuple(LayerProfile(f"l{i}", f, b, 0, o, 0) for i, (f, b, o) in enumerate(rows)))
    folded = Profile(tuple(LayerProfile(f"l{i}", f + extra_f, b + extra_b, 0, o, 0) for i, (f, b, o) in enumerate(rows)))
    return prof, folded, rows


@pytest.mark.parametrize(("schedule", "p", "m", "v"), SCHEDULE_CASES)
def test_the_loops_time_prices_as_if_each_chunks_layer_took_it_longer(schedule: str, p: int, m: int, v: int) -> None:
    """Oracle: with one layer per chunk, the schedule's a seconds per action is the same plan as each layer's
    forward and backward a seconds longer (step, rank times, bottleneck; the lower bound too with one chunk per
    rank, where no rank runs two chunks' overhead)."""

    from stageplan.planning.costs import LayerArrays, evaluate, make_options

    S, a = p * v, 0.3
    prof, folded, _ = _one_layer_per_chunk(3, S, a, a)
    bounds = list(range(S + 1))
    kw = dict(num_microbatches=m, schedule=schedule, virtual_stages=v, optimizer="none", bandwidth_bytes_per_s=40.0,
              boundary_latency_s=0.25)
    ev = evaluate(LayerArrays.of(prof, m), bounds, make_options(prof, p, action_s=a, **kw))
    ref = evaluate(LayerArrays.of(folded, m), bounds, make_options(folded, p, **kw))
    assert ev.predicted_step_s == pytest.approx(ref.predicted_step_s, rel=1e-12)
    assert ev.rank_time_s == pytest.approx(ref.rank_time_s, rel=1e-12)
    assert ev.bottleneck_s == pytest.approx(ref.bottleneck_s, rel=1e-12)
    if v == 1:
        assert ev.lower_bound_s == pytest.approx(ref.lower_bound_s, rel=1e-12)
    # every rank runs v chunks, each a forward and a backward: the bound rises by 2 a v whatever the split
    plain = evaluate(LayerArrays.of(prof, m), bounds, make_options(prof, p, **kw))
    assert ev.lower_bound_s == pytest.approx(plain.lower_bound_s + 2 * a * v, rel=1e-12)
    with pytest.raises(StageplanError, match="time per action"):
        make_options(prof, p, action_s=-1.0, **kw)


@pytest.mark.parametrize(("schedule", "p", "m", "v"), SCHEDULE_CASES)
def test_the_chunks_overhead_prices_as_if_each_chunks_layer_took_it_longer(schedule: str, p: int, m: int, v: int) -> None:
    """Oracle: with one layer per chunk, PipelineStage's cF and cB seconds inside each chunk's forward and backward
    are the same plan as each layer's forward cF and backward cB seconds longer: the stages' forward and backward
    (what a run's chunk timers see), step, rank times, bottleneck; every rank's lower bound rises by (cF + cB) v.
    The split-search's prefix sums (SplitCosts) agree with evaluate, with the loop's action_s on top."""
    import numpy as np

    from stageplan.planning.costs import LayerArrays, evaluate, make_options
    from stageplan.planning.search import SplitCosts

    S, cf, cb, a = p * v, 0.15, 0.35, 0.05
    prof, folded, rows = _one_layer_per_chunk(5, S, cf, cb)
    bounds = list(range(S + 1))
    kw = dict(num_microbatches=m, schedule=schedule, virtual_stages=v, optimizer="none", bandwidth_bytes_per_s=40.0,
              boundary_latency_s=0.25, action_s=a)
    opts = make_options(prof, p, chunk_forward_s=cf, chunk_backward_s=cb, **kw)
    ev = evaluate(LayerArrays.of(prof, m), bounds, opts)
    ref = evaluate(LayerArrays.of(folded, m), bounds, make_options(folded, p, **kw))
    for st, want in zip(ev.stages, ref.stages):
        assert (st.forward_s, st.backward_s) == pytest.approx((want.forward_s, want.backward_s), rel=1e-12)
        assert st.chunk_s == pytest.approx(cf + cb) and want.chunk_s == 0.0
    assert ev.predicted_step_s == pytest.approx(ref.predicted_step_s, rel=1e-12)
    assert ev.rank_time_s == pytest.approx(ref.rank_time_s, rel=1e-12)
    assert ev.bottleneck_s == pytest.approx(ref.bottleneck_s, rel=1e-12)
    plain = evaluate(LayerArrays.of(prof, m), bounds, make_options(prof, p, **kw))
    assert ev.lower_bound_s == pytest.approx(plain.lower_bound_s + (cf + cb) * v, rel=1e-12)
    f, b, _, _ = SplitCosts(LayerArrays.of(prof, m), opts).split(np.array([bounds]))
    assert list(f[0]) == pytest.approx([st.forward_s + a for st in ev.stages], rel=1e-12)
    assert list(b[0]) == pytest.approx([st.backward_s + a for st in ev.stages], rel=1e-12)
    # recomputation runs the layers' forward again inside the backward, not PipelineStage's code around them
    rec = evaluate(LayerArrays.of(prof, m), bounds, make_options(prof, p, chunk_forward_s=cf, chunk_backward_s=cb,
                                                                 recompute=True, **kw))
    for st, (fl, bl, _) in zip(rec.stages, rows):
        assert st.backward_s == pytest.approx(float(fl) + float(bl) + cb, rel=1e-12)
    for bad in (-1.0, float("inf"), True):
        with pytest.raises(StageplanError, match="chunk's forward overhead"):
            make_options(prof, p, chunk_forward_s=bad, **kw)
        with pytest.raises(StageplanError, match="chunk's backward overhead"):
            make_options(prof, p, chunk_backward_s=bad, **kw)


def test_a_link_with_the_chunks_overhead_prices_it_inside_every_chunk(tmp_path: Path) -> None:
    """Closed form: GPipe, p = 2, m = 1, forward 1 s, backward 2 s, one layer per rank; PipelineStage's 0.1 s in
    each forward and 0.2 s in each backward lengthen the four actions on the critical path (F0, F1, B1, B0) by
    0.6 s, and each stage's forward, backward and time by 0.1, 0.2 and 0.3 s; a link without the figures says so."""
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
    assert any("100.000 ms inside each chunk's forward and 200.000 ms inside its backward" in n for n in timed.notes)
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
