"""Planner: plan invariants, memory-aware splits, exports round trip, auto choice, bad input."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_error, run_cli

from stageplan import InfeasiblePlanError, LayerProfile, Profile, StageplanError
from stageplan.errors import SchemaError
from stageplan.formats.interop import (
    boundaries_from_balance,
    boundaries_from_megatron,
    boundaries_from_module_fqns,
    boundaries_from_split_spec,
)
from stageplan.formats.plan import Plan
from stageplan.planning.costs import Device
from stageplan.planning.planner import METHODS, plan
from stageplan.units import parse_bandwidth, parse_bytes


def make_profile(times, act=None, params=None, out=None, *, named=True, batch=8, mb=2) -> Profile:  # type: ignore[no-untyped-def]
    n = len(times)
    act = act if act is not None else [0] * n
    params = params if params is not None else [0] * n
    out = out if out is not None else [0] * n
    names = ["embed", *[f"blocks.{i}" for i in range(n - 2)], "head+norm"]
    layers = tuple(LayerProfile(names[i], float(times[i]) * 0.4, float(times[i]) * 0.6, int(act[i]), int(out[i]), int(params[i]))
                   for i in range(n))
    meta = {"batch_size": batch, "microbatch_size": mb, "model": "toy"}
    if named:
        meta["named_layers"] = names[1:-1]
    return Profile(layers, meta)


def brute_force(times, p, speeds=None) -> float:  # type: ignore[no-untyped-def]
    L = len(times)
    speeds = speeds or [1.0] * p
    best = math.inf
    for cuts in itertools.combinations(range(1, L), p - 1):
        b = (0, *cuts, L)
        best = min(best, max(sum(times[b[s]:b[s + 1]]) / speeds[s] for s in range(p)))
    return best


def check_invariants(pl: Plan) -> None:
    b = pl.boundaries
    assert b[0] == 0 and b[-1] == len(pl.layer_names)
    assert all(x < y for x, y in itertools.pairwise(b))
    covered = [name for st in pl.stages for name in st.layers]
    assert covered == list(pl.layer_names)
    if pl.virtual_stages == 1:
        assert pl.bottleneck_s == max(st.time_s for st in pl.stages)
    assert pl.bottleneck_s == max(pl.rank_time_s)
    assert pl.balance_efficiency == pytest.approx(pl.lower_bound_s / pl.bottleneck_s)
    assert pl.lower_bound_s <= pl.bottleneck_s * (1 + 1e-12)
    assert boundaries_from_balance(pl.torchgpipe_balance()) == b
    assert tuple(pl.deepspeed_parts()) == b
    assert boundaries_from_split_spec(pl.split_spec(), pl.layer_names) == b
    assert boundaries_from_module_fqns(pl.module_fqns_per_model_part(), pl.layer_names) == b
    assert boundaries_from_megatron(pl.megatron_layout()) == b


@pytest.mark.parametrize("seed", range(12))
def test_invariants_and_optimality_on_random_profiles(seed: int) -> None:
    rng = np.random.default_rng(seed)
    L = int(rng.integers(4, 11))
    times = list(rng.lognormal(0, 1, L))
    prof = make_profile(times, params=list(rng.integers(1, 100, L)))
    for p in range(1, min(L, 4) + 1):
        for method in ("optimal", "uniform", "parameters"):
            pl = plan(prof, p, num_microbatches=max(p, 2), method=method)
            check_invariants(pl)
        opt = plan(prof, p, num_microbatches=max(p, 2))
        assert opt.bottleneck_s == pytest.approx(brute_force(times, p), rel=1e-9)


def test_json_round_trip_and_schema(tmp_path: Path) -> None:
    pl = plan(make_profile([1, 2, 3, 4, 5, 6]), 2, num_microbatches=4)
    assert pl.boundaries == (0, 4, 6)
    pl.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["schema"] == "stageplan.plan/2" and data["boundaries"] == [0, 4, 6]
    assert Plan.load(tmp_path / "plan.json") == pl
    data["schema"] = "stageplan.plan/9"
    with pytest.raises(SchemaError, match=r"schema 'stageplan.plan/9' but this stageplan reads 'stageplan.plan/2'"):
        Plan.from_json(data)
    df = pl.to_pandas()
    assert list(df["stage"]) == [0, 1] and "activations_bytes" in df.columns


def test_memory_moves_layers_off_stage_zero_under_1f1b() -> None:
    # 8 equal layers, 100 activation bytes each. 1F1B with p=2, m=4: stage 0 holds 2 microbatches, stage 1 holds 1.
    prof = make_profile([1.0] * 8, act=[100] * 8)
    free = plan(prof, 2, num_microbatches=4, schedule="1F1B", optimizer="none")
    assert free.boundaries == (0, 4, 8)
    assert [st.memory["activations"] for st in free.stages] == [800, 400]
    capped = plan(prof, 2, num_microbatches=4, schedule="1F1B", optimizer="none", memory_limit=700)
    assert capped.boundaries == (0, 3, 8)  # stage 0: 2 x 300 = 600 <= 700; stage 1: 1 x 500 = 500
    assert max(capped.rank_memory_bytes) <= 700
    gpipe = plan(prof, 2, num_microbatches=4, schedule="GPipe", optimizer="none")
    assert max(gpipe.rank_memory_bytes) == 1600 > max(free.rank_memory_bytes)  # GPipe holds all 4 microbatches
    with pytest.raises(InfeasiblePlanError, match=r"smallest limit that admits a plan is") as info:
        plan(prof, 2, num_microbatches=4, schedule="GPipe", optimizer="none", memory_limit=700)
    assert info.value.min_memory_limit_bytes == pytest.approx(1600)
    with pytest.raises(InfeasiblePlanError) as info:
        plan(prof, 2, num_microbatches=4, schedule="1F1B", optimizer="none", memory_limit=550)
    assert info.value.min_memory_limit_bytes == pytest.approx(600)  # brute force: (3, 5) -> max(600, 500)


def test_optimizer_state_and_recompute_memory() -> None:
    prof = make_profile([1.0] * 4, act=[100] * 4, params=[10] * 4, out=[7] * 4)
    adam = plan(prof, 2, num_microbatches=4, optimizer="adam")
    st = adam.stages[0]
    assert st.memory["params"] == 20 and st.memory["grads"] == 20 and st.memory["optimizer"] == 40
    assert st.memory["buffers"] == 14 and adam.stages[1].memory["buffers"] == 0
    rec = plan(prof, 2, num_microbatches=4, optimizer="adam", recompute=True)
    # recompute: in flight keep only the stage input (7 bytes for stage 1), plus one microbatch's activations.
    assert rec.stages[1].memory["activations"] == 1 * 7 + 200
    assert rec.stages[0].time_s == pytest.approx(adam.stages[0].time_s + adam.stages[0].forward_s)


def test_heterogeneous_devices_and_bandwidth() -> None:
    times = [1.0, 2.0, 1.0, 3.0, 1.0, 2.0]
    prof = make_profile(times, out=[1e6] * 6)
    slow = plan(prof, 2, num_microbatches=4, devices=[1.0, 0.5])
    assert slow.bottleneck_s == pytest.approx(brute_force(times, 2, [1.0, 0.5]), rel=1e-9)
    fast = plan(prof, 2, num_microbatches=4, devices=[Device(1.0), Device(1.0)])
    assert slow.stages[1].end_layer - slow.stages[1].first_layer <= fast.stages[1].end_layer - fast.stages[1].first_layer
    comm = plan(prof, 2, num_microbatches=4, bandwidth="1MB/s")
    assert comm.stages[0].comm_s == pytest.approx(2.0) and comm.stages[1].comm_s == 0
    assert not any("not modelled" in n for n in comm.notes)
    assert any("not modelled" in n for n in fast.notes)


def test_auto_picks_the_fastest_feasible_candidate() -> None:
    prof = make_profile([1.0] * 8, act=[100] * 8)
    pl = plan(prof, 2, num_microbatches="auto", schedule="auto")
    feasible = [c for c in pl.candidates if c["feasible"]]
    assert len(pl.candidates) > 3 and feasible
    assert pl.predicted_step_s == pytest.approx(min(c["predicted_step_s"] for c in feasible))


def test_interleaved_rank_loads() -> None:
    times = [1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 1.0, 2.0]
    pl = plan(make_profile(times, act=[10] * 8), 2, num_microbatches=4, schedule="Interleaved1F1B", virtual_stages=2)
    assert pl.num_chunks == 4 and pl.virtual_stages == 2
    loads = [sum(st.time_s for st in pl.stages if st.rank == r) for r in range(2)]
    assert pl.rank_time_s == pytest.approx(loads) and pl.bottleneck_s == pytest.approx(max(loads))
    # brute force over 4 chunks, chunk c on rank c % 2
    best = math.inf
    for cuts in itertools.combinations(range(1, 8), 3):
        b = (0, *cuts, 8)
        best = min(best, max(sum(sum(times[b[c]:b[c + 1]]) for c in range(r, 4, 2)) for r in range(2)))
    assert pl.bottleneck_s == pytest.approx(best)
    # the exact per-rank peak over torch's order never exceeds the sum of each stage's own peak
    per_stage_sum = [sum(st.memory["activations"] for st in pl.stages if st.rank == r) for r in range(2)]
    assert all(a <= b + 1e-9 for a, b in zip(pl.rank_peak_activation_bytes, per_stage_sum))


def test_compare_methods_ratios() -> None:
    prof = make_profile([1.0, 1.0, 1.0, 1.0, 1.0, 8.0], params=[50, 1, 1, 1, 1, 50])
    plans = {m: plan(prof, 2, num_microbatches=4, method=m) for m in METHODS}
    assert plans["optimal"].bottleneck_s <= plans["uniform"].bottleneck_s
    assert plans["uniform"].boundaries == (0, 3, 6)


def test_units() -> None:
    assert parse_bytes("40GiB") == 40 * 2**30 and parse_bytes("40GB") == 40e9 and parse_bytes("512MiB") == 512 * 2**20
    assert parse_bandwidth("25GB/s") == 25e9 and parse_bandwidth(1e9) == 1e9
    with pytest.raises(StageplanError, match=r"cannot read memory limit '40 gigs'; use a number with a unit such as 40GiB"):
        parse_bytes("40 gigs")
    assert parse_bandwidth("400MiB/s") == 400 * 2**20 and parse_bandwidth("1e9") == 1e9
    for bad in ("0GB/s", "0Gb/s", -1):  # the text as given, and a rate as the example (was '0GB' and 40GiB)
        with pytest.raises(StageplanError, match=rf"bandwidth must be a positive rate, got {bad!r}; use a number with "
                                                 r"a unit such as 25GB/s"):
            parse_bandwidth(bad)  # type: ignore[arg-type]
    for bad in ("fast", "/s", "-5GB/s"):
        with pytest.raises(StageplanError, match=rf"cannot read bandwidth {bad!r}; use a number with a unit such as "
                                                 r"25GB/s or 400MiB/s \(bytes\), 100Gb/s"):
            parse_bandwidth(bad)
    # B is a byte and b a bit, as links are sold: 25Gb/s had read as 25 GB/s, 8x the link; 25Gbit/s was refused
    assert parse_bandwidth("400Gb/s") == parse_bandwidth("400Gbit/s") == parse_bandwidth("400Gbps") == 50e9
    assert parse_bandwidth("100Mbps") == 12.5e6 and parse_bandwidth("25GBps") == 25e9 and parse_bandwidth("8Kib/s") == 1024
    # whatever the prefix's case: 25gbps had read as 25 GB/s, and 25gb/s stayed bytes while 25kb/s read as bits
    assert parse_bandwidth("25gbps") == parse_bandwidth("25gb/s") == parse_bandwidth("25Gb/s") == 25e9 / 8
    assert parse_bandwidth("25kb/s") == 25e3 / 8 and parse_bandwidth("25GB/S") == parse_bandwidth("25 GB/s") == 25e9
    with pytest.raises(StageplanError, match=r"cannot read the unit of bandwidth '25G'; use 25GB/s or 400MiB/s"):
        parse_bandwidth("25G")


def _write(tmp_path: Path, prof: Profile) -> str:
    path = tmp_path / "prof.json"
    prof.save(path)
    return str(path)


def test_cli_plan_compare_export_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, make_profile([1, 2, 3, 4, 5, 6]))
    code, out, err = run_cli(["plan", path, "--stages", "2", "--microbatches", "4", "--compare", "--export", "megatron",
                              "-o", str(tmp_path / "plan.json")], capsys)
    assert code == 0
    # with --export, stdout carries only the export (so `> layout.txt` captures it); the tables go to stderr
    assert out == "Ettt|tL\n"
    assert "balance efficiency" in err and "x optimal" in err and "--pipeline-model-parallel-layout" in err
    code, out, _ = run_cli(["show", str(tmp_path / "plan.json")], capsys)
    assert code == 0 and "boundaries [0, 4, 6]" in out


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--stages", "9"], r"num_ranks \(9\) exceeds the number of layers \(6\), one stage a rank; use --stages 6 or fewer"),
        (["--stages", "0"], r"num_ranks must be an integer >= 1, got 0"),
        (["--stages", "2", "--microbatches", "0"], r"num_microbatches must be an integer >= 1, got 0"),
        (["--stages", "2", "--schedule", "Zigzag"], r"unknown schedule 'Zigzag'"),
        (["--stages", "2", "--method", "random"], r"unknown method 'random'; use one of optimal, uniform, parameters"),
        (["--stages", "2", "--memory-limit", "40 gigs"], r"cannot read memory limit '40 gigs'"),
        (["--stages", "2", "--schedule", "Interleaved1F1B", "--virtual-stages", "4"], r"needs at least 8 layers, the profile has 6"),
        (["--stages", "2", "--device-speeds", "1,1,0.5"], r"got 3 device entries for 2 ranks; give one speed per rank, not per chunk"),
        (["--stages", "2", "--memory-limit", "1KiB", "--microbatches", "4"], r"smallest limit that admits a plan is"),
        (["--stages", "4", "--microbatches", "2"], r"1F1B needs num_microbatches >= num_ranks"),
        (["--stages", "2", "--export", "nope"], r"unknown export 'nope'"),
        (["--stages", "2", "--schedule", "Interleaved1F1B", "--virtual-stages", "2", "--export", "deepspeed"],
         r"deepspeed places one stage on each rank, and this Interleaved1F1B plan has 2 chunks on each of its 2 ranks"),
        (["--stages", "2", "--schedule", "ZBVZeroBubble", "--virtual-stages", "2", "--export", "torchgpipe"],
         r"torchgpipe places one stage on each rank"),
        (["--stages", "2", "--schedule", "ZBVZeroBubble", "--virtual-stages", "2", "--export", "megatron"],
         r"Megatron places virtual stages round-robin \(stage s on rank s mod 2\), and this ZBVZeroBubble plan places "
         r"them otherwise \(ranks \[0, 1, 1, 0\]\); export torchtitan"),
        # every auto candidate of a fixed split over the limit (was an AssertionError); with 1F1B the m = 1
        # candidate's own error used to stand in for the memory limit
        *[(["--stages", "2", "--method", "uniform", "--memory-limit", "1KiB", "--microbatches", "auto", "--schedule", s],
           rf"no candidate of the 4 tried \({s}; m in \[1, 2, 4, 8\]\) fits the memory limits with method uniform; "
           rf"the closest, {s} with \d+ microbatch(es)?: rank 0 needs .* over its limit of 1.00 KiB.*raise --memory-limit")
          for s in ("GPipe", "1F1B")],
    ],
)
def test_cli_plan_bad_input(args: list[str], pattern: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, make_profile([1, 2, 3, 4, 5, 6], act=[1000] * 6))
    code, _, err = run_cli(["plan", path, *args], capsys)
    assert_one_line_error(code, err, pattern)


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda d: d["layers"][0].update(forward_s=float("nan")), r"has forward_s = None; costs must be finite"),
        (lambda d: d["layers"][1].update(backward_s=-1), r"has backward_s = -1; costs must be finite numbers >= 0"),
        (lambda d: d.update(layers=[]), r"the profile has no layers"),
        (lambda d: d.update(schema="stageplan.profile/2"), r"schema 'stageplan.profile/2' but this stageplan reads"),
        # beyond the required costs: each of these went through as a traceback or a wrong reading before
        (lambda d: d["layers"][1].update(backward_accumulate_s="x"), r"layer 1 \('blocks.0'\) has backward_accumulate_s = 'x'; "
                                                                    r"it must be a finite number >= 0 or null"),
        (lambda d: d["layers"][1].update(forward_iqr_s=-1), r"has forward_iqr_s = -1; it must be a finite number >= 0;"),
        (lambda d: d["layers"][2].update(name="blocks.0"), r"layer 2 has name 'blocks.0', as layer 1 has; each layer needs"),
        (lambda d: d["layers"][2].update(name=5), r"layer 2 has name 5; each layer needs its own non-empty name"),
        (lambda d: d["meta"].update(batch_size="x"), r"meta batch_size = 'x'; it must be an integer >= 1"),
        (lambda d: d["meta"].update(microbatch_size=-8), r"meta microbatch_size = -8; it must be an integer >= 1"),
        (lambda d: d["meta"].update(named_layers="blocks.0"), r"meta named_layers = 'blocks.0'; it must be a list of"),
        (lambda d: d["meta"].update(optimizer_step={"floor_s": "x"}), r"meta optimizer_step = .*its floor_s must map"),
        (lambda d: d["meta"].update(calibration={"allreduce_latency_s": "x", "allreduce_bandwidth_bytes_per_s": 1e9}),
         r"meta calibration has allreduce_latency_s = 'x' and allreduce_bandwidth_bytes_per_s = 1000000000.0"),
    ],
)
def test_cli_plan_bad_profiles(mutate, pattern: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    data = make_profile([1, 2, 3, 4]).to_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data).replace("NaN", "null"))
    code, _, err = run_cli(["plan", str(path), "--stages", "2", "--microbatches", "2"], capsys)
    assert_one_line_error(code, err, pattern)


def test_an_interleaved_plan_exports_where_the_tool_can_place_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron's virtual stages go round-robin, as Interleaved1F1B places them; torchtitan's parts and torch's split
    points leave the placement to the schedule."""
    pl = plan(make_profile([1, 2, 3, 4, 5, 6]), 2, num_microbatches=4, schedule="Interleaved1F1B", virtual_stages=2)
    assert [st.rank for st in pl.stages] == [0, 1, 0, 1]
    assert boundaries_from_megatron(pl.export("megatron")) == pl.boundaries
    assert boundaries_from_module_fqns(pl.export("torchtitan"), pl.layer_names) == pl.boundaries
    assert boundaries_from_split_spec(pl.export("split-spec"), pl.layer_names) == pl.boundaries


