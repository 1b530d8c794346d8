"""`opencode_calc`: SmolLM2 trained behind a real CLI harness, OpenCode (npm `opencode-ai`, unmodified).

`harness.py` is a small wrapper of the harness contract: it writes an `opencode.json` (a provider that
points at the gateway with the rollout's key, and a short custom agent with only the `write` tool) into
the attempt's folder and runs `opencode run` on the task. `task.py` holds the tasks (the `calc`
example's arithmetic problems) and the grader (the answer file the agent wrote, else the last number
OpenCode printed). See
docs/examples/opencode_calc.md.
"""
