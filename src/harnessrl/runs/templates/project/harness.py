"""A small agent on the official `openai` SDK with one tool, `multiply`.

It knows nothing of harnessrl: like any harness, it reads its model endpoint and key from
OPENAI_BASE_URL / OPENAI_API_KEY, its task from the JSON file named by HARNESSRL_TASK, and writes
its answer into the folder named by HARNESSRL_OUTPUT. Replace it with your own agent.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from openai import OpenAI

MODEL = "gpt-4o-mini"  # any name: the gateway serves the model being trained
MAX_TURNS = 4
SYSTEM = (
    "You are a careful assistant with a multiplication tool. To use it, reply with exactly:\n"
    '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>\n'
    "After you get the result, reply with the final answer."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]
# One solved exchange shown to the model as earlier turns: small models follow a format they have seen.
EXAMPLE: list[dict[str, Any]] = [
    {"role": "user", "content": "What is 12 times 34?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "multiply", "arguments": json.dumps({"a": 12, "b": 34})},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "408"},
    {"role": "assistant", "content": "The answer is 408."},
]


def multiply(arguments: str) -> str:
    """The tool: a * b, or an error message the model can read."""
    try:
        args = json.loads(arguments)
        result = float(args["a"]) * float(args["b"])
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {e}"
    return str(int(result)) if result == int(result) else str(result)


def solve(client: OpenAI, question: str) -> dict[str, Any]:
    """The agent loop: model -> tool -> model, until the model answers without a tool call."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, *EXAMPLE]
    messages.append({"role": "user", "content": question})
    text, tool_calls = "", 0
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=96)  # type: ignore[arg-type]
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        text = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            tool_calls += 1
            fn = getattr(call, "function", None)
            result = multiply(fn.arguments) if fn and fn.name == "multiply" else "error: unknown tool"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    return {"answer": numbers[-1] if numbers else None, "text": text, "tool_calls": tool_calls}


def main() -> int:
    """Solve the task in $HARNESSRL_TASK; write $HARNESSRL_OUTPUT/answer.json."""
    task = json.loads(Path(os.environ["HARNESSRL_TASK"]).read_text())
    out = solve(OpenAI(max_retries=3, timeout=600), task["question"])
    Path(os.environ["HARNESSRL_OUTPUT"], "answer.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
