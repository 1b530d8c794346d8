"""A small Okapi BM25 retriever in pure Python (the harness needs nothing beyond the standard library).

    score(q, d) = Σ_{t ∈ q} idf(t) · f(t, d) · (k1 + 1) / (f(t, d) + k1 · (1 − b + b · |d| / avgdl))
    idf(t)      = ln(1 + (N − n(t) + 0.5) / (n(t) + 0.5))        (never negative)

with f(t, d) the count of term t in document d, |d| its length in terms, avgdl the mean length, N the
number of documents and n(t) the number that contain t.
"""

from __future__ import annotations

import math
import re
from collections import Counter

_TOKEN = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    """Lower-cased alphanumeric terms."""
    return _TOKEN.findall(text.lower())


class BM25:
    """An index over a fixed list of documents; `search` returns the best (index, score) pairs."""

    def __init__(self, documents: list[str], k1: float = 1.5, b: float = 0.75) -> None:
        self.k1, self.b = k1, b
        self.counts = [Counter(tokenize(d)) for d in documents]
        self.lengths = [sum(c.values()) for c in self.counts]
        self.avgdl = sum(self.lengths) / max(len(self.lengths), 1)
        df: Counter[str] = Counter()
        for c in self.counts:
            df.update(c.keys())
        n = len(documents)
        self.idf = {t: math.log(1 + (n - m + 0.5) / (m + 0.5)) for t, m in df.items()}

    def scores(self, query: str) -> list[float]:
        """The BM25 score of every document for `query`."""
        terms = [t for t in tokenize(query) if t in self.idf]
        out = []
        for c, length in zip(self.counts, self.lengths, strict=True):
            norm = self.k1 * (1 - self.b + self.b * length / self.avgdl)
            out.append(sum(self.idf[t] * c[t] * (self.k1 + 1) / (c[t] + norm) for t in terms if t in c))
        return out

    def search(self, query: str, k: int = 3) -> list[tuple[int, float]]:
        """The `k` best documents with a positive score, best first (ties: lower index first)."""
        ranked = sorted(enumerate(self.scores(query)), key=lambda x: (-x[1], x[0]))
        return [(i, s) for i, s in ranked[:k] if s > 0]
