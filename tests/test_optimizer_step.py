"""The optimizer step per stage: measured per layer by the profiler, summed per stage by the cost model, run by
each rank after its last backward in the simulator (kind "O"), and left out of what the solver balances."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SCHEDULE_CASES
from torch import nn

from stageplan import LayerProfile, Profile, Workload, profile_model
from stageplan.errors import SchemaError
from stageplan.formats.plan import Plan
from stageplan.planning.costs import Device, LayerArrays, evaluate, make_options
from stageplan.planning.planner import plan
from stageplan.planning.schedules import simulate
from stageplan.planning.search import SplitCosts
from stageplan.profiling.optimizer import OPTIMIZER_PASSES
from stageplan.report import plan_table

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "tests" / "data" / "old-format" / "gpt-12l-v16k.json"  # written before optimizer records existed
NOTE = "optimizer step not measured in this profile: re-profile to include it"


def _sum_loss(out: torch.Tensor, target: object) -> torch.Tensor:
    return out.sum()


def _quiet_plan(*args, **kwargs) -> Plan:  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan(*args, **kwargs)


def _with_optimizer(prof: Profile, seconds_per_param_byte: float = 1e-10) -> Profile:
    """The profile with synthetic optimizer times proportional to each layer's parameter bytes x passes."""
    layers = tuple(LayerProfile(**{**x.__dict__, "optimizer_s": {k: n * x.param_bytes * seconds_per_param_byte
                                                                  for k, n in OPTIMIZER_PASSES.items()}})
                   for x in prof.layers)
    return Profile(layers, dict(prof.meta))


# -- the simulator against closed forms ---------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
@pytest.mark.parametrize(("p", "m"), [(2, 2), (3, 5), (4, 8), (8, 16)])
def test_equal_stages_step_is_the_closed_form_plus_one_optimizer_step(schedule: str, p: int, m: int) -> None:
    # Balanced stages: rank 0 ends its last backward last, at (m + p - 1)(f + b); its optimizer step follows.
    f, b, o = 1.0, 2.0, 0.75
    sim = simulate(schedule, [f] * p, [b] * p, m, optimizer_s=[o] * p)
    step = (m + p - 1) * (f + b) + o
    assert sim.step_s == pytest.approx(step, rel=1e-12)
    # optimizer time is busy time: each rank idles (p - 1)(f + b)
    assert sim.busy_s == pytest.approx([m * (f + b) + o] * p)
    assert sim.bubble_fraction == pytest.approx((p - 1) * (f + b) / step, rel=1e-12)


def test_each_rank_steps_after_its_own_last_backward() -> None:
    # 1F1B, equal stages: rank r ends its last backward at (m + p - 1)(f + b) - r b; its optimizer step o_r follows,
    # and the step ends when the last of them does.
    p, m, f, b = 4, 8, 1.0, 2.0
    o = [0.0, 1.0, 3.0, 10.0]
    sim = simulate("1F1B", [f] * p, [b] * p, m, optimizer_s=o)
    ends = [(m + p - 1) * (f + b) - r * b for r in range(p)]
    assert sim.step_s == pytest.approx(max(e + x for e, x in zip(ends, o)))
    events = {e.rank: e for e in sim.timeline if e.kind == "O"}
    assert sorted(events) == [1, 2, 3]  # a rank without an optimizer step gets no event
    for r, e in events.items():
        assert (e.start_s, e.end_s, e.microbatch, e.stage) == pytest.approx((ends[r], ends[r] + o[r], -1, r))
        assert all(x.end_s <= e.start_s for x in sim.timeline if x.rank == r and x.kind != "O")


def test_interleaved_rank_runs_one_optimizer_step_over_its_chunks() -> None:
    sim = simulate("Interleaved1F1B", [1.0] * 4, [2.0] * 4, 4, virtual_stages=2, optimizer_s=[0.5, 0.25, 1.0, 2.0])
    events = sorted((e.rank, e.stage, e.end_s - e.start_s) for e in sim.timeline if e.kind == "O")
    assert events == [(0, 0, pytest.approx(1.5)), (1, 1, pytest.approx(2.25))]
    without = simulate("Interleaved1F1B", [1.0] * 4, [2.0] * 4, 4, virtual_stages=2)
    assert not [e for e in without.timeline if e.kind == "O"]