def test_small_m_warns() -> None:
    with pytest.warns(UserWarning, match=r"num_microbatches \(1\) < num_ranks \(2\)"):
        plan(make_profile([1, 1, 1, 1]), 2, num_microbatches=1, schedule="GPipe")


def test_precision_holds_the_bytes_a_megatron_user_expects() -> None:
    """ZeRO accounting, closed form: mixed precision with Adam holds 16 bytes per parameter (2 weights, 2 grads,
    4 fp32 master, 4 + 4 Adam moments); pure bf16 with Adam 8; fp32 with SGD 8 (weights and grads)."""
    count = 1000
    layers = tuple(LayerProfile(f"l{i}", 1.0, 1.0, 0, 0, 4 * count, param_count=count) for i in range(4))
    prof = Profile(layers, {"dtype": "float32"})
    cases = {("bf16-mixed", "adam"): 16, ("fp16-mixed", "adamw"): 16, ("bf16", "adam"): 8, ("fp32", "sgd"): 8,
             ("bf16-mixed", "sgd"): 8, ("fp32", "momentum"): 12}
    for (precision, optimizer), per_param in cases.items():
        pl = plan(prof, 2, num_microbatches=2, precision=precision, optimizer=optimizer)
        for st in pl.stages:
            static = st.memory["total"] - st.memory["activations"] - st.memory["buffers"]
            assert static == per_param * count * len(st.layers), (precision, optimizer)
        assert pl.stages[0].memory["master"] == (4 * count * 2 if precision.endswith("mixed") else 0)
    # 2 layers x 1000 params x 16 B = 32000 B per stage: a 31 KB limit is refused with the smallest cap that works
    with pytest.raises(InfeasiblePlanError, match=r"the smallest limit that admits a plan is 31.25 KiB") as info:
        plan(prof, 2, num_microbatches=2, precision="bf16-mixed", optimizer="adam", memory_limit=31000)
    assert info.value.min_memory_limit_bytes == 32000
    with pytest.raises(StageplanError, match=r"unknown precision 'fp8'; use one of fp32, bf16, bf16-mixed, fp16-mixed"):
        plan(prof, 2, num_microbatches=2, precision="fp8")


