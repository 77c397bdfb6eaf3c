"""Write the four notebooks (notebooks/*.ipynb) from their cells and execute them, so the committed
copies carry small rendered outputs. Run: make notebooks. Tests re-execute the committed copies."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / "notebooks"

SETUP = """\
import os
from pathlib import Path

import matplotlib.pyplot as plt
import stageplan
from stageplan import plots

ROOT = Path(os.environ.get("STAGEPLAN_ROOT", "..")).resolve()  # the repository (tests run from a temp folder)
PROFILES = ROOT / "profiles" / "cpu"
plt.rcParams["figure.dpi"] = 60"""

NOTEBOOKS: dict[str, list[tuple[str, str]]] = {
    "01_stage_balance": [
        ("md", "# Stage balance: where the embedding/head skew comes from, and what fixes it\n"
               "We load a profile measured on this project's CPU (`profiles/cpu/gpt-12l-v16k.json`: a GPT "
               "with 12 blocks, d_model 128, a 16384-token vocabulary), plan 2, 4 and 8 pipeline stages with "
               "each method, and plot the balance and the memory. Nothing is run here: every number is the "
               "cost model's prediction from the profile."),
        ("code", SETUP),
        ("code", "profile = stageplan.Profile.load(PROFILES / 'gpt-12l-v16k.json')\n"
                 "df = profile.to_pandas()\n"
                 "df['time_ms'] = (df.forward_s + df.backward_s) * 1e3\n"
                 "df[['name', 'time_ms', 'param_bytes', 'activation_bytes']].round(3)"),
        ("md", "The LM head (with the loss over the vocabulary) costs about nine blocks' time, and the "
               "embedding holds several blocks' parameters while costing almost no time. Equal layer counts "
               "(Megatron's default, DeepSpeed `uniform`) and equal parameters (DeepSpeed's default) both "
               "misplace them."),
        ("code", "rows = []\n"
                 "for p in (2, 4, 8):\n"
                 "    plans = {m: stageplan.plan(profile, p, num_microbatches=4 * p, method=m) for m in "
                 "('optimal', 'uniform', 'parameters')}\n    for m, pl in plans.items():\n"
                 "        rows.append((p, m, pl.boundaries, round(pl.bottleneck_s * 1e3, 2), "
                 "round(pl.bottleneck_s / plans['optimal'].bottleneck_s, 3), round(pl.balance_efficiency, "
                 "3)))\nimport pandas as pd\npd.DataFrame(rows, columns=['stages', 'method', 'boundaries', "
                 "'bottleneck ms', 'x optimal', 'efficiency'])"),
        ("code", "plans4 = {m: stageplan.plan(profile, 4, num_microbatches=16, method=m) for m in "
                 "('optimal', 'uniform', 'parameters')}\nfig, axes = plt.subplots(1, 2, figsize=(13, 4))\n"
                 "plots.plot_stage_balance(plans4, ax=axes[0])\n"
                 "plots.plot_memory(plans4['optimal'], ax=axes[1])\n"
                 "plt.show()"),
        ("md", "Per-layer cost with the optimal 4-stage boundaries: the embedding and the head each get a "
               "stage of their own, and the blocks share the two in between."),
        ("code", "ax = plots.plot_layer_costs(profile, plans4['optimal'])\nplt.show()"),
        ("md", "Memory can change the answer: under 1F1B stage 0 keeps p microbatches of activations in "
               "flight. With a per-device limit just below what the time-optimal 2-stage split needs on "
               "stage 0, the planner moves a block off stage 0 and pays some time for it."),
        ("code", "free = stageplan.plan(profile, 2, num_microbatches=8)  # 1F1B: stage 0 holds 2 "
                 "microbatches, stage 1 holds 1\nlimit = 0.95 * free.rank_memory_bytes[0]\n"
                 "capped = stageplan.plan(profile, 2, num_microbatches=8, memory_limit=limit)\n"
                 "print('limit', round(limit / 2**20, 1), 'MiB per device')\n"
                 "print('time-optimal', free.boundaries, 'needs', [round(x / 2**20, 1) for x in "
                 "free.rank_memory_bytes], 'MiB')\nprint('memory-capped', capped.boundaries, 'needs', "
                 "[round(x / 2**20, 1) for x in capped.rank_memory_bytes], 'MiB',\n      f'bottleneck "
                 "x{capped.bottleneck_s / free.bottleneck_s:.3f}')\ngpipe = stageplan.plan(profile, 2, "
                 "num_microbatches=8, schedule='GPipe')\nprint('the same split under GPipe needs', [round(x "
                 "/ 2**20, 1) for x in gpipe.rank_memory_bytes], 'MiB (all 8 microbatches in flight)')"),
    ],
    "02_schedules_and_bubbles": [
        ("md", "# Schedules and bubbles\nThe simulator executes, on each rank, the action order that "
               "`torch.distributed.pipelining` executes (GPipe, 1F1B, Interleaved1F1B, ...). Here: its "
               "timelines, the bubble against the number of microbatches, and the activations each stage "
               "keeps in flight. The timelines are priced with the link measured on this project's CPU "
               "(`profiles/cpu/links/gloo-2ranks.json`, `stageplan link --ranks 2`): each crossing's "
               "transfer is the thin green bar under the rank that receives it, and each rank's Adam step, "
               "measured per layer by the profiler, the purple bar at the end."),
        ("code", SETUP + "\nfrom stageplan.planning.schedules import bubble_closed_form, peak_inflight"),
        ("code", "profile = stageplan.Profile.load(PROFILES / 'gpt.json')\n"
                 "fig, axes = plt.subplots(3, 1, figsize=(11, 7))\n"
                 "for ax, (schedule, v) in zip(axes, [('GPipe', 1), ('1F1B', 1), ('Interleaved1F1B', 2)]):\n"
                 "    pl = stageplan.plan(profile, 2, num_microbatches=4, schedule=schedule, "
                 "virtual_stages=v,\n                        link=str(PROFILES / 'links' / "
                 "'gloo-2ranks.json'))\n    sim = pl.simulate()\n"
                 "    plots.plot_timeline(sim, ax=ax, title=f'{schedule}: step {sim.step_s * 1e3:.1f} ms, "
                 "bubble {sim.bubble_fraction:.1%}')\nplt.tight_layout(); plt.show()"),
        ("md", "Bubble against m for p = 8 balanced stages: the simulator against the closed form "
               "(p−1)/(m+p−1). The seeds quote 47% at m = 8 and 10% at m = 64."),
        ("code", "ms = [1, 2, 4, 8, 16, 32, 64, 128]\n"
                 "sim = [stageplan.simulate('GPipe', [1.0] * 8, [2.0] * 8, m).bubble_fraction for m in ms]\n"
                 "closed = [bubble_closed_form(8, m) for m in ms]\n"
                 "for m, s, c in zip(ms, sim, closed):\n"
                 "    print(f'm={m:4d}  simulated {s:6.1%}  closed form {c:6.1%}')\n"
                 "fig, ax = plt.subplots(figsize=(6, 3.5))\n"
                 "ax.plot(ms, sim, 'o', label='simulated'); ax.plot(ms, closed, '-', label='(p-1)/(m+p-1)')\n"
                 "ax.set_xscale('log', base=2); ax.set_xlabel('microbatches m'); ax.set_ylabel('bubble "
                 "fraction'); ax.legend()\nplt.show()"),
        ("md", "Activations in flight per stage (p = 4, m = 8): GPipe keeps all m on every stage; 1F1B keeps "
               "min(p−s, m), so stage 0 holds the most. That is why a time-balanced plan runs out of memory "
               "on stage 0 under 1F1B."),
        ("code", "for schedule in ('GPipe', '1F1B'):\n"
                 "    print(schedule, peak_inflight(schedule, 4, 8))\n"
                 "print('Interleaved1F1B v=2 (per stage)', peak_inflight('Interleaved1F1B', 4, 8, 2))\n"
                 "pl = stageplan.plan(profile, 4, num_microbatches=8, schedule='1F1B')\n"
                 "ax = plots.plot_memory(pl); plt.show()"),
    ],
    "03_predicted_vs_measured": [
        ("md", "# Predicted vs measured\nWe plan the built-in `gpt` from its stored profile, run the plan on "
               "2 local CPU processes with `torch.distributed.pipelining`, compare the prediction with the "
               "measurement, calibrate the profile with what was measured, plan again and run again."),
        ("code", SETUP),
        ("code", "profile = stageplan.Profile.load(PROFILES / 'gpt.json')\n"
                 "plan = stageplan.plan(profile, 2, num_microbatches=4)\n"
                 "report = stageplan.run('gpt', plan, steps=6, warmup=2, check=True)\n"
                 "print('check passed:', report.check['passed'])\n"
                 "for r in report.ranks:\n"
                 "    print(f\"rank {r['rank']}: compute predicted {r['predicted_compute_s']*1e3:.2f} ms, "
                 "measured {r['measured_compute_s']*1e3:.2f} ms, ratio {r['compute_ratio']:.3f}\")\n    "
                 "print(f\"  = the machine now x{r['machine_ratio']:.3f} the profile (its layers alone after "
                 "the run) \"\n          f\"x the pipeline {r['pipeline_ratio']:.3f}\")\nprint(f'step: "
                 "predicted {report.predicted_step_s*1e3:.1f} ms, measured {report.measured_step_s*1e3:.1f} "
                 "ms, ratio {report.step_ratio:.3f}')"),
        ("md", "Each rank ended its run by timing its layers alone, as the profiler does (the ranks in "
               "turns). On the right, that figure is the hollow circle: its height over the diagonal is the "
               "machine's drift since the profile, and the line from it to the measured dot is what the "
               "pipeline itself added."),
        ("code", "fig, axes = plt.subplots(1, 2, figsize=(13, 3.5), gridspec_kw={'width_ratios': [2.5, 1]})\n"
                 "plots.plot_timeline(report, ax=axes[0])\n"
                 "plots.plot_predicted_vs_measured(report, ax=axes[1])\n"
                 "fig.tight_layout(); plt.show()  # room for the legends outside each panel"),
        ("md", "Calibrate: each layer's time becomes what the run measured of it inside the schedule (the "
               "per-layer clock; its rank's overhead outside the layers shared out by time); plan again."),
        ("code", "calibrated = stageplan.calibrate(profile, report)\n"
                 "plan2 = stageplan.plan(calibrated, 2, num_microbatches=4)\n"
                 "report2 = stageplan.run('gpt', plan2, steps=6, warmup=2)\n"
                 "print('boundaries before', plan.boundaries, 'after', plan2.boundaries)\n"
                 "print(f'step error before calibration: {abs(report.step_ratio - 1):.1%} (ratio "
                 "{report.step_ratio:.3f})')\nprint(f'step error after calibration:  {abs(report2.step_ratio "
                 "- 1):.1%} (ratio {report2.step_ratio:.3f})')"),
        ("md", "## A model defined right here\nA class defined in a notebook lives in `__main__`, which a "
               "fresh rank process cannot import. `stageplan.run` sees that and forks the ranks instead, so "
               "they share this notebook's definitions. Each rank still gets only its own stage's weights."),
        ("code", "import torch\nfrom torch import nn\n\n"
                 "class Net(nn.Module):\n"
                 "    def __init__(self, width=64, depth=6):\n"
                 "        super().__init__()\n"
                 "        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) "
                 "for _ in range(depth)])\n        self.head = nn.Linear(width, 1)\n\n"
                 "    def forward(self, x):\n"
                 "        return self.head(self.layers(x))\n\n"
                 "torch.manual_seed(0)\n"
                 "mine = stageplan.Workload(Net(), torch.randn(16, 64), torch.randn(16, 1), "
                 "nn.functional.mse_loss, name='Net')\nnet_profile = stageplan.profile_model(mine, "
                 "microbatch_size=4, warmup=1, repeats=3)\nnet_plan = stageplan.plan(net_profile, 2, "
                 "num_microbatches=4)\nnet_report = stageplan.run(mine, net_plan, steps=3, warmup=1, "
                 "check=True)\nprint('layers:', net_profile.names)\n"
                 "print('boundaries', net_plan.boundaries, '| check passed:', net_report.check['passed'])\n"
                 "print(f'step: predicted {net_report.predicted_step_s*1e3:.1f} ms, measured "
                 "{net_report.measured_step_s*1e3:.1f} ms, '\n      f'ratio {net_report.step_ratio:.3f}')"),
    ],
    "04_layout_for_64_gpus": [
        ("md", "# Choosing a layout for 64 GPUs\nLLaMA-3-70B at sequence 8192 in bf16-mixed with Adam, on 64 "
               "H100 SXM (8 a node, 80 GiB each), 128 sequences a step. `stageplan.layout` estimates each "
               "tensor-parallel shard for each microbatch size (analytic, on fake tensors: nothing runs, and "
               "the figures are not yet checked against a GPU), searches pipeline x data x tensor degrees, "
               "microbatching, schedule, recompute and sharding with the exact split inside, and scores the "
               "published Megatron recipe (TP4, PP8, VP5, sequence parallel, its hand-written layout) beside "
               "the best."),
        ("code", SETUP + "\nfrom stageplan.report import layout_table\n"
                 "RECIPE = "
                 "'tp=4,pp=8,dp=2,mbs=1,sharding=zero1,vp=5,sp=1,layout=Et*2|(t*2|)*34,t*3|(t*2|)*3,tL'"),
        ("code", "lay = stageplan.layout('hf', 64, options={'preset': 'llama3-70b', 'seq_len': 8192}, "
                 "device='estimate:h100-sxm',\n                      global_batch_size=128, "
                 "memory_limit='80GiB', sequence_parallel=True, microbatch_sizes=[1, 2],\n"
                 "                      given=RECIPE)\nprint(layout_table(lay, top=5))"),
        ("md", "Every candidate priced, its predicted step against its fullest device: the ones over 80 GiB "
               "are hollow, the chosen one is the star, the recipe the diamond."),
        ("code", "ax = plots.plot_layouts(lay)\nplt.show()"),
        ("md", "The best layout's memory per pipeline rank, by kind: the first and last stages carry the "
               "embedding and the head whole."),
        ("code", "ax = plots.plot_memory(lay.plan)\nplt.show()"),
        ("md", "The best against the recipe, term by term (seconds per step, GiB on the fullest device), "
               "with the ratio."),
        ("code", "import pandas as pd\nbest, given = lay.best, lay.given\n"
                 "rows = {k: (best.step_parts.get(k, 0.0), given.step_parts.get(k, 0.0)) for k in "
                 "best.step_parts}\nrows['step_s'] = (best.step_s, given.step_s)\n"
                 "rows['fullest device GiB'] = (best.peak_memory_bytes / 2**30, given.peak_memory_bytes / "
                 "2**30)\nrows['MFU'] = (best.mfu, given.mfu)\n"
                 "df = pd.DataFrame(rows, index=[best.degrees, given.degrees]).T\n"
                 "df['recipe / best'] = df.iloc[:, 1] / df.iloc[:, 0]\ndf.round(3)"),
        ("md", "The exports say where each goes; a tool that cannot run the layout refuses it in one line."),
        ("code", "for kind in ('megatron', 'torchtitan', 'deepspeed'):\n    try:\n"
                 "        print(f'--- {kind}\\n' + lay.export(kind))\n"
                 "    except stageplan.StageplanError as exc:\n        print(f'--- {kind}: {exc}')"),
    ],
}


def build(name: str, cells: list[tuple[str, str]], execute: bool = True) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
                for kind, src in cells]
    if execute:
        os.environ["STAGEPLAN_ROOT"] = str(ROOT)
        NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NB)}}
        ).execute()
    path = NB / f"{name}.ipynb"
    tmp = path.with_suffix(".tmp")
    nbformat.write(nb, str(tmp))
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    names = sys.argv[1:] or list(NOTEBOOKS)
    for name in names:
        print("built", build(name, NOTEBOOKS[name]))
