"""The `search` harness: a plain agent loop on the official `openai` SDK with a BM25 `search` tool.

It runs as a plain script and knows nothing of harnessrl's training machinery: it reads the harness
contract (`OPENAI_BASE_URL`, `OPENAI_API_KEY`, `HARNESSRL_TASK`, `HARNESSRL_OUTPUT`), loops
model → search → model until the model answers without a tool call (or `MAX_TURNS` model calls), and
writes `answer.json`. The only project code it imports is the corpus it searches: the knowledge base
is regenerated from the task's `kb_seed` (deterministic, a few milliseconds) and indexed with BM25.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from openai import APIStatusError, OpenAI

from harnessrl.examples.search.bm25 import BM25
from harnessrl.examples.search.corpus import cached_kb

MAX_TURNS = 10
MAX_TOKENS = 64
MODEL = "gpt-4o-mini"  # any name: the gateway maps it to the served model
SYSTEM = (
    "You answer questions about a made-up world. You know nothing about it, so look up every name "
    "with the search tool. To search, reply with exactly:\n"
    '<tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call>\n'
    "Search one name at a time. When the results show the answer, reply: The answer is <answer>."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the encyclopedia of the world; returns the best matching articles.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]


def format_results(results: list[tuple[str, str]]) -> str:
    """What the search tool returns: numbered `title: text` lines (or a note that nothing matched)."""
    if not results:
        return "No results."
    return "\n".join(f"[{i}] {title}: {text}" for i, (title, text) in enumerate(results, 1))


def worked_example(
    question: str, steps: list[tuple[str, str, str]], answer: tuple[str, str]
) -> list[dict[str, Any]]:
    """A solved exchange shown to the model as earlier turns: the question, then per step (a note on
    what the last result showed, a search, its result), then (the fact found, the answer)."""
    out: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for i, (note, query, result) in enumerate(steps):
        call = {
            "id": f"call_example_{len(question)}_{i}",
            "type": "function",
            "function": {"name": "search", "arguments": json.dumps({"query": query})},
        }
        out.append({"role": "assistant", "content": note, "tool_calls": [call]})
        out.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    out.append({"role": "assistant", "content": f"{answer[0]} The answer is {answer[1]}."})
    return out


# A one-hop and a two-hop example over names the knowledge base never uses (corpus.RESERVED_WORDS).
_PELU = (
    "Pelu Garrow",
    "Pelu Garrow is a baker. Pelu Garrow was born in Quarl. Pelu Garrow works for Frenn Labs.",
)
_TESK = (
    "Tesk Holdings",
    "Tesk Holdings was founded by Moro Vint. Tesk Holdings was founded in 1950. Tesk Holdings is based in Osta.",
)
_MORO = ("Moro Vint", "Moro Vint is a sailor. Moro Vint was born in Quarl. Moro Vint works for Frenn Labs.")
EXAMPLES = worked_example(
    "Which company does Pelu Garrow work for?",
    [("", "Pelu Garrow", format_results([_PELU]))],
    ("Pelu Garrow works for Frenn Labs.", "Frenn Labs"),
) + worked_example(
    "In which city was the founder of Tesk Holdings born?",
    [
        ("", "Tesk Holdings", format_results([_TESK])),
        (
            "Tesk Holdings was founded by Moro Vint. Next I search Moro Vint.",
            "Moro Vint",
            format_results([_MORO]),
        ),
    ],
    ("Moro Vint was born in Quarl.", "Quarl"),
)
NUDGE = "Use the search tool, or give your final answer."
_ANSWER = re.compile(r"answer is\s*:?\s*(.+)|answer\s*:\s*(.+)", re.IGNORECASE)


class Searcher:
    """BM25 over the documents of the knowledge base of one seed."""

    def __init__(self, kb_seed: int, top_k: int) -> None:
        self.docs = cached_kb(kb_seed).documents()
        self.index = BM25([text for _, text in self.docs])
        self.top_k = top_k

    def __call__(self, query: str) -> list[tuple[str, str]]:
        """The best `top_k` (title, text) documents for `query`."""
        return [self.docs[i] for i, _ in self.index.search(query, self.top_k)]


def run_tool(search: Searcher, name: str, arguments: str) -> tuple[str, str | None]:
    """Execute one tool call; returns (result text, the query or None). Errors are results too."""
    if name != "search":
        return f"error: unknown tool {name!r}; the only tool is search", None
    try:
        args = json.loads(arguments)
        query = str(args["query"]) if isinstance(args, dict) else str(args)
    except (json.JSONDecodeError, KeyError) as e:
        return f"error: arguments must be {{'query': '...'}} ({e})", None
    return format_results(search(query[:200])), query


def final_answer(text: str | None) -> str | None:
    """The answer in the model's final message: after 'The answer is', else the first line."""
    if not text or not text.strip():
        return None
    m = _ANSWER.search(text)
    line = (m.group(1) or m.group(2)) if m else text.strip()
    line = line.strip().splitlines()[0] if line.strip() else ""
    return line.strip().rstrip(".").strip() or None


def solve(client: OpenAI, search: Searcher, question: str) -> dict[str, Any]:
    """Run the agent loop on one question: a reply with neither a tool call nor an answer gets a nudge."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, *EXAMPLES]
    messages.append({"role": "user", "content": question})
    queries: list[str | None] = []
    text: str | None = None
    stop, nudges = "max_turns", 0
    for turn in range(MAX_TURNS):
        try:
            resp = client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
                max_tokens=MAX_TOKENS,
            )
        except APIStatusError as e:  # e.g. the context is full: the attempt ends without an answer
            print(f"model call {turn} failed: {e.status_code} {e.message}", file=sys.stderr)
            text, stop = None, f"error {e.status_code}"
            break
        msg = resp.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        text = msg.content
        if msg.tool_calls:
            for tc in msg.tool_calls:
                fn = getattr(tc, "function", None)
                result, query = (
                    run_tool(search, fn.name, fn.arguments) if fn else ("error: not a function", None)
                )
                queries.append(query)
                messages.append({"role": "tool", "tool_call_id": tc.id, "content": result})
        elif _ANSWER.search(text or "") or turn == MAX_TURNS - 1:
            stop = "answered"
            break
        else:
            nudges += 1
            messages.append({"role": "user", "content": NUDGE})
    answer = final_answer(text) if stop == "answered" else None
    return {
        "answer": answer,
        "text": text,
        "tool_calls": len(queries),
        "queries": queries,
        "nudges": nudges,
        "stop": stop,
    }


def main() -> int:
    """Entry point: solve the task in $HARNESSRL_TASK and write $HARNESSRL_OUTPUT/answer.json."""
    if "HARNESSRL_TASK" not in os.environ:
        print("error: HARNESSRL_TASK is not set; the controller starts this harness", file=sys.stderr)
        return 2
    task = json.loads(Path(os.environ["HARNESSRL_TASK"]).read_text())
    search = Searcher(int(task.get("kb_seed", 0)), int(task.get("top_k", 2)))
    client = OpenAI(max_retries=5, timeout=600)
    out = solve(client, search, task["question"])
    Path(os.environ["HARNESSRL_OUTPUT"], "answer.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
