"""What the dashboard shows, read from a run directory (or a bare store) without writing to it.

The store is opened read-only (SQLite `mode=ro`), so the dashboard can sit beside a running training.
Listings scale to runs of many thousands of rollouts: the place of each rollout (phase, step, group;
fixed at creation) is cached and extended with new rollouts only, the changing columns (state, reward,
call count) are read with one indexed query at most once a second, and rows and merge breaks (the
adapter's `merge_calls`, the expensive part) are computed only for the page of rollouts shown.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.adapter import AdvantageLevel
from harnessrl.adapter.advantage import rollout_advantages
from harnessrl.dashboard.suspects import Graded, checks_of, unbacked_rises
from harnessrl.export.traces import run_files
from harnessrl.inspection.report import rollout_view
from harnessrl.inspection.runview import (
    Place,
    RunError,
    RunSettings,
    find_rollout,
    place_of,
    read_settings,
    run_store_spec,
    summarize,
)
from harnessrl.inspection.tokens import load_decoder
from harnessrl.schema import Rollout, RolloutState
from harnessrl.store import SQLiteStore, StoreError, is_postgres_url, open_store
from harnessrl.store.sql import SQLStore

STORE_FILE = "store.sqlite"
SCAN_TTL_S = 1.0  # the changing columns are re-read at most this often
MAX_PAGE = 500
SUMMARY_CACHE = 50_000  # index lines kept (a few hundred bytes each)
ZERO_VARIANCE_EPS = 1e-12


@dataclass
class Entry:
    """One rollout in the listing: fixed facts (cached) and the changing ones (rescanned)."""

    seq: int
    rollout_id: str
    client_id: str
    task_id: str
    group_id: str | None
    place: Place
    state: str = "queued"
    attempts: int = 0
    reward: float | None = None
    calls: int = 0


@dataclass
class Filters:
    """What the rollout listing keeps (None: no condition)."""

    phase: str | None = "train"  # train | eval | other | None (all)
    step: int | None = None
    group: str | None = None
    task: str | None = None  # substring of the task id
    state: str | None = None  # a RolloutState, or "failed" = failed or cancelled
    zero_variance: bool = False  # only rollouts of groups whose graded rewards are all equal
    reward_min: float | None = None
    reward_max: float | None = None


@dataclass
class Scan:
    """The listing at one instant, with per-group reward statistics."""

    entries: list[Entry]
    group_rewards: dict[str, list[float]] = field(default_factory=dict)
    at: float = 0.0


def _open_reader(store_path: Path, run_dir: Path | None) -> SQLStore:
    """The store to read: the PostgreSQL database a run's config names, else the SQLite file, opened
    read-only (a reader beside the run's writer)."""
    spec = run_store_spec(run_dir) if run_dir is not None else None
    if spec is not None and is_postgres_url(spec):
        try:
            store = open_store(spec)
        except StoreError as e:
            raise RunError(f"the run's PostgreSQL store cannot be read: {e}") from e
        assert isinstance(store, SQLStore)
        return store
    if not store_path.is_file():
        raise RunError(f"no store at {store_path}; pass --run RUN_DIR (a run's run_dir) or --store FILE")
    try:
        return SQLiteStore(store_path, readonly=True)
    except Exception as e:  # sqlite3.DatabaseError and friends: not a harnessrl store
        raise RunError(f"{store_path} is not a readable harnessrl store ({e})") from e


class RunData:
    """A run's recorded data for the dashboard: overview, steps, groups, rollout pages, one rollout."""

    def __init__(self, store_path: Path, run_dir: Path | None = None) -> None:
        self.run_dir = run_dir if run_dir is not None else store_path.parent
        self.settings = (
            read_settings(self.run_dir) if (self.run_dir / "config.json").is_file() else RunSettings()
        )
        self.store = _open_reader(store_path, run_dir)
        self._lock = threading.Lock()
        self._fixed: list[Entry] = []
        self._by_seq: dict[int, Entry] = {}
        self._scan: Scan | None = None
        self._summaries: dict[str, tuple[tuple[str, int, int], dict[str, Any]]] = {}
        self._decoder = load_decoder(self.settings.model, self.run_dir)

    def close(self) -> None:
        """Release the store."""
        self.store.close()

    # listing --------------------------------------------------------------------------------------
    def _extend_fixed(self) -> None:
        last = self._fixed[-1].seq if self._fixed else 0
        rows = self.store.query(
            "SELECT seq, rollout_id, client_id, task_id, group_id, metadata FROM rollouts WHERE seq > ? ORDER BY seq",
            (last,),
        )
        for seq, rid, cid, task, gid, meta in rows:
            e = Entry(seq, rid, cid, task, gid, place_of(json.loads(meta), cid))
            self._fixed.append(e)
            self._by_seq[seq] = e

    def scan(self) -> Scan:
        """The listing with fresh states, rewards and call counts (cached for `SCAN_TTL_S`)."""
        with self._lock:
            if self._scan is not None and time.monotonic() - self._scan.at < SCAN_TTL_S:
                return self._scan
            self._extend_fixed()
            rows = self.store.query(
                "SELECT r.seq, r.state, r.n_attempts, w.value,"
                " (SELECT COUNT(*) FROM calls c WHERE c.rollout_id = r.rollout_id)"
                " FROM rollouts r LEFT JOIN rewards w ON w.rollout_id = r.rollout_id"
            )
            groups: dict[str, list[float]] = {}
            for seq, state, attempts, reward, calls in rows:
                e = self._by_seq.get(seq)
                if e is None:
                    continue  # created between the two reads: next scan
                e.state, e.attempts, e.reward, e.calls = state, attempts, reward, calls
                if e.group_id is not None and state == RolloutState.SUCCEEDED and reward is not None:
                    groups.setdefault(e.group_id, []).append(reward)
            self._scan = Scan(list(self._fixed), groups, time.monotonic())
            return self._scan

    def _zero_variance(self, scan: Scan, group: str | None) -> bool:
        rewards = scan.group_rewards.get(group or "", [])
        return len(rewards) >= 2 and max(rewards) - min(rewards) <= ZERO_VARIANCE_EPS

    def _keep(self, e: Entry, f: Filters, scan: Scan) -> bool:
        if f.phase is not None and e.place.phase != f.phase:
            return False
        if f.step is not None and e.place.step != f.step:
            return False
        if f.group is not None and e.group_id != f.group:
            return False
        if f.task and f.task not in e.task_id:
            return False
        if f.state == "failed":
            if e.state not in (RolloutState.FAILED, RolloutState.CANCELLED):
                return False
        elif f.state is not None and e.state != f.state:
            return False
        if f.zero_variance and not self._zero_variance(scan, e.group_id):
            return False
        if f.reward_min is not None and (e.reward is None or e.reward < f.reward_min):
            return False
        return not (f.reward_max is not None and (e.reward is None or e.reward > f.reward_max))

    def rollouts(self, f: Filters, offset: int = 0, limit: int = 50) -> dict[str, Any]:
        """One page of the rollouts that pass `f`, in step order, with rows and merge breaks."""
        scan = self.scan()
        kept = [e for e in scan.entries if self._keep(e, f, scan)]
        kept.sort(key=lambda e: (e.place.step is None, e.place.step or 0,
                                 -1 if e.place.group is None else e.place.group, e.place.label, e.seq))  # fmt: skip
        page = kept[offset : offset + max(1, min(limit, MAX_PAGE))]
        adv = self._advantages(scan) if self.settings.advantage_level == AdvantageLevel.ROLLOUT else {}
        items = []
        for e in page:
            line = self._summary(e)
            items.append({**line, "state": e.state, "reward": e.reward, "advantage": adv.get(e.rollout_id),
                          "zero_variance_group": self._zero_variance(scan, e.group_id)})  # fmt: skip
        return {"total": len(kept), "offset": offset, "limit": limit, "items": items}

    def _summary(self, e: Entry) -> dict[str, Any]:
        """The index line of a rollout (rows and breaks through the adapter), kept while its calls,
        attempts and state stay the same."""
        key = (e.state, e.calls, e.attempts)
        hit = self._summaries.get(e.rollout_id)
        if hit is not None and hit[0] == key:
            return hit[1]
        line = summarize(self.store.detail(e.rollout_id), self.settings).as_dict()
        if len(self._summaries) > SUMMARY_CACHE:
            self._summaries.clear()
        self._summaries[e.rollout_id] = (key, line)
        return line

    def _advantages(self, scan: Scan) -> dict[str, float]:
        rewards = {e.rollout_id: e.reward for e in scan.entries
                   if e.state == RolloutState.SUCCEEDED and e.reward is not None and e.place.phase != "eval"}  # fmt: skip
        groups = {e.rollout_id: e.group_id or e.rollout_id for e in scan.entries if e.rollout_id in rewards}
        return rollout_advantages(
            {k: v for k, v in rewards.items() if v is not None}, groups, self.settings.estimator
        )

    def groups(self, step: int | None, phase: str | None = "train") -> list[dict[str, Any]]:
        """The groups of a step (or all): task, rollouts, states, rewards, mean, spread, zero variance."""
        scan = self.scan()
        by: dict[str, list[Entry]] = {}
        for e in scan.entries:
            if (phase is None or e.place.phase == phase) and (step is None or e.place.step == step):
                by.setdefault(e.group_id or e.rollout_id, []).append(e)
        out = []
        for gid, members in by.items():
            rewards = [
                m.reward for m in members if m.reward is not None and m.state == RolloutState.SUCCEEDED
            ]
            mean = sum(rewards) / len(rewards) if rewards else None
            std = (
                math.sqrt(sum((r - (mean or 0.0)) ** 2 for r in rewards) / len(rewards)) if rewards else None
            )
            out.append({
                "group_id": gid, "task_id": members[0].task_id, "step": members[0].place.step,
                "rollouts": len(members), "succeeded": sum(m.state == RolloutState.SUCCEEDED for m in members),
                "failed": sum(m.state in (RolloutState.FAILED, RolloutState.CANCELLED) for m in members),
                "rewards": [m.reward for m in members], "reward_mean": mean, "reward_std": std,
                "zero_variance": len(rewards) >= 2 and std is not None and std <= ZERO_VARIANCE_EPS,
                "calls": sum(m.calls for m in members),
            })  # fmt: skip
        return out

    def suspects(self, checks: str, phase: str | None = "train") -> dict[str, Any]:
        """Rollouts whose reward rose while their checks (`details[checks]`) did not (`suspects.py`)."""
        scan = self.scan()
        rows = self.store.query(
            "SELECT r.seq, w.value, w.details FROM rollouts r JOIN rewards w ON w.rollout_id = r.rollout_id"
            " WHERE r.state = ?",
            (RolloutState.SUCCEEDED.value,),
        )
        by_seq = {e.seq: e for e in scan.entries}
        graded = []
        for seq, value, details_json in rows:
            e = by_seq.get(seq)
            if e is None or (phase is not None and e.place.phase != phase):
                continue
            details = json.loads(details_json)
            graded.append(Graded(e.rollout_id, e.task_id, e.group_id, e.place.step, value,
                                 checks_of(details, checks), details.get("hacking") or None))  # fmt: skip
        listed, without = unbacked_rises(graded)
        flagged = sum(g.hacking is not None for g in graded)
        return {"checks": checks, "graded": len(graded), "without_checks": without,
                "flagged_hacking": flagged, "items": listed}  # fmt: skip

    # run and steps --------------------------------------------------------------------------------
    def overview(self) -> dict[str, Any]:
        """The run: id, name, model, settings, summary, counts by phase and state."""
        run_id, config, metrics, summary = run_files(self.run_dir)
        scan = self.scan()
        counts: dict[str, dict[str, int]] = {}
        for e in scan.entries:
            c = counts.setdefault(e.place.phase, {})
            c[e.state] = c.get(e.state, 0) + 1
        return {
            "run_dir": str(self.run_dir), "run_id": run_id, "name": config.get("name"),
            "model": self.settings.model, "steps_recorded": len(metrics), "steps_planned":
            (config.get("train") or {}).get("steps"), "rollouts": len(scan.entries), "counts": counts,
            "settings": {"merge_calls": self.settings.merge, "estimator": str(self.settings.estimator),
                         "loss_mode": str(self.settings.loss_mode), "zero_variance": str(self.settings.zero_variance)},
            "summary": summary, "tokenizer": self._decoder.source, "live": self.live_token(),
        }  # fmt: skip

    def steps(self) -> dict[str, Any]:
        """The records of `metrics.jsonl` (one per step), with the rollouts of each step counted."""
        _, _, metrics, summary = run_files(self.run_dir)
        scan = self.scan()
        per: dict[int, dict[str, int]] = {}
        for e in scan.entries:
            if e.place.phase == "train" and e.place.step is not None:
                c = per.setdefault(e.place.step, {"rollouts": 0, "failed": 0})
                c["rollouts"] += 1
                c["failed"] += e.state in (RolloutState.FAILED, RolloutState.CANCELLED)
        steps = sorted({*per, *(int(m["step"]) for m in metrics if isinstance(m.get("step"), int))})
        return {"metrics": metrics, "recorded": per, "steps": steps, "summary": summary,
                "heldout": self._heldout(scan)}  # fmt: skip

    @staticmethod
    def _heldout(scan: Scan) -> list[dict[str, Any]]:
        """Each held-out evaluation read from its rollouts: label, step (updates behind it), sampling
        temperature, mean reward over the graded ones (as the trainer reports it), count, ungraded."""
        by: dict[str, list[Entry]] = {}
        for e in scan.entries:
            if e.place.phase == "eval" and e.place.step is not None:
                by.setdefault(e.place.label, []).append(e)
        out = []
        for label, members in by.items():
            rewards = [m.reward for m in members if m.reward is not None]
            out.append({
                "label": label, "step": members[0].place.step, "temperature": label.rsplit("-", 1)[-1],
                "mean": sum(rewards) / len(rewards) if rewards else None, "n": len(rewards),
                "ungraded": len(members) - len(rewards),
            })  # fmt: skip
        return sorted(out, key=lambda h: (h["temperature"], h["step"]))

    # one rollout ----------------------------------------------------------------------------------
    def rollout(self, key: str) -> dict[str, Any]:
        """One rollout: the inspect report (calls, rows with decoded tokens, breaks) plus each call's
        conversation (the messages it was sent, its answer)."""
        r = self.store.get_rollout(key)
        if r is None:
            scan = self.scan()
            stub = [Rollout(rollout_id=e.rollout_id, client_id=e.client_id, task_id=e.task_id,
                            created_at=0.0, updated_at=0.0) for e in scan.entries]  # fmt: skip
            r = self.store.get_rollout(find_rollout(stub, key, self.run_dir).rollout_id)
            assert r is not None
        group = [r]
        if r.group_id is not None:
            ids = self.store.query("SELECT rollout_id FROM rollouts WHERE group_id = ?", (r.group_id,))
            group = [x for (rid,) in ids if (x := self.store.get_rollout(rid)) is not None]
        report = rollout_view(self.store, self.run_dir, self.settings, r, group, self._decoder)
        calls = {c.call_id: c for c in self.store.calls(r.rollout_id)}
        for entry in report["calls"]:
            messages, tools, _ = calls[entry["call_id"]].conversation()
            entry["messages"] = [_message(m) for m in messages if isinstance(m, dict)]
            entry["tools"] = [t.get("function", {}).get("name") for t in tools or [] if isinstance(t, dict)]
        return report

    def live_token(self) -> dict[str, Any]:
        """What changes while a run goes on: the last event, rewards written, metrics size."""
        ((last_event,),) = self.store.query("SELECT COALESCE(MAX(seq), 0) FROM events")
        ((rewards,),) = self.store.query("SELECT COUNT(*) FROM rewards")
        ((calls,),) = self.store.query("SELECT COALESCE(MAX(seq), 0) FROM calls")
        m = self.run_dir / "metrics.jsonl"
        return {"events": last_event, "rewards": rewards, "calls": calls,
                "metrics_bytes": m.stat().st_size if m.is_file() else 0}  # fmt: skip


def _message(m: dict[str, Any]) -> dict[str, Any]:
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    tool_calls = []
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function", {}) if isinstance(tc, dict) else {}
        tool_calls.append({"name": fn.get("name"), "arguments": fn.get("arguments")})
    return {
        "role": m.get("role"),
        "content": "" if content is None else str(content),
        "tool_calls": tool_calls,
    }
