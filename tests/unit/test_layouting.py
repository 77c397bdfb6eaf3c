"""stageplan.layout and `stageplan layout` from stored profiles: the search, the user's own layout scored
beside it, the exports, `show`, and bad input in one line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stageplan.cli import main
from stageplan.errors import StageplanError
from stageplan.formats.layout import Layout
from stageplan.layouting import layout, parse_given
from unit.test_layouts import lm_profile

LINKS = ["--intra-node-bandwidth", "100GB/s", "--inter-node-bandwidth", "10GB/s", "--devices-per-node", "4"]


@pytest.fixture
def profile_path(tmp_path: Path) -> str:
    path = tmp_path / "profile.json"
    lm_profile().save(path)
    return str(path)


def test_api_lays_out_stored_profiles_and_scores_a_given_layout(profile_path: str) -> None:
    lay = layout(profile_path, 8, global_batch_size=16, devices_per_node=4, intra_node_bandwidth="100GB/s",
                 inter_node_bandwidth="10GB/s", memory_limit="6GiB", microbatch_sizes=[1],
                 given="tp=1,pp=4,dp=2,mbs=1,sharding=zero1,layout=Et*3|t*3|t*3|t*3L")
    assert lay.best.feasible and lay.plan is not None
    given = lay.given
    assert given is not None
    assert (given.pipeline_parallel, given.data_parallel, given.sharding) == (4, 2, "zero1")
    assert given.boundaries == (0, 4, 7, 10, 14)
    assert given.step_s >= lay.best.step_s * (1 - 1e-12)  # the best is at least as fast as any layout


def test_parse_given_reads_megatron_names_and_the_layout_last() -> None:
    assert parse_given("tp=2,pp=4,dp=1,mbs=2,vp=3,sp=1,recompute=full,layout=E,t*2|t*2,L") == {
        "layout": "E,t*2|t*2,L", "t": 2, "p": 4, "d": 1, "b": 2, "v": 3, "sp": True, "recompute": True}
    with pytest.raises(StageplanError, match=r"--given takes key=value pairs among .*, got 'ep=2'"):
        parse_given("tp=2,ep=2")


def test_given_degrees_must_multiply_to_the_devices(profile_path: str) -> None:
    with pytest.raises(StageplanError, match=r"--given's degrees multiply to 4 x 4 x 1 = 16, not the 8 "
                                             r"devices; give tp, pp and dp whose product is 8"):
        layout(profile_path, 8, global_batch_size=16, intra_node_bandwidth=1e11, inter_node_bandwidth=1e10,
               microbatch_sizes=[1], given="pp=4,dp=4")
    with pytest.raises(StageplanError, match=r"--given's b x dp = 2 x 4 does not divide the global batch 12"):
        layout(profile_path, 8, global_batch_size=12, intra_node_bandwidth=1e11, inter_node_bandwidth=1e10,
               microbatch_sizes=[1], given="pp=2,dp=4,mbs=2")


def test_context_parallelism_and_unpriced_links_are_refused(profile_path: str) -> None:
    with pytest.raises(StageplanError, match=r"context parallelism \(cp = 2\) is not modelled"):
        layout(profile_path, 8, global_batch_size=16, context_parallel=2)
    with pytest.raises(StageplanError, match=r"a layout prices its links: give --intra-node-bandwidth and "
                                             r"--inter-node-bandwidth"):
        layout(profile_path, 8, global_batch_size=16)


def test_cli_layout_writes_a_layout_that_show_reads_and_plots(profile_path: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "layout.json"
    rc = main(["layout", profile_path, "--devices", "8", "--global-batch-size", "16", "--memory-limit",
               "6GiB", "--microbatch-sizes", "1,2", "--quiet", "-o", str(out), *LINKS])
    assert rc == 0
    text = capsys.readouterr().out
    assert "layouts of 8 devices (4 a node, 6 GiB each), global batch 16" in text
    assert "searched " in text and "priced " in text
    data = json.loads(out.read_text())
    assert data["schema"] == "stageplan.layout/1"
    best = Layout.load(out).best
    assert best.pipeline_parallel * best.data_parallel * best.tensor_parallel == 8
    assert best.microbatch_size * best.num_microbatches * best.data_parallel == 16
    assert main(["show", str(out), "--plot", str(tmp_path / "layout.png")]) == 0
    shown = capsys.readouterr().out
    assert f"best {best.degrees}" in shown
    assert (tmp_path / "layout.png").stat().st_size > 10_000


def test_cli_exports_the_best_layout_or_refuses_in_one_line(profile_path: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    args = ["layout", profile_path, "--devices", "8", "--global-batch-size", "16", "--microbatch-sizes", "1",
            "--quiet", *LINKS]
    assert main([*args, "--sharding", "zero1", "--pipeline-parallel", "4", "--export", "megatron"]) == 0
    out = capsys.readouterr().out
    assert "--pipeline-model-parallel-size 4" in out and "--use-distributed-optimizer" in out
    assert "--global-batch-size 16" in out and '--pipeline-model-parallel-layout "E' in out
    assert main([*args, "--sharding", "zero1", "--pipeline-parallel", "4", "--export", "torchtitan"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torchtitan has no zero1" in err
    assert main([*args, "--sharding", "fsdp", "--pipeline-parallel", "4", "--schedule", "1F1B",
                 "--export", "torchtitan"]) == 0
    toml = capsys.readouterr().out
    assert "data_parallel_shard_degree = 2" in toml and "pipeline_parallel_degree = 4" in toml
    assert main([*args, "--sharding", "fsdp", "--pipeline-parallel", "4", "--export", "deepspeed"]) == 2
    assert "DeepSpeed's pipeline engine refuses ZeRO stage 2 and 3" in capsys.readouterr().err


@pytest.mark.parametrize(("extra", "message"), [
    (["--context-parallel", "2"], "context parallelism (cp = 2) is not modelled"),
    (["--tensor-parallel", "8"],
     "tensor parallelism stays within a node: t = 8 exceeds the 4 devices per node"),
    (["--recompute", "some"], "--recompute takes none, full or none,full"),
    (["--memory-limit", "100MiB"], "no layout of 8 devices fits 100.00 MiB per device"),
])
def test_cli_bad_input_is_one_line_and_exit_2(profile_path: str, capsys: pytest.CaptureFixture[str],
                                              extra: list[str], message: str) -> None:
    rc = main(
        ["layout", profile_path, "--devices", "8", "--global-batch-size", "16", "--quiet", *LINKS, *extra])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_run_takes_a_layouts_plan_with_replicas_and_refuses_replicas_of_tensor_parallel_shards(
        profile_path: str, tmp_path: Path) -> None:
    """A layout's best (p = 4, d = 2) is what run trains, on 8 ranks; replicas of t-way shards are not run."""
    import dataclasses

    import torch

    from stageplan.running.launch import load_plan
    from stageplan.running.tensor import check_tensor_parallel_run

    lay = layout(profile_path, 8, global_batch_size=16, devices_per_node=4, intra_node_bandwidth=1e11,
                 inter_node_bandwidth=1e10, microbatch_sizes=[1], pipeline_parallel=[4], shardings=["ddp"])
    path = tmp_path / "layout.json"
    lay.save(path)
    loaded = load_plan(path)
    assert (loaded.num_ranks, loaded.data_parallel) == (4, 2)
    assert lay.plan is not None
    sharded = dataclasses.replace(lay.plan, profile_meta={**lay.plan.profile_meta, "tensor_parallel": 2})
    with pytest.raises(StageplanError, match=r"this plan has 2 data-parallel replicas of 2-way "
                                             r"tensor-parallel shards, and stageplan run trains replicas or "
                                             r"shards, not both"):
        check_tensor_parallel_run(torch.nn.Linear(1, 1), load_plan(sharded))


