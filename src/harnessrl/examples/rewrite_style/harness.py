"""The `rewrite_style` harness: one chat call on the official `openai` SDK; the rewrite goes to
`answer.txt`, which the judge reads. It knows nothing of harnessrl (the harness contract only)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from openai import OpenAI

MODEL = "gpt-4o-mini"  # any name: the gateway maps it to the served model


def main() -> int:
    """Entry point: rewrite the sentence of $HARNESSRL_TASK and write $HARNESSRL_OUTPUT/answer.txt."""
    if "HARNESSRL_TASK" not in os.environ or "HARNESSRL_OUTPUT" not in os.environ:
        print("error: HARNESSRL_TASK / HARNESSRL_OUTPUT are not set; the controller starts this harness",
              file=sys.stderr)  # fmt: skip
        return 2
    task = json.loads(Path(os.environ["HARNESSRL_TASK"]).read_text())
    client = OpenAI(max_retries=5, timeout=600)
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": task["prompt"]}])
    text = (resp.choices[0].message.content or "").strip()
    Path(os.environ["HARNESSRL_OUTPUT"], "answer.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