def test_the_timeline_draws_the_optimizer_step_with_its_own_colour_and_legend() -> None:
    import matplotlib

    matplotlib.use("Agg")
    from stageplan.plots import COLORS, plot_timeline

    ax = plot_timeline(simulate("1F1B", [1.0] * 2, [2.0] * 2, 4, optimizer_s=[0.5, 0.5]))
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["forward", "backward", "optimizer", "idle"]
    assert COLORS["O"] not in {COLORS[k] for k in ("F", "B", "I", "W", "idle")}


def test_optimizer_times_are_validated() -> None:
    with pytest.raises(ValueError, match=r"optimizer_s must have 2 values, got 3; pass one optimizer-step time per stage"):
        simulate("1F1B", [1.0, 1.0], [1.0, 1.0], 2, optimizer_s=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"optimizer_s must be finite and >= 0 seconds, got optimizer_s\[1\] = -1.0"):
        simulate("1F1B", [1.0, 1.0], [1.0, 1.0], 2, optimizer_s=[1.0, -1.0])


# -- the cost model -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("schedule", "p", "m", "v"), SCHEDULE_CASES)
def test_split_costs_price_the_optimizer_step_as_evaluate_does(schedule: str, p: int, m: int, v: int) -> None:
    rng = np.random.default_rng(11)
    n = 11
    layers = tuple(LayerProfile(f"l{i}", float(a), float(b), 0, 1, 4, optimizer_s={"adam": float(o), "sgd": float(o) / 3})
                   for i, (a, b, o) in enumerate(zip(rng.lognormal(0, 1, n), rng.lognormal(0, 1, n),
                                                     rng.lognormal(1, 1, n))))
    prof = Profile(layers)
    devices = [Device(speed=1.0 + r) for r in range(p)]
    for optimizer in ("adam", "sgd", "none"):
        opts = make_options(prof, p, num_microbatches=m, schedule=schedule, virtual_stages=v, optimizer=optimizer,
                            devices=devices, bandwidth_bytes_per_s=40.0, boundary_latency_s=0.25)
        arr = LayerArrays.of(prof, m)
        costs = SplitCosts(arr, opts)
        splits = np.array([[0, *sorted(rng.choice(np.arange(1, n), opts.num_chunks - 1, replace=False)), n]
                           for _ in range(12)])
        f, b, c, _ = costs.split(splits)
        steps = costs.steps(f, b, c, costs.optimizer(splits))
        for row, cuts in enumerate(splits):
            ev = evaluate(arr, cuts, opts)
            assert steps[row] == pytest.approx(ev.predicted_step_s, rel=1e-12, abs=0)
            opt = [sum(layers[k].optimizer_s[optimizer] for k in range(st.first_layer, st.end_layer))  # type: ignore[index]
                   / devices[st.rank].speed if optimizer != "none" else 0.0 for st in ev.stages]
            assert [st.optimizer_s for st in ev.stages] == pytest.approx(opt, rel=1e-12)
            assert NOTE not in ev.notes


@pytest.mark.parametrize(("schedule", "p", "m", "v"), SCHEDULE_CASES)
def test_the_steps_fixed_cost_is_paid_once_per_rank(schedule: str, p: int, m: int, v: int) -> None:
    """With the profile's per-step floor, a stage's optimizer time is its layers' times less the floor each (not
    below 0; untrained layers 0) and the floor once on the rank's first chunk, where the rank steps anything: the
    closed form, and the vectorised replay agreeing with evaluate."""
    rng = np.random.default_rng(5)
    n = 13
    raw = rng.lognormal(0, 1, n)
    raw[[2, 3, 11, 12]] = 0.0  # no parameters
    raw[5] = 0.05  # below the floor: its net is 0, but its rank still steps
    layers = tuple(LayerProfile(f"l{i}", 1.0 + i % 3, 2.0, 0, 1, 4, optimizer_s={"adam": float(o), "sgd": float(o) / 3})
                   for i, o in enumerate(raw))
    floor = {"adam": 0.2, "sgd": 0.1}
    prof = Profile(layers, {"optimizer_step": {"floor_s": floor}})
    devices = [Device(speed=1.0 + r) for r in range(p)]
    for optimizer in ("adam", "sgd"):
        opts = make_options(prof, p, num_microbatches=m, schedule=schedule, virtual_stages=v, optimizer=optimizer,
                            devices=devices)
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


