"""Tasks of the `rewrite_style` example: a sentence and a style to rewrite it in. There is no reference
answer: a judge model grades the rewrites against the rubric (`rubric.txt`, `grader.judge` in config.yaml).

Train and held-out tasks never share a sentence, so the held-out score measures the style, not recall.
"""

from __future__ import annotations

import random

from harnessrl.schema import Task

SENTENCES = [
    "The meeting has been moved to Thursday afternoon.",
    "Please remember to water the plants while I am away.",
    "The train was late again this morning.",
    "I could not find my keys anywhere.",
    "The soup needs a little more salt.",
    "Our team won the match by two goals.",
    "It is going to rain all weekend.",
    "The library closes at six o'clock.",
    "My computer stopped working during the call.",
    "We are out of milk and bread.",
    "The new bridge opens to traffic next month.",
    "She finished the marathon in under four hours.",
    "The cat knocked the glass off the table.",
    "Please send me the report by Friday.",
    "The museum is free on the first Sunday of the month.",
    "He forgot his umbrella at the office.",
    "The concert was cancelled because of the storm.",
    "I have been learning to play the guitar.",
    "The printer on the second floor is out of paper.",
    "Dinner will be ready in twenty minutes.",
    "The children built a snowman in the garden.",
    "Our flight was delayed by three hours.",
    "The shop on the corner sells fresh bread.",
    "Turn left after the old church.",
    "The river flooded the lower fields last spring.",
    "I will call you back after lunch.",
    "The battery is almost empty.",
    "They painted the kitchen bright yellow.",
    "The bus stop has moved across the street.",
    "We planted tomatoes and beans this year.",
]
STYLES = {
    "pirate": "as a pirate would say it",
    "formal": "in very formal, polite business English",
    "shakespeare": "in the style of Shakespeare",
    "child": "as a five-year-old child would say it",
}


def prompt(sentence: str, style: str) -> str:
    """The instruction the harness sends: the sentence and the style, and to answer with the rewrite only."""
    return f"Rewrite this sentence {STYLES[style]}. Answer with the rewritten sentence only.\n\n{sentence}"


def build_splits(n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """Train and held-out tasks (sentence × style) on disjoint sentences; ids say which is which."""
    rng = random.Random(seed)
    sentences = SENTENCES[:]
    rng.shuffle(sentences)
    cut = max(1, len(sentences) // 4)
    held_s, train_s = sentences[:cut], sentences[cut:]

    def tasks(pool: list[str], n: int, split: str) -> list[Task]:
        pairs = [(s, st) for s in pool for st in STYLES]
        rng.shuffle(pairs)
        pairs = (pairs * (n // len(pairs) + 1))[:n] if n > 0 else pairs
        return [Task(task_id=f"{split}-{i}", input={"sentence": s, "style": st, "prompt": prompt(s, st)})
                for i, (s, st) in enumerate(pairs)]  # fmt: skip

    return tasks(train_s, n_train, "train"), tasks(held_s, n_heldout, "heldout")
