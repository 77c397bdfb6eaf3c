"""Tensor-parallel layouts run on a ("pp", "tp") mesh of local ranks: a small HF LLaMA (grouped-query
attention) sharded by its own base_model_tp_plan trains as one process does (--check), and every rank's
all-reduces in a step equal the cost model's count, checked against the closed form written out here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stageplan.cli import main
from stageplan.formats.profile import Profile
from stageplan.formats.runreport import RunReport
from stageplan.layouting import layout
from stageplan.profiling.shards import estimate_hf_profiles
from stageplan.running.launch import run

pytestmark = pytest.mark.slow

# 4 blocks, hidden 64, 4 attention heads over 2 key/value heads (each shard: 2 heads, 1 key/value head)
CONFIG = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128, "num_hidden_layers": 4, "vocab_size": 256, "max_position_embeddings": 64,
          "tie_word_embeddings": False}
SEQ, BATCH, M = 16, 8, 4  # microbatches of 2
NET = {"intra_node_bandwidth": "5GB/s", "inter_node_bandwidth": "5GB/s"}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tp") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


@pytest.fixture(scope="module")
def shard_profile(config: str) -> Profile:
    """One 2-way shard's block measured on this CPU, repeated to the model's four blocks."""
    profiles, _ = estimate_hf_profiles({"config": config, "seq_len": SEQ}, device="cpu", microbatch_sizes=[2],
                                       tensor_parallel=[2])
    return profiles[(2, 2)]


def _counts(report: RunReport) -> dict[tuple[int, int], tuple[dict[str, int], dict[str, int]]]:
    return {(r["mesh"]["pp"], r["mesh"]["tp"]): (r["measured_tp_collectives"], r["predicted_tp_collectives"])
            for r in [*report.ranks, *report.replicas]}


@pytest.mark.parametrize("recompute", [False, True])
def test_a_2x2_tensor_parallel_pipeline_trains_as_one_process_and_counts_its_all_reduces(
        config: str, shard_profile: Profile, recompute: bool) -> None:
    """p = 2 x t = 2 on four ranks, 1F1B: the shards' parameters, gathered whole, and the losses equal one
    process's; each rank holds two blocks, so per step 2 blocks x 4 microbatches x 2 all-reduces forward and
    the same backward; with recompute the forward's again inside the backward, but for rank 0's last one per
    microbatch (its stage ends with a block, and checkpoint stops recomputing before it)."""
    lay = layout([shard_profile], 4, global_batch_size=BATCH, devices_per_node=4, precision="fp32",
                 optimizer="sgd", tensor_parallel=[2], pipeline_parallel=[2], microbatch_sizes=[2],
                 schedules=["1F1B"], recompute=[recompute], shardings=["ddp"], **NET)
    assert lay.plan is not None and lay.plan.profile_meta["tensor_parallel"] == 2
    assert lay.plan.boundaries == (0, 3, 6)  # embedding + 2 blocks | 2 blocks + norm and head
    report = run("hf", lay.plan, factory_options={"config": config, "seq_len": SEQ, "batch_size": BATCH},
                 steps=2, warmup=1, optimizer="sgd", check=True, retime=False, timeout_s=240)
    assert report.check is not None and report.check["passed"], report.check
    assert report.check["max_loss_diff"] < 1e-5
    # every parameter of the model, gathered whole, on each of the 2 shards
    assert report.check["params_compared"] == 2 * (1 + 4 * 9 + 2)
    assert report.check["grads_compared"] == report.check["params_compared"]  # the shards' whole gradients
    assert report.check["max_grad_diff"] < 1e-6, report.check
    assert not report.check["not_trained_by_pipeline"]
    assert report.meta["mesh"] == {"pp": 2, "dp": 1, "tp": 2}
    forward = 2 * 2 * M
    backward = {0: 2 * 2 * M + (forward - M if recompute else 0),
                1: 2 * 2 * M + (forward if recompute else 0)}
    counts = _counts(report)
    assert sorted(counts) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for (pp, _), (measured, predicted) in counts.items():
        assert measured == predicted == {"forward": forward, "backward": backward[pp]}


def test_one_stage_of_two_shards_runs_from_the_cli(config: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """p = 1 x t = 2 through the documented commands: layout measures the shard on this CPU, run trains the
    layout's best on two ranks and checks it; the run's table says the counts."""
    out = tmp_path / "layout.json"
    assert main(["layout", "hf", "--set", f"config={config}", "--set", f"seq_len={SEQ}", "--device", "cpu",
                 "--devices", "2", "--devices-per-node", "2", "--global-batch-size", str(BATCH),
                 "--tensor-parallel", "2", "--pipeline-parallel", "1", "--microbatch-sizes", "2",
                 "--schedule", "GPipe", "--recompute", "none", "--sharding", "ddp", "--precision", "fp32",
                 "--optimizer", "sgd", "--intra-node-bandwidth", "5GB/s", "--inter-node-bandwidth", "5GB/s",
                 "--quiet", "-o", str(out)]) == 0
    report_path = tmp_path / "run.json"
    assert main(["run", "hf", "--set", f"config={config}", "--set", f"seq_len={SEQ}", "--set",
                 f"batch_size={BATCH}", "--plan", str(out), "--check", "--steps", "2", "--warmup", "1",
                 "--optimizer", "sgd", "--no-retime", "--quiet", "-o", str(report_path)]) == 0
    text = capsys.readouterr().out
    assert "check: PASS" in text
    assert "tensor parallel: mesh 1 x 2 (pp x tp)" in text and "(0,1) 32+32/32+32" in text
    counts = _counts(RunReport.load(report_path))
    each = {"forward": 32, "backward": 32}
    assert counts == {(0, t): (each, each) for t in (0, 1)}