def test_an_old_profile_plans_with_the_note_and_the_same_boundaries() -> None:
    old = Profile.load(GPT)
    assert all(x.optimizer_s is None for x in old.layers)
    new = _with_optimizer(old)
    for schedule, p, v in (("1F1B", 4, 1), ("GPipe", 2, 1), ("Interleaved1F1B", 2, 2)):
        a = _quiet_plan(old, p, num_microbatches=2 * p, schedule=schedule, virtual_stages=v)
        b = _quiet_plan(new, p, num_microbatches=2 * p, schedule=schedule, virtual_stages=v)
        assert NOTE in a.notes and NOTE not in b.notes
        assert a.bottleneck_s == b.bottleneck_s  # the solver balances per-microbatch time only
        assert a.boundaries == b.boundaries
        assert b.predicted_step_s > a.predicted_step_s
        assert b.simulate().step_s == pytest.approx(b.predicted_step_s, rel=1e-12)
        assert any(e.kind == "O" for e in b.simulate().timeline)
        assert sum(st.optimizer_s for st in b.stages) == pytest.approx(sum(x.optimizer_s["adam"] for x in new.layers))  # type: ignore[index]
    assert "optimizer ms" in plan_table(b)


def test_plan_json_keeps_the_optimizer_step_and_old_plans_load() -> None:
    pl = _quiet_plan(_with_optimizer(Profile.load(GPT)), 2, num_microbatches=4)
    again = Plan.from_json(json.loads(json.dumps(pl.to_json())))
    assert [st.optimizer_s for st in again.stages] == [st.optimizer_s for st in pl.stages]
    data = pl.to_json()
    for st in data["stages"]:
        del st["optimizer_s"]
    assert [st.optimizer_s for st in Plan.from_json(data).stages] == [0.0, 0.0]


# -- the profile --------------------------------------------------------------------------------------------------


def test_profile_json_round_trip_and_digest() -> None:
    old = Profile.load(GPT)
    new = _with_optimizer(old)
    assert Profile.from_json(json.loads(json.dumps(new.to_json()))) == new
    assert Profile.from_json(json.loads(json.dumps(old.to_json()))).layers[0].optimizer_s is None
    assert new.to_json()["schema"] == "stageplan.profile/1"
    assert old.digest() == Profile.from_json(json.loads(GPT.read_text())).digest()  # absent: digest as before
    assert new.digest() != old.digest()  # measured: a cost the plan was made from


def test_bad_optimizer_times_are_refused() -> None:
    data = Profile.load(GPT).to_json()
    data["layers"][0]["optimizer_s"] = {"adam": -1.0}
    with pytest.raises(SchemaError, match=r"layer 0 \('tok_emb\+pos_emb'\) has optimizer_s = \{'adam': -1.0\}; it must map "
                                          r"optimizer names to finite seconds >= 0, or be null; re-profile the model"):
        Profile.from_json(data)


# -- the profiler -------------------------------------------------------------------------------------------------


def test_profiler_times_adam_above_sgd_on_a_big_linear_and_leaves_the_model_alone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU())
    before = [p.detach().clone() for p in model.parameters()]
    prof = profile_model(Workload(model, torch.randn(4, 1024), loss_fn=_sum_loss), microbatch_size=4, warmup=1,
                         repeats=5, streaming=False)
    lin, relu = prof.layers
    assert lin.optimizer_s is not None and set(lin.optimizer_s) == {"sgd", "momentum", "adam", "adamw"}
    assert 0 < lin.optimizer_s["sgd"] < lin.optimizer_s["adam"]  # adam reads and writes two more states
    assert relu.optimizer_s == {"sgd": 0.0, "momentum": 0.0, "adam": 0.0, "adamw": 0.0}  # no parameters
    assert all(p.grad is None and torch.equal(p, q) for p, q in zip(model.parameters(), before))
    floors = prof.meta["optimizer_step"]["floor_s"]  # one step's fixed cost, timed on a single tiny parameter
    assert set(floors) == {"sgd", "momentum", "adam", "adamw"}
    assert all(0 < floors[k] < lin.optimizer_s[k] for k in floors)  # a 1M-parameter layer's step costs more


