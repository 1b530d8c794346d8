"""Terminal rendering of the `inspect` reports with rich: tables for the index and the calls, and each
row's tokens coloured by loss mask and logprob (marked ⟦…⟧ too, so the mask shows without colour)."""

from __future__ import annotations

import json
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from harnessrl.inspection.credit_view import render_credit

STATE_STYLE = {
    "succeeded": "green",
    "failed": "red",
    "cancelled": "yellow",
    "running": "cyan",
    "queued": "cyan",
}
PROMPT_STYLE = "dim"
TRAIN_OPEN, TRAIN_CLOSE = "⟦", "⟧"
MAX_COMPLETION_CHARS = 600


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _breaks(breaks: dict[str, int]) -> str:
    return " ".join(f"{k}×{v}" if v > 1 else k for k, v in sorted(breaks.items())) or "-"


def _state(state: str) -> Text:
    return Text(state, style=STATE_STYLE.get(state, ""))


def _reward(r: dict[str, Any]) -> Text:
    """The reward of a succeeded rollout; the state (failed, cancelled, running) of any other."""
    if r["state"] != "succeeded":
        return _state(r["state"])
    return Text(_num(r["reward"]))


def _group_labels(rollouts: list[dict[str, Any]]) -> dict[str, str]:
    """Short group names: `#1, #2, ...` in order of appearance within each step; `g{k}` for async."""
    labels: dict[str, str] = {}
    count: dict[Any, int] = {}
    for r in rollouts:
        gid = r["group_id"] or r["rollout_id"]
        if gid in labels:
            continue
        if r["group_index"] is not None:
            labels[gid] = f"g{r['group_index']}"
            continue
        count[r["step"]] = count.get(r["step"], 0) + 1
        labels[gid] = f"#{count[r['step']]}"
    return labels


def _table(title: str | None, columns: list[tuple[str, str, bool]], rows: list[list[str | Text]]) -> Table:
    """A compact table; columns marked fixed never wrap or shrink below their widest cell (ids,
    numbers), the others wrap."""
    table = Table(
        title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1),
        pad_edge=False, collapse_padding=True,
    )  # fmt: skip
    for i, (name, justify, fixed) in enumerate(columns):
        if fixed:
            width = max([len(name), *(len(str(r[i])) for r in rows)])
        else:  # room for the longest word, up to 16 characters
            width = min(max([len(w) for r in rows for w in str(r[i]).split()], default=1), 16)
        table.add_column(name, justify=justify, no_wrap=fixed, min_width=width, overflow="fold")  # type: ignore[arg-type]
    return table


def _filled_table(
    title: str | None, columns: list[tuple[str, str, bool]], rows: list[list[str | Text]]
) -> Table:
    """`_table` with its rows added."""
    table = _table(title, columns, rows)
    for cells in rows:
        table.add_row(*cells)
    return table


def render_index(console: Console, report: dict[str, Any]) -> None:
    """The index table (one line per rollout, a section per step) and the per-step totals."""
    rollouts = report["rollouts"]
    evals = report["phase"] == "eval"
    what = "held-out evaluation" if evals else "training"
    labels = _group_labels(rollouts)
    rows: list[list[str | Text]] = []
    for r in rollouts:
        group = r["eval_label"] if evals else labels[r["group_id"] or r["rollout_id"]]
        rows.append([
            _num(r["step"], "d"), escape(r["task_id"]), escape(group or "-"), r["rollout_id"], _reward(r),
            _num(r["advantage"], "+.2f"), str(r["attempts"]), str(r["calls"]), str(r["rows"]),
            _breaks(r["breaks"]),
        ])  # fmt: skip
    columns = [
        ("step", "right", True), ("task", "left", False), ("eval" if evals else "group", "left", not evals),
        ("rollout", "left", True), ("reward", "right", True), ("adv", "right", True),
        ("att", "right", True), ("calls", "right", True), ("rows", "right", True), ("merge breaks", "left", False),
    ]  # fmt: skip
    title = f"{report['run_dir']}: {what} rollouts ({report['shown']} of {report['total']})"
    table = _table(title, columns, rows)
    prev: Any = None
    for r, cells in zip(rollouts, rows, strict=True):
        key = (r["step"], r["group_index"], r["eval_label"])
        if table.row_count and key != prev:
            table.add_section()
        prev = key
        table.add_row(*cells)
    console.print(table)
    if report["total"] > report["shown"]:
        more = report["total"] - report["shown"]
        console.print(f"{more} more not shown: narrow with --step N, or raise --limit (0: all)")
    if len(report["steps"]) > 1:
        console.print(_step_table(report["steps"], evals))
    console.print(
        "one rollout's calls and rows: harnessrl inspect RUN_DIR --rollout ID (a unique prefix is enough)"
    )


