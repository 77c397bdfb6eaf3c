"""The link between neighbouring ranks: the ping-pong (2 gloo ranks, slow), LINK.json, and plan --link priced
exactly as --bandwidth with the measured latency added per crossing; estimated profiles get their GPU's link."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli

import stageplan.link
from stageplan import RunReport, StageplanError
from stageplan.api import plan
from stageplan.link import LINK_SCHEMA, load_link
from stageplan.profile import LayerProfile, Profile

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
    result = doctest.testmod(stageplan.link, optionflags=doctest.ELLIPSIS)
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
    with pytest.raises(Exception, match=r"missing or mangles field 'latency_s'"):
        load_link({"schema": LINK_SCHEMA, "bandwidth_bytes_per_s": 5})
    with pytest.raises(Exception, match=r"latency_s >= 0"):
        load_link({"schema": LINK_SCHEMA, "latency_s": -1, "bandwidth_bytes_per_s": 5})


@pytest.mark.parametrize(("gpu", "bandwidth", "name"), [("h100-sxm", 450e9, "NVLink"), ("mi300x", None, "xGMI")])
def test_estimated_profile_gets_its_gpus_link_within_a_node(gpu: str, bandwidth: float | None, name: str) -> None:
    table = json.loads((Path(stageplan.link.__file__).parent / "gpus.json").read_text())
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
            "samples_per_s": 1.0, "measured_bubble_fraction": 0.0, "predicted_bubble_fraction": 0.0, "ranks": [],
            "losses": [], "plan": {}, "run_options": {}}
    old = RunReport.from_json(data)
    assert old.link is None
    linked = RunReport.from_json({**data, "link": {"latency_s": 1e-5}})
    assert linked.link == {"latency_s": 1e-5} and RunReport.from_json(linked.to_json()) == linked


# ------------------------------------------------------------------------------------------------ 2 gloo ranks


@pytest.mark.slow
def test_every_run_starts_with_a_ping_pong(tmp_path: Path) -> None:
    from stageplan.launch import run
    from stageplan.profiler import profile_model
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
    assert "latency" in stdout and f"wrote {out}" in stdout
    # what it measured plans as a link
    pl = plan(_profile(), 2, num_microbatches=4, link=out)
    assert pl.cost_options["bandwidth_bytes_per_s"] == link["bandwidth_bytes_per_s"]


@pytest.mark.slow
def test_a_rendezvous_port_taken_after_it_was_chosen_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process can take the free port between the launcher choosing it and rank 0 listening on it: that
    start fails with EADDRINUSE before any work, and the launcher starts again on a new port (a bounded number of
    times)."""
    import socket

    from stageplan import RunError, launch

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
