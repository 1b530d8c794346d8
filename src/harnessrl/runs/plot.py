"""The reward-curve PNG of a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def reward_curve(metrics_path: Path, summary: dict[str, Any], out: Path) -> Path | None:
    """Plot training reward per step and held-out reward before/after (with 95% intervals)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = []
    if metrics_path.exists():
        records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    if records:
        ax.plot(
            [r["step"] for r in records],
            [float("nan") if r.get("reward") is None else r["reward"] for r in records],
            marker="o",
            label="train reward (batch mean)",
        )
    mid = [r for r in records if "heldout_reward" in r]  # eval.every
    if mid:
        ax.errorbar(
            [r["step"] for r in mid],
            [r["heldout_reward"] for r in mid],
            yerr=[
                [max(r["heldout_reward"] - r["heldout_ci95"][0], 0.0) for r in mid],
                [max(r["heldout_ci95"][1] - r["heldout_reward"], 0.0) for r in mid],
            ],
            fmt="s",
            color="gray",
            capsize=3,
            label=f"held-out reward during training at T={summary.get('eval_temperature')}",
        )
    _heldout_before_after(ax, summary)
    ax.set_xlabel("training step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"harnessrl: {summary.get('example')} with {summary.get('model')}")
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _heldout_before_after(ax: Any, summary: dict[str, Any]) -> None:
    """The held-out reward before (step 0) and after training at each eval temperature, with its 95%
    interval (clamped: a Wilson interval at 0/n or n/n can miss its end by a rounding error)."""
    steps = summary.get("train_steps", 0)
    markers = iter(["s", "D", "^", "v", "o"])
    for temp, r in summary.get("heldout_by_temperature", {}).items():
        marker = next(markers, "s")
        for x, key in ((0, "before"), (steps, "after")):
            if r[key] is None:  # eval.before off
                continue
            y, (lo, hi) = r[key]["mean"], r[key]["ci95"]
            ax.errorbar(
                [x], [y], yerr=[[max(y - lo, 0.0)], [max(hi - y, 0.0)]], fmt=marker, color="black", capsize=4
            )
        ax.plot(
            [],
            [],
            marker,
            color="black",
            label=f"held-out reward at T={temp}, 95% CI (n={summary.get('n_heldout')})",
        )
