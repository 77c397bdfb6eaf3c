"""Tied parameters across ranks are summed over every copy, pipeline training with a tie equals one process,
and the README's own loop (build_pipeline) under torchrun matches one process."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import spawn_ranks
from unit.test_stages import _plan_for_tied_blocks

from stageplan.formats.profile import LayerProfile, Profile
from stageplan.materialize import Checkpoint, save_checkpoint
from stageplan.planning.planner import plan
from stageplan.zoo import gpt


def _sum_a_tie_in_child(rank: int, port: int, queue) -> None:  # type: ignore[no-untyped-def]
    """One of three ranks summing a tie's gradient: rank 0
    holds one copy, rank 1 two (two chunks), rank 2 none."""
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
        holders = dist.new_group([0, 1])  # every rank creates it, in the same order, as torch requires
        sync_tied_grads([(["w", "v"], torch.zeros(2))], held, torch.device("cpu"), across=[True],
                        groups=[holders if rank < 2 else None])
        queue.put((rank, [p.grad.tolist() for p in held.values()],
                   [p.grad is g for p, g in zip(held.values(), grads)]))
    finally:
        dist.destroy_process_group()


def test_a_tie_across_ranks_is_summed_over_every_copy_and_one_copy_in_place() -> None:
    """Oracle: the copies' gradients 1, 10 and 100 x [1, 2] sum to [111, 222] on every copy. Every copy keeps
    its own gradient tensor (no buffer, no copy back, which had made HF GPT-2's 4 MiB sum 4.06 ms against
    2.92 ms in place, medians of 8 runs); two copies on a rank are summed there first, into the first. The
    rank without a copy is outside the holders' group and does nothing."""
    got = spawn_ranks(_sum_a_tie_in_child, 3)
    assert got[0][0] == [[111.0, 222.0]] and got[1][0] == [[111.0, 222.0]] * 2 and got[2][0] == []
    assert got[0][1] == [True] and got[1][1] == [True, True]


def _tied_blocks_on_meta() -> torch.nn.Module:
    from workloads import TiedBlocks

    from stageplan.materialize import init_empty_weights

    with init_empty_weights():
        return TiedBlocks(16, 4)


def _tie_on_first_and_last_of_three(rank: int, port: int, plan_path: str, queue) -> None:  # type: ignore[no-untyped-def]
    """One of three ranks training one step of the tied blocks (block 0 on rank 0, block 4 on rank 2) with
    build_pipeline; records what the tied sum allocated and which collectives it joined."""
    import torch.distributed as dist
    from workloads import tied_blocks

    from stageplan.layers import used_parameters
    from stageplan.running.stages import build_pipeline

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    try:
        wl = tied_blocks(tie_with=4)
        pipe = build_pipeline(_tied_blocks_on_meta, plan_path, rank=rank, world_size=3,
                              loss_fn=torch.nn.functional.mse_loss, example_inputs=(wl.inputs[:2],))
        if pipe.is_first:
            pipe.schedule.step(wl.inputs)
        elif pipe.is_last:
            pipe.schedule.step(target=wl.target, losses=[])
        else:
            pipe.schedule.step()
        params = {k: v for m in pipe.modules for k, v in used_parameters(m).items()}
        own = {k: p.grad for k, p in params.items()}
        allocated: list[tuple[int, ...]] = []
        joined: list[int] = []
        zeros, all_reduce = torch.zeros, dist.all_reduce

        def counting_zeros(*a, **k):  # type: ignore[no-untyped-def]
            out = zeros(*a, **k)
            allocated.append(tuple(out.shape))
            return out

        def counting_all_reduce(t, *a, **k):  # type: ignore[no-untyped-def]
            joined.append(t.numel())
            return all_reduce(t, *a, **k)

        torch.zeros, dist.all_reduce = counting_zeros, counting_all_reduce
        try:
            pipe.sync_tied_grads()
        finally:
            torch.zeros, dist.all_reduce = zeros, all_reduce
        # as lists: a tensor goes through the queue by a file descriptor that its process must outlive
        queue.put((rank, {k: p.grad.tolist() for k, p in params.items()},
                   [p.grad is own[k] for k, p in params.items()], allocated, joined))
    finally:
        dist.destroy_process_group()


