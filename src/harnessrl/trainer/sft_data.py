"""Rows for supervised fine-tuning from recorded calls (`harnessrl sft`): which rollouts, which tokens.

    details  = the rollouts of a run directory's store, or of a trace file (`harnessrl export --format trace`)
    kept     = graded rollouts with reward ≥ sft.min_reward (evaluation rollouts left out: held-out tasks)
    calls    = the last attempt's usable calls, in order
    calls'   = the same calls in the student's tokens where they came from another model (text-level)
    rows     = merge_calls(calls')        (adapter.merge: one row per merged sequence, loss on the answers)

Re-templating is text-level, and said as such: the recorded messages and answer of each call are
rendered again with the student's own chat template and tokenized with its tokenizer, the prompt with
`gateway.tito.build_prompt` — the rule that makes the gateway reuse an earlier call's exact tokens — so
a conversation of many calls merges into one row here exactly as it would have for the student. The
answer's tokens are what the student's template renders for the assistant turn, up to and including its
end-of-turn marker. Another model's token IDs and logprobs are never used: they mean nothing to the
student. `retemplate: auto` re-renders a rollout when its first call's recorded prompt is not what the
student's template and tokenizer give for its messages (a call without token IDs included).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.adapter import MergeStats, Row, merge_calls
from harnessrl.adapter.merge import usable
from harnessrl.chat import ChatFormatError
from harnessrl.gateway.engine_client.inference import TitoTokenizer
from harnessrl.gateway.tito import build_prompt
from harnessrl.schema import Call, CallStatus, RolloutDetail, RolloutState


class SftDataError(ValueError):
    """The traces cannot give SFT rows (no such file, nothing left after the filter); says what to do."""


@dataclass
class SftReport:
    """What the filter kept and how the rows were made."""

    rollouts: int = 0
    kept: int = 0
    below_min_reward: int = 0
    ungraded: int = 0
    eval_rollouts: int = 0
    retemplated: int = 0  # rollouts re-rendered with the student's template (text-level)
    calls: int = 0
    unrenderable_calls: int = 0  # calls whose messages or answer the student's template cannot render
    rows: int = 0
    tokens: int = 0
    trainable_tokens: int = 0
    breaks: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def load_details(source: Path) -> list[RolloutDetail]:
    """The rollouts recorded in a run directory (its store) or a trace file (`harnessrl export`)."""
    if source.is_dir():
        from harnessrl.inspection.runview import RunError, all_rollouts, open_run_store

        try:
            store = open_run_store(source)
        except RunError as e:
            raise SftDataError(str(e)) from e
        try:
            return [store.detail(r.rollout_id) for r in all_rollouts(store)]
        finally:
            store.close()
    if not source.is_file():
        raise SftDataError(f"--from {source}: no such run directory or trace file")
    from harnessrl.export.traces import TraceError, open_text, read_trace

    try:
        with open_text(source) as f:
            _, rollouts = read_trace(f, str(source))
            return [RolloutDetail.model_validate(dict(r)) for r in rollouts]
    except TraceError as e:
        raise SftDataError(str(e)) from e


def answer_ids(call: Call, tok: TitoTokenizer) -> list[int] | None:
    """The student's tokens of the call's answer: its template's assistant turn after the rendered
    prompt, through the end-of-turn marker; None when the call has no answer or it cannot be rendered."""
    messages, tools, answer = call.conversation()
    if not messages or answer is None:
        return None
    try:
        prompt = tok.chat.render(messages, tools)
        full = tok.chat.render([*messages, answer], tools, False)
    except (ChatFormatError, TypeError, ValueError):
        return None
    if not full.startswith(prompt):
        return None
    rest = full[len(prompt) :]
    ends = [rest.find(s) + len(s) for s in tok.chat.rules.stop_texts if s and s in rest]
    if not ends:
        return None
    return tok.encode(rest[: min(ends)])


def retemplate_calls(calls: Sequence[Call], tok: TitoTokenizer) -> tuple[list[Call], int]:
    """The calls in the student's tokens (see the module docstring), and how many could not be rendered.
    Logprobs are 0: SFT does not use them."""
    out: list[Call] = []
    skipped = 0
    for call in calls:
        completion = answer_ids(call, tok) if call.status == CallStatus.OK else None
        if not completion:
            skipped += call.status == CallStatus.OK
            continue
        messages, tools, _ = call.conversation()
        prompt = build_prompt(messages, tools, out, tok.encode, tok.eos_id, chat=tok.chat)
        out.append(call.model_copy(update={
            "prompt_ids": prompt.prompt_ids, "completion_ids": completion,
            "completion_logprobs": [0.0] * len(completion), "temperature": 1.0,
        }))  # fmt: skip
    return out, skipped


def own_tokens(call: Call, tok: TitoTokenizer) -> bool:
    """Whether the call's recorded prompt is what the student's template and tokenizer give."""
    messages, tools, _ = call.conversation()
    if not call.prompt_ids or not messages:
        return False
    try:
        return tok.encode(tok.chat.render(messages, tools)) == list(call.prompt_ids)
    except (ChatFormatError, TypeError, ValueError):
        return False


def _keep(d: RolloutDetail, min_reward: float | None, include_eval: bool, report: SftReport) -> bool:
    """The filter: graded and successful (unless no reward is asked for), not an evaluation, reward ≥ min."""
    if not include_eval and "eval" in (d.rollout.metadata or {}):
        report.eval_rollouts += 1
        return False
    if min_reward is None:
        return True
    if d.reward is None or d.rollout.state != RolloutState.SUCCEEDED:
        report.ungraded += 1
        return False
    if d.reward.value < min_reward:
        report.below_min_reward += 1
        return False
    return True


def sft_rows(
    details: Sequence[RolloutDetail],
    tok: TitoTokenizer,
    min_reward: float | None = None,
    retemplate: str = "auto",
    include_eval: bool = False,
) -> tuple[list[Row], SftReport]:
    """The SFT rows of the rollouts that pass the filter (module docstring), with the report."""
    report = SftReport(rollouts=len(details))
    stats = MergeStats()
    rows: list[Row] = []
    for d in details:
        if not _keep(d, min_reward, include_eval, report):
            continue
        last = max((a.attempt for a in d.attempts), default=0)
        calls = [c for c in d.calls if c.attempt == last]
        ok = [c for c in calls if c.status == CallStatus.OK]
        if not ok:
            continue
        report.kept += 1
        report.calls += len(ok)
        again = retemplate == "always" or (retemplate == "auto" and not own_tokens(ok[0], tok))
        if again:
            calls, skipped = retemplate_calls(ok, tok)
            report.retemplated += 1
            report.unrenderable_calls += skipped
        result = merge_calls([c for c in calls if usable(c)])
        stats.add(result)
        rows.extend(result.rows)
    report.rows = len(rows)
    report.tokens = sum(len(r.tokens) for r in rows)
    report.trainable_tokens = sum(r.n_trainable for r in rows)
    report.breaks = dict(stats.breaks)
    return rows, report


def describe(report: SftReport) -> str:
    """One line for the terminal."""
    return json.dumps(report.as_dict())
