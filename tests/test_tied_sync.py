"""Tied parameters: the profiler records which layers share a parameter, the cost model prices the gradient
all-reduce a split puts across ranks (ring all-reduce over all p ranks, before the optimizer step), the simulator
draws it as a collective "T" event, and the executor all-reduces only the ties that span ranks."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SCHEDULE_CASES, spawn_ranks

from stageplan.errors import SchemaError
from stageplan.formats.plan import Plan
from stageplan.formats.profile import LayerProfile, Profile, TiedParameter
from stageplan.planning.costs import Device, LayerArrays, evaluate, make_options
from stageplan.planning.planner import plan
from stageplan.planning.schedules import simulate
from stageplan.planning.search import SplitCosts
from stageplan.profiling.profiler import profile_model
from stageplan.report import plan_table
from stageplan.zoo import build_workload

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "profiles" / "cpu" / "gpt.json"
OLD_GPT = ROOT / "tests" / "data" / "old-format" / "gpt.json"  # written before tie records existed
BANDWIDTH = 1e9  # bytes/s
LATENCY = 2.5e-4  # s per message
TIE_BYTES = 3_000_000


def _ring(p: int, nbytes: float, bandwidth: float = BANDWIDTH, latency: float = LATENCY) -> float:
    """The oracle: a ring all-reduce over p ranks, 2(p-1)/p x bytes / bandwidth + 2(p-1) x latency."""
    return 2 * (p - 1) / p * nbytes / bandwidth + 2 * (p - 1) * latency


def _profile(n: int, tied: list[dict] | None, **layer: float) -> Profile:
    meta = {} if tied is None else {"tied": tied}
    rows = tuple(LayerProfile(f"l{i}", layer.get("f", 1.0), layer.get("b", 2.0), 0, 0, 4) for i in range(n))
    return Profile(rows, meta)


def _tie(*layers: int, nbytes: int = TIE_BYTES) -> dict:
    return {"names": ["emb.weight", "head.weight"], "layers": list(layers), "bytes": nbytes}


def _evaluate(prof: Profile, bounds: tuple[int, ...], p: int, **kw):  # type: ignore[no-untyped-def]
    kw = {"num_microbatches": 4, "optimizer": "none", "bandwidth_bytes_per_s": BANDWIDTH,
          "boundary_latency_s": LATENCY, "link_latency_s": LATENCY, **kw}
    return evaluate(LayerArrays.of(prof, kw["num_microbatches"]), bounds, make_options(prof, p, **kw))


# -- the cost model against the closed form -----------------------------------------------------------------------


def test_the_all_reduce_pays_the_links_latency_not_the_calibrated_crossing_delay() -> None:
    # calibrate's per-crossing delay is a catch-all for waits the model lacks; a collective pays the link's latency
    ev = _evaluate(_profile(4, [_tie(0, 3)]), (0, 2, 4), 2, boundary_latency_s=0.5, link_latency_s=0.0)
    assert ev.tied_sync_s == pytest.approx(_ring(2, TIE_BYTES, latency=0.0), rel=1e-12)


@pytest.mark.parametrize(("p", "bounds"), [(2, (0, 2, 4)), (3, (0, 1, 3, 4)), (4, (0, 1, 2, 3, 4))])
def test_a_link_that_timed_the_all_reduce_prices_the_tie_from_it(p: int, bounds: tuple[int, ...]) -> None:
    """The link probe times the collective itself (gloo's took 2-5x the ring model's point-to-point figure here):
    its fit a + n / B at 2 ranks, stored as the ring's constants, gives back a + n / B for 2 ranks and the ring at
    those constants for 3 and 4; the point-to-point bandwidth and latency still price the boundary bytes."""
    fixed, rate = 4e-4, 0.8e9  # the probe's fit at 2 ranks: 0.4 ms + bytes / 0.8 GB/s
    link = {"schema": "stageplan.link/1", "latency_s": LATENCY, "bandwidth_bytes_per_s": BANDWIDTH,
            "allreduce_latency_s": fixed / 2, "allreduce_bandwidth_bytes_per_s": rate, "allreduce_ranks": 2}
    prof = _profile(4, [_tie(0, 3)])
    pl = plan(prof, p, num_microbatches=4, optimizer="none", boundaries=list(bounds), link=link)
    want = fixed + TIE_BYTES / rate if p == 2 else _ring(p, TIE_BYTES, bandwidth=rate, latency=fixed / 2)
    assert [st.tied_sync_s for st in pl.stages] == pytest.approx([want] * p, rel=1e-12)
    assert pl.cost_options["allreduce_bandwidth_bytes_per_s"] == rate
    assert any("priced from the link's own all-reduce (0.400 ms + bytes / 0.8 GB/s at 2 ranks" in n for n in pl.notes)
    plain = plan(prof, p, num_microbatches=4, optimizer="none", boundaries=list(bounds),
                 link={k: v for k, v in link.items() if not k.startswith("allreduce")})
    assert [st.tied_sync_s for st in plain.stages] == pytest.approx([_ring(p, TIE_BYTES)] * p, rel=1e-12)
    assert [st.comm_s for st in plain.stages] == [st.comm_s for st in pl.stages]  # boundaries priced alike


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
    link.write_text(json.dumps({"schema": "stageplan.link/1", "latency_s": LATENCY, "bandwidth_bytes_per_s": BANDWIDTH,
                                "allreduce_latency_s": 1e-4, "allreduce_bandwidth_bytes_per_s": 1e9,
                                "allreduce_ranks": 1}))
    code, _, err = run_cli(["plan", str(GPT), "--stages", "2", "--link", str(link)], capsys)
    assert_one_line_error(code, err, "allreduce_ranks = 1; .* integer >= 2")


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
@pytest.mark.parametrize(("p", "bounds"), [(2, (0, 2, 4)), (3, (0, 1, 3, 4)), (4, (0, 1, 2, 3, 4))])
def test_a_tie_across_ranks_adds_one_ring_all_reduce_to_the_step(schedule: str, p: int, bounds: tuple[int, ...]) -> None:
    plain = _evaluate(_profile(4, None), bounds, p, schedule=schedule)
    tied = _evaluate(_profile(4, [_tie(0, 3)]), bounds, p, schedule=schedule)
    assert tied.tied_sync_s == pytest.approx(_ring(p, TIE_BYTES), rel=1e-12)
    assert tied.predicted_step_s - plain.predicted_step_s == pytest.approx(_ring(p, TIE_BYTES), rel=1e-9)
    assert plain.tied_sync_s == 0.0
    # once per step, per rank: held by each rank's (first) stage, never in the per-microbatch time the solver balances
    assert [st.tied_sync_s for st in tied.stages] == pytest.approx([_ring(p, TIE_BYTES)] * p, rel=1e-12)
    assert [st.time_s for st in tied.stages] == [st.time_s for st in plain.stages]
    assert tied.bottleneck_s == plain.bottleneck_s


def test_each_tie_across_ranks_is_its_own_all_reduce_and_a_tie_inside_one_layer_is_free() -> None:
    ties = [_tie(0, 3), _tie(1, 3, nbytes=1000), _tie(2, nbytes=10**9)]  # the last one is used by one layer only
    ev = _evaluate(_profile(4, ties), (0, 2, 4), 2)
    assert ev.tied_sync_s == pytest.approx(_ring(2, TIE_BYTES) + _ring(2, 1000), rel=1e-12)


def test_a_tie_kept_on_one_rank_costs_nothing() -> None:
    plain = _evaluate(_profile(3, None), (0, 2, 3), 2)
    inside = _evaluate(_profile(3, [_tie(0, 1)]), (0, 2, 3), 2)
    assert inside.tied_sync_s == 0.0 and inside.predicted_step_s == plain.predicted_step_s
    assert [st.tied_sync_s for st in inside.stages] == [0.0, 0.0]
    across = _evaluate(_profile(3, [_tie(0, 1)]), (0, 1, 3), 2)  # the same tie, split between its layers
    assert across.tied_sync_s == pytest.approx(_ring(2, TIE_BYTES), rel=1e-12)


def test_virtual_stages_map_chunks_to_ranks() -> None:
    # 2 ranks x 2 chunks, one layer each. ZBV: rank 0 holds chunks 0 and 3, so the first and last layer share it;
    # Interleaved1F1B: chunk k on rank k % 2, so they do not.
    prof = _profile(4, [_tie(0, 3)])
    zbv = _evaluate(prof, (0, 1, 2, 3, 4), 2, schedule="ZBVZeroBubble", virtual_stages=2)
    assert zbv.tied_sync_s == 0.0
    inter = _evaluate(prof, (0, 1, 2, 3, 4), 2, schedule="Interleaved1F1B", virtual_stages=2)
    assert inter.tied_sync_s == pytest.approx(_ring(2, TIE_BYTES), rel=1e-12)
    assert [st.tied_sync_s > 0 for st in inter.stages] == [True, True, False, False]  # each rank's first chunk


def test_without_bandwidth_the_sync_is_not_priced_and_the_note_says_so() -> None:
    note = "tied parameter(s) this split puts on two or more ranks"
    prof = _profile(4, [_tie(0, 3)])
    for latency in (0.0, LATENCY):
        ev = _evaluate(prof, (0, 2, 4), 2, bandwidth_bytes_per_s=None, boundary_latency_s=latency)
        assert ev.tied_sync_s == 0.0
        assert any(note in n and "is not modelled (tied_sync_s = 0)" in n for n in ev.notes), ev.notes
    inside = _evaluate(_profile(4, [_tie(0, 1)]), (0, 2, 4), 2, bandwidth_bytes_per_s=None)
    assert not any(note in n for n in inside.notes)
    assert not any(note in n for n in _evaluate(prof, (0, 2, 4), 2).notes)  # priced: no note


@pytest.mark.parametrize(("schedule", "p", "m", "v"), SCHEDULE_CASES)
def test_split_costs_price_the_tied_sync_as_evaluate_does(schedule: str, p: int, m: int, v: int) -> None:
    rng = np.random.default_rng(5)
    n = 11
    layers = tuple(LayerProfile(f"l{i}", float(a), float(b), 0, 1, 4, optimizer_s={"adam": float(o)})
                   for i, (a, b, o) in enumerate(zip(rng.lognormal(0, 1, n), rng.lognormal(0, 1, n), rng.lognormal(0, 1, n))))
    prof = Profile(layers, {"tied": [_tie(0, n - 1, nbytes=40), _tie(2, 3, 7, nbytes=15)]})
    opts = make_options(prof, p, num_microbatches=m, schedule=schedule, virtual_stages=v, bandwidth_bytes_per_s=10.0,
                        boundary_latency_s=0.25, link_latency_s=0.25, devices=[Device(speed=1.0 + r) for r in range(p)])
    arr = LayerArrays.of(prof, m)
    costs = SplitCosts(arr, opts)
    splits = np.array([[0, *sorted(rng.choice(np.arange(1, n), opts.num_chunks - 1, replace=False)), n]
                       for _ in range(16)])
    f, b, c, _ = costs.split(splits)
    steps, tied = costs.split_steps(splits, f, b, c), costs.tied_sync(splits)
    assert tied.max() > 0
    for row, cuts in enumerate(splits):
        ev = evaluate(arr, cuts, opts)
        assert steps[row] == pytest.approx(ev.predicted_step_s, rel=1e-12, abs=0)
        assert tied[row] == ev.tied_sync_s


# -- the simulator ------------------------------------------------------------------------------------------------


def test_the_sync_is_a_collective_after_the_last_backward_and_before_each_optimizer_step() -> None:
    # 1F1B, equal stages: rank r ends its last backward at (m + p - 1)(f + b) - r b, rank 0 last; the all-reduce
    # starts there on every rank and each rank's optimizer step follows it.
    p, m, f, b, t = 4, 8, 1.0, 2.0, 0.75
    o = [0.5, 1.0, 0.0, 2.0]
    sim = simulate("1F1B", [f] * p, [b] * p, m, optimizer_s=o, tied_sync_s=t)
    begin = (m + p - 1) * (f + b)
    sync = {e.rank: e for e in sim.timeline if e.kind == "T"}
    assert sorted(sync) == list(range(p))
    for r, e in sync.items():
        assert (e.start_s, e.end_s, e.microbatch, e.stage) == pytest.approx((begin, begin + t, -1, r))
    for e in (e for e in sim.timeline if e.kind == "O"):
        assert (e.start_s, e.end_s) == pytest.approx((begin + t, begin + t + o[e.rank]))
    assert sim.step_s == pytest.approx(begin + t + max(o))
    assert sim.busy_s == pytest.approx([m * (f + b) + t + x for x in o])  # the all-reduce is busy time
    assert not [e for e in simulate("1F1B", [f] * p, [b] * p, m).timeline if e.kind == "T"]


def test_the_plan_timeline_holds_one_sync_per_rank_of_the_priced_length() -> None:
    prof = _profile(6, [_tie(0, 5)])
    for schedule, p, v in (("1F1B", 3, 1), ("Interleaved1F1B", 2, 2)):
        pl = plan(prof, p, num_microbatches=2 * p, schedule=schedule, virtual_stages=v, bandwidth=BANDWIDTH, optimizer="none")
        sim = pl.simulate()
        sync = sorted((e.rank, e.end_s - e.start_s) for e in sim.timeline if e.kind == "T")
        assert sync == [(r, pytest.approx(_ring(p, TIE_BYTES, latency=0.0), rel=1e-9)) for r in range(p)]
        assert pl.tied_sync_s == pytest.approx(_ring(p, TIE_BYTES, latency=0.0), rel=1e-12)
        assert sim.step_s == pytest.approx(pl.predicted_step_s, rel=1e-12)


def test_the_timeline_draws_the_sync_with_its_own_colour_and_legend() -> None:
    import matplotlib

    matplotlib.use("Agg")
    from stageplan.plots import COLORS, plot_timeline

    ax = plot_timeline(simulate("1F1B", [1.0] * 2, [2.0] * 2, 4, optimizer_s=[0.5, 0.5], tied_sync_s=0.25))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "backward", "tied sync", "optimizer", "idle"]
    assert COLORS["T"] not in {COLORS[k] for k in ("F", "B", "I", "W", "O", "idle")}


def test_a_bad_sync_time_is_refused() -> None:
    with pytest.raises(ValueError, match=r"tied_sync_s must be finite and >= 0 seconds, got -1.0; fix the profile"):
        simulate("1F1B", [1.0, 1.0], [1.0, 1.0], 2, tied_sync_s=-1.0)


# -- profiles and plans on disk -----------------------------------------------------------------------------------


def test_an_old_profile_without_ties_still_plans_as_a_model_without_ties() -> None:
    data = json.loads(OLD_GPT.read_text())
    assert "tied" not in data["meta"]
    old = Profile.from_json(data)
    assert old.tied == ()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl = plan(old, 2, num_microbatches=4, bandwidth=BANDWIDTH)
    assert pl.tied_sync_s == 0.0 and all(st.tied_sync_s == 0.0 for st in pl.stages)
    assert not [e for e in pl.simulate().timeline if e.kind == "T"]
    assert "tied sync" not in plan_table(pl)
    # an empty record is no tie: the same digest, so plans made from the old file still match it
    assert Profile(old.layers, {**old.meta, "tied": []}).digest() == old.digest()
    assert Profile(old.layers, {**old.meta, "tied": [_tie(0, len(old) - 1)]}).digest() != old.digest()


def test_plan_json_keeps_the_sync_and_old_plans_load() -> None:
    pl = plan(_profile(4, [_tie(0, 3)]), 2, num_microbatches=4, bandwidth=BANDWIDTH, optimizer="none")
    assert pl.tied_sync_s > 0
    again = Plan.from_json(json.loads(json.dumps(pl.to_json())))
    assert again == pl and again.tied_sync_s == pl.tied_sync_s
    data = pl.to_json()
    assert data["schema"] == "stageplan.plan/2"
    for st in data["stages"]:
        del st["tied_sync_s"]
    assert Plan.from_json(data).tied_sync_s == 0.0
    table = plan_table(pl)
    assert "tied sync ms" in table and "tied-gradient all-reduce" in table


def test_bad_tie_records_are_refused() -> None:
    data = _profile(4, None).to_json()
    for bad in ([{"names": ["a"], "layers": [0, 1], "bytes": 4}], [{"names": ["a", "b"], "layers": [3, 0], "bytes": 4}],
                [{"names": ["a", "b"], "layers": [0, 4], "bytes": 4}], [{"names": ["a", "b"], "layers": [0], "bytes": -1}]):
        data["meta"]["tied"] = bad
        with pytest.raises(SchemaError, match=r"meta 'tied' must be a list of \{\"names\": \[two or more FQNs\], "
                                              r"\"layers\": \[sorted distinct layer indices below 4\].*entry 0 is .*; "
                                              r"re-profile the model"):
            Profile.from_json(data)
    data["meta"]["tied"] = {"names": []}
    with pytest.raises(SchemaError, match=r"got dict; re-profile the model"):
        Profile.from_json(data)


# -- the profiler -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True])
def test_the_profiler_records_the_tied_embedding_and_head(streaming: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # two tiny identical blocks timed once each on a shared machine
        wl = build_workload("gpt", {"tied": True, "n_layer": 2})
        prof = profile_model(wl, microbatch_size=2, warmup=0, repeats=1, streaming=streaming)
        untied = profile_model(build_workload("gpt", {"n_layer": 2}), microbatch_size=2, warmup=0, repeats=1,
                               streaming=streaming)
    assert prof.names[0] == "tok_emb+pos_emb" and prof.names[-1] == "ln_f+head"
    assert prof.tied == (TiedParameter(("tok_emb.weight", "head.weight"), (0, len(prof) - 1), 8192 * 128 * 4),)
    assert untied.meta["tied"] == [] and untied.tied == ()
    assert Profile.from_json(json.loads(json.dumps(prof.to_json()))).tied == prof.tied


def test_the_estimate_records_ties_in_the_profiled_dtype() -> None:
    wl = build_workload("gpt", {"tied": True, "n_layer": 2})
    prof = profile_model(wl, microbatch_size=2, device="estimate:h100-sxm", dtype="bfloat16")
    assert [(t.layers, t.bytes) for t in prof.tied] == [((0, len(prof) - 1), 8192 * 128 * 2)]


# -- the executor -------------------------------------------------------------------------------------------------


def _plan_for_tied_blocks(tie_with: int) -> Plan:
    """2 ranks x 2 chunks: block 0 in chunk 0 (rank 0), block 2 in chunk 2 (rank 0 again), block 4 in chunk 3
    (rank 1). Tied with block 2, the two copies sit on one rank; with block 4, on two."""
    wl = build_workload("workloads:tied_blocks", {"tie_with": tie_with})
    prof = profile_model(wl, microbatch_size=2, warmup=0, repeats=1, streaming=False, dedup=False)
    assert [t.layers for t in prof.tied] == [(0, tie_with)]
    return plan(prof, 2, num_microbatches=4, schedule="Interleaved1F1B", virtual_stages=2, boundaries=(0, 1, 2, 4, 5),
                bandwidth=BANDWIDTH, optimizer="adamw")


@pytest.mark.parametrize(("tie_with", "across"), [(2, False), (4, True)])
def test_the_executor_knows_which_ties_span_ranks(tie_with: int, across: bool) -> None:
    from stageplan.layers import cut_stages
    from stageplan.materialize import meta_copy
    from stageplan.running.stages import tie_groups, ties_across_ranks

    pl = _plan_for_tied_blocks(tie_with)
    assert (pl.tied_sync_s > 0) == across
    model = meta_copy(build_workload("workloads:tied_blocks", {"tie_with": tie_with}).model)
    ties = tie_groups(model)
    cut = cut_stages(model, (torch.zeros(2, 16),), pl.layer_names, pl.boundaries, pl.profile_meta.get("layers_arg"))
    assert ties_across_ranks(ties, cut, pl) == [across]


def test_a_tie_on_one_rank_is_summed_there_without_communication() -> None:
    """No process group exists here: an all-reduce would raise. Two copies on this rank are summed; one copy of a
    tie no other rank holds is left alone."""
    from stageplan.running.stages import sync_tied_grads

    shared = torch.nn.Parameter(torch.zeros(2))
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    sync_tied_grads([(["x.weight", "y.weight"], shared)], {"x.weight": a, "y.weight": b}, torch.device("cpu"),
                    across=[False])
    assert torch.equal(a.grad, torch.tensor([11.0, 22.0])) and torch.equal(b.grad, a.grad)
    sync_tied_grads([(["x.weight", "y.weight"], shared)], {"x.weight": a}, torch.device("cpu"), across=[False])
    assert torch.equal(a.grad, torch.tensor([11.0, 22.0]))


def _sum_a_tie_in_child(rank: int, port: int, queue) -> None:  # type: ignore[no-untyped-def]
    """One of three ranks summing a tie's gradient: rank 0 holds one copy, rank 1 two (two chunks), rank 2 none."""
    import os

    import torch.distributed as dist

    from stageplan.running.stages import sync_tied_grads

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    try:
        held = {name: torch.nn.Parameter(torch.zeros(2)) for name in [["w"], ["w", "v"], []][rank]}
        for k, p in enumerate(held.values()):
            p.grad = torch.tensor([1.0, 2.0]) * 10 ** (rank + k)
        grads = [p.grad for p in held.values()]
        sync_tied_grads([(["w", "v"], torch.zeros(2))], held, torch.device("cpu"), across=[True])
        queue.put((rank, [p.grad.tolist() for p in held.values()], [p.grad is g for p, g in zip(held.values(), grads)]))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_tie_across_ranks_is_summed_over_every_copy_and_one_copy_in_place() -> None:
    """Oracle: the copies' gradients 1, 10 and 100 x [1, 2] sum to [111, 222] on every copy. A rank's one copy is
    summed in place (its gradient tensor kept: no buffer, no sum into it, no copy back, which had made HF GPT-2's 4
    MiB sum 4.06 ms against 2.92 ms in place, medians of 8 runs); two copies on a rank are summed there first."""
    got = spawn_ranks(_sum_a_tie_in_child, 3)
    assert got[0][0] == [[111.0, 222.0]] and got[1][0] == [[111.0, 222.0]] * 2 and got[2][0] == []
    assert got[0][1] == [True] and got[1][1] == [False, False]  # in place where the rank holds one copy