class _Detached(nn.Module):
    """A linear layer plus a parameter its backward never reaches (used detached): that parameter gets no gradient."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 3)
        self.offset = nn.Parameter(torch.zeros(1, 1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.offset.detach()


@pytest.mark.parametrize(("streaming", "sparse"), [(False, False), (True, False), (False, True)])
def test_each_layers_step_is_timed_on_the_gradient_its_own_backward_made(monkeypatch: pytest.MonkeyPatch,
                                                                         streaming: bool, sparse: bool) -> None:
    """An embedding's gradient is zero on the rows its batch does not use, and a CPU Adam step over those zeros
    costs twice one over ones (torch's sqrt of 0): so the profiler steps the layer's own gradient. Oracle: with the
    output's gradient all ones, row r of the table's gradient is (times r occurs in the batch) x ones; a sparse
    table's gradient is stepped as its dense equal (torch's dense optimizers refuse sparse ones); a parameter the
    backward does not reach is not stepped, as torch's optimizers skip a None gradient."""
    from stageplan.profiling import optimizer as profiler

    seen: list[list[torch.Tensor]] = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[no-untyped-def,override]
            seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
            return super().step(closure)

    monkeypatch.setattr(profiler, "_OPTIMIZERS", {**profiler._OPTIMIZERS, "sgd": lambda ps: Recording(ps, lr=1e-3)})
    torch.manual_seed(0)
    vocab, dim = 64, 4
    model = nn.Sequential(nn.Embedding(vocab, dim, sparse=sparse), _Detached(dim))
    idx = torch.randint(0, vocab // 4, (4, 6))  # rows 16..63 unused: their gradient is 0
    profile_model(Workload(model, idx, loss_fn=_sum_loss), microbatch_size=4, warmup=0, repeats=2,
                  streaming=streaming)
    table = [g for grads in seen for g in grads if g.shape == (vocab, dim)]
    assert table, "the embedding's step was not timed"
    expected = torch.bincount(idx.flatten(), minlength=vocab).float()[:, None].expand(vocab, dim)
    for g in table:
        torch.testing.assert_close(g, expected)
    head = [g for grads in seen for g in grads if g.shape == (3, dim)]  # the last layer: the loss's own gradient
    expected_head = torch.ones(3, 1) * model[0](idx).detach().sum(dim=(0, 1))[None, :]
    assert head
    for g in head:
        torch.testing.assert_close(g, expected_head)
    assert not [g for grads in seen for g in grads if g.shape == (1, 1, 3)]  # the detached parameter: never stepped


def test_identical_layers_reuse_the_measured_optimizer_step() -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])  # 1..4 alike: 3 and 4 reuse 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the spread of two tiny layers on a shared machine
        prof = profile_model(Workload(model, torch.randn(4, 64), loss_fn=_sum_loss), microbatch_size=4, warmup=0,
                             repeats=2, streaming=True)
    rows = {x.name: x for x in prof.layers}
    assert any(x.measured_as is not None for x in prof.layers)
    for x in prof.layers:
        assert x.optimizer_s is not None
        if x.measured_as is not None:
            assert x.optimizer_s == rows[x.measured_as].optimizer_s


def test_estimate_prices_the_optimizer_step_by_bytes_moved() -> None:
    from stageplan.profiling.estimate import gpu_spec

    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    prof = profile_model(Workload(model, torch.randn(4, 256), loss_fn=_sum_loss), microbatch_size=4,
                         device="estimate:h100-sxm")
    rate = 0.7 * gpu_spec("h100-sxm").memory_bandwidth  # the default eta_m
    for x in prof.layers:
        assert x.optimizer_s == pytest.approx({k: n * x.param_bytes / rate for k, n in OPTIMIZER_PASSES.items()})
