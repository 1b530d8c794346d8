"""Read what a run recorded: its store, its settings, where each rollout belongs (step, phase, group).

Rows and merge breaks are recomputed from the stored calls with the adapter's own `merge_calls`, on
the same attempts the trainer uses (`adapter.batch.build_batch`: the last attempt, or every attempt
with `train.train_on_failed_attempts`), so what `inspect` shows is what the update saw.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.adapter import (
    AdvantageLevel,
    Credit,
    Estimator,
    LossMode,
    MergeResult,
    ZeroVariance,
    merge_calls,
)
from harnessrl.adapter.advantage import rollout_advantages, sample_level_advantages
from harnessrl.schema import Rollout, RolloutDetail, RolloutState
from harnessrl.store import SQLiteStore, Store, StoreError, is_postgres_url, open_store

STORE_FILE = "store.sqlite"


class RunError(Exception):
    """A problem with what the user asked for (no run there, no such rollout): a message, exit code 2."""


@dataclass(frozen=True)
class Place:
    """Where a rollout belongs in its run.

    `step` numbers updates as `metrics.jsonl` does: the rollouts of step N fed update N (1-based).
    Held-out evaluations carry the number of updates behind them (0: before training). Async training
    groups carry their group index (`group`); the step that trained them is not recorded (None)."""

    phase: str  # "train" | "eval" | "other"
    step: int | None
    group: int | None = None  # async schedule: the group index k
    label: str = ""  # the evaluation's label, e.g. "eval-before-t0"


_EVAL_STEP = re.compile(r"^eval-(?:step|after-)(\d+)")
_CLIENT_STEP = re.compile(r"-s(\d+)-")
_CLIENT_GROUP = re.compile(r"-g(\d+)-")


def rollout_place(rollout: Rollout) -> Place:
    """The phase and step of a rollout, read from the metadata the trainer gives it (`trainer.loop`:
    {"step": s} 0-based, {"eval": label}; `trainer.async_loop`: {"group": k}), else its client id."""
    return place_of(rollout.metadata, rollout.client_id)


def place_of(meta: dict[str, Any], cid: str) -> Place:
    """`rollout_place` from a rollout's metadata and client id alone."""
    if isinstance(meta.get("eval"), str):
        label = meta["eval"]
        m = _EVAL_STEP.match(label)
        step = int(m.group(1)) if m else 0 if label.startswith("eval-before") else None
        return Place("eval", step, label=label)
    if isinstance(meta.get("step"), int):
        return Place("train", meta["step"] + 1)
    if isinstance(meta.get("group"), int):
        return Place("train", None, group=meta["group"])
    if m := _CLIENT_STEP.search(cid):
        return Place("train", int(m.group(1)) + 1)
    if m := _CLIENT_GROUP.search(cid):
        return Place("train", None, group=int(m.group(1)))
    return Place("other", None)


@dataclass(frozen=True)
class RunSettings:
    """The settings of a run that decide how its calls became rows (from `config.json`)."""

    model: str | None = None
    merge: bool = True
    include_failed_attempts: bool = False
    estimator: Estimator = Estimator.GRPO
    advantage_level: AdvantageLevel = AdvantageLevel.ROLLOUT
    loss_mode: LossMode = LossMode.ROLLOUT_TOKEN_MEAN
    zero_variance: ZeroVariance = ZeroVariance.KEEP
    max_row_tokens: int | None = None
    credit: Credit = Credit.ROLLOUT
    step_coef: float = 1.0


def _section(cfg: Any, name: str) -> dict[str, Any]:
    value = cfg.get(name) if isinstance(cfg, dict) else None
    return value if isinstance(value, dict) else {}


def read_settings(run_dir: Path) -> RunSettings:
    """The run's adapter settings and model from `config.json` (the defaults when it is absent)."""
    path = run_dir / "config.json"
    try:
        cfg = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError) as e:
        raise RunError(f"{path} is not readable JSON ({e}); is this a harnessrl run directory?") from e
    engine = _section(cfg, "engine")
    train = _section(cfg, "train")
    try:
        estimator = Estimator(train.get("estimator", Estimator.GRPO))
        level = AdvantageLevel(train.get("advantage_level", AdvantageLevel.ROLLOUT))
        loss_mode = LossMode(train.get("loss_mode", LossMode.ROLLOUT_TOKEN_MEAN))
        zero_variance = ZeroVariance(train.get("zero_variance", ZeroVariance.KEEP))
        credit = Credit(train.get("credit", Credit.ROLLOUT))
    except ValueError as e:
        raise RunError(f"{path}: {e}") from e
    model = engine.get("model")
    return RunSettings(
        model=str(model) if model is not None else None,
        merge=bool(train.get("merge_calls", True)),
        include_failed_attempts=bool(train.get("train_on_failed_attempts", False)),
        estimator=estimator,
        advantage_level=level,
        loss_mode=loss_mode,
        zero_variance=zero_variance,
        max_row_tokens=max_row if isinstance(max_row := train.get("max_row_tokens"), int) else None,
        credit=credit,
        step_coef=float(coef) if isinstance(coef := train.get("step_coef"), int | float) else 1.0,
    )


def run_store_spec(run_dir: Path) -> str | None:
    """The store the run's config names (`store:` in config.json), when it is not the run's own
    `store.sqlite`: a PostgreSQL URL, or a SQLite file elsewhere."""
    try:
        spec = json.loads((run_dir / "config.json").read_text()).get("store")
    except (OSError, ValueError, AttributeError):
        return None
    return spec if isinstance(spec, str) and spec else None