@pytest.mark.slow
@pytest.mark.parametrize("tie_with", [2, 4])
def test_pipeline_training_with_a_tie_on_one_or_two_ranks_equals_one_process(tie_with: int, tmp_path: Path) -> None:
    """On one rank the two copies' gradients are summed there (no all-reduce); on two, across the ranks."""
    from stageplan.running.launch import run

    report = run("workloads:tied_blocks", _plan_for_tied_blocks(tie_with), factory_options={"tie_with": tie_with}, steps=2,
                 warmup=1, check=True, optimizer="adamw", output=tmp_path / "run.json")
    assert report.check is not None and report.check["passed"], report.check
    # the sum is timed apart from the optimizer step (within what follows the schedule) and set beside its price
    from stageplan.report import run_table

    pl = _plan_for_tied_blocks(tie_with)
    # the oracle is the run's own ping-pong (one message, one way; ~0.2 ms here): across ranks the sum is a ring
    # all-reduce, 2(p - 1) = 2 messages at least on each rank (measured 1.6-2.6 ms); on one rank no message is sent,
    # and rank 1, which holds no copy, has nothing to sum (measured ~0.01 ms)
    link_latency = report.link["latency_s"]
    # the probe ran seconds before the sum: under make test's load it once read 0.67 ms one way, and the sum 0.49 ms;
    # quiet, it reads 60-110 us here, so two messages take at least twice the smaller of the two (a sum that sends
    # nothing takes ~0.01 ms)
    messages_floor = 2 * min(link_latency, 1e-4)
    for row in report.ranks:
        assert 0 < row["measured_tied_sync_s"] < row["optimizer_s"]  # adamw's own step follows the sum
        # and is timed on its own: what follows the schedule, less the sum (each a median over the steps)
        assert 0 < row["measured_optimizer_step_s"] < row["optimizer_s"]
        assert row["predicted_optimizer_step_s"] > 0  # the run's plan priced adamw from its profile
        if tie_with == 4:
            assert row["measured_tied_sync_s"] >= messages_floor, (row, link_latency)
        priced = sum(st.tied_sync_s for st in pl.stages if st.rank == row["rank"])
        assert row["predicted_tied_sync_s"] == pytest.approx(priced, rel=1e-9) and (priced > 0) == (tie_with == 4)
    if tie_with == 2:
        rank1 = next(row for row in report.ranks if row["rank"] == 1)
        assert rank1["measured_tied_sync_s"] < link_latency, (rank1, link_latency)
    assert ("tied gradients' all-reduce" in run_table(report)) == (tie_with == 4)  # shown where one is priced
    # the measured timeline (last step) holds the step's tail as the simulator draws it: per rank, after its last
    # forward or backward, the tied all-reduce ("T", only where the tie spans ranks) and then the optimizer step ("O")
    slack = 1e-3  # the tail is placed from perf_counter offsets, the chunk calls from their own time.time() starts
    for rank in range(2):
        mine = [e for e in report.timeline if e["rank"] == rank]
        work_end = max(e["end_s"] for e in mine if e["kind"] in ("F", "B", "W"))
        tail = {e["kind"]: e for e in mine if e["kind"] in ("T", "O")}
        assert set(tail) == ({"T", "O"} if tie_with == 4 else {"O"}), (rank, tail)
        assert all(e["microbatch"] == -1 and e["end_s"] > e["start_s"] >= work_end - slack for e in tail.values())
        if "T" in tail:
            assert tail["T"]["end_s"] <= tail["O"]["start_s"] + slack
    assert max(e["end_s"] for e in report.timeline) == max(e["end_s"] for e in report.timeline if e["kind"] == "O")
    assert "optimizer step (ms per step, after the tied sum" in run_table(report)
