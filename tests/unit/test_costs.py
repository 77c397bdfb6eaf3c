"""stageplan.planning.costs: evaluate(layers, boundaries, options) against closed forms: the optimizer step,
the tied parameters' all-reduce, the schedule's per-chunk overheads, and make_options' limit on a step's
size."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import SCHEDULE_CASES, assert_one_line_error, run_cli

from stageplan import LayerProfile, Profile, StageplanError
from stageplan.errors import SchemaError
from stageplan.formats.plan import Plan
from stageplan.planning.costs import Device, LayerArrays, evaluate, make_options, ring_allreduce_time
from stageplan.planning.planner import plan
from stageplan.planning.search import SplitCosts
from stageplan.report import plan_table

from .test_planner import NOTE

GPT = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu" / "gpt.json")


def test_a_step_past_the_simulators_limit_is_refused_at_once(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """--microbatches 100000000 (a slip of the finger) had planned for hours: a step's microbatches x stages
    is at most costmodel.MAX_STEP_PAIRS, and the line gives the most microbatches these stages take. The
    limit is lowered to 24,000 pairs for the accepted edge cases (building options for the real limit's
    125,000 microbatches takes seconds); the CLI's refusal runs at the real one."""
    from stageplan import Profile
    from stageplan.errors import StageplanError
    from stageplan.planning import costs

    prof = Profile.load(GPT)
    monkeypatch.setattr(costs, "MAX_STEP_PAIRS", 24_000)
    most = 24_000 // 8
    assert costs.make_options(prof, 4, num_microbatches=most,
                              schedule="Interleaved1F1B").num_microbatches == most
    with pytest.raises(StageplanError,
                       match=rf"got {most + 1:,} x 8 = {8 * most + 8:,}; use --microbatches {most} "):
        costs.make_options(prof, 4, num_microbatches=most + 1, schedule="Interleaved1F1B")
    # 3 ranks x 2 chunks: 4,000 would not divide into
    # Interleaved1F1B's rounds; the line gives a multiple of 3
    with pytest.raises(StageplanError, match=r"use --microbatches 3999 or fewer"):
        costs.make_options(prof, 3, num_microbatches=10**6, schedule="Interleaved1F1B")
    assert costs.make_options(prof, 3, num_microbatches=3999,
                              schedule="Interleaved1F1B").num_microbatches == 3999
    monkeypatch.undo()
    assert costs.MAX_STEP_PAIRS == 1_000_000
    code, _, err = run_cli(["plan", GPT, "--stages", "2", "--microbatches", "100000000"], capsys)
    assert_one_line_error(code, err, r"a step's timeline is at most 1,000,000 forward/backward pairs "
                                     r"\(microbatches x stages\), got 100,000,000 x 2 = 200,000,000; use "
                                     r"--microbatches 500000 or fewer")