def test_a_tie_on_the_first_and_last_of_three_ranks_is_summed_by_those_two_alone(tmp_path: Path) -> None:
    """Oracle: one process's gradients of the same model, the same weights and the same microbatches (the
    mean of the 4 microbatches' losses). The tie (block 0's weight, used again by block 4) sits on ranks 0 and
    2: they sum it on a process group of their own, in their own .grad tensors; rank 1 allocates nothing for
    it and joins no collective."""
    from workloads import tied_blocks

    from stageplan.running.stages import reference_model

    wl = tied_blocks(tie_with=4)
    tie = {"names": ["blocks.0.0.weight", "blocks.4.0.weight"], "layers": [0, 4], "bytes": 1024}
    prof = Profile(tuple(LayerProfile(f"blocks.{i}", 1.0, 1.0, 0, 0, 1088) for i in range(5)),
                   {"batch_size": 8, "microbatch_size": 2, "tied": [tie]})
    pl = plan(prof, 3, num_microbatches=4, schedule="GPipe", boundaries=[0, 2, 4, 5], optimizer="none")
    pl.save(tmp_path / "plan.json")
    got = spawn_ranks(_tie_on_first_and_last_of_three, 3, str(tmp_path / "plan.json"))
    ref = reference_model(_tied_blocks_on_meta(), torch.device("cpu"))
    for i in range(4):
        loss = torch.nn.functional.mse_loss(ref(wl.inputs[2 * i:2 * i + 2]), wl.target[2 * i:2 * i + 2])
        (loss / 4).backward()
    want = dict(ref.named_parameters(remove_duplicate=False))
    seen = set()
    for rank, (grads, kept, allocated, joined) in got.items():
        for name, grad in grads.items():
            torch.testing.assert_close(torch.tensor(grad), want[name].grad, msg=f"rank {rank} {name}")
            seen.add(name)
        assert all(kept), (rank, kept)  # each copy's own .grad tensor, summed in place
        assert allocated == [], (rank, allocated)
        assert joined == ([] if rank == 1 else [16 * 16]), (rank, joined)
    assert seen == set(want)  # every parameter, under both of the tie's names


@pytest.mark.parametrize("tie_with", [2, 4])
def test_pipeline_training_with_a_tie_on_one_or_two_ranks_equals_one_process(
    tie_with: int, tmp_path: Path
) -> None:
    """On one rank the two copies' gradients are summed there (no all-reduce); on two, across the ranks."""
    from stageplan.running.launch import run

    report = run("workloads:tied_blocks", _plan_for_tied_blocks(tie_with),
                 factory_options={"tie_with": tie_with}, steps=2,
                 warmup=1, check=True, optimizer="adamw", output=tmp_path / "run.json")
    assert report.check is not None and report.check["passed"], report.check
    # the sum is timed apart from the optimizer step (within
    # what follows the schedule) and set beside its price
    from stageplan.report import run_table

    pl = _plan_for_tied_blocks(tie_with)
    # the oracle is the run's own ping-pong (one message, one way; ~0.2 ms here): across ranks the sum is a
    # ring all-reduce, 2(p - 1) = 2 messages at least on each rank (measured 1.6-2.6 ms); on one rank no
    # message is sent, and rank 1, which holds no copy, has nothing to sum (measured ~0.01 ms)
    link_latency = report.link["latency_s"]
    # the probe ran seconds before the sum: under make test's load it once read 0.67 ms one way, and the sum
    # 0.49 ms; quiet, it reads 60-110 us here, so two messages take at least twice the smaller of the two (a
    # sum that sends nothing takes ~0.01 ms)
    messages_floor = 2 * min(link_latency, 1e-4)
    for row in report.ranks:
        assert 0 < row["measured_tied_sync_s"] < row["optimizer_s"]  # adamw's own step follows the sum
        # and is timed on its own: what follows the schedule, less the sum (each a median over the steps)
        assert 0 < row["measured_optimizer_step_s"] < row["optimizer_s"]
        assert row["predicted_optimizer_step_s"] > 0  # the run's plan priced adamw from its profile
        if tie_with == 4:
            assert row["measured_tied_sync_s"] >= messages_floor, (row, link_latency)
        priced = sum(st.tied_sync_s for st in pl.stages if st.rank == row["rank"])
        assert row["predicted_tied_sync_s"] == pytest.approx(priced, rel=1e-9) and (priced > 0) == (tie_with
                                                                                                    == 4)
    if tie_with == 2:
        rank1 = next(row for row in report.ranks if row["rank"] == 1)
        assert rank1["measured_tied_sync_s"] < link_latency, (rank1, link_latency)
    # shown where one is priced
    assert ("tied gradients' all-reduce" in run_table(report, explain=True)) == (tie_with == 4)
    # the measured timeline (last step) holds the step's tail as the simulator draws it: per rank, after its
    # last forward or backward, the tied all-reduce ("T", only where the tie spans ranks) and then the
    # optimizer step ("O") the tail is placed from perf_counter offsets, the chunk calls from their own
    # time.time() starts
    slack = 1e-3
    for rank in range(2):
        mine = [e for e in report.timeline if e["rank"] == rank]
        work_end = max(e["end_s"] for e in mine if e["kind"] in ("F", "B", "W"))
        tail = {e["kind"]: e for e in mine if e["kind"] in ("T", "O")}
        assert set(tail) == ({"T", "O"} if tie_with == 4 else {"O"}), (rank, tail)
        assert all(e["microbatch"] == -1 and e["end_s"] > e["start_s"] >= work_end - slack
                   for e in tail.values())
        if "T" in tail:
            assert tail["T"]["end_s"] <= tail["O"]["start_s"] + slack
    assert max(e["end_s"] for e in report.timeline) == max(e["end_s"] for e in report.timeline
                                                           if e["kind"] == "O")
    assert "optimizer step (ms per step, after the tied sum" in run_table(report, explain=True)