def test_a_plan_for_another_batch_than_the_profiled_one_says_how_to_run_it() -> None:
    """A plan keeps its profile's microbatch size for any m; when m microbatches of it are not the profiled model's
    batch, the plan says so (stageplan run splits the model's own batch and refuses the mismatch)."""
    prof = make_profile([1.0] * 6)  # batch 8, microbatch 2

    def batch_notes(pl: Plan) -> list[str]:
        return [n for n in pl.notes if "prices" in n]

    assert batch_notes(plan(prof, 2, num_microbatches=4)) == []  # 4 x 2 = the profiled batch
    assert batch_notes(plan(prof, 2)) == []  # m defaults to batch / microbatch
    assert batch_notes(plan(prof, 2, num_microbatches="auto")) == []  # auto rescales to batch / m
    (note,) = batch_notes(plan(prof, 2, num_microbatches=8))
    assert ("prices 8 microbatches of 2 samples, a batch of 16, and the profiled model's batch is 8" in note
            and "plan --microbatches 4, or profile at --microbatch-size 1" in note)
    (note,) = batch_notes(plan(prof, 2, num_microbatches=16))  # 16 does not divide 8: only a bigger batch runs it
    assert note.endswith("build the model with a batch of 32") and "--microbatch-size" not in note
    (note,) = batch_notes(plan(make_profile([1.0] * 6, mb=1), 2, num_microbatches=64))  # the 70B way: m free at mb 1
    assert "64 microbatches of 1 sample, a batch of 64" in note


