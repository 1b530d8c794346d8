"""The two views of `inspect` as plain JSON-ready dicts: the index of rollouts per step, and one
rollout's calls and rows. The terminal rendering (`render`) and `--json` both print these."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from harnessrl.adapter import MergeResult
from harnessrl.chat import tool_call_parts
from harnessrl.inspection.credit_view import credit_report
from harnessrl.inspection.runview import (
    RolloutSummary,
    RunError,
    RunSettings,
    advantages,
    all_rollouts,
    find_rollout,
    open_run_store,
    read_settings,
    rollout_place,
    rollout_rows,
    summarize,
)
from harnessrl.inspection.teacher_view import attach_teacher_logprobs, read_teacher_logprobs
from harnessrl.inspection.tokens import Decoder, load_decoder
from harnessrl.schema import Call, Rollout
from harnessrl.store import Store


def _sort_key(r: Rollout) -> tuple[int, int, int, str]:
    p = rollout_place(r)
    return (p.step is None, p.step or 0, -1 if p.group is None else p.group, p.label)


def select_rollouts(rollouts: list[Rollout], step: int | None, evals: bool) -> list[Rollout]:
    """The rollouts of the index: training ones (and any the trainer did not place), or held-out
    evaluation ones with `evals`; only those of `step` when given; in step order."""
    chosen = []
    for r in rollouts:
        p = rollout_place(r)
        if (p.phase == "eval") != evals:
            continue
        if step is not None and p.step != step:
            continue
        chosen.append(r)
    return sorted(chosen, key=_sort_key)  # stable: creation order within a step


def _no_step_message(rollouts: list[Rollout], step: int, evals: bool, run_dir: Path) -> str:
    places = [rollout_place(r) for r in rollouts]
    steps = sorted({p.step for p in places if p.step is not None and (p.phase == "eval") == evals})
    what = "evaluation" if evals else "training"
    have = f"steps with {what} rollouts: {_ranges(steps)}" if steps else f"it has no {what} rollouts by step"
    if not evals and any(p.group is not None for p in places):
        have += " (this run used the async schedule: its training rollouts are listed by group, g0, g1, ...)"
    return f"no {what} rollouts at step {step} in {run_dir}; {have}"


def _ranges(xs: list[int]) -> str:
    out: list[str] = []
    for x in xs:
        if out and out[-1].split("-")[-1] == str(x - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{x}"
        else:
            out.append(str(x))
    return ", ".join(out)


def index_report(
    run_dir: Path, step: int | None = None, evals: bool = False, limit: int | None = None
) -> dict[str, Any]:
    """The index: one entry per rollout (step, task, group, reward, advantage, attempts, calls, rows,
    merge breaks by cause) and per-step totals over the entries shown."""
    settings = read_settings(run_dir)
    store = open_run_store(run_dir)
    try:
        everything = all_rollouts(store)
        chosen = select_rollouts(everything, step, evals)
        if step is not None and not chosen:
            raise RunError(_no_step_message(everything, step, evals, run_dir))
        shown = chosen if not limit else chosen[:limit]
        summaries = [summarize(store.detail(r.rollout_id), settings) for r in shown]
        adv = advantages(store, shown, everything, settings) if not evals else {}
    finally:
        store.close()
    for s in summaries:
        s.advantage = adv.get(s.rollout.rollout_id)
    return {
        "run_dir": str(run_dir),
        "phase": "eval" if evals else "train",
        "total": len(chosen),
        "shown": len(shown),
        "steps": _step_totals(summaries),
        "rollouts": [s.as_dict() for s in summaries],
    }


def _step_totals(summaries: list[RolloutSummary]) -> list[dict[str, Any]]:
    by: dict[tuple[int | None, int | None, str], list[RolloutSummary]] = {}
    for s in summaries:
        by.setdefault((s.place.step, s.place.group, s.place.label), []).append(s)
    out = []
    for (step, group, label), items in by.items():
        rewards = [s.reward for s in items if s.reward is not None]
        breaks: Counter[str] = Counter()
        for s in items:
            breaks.update(s.breaks)
        out.append({
            "step": step, "group_index": group, "eval_label": label or None, "rollouts": len(items),
            "groups": len({s.rollout.group_id or s.rollout.rollout_id for s in items}),
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "calls": sum(s.calls for s in items), "rows": sum(s.rows for s in items), "breaks": dict(breaks),
        })  # fmt: skip
    return out


def rollout_report(run_dir: Path, key: str, tokenizer: Path | None = None) -> dict[str, Any]:
    """One rollout: its place, reward and attempts; every call (status, finish reason, weight version,
    token counts, decoded completion, tool calls, the break it caused); every row's tokens with their
    decoded pieces, loss mask and old logprobs."""
    settings = read_settings(run_dir)
    store = open_run_store(run_dir)
    try:
        everything = all_rollouts(store)
        rollout = find_rollout(everything, key, run_dir)
        return rollout_view(store, run_dir, settings, rollout, everything,
                            load_decoder(settings.model, run_dir, tokenizer))  # fmt: skip
    finally:
        store.close()


def rollout_view(store: Store, run_dir: Path, settings: RunSettings, rollout: Rollout,
                 group: list[Rollout], decoder: Decoder) -> dict[str, Any]:  # fmt: skip
    """The report of one rollout read from an open store; `group` holds (at least) the rollouts of its
    group, for its advantage."""
    detail = store.detail(rollout.rollout_id)
    adv = advantages(store, [rollout], group, settings)
    summary = summarize(detail, settings)
    summary.advantage = adv.get(rollout.rollout_id)
    results = rollout_rows(detail, settings)
    row_of, cause_of = row_positions(results)
    rows = _row_entries(results, decoder, detail.calls)
    attach_teacher_logprobs(rows, [r.call_ids for res in results for r in res.rows],
                            read_teacher_logprobs(run_dir, rollout.rollout_id))  # fmt: skip
    return {
        "run_dir": str(run_dir),
        "rollout": {
            **summary.as_dict(),
            "input": rollout.input,
            "metadata": rollout.metadata,
            "attempt_details": [
                {**a.model_dump(mode="json"), "folder": f"rollouts/{rollout.rollout_id}/attempt-{a.attempt}"}
                for a in detail.attempts
            ],
            "reward_details": detail.reward.details if detail.reward is not None else None,
        },
        "settings": {
            "merge_calls": settings.merge,
            "train_on_failed_attempts": settings.include_failed_attempts,
        },
        "tokenizer": decoder.source,
        "decoded": decoder.available,
        "calls": [
            _call_entry(c, decoder, row_of.get(c.call_id), cause_of.get(c.call_id)) for c in detail.calls
        ],
        "rows": rows,
        "credit": credit_report(detail),
    }


def row_positions(results: list[MergeResult]) -> tuple[dict[str, int], dict[str, str]]:
    """Which row each call went into, and the break cause of each call that started a row after the
    first one of its attempt (rows are created in call order, so break i starts row i + 1)."""
    row_of: dict[str, int] = {}
    cause_of: dict[str, str] = {}
    n = 0
    for res in results:
        for i, row in enumerate(res.rows):
            for cid in row.call_ids:
                row_of[cid] = n + i
            if i > 0:
                cause_of[row.call_ids[0]] = str(res.breaks[i - 1])
        n += len(res.rows)
    return row_of, cause_of


def _call_entry(call: Call, decoder: Decoder, row: int | None, cause: str | None) -> dict[str, Any]:
    _, _, answer = call.conversation()
    text = decoder.text(call.completion_ids) if decoder.available or not answer else _content(answer)
    return {
        "index": call.index,
        "call_id": call.call_id,
        "attempt": call.attempt,
        "status": str(call.status),
        "finish_reason": call.finish_reason,
        "weight_version": call.weight_version,
        "policy": call.policy,
        "face": call.face,
        "latency_s": call.latency_s,
        "prompt_tokens": len(call.prompt_ids),
        "completion_tokens": len(call.completion_ids),
        "completion_text": text,
        "tool_calls": _tool_calls(answer),
        "error": call.error,
        "row": row,
        "break_cause": cause,
    }


def _content(answer: dict[str, Any]) -> str:
    content = answer.get("content")
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def _tool_calls(answer: dict[str, Any] | None) -> list[dict[str, Any]]:
    return [
        {"name": name, "arguments": args}
        for _, name, args in tool_call_parts((answer or {}).get("tool_calls"))
    ]


def _row_entries(results: list[MergeResult], decoder: Decoder, calls: list[Call]) -> list[dict[str, Any]]:
    index_of = {c.call_id: c.index for c in calls}
    attempt_of = {c.call_id: c.attempt for c in calls}
    rows = [row for res in results for row in res.rows]
    return [
        {
            "index": i,
            "attempt": attempt_of.get(row.call_ids[0]),
            "calls": [index_of[c] for c in row.call_ids],
            "weight_versions": row.weight_versions,
            "policy": row.policy,
            "temperature": row.temperature,
            "n_tokens": len(row.tokens),
            "n_trainable": row.n_trainable,
            "tokens": row.tokens,
            "pieces": decoder.pieces(row.tokens),
            "loss_mask": row.loss_mask,
            "logprobs": row.old_logprobs,
        }
        for i, row in enumerate(rows)
    ]
