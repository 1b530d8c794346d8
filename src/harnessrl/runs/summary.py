"""A run's summary: held-out reward before/after, merge statistics and timings, written with its
reward curve (summary.json, reward_curve.png) and the index of its rollout folders."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from harnessrl.config import RunConfig
from harnessrl.trainer.budget import stop_line
from harnessrl.trainer.loop import EvalResult
from harnessrl.trainer.metrics import finite_json

log = logging.getLogger(__name__)


def write_summary(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """Plot the reward curve and write `summary.json` (non-finite numbers as null); returns what was
    written."""
    from harnessrl.runs.plot import reward_curve

    reward_curve(run_dir / "metrics.jsonl", summary, run_dir / "reward_curve.png")
    summary = finite_json(summary)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False))
    return summary


def write_index(run_dir: Path) -> None:
    """`rollouts/index.tsv`: which rollout folder is which step, group, task and reward."""
    from harnessrl.inspection import write_rollout_index

    try:
        write_rollout_index(run_dir)
    except Exception as e:  # an index is a convenience: never fail a run over it
        log.warning("event=rollout_index_failed error=%s", e)


def summarise(
    cfg: RunConfig,
    before_all: list[EvalResult],
    after_all: list[EvalResult],
    steps: int,
    records: list[dict[str, Any]],
) -> dict[str, Any]:
    """The run's summary: held-out reward before/after with intervals, merge statistics, timings.
    `before_all` is empty when `eval.before` is off: the before figures are then null."""
    after = after_all[0]
    before = before_all[0] if before_all else None
    temps = [cfg.eval.temperature, *cfg.eval.extra_temperatures]
    befores: list[EvalResult | None] = list(before_all) or [None] * len(temps)
    by_temp = {
        f"{t:g}": {"before": b.as_dict() if b else None, "after": a.as_dict()}
        for t, b, a in zip(temps, befores, after_all, strict=True)
    }
    multi = sum(r.get("calls", 0) > r.get("rollouts", 0) for r in records)
    rates = [r["merge_rate"] for r in records if r.get("merge_rate") is not None]
    return {
        "name": cfg.name,
        "model": cfg.engine.model,
        "heldout_reward_before": before.mean if before else None,
        "heldout_reward_after": after.mean,
        "heldout_ci95_before": [before.lo, before.hi] if before else None,
        "heldout_ci95_after": [after.lo, after.hi],
        "n_heldout": (before or after).n,
        "eval_temperature": cfg.eval.temperature,
        "heldout_by_temperature": by_temp,
        # (step, held-out reward at eval.temperature): before, every `eval.every` steps, after
        "heldout_curve": [
            *([[0, before.mean]] if before else []),
            *([r["step"], r["heldout_reward"]] for r in records if "heldout_reward" in r),
            [steps, after.mean],
        ],
        "train_steps": steps,
        # train.time_budget_s stopped the run after `train_steps` (with that step's checkpoint: --resume
        # continues from it; `checkpoint` is the newest, set by the flow)
        "steps_planned": cfg.train.steps,
        "stopped_early": steps < cfg.train.steps,
        "time_budget_s": cfg.train.time_budget_s,
        "rollouts_per_step": cfg.train.batch_groups * cfg.train.group_size,
        "merge_rate": sum(rates) / len(rates) if rates else None,
        "merge_breaks": _sum_counts([r.get("breaks", {}) for r in records]),
        "steps_with_multi_call_rollouts": multi,
        "rows_per_rollout": _mean([r["rows_per_rollout"] for r in records if "rows_per_rollout" in r]),
        "rollouts_failed_total": sum(r.get("rollouts_failed", 0) for r in records),
        "grader_errors_total": sum(r.get("rollouts_grader_error", 0) for r in records),
        "heldout_failed_before": before.failed if before else None,
        "heldout_failed_after": after.failed,
        # graded held-out tasks whose harness ran past its time limit (in the means above)
        "heldout_timed_out_before": before.timed_out if before else None,
        "heldout_timed_out_after": after.timed_out,
        "rollouts_timed_out_total": sum(r.get("rollouts_timed_out", 0) for r in records),
        "rollouts_flagged_hacking_total": sum(r.get("rollouts_flagged_hacking", 0) for r in records),
        "train_reward_first": records[0]["reward"] if records else None,
        "train_reward_last": records[-1]["reward"] if records else None,
        "schedule": cfg.train.schedule,
        "mean_step_seconds": _mean([r["time_step_s"] for r in records if "time_step_s" in r]),
    }


def stop_note(s: dict[str, Any], resume_command: str) -> str | None:
    """The line that says a run stopped early for `train.time_budget_s` and how `resume_command` continues
    it; None when it ran all its steps."""
    if not s.get("stopped_early"):
        return None
    name = Path(s["checkpoint"]).name if s.get("checkpoint") else None
    line = stop_line(s["time_budget_s"], s["train_steps"], s["steps_planned"], name, resume_command)
    return f"stopped early: {line}"


def _sum_counts(counts: list[dict[str, int]]) -> dict[str, int]:
    """Per-cause totals over the run's steps: the run's merge report."""
    total: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + int(v)
    return total


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None
