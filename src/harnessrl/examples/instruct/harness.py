"""The `instruct` harness: one chat call on the official `openai` SDK, the answer written to a file.

It knows nothing of harnessrl (it imports only the standard library and `openai`, and runs as a plain
script): it reads the harness contract (`OPENAI_BASE_URL`, `OPENAI_API_KEY`, `HARNESSRL_TASK`,
`HARNESSRL_OUTPUT`), sends the task's prompt as a single user message (no system message; the same
messages as `task.messages`, which a TRL baseline trains on) and writes `answer.json` with the text.
It sets no `max_tokens`: the run's `gateway.default_max_tokens` bounds the completion.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from openai import OpenAI

MODEL = "gpt-4o-mini"  # any name: the gateway maps it to the served model


def answer(client: OpenAI, prompt: str) -> dict[str, Any]:
    """Ask the model once; return its text and why it stopped."""
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}])
    choice = resp.choices[0]
    return {"text": choice.message.content or "", "finish_reason": choice.finish_reason}


def main() -> int:
    """Entry point: answer the prompt in $HARNESSRL_TASK and write $HARNESSRL_OUTPUT/answer.json."""
    if "HARNESSRL_TASK" not in os.environ or "HARNESSRL_OUTPUT" not in os.environ:
        print("error: HARNESSRL_TASK / HARNESSRL_OUTPUT are not set; the controller starts this harness",
              file=sys.stderr)  # fmt: skip
        return 2
    task = json.loads(Path(os.environ["HARNESSRL_TASK"]).read_text())
    client = OpenAI(max_retries=5, timeout=600)
    out = answer(client, task["prompt"])
    Path(os.environ["HARNESSRL_OUTPUT"], "answer.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
