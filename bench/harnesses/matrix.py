"""Regenerate the harness matrix in docs/harnesses.md from the suite's last results file.

The table sits between `<!-- harness-matrix:start -->` and `<!-- harness-matrix:end -->`; everything
else in the document is left as it is.

    python bench/harnesses/matrix.py [--results bench/results/harnesses.json] [--doc docs/harnesses.md]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
START, END = "<!-- harness-matrix:start -->", "<!-- harness-matrix:end -->"
MODES = ("passthrough", "tito")


def _merge(report: dict[str, Any] | None) -> str:
    """`rate` of one rollout's merge, with rows/calls and break causes; the main conversation's too."""
    if not report or not report.get("calls"):
        return "–"
    whole, main = report["calls"]["merge_all_calls"], report["calls"]["merge_main_conversation"]

    def one(m: dict[str, Any]) -> str:
        if m["calls"] < 2:
            return f"n/a ({m['calls']} call)"
        causes = ", ".join(f"{c}×{n}" for c, n in Counter(m["breaks"]).items())
        rows = f"{m['rows']} row{'s' if m['rows'] != 1 else ''}"
        return f"{m['merge_rate']:.2f} ({rows}/{m['calls']} calls{': ' + causes if causes else ''})"

    text = one(whole)
    if main["calls"] != whole["calls"]:
        text += f"; agent turns only: {one(main)}"
    return text


def _loop(report: dict[str, Any] | None) -> str:
    if not report:
        return "not run"
    if report["outcome"] == "pass":
        c = report["calls"]
        return f"pass ({c['with_token_ids']}/{c['recorded']} calls with token IDs)"
    return report["outcome"].replace("|", "\\|")[:160]


def _by_style(replay: dict[str, Any], mode: str, cell: Any) -> str:
    """One cell per mode: the template-style run, and the compact-JSON run when there was one."""
    first = cell(replay.get(mode))
    compact = replay.get(f"{mode}, compact")
    return first if compact is None else f"template JSON: {first}<br>compact JSON: {cell(compact)}"


def _first(entry: dict[str, Any]) -> dict[str, Any]:
    """The first mode's replay report that reached the gateway (for the columns both modes share)."""
    for mode in MODES:
        r = entry.get("replay", {}).get(mode) or {}
        if r.get("calls") or r.get("http"):
            return r
    return {}


def _smollm2(s: dict[str, Any] | None) -> str:
    if not s:
        return "not run"
    if s.get("outcome") == "answered":
        return (f"answered: prompt {s['prompt_tokens']} tokens, {s['completion_tokens']} generated "
                f"({s['finish_reason']}), {s['latency_s']} s")  # fmt: skip
    return str(s.get("outcome", "")).replace("|", "\\|")[:160]


def _notes(entry: dict[str, Any]) -> dict[str, list[Any]]:
    """The union over both modes' runs of the gateway's notes."""
    out: dict[str, set[Any]] = {"ignored_fields": set(), "dropped_tools": set(), "max_tokens_requested": set(),
                                "models_requested": set()}  # fmt: skip
    for r in entry.get("replay", {}).values():
        for key, values in ((r.get("calls") or {}).get("gateway_notes") or {}).items():
            out.setdefault(key, set()).update(values)
    return {k: sorted(v, key=str) for k, v in out.items()}


def _list(values: list[Any]) -> str:
    return ", ".join(f"`{v}`" for v in values) if values else "–"


def table(results: dict[str, Any]) -> str:
    """The markdown matrix of one results file."""
    head = ("| Harness | Version | API face | Streaming | Tools declared (called) | Tool loop: passthrough | "
            "Tool loop: tito | Merge rate: passthrough | Merge rate: tito | One turn on SmolLM2 (8,192 ctx) |")  # fmt: skip
    rows = [head, "|" + " --- |" * 10]
    for name, e in results["harnesses"].items():
        r = _first(e)
        http, calls = r.get("http") or {}, r.get("calls") or {}
        stream = {(True,): "yes", (False,): "no", (False, True): "both"}.get(
            tuple(http.get("streaming", [])), "–"
        )
        called = ", ".join(f"`{t}`" for t in calls.get("tools_called", []))
        tools = f"{calls['tools_declared']} ({called or 'none'})" if calls else "–"
        replay = e.get("replay", {})
        cells = [_by_style(replay, m, f) for f in (_loop, _merge) for m in MODES]
        rows.append(f"| {name} | {e['version']} | {e['face']} | {stream} | {tools} | {' | '.join(cells)} "
                    f"| {_smollm2(e.get('smollm2'))} |")  # fmt: skip
    rows += [
        "",
        "What the gateway noted in the call records of the replay runs (both modes): request fields it",
        "accepted and ignored for generation, tools it dropped from the prompt (hosted tools, deferred",
        "placeholders), and the output budgets and model names the harness asked for (any name is served",
        "by the mapped model).",
        "",
        "| Harness | Ignored fields | Dropped tools | max_tokens asked | Model names sent |",
        "|" + " --- |" * 5,
    ]
    for name, e in results["harnesses"].items():
        notes = _notes(e)
        rows.append(f"| {name} | {_list(notes['ignored_fields'])} | {_list(notes['dropped_tools'])} | "
                    f"{_list(notes['max_tokens_requested'])} | {_list(notes['models_requested'])} |")  # fmt: skip
    gw = results.get("gateway", {})
    note = (f"\nGenerated by `bench/harnesses/matrix.py` from `bench/results/harnesses.json` ({results['generated_at']}, "
            f"{results['seconds']} s on {results['machine']['cores']} cores; gateway at `{gw.get('last_commit', '?')}`"
            f"{' + uncommitted changes' if gw.get('uncommitted_changes') else ''}"
            f"{'; SmolLM2 answers capped at ' + str(results['smollm2_max_tokens']) + ' tokens' if 'smollm2_max_tokens' in results else ''}).")  # fmt: skip
    return "\n".join(rows) + "\n" + note


def main(argv: list[str] | None = None) -> int:
    """Rewrite the matrix section of the doc."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=REPO / "bench" / "results" / "harnesses.json")
    p.add_argument("--doc", type=Path, default=REPO / "docs" / "harnesses.md")
    args = p.parse_args(argv)
    doc = args.doc.read_text()
    if START not in doc or END not in doc:
        raise SystemExit(f"{args.doc} has no {START} ... {END} section")
    before, rest = doc.split(START, 1)
    after = rest.split(END, 1)[1]
    args.doc.write_text(f"{before}{START}\n{table(json.loads(args.results.read_text()))}\n{END}{after}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
