"""--precision applied to a profile's bytes: activation and boundary bytes scaled to the precision's element
size (measured profiles), estimates refused in the wrong dtype, and the optimizer step priced at the bytes it
moves under the precision (closed forms)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli

from stageplan import LayerProfile, Profile, plan
from stageplan.errors import StageplanError
from stageplan.planning.costs import PRECISIONS
from stageplan.planning.precision import at_precision, step_bytes_per_parameter
from stageplan.profiling.optimizer import OPTIMIZER_PASSES

ROOT = Path(__file__).resolve().parents[2]
LLAMA_70B = ROOT / "profiles" / "estimate" / "llama2-70b-h100-sxm.json"

# Bytes one step moves per parameter, counted by hand: read w and g, write w, read and write each state; with
# an fp32 master copy, read the 16-bit g, read and write the fp32 master and states, write the 16-bit weight.
HAND_STEP_BYTES = {
    ("fp32", "sgd"): 4 + 4 + 4, ("fp32", "momentum"): 12 + 8, ("fp32", "adam"): 12 + 16,
    ("bf16", "sgd"): 2 + 2 + 2, ("bf16", "momentum"): 6 + 4, ("bf16", "adam"): 6 + 8,
    ("bf16-mixed", "sgd"): 2 + 8 + 2, ("bf16-mixed", "momentum"): 12 + 8, ("bf16-mixed", "adam"): 12 + 16,
    ("fp16-mixed", "adamw"): 28,
}


@pytest.mark.parametrize(("precision", "optimizer"), sorted(HAND_STEP_BYTES))
def test_step_bytes_are_the_hand_counts(precision: str, optimizer: str) -> None:
    assert step_bytes_per_parameter(precision, optimizer) == HAND_STEP_BYTES[precision, optimizer]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZER_PASSES))
def test_step_bytes_without_a_master_copy_are_the_profilers_passes(optimizer: str) -> None:
    for element in (2, 4):
        assert step_bytes_per_parameter(None, optimizer, element) == OPTIMIZER_PASSES[optimizer] * element
    # mixed precision moves twice a bf16 step's bytes, and as many as an fp32 step's
    mixed = step_bytes_per_parameter("bf16-mixed", optimizer)
    assert mixed == 2 * step_bytes_per_parameter("bf16", optimizer)
    assert mixed == step_bytes_per_parameter("fp32", optimizer)


def _fp32_profile() -> Profile:
    layers = tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 1000 * (i + 1), 400, 4000, param_count=1000,
                                optimizer_s={"sgd": 3e-4, "momentum": 5e-4, "adam": 7e-4, "adamw": 7e-4})
                   for i in range(4))
    meta = {"dtype": "float32", "timer": "perf_counter", "batch_size": 8, "microbatch_size": 2,
            "optimizer_step": {"floor_s": {"sgd": 1e-4, "momentum": 1e-4, "adam": 1e-4, "adamw": 1e-4}}}
    return Profile(layers, meta)


def test_a_fp32_profile_planned_as_bf16_mixed_prices_activations_at_2_bytes() -> None:
    prof = _fp32_profile()
    kept = plan(prof, 2, boundaries=(0, 2, 4), precision="fp32")
    mixed = plan(prof, 2, boundaries=(0, 2, 4), precision="bf16-mixed")
    for s_fp32, s_mixed, lo in zip(kept.stages, mixed.stages, (0, 2)):
        acts = sum(x.activation_bytes for x in prof.layers[lo:lo + 2])
        assert s_fp32.memory["activations"] == s_fp32.inflight * acts
        assert s_mixed.memory["activations"] == s_mixed.inflight * acts / 2
    # the send and receive buffers after stage 0: 2 x the boundary's 400 bytes, at 2 bytes per element
    assert kept.stages[0].memory["buffers"] == 2 * 400 and mixed.stages[0].memory["buffers"] == 2 * 200
    # fp32 Adam and bf16-mixed Adam move the same 28 bytes per parameter: the step keeps its measured time
    assert mixed.stages[0].optimizer_s == pytest.approx(kept.stages[0].optimizer_s)
    notes = [n for n in mixed.notes if n.startswith("precision bf16-mixed")]
    assert notes == ["precision bf16-mixed: activation and boundary bytes scaled x0.5 from the profiled "
                     "float32 (tensors kept in fp32 are undercounted; profile in bfloat16 to measure them)"]
    assert not any(n.startswith("precision") for n in kept.notes)  # nothing scaled, nothing said


def test_a_bf16_profile_planned_as_fp32_is_scaled_up_and_its_step_priced_at_fp32_bytes() -> None:
    prof = Profile(_fp32_profile().layers, {**_fp32_profile().meta, "dtype": "bfloat16"})
    priced = at_precision(prof, "fp32", "adam")
    doubled = [2 * x.activation_bytes for x in prof.layers]
    assert [x.activation_bytes for x in priced.profile.layers] == doubled
    assert [x.output_bytes for x in priced.profile.layers] == [800] * 4
    # above the 0.1 ms fixed cost, the step scales by 28 / 14 bytes per parameter
    assert priced.profile.layers[0].optimizer_s["adam"] == pytest.approx(1e-4 + 2 * 6e-4)
    assert priced.profile.layers[0].optimizer_s["sgd"] == pytest.approx(1e-4 + 2 * 2e-4)
    assert priced.note is not None and "scaled x2" in priced.note and "overcounted" in priced.note
    assert "adam step at 28 bytes per parameter (x2)" in priced.note


def test_a_profile_without_a_dtype_is_priced_as_profiled_and_says_so() -> None:
    prof = Profile(_fp32_profile().layers, {"timer": "perf_counter"})
    priced = at_precision(prof, "bf16-mixed")
    assert priced.profile is prof
    assert priced.note is not None and "names no dtype" in priced.note


def test_an_estimate_in_bf16_planned_as_bf16_mixed_prices_the_fp32_master_and_states() -> None:
    prof = Profile.load(LLAMA_70B)
    assert prof.meta["dtype"] == "bfloat16" and prof.meta["timer"] == "analytic"
    gpu = json.loads((ROOT / "stageplan" / "gpus.json").read_text())["gpus"]["h100-sxm"]
    rate = prof.meta["estimate"]["eta_m"] * gpu["memory_bandwidth"]
    bounds = (0, 41, len(prof))
    bf16 = plan(prof, 2, boundaries=bounds)
    mixed = plan(prof, 2, boundaries=bounds, precision="bf16-mixed")
    for stage_bf16, stage_mixed, (lo, hi) in zip(bf16.stages, mixed.stages, zip(bounds, bounds[1:])):
        count = sum(x.param_count for x in prof.layers[lo:hi])
        # closed form: bytes moved per parameter x parameters / (eta_m x bandwidth)
        assert stage_bf16.optimizer_s == pytest.approx(14 * count / rate, rel=1e-9)
        assert stage_mixed.optimizer_s == pytest.approx(28 * count / rate, rel=1e-9)
        assert stage_mixed.memory["activations"] == stage_bf16.memory["activations"]  # already 2 bytes
    assert any(n == "precision bf16-mixed: adam step at 28 bytes per parameter (x2)" for n in mixed.notes)
    assert math.isclose(mixed.predicted_step_s - bf16.predicted_step_s,
                        max(s.optimizer_s for s in mixed.stages) - max(s.optimizer_s for s in bf16.stages),
                        rel_tol=0.05)


def test_an_estimate_in_another_dtype_is_refused() -> None:
    prof = Profile.load(LLAMA_70B)
    with pytest.raises(StageplanError, match=r"precision fp32 computes in 4-byte elements, but this estimate "
                                             r"was made in bfloat16 \(2 bytes\); .* re-estimate with --dtype "
                                             r"float32, or plan without --precision"):
        plan(prof, 2, precision="fp32")
    assert set(PRECISIONS) == {"fp32", "bf16", "bf16-mixed", "fp16-mixed"}  # every one named above


def test_cli_plans_a_fp32_profile_as_bf16_mixed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, out = tmp_path / "fp32.json", tmp_path / "plan.json"
    _fp32_profile().save(path)
    code, stdout, err = run_cli(["plan", str(path), "--stages", "2", "--precision", "bf16-mixed",
                                 "-o", str(out)], capsys)
    assert code == 0, err
    assert "activation and boundary bytes scaled x0.5 from the profiled float32" in stdout + err
    data = json.loads(out.read_text())
    acts = [x.activation_bytes for x in _fp32_profile().layers]
    assert any("scaled x0.5" in n for n in data["notes"])
    for stage in data["stages"]:
        lo, hi = stage["first_layer"], stage["end_layer"]
        assert stage["memory"]["activations"] == stage["inflight"] * sum(acts[lo:hi]) / 2
    code, _, err = run_cli(["plan", str(LLAMA_70B), "--stages", "2", "--precision", "fp32"], capsys)
    assert_one_line_error(code, err,
                          r"this estimate was made in bfloat16 .* re-estimate with --dtype float32")
