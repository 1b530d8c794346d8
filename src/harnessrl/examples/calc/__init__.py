"""The `calc` example: arithmetic problems, a calculator-tool harness on the openai SDK, exact grading."""

from __future__ import annotations
