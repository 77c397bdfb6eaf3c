"""The layout search: exact inside (d = t = 1 is today's plan), the same best with and without its bounds,
valid bounds, the embedding on the first stage whole, zero1's partition, refusals in one line."""

from __future__ import annotations

import pytest

from stageplan.errors import InfeasiblePlanError, StageplanError
from stageplan.formats.layout import Candidate, Layout
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.planning import layouts
from stageplan.planning.costs import LayerArrays, make_options, solver_inputs
from stageplan.planning.layouts import (
    Network,
    _Point,
    lower_bounds,
    prepare_profile,
    scale_profile,
    search_layouts,
)
from stageplan.planning.planner import plan
from stageplan.planning.sharding import bytes_per_param

NET = Network(devices_per_node=4, intra_node_bytes_per_s=100e9, inter_node_bytes_per_s=10e9)
GiB = 1024.0**3


def lm_profile(blocks: int = 12, *, b: int = 1, vocab_params: int = 50_000_000,
               block_params: int = 20_000_000,
               act: int = 400_000_000, hidden: int = 1024, seq: int = 2048) -> Profile:
    """A decoder's profile at microbatch size b: an embedding, identical blocks (one heavier in the middle), a
    head; times in seconds, memory in bytes, the model's shape for tensor parallelism and MFU."""
    out = b * seq * hidden * 2
    layers = [LayerProfile("embed", 0.001 * b, 0.001 * b, 0, out, 2 * vocab_params, vocab_params)]
    for i in range(blocks):
        heavy = 1.5 if i == blocks // 2 else 1.0
        layers.append(LayerProfile(f"layers.{i}", 0.01 * b * heavy, 0.02 * b * heavy, act * b, out,
                                   2 * block_params, block_params))
    layers.append(LayerProfile("head", 0.008 * b, 0.016 * b, 3 * act * b, 0, 2 * vocab_params, vocab_params))
    params = 2 * vocab_params + blocks * block_params
    meta = {"microbatch_size": b, "named_layers": [f"layers.{i}" for i in range(blocks)],
            "layout_model": {"params": params, "num_layers": blocks, "hidden_size": hidden, "seq_len": seq,
                             "activation_element_bytes": 2},
            "param_tensors": [[vocab_params]] + [[block_params // 4] * 4] * blocks + [[vocab_params]]}
    return Profile(tuple(layers), meta)


def search(n: int = 8, batch: int = 16, **kw: object) -> Layout:
    kw.setdefault("tensor_parallel", [1])
    kw.setdefault("microbatch_sizes", [1, 2])
    return search_layouts({(1, 1): lm_profile(), (2, 1): lm_profile(b=2)}, n, global_batch_size=batch,
                          network=NET, **kw)  # type: ignore[arg-type]


def test_one_pipeline_of_fixed_depth_is_todays_plan_exactly() -> None:
    prof = lm_profile()
    for p, m in ((4, 8), (2, 4), (7, 14)):
        lay = search_layouts({(1, 1): prof}, p, global_batch_size=m, network=NET, tensor_parallel=[1],
                             pipeline_parallel=[p], microbatch_sizes=[1], schedules=["1F1B"],
                             recompute=[False], shardings=["ddp"])
        best = lay.best
        assert (best.pipeline_parallel, best.data_parallel, best.num_microbatches) == (p, 1, m)
        bandwidth = NET.inter_node_bytes_per_s if p > NET.devices_per_node else NET.intra_node_bytes_per_s
        ref = plan(prof, p, num_microbatches=m, bandwidth=bandwidth, precision="bf16-mixed")
        assert lay.plan is not None
        assert lay.plan.boundaries == ref.boundaries
        assert lay.plan.predicted_step_s == pytest.approx(ref.predicted_step_s, rel=1e-12)
        assert best.simulated_step_s == pytest.approx(ref.predicted_step_s, rel=1e-12)
        assert lay.plan.rank_memory_bytes == pytest.approx(ref.rank_memory_bytes, rel=1e-12)


@pytest.mark.parametrize("limit", [None, 6 * GiB, 3.2 * GiB])
def test_bounds_prune_but_never_change_the_best(limit: float | None) -> None:
    kw = {"memory_limit_bytes": limit, "microbatch_sizes": [1, 2], "top": 3}
    pruned, full = search(**kw), search(bounds=False, **kw)
    assert pruned.best.degrees == full.best.degrees
    assert pruned.best.step_s == full.best.step_s
    assert [c.degrees for c in pruned.candidates[:3]] == [c.degrees for c in full.candidates[:3]]
    assert full.counts["pruned_by_time"] == full.counts["pruned_by_memory"] == 0
    assert full.counts["priced"] == full.counts["grid"]
    assert pruned.counts["priced"] < full.counts["priced"]


def test_every_priced_step_is_at_least_its_bound() -> None:
    lay = search(bounds=False, top=1000)
    assert len(lay.candidates) > 50
    for c in lay.candidates:
        assert c.predicted_step_s is not None and c.lower_bound_step_s is not None
        assert c.predicted_step_s >= c.lower_bound_step_s * (1 - 1e-12), c.degrees


def test_memory_bound_is_below_every_split_brute_force() -> None:
    """For each candidate of a small grid, the memory bound is at most the least fullest-device memory over
    every split (enumerated)."""
    import itertools

    from stageplan.planning.costs import LayerArrays

    prof = lm_profile(blocks=5)
    L = len(prof)
    for sched, rc, p, m in itertools.product(["GPipe", "1F1B"], [False, True], [2, 3], [3, 6]):
        pt = _Point(1, p, 1, 1, m, sched, 1, rc, "ddp")
        arr = LayerArrays.of(prof, m)
        per = bytes_per_param("bf16-mixed", "adam").total
        _, bound = lower_bounds(arr, pt, per)
        best = min(_fullest(prof, (0, *cut, L), pt) for cut in itertools.combinations(range(1, L), p - 1))
        assert bound <= best * (1 + 1e-12), (sched, rc, p, m)


def _fullest(prof: Profile, bounds: tuple[int, ...], pt: object) -> float:
    from stageplan.planning.costs import evaluate, make_options

    opts = make_options(prof, pt.p, num_microbatches=pt.m, schedule=pt.schedule,  # type: ignore[attr-defined]
                        recompute=pt.recompute, precision="bf16-mixed")  # type: ignore[attr-defined]
    from stageplan.planning.costs import LayerArrays

    return max(evaluate(LayerArrays.of(prof, pt.m), bounds, opts).rank_memory_bytes)  # type: ignore[attr-defined]


def test_the_first_stage_holds_the_whole_embedding() -> None:
    """NeMo's pre-filter divides the embedding by p; the first stage holds all of it (with its blocks)."""
    prof = lm_profile(vocab_params=400_000_000)
    lay = search_layouts({(1, 1): prof}, 4, global_batch_size=8, network=NET, tensor_parallel=[1],
                         pipeline_parallel=[4], microbatch_sizes=[1], schedules=["1F1B"], recompute=[False],
                         shardings=["ddp"])
    assert lay.plan is not None
    first = lay.plan.stages[0]
    count = sum(prof.layers[i].param_count for i in range(first.first_layer, first.end_layer))
    assert first.memory["params"] == pytest.approx(2.0 * count)  # bf16 weights of exactly its own layers
    assert first.memory["optimizer"] == pytest.approx(8.0 * count)
    total = sum(x.param_count for x in prof.layers)
    divided = 16.0 * total / 4  # every stage's static memory if the embedding were spread over p
    assert first.memory["params"] + first.memory["grads"] + first.memory["master"] + first.memory[
        "optimizer"] != pytest.approx(divided, rel=0.05)


def test_zero1_counts_the_fullest_replica_of_whole_tensors() -> None:
    prof = lm_profile(vocab_params=400_000_000)
    lay = search_layouts({(1, 1): prof}, 8, global_batch_size=16, network=NET, tensor_parallel=[1],
                         pipeline_parallel=[2], microbatch_sizes=[1], schedules=["1F1B"], recompute=[False],
                         shardings=["zero1"])
    best = lay.best
    assert (best.pipeline_parallel, best.data_parallel, best.sharding) == (2, 4, "zero1")
    assert lay.plan is not None
    # rank 0 holds the embedding tensor (400 M) and its blocks' 5 M tensors: the embedding alone is one
    # replica's load, against a 1/4 average
    first = lay.plan.stages[0]
    numels = [400_000_000] + [5_000_000] * 4 * (first.end_layer - 1)
    extra = (max(400_000_000, sum(numels) / 4) - sum(numels) / 4) * 12  # master 4 + Adam 8 bytes, owned
    assert best.rank_memory_bytes[0] - lay.plan.rank_memory_bytes[0] == pytest.approx(extra, rel=1e-9)


def test_tensor_parallelism_adds_its_all_reduces_to_the_blocks_only() -> None:
    prof = lm_profile()
    prep = prepare_profile(prof, 4, NET)
    tokens_bytes = 1 * 2048 * 1024 * 2
    one = 2 * 3 / 4 * tokens_bytes / NET.intra_node_bytes_per_s
    assert prep.profile.layers[0].forward_s == prof.layers[0].forward_s  # the embedding
    assert prep.profile.layers[1].forward_s == pytest.approx(prof.layers[1].forward_s + 2 * one)
    assert prep.profile.layers[1].backward_s == pytest.approx(prof.layers[1].backward_s + 2 * one)
    sp = prepare_profile(prof, 4, NET, sequence_parallel=True)
    assert sp.profile.layers[1].output_bytes == prof.layers[1].output_bytes // 4
    assert sp.profile.layers[1].activation_bytes == prof.layers[1].activation_bytes - 3 / 4 * 4 * tokens_bytes
    bare = Profile(prof.layers, {"microbatch_size": 1})
    with pytest.raises(StageplanError, match=r"tensor parallelism \(t = 2\) needs a profile of the t-way "
                                             r"shard with the model's shape"):
        prepare_profile(bare, 2, NET)


def test_a_microbatch_size_without_its_profile_is_scaled_and_labelled() -> None:
    prof = lm_profile()
    scaled = scale_profile(prof, 4)
    assert scaled.layers[1].forward_s == pytest.approx(4 * prof.layers[1].forward_s)
    assert scaled.layers[1].activation_bytes == 4 * prof.layers[1].activation_bytes
    lay = search_layouts({(1, 1): prof}, 4, global_batch_size=16, network=NET, tensor_parallel=[1],
                         microbatch_sizes=[4], top=2)
    assert lay.best.scaled_from_microbatch_size == 1
    assert any("scaled from microbatch size 1 to 4" in n for n in lay.notes)


def test_same_input_same_answer() -> None:
    a, b = search(memory_limit_bytes=6 * GiB), search(memory_limit_bytes=6 * GiB)
    assert a.to_json() == b.to_json()


def test_layout_round_trips_through_json(tmp_path: object) -> None:
    lay = search(memory_limit_bytes=6 * GiB, top=3)
    path = f"{tmp_path}/layout.json"
    lay.save(path)
    back = Layout.load(path)
    assert back.to_json() == lay.to_json()
    assert isinstance(back.best, Candidate) and back.plan is not None
    assert back.plan.boundaries == lay.plan.boundaries  # type: ignore[union-attr]


def test_refusals_name_the_rule_and_the_remedy() -> None:
    with pytest.raises(StageplanError, match=r"tensor parallelism stays within a node: t = 8 exceeds the 4 "
                                             r"devices per node; use --tensor-parallel 1,2"):
        search(tensor_parallel=[1, 2, 8])
    with pytest.raises(StageplanError, match=r"no layout of 8 devices fits the grid: .*the global batch 3 is "
                                             r"not a multiple of b x dp"):
        search(batch=3, microbatch_sizes=[2], pipeline_parallel=[1, 2, 4])
    with pytest.raises(StageplanError, match=r"the layout search prices GPipe, 1F1B, Interleaved1F1B, got "
                                             r"'ZBVZeroBubble'"):
        search(schedules=["ZBVZeroBubble"])
    with pytest.raises(InfeasiblePlanError, match=r"no layout of 8 devices fits 512.00 MiB per device "
                                                  r"\(176 candidates\): the smallest memory limit that "
                                                  r"admits one is .*; raise --memory-limit to "):
        search(memory_limit_bytes=512 * 1024**2)
    with pytest.raises(StageplanError, match=r"the device count must be an integer >= 1, got 0"):
        search(n=0)


def test_an_estimate_reports_mfu_from_the_palm_formula() -> None:
    prof = lm_profile()
    prof = Profile(prof.layers, {**prof.meta, "estimate": {"gpu": "h100-sxm"}, "timer": "analytic"})
    lay = search_layouts({(1, 1): prof}, 4, global_batch_size=8, network=NET, tensor_parallel=[1],
                         microbatch_sizes=[1], top=2)
    best = lay.best
    model = prof.meta["layout_model"]
    flops = (
        (6 * model["params"] + 12 * model["num_layers"] * model["hidden_size"] * model["seq_len"]) * 8 * 2048
    )
    assert best.mfu == pytest.approx(flops / (best.step_s * 4 * 989.5e12), rel=1e-9)
    assert best.tokens_per_s_per_device == pytest.approx(8 * 2048 / best.step_s / 4, rel=1e-9)
    assert best.hfu == best.mfu if not best.recompute else best.hfu > best.mfu  # type: ignore[operator]


def test_the_pipeline_goes_inside_the_data_groups_where_that_is_faster() -> None:
    """8 devices, 4 a node, p = 2 x d = 4: torchtitan's order (data inside pipeline) puts each pipeline hop
    across nodes (32 MiB boundaries at 10 GB/s); the pipeline inside the data groups keeps the hops in a node
    and sends the (small) gradient all-reduce across instead."""
    prof = lm_profile(hidden=8192, block_params=1_000_000, vocab_params=1_000_000)
    lay = search_layouts({(1, 1): prof}, 8, global_batch_size=16, network=NET, tensor_parallel=[1],
                         pipeline_parallel=[2], microbatch_sizes=[1], schedules=["1F1B"], recompute=[False],
                         shardings=["ddp"])
    best = lay.best
    assert best.placement == "tp,pp,dp"
    assert best.spans_nodes == ("dp",)
    assert any("placing the pipeline inside the data-parallel groups" in n for n in lay.notes)
    second = lay.candidates[1]
    assert second.degrees == best.degrees and second.placement == "tp,dp,pp"
    assert second.spans_nodes == ("pp",)
    assert best.step_s < second.step_s
    assert "--use-tp-pp-dp-mapping" in lay.export("megatron")
    with pytest.raises(StageplanError, match=r"torchtitan's mesh puts the pipeline outermost"):
        lay.export("torchtitan")


def _small_grid_points() -> list[_Point]:
    """Every schedule, recompute setting and sharding of a small grid (8 layers): up to 6 chunks."""
    import itertools

    from stageplan.formats.schedule import check_microbatches

    points = []
    for sched, rc, (p, v), m, (sh, d) in itertools.product(
            ["GPipe", "1F1B", "Interleaved1F1B"], [False, True], [(2, 1), (3, 1), (2, 2), (2, 3), (3, 2)],
            [2, 3, 4, 6], [("ddp", 1), ("zero1", 2), ("fsdp", 2), ("ddp", 2)]):
        if (v > 1) != (sched == "Interleaved1F1B"):
            continue
        try:
            check_microbatches(sched, p, m, v)
        except StageplanError:
            continue
        points.append(_Point(1, p, d, 1, m, sched, v, rc, sh))
    return points


def test_memory_and_step_bounds_are_below_every_split_brute_force() -> None:
    """Each bound against brute force, on every split of an 8-layer model (an embedding, six blocks with one
    heavier, a head carrying three blocks' activations) into p x v chunks: the closed-form memory floor, the
    split bound (split_memory_bounds: both weightings, the warm-up counts) and the step bound are at most
    the least the pricing itself finds over the splits (its fullest device, zero1's whole tensors included,
    and its closed-form step)."""
    import itertools

    from stageplan.planning.costs import LayerArrays
    from stageplan.planning.layouts import _prepared, _rank_memory, _Search, price, split_memory_bounds

    prof = lm_profile(blocks=6)
    L = len(prof)
    prepared = _prepared({(1, 1): prof}, NET, [1], [1], False)
    prep = prepared[(1, 1)]
    checked = 0
    for pt in _small_grid_points():
        search = _Search(prepared, pt.p * pt.d, 16, NET, None, "bf16-mixed", "param", "adam")
        arr = LayerArrays.of(prep.profile, pt.m)
        opts = search.options(pt, prep.profile)
        per = bytes_per_param("bf16-mixed", "adam", pt.sharding, pt.d).total
        step_lb, mem_lb = lower_bounds(arr, pt, per, opts.bandwidth_bytes_per_s)
        (split_lb,) = split_memory_bounds([(arr, pt, per)])
        least_memory = least_step = float("inf")
        for cut in itertools.combinations(range(1, L), opts.num_chunks - 1):
            bounds = (0, *cut, L)
            least_memory = min(least_memory, max(_rank_memory(search, prep.profile, arr, bounds, opts)[0]))
            least_step = min(least_step, price(search, pt, prep, arr, opts, bounds, 0.0).step_s)
        assert mem_lb <= least_memory * (1 + 1e-12), (pt, mem_lb, least_memory)
        assert split_lb <= least_memory * (1 + 1e-12), (pt, split_lb, least_memory)
        assert step_lb <= least_step * (1 + 1e-12), (pt, step_lb, least_step)
        checked += 1
    assert checked > 100


def test_the_split_bound_is_tight_where_the_closed_form_is_not() -> None:
    """Interleaved without recompute: the closed form counts one microbatch in flight; the split bound counts
    each rank's warm-up, and piling the layers onto the last chunk (one microbatch) costs its rank as much."""
    import itertools

    from stageplan.planning.costs import LayerArrays
    from stageplan.planning.layouts import _prepared, _rank_memory, _Search, split_memory_bounds

    prof = lm_profile(blocks=12)
    prepared = _prepared({(1, 1): prof}, NET, [1], [1], False)
    search = _Search(prepared, 4, 8, NET, None, "bf16-mixed", "param", "adam")
    pt = _Point(1, 4, 1, 1, 8, "Interleaved1F1B", 2, False, "ddp")
    arr = LayerArrays.of(prof, 8)
    opts = search.options(pt, prof)
    per = bytes_per_param("bf16-mixed", "adam").total
    _, closed = lower_bounds(arr, pt, per)
    (split,) = split_memory_bounds([(arr, pt, per)])
    best = min(max(_rank_memory(search, prof, arr, (0, *cut, len(prof)), opts)[0])
               for cut in itertools.combinations(range(1, len(prof)), 7))
    assert closed < 0.6 * best
    assert 0.75 * best < split <= best * (1 + 1e-12)


def test_warmup_counts_are_a_moment_of_each_ranks_order() -> None:
    """The counts the split bound weights each chunk by are one of the moments the pricing takes each rank's
    activation peak over (counts_shape), and of torch's whole order (schedule_shape)."""
    import numpy as np

    from stageplan.formats.schedule import check_microbatches
    from stageplan.planning.schedules import counts_shape, schedule_shape, warmup_counts

    checked = 0
    for sched in ("GPipe", "1F1B", "Interleaved1F1B"):
        for p in range(1, 6):
            for m in range(1, 17):
                for v in (range(2, 5) if sched == "Interleaved1F1B" else [1]):
                    try:
                        check_microbatches(sched, p, m, v)
                    except StageplanError:
                        continue
                    counts = warmup_counts(sched, p, m, v)
                    for shape in (counts_shape(sched, p, m, v), schedule_shape(sched, p, m, v)):
                        for r, moments in enumerate(shape._forward_counts):
                            mine = np.asarray(shape.stage_ranks) == r
                            assert any(np.array_equal(k[mine], counts[mine]) for k in moments), (p, m, v)
                    checked += 1
    assert checked > 150


@pytest.mark.parametrize("limit", [None, 8 * GiB, 5 * GiB, 3.2 * GiB, 2.6 * GiB])
def test_the_bounds_keep_the_exhaustive_ranking(limit: float | None) -> None:
    """Every bound on (the closed forms, the split bound, the solver's least bottleneck) against every bound
    off, on a grid of two tensor degrees, two microbatch sizes, every schedule, recompute and sharding: the
    same best, the same first --top candidates in the same order with the same steps, simulated steps and
    splits, and the same plan."""
    profiles = {(1, 1): lm_profile(), (2, 1): lm_profile(b=2),
                (1, 2): lm_profile(block_params=10_000_000, act=250_000_000),
                (2, 2): lm_profile(b=2, block_params=10_000_000, act=250_000_000)}
    kw: dict[str, object] = {"global_batch_size": 16, "network": NET, "memory_limit_bytes": limit,
                             "tensor_parallel": [1, 2], "microbatch_sizes": [1, 2], "top": 5}
    try:
        full = search_layouts(profiles, 8, bounds=False, **kw)  # type: ignore[arg-type]
    except InfeasiblePlanError as exc:
        with pytest.raises(InfeasiblePlanError) as pruned_exc:
            search_layouts(profiles, 8, **kw)  # type: ignore[arg-type]
        assert str(pruned_exc.value) == str(exc)
        return
    pruned = search_layouts(profiles, 8, **kw)  # type: ignore[arg-type]
    assert pruned.counts["priced"] < full.counts["priced"] == full.counts["grid"]

    def ranked(lay: Layout) -> list[tuple[object, ...]]:
        return [(c.degrees, c.placement, c.step_s, c.simulated_step_s, c.boundaries, c.peak_memory_bytes)
                for c in lay.candidates[:5]]

    assert ranked(pruned) == ranked(full)
    assert pruned.plan is not None and full.plan is not None
    assert pruned.plan.boundaries == full.plan.boundaries
    assert pruned.plan.predicted_step_s == full.plan.predicted_step_s


def test_no_fit_names_the_smallest_limit_and_device_count_that_admit_a_layout() -> None:
    """The limit and the device count in the refusal are computed: the search finds a layout at that limit and
    none a hair below it; at that device count and none of the counts tried before it."""
    import re

    from stageplan.units import parse_bytes

    limit = 1.5 * GiB
    with pytest.raises(InfeasiblePlanError) as exc:
        search(memory_limit_bytes=limit)
    text = str(exc.value)
    assert "\n" not in text
    found = re.fullmatch(r"no layout of 8 devices fits 1.50 GiB per device \(176 candidates\): the "
                         r"smallest memory limit that admits one is [\d.]+ GiB \((?P<one>[^)]*)\); the "
                         r"smallest device count that admits one at 1.50 GiB is (?P<n>\d+) "
                         r"\((?P<other>[^)]*)\); raise --memory-limit to (?P<up>[\d.]+GiB), or use --devices "
                         r"(?P=n)", text)
    assert found is not None, text
    need = exc.value.min_memory_limit_bytes
    assert need is not None and limit < need <= parse_bytes(found["up"]) < need * 1.01
    at = search(memory_limit_bytes=need)
    assert at.best.peak_memory_bytes is not None and at.best.peak_memory_bytes <= need
    assert at.best.degrees == found["one"]
    assert search(memory_limit_bytes=parse_bytes(found["up"])).best.feasible
    with pytest.raises(InfeasiblePlanError):
        search(memory_limit_bytes=need * (1 - 1e-5))
    n = int(found["n"])
    assert search(n=n, memory_limit_bytes=limit).best.degrees == found["other"]
    for fewer in range(12, n, NET.devices_per_node):  # whole nodes of 4 above 8 devices
        with pytest.raises(StageplanError, match=r"no layout of \d+ devices fits"):
            search(n=fewer, memory_limit_bytes=limit)


def test_no_fit_where_a_layers_activations_overflow_any_device_count() -> None:
    with pytest.raises(InfeasiblePlanError) as exc:
        search(memory_limit_bytes=512 * 1024**2)
    assert ("a layer's activations for one microbatch alone take 1.12 GiB in every layout: the sequence "
            "does not fit without context parallelism, which stageplan does not model, at any device count; "
            "raise --memory-limit to ") in str(exc.value)
    need = exc.value.min_memory_limit_bytes
    assert need is not None and search(memory_limit_bytes=need).best.feasible
    with pytest.raises(InfeasiblePlanError):
        search(memory_limit_bytes=need * (1 - 1e-5))


def _interleaved_search(monkeypatch: pytest.MonkeyPatch) -> tuple[Layout, list[tuple[Candidate, Candidate,
                                                                                        object]]]:
    """12 blocks on 2 ranks x 3 chunks under 8 GiB, where the rank-level MILP's split simulates 3.4% faster
    than the chunk-by-chunk one; with each call of the MILP (the candidate in, out, and what it found)."""
    calls: list[tuple[Candidate, Candidate, object]] = []
    run_milp = layouts._milp_split

    def spy(search: object, c: Candidate, arrays: object) -> tuple[Candidate, object]:
        out, run = run_milp(search, c, arrays)  # type: ignore[arg-type]
        calls.append((c, out, run))
        return out, run

    monkeypatch.setattr(layouts, "_milp_split", spy)
    lay = search_layouts({(1, 1): lm_profile()}, 2, global_batch_size=8, network=NET, tensor_parallel=[1],
                         pipeline_parallel=[2], microbatch_sizes=[1], schedules=["Interleaved1F1B"],
                         virtual_stages=[3], recompute=[False], shardings=["ddp"], memory_limit_bytes=8 * GiB)
    return lay, calls


def test_an_interleaved_best_gets_the_rank_level_milp_split_and_its_proven_gap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lay, calls = _interleaved_search(monkeypatch)
    assert len(calls) == 1
    chunk, out, run = calls[0]
    assert isinstance(run, layouts._MilpRun) and run.kept and 1 <= run.nodes <= 2 * layouts.MILP_NODE_LIMIT
    # no slower than the chunk split, simulated and at the rank level (the MILP's objective)
    assert chunk.simulated_step_s is not None and out.simulated_step_s is not None
    assert out.simulated_step_s < chunk.simulated_step_s
    arr = LayerArrays.of(lm_profile(), 8)
    opts = make_options(lm_profile(), 2, num_microbatches=8, schedule="Interleaved1F1B", virtual_stages=3,
                        memory_limit_bytes=8 * GiB, bandwidth_bytes_per_s=NET.bandwidth(False))
    inp = solver_inputs(arr, opts)

    def slowest_rank(b: tuple[int, ...]) -> float:
        ranks = opts.shape.stage_ranks
        return max(sum(inp["costs"][b[c]:b[c + 1]].sum() + (inp["boundary_costs"][b[c + 1] - 1]
                                                            if c < len(ranks) - 1 else 0.0)
                       for c in range(len(ranks)) if ranks[c] == r) for r in range(2))

    assert chunk.boundaries is not None and out.boundaries is not None
    assert run.bottleneck == pytest.approx(slowest_rank(out.boundaries), rel=1e-9)
    assert run.bottleneck <= slowest_rank(chunk.boundaries) * (1 + 1e-9)
    assert run.gap >= 0 and run.gap == run.bottleneck / run.lower_bound - 1
    assert lay.best.boundaries == out.boundaries and lay.plan.boundaries == out.boundaries
    assert f"interleaved split by the rank-level MILP: within {run.gap:.1%} of its proven optimum" in \
        " ".join(lay.notes)
    assert not any("chunk by chunk" in n for n in lay.notes)


def test_an_interleaved_layout_is_the_same_twice_milp_split_included(monkeypatch: pytest.MonkeyPatch) -> None:
    a, calls_a = _interleaved_search(monkeypatch)
    b, calls_b = _interleaved_search(monkeypatch)
    assert a.to_json() == b.to_json() and a.notes == b.notes
    assert calls_a[0][1].boundaries == calls_b[0][1].boundaries and calls_a[0][2] == calls_b[0][2]