ROOT = Path(__file__).resolve().parents[2]


def _readme_loop() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return next(b for b in blocks if "build_pipeline" in b)


def _reference_losses(checkpoint: Path, steps: int, m: int, batch_size: int = 8) -> list[float]:
    wl = gpt(n_layer=4, tied=True, batch_size=batch_size)
    model = wl.model
    state = Checkpoint(checkpoint).read(Checkpoint(checkpoint).keys())
    model.load_state_dict(state, strict=False)  # the tied head is stored once, under the embedding's name
    assert torch.equal(model.head.weight, state["tok_emb.weight"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mb = wl.batch_size // m
    out = []
    for _ in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for i in range(m):
            loss = wl.compute_loss(model(wl.inputs[i * mb:(i + 1) * mb]), wl.target[i * mb:(i + 1) * mb])
            (loss / m).backward()
            total += float(loss.detach())
        optimizer.step()
        out.append(total / m)
    return out


@pytest.mark.parametrize("sharding", ["ddp", "zero1", "fsdp"])
def test_the_readme_loop_under_torchrun_matches_one_process(tmp_path: Path, sharding: str) -> None:
    """2 pipeline ranks x 2 replicas under torchrun, each sharding mode: the replicas' mean loss each step is
    one process's on the whole batch of 16 (8 microbatches of 2)."""
    save_checkpoint(gpt(n_layer=4, tied=True).model, tmp_path / "model.safetensors")
    names = ["tok_emb+pos_emb", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f+head"]
    prof = Profile(tuple(LayerProfile(n, 1.0, 1.0, 0, 0, 0) for n in names),
                   {"batch_size": 8, "microbatch_size": 2, "named_layers": names[1:-1]})
    plan(prof, 2, num_microbatches=4, schedule="1F1B", method="uniform", data_parallel=2,
         sharding=sharding).save(tmp_path / "plan.json")
    (tmp_path / "train.py").write_text(_readme_loop())
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None
    # its own session, so that on a timeout torchrun's workers are ended with it (never orphaned)
    proc = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "4", "train.py"], cwd=tmp_path,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    printed = {(int(s), int(r)): float(x) for s, r, x in re.findall(r"step (\d+) replica (\d) loss ([0-9.]+)",
                                                                     stdout)}
    assert sorted(printed) == [(s, r) for s in range(3) for r in range(2)], stdout
    losses = [(printed[(s, 0)] + printed[(s, 1)]) / 2 for s in range(3)]
    torch.testing.assert_close(losses, _reference_losses(tmp_path / "model.safetensors", 3, 8, 16), rtol=1e-5,
                               atol=1e-6)


def test_the_readme_loop_runs_from_the_inputs_its_own_commands_make(tmp_path: Path) -> None:
    """The README's commands that make plan.json and model.safetensors (its ```bash block before train.py),
    run as written in an empty folder, then train.py under torchrun: three steps, each loss printed."""
    readme = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.S) if "save_checkpoint" in b)
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    made = subprocess.run(["bash", "-euc", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert made.returncode == 0, made.stderr[-2000:]
    assert (tmp_path / "plan.json").is_file() and (tmp_path / "model.safetensors").is_file()
    (tmp_path / "train.py").write_text(_readme_loop())
    proc = subprocess.Popen([str(bindir / "torchrun"), "--standalone", "--nproc-per-node", "4", "train.py"],
                            cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-2000:]
    assert sorted(line.split(" loss ")[0] for line in out.splitlines() if " loss " in line) == [
        f"step {s} replica {r}" for s in range(3) for r in range(2)]
