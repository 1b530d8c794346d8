"""The `instruct` example: writing requests with verifiable constraints (length, keywords, format, JSON,
casing, sections, …), a single-call harness on the openai SDK, reward = fraction of constraints met."""

from __future__ import annotations