def test_auto_where_nothing_fits_names_the_memory_limit_not_the_last_schedule_tried() -> None:
    """schedule='auto' tries Interleaved1F1B last; with 3 layers it cannot run 4 chunks, and that error used to
    stand in for the memory limit every candidate missed."""
    prof = make_profile([1.0, 1.0, 1.0], act=[1 << 20] * 3, params=[1 << 20] * 3)
    with pytest.raises(InfeasiblePlanError, match=r"alone needs .* more than the memory limit of 1\.00 MiB"):
        plan(prof, 2, memory_limit="1MiB", schedule="auto")


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda d: d.update(cost_options=None), r"cost_options must be an object, got None"),
        (lambda d: d.update(bottleneck_s=float("nan")), r"bottleneck_s must be a finite number, got nan"),
        (lambda d: d.update(rank_time_s=[1.0]), r"rank_time_s must hold a finite number for each of its 2 ranks"),
        (lambda d: d.update(boundaries=["0", "2", "4"]), r"boundaries must be integers, got \['0', '2', '4'\]"),
        (lambda d: d["stages"][1].update(rank=7), r"stage 1 must run on a rank 0..1 with finite times"),
        (lambda d: d["stages"][0].update(comm_s="x"), r"stage 0 must run on a rank 0..1 with finite times"),
        # each of these had been a traceback in show, run or calibrate (a sweep of hand-edited files)
        (lambda d: d["stages"][0].update(memory=None), r"stage 0's memory must map each kind to bytes, got None"),
        (lambda d: d["stages"][0].update(layers=[]), r"stage 0's layers must name its layers, got \[\]"),
        (lambda d: d["stages"][0].update(memory_limit_bytes="x"),
         r"stage 0's memory_limit_bytes must be bytes > 0 or null, got 'x'"),
        (lambda d: d["cost_options"].update(virtual_stages=None),
         r"cost_options' virtual_stages must be an integer >= 1, got None"),
        (lambda d: d["cost_options"].update(num_microbatches="x"),
         r"cost_options' num_microbatches must be an integer >= 1, got 'x'"),
        (lambda d: d["cost_options"].update(bandwidth_bytes_per_s="x"),
         r"cost_options' bandwidth_bytes_per_s must be bytes/s > 0 or null \(not modelled\), got 'x'"),
        (lambda d: d["cost_options"].update(devices=-1), r"cost_options' devices must be a list of \{speed > 0"),
        (lambda d: d["cost_options"].update(precision=[]), r"cost_options' precision must be a name or null, got \[\]"),
        (lambda d: d["cost_options"].update(link_latency_s="x"),
         r"cost_options' link_latency_s must be seconds >= 0 or null, got 'x'"),
        (lambda d: d["cost_options"].update(microbatch_size="x"),
         r"cost_options' microbatch_size must be an integer >= 1, got 'x'"),
        (lambda d: d.update(candidates="xy"), r"candidates must be a list, got 'xy'"),
        (lambda d: d.update(candidates=["xy"]), r"candidates must be a list of objects \(boundaries, predicted_step_s\), "
                                                r"got 'xy'"),
    ],
)
def test_show_and_run_refuse_a_mangled_plan_file(mutate, pattern: str, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A plan file whose figures are of the wrong kind: one line naming the field, for show (which crashed on a
    null cost_options) and for the API's loader (which printed a NaN bottleneck as 'nan')."""
    data = plan(make_profile([1, 2, 3, 4]), 2, num_microbatches=2).to_json()
    Plan.from_json(json.loads(json.dumps(data)))  # the unedited plan loads
    mutate(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaError, match=pattern):
        Plan.load(path)
    code, _, err = run_cli(["show", str(path)], capsys)
    assert_one_line_error(code, err, pattern)


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--bandwidth", "1e-300"], r"bandwidth must be at least 1 kB/s, got '1e-300'"),
        (["--device-speeds", "1e-320,1"], r"device 0 speed must be between 1e-06 and 1e\+06, got 1e-320"),
        (["--megatron-layout", ""], r"Megatron layout '' holds no layers"),
        (["--megatron-layout", "(" * 100_000], r"groups nest deeper than 64 levels"),  # was a RecursionError
        (["--megatron-layout", "E,t*99999999999999|t,L"], r"repeats to more than 1,000,000 symbols"),
        (["--megatron-layout", "E" + "(t*999999)" * 3 + "|tL"], r"writes out to more than 1,000,000 symbols"),
        (["--megatron-layout", "t*" + "9" * 5000 + "|tL"], r"the count '9{20}.*repeats to more than 1,000,000"),  # was int()'s ValueError
        (["--fqns", ""], r"--fqns '' is empty; give the JSON file of the parts"),
        (["--fqns", "{tmp}"], r"--fqns '.*' is a folder; give the JSON file of the parts"),
        (["--link", "{tmp}/none.json"], r"^stageplan: error: link file '.*none.json' does not exist; check the path"),
        (["--link", "{tmp}"], r"link '.*' is a folder, not a file; give the file inside it \(it holds bad.json, prof.json\)"),
    ],
)
def test_cli_plan_refuses_out_of_range_and_empty_inputs(args: list[str], pattern: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, make_profile([1, 2, 3, 4, 5, 6]))
    (tmp_path / "bad.json").write_text("{}")
    code, _, err = run_cli(["plan", path, "--stages", "2", *[a.replace("{tmp}", str(tmp_path)) for a in args]], capsys)
    assert_one_line_error(code, err, pattern)