@pytest.mark.parametrize(("schedule", "p", "m", "v"), SCHEDULE_CASES)
def test_the_steps_fixed_cost_is_paid_once_per_rank(schedule: str, p: int, m: int, v: int) -> None:
    """With the profile's per-step floor, a stage's optimizer time is its layers' times less the floor each
    (not below 0; untrained layers 0) and the floor once on the rank's first chunk, where the rank steps
    anything: the closed form, and the vectorised replay agreeing with evaluate."""
    rng = np.random.default_rng(5)
    n = 13
    raw = rng.lognormal(0, 1, n)
    raw[[2, 3, 11, 12]] = 0.0  # no parameters
    raw[5] = 0.05  # below the floor: its net is 0, but its rank still steps
    layers = tuple(LayerProfile(f"l{i}", 1.0 + i % 3, 2.0, 0, 1, 4,
                                optimizer_s={"adam": float(o), "sgd": float(o) / 3})
                   for i, o in enumerate(raw))
    floor = {"adam": 0.2, "sgd": 0.1}
    prof = Profile(layers, {"optimizer_step": {"floor_s": floor}})
    devices = [Device(speed=1.0 + r) for r in range(p)]
    for optimizer in ("adam", "sgd"):
        opts = make_options(prof, p, num_microbatches=m, schedule=schedule, virtual_stages=v,
                            optimizer=optimizer, devices=devices)
        arr = LayerArrays.of(prof, m)
        costs = SplitCosts(arr, opts)
        # and one split whose rank 1 holds only layers without parameters (2-3 and 11-12): it steps nothing
        bare = {2: [0, 11, n], 3: [0, 2, 4, n], 4: [0, 2, 4, 11, n]}[opts.num_chunks]
        splits = np.array([[0, *sorted(rng.choice(np.arange(1, n), opts.num_chunks - 1, replace=False)), n]
                           for _ in range(10)] + [bare])
        f, b, c, _ = costs.split(splits)
        steps = costs.steps(f, b, c, costs.optimizer(splits))
        by_chunk = costs.optimizer(splits)
        for row, cuts in enumerate(splits):
            ev = evaluate(arr, cuts, opts)
            assert steps[row] == pytest.approx(ev.predicted_step_s, rel=1e-12, abs=0)
            want = []
            for st in ev.stages:
                own = [layers[k].optimizer_s[optimizer] for k in range(st.first_layer, st.end_layer)]  # type: ignore[index]
                net = sum(max(x - floor[optimizer], 0.0) for x in own if x > 0)
                mine = [t for t in ev.stages if t.rank == st.rank]
                steps_any = any(layers[k].optimizer_s[optimizer] > 0  # type: ignore[index]
                                for t in mine for k in range(t.first_layer, t.end_layer))
                once = floor[optimizer] if st is mine[0] and steps_any else 0.0
                want.append((net + once) / devices[st.rank].speed)
            assert [st.optimizer_s for st in ev.stages] == pytest.approx(want, rel=1e-12, abs=1e-15)
            assert by_chunk[row] == pytest.approx(want, rel=1e-12, abs=1e-15)
        last = evaluate(arr, splits[-1], opts)
        if schedule != "ZBVZeroBubble":  # its V gives rank 1 the middle chunks, one of them with parameters
            assert [st.optimizer_s for st in last.stages if st.rank == 1] == [0.0] * (opts.num_chunks // p)


def test_evaluate_adds_the_optimizer_step_to_the_step_not_to_the_stage_time() -> None:
    base = [LayerProfile(f"l{i}", 1.0, 2.0, 0, 0, 4) for i in range(4)]
    opt = [LayerProfile(x.name, 1.0, 2.0, 0, 0, 4, optimizer_s={"adam": 0.5, "sgd": 0.1}) for x in base]
    for layers, o in ((base, 0.0), (opt, 1.0)):  # two layers per stage: 2 x 0.5 s of adam per rank
        prof = Profile(tuple(layers))
        ev = evaluate(LayerArrays.of(prof, 4), (0, 2, 4), make_options(prof, 2, num_microbatches=4))
        assert [st.time_s for st in ev.stages] == [6.0, 6.0] and ev.bottleneck_s == 6.0
        assert [st.optimizer_s for st in ev.stages] == [o, o]
        assert ev.predicted_step_s == pytest.approx((4 + 2 - 1) * 6.0 + o)
        assert (NOTE in ev.notes) == (layers is base)
    prof = Profile(tuple(base))  # optimizer "none": nothing to measure, no note
    assert NOTE not in evaluate(LayerArrays.of(prof), (0, 2, 4), make_options(prof, 2, num_microbatches=4,
                                                                             optimizer="none")).notes


ROOT = Path(__file__).resolve().parents[2]


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


def test_the_all_reduce_pays_the_links_latency_not_the_calibrated_crossing_delay() -> None:
    # calibrate's per-crossing delay is a catch-all for waits
    # the model lacks; a collective pays the link's latency
    ev = _evaluate(_profile(4, [_tie(0, 3)]), (0, 2, 4), 2, boundary_latency_s=0.5, link_latency_s=0.0)
    assert ev.tied_sync_s == pytest.approx(_ring(2, TIE_BYTES, latency=0.0), rel=1e-12)


@pytest.mark.parametrize(("p", "bounds"), [(2, (0, 2, 4)), (3, (0, 1, 3, 4)), (4, (0, 1, 2, 3, 4))])
def test_a_link_that_timed_the_all_reduce_prices_the_tie_from_it(p: int, bounds: tuple[int, ...]) -> None:
    """The link probe times the collective itself (gloo's took 2-5x the ring model's point-to-point figure
    here): its fit a + n / B at 2 ranks, stored as the ring's constants, gives back a + n / B for 2 ranks and
    the ring at those constants for 3 and 4; the point-to-point bandwidth and latency still price the boundary
    bytes."""
    fixed, rate = 4e-4, 0.8e9  # the probe's fit at 2 ranks: 0.4 ms + bytes / 0.8 GB/s
    link = {"schema": "stageplan.link/1", "latency_s": LATENCY, "bandwidth_bytes_per_s": BANDWIDTH,
            "allreduce_latency_s": fixed / 2, "allreduce_bandwidth_bytes_per_s": rate, "allreduce_ranks": 2}
    prof = _profile(4, [_tie(0, 3)])
    pl = plan(prof, p, num_microbatches=4, optimizer="none", boundaries=list(bounds), link=link)
    # the tie's layers 0 and 3 sit on the first and last rank: a sum over those 2, whatever p
    want = fixed + TIE_BYTES / rate
    holders = [0.0] * p
    holders[0] = holders[p - 1] = 1.0
    assert [st.tied_sync_s for st in pl.stages] == pytest.approx([want * h for h in holders], rel=1e-12)
    assert pl.cost_options["allreduce_bandwidth_bytes_per_s"] == rate
    assert any("priced from the link's own all-reduce (0.400 ms + bytes / 0.8 GB/s at 2 ranks" in n
               for n in pl.notes)
    plain = plan(prof, p, num_microbatches=4, optimizer="none", boundaries=list(bounds),
                 link={k: v for k, v in link.items() if not k.startswith("allreduce")})
    ring = [_ring(2, TIE_BYTES) * h for h in holders]
    assert [st.tied_sync_s for st in plain.stages] == pytest.approx(ring, rel=1e-12)
    assert [st.comm_s for st in plain.stages] == [st.comm_s for st in pl.stages]  # boundaries priced alike


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
@pytest.mark.parametrize(("p", "bounds"), [(2, (0, 2, 4)), (3, (0, 1, 3, 4)), (4, (0, 1, 2, 3, 4))])
def test_a_tie_across_ranks_adds_one_ring_all_reduce_to_the_step(schedule: str, p: int,
                                                                 bounds: tuple[int, ...]) -> None:
    plain = _evaluate(_profile(4, None), bounds, p, schedule=schedule)
    tied = _evaluate(_profile(4, [_tie(0, 3)]), bounds, p, schedule=schedule)
    # layers 0 and 3: the first and the last rank hold the tie, and sum it over those two ranks
    assert tied.tied_sync_s == pytest.approx(_ring(2, TIE_BYTES), rel=1e-12)
    assert tied.predicted_step_s - plain.predicted_step_s == pytest.approx(_ring(2, TIE_BYTES), rel=1e-9)
    assert plain.tied_sync_s == 0.0
    # once per step, per holding rank: held by its (first) stage, never in the per-microbatch time the solver
    # balances; a middle rank holds no copy and joins no sum
    want = [_ring(2, TIE_BYTES) if r in (0, p - 1) else 0.0 for r in range(p)]
    assert [st.tied_sync_s for st in tied.stages] == pytest.approx(want, rel=1e-12)
    assert [st.time_s for st in tied.stages] == [st.time_s for st in plain.stages]
    assert tied.bottleneck_s == plain.bottleneck_s


@pytest.mark.parametrize(("p", "k", "nbytes"),
                         [(2, 2, 4096.0), (4, 2, 3e6), (4, 3, 3e6), (8, 5, 1e9), (3, 1, 5.0)])
def test_the_ring_over_k_holders_is_the_closed_form(p: int, k: int, nbytes: float) -> None:
    """Oracle: 2(k-1)/k x bytes / B + 2(k-1) x latency (Patarasuk and Yuan 2009), whatever p; 0 at k = 1."""
    opts = make_options(_profile(p, None), p, num_microbatches=8, bandwidth_bytes_per_s=BANDWIDTH,
                        link_latency_s=LATENCY)
    got = float(ring_allreduce_time(np.array(nbytes), opts, ranks=k))
    assert got == pytest.approx(2 * (k - 1) / k * nbytes / BANDWIDTH + 2 * (k - 1) * LATENCY, rel=1e-12)
    assert float(ring_allreduce_time(np.array(nbytes), opts)) == pytest.approx(_ring(p, nbytes), rel=1e-12)


def test_a_tie_on_three_of_four_ranks_is_summed_over_those_three() -> None:
    """Layers 0, 1 and 3 of four, one per rank: ranks 0, 1 and 3 hold the tie, rank 2 none."""
    ev = _evaluate(_profile(4, [_tie(0, 1, 3)]), (0, 1, 2, 3, 4), 4)
    assert ev.tied_sync_s == pytest.approx(_ring(3, TIE_BYTES), rel=1e-12)
    assert [st.tied_sync_s for st in ev.stages] == pytest.approx(
        [_ring(3, TIE_BYTES), _ring(3, TIE_BYTES), 0.0, _ring(3, TIE_BYTES)], rel=1e-12)


def test_each_tie_across_ranks_is_its_own_all_reduce_and_a_tie_inside_one_layer_is_free() -> None:
    # the last one is used by one layer only
    ties = [_tie(0, 3), _tie(1, 3, nbytes=1000), _tie(2, nbytes=10**9)]
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
    # 2 ranks x 2 chunks, one layer each. ZBV: rank 0 holds chunks 0 and 3, so the first and last layer share
    # it; Interleaved1F1B: chunk k on rank k % 2, so they do not.
    prof = _profile(4, [_tie(0, 3)])
    zbv = _evaluate(prof, (0, 1, 2, 3, 4), 2, schedule="ZBVZeroBubble", virtual_stages=2)
    assert zbv.tied_sync_s == 0.0
    inter = _evaluate(prof, (0, 1, 2, 3, 4), 2, schedule="Interleaved1F1B", virtual_stages=2)
    assert inter.tied_sync_s == pytest.approx(_ring(2, TIE_BYTES), rel=1e-12)
    # each rank's first chunk
    assert [st.tied_sync_s > 0 for st in inter.stages] == [True, True, False, False]


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


def test_the_plan_timeline_holds_one_sync_per_rank_of_the_priced_length() -> None:
    prof = _profile(6, [_tie(0, 5)])
    for schedule, p, v in (("1F1B", 3, 1), ("Interleaved1F1B", 2, 2)):
        pl = plan(prof, p, num_microbatches=2 * p, schedule=schedule, virtual_stages=v, bandwidth=BANDWIDTH,
                  optimizer="none")
        sim = pl.simulate()
        sync = sorted((e.rank, e.end_s - e.start_s) for e in sim.timeline if e.kind == "T")
        # the tie's two layers, first and last, on two ranks: a ring over 2; the simulator keeps one sum at
        # the end of every rank's step, its holders' price
        assert sync == [(r, pytest.approx(_ring(2, TIE_BYTES, latency=0.0), rel=1e-9)) for r in range(p)]
        assert pl.tied_sync_s == pytest.approx(_ring(2, TIE_BYTES, latency=0.0), rel=1e-12)
        assert sim.step_s == pytest.approx(pl.predicted_step_s, rel=1e-12)


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
    for bad in ([{"names": ["a"], "layers": [0, 1], "bytes": 4}],
                [{"names": ["a", "b"], "layers": [3, 0], "bytes": 4}],
                [{"names": ["a", "b"], "layers": [0, 4], "bytes": 4}],
                [{"names": ["a", "b"], "layers": [0], "bytes": -1}]):
        data["meta"]["tied"] = bad
        with pytest.raises(SchemaError, match=r"meta 'tied' must be a list of \{\"names\": \[two or more "
                                              r"FQNs\], \"layers\": \[sorted distinct layer indices below "
                                              r"4\].*entry 0 is .*; re-profile the model"):
            Profile.from_json(data)
    data["meta"]["tied"] = {"names": []}
    with pytest.raises(SchemaError, match=r"got dict; re-profile the model"):
        Profile.from_json(data)


def _one_layer_per_chunk(seed: int, count: int, extra_f: float, extra_b: float
                         ) -> tuple[Profile, Profile, list[tuple[float, float, int]]]:
    """``count`` random layers (forward, backward, output bytes), and the same layers with ``extra_f`` seconds
    added to each forward and ``extra_b`` to each backward: the fold-into-layers oracles' pair."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = [(float(f), float(b), int(o))
            for f, b,
            o in zip(rng.lognormal(0, 1, count), rng.lognormal(0, 1, count), rng.integers(1, 100, count))]
    prof = Profile(tuple(LayerProfile(f"l{i}", f, b, 0, o, 0) for i, (f, b, o) in enumerate(rows)))
    folded = Profile(
        tuple(LayerProfile(f"l{i}", f + extra_f, b + extra_b, 0, o, 0) for i, (f, b, o) in enumerate(rows)))
    return prof, folded, rows


@pytest.mark.parametrize(("schedule", "p", "m", "v"), SCHEDULE_CASES)
def test_the_loops_time_prices_as_if_each_chunks_layer_took_it_longer(
    schedule: str, p: int, m: int, v: int
) -> None:
    """Oracle: with one layer per chunk, the schedule's a seconds per action is the same plan as each layer's
    forward and backward a seconds longer (step, rank times, bottleneck; the lower bound too with one chunk
    per rank, where no rank runs two chunks' overhead)."""

    from stageplan.planning.costs import LayerArrays, evaluate, make_options

    S, a = p * v, 0.3
    prof, folded, _ = _one_layer_per_chunk(3, S, a, a)
    bounds = list(range(S + 1))
    kw = dict(num_microbatches=m, schedule=schedule, virtual_stages=v, optimizer="none",
              bandwidth_bytes_per_s=40.0, boundary_latency_s=0.25)
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
def test_the_chunks_overhead_prices_as_if_each_chunks_layer_took_it_longer(schedule: str, p: int, m: int,
                                                                           v: int) -> None:
    """Oracle: with one layer per chunk, PipelineStage's cF and cB seconds inside each chunk's forward and
    backward are the same plan as each layer's forward cF and backward cB seconds longer: the stages' forward
    and backward (what a run's chunk timers see), step, rank times, bottleneck; every rank's lower bound rises
    by (cF + cB) v. The split-search's prefix sums (SplitCosts) agree with evaluate, with the loop's action_s
    on top."""
    import numpy as np

    from stageplan.planning.costs import LayerArrays, evaluate, make_options
    from stageplan.planning.search import SplitCosts

    S, cf, cb, a = p * v, 0.15, 0.35, 0.05
    prof, folded, rows = _one_layer_per_chunk(5, S, cf, cb)
    bounds = list(range(S + 1))
    kw = dict(num_microbatches=m, schedule=schedule, virtual_stages=v, optimizer="none",
              bandwidth_bytes_per_s=40.0, boundary_latency_s=0.25, action_s=a)
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
    rec = evaluate(LayerArrays.of(prof, m), bounds, make_options(prof, p, chunk_forward_s=cf,
                                                                 chunk_backward_s=cb, recompute=True, **kw))
    for st, (fl, bl, _) in zip(rec.stages, rows):
        assert st.backward_s == pytest.approx(float(fl) + float(bl) + cb, rel=1e-12)
    for bad in (-1.0, float("inf"), True):
        with pytest.raises(StageplanError, match="chunk's forward overhead"):
            make_options(prof, p, chunk_forward_s=bad, **kw)
        with pytest.raises(StageplanError, match="chunk's backward overhead"):
            make_options(prof, p, chunk_backward_s=bad, **kw)
