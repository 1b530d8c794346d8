"""The `rewrite_style` example: rewrite a sentence in a given style, graded by a judge model (no answer to check)."""
