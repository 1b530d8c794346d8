"""Group judging's arithmetic (pure): a ranking with ties, its rewards, the shuffle and its undoing,
and how far two judgments of one group agree.

A ranking names the m candidates best first, in tiers: `RANKING: 2 = 3 > 1` is the tiers [[2, 3], [1]].
A candidate's place is the mean of the places its tier spans (0 = best), so tied candidates share a
place; its reward is (m − 1 − place) / (m − 1):

    2 = 3 > 1   →   places 0.5, 0.5, 2   →   rewards 0.75, 0.75, 0

Strict rankings get 1, ..., 0 evenly spaced as before; the rewards of a group always sum to m / 2.

Candidates are shown in a shuffled order (`shown[j]` = the candidate at position j), so a judge that
prefers a position (the first, the last) spreads that preference evenly over the rollouts instead of
handing it to rollout 0 every time; the ranking the judge writes names positions, and `unshuffle` maps it
back to candidates. With `debias: swap` a second judgment shows the candidates in the reverse of the first
order and the two rewards are averaged: a judge that only ever prefers a position then gives every
candidate the same reward. `agreement` is the share of candidate pairs the two judgments order the same
way (ties included): 1 when they agree, 0 when one is the other reversed (pure position preference).
"""

from __future__ import annotations

import random
import re

RANKING_RE = re.compile(r"RANKING:\s*\**\s*([\d\s>=,]+)", re.IGNORECASE)


def parse_ranking(text: str, n: int) -> list[list[int]]:
    """The last `RANKING: a > b = c ...` of the judge's answer as tiers of 0-based candidates, best
    first (`,` and `>` separate tiers, `=` joins a tie); it must name each of the n candidates once
    (else `ValueError`, which the judge reports as a `JudgeError`)."""
    found = RANKING_RE.findall(text)
    if not found:
        raise ValueError(f"the judge's answer has no 'RANKING: a > b > ...' line: {text[-300:]!r}")
    tiers = [[int(x) - 1 for x in re.findall(r"\d+", part)] for part in re.split(r"[>,]", found[-1])]
    tiers = [t for t in tiers if t]
    if sorted(c for t in tiers for c in t) != list(range(n)):
        raise ValueError(
            f"the judge's ranking {found[-1].strip()!r} does not name each of the {n} candidates "
            f"(1..{n}) exactly once"
        )
    return tiers


def tier_rewards(tiers: list[list[int]]) -> list[float]:
    """Per candidate (by index): (m − 1 − place) / (m − 1), place being the mean place of its tier
    (0 = best); 1.0 for m = 1 (module docstring)."""
    m = sum(len(t) for t in tiers)
    out = [0.0] * m
    first = 0
    for tier in tiers:
        place = first + (len(tier) - 1) / 2
        for c in tier:
            out[c] = 1.0 if m == 1 else (m - 1 - place) / (m - 1)
        first += len(tier)
    return out


def rank_rewards(order: list[int]) -> list[float]:
    """Per candidate: the rewards of a strict ranking `order` (best first)."""
    return tier_rewards([[c] for c in order])


def shuffled(m: int, rng: random.Random) -> list[int]:
    """A random order to show m candidates in: `shown[j]` is the candidate at position j."""
    shown = list(range(m))
    rng.shuffle(shown)
    return shown


def unshuffle(tiers: list[list[int]], shown: list[int]) -> list[list[int]]:
    """A ranking of positions (what the judge saw) as a ranking of candidates."""
    return [[shown[j] for j in tier] for tier in tiers]


def agreement(a: list[float], b: list[float]) -> float:
    """The share of candidate pairs that rewards `a` and `b` order the same way (a tie is an order);
    1.0 when there is no pair."""
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    if not pairs:
        return 1.0
    sign = lambda x: (x > 1e-12) - (x < -1e-12)  # noqa: E731
    return sum(sign(a[i] - a[j]) == sign(b[i] - b[j]) for i, j in pairs) / len(pairs)
