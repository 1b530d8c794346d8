"""The `calc` harness: a plain agent loop on the official `openai` SDK with a calculator tool.

It knows nothing of harnessrl (it imports only the standard library and `openai`, and runs as a plain
script): it reads the harness contract (`OPENAI_BASE_URL`, `OPENAI_API_KEY`,
`HARNESSRL_TASK`, `HARNESSRL_OUTPUT`), loops model → tool → model until the model answers without a
tool call (or `MAX_TURNS`), and writes `answer.json` to the output directory.

A task with `steps` instead of `question` is a chain (the `calc_chain` example): a running total
updated step by step, each step a fresh conversation ("The total is 45. Add 7 * 3. What is the new
total?") solved by the same loop, the model's answer carried into the next step as the new total.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import os
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from openai import OpenAI

MAX_TURNS = 4
MODEL = "gpt-4o-mini"  # any name: the gateway maps it to the served model
SYSTEM = (
    "You are a math assistant with a calculator. To use it, reply with exactly:\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>\n'
    "After you get the result, reply with the final answer."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def worked_example(question: str, expression: str, result: str) -> list[dict[str, Any]]:
    """A solved exchange (question → tool call → result → answer), shown to the model as earlier turns."""
    call = {
        "id": f"call_example_{len(expression)}",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": result},
        {"role": "assistant", "content": f"The answer is {result}."},
    ]


# Two worked examples: with one, SmolLM2-135M calls the tool ~3% of the time; with two, about half.
EXAMPLES = worked_example("What is 12 + 7 * 3?", "12 + 7 * 3", "33") + worked_example(
    "Compute 45 - 18.", "45 - 18", "27"
)
# The chain's worked examples: the same exchanges, phrased as steps on a running total.
CHAIN_EXAMPLES = worked_example(
    "The total is 12. Add 7 * 3. What is the new total?", "12 + 7 * 3", "33"
) + worked_example("The total is 45. Subtract 18. What is the new total?", "45 - 18", "27")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


# The calculator tool: a safe arithmetic evaluator (no `eval`).
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


class CalcError(ValueError):
    """The expression is not plain arithmetic or cannot be computed."""


def evaluate(expression: str) -> float:
    """Evaluate `+ - * / // % **` over numbers and parentheses."""
    if len(expression) > 200:
        raise CalcError("expression too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalcError(f"not an arithmetic expression: {expression!r}") from e
    return float(_eval(tree.body))


def _eval(node: ast.AST) -> float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise CalcError("exponent too large")
        try:
            return float(_BINOPS[type(node.op)](left, right))
        except (ZeroDivisionError, OverflowError) as e:
            raise CalcError(str(e)) from e
    raise CalcError("only numbers, + - * / // % ** and parentheses are allowed")


def format_number(x: float) -> str:
    """Print integers without a decimal point and other numbers to 6 decimals."""
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.6f}".rstrip("0").rstrip(".")


def tool_delay(spec: dict[str, Any] | None, rnd: random.Random) -> float:
    """Seconds a slow calculator takes: lognormal with the given median and sigma, capped (for the
    async-vs-sync benchmark: a tool whose latency has a long tail). No spec: no delay."""
    if not spec:
        return 0.0
    median, sigma, cap = float(spec["median_s"]), float(spec.get("sigma", 1.0)), float(spec.get("max_s", 60))
    return min(cap, median * math.exp(sigma * rnd.gauss(0.0, 1.0)))


def run_tool(name: str, arguments: str) -> str:
    """Execute one tool call and return its result as text (errors included, as a tool would)."""
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        args = json.loads(arguments)
        return format_number(evaluate(str(args["expression"])))
    except (json.JSONDecodeError, KeyError, TypeError, CalcError) as e:
        return f"error: {e}"


def final_number(text: str | None) -> str | None:
    """The last number in the model's final message, which the harness reports as its answer."""
    found = _NUMBER.findall(text or "")
    return found[-1] if found else None


def solve(
    client: OpenAI,
    question: str,
    latency: dict[str, Any] | None = None,
    examples: list[dict[str, Any]] | None = None,
    rnd: random.Random | None = None,
    model: str = MODEL,
) -> dict[str, Any]:
    """Run the agent loop on one question (the calculator sleeps per `latency`, if given), sending
    `model` as the model name."""
    rnd = rnd or random.Random(os.environ.get("HARNESSRL_ROLLOUT_ID", ""))
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, *(examples or EXAMPLES)]
    messages.append({"role": "user", "content": question})
    tool_calls = calls = 0
    text: str | None = None
    for _ in range(MAX_TURNS):
        calls += 1
        resp = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=96)  # type: ignore[arg-type]
        msg = resp.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        text = msg.content
        if not msg.tool_calls:
            break
        for tc in msg.tool_calls:
            tool_calls += 1
            fn = getattr(tc, "function", None)
            time.sleep(tool_delay(latency, rnd))
            result = run_tool(fn.name, fn.arguments) if fn else "error: unsupported tool call"
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": result})
    return {"answer": final_number(text), "text": text, "tool_calls": tool_calls, "calls": calls}


def solve_chain(
    client: OpenAI, start: float, steps: list[str], latency: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run a chain: each step one agent loop on "The total is T. <step> What is the new total?", T the
    model's previous answer. A step without a number in its answer ends the chain (nothing to carry).
    `calls_per_step`: how many model calls each step made (in order), so a grader can name a step's calls."""
    rnd = random.Random(os.environ.get("HARNESSRL_ROLLOUT_ID", ""))
    total, answers, tool_calls, calls_per_step = format_number(start), [], 0, []
    for step in steps:
        out = solve(
            client, f"The total is {total}. {step} What is the new total?", latency, CHAIN_EXAMPLES, rnd
        )
        answers.append(out["answer"])
        tool_calls += out["tool_calls"]
        calls_per_step.append(out["calls"])
        if out["answer"] is None:
            break
        total = out["answer"]
    return {
        "answers": answers,
        "tool_calls": tool_calls,
        "steps": len(steps),
        "calls_per_step": calls_per_step,
    }


def main() -> int:
    """Entry point: solve the task in $HARNESSRL_TASK and write $HARNESSRL_OUTPUT/answer.json."""
    if "HARNESSRL_TASK" not in os.environ:
        print("error: HARNESSRL_TASK is not set; the controller starts this harness", file=sys.stderr)
        return 2
    task = json.loads(Path(os.environ["HARNESSRL_TASK"]).read_text())
    client = OpenAI(max_retries=5, timeout=600)
    if "steps" in task:
        out = solve_chain(client, float(task["start"]), list(task["steps"]), task.get("tool_latency"))
    else:
        out = solve(client, task["question"], task.get("tool_latency"))
    Path(os.environ["HARNESSRL_OUTPUT"], "answer.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