def test_a_megatron_layout_is_scored_only_where_the_schedule_places_stages_as_megatron_does() -> None:
    """Megatron runs virtual stage s on rank s mod p. ZBVZeroBubble places them V-shaped (0, 1, 1, 0), so the layout
    scored there (it was, silently, at 0.97x the bottleneck of the round-robin placement) is a split Megatron never
    runs; the same layout under Interleaved1F1B scores on Megatron's own placement, and --boundaries still scores
    the V split."""
    from stageplan.formats.schedule import stage_ranks

    prof = make_profile([1, 2, 3, 4, 5, 6, 7, 8])
    layout = "E,t|t*2|t*2|t,L"
    with pytest.raises(StageplanError, match=r"Megatron places virtual stages round-robin .* ZBVZeroBubble places "
                                             r"them otherwise \(ranks \[0, 1, 1, 0\]\)"):
        plan(prof, 2, num_microbatches=4, schedule="ZBVZeroBubble", virtual_stages=2, megatron_layout=layout)
    assert list(stage_ranks("Interleaved1F1B", 2, 2)) == [0, 1, 0, 1]
    given = plan(prof, 2, num_microbatches=4, schedule="Interleaved1F1B", virtual_stages=2, megatron_layout=layout)
    assert given.boundaries == (0, 2, 4, 6, 8) and [st.rank for st in given.stages] == [0, 1, 0, 1]
    v = plan(prof, 2, num_microbatches=4, schedule="ZBVZeroBubble", virtual_stages=2, boundaries=[0, 2, 4, 6, 8])
    assert [st.rank for st in v.stages] == [0, 1, 1, 0]


def test_a_plan_of_zero_cost_layers_saves_and_loads(tmp_path: Path) -> None:
    """A step predicted at 0 s has an infinite throughput, written as null: the file stageplan writes loads back."""
    prof = Profile(tuple(LayerProfile(f"l{i}", 0.0, 0.0, 0, 0, 0) for i in range(4)))
    pl = plan(prof, 2, num_microbatches=2)
    pl.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").boundaries == pl.boundaries
