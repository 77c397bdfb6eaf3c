"""make figures: the README's balance and timeline figures, from a stored profile (no run needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

import stageplan
from stageplan.api import METHODS
from stageplan.plots import plot_stage_balance, plot_timeline, save

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    profile = stageplan.Profile.load(ROOT / "profiles" / "cpu" / "gpt-12l-v16k.json")
    plans = {m: stageplan.plan(profile, 4, num_microbatches=16, schedule="1F1B", method=m) for m in METHODS}
    out = ROOT / "docs" / "figures"
    out.mkdir(parents=True, exist_ok=True)
    _, ax = plt.subplots(figsize=(8, 4))
    save(plot_stage_balance(plans, ax=ax), str(out / "balance.png"))
    _, ax = plt.subplots(figsize=(11, 3))
    sim = plans["optimal"].simulate()
    save(plot_timeline(sim, ax=ax, title=f"optimal plan, 1F1B, 4 ranks, 16 microbatches: simulated step "
                       f"{sim.step_s * 1e3:.0f} ms, bubble {sim.bubble_fraction:.1%}"), str(out / "timeline.png"))
    plt.close("all")
    print(f"wrote {out / 'balance.png'} and {out / 'timeline.png'}")


if __name__ == "__main__":
    main()
