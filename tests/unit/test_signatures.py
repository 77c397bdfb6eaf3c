"""stageplan.profiling.signatures: layers are measured apart when an attribute or the wiring differs, and
every member of a group of identical layers is checked against the figures it would reuse."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from torch import nn

from stageplan import Profile, Workload, profile_model
from stageplan.profiling.signatures import OFF_CAP, OFF_FLOOR, check_group, tolerance


def _sum_loss(out, _target):  # type: ignore[no-untyped-def]
    return out.sum()


class _Act(nn.Module):
    def __init__(self, act, loop_num: int = 1) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.act = act
        self.loop_num = loop_num

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.loop_num):
            x = self.act(self.lin(x))
        return x


@pytest.mark.parametrize("last", [_Act(lambda x: x), _Act(torch.tanh, loop_num=4)],
                         ids=["lambda", "loop_num"])
def test_dedup_measures_apart_what_an_attribute_changes(last: nn.Module) -> None:
    """Blocks that differ only in a function attribute (torch.tanh against a lambda: saves 256 B, not 512), or
    in an attribute named like a layer index but used as a count (loop_num), were taken as one layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _Act(torch.tanh), _Act(torch.tanh), _Act(torch.tanh), last,
                          nn.Linear(16, 16))
    wl = Workload(model, torch.randn(4, 16), loss_fn=_sum_loss)
    every = profile_model(wl, microbatch_size=4, warmup=0, repeats=1, dedup=False, order="layer")
    dedup = profile_model(wl, microbatch_size=4, warmup=0, repeats=1, order="layer")
    assert dedup.layers[3].measured_as == "2"  # the identical ones are still measured once
    assert dedup.layers[4].measured_as is None
    assert (
        dedup.layers[4].activation_bytes
        == every.layers[4].activation_bytes
        != every.layers[3].activation_bytes
    )


def test_a_graph_signature_follows_the_wiring_not_only_the_ops() -> None:
    from stageplan.profiling.signatures import _graph_signature

    def squared(x: torch.Tensor) -> torch.Tensor:
        a = torch.sigmoid(x)
        return a * a

    def gated(x: torch.Tensor) -> torch.Tensor:
        a = torch.sigmoid(x)
        return a * x

    sig = [_graph_signature(torch.fx.symbolic_trace(f).graph, lambda t: t) for f in (squared, gated, squared)]
    assert sig[0] != sig[1] and sig[0] == sig[2]


# --------------------------------------------------------------------------------------------------
# The check of every member: a block whose work depends on its index


class _Config:
    """What a model shares with its blocks (HF passes its config): the indices of the heavy blocks."""

    def __init__(self, heavy: tuple[int, ...], extra: int) -> None:
        self.heavy, self.extra = heavy, extra


class _Indexed(nn.Module):
    """A block that branches on ``self.layer_idx in cfg.heavy``: the heavy one runs ``cfg.extra`` more
    Linear+tanh. Its signature is the others' (layer_idx is left out of it, as HF's numbering must be)."""

    def __init__(self, width: int, layer_idx: int, cfg: _Config) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.layer_idx = layer_idx
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.lin(x))
        if self.layer_idx in self.cfg.heavy:
            for _ in range(self.cfg.extra):
                x = torch.tanh(self.lin(x))
        return x


WIDTH, SEQ, MB, EXTRA = 64, 16, 2, 20


def indexed_blocks(heavy: int = 4, extra: int = EXTRA, batch_size: int = 4) -> Workload:
    """Linear, six _Indexed blocks cut sequentially (layers '1' to '6', layer_idx 0 to 5), Linear."""
    torch.manual_seed(0)
    cfg = _Config((heavy,), extra)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), *[_Indexed(WIDTH, i, cfg) for i in range(6)],
                          nn.Linear(WIDTH, WIDTH))
    return Workload(model, torch.randn(batch_size, SEQ, WIDTH), loss_fn=_sum_loss, name="indexed_blocks")


HEAVY = "5"  # the block with layer_idx 4
LIGHT = ["1", "2", "3", "4", "6"]


@pytest.fixture(scope="module")
def every() -> Profile:
    """The oracle: each layer measured on its own (--no-dedup)."""
    return profile_model(indexed_blocks(), microbatch_size=MB, warmup=1, repeats=5, dedup=False,
                         streaming=False, order="layer")