# The fields of torchtitan's JobConfig sections that the torchtitan export writes, as torchtitan/config/
# job_config.py declares them at commit 000204a4a8bf (the release the export names): Parallelism, Training,
# ActivationCheckpoint. Older releases named the split module_fqns_per_model_part; a key outside these sets
# would be refused by that torchtitan's config parser.
TORCHTITAN_FIELDS = {
    "parallelism": {"data_parallel_replicate_degree", "enable_compiled_autograd",
                    "data_parallel_shard_degree",
                    "fsdp_reshard_after_forward", "tensor_parallel_degree", "disable_loss_parallel",
                    "enable_async_tensor_parallel", "pipeline_parallel_degree",
                    "pipeline_parallel_split_points",
                    "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
                    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
                    "context_parallel_degree", "context_parallel_rotate_method", "expert_parallel_degree"},
    "training": {"dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm",
                 "steps", "enable_cpu_offload", "mixed_precision_param", "mixed_precision_reduce", "compile",
                 "gc_freq", "gc_debug", "seed", "deterministic"},
    "activation_checkpoint": {"mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns"},
}


def test_the_torchtitan_export_uses_that_releases_fields_only(profile_path: str) -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    lay = layout(profile_path, 8, global_batch_size=16, devices_per_node=4, intra_node_bandwidth=1e11,
                 inter_node_bandwidth=1e10, microbatch_sizes=[1], pipeline_parallel=[4], shardings=["fsdp"],
                 recompute=[True])
    text = lay.export("torchtitan")
    assert text.splitlines()[0].startswith("# stageplan layout for torchtitan "
                                           "(torchtitan/config/job_config.py at commit 000204a4a8bf)")
    data = tomllib.loads(text)
    assert set(data) == set(TORCHTITAN_FIELDS)
    for section, fields in data.items():
        assert set(fields) <= TORCHTITAN_FIELDS[section], section
    assert data["parallelism"]["data_parallel_shard_degree"] == 2
    assert data["parallelism"]["pipeline_parallel_degree"] == 4
    assert data["activation_checkpoint"]["mode"] == "full"
    assert data["training"]["global_batch_size"] == 16
    assert data["training"]["local_batch_size"] * 2 == 16  # b x m per replica
    split = data["parallelism"]["pipeline_parallel_split_points"]
    assert split == [lay.plan.layer_names[b] for b in lay.plan.boundaries[1:-1]]  # type: ignore[union-attr]


