"""The `search` example: multi-hop questions over a generated knowledge base of fictional entities,
a harness on the openai SDK with a BM25 `search` tool, and an F1 / exact-match grader."""

from __future__ import annotations