def _step_table(steps: list[dict[str, Any]], evals: bool) -> Table:
    rows: list[list[str | Text]] = []
    for s in steps:
        group = s["eval_label"] or (str(s["groups"]) if s["group_index"] is None else f"g{s['group_index']}")
        rows.append([
            _num(s["step"], "d"), escape(group), str(s["rollouts"]), _num(s["reward_mean"]), str(s["calls"]),
            str(s["rows"]), _breaks(s["breaks"]),
        ])  # fmt: skip
    columns = [
        ("step", "right", True), ("eval" if evals else "groups", "left" if evals else "right", True),
        ("rollouts", "right", True), ("mean reward", "right", True), ("calls", "right", True),
        ("rows", "right", True), ("merge breaks", "left", False),
    ]  # fmt: skip
    return _filled_table("per step (rollouts shown)", columns, rows)


def render_rollout(console: Console, report: dict[str, Any], tokens: bool = False) -> None:
    """One rollout: its header, its calls, then each row's tokens (and with `tokens` a line per token)."""
    r = report["rollout"]
    console.print(_header(r, report))
    console.print(_calls_table(report["calls"]))
    _render_completions(console, report["calls"])
    render_credit(console, report.get("credit"))
    for row in report["rows"]:
        _render_row(console, row, tokens)
    if not report["rows"]:
        console.print("no rows: no call of the attempt the trainer uses produced tokens with logprobs")


