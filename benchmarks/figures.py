"""make figures: the README's balance and timeline figures, from a stored profile and the link stored beside
it (no run needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

import stageplan
from stageplan.planning.planner import METHODS
from stageplan.plots import plot_stage_balance, plot_timeline, save

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    profile = stageplan.Profile.load(ROOT / "profiles" / "cpu" / "gpt-12l-v16k.json")
    # stageplan link --ranks 2, same machine
    link = str(ROOT / "profiles" / "cpu" / "links" / "gloo-2ranks.json")
    out = ROOT / "docs" / "figures"
    out.mkdir(parents=True, exist_ok=True)
    # What the planner does: 2 ranks, where no single layer bounds the step, so the split decides it.
    plans = {m: stageplan.plan(profile, 2, num_microbatches=8, schedule="1F1B", method=m, link=link)
             for m in METHODS}
    _, ax = plt.subplots(figsize=(8, 4))
    save(plot_stage_balance(plans, ax=ax), str(out / "balance.png"))
    _, ax = plt.subplots(figsize=(11, 3))
    sim = plans["optimal"].simulate()
    save(plot_timeline(sim, ax=ax, title=f"optimal plan, 1F1B, 2 ranks, 8 microbatches, Adam, the measured "
                       f"link: simulated step {sim.step_s * 1e3:.0f} ms, bubble {sim.bubble_fraction:.1%}"),
         str(out / "timeline.png"))
    # The limitation, shown honestly: at 4 ranks the LM head alone exceeds total / p, so every split that
    # isolates it ties at efficiency 1.00 and the other ranks idle; finer layers or a vocabulary-parallel head
    # would help.
    bound = {m: stageplan.plan(profile, 4, num_microbatches=16, schedule="1F1B", method=m, link=link)
             for m in METHODS}
    head = bound["optimal"].stages[-1]
    _, ax = plt.subplots(figsize=(8, 4))
    ax = plot_stage_balance(bound, ax=ax)
    ax.set_title(f"4 ranks: bound by one layer ({head.layers[-1]}, {head.time_s * 1e3:.0f} ms per microbatch "
                 f">= total / p); split the head (vocabulary-parallel) or use fewer ranks", fontsize=9)
    save(ax, str(out / "head_bound.png"))
    plt.close("all")
    print(f"wrote {out / 'balance.png'}, {out / 'timeline.png'} and {out / 'head_bound.png'}")


if __name__ == "__main__":
    main()
