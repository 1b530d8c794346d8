"""Data and grader of the `search` example: multi-hop questions over a generated knowledge base.

Train and held-out questions share the knowledge base (`corpus.build_kb(seed)`) but never a question:
held-out questions come from their own seeded stream, independent of `n_train`, and the train stream
skips every held-out text. The grader scores the harness's answer against the gold answer by token F1
(default: partial credit, so a tiny model gets signal) or exact match, after normalisation.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter
from typing import Literal

from harnessrl.controller.grader import Grader
from harnessrl.controller.runner import AttemptResult
from harnessrl.examples.search.corpus import KnowledgeBase, Question, cached_kb, make_question
from harnessrl.schema import RewardIn, Task

# Share of questions per number of hops (searches needed). 1-hop questions keep the base rate of a tiny
# model above zero; 2–4-hop ones are the multi-hop task proper.
HOP_WEIGHTS: dict[int, float] = {1: 0.6, 2: 0.25, 3: 0.1, 4: 0.05}
TOP_K = 1  # documents the search tool returns per query
Metric = Literal["f1", "exact"]
METRIC: Metric = "f1"

# Words the grader ignores: articles and the generic words of entity names ("the Ravel River" = "Ravel").
IGNORED_WORDS = frozenset(
    {"a", "an", "the", "of", "river", "sea", "industries", "labs", "holdings", "works", "city"}
)
_PUNCT = re.compile(f"[{re.escape(string.punctuation)}]")


def _questions(kb: KnowledgeBase, n: int, rng: random.Random, exclude: set[str]) -> list[Question]:
    """`n` distinct questions (hop counts drawn from HOP_WEIGHTS) whose texts are not in `exclude`."""
    hops, weights = list(HOP_WEIGHTS), list(HOP_WEIGHTS.values())
    out: list[Question] = []
    seen = set(exclude)
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 500 * (n + 1):
            raise ValueError(f"could not generate {n} distinct questions; the knowledge base is too small")
        h = rng.choices(hops, weights)[0]
        for _ in range(100):  # keep the drawn hop count: retry the walk until it yields a new question
            q = make_question(kb, rng, h)
            if q is not None and q.text not in seen:
                seen.add(q.text)
                out.append(q)
                break
    return out


def build_splits(n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """Train and held-out tasks over the knowledge base of `seed`; no held-out question is in train."""
    kb = cached_kb(seed)
    held = _questions(kb, n_heldout, random.Random(f"search-heldout-{seed}"), set())
    train = _questions(kb, n_train, random.Random(f"search-train-{seed}"), {q.text for q in held})
    return (
        [_task(q, f"train-{i}", seed) for i, q in enumerate(train)],
        [_task(q, f"heldout-{i}", seed) for i, q in enumerate(held)],
    )


def _task(q: Question, task_id: str, seed: int) -> Task:
    return Task(
        task_id=task_id,
        input={"question": q.text, "kb_seed": seed, "top_k": TOP_K},
        reference={"answer": q.answer, "hops": q.hops, "chain": [list(h) for h in q.chain]},
    )


def normalize_answer(text: str) -> list[str]:
    """Lower-case words without punctuation, articles or generic name words."""
    words = _PUNCT.sub(" ", text.lower()).split()
    return [w for w in words if w not in IGNORED_WORDS]


def exact_match(prediction: str, gold: str) -> float:
    """1.0 if the normalised answers are equal, else 0.0."""
    return 1.0 if normalize_answer(prediction) == normalize_answer(gold) else 0.0


def token_f1(prediction: str, gold: str) -> float:
    """Harmonic mean of word precision and recall between the normalised answers."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def make_grader(metric: Metric = METRIC) -> Grader:
    """A grader scoring `answer.json` by `metric` ("f1" or "exact"); details carry both scores."""
    if metric not in ("f1", "exact"):
        raise ValueError(f"metric must be 'f1' or 'exact', not {metric!r}")

    def grade(task: Task, result: AttemptResult) -> RewardIn:
        """Score the harness's answer against the task's gold answer."""
        gold = str(task.reference["answer"])
        base = {"expected": gold, "hops": task.reference.get("hops"), "metric": metric}
        answer_file = result.output_dir / "answer.json"
        if not answer_file.exists():
            return RewardIn(value=0.0, details={**base, "reason": "no answer.json written", "tool_calls": 0})
        out = json.loads(answer_file.read_text())
        answer = out.get("answer")
        text = answer if isinstance(answer, str) else ""
        em, f1 = exact_match(text, gold), token_f1(text, gold)
        details = {**base, "answer": answer, "exact": em, "f1": f1, "tool_calls": out.get("tool_calls", 0)}
        return RewardIn(value=f1 if metric == "f1" else em, details=details)

    return grade


grade = make_grader()
grade_exact = make_grader("exact")  # grader.python: harnessrl.examples.search.task:grade_exact
