"""Data and grader of the `instruct` example: writing requests on simple topics with 1–3 verifiable
constraints, built offline and deterministically from a seed; reward = the fraction of constraints met.

Split: a prompt is a base request (a template × a topic) plus its constraint sentences. Held-out tasks
use only base requests whose stable hash falls in the held-out bucket, train tasks only the others, so
no held-out prompt (not even its base request) appears in train, whatever the sizes asked for. Each
split is a prefix-stable stream: `build_splits(n, …)` gives the first `n` tasks of `build_splits(m, …)`
for `m > n`.

The same tasks are available without the harness for a TRL `GRPOTrainer` baseline: `trl_dataset`
(chat-format prompts, the same messages the harness sends) and `reward_text` / `grpo_reward`.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator, Mapping
from typing import Any

from harnessrl.controller.runner import AttemptResult
from harnessrl.examples.instruct.checkers import Constraint, check, compatible, describe, kind_of
from harnessrl.schema import RewardIn, Task

TEMPLATES = (
    "Write a short paragraph about {topic}.",
    "Describe {topic} to a friend.",
    "Give some advice about {topic}.",
    "Explain why people like {topic}.",
    "Write a short story about {topic}.",
    "Tell me a few facts about {topic}.",
)
# topic -> words a response about it is likely to use (keywords to include or to forbid)
TOPICS: dict[str, tuple[str, ...]] = {
    "the ocean": ("water", "waves", "fish", "blue"),
    "coffee": ("cup", "morning", "beans", "hot"),
    "a rainy day": ("rain", "umbrella", "clouds", "wet"),
    "bicycles": ("wheels", "ride", "pedal", "road"),
    "gardening": ("plants", "soil", "flowers", "water"),
    "the moon": ("night", "sky", "light", "space"),
    "dogs": ("pet", "bark", "walk", "loyal"),
    "winter": ("snow", "cold", "ice", "warm"),
    "cooking pasta": ("water", "salt", "sauce", "boil"),
    "a city park": ("trees", "grass", "bench", "people"),
    "libraries": ("books", "read", "quiet", "shelves"),
    "trains": ("tracks", "station", "travel", "fast"),
    "friendship": ("trust", "friends", "time", "help"),
    "the mountains": ("hike", "peak", "snow", "view"),
    "music": ("song", "sound", "rhythm", "listen"),
    "breakfast": ("eggs", "bread", "morning", "coffee"),
    "the sun": ("light", "warm", "sky", "energy"),
    "learning a language": ("words", "practice", "grammar", "speak"),
    "birds": ("fly", "wings", "nest", "song"),
    "a school day": ("teacher", "class", "students", "lunch"),
    "cats": ("purr", "fur", "pet", "sleep"),
    "the forest": ("trees", "leaves", "animals", "green"),
}
UNRELATED_WORDS = ("lantern", "purple", "honest", "seven", "window", "silver", "puzzle", "orange", "candle")
START_WORDS = ("Yes", "Today", "Imagine", "Honestly", "First", "Well")
END_PHRASES = ("Thank you for reading.", "That is all.", "Have a nice day!", "The end.")
JSON_KEYS = ("title", "summary", "mood", "rating", "tags", "author")
# how often each kind is drawn (relative); tuned on SmolLM2-135M for a greedy base rate of about 0.3–0.6
KIND_WEIGHTS: dict[str, float] = {
    "words_max": 2.0,
    "words_min": 1.0,
    "sentences_max": 1.5,
    "keywords_include": 2.0,
    "keywords_exclude": 1.5,
    "bullets": 1.0,
    "json_keys": 0.5,
    "sections": 0.5,
    "lowercase": 1.0,
    "uppercase": 0.5,
    "end_phrase": 1.0,
    "no_commas": 1.0,
    "title": 1.0,
    "postscript": 1.0,
    "start_word": 1.5,
}
N_CONSTRAINTS_WEIGHTS = {1: 1.0, 2: 2.0, 3: 1.0}
HELDOUT_BUCKETS = 8  # 1 in 8 base requests is held out


def base_requests() -> list[str]:
    """Every base request (template × topic), in a fixed order."""
    return [t.format(topic=topic) for topic in TOPICS for t in TEMPLATES]


def is_heldout(base: str) -> bool:
    """Whether a base request belongs to the held-out split (a stable hash, not Python's `hash`)."""
    return int(hashlib.sha256(base.encode()).hexdigest(), 16) % HELDOUT_BUCKETS == 0


def _params(kind: str, topic: str, used: set[str], rng: random.Random) -> Constraint:
    """Draw the parameters of one constraint; `used` holds words already asked for or forbidden."""

    def fresh(pool: tuple[str, ...], k: int = 1) -> list[str]:
        words = rng.sample([w for w in pool if w.lower() not in used], k)
        used.update(w.lower() for w in words)
        return words

    match kind:
        case "words_max":
            return {"kind": kind, "n": rng.choice((30, 40, 50, 60))}
        case "words_min":
            return {"kind": kind, "n": rng.choice((20, 30, 40))}
        case "sentences_max":
            return {"kind": kind, "n": rng.choice((2, 3, 4))}
        case "keywords_include":
            words = fresh(TOPICS[topic]) if rng.random() < 0.6 else fresh(UNRELATED_WORDS)
            return {"kind": kind, "words": words}
        case "keywords_exclude":
            return {"kind": kind, "words": fresh(TOPICS[topic])}
        case "bullets":
            return {"kind": kind, "n": rng.choice((2, 3, 4))}
        case "json_keys":
            return {"kind": kind, "keys": sorted(fresh(JSON_KEYS, rng.choice((1, 2))))}
        case "sections":
            return {"kind": kind, "n": rng.choice((2, 3))}
        case "end_phrase":
            return {"kind": kind, "phrase": rng.choice(END_PHRASES)}
        case "postscript":
            return {"kind": kind, "marker": "P.S."}
        case "start_word":
            return {"kind": kind, "word": fresh(START_WORDS)[0]}
        case _:
            return {"kind": kind}


def _constraints(topic: str, rng: random.Random) -> list[Constraint]:
    """1–3 mutually compatible constraints for a request about `topic`."""
    n = rng.choices(list(N_CONSTRAINTS_WEIGHTS), weights=list(N_CONSTRAINTS_WEIGHTS.values()))[0]
    used: set[str] = set()
    chosen: list[str] = []
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    while len(chosen) < n:
        options = [
            (k, w) for k, w in zip(kinds, weights, strict=True) if all(compatible(k, c) for c in chosen)
        ]
        if not options:
            break
        chosen.append(rng.choices([k for k, _ in options], weights=[w for _, w in options])[0])
    # exclusions first, so that a word to include, start or end with is never also forbidden
    chosen.sort(key=lambda k: k != "keywords_exclude")
    constraints = [_params(k, topic, used, rng) for k in chosen]
    rng.shuffle(constraints)
    return constraints


def _items(seed: int, heldout: bool) -> Iterator[tuple[str, list[Constraint]]]:
    """An endless deterministic stream of distinct (prompt, constraints) of one split."""
    rng = random.Random(f"instruct-{seed}-{'heldout' if heldout else 'train'}")
    pairs = [
        (t, topic) for topic in TOPICS for t in TEMPLATES if is_heldout(t.format(topic=topic)) == heldout
    ]
    seen: set[str] = set()
    misses = 0
    while misses < 10_000:
        template, topic = rng.choice(pairs)
        constraints = _constraints(topic, rng)
        prompt = " ".join([template.format(topic=topic), *(describe(c) for c in constraints)])
        if prompt in seen:
            misses += 1
            continue
        seen.add(prompt)
        misses = 0
        yield prompt, constraints
    raise RuntimeError("the instruct generator ran out of distinct prompts; ask for fewer tasks")


def _take(seed: int, heldout: bool, n: int) -> list[tuple[str, list[Constraint]]]:
    stream = _items(seed, heldout)
    return [next(stream) for _ in range(n)]


def build_splits(n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """Train and held-out tasks; no held-out base request (hence no held-out prompt) appears in train."""
    train = [_task(p, c, f"train-{i}") for i, (p, c) in enumerate(_take(seed, False, n_train))]
    held = [_task(p, c, f"heldout-{i}") for i, (p, c) in enumerate(_take(seed, True, n_heldout))]
    return train, held


def _task(prompt: str, constraints: list[Constraint], task_id: str) -> Task:
    return Task(task_id=task_id, input={"prompt": prompt}, reference={"constraints": constraints})


def messages(prompt: str) -> list[dict[str, str]]:
    """The chat messages for a prompt: exactly what the harness sends (one user turn, no system turn)."""
    return [{"role": "user", "content": prompt}]


def score(constraints: list[Constraint], text: str) -> tuple[float, list[dict[str, Any]]]:
    """The fraction of constraints `text` meets, and one verdict per constraint."""
    verdicts = [
        {**c, "source": kind_of(c).source, "description": describe(c), "passed": check(text, c)}
        for c in constraints
    ]
    value = sum(v["passed"] for v in verdicts) / len(verdicts) if verdicts else 0.0
    return value, verdicts


def grade(task: Task, result: AttemptResult) -> RewardIn:
    """Reward = fraction of the task's constraints met by the text in the harness's `answer.json`."""
    constraints: list[Constraint] = task.reference["constraints"]
    answer_file = result.output_dir / "answer.json"
    if not answer_file.exists():
        return RewardIn(value=0.0, details={"reason": "no answer.json written", "constraints": constraints})
    try:
        text = json.loads(answer_file.read_text()).get("text")
    except (json.JSONDecodeError, AttributeError):
        return RewardIn(value=0.0, details={"reason": "answer.json is not a JSON object"})
    if not isinstance(text, str):
        return RewardIn(value=0.0, details={"reason": "answer.json has no text", "constraints": constraints})
    value, verdicts = score(constraints, text)
    passed = sum(v["passed"] for v in verdicts)
    return RewardIn(value=value, details={"constraints": verdicts, "passed": passed, "total": len(verdicts)})


# --- the same tasks for a TRL GRPOTrainer baseline ----------------------------------------------------


def trl_dataset(n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """The first `n` tasks of a split (`train` or `heldout`) as rows for TRL: `prompt` in chat format
    (the harness's messages), `constraints` (a column the reward function receives) and `task_id`."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    items = _take(seed, split == "heldout", n)
    return [
        {"prompt": messages(p), "constraints": c, "task_id": f"{split}-{i}"} for i, (p, c) in enumerate(items)
    ]


def reward_text(task_input: Mapping[str, Any], text: str) -> float:
    """The reward of a completion `text`: `task_input` is a `trl_dataset` row or a task's `reference`
    (anything with `constraints`). Equals the grader's value for the same text."""
    return score(list(task_input["constraints"]), text)[0]


def grpo_reward(completions: list[Any], constraints: list[list[Constraint]], **_: Any) -> list[float]:
    """A reward function with TRL GRPOTrainer's signature: completions as strings or as chat messages
    (`[{"role": "assistant", "content": ...}]`), `constraints` the dataset column of the same name."""
    texts = [c if isinstance(c, str) else str(c[-1]["content"]) for c in completions]
    return [score(cs, t)[0] for t, cs in zip(texts, constraints, strict=True)]
