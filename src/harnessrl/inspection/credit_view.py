"""What `inspect` shows of a rollout's credit: the judge's call (prompt, answer, parsed score or
ranking), the grader's step rewards and the harness's annotations (docs/credit.md)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from harnessrl.schema import RolloutDetail

MAX_PROMPT_CHARS = 2000  # of each judge prompt message shown in the terminal (the JSON report has all)


def credit_report(detail: RolloutDetail) -> dict[str, Any]:
    """The JSON-ready credit part of a rollout's report."""
    reward = detail.reward
    return {
        "judge": (reward.details.get("judge") if reward is not None else None),
        "step_rewards": [s.model_dump(mode="json") for s in (reward.steps if reward else [])],
        "annotations": [a.model_dump(mode="json") for a in detail.annotations],
        "annotation_rewards_allowed": detail.rollout.metadata.get("allow_annotation_rewards") is True,
    }


def _target(entry: dict[str, Any]) -> str:
    return (
        f"call {entry['call']}" if entry.get("call") is not None else f"tool call {entry.get('tool_call_id')}"
    )


def render_credit(console: Console, credit: dict[str, Any] | None) -> None:
    """Print the judge's call, the step rewards and the annotations of a rollout (nothing when none)."""
    if not credit:
        return
    judge = credit.get("judge")
    if isinstance(judge, dict):
        verdict = (f"score {judge['score']}" if "score" in judge
                   else f"ranking {judge.get('ranking')}, this rollout is candidate {judge.get('candidate')} "
                        f"at place {judge.get('place')}")  # fmt: skip
        console.rule(f"judge ({judge.get('mode')}, model {judge.get('model')}): {verdict}", align="left")
        for m in judge.get("prompt") or []:
            text = str(m.get("content", ""))
            cut = text[:MAX_PROMPT_CHARS] + (f"… ({len(text)} chars)" if len(text) > MAX_PROMPT_CHARS else "")
            console.print(Text(f"{m.get('role')}: ", style="bold") + Text(cut, style="dim"))
        console.print(Text("judge answered: ", style="bold") + Text(str(judge.get("answer", ""))))
        if isinstance(judge.get("digits"), dict):  # logprob mode: what the expected digit came from
            shown = ", ".join(f"{d}: {p:.3f}" for d, p in judge["digits"].items())
            console.print(Text("digits: ", style="bold") + Text(f"{shown} (their mass among the top 20 "
                                                                  f"first tokens: {judge.get('digit_mass')})"))  # fmt: skip
    rows = [("grader", _target(s), f"{s['value']:+.3f}", "") for s in credit["step_rewards"]]
    allowed = credit["annotation_rewards_allowed"]
    for a in credit["annotations"]:
        value = "-" if a.get("value") is None else f"{a['value']:+.3f}" + ("" if allowed else " (data)")
        rows.append(("annotation", _target(a), value, a.get("label") or ""))
    if not rows:
        return
    table = Table(title="step rewards and annotations", header_style="bold", title_justify="left")
    for name in ("from", "target", "value", "label"):
        table.add_column(name)
    for cells in rows:
        table.add_row(*(escape(c) for c in cells))
    console.print(table)
