"""The `coding` example: SWE-smith-style bug-fix tasks built from HumanEval (a tiny repository
with a synthesised bug and pytest tests), the real `mini-swe-agent` as the harness, and a grader
that runs the task's tests outside the sandbox on the agent's changes. See docs/examples/coding.md."""

from __future__ import annotations