def test_cli_no_fit_gives_the_limit_and_the_device_count_that_fit_in_one_line(
        profile_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The refusal's remedies are computed: each of them, given back to the CLI, lays the model out."""
    import re

    args = ["layout", profile_path, "--global-batch-size", "16", "--quiet", *LINKS]
    assert main([*args, "--devices", "8", "--memory-limit", "1.5GiB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "no layout of 8 devices fits 1.50 GiB per device" in err
    remedy = re.search(r"raise --memory-limit to (?P<limit>[\d.]+GiB), or use --devices (?P<n>\d+)$",
                       err.strip())
    assert remedy is not None, err
    assert main([*args, "--devices", "8", "--memory-limit", remedy["limit"]]) == 0
    assert main([*args, "--devices", remedy["n"], "--memory-limit", "1.5GiB"]) == 0


def test_a_measured_link_prices_the_sync_of_replicas_within_a_node_and_not_across(
        profile_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """layout --link: a replicas' ring of per-link bandwidth B and no per-step latency, measured, prices a dp
    group inside a node as the network's link of bandwidth B would (the split is the given one, so only the
    dp price differs); a group spanning nodes keeps the inter-node link."""
    from unit.test_link import _dp_link

    rate = 3e9
    link = {**_dp_link(), "dp_allreduce_latency_s": 0.0, "dp_allreduce_bandwidth_bytes_per_s": rate}
    given = "tp=1,pp=4,dp=2,mbs=1,sharding=ddp,layout=Et*3|t*3|t*3|t*3L"

    def dp_sync(per_node: int, intra: float, with_link: bool) -> float:
        lay = layout(profile_path, 8, global_batch_size=16, devices_per_node=per_node,
                     intra_node_bandwidth=intra, inter_node_bandwidth=1e9, microbatch_sizes=[1],
                     schedules=["1F1B"], recompute=[False], shardings=["ddp"], given=given,
                     link=link if with_link else None)
        assert lay.given is not None
        if with_link:
            assert any("the link's data-parallel all-reduce" in n and "within a node" in n for n in lay.notes)
            assert lay.options["dp_bandwidth_bytes_per_s"] == rate
        return lay.given.step_parts["dp_sync_s"]

    within = dp_sync(8, 1e11, True)
    assert within == pytest.approx(dp_sync(8, rate, False), rel=1e-12) and within > dp_sync(8, 1e11, False)
    assert dp_sync(1, 1e11, True) == pytest.approx(dp_sync(1, 1e11, False), rel=1e-12)  # across nodes
    path = tmp_path / "old.json"
    path.write_text(json.dumps({k: v for k, v in link.items() if not k.startswith("dp_")}))
    with pytest.raises(StageplanError, match=r"timed no all-reduce .* stageplan link --ranks N "
                                             r"--data-parallel D"):
        layout(profile_path, 8, global_batch_size=16, intra_node_bandwidth=1e11, inter_node_bandwidth=1e10,
               link=path)
    rc = main(["layout", profile_path, "--devices", "8", "--global-batch-size", "16", "--quiet", *LINKS,
               "--link", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "timed no all-reduce" in err and "Traceback" not in err


def test_the_modes_own_sync_from_the_link_prices_the_layouts_of_its_d_within_a_node(
        profile_path: str) -> None:
    """layout --link with each mode's own sync (stageplan link --data-parallel 2): FSDP2's reduce priced at
    1 s a unit (a fixed cost only), so the replicas' sync of the given 4 x 2 layout is one second for each
    layer holding parameters on its fullest rank (embedding + 3 blocks, or 3 blocks + the head: 4); not
    across nodes, and not at another d, where the ring of the all-reduce prices it."""
    from unit.test_link import SYNC_SIZES, _sync_link

    link = _sync_link()
    link["dp_sync_fit"] = {"fsdp_reduce": [1.0, 1e30], "fsdp_gather": [0.0, 1e30]}
    link["dp_sync_s"] = {k: [1.0] * len(SYNC_SIZES) for k in link["dp_sync_fit"]}

    ring = {k: v for k, v in link.items() if not k.startswith("dp_sync")}

    def dp_sync(per_node: int, d: int, link: dict = link) -> float:  # type: ignore[type-arg]
        pp = 8 // d  # the profile's 12 blocks evenly over pp stages, the embedding first and the head last
        given = f"tp=1,pp={pp},dp={d},mbs=1,sharding=fsdp,layout=E{'|'.join([f't*{12 // pp}'] * pp)}L"
        lay = layout(profile_path, 8, global_batch_size=16, devices_per_node=per_node,
                     intra_node_bandwidth=1e11, inter_node_bandwidth=1e9, microbatch_sizes=[1],
                     schedules=["1F1B"], recompute=[False], shardings=["fsdp"], given=given, link=link)
        assert lay.given is not None
        assert any("each sharding mode's own sync, timed by the link over 2 replicas" in n
                   for n in lay.notes) == ("dp_sync_fit" in link)
        return lay.given.step_parts["dp_sync_s"]

    assert dp_sync(8, 2) == pytest.approx(4.0, rel=1e-9)
    for per_node, d in ((1, 2), (8, 4)):  # across nodes; another d
        assert dp_sync(per_node, d) == pytest.approx(dp_sync(per_node, d, ring), rel=1e-12)
        assert dp_sync(per_node, d) < 1.0
