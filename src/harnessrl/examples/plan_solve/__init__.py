"""`plan_solve`: two roles in one harness, one adapter each. A planner call writes a short plan for a
calc problem (model name `planner`), a solver call follows it with the calculator tool (model name
`solver`); one reward per attempt trains both policies' adapters (docs/lora.md, "Several policies")."""

from __future__ import annotations
