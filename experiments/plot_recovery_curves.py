"""Tokens to quality, from recovery screens: LAMBADA and greedy loops along each run's training, one PNG.

Reads experiments.recovery_screen JSONs (one level each) whose runs recorded their curve
(`python -m bench.bench_recovery --curve-repeats` adds repeat-4 to every point) and plots, per level,
LAMBADA perplexity and the repeated-4-gram rate as multiples of the full model's, with the issue's goals. A screen with
`acceptance` also gets that run's (c) at its end as a reference mark.

  .venv/bin/python -m experiments.plot_recovery_curves experiments/results/recovery-long-lm-0.7.json \\
      experiments/results/recovery-long-0.5.json --png experiments/results/recovery-long.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GOALS = {"0.7": 1.6, "0.5": 2.5}  # LAMBADA perplexity over the full model's (issue 13)
REPEAT_GOAL = 2.0  # greedy repeat-4 over the full model's, at every level >= 0.5


def plot(screens: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ppl_ax, loop_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for screen, color in zip(screens, ["tab:red", "tab:blue", "tab:green", "tab:purple"], strict=False):
        level = screen["level"]
        for (name, row), style in zip(screen["rows"].items(), ["-", "-.", ":"], strict=False):
            kilo = [p["tokens"] / 1000 for p in row["curve"]]
            ppl_ax.plot(kilo, [p["lambada_ppl"] / screen["full_lambada_ppl"] for p in row["curve"]],
                        marker="o", ls=style, color=color, label=f"level {level}: {name}")
            with_loops = [p for p in row["curve"] if "repeat4" in p]
            loop_ax.plot([p["tokens"] / 1000 for p in with_loops],
                         [p["repeat4"] / screen["full_repeat4"] for p in with_loops],
                         marker="o", ls=style, color=color, label=f"level {level}: {name} (torch decoder)")
            if row.get("repeat4_read", "device SDK") == "device SDK":
                loop_ax.plot([kilo[-1]], [row["repeat4"] / screen["full_repeat4"]], marker="s", ls="none",
                             color=color, label=f"level {level}: {name}, end (device SDK)")
        accepted = screen.get("acceptance")
        if accepted:
            tokens = accepted["tokens"] / 1000
            ppl_ax.plot([p["tokens"] / 1000 for p in accepted["curve"]],
                        [p["lambada_ppl"] / screen["full_lambada_ppl"] for p in accepted["curve"]], ls=":",
                        marker="*", ms=8, color=color, label=f"level {level}: acceptance run (c), its own schedule")
            loop_ax.plot([tokens], [accepted["repeat4"] / screen["full_repeat4"]], marker="*", ms=12, ls="none",
                         color=color, label=f"level {level}: acceptance run (c)")
        if level in GOALS:
            ppl_ax.axhline(GOALS[level], ls="--", color=color, lw=1, label=f"level {level} goal {GOALS[level]}x")
    loop_ax.axhline(REPEAT_GOAL, ls="--", color="black", lw=1, label=f"goal {REPEAT_GOAL:g}x")
    ppl_ax.set(title="LAMBADA perplexity", xlabel="training tokens per level (thousands)",
               ylabel="multiple of the full model's")
    loop_ax.set(title="greedy repeated-4-gram rate, 32 prompts x 64 tokens",
                xlabel="training tokens per level (thousands)", ylabel="multiple of the full model's")
    loop_ax.set_ylim(bottom=0)
    for ax in (ppl_ax, loop_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("SmolLM2-135M: recovery along a long schedule")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("screens", type=Path, nargs="+", help="experiments.recovery_screen JSONs")
    parser.add_argument("--png", type=Path, required=True)
    args = parser.parse_args()
    screens = [json.loads(path.read_text()) for path in args.screens]
    if any("curve" not in row for screen in screens for row in screen["rows"].values()):
        raise SystemExit("error: a screen's run has no curve (experiments.recovery_screen records it)")
    plot(screens, args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
