"""stageplan.running.stages without ranks: build_pipeline refuses a plan for another model, and which tied
parameters span ranks and how a tie on one rank is summed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_cli

from stageplan.errors import StageplanError
from stageplan.formats.plan import Plan
from stageplan.formats.profile import LayerProfile, Profile
from stageplan.materialize import Checkpoint
from stageplan.planning.planner import plan
from stageplan.profiling.profiler import profile_model
from stageplan.running.stages import build_pipeline
from stageplan.zoo import build_workload, gpt

from .test_costs import BANDWIDTH


def _plan_for_tied_blocks(tie_with: int) -> Plan:
    """2 ranks x 2 chunks: block 0 in chunk 0 (rank 0), block 2 in chunk 2 (rank 0 again), block 4 in chunk 3
    (rank 1). Tied with block 2, the two copies sit on one rank; with block 4, on two."""
    wl = build_workload("workloads:tied_blocks", {"tie_with": tie_with})
    prof = profile_model(wl, microbatch_size=2, warmup=0, repeats=1, streaming=False, dedup=False)
    assert [t.layers for t in prof.tied] == [(0, tie_with)]
    return plan(prof, 2, num_microbatches=4, schedule="Interleaved1F1B", virtual_stages=2,
                boundaries=(0, 1, 2, 4, 5), bandwidth=BANDWIDTH, optimizer="adamw")


@pytest.mark.parametrize(("tie_with", "across"), [(2, False), (4, True)])
def test_the_executor_knows_which_ties_span_ranks(tie_with: int, across: bool) -> None:
    from stageplan.layers import cut_stages
    from stageplan.materialize import meta_copy
    from stageplan.running.stages import tie_groups, ties_across_ranks

    pl = _plan_for_tied_blocks(tie_with)
    assert (pl.tied_sync_s > 0) == across
    model = meta_copy(build_workload("workloads:tied_blocks", {"tie_with": tie_with}).model)
    ties = tie_groups(model)
    cut = cut_stages(model, (torch.zeros(2, 16),), pl.layer_names, pl.boundaries,
                     pl.profile_meta.get("layers_arg"))
    assert ties_across_ranks(ties, cut, pl) == [across]


def test_a_tie_on_one_rank_is_summed_there_without_communication() -> None:
    """No process group exists here: an all-reduce would raise. Two copies on this rank are summed; one copy
    of a tie no other rank holds is left alone."""
    from stageplan.running.stages import sync_tied_grads

    shared = torch.nn.Parameter(torch.zeros(2))
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    sync_tied_grads([(["x.weight", "y.weight"], shared)], {"x.weight": a, "y.weight": b}, torch.device("cpu"),
                    across=[False])
    assert torch.equal(a.grad, torch.tensor([11.0, 22.0])) and torch.equal(b.grad, a.grad)
    sync_tied_grads([(["x.weight", "y.weight"], shared)], {"x.weight": a}, torch.device("cpu"),
                    across=[False])
    assert torch.equal(a.grad, torch.tensor([11.0, 22.0]))


def test_build_pipeline_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = Profile(tuple(LayerProfile(str(i), 1.0, 1.0, 0, 0, 0) for i in range(4)), {"batch_size": 8})
    plan(prof, 2, num_microbatches=2).save(tmp_path / "plan.json")
    with pytest.raises(Exception, match=r"rank 0 of world size 3 does not fit the plan's 2 ranks"):
        build_pipeline(lambda: torch.nn.Linear(2, 2), tmp_path / "plan.json", rank=0, world_size=3)
    with pytest.raises(Exception,
                       match=r"Linear is not an nn.Sequential, so cutting it .* pass example_inputs"):
        build_pipeline(lambda: torch.nn.Linear(2, 2), tmp_path / "plan.json", rank=0, world_size=2)
    # a checkpoint that lacks a stage's tensors names the missing keys
    from stageplan.materialize import init_empty_weights, real_parameters
    with init_empty_weights():
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(Exception, match=r"the weights lack 2 tensor\(s\) this stage needs: 1.weight, 1.bias"):
        real_parameters(model, ["0.weight", "1.weight", "1.bias"], "cpu",
                        weights=Checkpoint({"0.weight": torch.zeros(2, 2)}))
    code, _, err = run_cli(["run", "gpt", "--plan", str(tmp_path / "plan.json"), "--weights",
                            str(tmp_path / "nope")],
                           capsys)
    assert code == 2 and "weights" in err and "do not exist" in err


def test_build_pipeline_refuses_a_plan_for_another_model(tmp_path: Path) -> None:
    names = ["tok_emb+pos_emb", *[f"blocks.{i}" for i in range(6)], "ln_f+head"]
    prof = Profile(tuple(LayerProfile(n, 1.0, 1.0, 0, 0, 0) for n in names),
                   {"batch_size": 8, "microbatch_size": 2})
    plan(prof, 2, num_microbatches=4).save(tmp_path / "plan.json")
    data = gpt(n_layer=4, tied=True)
    with pytest.raises(Exception, match=r"the plan does not match this model: it has 8 layers, the model 6"):
        build_pipeline(lambda: gpt(n_layer=4, tied=True).model, tmp_path / "plan.json", rank=0, world_size=2,
                       example_inputs=data.inputs[:2])


def test_a_plan_for_another_model_says_so_before_any_shape_or_batch_check() -> None:
    """A gpt plan run with the convnet: its microbatch size (2, against the convnet's 16 / 4 = 4) and its
    layers differ too, and the first thing said is the model the plan was made for."""
    from stageplan.running.stages import validate
    from stageplan.zoo import build_workload

    names = ["tok_emb+pos_emb", *[f"blocks.{i}" for i in range(6)], "ln_f+head"]
    prof = Profile(tuple(LayerProfile(n, 1.0, 1.0, 0, 0, 0) for n in names),
                   {"batch_size": 8, "microbatch_size": 2, "model": "gpt"})
    gpt_plan = plan(prof, 2, num_microbatches=4)
    convnet = build_workload("convnet", {"batch_size": 16})
    with pytest.raises(StageplanError, match=r"^plan made for 'gpt', and this run builds 'convnet': .*; run "
                                             r"'gpt' with this plan, or profile and plan 'convnet'$"):
        validate(convnet, gpt_plan)
    # a factory named by module and function matches the same name without the module
    from stageplan.workload import check_model_name

    check_model_name("mypkg.models:build", "build")
    with pytest.raises(StageplanError, match=r"^profile made for 'mymodel:build'"):
        check_model_name("mymodel:other", "mymodel:build", "profile")


def test_a_rank_builds_its_stage_from_the_cut_it_was_given(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor cuts the meta model before it reads its memory baseline (the trace's objects are set-up,
    as the meta model is, not the stage's memory) and builds the stage from that cut: build_rank_stages takes
    the cut's pieces as they are and traces nothing again."""
    import torch.distributed as dist

    from stageplan.materialize import init_empty_weights
    from stageplan.running import stages

    names = ["tok_emb+pos_emb", "blocks.0", "blocks.1", "ln_f+head"]
    prof = Profile(tuple(LayerProfile(n, 1.0, 1.0, 0, 0, 0) for n in names),
                   {"batch_size": 8, "microbatch_size": 2})
    the_plan = plan(prof, 1, num_microbatches=4)
    with init_empty_weights():
        wl = gpt(n_layer=2)
    mb = stages.first_microbatch_of_plan(wl, the_plan)
    cut = stages.cut_rank_stages(wl.model, the_plan, mb, torch.device("cpu"))

    def traced_again(*_: object, **__: object) -> None:
        raise AssertionError("the model was cut a second time")

    monkeypatch.setattr(stages, "cut_stages", traced_again)
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        rs = stages.build_rank_stages(wl.model, the_plan, 0, torch.device("cpu"), mb, cut=cut)
    finally:
        dist.destroy_process_group()
    assert rs.pieces == [cut.pieces[0].module]
    assert rs.unique_params and all(p.device.type == "cpu" for p in rs.unique_params)
