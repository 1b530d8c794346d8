"""`rollouts/index.tsv`: which rollout folder holds what (step, phase, task, group, reward).

Rollout folders are named by rollout id (`rollouts/<rollout_id>/attempt-N/`); this file maps each to
its place in the run, so `grep`, `sort` and `column -t` find the folders of a step or a task. The
trainer may call `write_rollout_index(run_dir)` after every step; the file is replaced atomically.
"""

from __future__ import annotations

import os
from pathlib import Path

from harnessrl.inspection.runview import all_rollouts, open_run_store, rollout_place

INDEX_FILE = "index.tsv"
COLUMNS = (
    "folder", "phase", "step", "group_index", "eval_label", "task_id", "group_id", "state", "reward",
    "attempts", "calls", "client_id",
)  # fmt: skip


def _cell(value: object) -> str:
    if value is None:
        return ""
    return str(value).replace("\t", " ").replace("\n", " ")


def write_rollout_index(run_dir: Path | str) -> Path:
    """Write `<run_dir>/rollouts/index.tsv` (a header line, then one line per rollout in creation order:
    the columns of `COLUMNS`; empty cells for unknown values) from the run's store; returns its path."""
    run_dir = Path(run_dir)
    store = open_run_store(run_dir)
    lines = ["\t".join(COLUMNS)]
    try:
        for r in all_rollouts(store):
            place = rollout_place(r)
            reward = store.get_reward(r.rollout_id)
            values = (
                r.rollout_id, place.phase, place.step, place.group, place.label or None, r.task_id, r.group_id,
                r.state, None if reward is None else f"{reward.value:g}", r.n_attempts,
                store.count_calls(r.rollout_id), r.client_id,
            )  # fmt: skip
            lines.append("\t".join(_cell(v) for v in values))
    finally:
        store.close()
    out = run_dir / "rollouts" / INDEX_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{INDEX_FILE}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)
    return out