def open_run_store(run_dir: Path) -> Store:
    """The run's store (its `store.sqlite`, or the PostgreSQL database or file its config names); a
    `RunError` naming the fix when `run_dir` holds no run."""
    if not run_dir.exists():
        raise RunError(f"no run directory at {run_dir}; pass the run_dir of a run (for example runs/demo)")
    if not run_dir.is_dir():
        raise RunError(f"{run_dir} is a file, not a run directory; pass the folder that holds {STORE_FILE}")
    spec = run_store_spec(run_dir)
    if spec is not None and (is_postgres_url(spec) or Path(spec).is_file()):
        try:
            return open_store(spec)
        except (StoreError, sqlite3.DatabaseError) as e:
            raise RunError(f"the run's store ({_redacted(spec)}) cannot be read: {e}") from e
    if not (run_dir / STORE_FILE).is_file():
        raise RunError(
            f"{run_dir} holds no {STORE_FILE}, so no run recorded anything there; pass the run_dir "
            "of a run that has started (for example runs/demo)"
        )
    try:
        return SQLiteStore(run_dir / STORE_FILE)
    except sqlite3.DatabaseError as e:
        raise RunError(f"{run_dir / STORE_FILE} is not a readable harnessrl store ({e})") from e


def _redacted(spec: str) -> str:
    """A store URL without its password."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", spec)


def all_rollouts(store: Store) -> list[Rollout]:
    """Every rollout of the store in creation order."""
    out: list[Rollout] = []
    cursor: int | None = 0
    while cursor is not None:
        page, cursor = store.list_rollouts(limit=1000, after=cursor)
        out.extend(page)
    return out


def find_rollout(rollouts: list[Rollout], key: str, run_dir: Path) -> Rollout:
    """The rollout whose id (or client id) is `key` or starts with it; a `RunError` if none or several."""
    exact = [r for r in rollouts if key in (r.rollout_id, r.client_id)]
    if exact:
        return exact[0]
    matches = [r for r in rollouts if r.rollout_id.startswith(key) or r.client_id.startswith(key)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise RunError(
            f"no rollout matches '{key}' in {run_dir} ({len(rollouts)} rollouts); "
            f"list them with: harnessrl inspect {run_dir}"
        )
    shown = ", ".join(r.rollout_id for r in matches[:8])
    more = f" and {len(matches) - 8} more" if len(matches) > 8 else ""
    raise RunError(f"'{key}' matches {len(matches)} rollouts ({shown}{more}); give more characters of the id")


def rollout_rows(detail: RolloutDetail, settings: RunSettings) -> list[MergeResult]:
    """The rows and breaks of a rollout, one `MergeResult` per attempt the trainer would use."""
    last = max((a.attempt for a in detail.attempts), default=0)
    used = sorted({c.attempt for c in detail.calls}) if settings.include_failed_attempts else [last]
    return [merge_calls([c for c in detail.calls if c.attempt == a], merge=settings.merge) for a in used]


@dataclass
class RolloutSummary:
    """One line of the index: a rollout with its place, reward, counts, rows and merge breaks."""

    rollout: Rollout
    place: Place
    reward: float | None
    attempts: int
    calls: int
    rows: int
    breaks: Counter[str] = field(default_factory=Counter)
    advantage: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (the `--json` index entry)."""
        r = self.rollout
        return {
            "rollout_id": r.rollout_id,
            "client_id": r.client_id,
            "phase": self.place.phase,
            "step": self.place.step,
            "group_index": self.place.group,
            "eval_label": self.place.label or None,
            "task_id": r.task_id,
            "group_id": r.group_id,
            "state": str(r.state),
            "reward": self.reward,
            "advantage": self.advantage,
            "attempts": self.attempts,
            "calls": self.calls,
            "rows": self.rows,
            "breaks": dict(self.breaks),
            "folder": f"rollouts/{r.rollout_id}",
        }


def summarize(detail: RolloutDetail, settings: RunSettings) -> RolloutSummary:
    """The index line of one rollout (rows and breaks recomputed with the adapter)."""
    results = rollout_rows(detail, settings)
    breaks: Counter[str] = Counter()
    for res in results:
        breaks.update(str(b) for b in res.breaks)
    return RolloutSummary(
        rollout=detail.rollout,
        place=rollout_place(detail.rollout),
        reward=detail.reward.value if detail.reward is not None else None,
        attempts=len(detail.attempts),
        calls=len(detail.calls),
        rows=sum(len(res.rows) for res in results),
        breaks=breaks,
    )


def advantages(
    store: Store, wanted: list[Rollout], everything: list[Rollout], settings: RunSettings
) -> dict[str, float]:
    """The advantage the trainer gave each rollout of `wanted`: group statistics over the graded
    (succeeded, rewarded) rollouts of each of their groups, with the run's estimator."""
    gids = {r.group_id for r in wanted if r.group_id is not None}
    rewards: dict[str, float] = {}
    groups: dict[str, str] = {}
    n_rows: dict[str, int] = {}
    for r in everything:
        if r.group_id not in gids or r.state != RolloutState.SUCCEEDED:
            continue
        reward = store.get_reward(r.rollout_id)
        if reward is None:
            continue
        rewards[r.rollout_id], groups[r.rollout_id] = reward.value, r.group_id or r.rollout_id
        if settings.advantage_level == AdvantageLevel.SAMPLE:
            detail = store.detail(r.rollout_id)
            n_rows[r.rollout_id] = sum(len(res.rows) for res in rollout_rows(detail, settings))
    if settings.advantage_level == AdvantageLevel.SAMPLE:
        return sample_level_advantages(rewards, groups, n_rows)
    return rollout_advantages(rewards, groups, settings.estimator)