def _header(r: dict[str, Any], report: dict[str, Any]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    where = r["phase"] + ("" if r["step"] is None else f", step {r['step']}")
    if r["group_index"] is not None:
        where += f", group g{r['group_index']}"
    if r["eval_label"]:
        where += f" ({r['eval_label']})"
    details = {k: v for k, v in (r["reward_details"] or {}).items() if k != "judge"}  # the judge: own section
    rows = [
        ("rollout", f"{r['rollout_id']}  (client id {r['client_id']})"),
        ("task", r["task_id"]), ("group", r["group_id"] or "-"), ("place", where), ("state", r["state"]),
        ("reward", _num(r["reward"]) + (f"  {json.dumps(details, ensure_ascii=False)}" if details else "")),
        ("advantage", _num(r["advantage"], "+.4f")),
        ("calls / rows", f"{r['calls']} calls, {r['rows']} rows, merge breaks: {_breaks(r['breaks'])}"),
    ]  # fmt: skip
    for a in r["attempt_details"]:
        end = f", exit {a['exit_code']}" if a["exit_code"] is not None else ""
        err = f", {a['error'][:200]}" if a["error"] else ""
        rows.append(
            (f"attempt {a['attempt']}", f"{a['status']}{end}{err}  {report['run_dir']}/{a['folder']}")
        )
    rows.append(
        (
            "tokenizer",
            report["tokenizer"] if report["decoded"] else f"none ({report['tokenizer']}): ids shown",
        )
    )
    for k, v in rows:
        grid.add_row(k, escape(str(v)))
    return grid


def _calls_table(calls: list[dict[str, Any]]) -> Table:
    rows: list[list[str | Text]] = [
        [
            str(c["index"]), str(c["attempt"]), Text(c["status"], style="green" if c["status"] == "ok" else "red"),
            c["finish_reason"] or "-", c.get("policy") or "-", _num(c["weight_version"], "d"), str(c["prompt_tokens"]),
            str(c["completion_tokens"]), _num(c["row"], "d"), c["break_cause"] or "-",
            Text(", ".join(_tool_call(t) for t in c["tool_calls"]) or "-"),
        ]
        for c in calls
    ]  # fmt: skip
    columns = [
        ("#", "right", True), ("att", "right", True), ("status", "left", True), ("finish", "left", True),
        ("policy", "left", True), ("weights", "right", True), ("prompt", "right", True), ("compl", "right", True), ("row", "right", True),
        ("break", "left", True), ("tool calls", "left", False),
    ]  # fmt: skip
    return _filled_table("calls", columns, rows)


def _tool_call(t: dict[str, Any]) -> str:
    args = t["arguments"]
    return f"{t['name']}({json.dumps(args, ensure_ascii=False) if not isinstance(args, str) else args})"


def _render_completions(console: Console, calls: list[dict[str, Any]]) -> None:
    """Each call's completion, decoded from the tokens the model sampled (or its error)."""
    for c in calls:
        text = c["completion_text"] or ""
        if len(text) > MAX_COMPLETION_CHARS:
            text = text[:MAX_COMPLETION_CHARS] + f"… ({len(text)} chars; the row shows all)"
        head = f"call {c['index']} completion" if c["status"] == "ok" else f"call {c['index']} failed"
        body = text if c["status"] == "ok" else (c["error"] or "")
        console.print(Text(head + ": ", style="bold") + Text(body))


def _logprob_style(lp: float) -> str:
    """Sampled tokens by how likely the model found them: likely green, unsure yellow, unlikely red."""
    if lp >= -0.5:
        return "bold green"
    if lp >= -2.3:
        return "bold yellow"
    return "bold red"


def _render_row(console: Console, row: dict[str, Any], tokens: bool) -> None:
    versions = ",".join("-" if v is None else str(v) for v in row["weight_versions"])
    console.rule(
        f"row {row['index']} (attempt {row['attempt']}): calls {','.join(map(str, row['calls']))}, "
        f"{row['n_tokens']} tokens, {row['n_trainable']} trainable, weight versions {versions}"
        + (f", policy {row['policy']}" if row.get("policy") else ""),
        align="left",
    )
    text = Text()
    for i, (piece, mask, lp) in enumerate(zip(row["pieces"], row["loss_mask"], row["logprobs"], strict=True)):
        prev = row["loss_mask"][i - 1] if i else 0
        nxt = row["loss_mask"][i + 1] if i + 1 < len(row["loss_mask"]) else 0
        if mask and not prev:
            text.append(TRAIN_OPEN, style="dim")
        text.append(piece, style=_logprob_style(lp) if mask else PROMPT_STYLE)
        if mask and not nxt:
            text.append(TRAIN_CLOSE, style="dim")
    console.print(text)
    console.print(_segment_table(row))
    if tokens:
        console.print(_token_table(row))


def _segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal mask: (start, end exclusive, mask)."""
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if out and out[-1][2] == m:
            out[-1] = (out[-1][0], i + 1, m)
        else:
            out.append((i, i + 1, m))
    return out


def _segment_table(row: dict[str, Any]) -> Table:
    table = Table(header_style="bold", box=None, padding=(0, 1))
    for name in ("tokens", "mask", "n", "mean logprob", "min logprob", "at"):
        table.add_column(name, justify="left" if name in ("tokens", "mask", "at") else "right")
    for start, end, m in _segments(row["loss_mask"]):
        if not m:
            table.add_row(
                f"{start}-{end - 1}", Text("prompt (0)", style=PROMPT_STYLE), str(end - start), "", "", ""
            )
            continue
        lps = row["logprobs"][start:end]
        k = min(range(start, end), key=lambda j: row["logprobs"][j])
        table.add_row(
            f"{start}-{end - 1}", Text("trainable (1)", style="bold green"), str(end - start),
            f"{sum(lps) / len(lps):.3f}", f"{row['logprobs'][k]:.3f}", Text(repr(row["pieces"][k])),
        )  # fmt: skip
    return table


def _token_table(row: dict[str, Any]) -> Table:
    table = Table(header_style="bold", box=None, padding=(0, 1))
    teacher = row.get("teacher_logprobs")  # runs with train.teacher: the teacher's beside the student's
    for name in ("pos", "id", "token", "mask", "logprob", *(["teacher"] if teacher else [])):
        table.add_column(name, justify="left" if name == "token" else "right")
    for i, (tok, piece, mask, lp) in enumerate(
        zip(row["tokens"], row["pieces"], row["loss_mask"], row["logprobs"], strict=True)
    ):
        style = _logprob_style(lp) if mask else PROMPT_STYLE
        cells: list[str | Text] = [
            str(i),
            str(tok),
            Text(repr(piece), style=style),
            str(mask),
            f"{lp:.4f}" if mask else "",
        ]
        if teacher:
            cells.append(f"{teacher[i]:.4f}" if mask and teacher[i] is not None else "")
        table.add_row(*cells)
    return table
