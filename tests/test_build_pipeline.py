"""The README's own training loop (stageplan.build_pipeline) under torchrun on 2 gloo ranks, from a saved checkpoint,
against single-process training from the same checkpoint: the same losses step by step."""

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
from conftest import run_cli

from stageplan.formats.profile import LayerProfile, Profile
from stageplan.materialize import Checkpoint, save_checkpoint
from stageplan.planning.planner import plan
from stageplan.running.stages import build_pipeline
from stageplan.zoo import gpt

ROOT = Path(__file__).resolve().parents[1]


def _readme_loop() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return next(b for b in blocks if "build_pipeline" in b)


def _reference_losses(checkpoint: Path, steps: int, m: int) -> list[float]:
    wl = gpt(n_layer=4, tied=True)
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


@pytest.mark.slow
def test_the_readme_loop_under_torchrun_matches_one_process(tmp_path: Path) -> None:
    save_checkpoint(gpt(n_layer=4, tied=True).model, tmp_path / "model.safetensors")
    names = ["tok_emb+pos_emb", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f+head"]
    prof = Profile(tuple(LayerProfile(n, 1.0, 1.0, 0, 0, 0) for n in names),
                   {"batch_size": 8, "microbatch_size": 2, "named_layers": names[1:-1]})
    plan(prof, 2, num_microbatches=4, schedule="1F1B", method="uniform").save(tmp_path / "plan.json")
    (tmp_path / "train.py").write_text(_readme_loop())
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None
    # its own session, so that on a timeout torchrun's workers are ended with it (never orphaned)
    proc = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "2", "train.py"], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", stdout)]
    assert len(losses) == 3, stdout
    torch.testing.assert_close(losses, _reference_losses(tmp_path / "model.safetensors", 3, 4), rtol=1e-5, atol=1e-6)


def test_build_pipeline_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = Profile(tuple(LayerProfile(str(i), 1.0, 1.0, 0, 0, 0) for i in range(4)), {"batch_size": 8})
    plan(prof, 2, num_microbatches=2).save(tmp_path / "plan.json")
    with pytest.raises(Exception, match=r"rank 0 of world size 3 does not fit the plan's 2 ranks"):
        build_pipeline(lambda: torch.nn.Linear(2, 2), tmp_path / "plan.json", rank=0, world_size=3)
    with pytest.raises(Exception, match=r"Linear is not an nn.Sequential, so cutting it .* pass example_inputs"):
        build_pipeline(lambda: torch.nn.Linear(2, 2), tmp_path / "plan.json", rank=0, world_size=2)
    # a checkpoint that lacks a stage's tensors names the missing keys
    from stageplan.materialize import init_empty_weights, real_parameters
    with init_empty_weights():
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(Exception, match=r"the weights lack 2 tensor\(s\) this stage needs: 1.weight, 1.bias"):
        real_parameters(model, ["0.weight", "1.weight", "1.bias"], "cpu",
                        weights=Checkpoint({"0.weight": torch.zeros(2, 2)}))
    code, _, err = run_cli(["run", "gpt", "--plan", str(tmp_path / "plan.json"), "--weights", str(tmp_path / "nope")],
                           capsys)
    assert code == 2 and "weights" in err and "do not exist" in err


def test_build_pipeline_refuses_a_plan_for_another_model(tmp_path: Path) -> None:
    names = ["tok_emb+pos_emb", *[f"blocks.{i}" for i in range(6)], "ln_f+head"]
    prof = Profile(tuple(LayerProfile(n, 1.0, 1.0, 0, 0, 0) for n in names), {"batch_size": 8, "microbatch_size": 2})
    plan(prof, 2, num_microbatches=4).save(tmp_path / "plan.json")
    data = gpt(n_layer=4, tied=True)
    with pytest.raises(Exception, match=r"the plan does not match this model: it has 8 layers, the model 6"):
        build_pipeline(lambda: gpt(n_layer=4, tied=True).model, tmp_path / "plan.json", rank=0, world_size=2,
                       example_inputs=data.inputs[:2])