@pytest.mark.parametrize("mode", ["layer", "stage", "streaming"])
def test_a_block_that_branches_on_its_layer_idx_gets_its_own_figures(mode: str, every: Profile) -> None:
    """With dedup, the heavy block had taken the second block's figures (measured_as '2'), 20x too small, and
    in a stage's order the light blocks' pooled medians; the check of every member finds it off (its forward
    21 Linear+tanh against 1) and measures it on its own."""
    opts = {"streaming": True} if mode == "streaming" else {"streaming": False, "order": mode}
    with pytest.warns(UserWarning, match=r"measured on their own: '5' \(\d+\.\d\dx '2''s forward\)"):
        prof = profile_model(indexed_blocks(), microbatch_size=MB, warmup=1, repeats=5, **opts)
    rows = {x.name: x for x in prof.layers}
    heavy, light = rows[HEAVY], [rows[k] for k in LIGHT]
    assert heavy.measured_as is None  # its own figures
    # Hand count: a light block saves its input and its tanh's output (the Linear's input and tanh's output),
    # the heavy one also the output of each extra tanh (each the next Linear's input), in float32.
    unit = 4 * MB * SEQ * WIDTH
    assert [x.activation_bytes for x in light] == [2 * unit] * 5
    assert heavy.activation_bytes == (2 + EXTRA) * unit == every.layers[5].activation_bytes
    # 21x the light blocks' matmuls and tanh: asserted at 4x, far from a shared host's noise
    assert heavy.forward_s >= 4 * statistics.median(x.forward_s for x in light), (heavy, light)
    assert heavy.backward_s >= 4 * statistics.median(x.backward_s for x in light), (heavy, light)
    # and what measuring it alone reads, within a shared host's noise
    assert 1 / 3 <= heavy.forward_s / every.layers[5].forward_s <= 3, (heavy, every.layers[5])
    # the profile names it, and the check covered every member of the group
    (apart,) = prof.meta["measured_apart"]
    assert apart["layer"] == HEAVY and apart["as"] == "2" and apart["forward_ratio"] >= 4
    assert OFF_FLOOR <= apart["tolerance"] <= OFF_CAP
    (check,) = prof.meta["dedup_checks"]
    assert check["as"] == "2" and check["layers"] == sorted([*LIGHT, HEAVY])
    ratios = dict(zip(check["layers"], check["forward_ratio"]))
    assert all(1 / check["tolerance"] <= ratios[k] <= check["tolerance"] for k in LIGHT), check
    if mode == "stage":
        # every layer timed in its place; the heavy one no longer in the light ones' pool
        assert all(x.measured_as is None for x in prof.layers)
        assert prof.meta["pooled_layers"] == [["2", "3", "4"]]
    else:
        assert [x.measured_as for x in prof.layers] == [None, None, None, "2", "2", None, "2", None]
        # the two Linears, blocks 1 and 2, the heavy one, and block 3 (the spread check's third member)
        assert prof.meta["layers_measured"] == 6 and prof.meta["layers_reused"] == 3


def test_the_cli_profiles_the_counterexample_and_names_the_heavy_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a user runs it: ``stageplan profile MODULE:FACTORY --streaming`` on a model file."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    out = tmp_path / "p.json"
    code, _, err = run_cli([
        "profile", f"{Path(__file__).stem}:indexed_blocks", "--streaming", "--microbatch-size", str(MB),
        "--warmup", "1", "--repeats", "3", "--quiet", "-o", str(out)], capsys)
    sys.modules.pop(Path(__file__).stem, None)  # imported again by name: leave no second copy behind
    assert code == 0, err
    assert "warning: measured on their own: '5'" in err
    data = json.loads(out.read_text())
    assert [x["measured_as"] for x in data["layers"]] == [None, None, None, "2", "2", None, "2", None]
    assert [a["layer"] for a in data["meta"]["measured_apart"]] == [HEAVY]


def test_identical_members_stay_deduplicated_and_an_estimate_is_not_checked() -> None:
    """No heavy block: every member within the tolerance, nothing measured apart; an estimate has no timer
    noise to rule out (its dedup_checks and measured_apart are None)."""
    wl = indexed_blocks(heavy=-1)
    prof = profile_model(wl, microbatch_size=MB, warmup=0, repeats=2, streaming=True)
    assert prof.meta["measured_apart"] == [] and len(prof.meta["dedup_checks"]) == 1
    assert [x.measured_as for x in prof.layers] == [None, None, None, "2", "2", "2", "2", None]
    est = profile_model(wl, microbatch_size=MB, device="estimate:h100-sxm")
    assert est.meta["dedup_checks"] is None and est.meta["measured_apart"] is None


def test_the_tolerance_follows_the_groups_spread_within_its_floor_and_cap() -> None:
    quiet = [[1.0, 1.0, 1.0, 1.0, 1.0]] * 3
    assert tolerance(quiet) == OFF_FLOOR == 1.5
    # a relative IQR of 0.2 (IQR 0.2 over a median of 1.0): 1 + 3 x 0.2
    assert tolerance([[0.9, 0.9, 1.0, 1.1, 1.1], [1.0] * 5]) == pytest.approx(1.6)
    assert tolerance([[1.0, 5.0, 9.0]]) == OFF_CAP == 3.0  # however noisy, a 3x-off member is off
    # each member's least sample against the representative's
    c = check_group(2, {1: [1.2, 9.0], 2: [1.0, 1.1], 3: [0.6, 0.7], 5: [20.0, 21.0]})
    assert c.members == (1, 2, 3, 5) and c.forward == pytest.approx((1.2, 1.0, 0.6, 20.0))
    assert c.off() == [5] and c.tolerance == OFF_CAP
    assert check_group(2, {2: [1.0] * 3, 3: [0.6] * 3}).off() == [3]  # 1/0.6 = 1.67x: beyond the floor
