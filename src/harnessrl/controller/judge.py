"""Judges: a model grades what a harness answered, for tasks without a checkable answer (`grader.judge`).

The judge is any OpenAI-compatible chat endpoint (an external API, a local engine, a frozen copy of the
run's own model). It reads the task, the rubric and the answer the harness wrote to its output folder
(`answer_file`), and answers in a fixed format that is parsed strictly:

- **single** mode: one judge call per rollout; the judge ends with `SCORE: <s>` for 0 ≤ s ≤ `scale`,
  and the reward is s / `scale`.
- **group** mode: one judge call per group; the group's answers are shown side by side, numbered
  1..n, and the judge ends with `RANKING: 3 > 1 > 2` (every candidate exactly once). The candidate at
  place ρ (0 = best) gets the reward (n − 1 − ρ) / (n − 1): 1 for the best, 0 for the worst, evenly
  spaced, so the group's rewards always differ (GRPO uses only their differences). A group of one is
  scored in single mode.
- **logprob** mode: one judge call per rollout for a one-digit rating 0..9 (`max_tokens: 1`,
  `top_logprobs: 20`); the reward is the expected digit under the judge's probabilities of the digits
  among its 20 most likely first tokens (renormalised over those digits), divided by 9. No format to
  follow: what a judge too small to write `SCORE:` lines (SmolLM2-135M on this CPU) can still give, a
  graded number rather than a sampled one. No digit among them is a `JudgeError`.

Every judge call is recorded in the reward's details under `judge` (mode, model, the prompt messages,
the judge's raw answer, the parsed score or ranking), so `harnessrl inspect` shows why a rollout got its
reward. A judge that cannot be reached, answers with an error, or answers nothing parsable (no score
line, a score out of range, a ranking that is not a permutation) raises `JudgeError`: a grader error,
never a silent 0 (the rollout fails as "grader"; `controller.grader_retries` asks again).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from harnessrl.controller.runner import AttemptResult
from harnessrl.schema import RewardIn, Task

log = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 4000  # of each answer shown to the judge (the rest is cut, and the cut is said)
SCORE_RE = re.compile(r"SCORE:\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
RANKING_RE = re.compile(r"RANKING:\s*\**\s*([\d\s>,]+)", re.IGNORECASE)


class JudgeError(RuntimeError):
    """The judge failed or answered nothing parsable (a grader error for the rollout or its group)."""


@dataclass(frozen=True)
class JudgeSpec:
    """Where the judge is and how it judges (the `grader.judge` config section, resolved)."""

    base_url: str  # OpenAI-compatible, ending in /v1
    model: str
    rubric: str
    mode: Literal["single", "group", "logprob"] = "single"
    api_key: str = "none"
    answer_file: str = "answer.txt"  # in the attempt's output folder (HARNESSRL_OUTPUT)
    scale: float = 10.0  # single mode: the top score the judge may give
    max_tokens: int = 256
    temperature: float = 0.0
    timeout_s: float = 120.0


def read_answer(result: AttemptResult, answer_file: str) -> str:
    """The answer the harness wrote (empty when it wrote none: the judge sees that and scores it)."""
    path = Path(result.output_dir) / answer_file
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return ""
    if len(text) > MAX_ANSWER_CHARS:
        text = text[:MAX_ANSWER_CHARS] + f"\n[... cut: {len(text)} characters in all]"
    return text


def _task_text(task: Task) -> str:
    return json.dumps(task.input, ensure_ascii=False, indent=1)


def single_prompt(spec: JudgeSpec, task: Task, answer: str) -> list[dict[str, str]]:
    """The messages of a single-mode judge call."""
    system = (f"You are a strict judge. Rubric:\n{spec.rubric}\n\nScore the answer from 0 (worst) to "
              f"{spec.scale:g} (best). End your reply with one line: SCORE: <number>")  # fmt: skip
    user = f"Task:\n{_task_text(task)}\n\nAnswer:\n{answer or '(no answer)'}"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def logprob_prompt(spec: JudgeSpec, task: Task, answer: str) -> list[dict[str, str]]:
    """The messages of a logprob-mode judge call: a rating as one digit, asked twice (system and last)."""
    ask = "Rate the answer from 0 (worst) to 9 (best). Reply with one digit only."
    system = f"You are a strict judge. Rubric:\n{spec.rubric}\n\n{ask}"
    user = f"Task:\n{_task_text(task)}\n\nAnswer:\n{answer or '(no answer)'}\n\n{ask}"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


DIGITS = frozenset("0123456789")


def digit_expectation(top: list[dict[str, Any]]) -> tuple[float, float, dict[str, float]]:
    """From the first answer token's `top_logprobs` (OpenAI chat shape): the expected digit under the
    judge's probabilities renormalised over the digits 0..9 among them, the digits' total probability,
    and each digit's probability. No digit among them is a `JudgeError`."""
    probs: dict[str, float] = {}
    for alt in top:
        token = str(alt.get("token", "")).strip()
        lp = alt.get("logprob")
        if token in DIGITS and isinstance(lp, int | float) and math.isfinite(lp):  # ASCII only ("٣" is no 3)
            probs[token] = probs.get(token, 0.0) + math.exp(lp)
    mass = sum(probs.values())
    if mass <= 0.0:
        shown = [alt.get("token") for alt in top[:10]]
        raise JudgeError(f"no digit 0-9 among the judge's {len(top)} most likely first tokens: {shown!r}")
    return sum(int(d) * p for d, p in probs.items()) / mass, mass, probs


def group_prompt(spec: JudgeSpec, task: Task, answers: list[str]) -> list[dict[str, str]]:
    """The messages of a group-mode judge call: the answers side by side, numbered from 1."""
    n = len(answers)
    system = (f"You are a strict judge. Rubric:\n{spec.rubric}\n\nRank the {n} candidate answers from "
              f"best to worst. End your reply with one line naming every candidate exactly once, e.g. "
              f"RANKING: {' > '.join(str(i) for i in range(n, 0, -1))}")  # fmt: skip
    shown = "\n\n".join(f"[{i}]\n{a or '(no answer)'}" for i, a in enumerate(answers, start=1))
    user = f"Task:\n{_task_text(task)}\n\nCandidate answers:\n\n{shown}"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def parse_score(text: str, scale: float) -> float:
    """The last `SCORE: s` of the judge's answer, checked to lie in [0, scale]."""
    found = SCORE_RE.findall(text)
    if not found:
        raise JudgeError(f"the judge's answer has no 'SCORE: <number>' line: {text[-300:]!r}")
    score = float(found[-1])
    if not (math.isfinite(score) and 0.0 <= score <= scale):
        raise JudgeError(f"the judge's score {score:g} is outside 0..{scale:g}: {text[-300:]!r}")
    return score


def parse_ranking(text: str, n: int) -> list[int]:
    """The last `RANKING: a > b > ...` of the judge's answer as 0-based candidates, best first; it must
    name each of the n candidates exactly once."""
    found = RANKING_RE.findall(text)
    if not found:
        raise JudgeError(f"the judge's answer has no 'RANKING: a > b > ...' line: {text[-300:]!r}")
    order = [int(x) - 1 for x in re.findall(r"\d+", found[-1])]
    if sorted(order) != list(range(n)):
        raise JudgeError(
            f"the judge's ranking {found[-1].strip()!r} does not name each of the {n} candidates "
            f"(1..{n}) exactly once"
        )
    return order


def rank_rewards(order: list[int]) -> list[float]:
    """Per candidate (by index): (n − 1 − place) / (n − 1), place 0 being the best; 1.0 for n = 1."""
    n = len(order)
    out = [0.0] * n
    for place, candidate in enumerate(order):
        out[candidate] = 1.0 if n == 1 else (n - 1 - place) / (n - 1)
    return out


class Judge:
    """A grader backed by a judge model; `grades_groups` tells the controller to hand it whole groups."""

    def __init__(self, spec: JudgeSpec) -> None:
        self.spec = spec
        self.grades_groups = spec.mode == "group"

    def ask(self, messages: list[dict[str, str]]) -> str:
        """One chat call to the judge; its text. Transport errors and non-200 answers are `JudgeError`."""
        content = self._choice(messages)["message"]["content"]
        if not isinstance(content, str) or not content.strip():
            raise JudgeError("the judge answered nothing")
        return content

    def _choice(self, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
        s = self.spec
        body = {
            "model": s.model,
            "messages": messages,
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            **extra,
        }
        try:
            r = httpx.post(f"{s.base_url.rstrip('/')}/chat/completions", json=body, timeout=s.timeout_s,
                           headers={"Authorization": f"Bearer {s.api_key}"})  # fmt: skip
        except httpx.HTTPError as e:
            raise JudgeError(f"the judge at {s.base_url} cannot be reached: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise JudgeError(f"the judge at {s.base_url} answered {r.status_code}: {r.text[:300]}")
        try:
            choice = r.json()["choices"][0]
            if not isinstance(choice, dict) or "content" not in choice["message"]:
                raise KeyError("message.content")
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise JudgeError(f"the judge's response is not a chat completion: {r.text[:300]}") from e
        return choice

    def _record(self, messages: list[dict[str, str]], answer: str, **parsed: Any) -> dict[str, Any]:
        return {
            "mode": self.spec.mode,
            "model": self.spec.model,
            "prompt": messages,
            "answer": answer,
            **parsed,
        }

    def __call__(self, task: Task, result: AttemptResult) -> RewardIn:
        """Single mode: score one rollout's answer alone (logprob mode: from the rating's probabilities)."""
        if self.spec.mode == "logprob":
            return self._logprob_score(task, result)
        messages = single_prompt(self.spec, task, read_answer(result, self.spec.answer_file))
        answer = self.ask(messages)
        try:
            score = parse_score(answer, self.spec.scale)
        except JudgeError as e:
            log.warning("event=judge_unparsable task=%s error=%s", task.task_id, e)
            raise
        judge = self._record(messages, answer, score=score, mode="single")
        return RewardIn(value=score / self.spec.scale, details={"judge": judge})

    def _logprob_score(self, task: Task, result: AttemptResult) -> RewardIn:
        messages = logprob_prompt(self.spec, task, read_answer(result, self.spec.answer_file))
        choice = self._choice(messages, max_tokens=1, logprobs=True, top_logprobs=20)
        try:
            top = choice["logprobs"]["content"][0]["top_logprobs"]
            if not isinstance(top, list):
                raise TypeError(type(top).__name__)
        except (KeyError, IndexError, TypeError) as e:
            raise JudgeError(
                f"the judge's answer carries no top_logprobs (logprob mode needs an endpoint that returns "
                f"them): {str(choice)[:300]}"
            ) from e
        expected, mass, probs = digit_expectation(top)
        judge = self._record(messages, str(choice["message"]["content"]), score=round(expected, 4),
                             digit_mass=round(mass, 4), digits={d: round(p, 4) for d, p in sorted(probs.items())})  # fmt: skip
        return RewardIn(value=expected / 9.0, details={"judge": judge})

    def grade_group(self, task: Task, results: list[AttemptResult]) -> list[RewardIn]:
        """Group mode: rank the group's answers in one judge call; rewards from the ranking."""
        if len(results) == 1:
            return [self(task, results[0])]
        answers = [read_answer(r, self.spec.answer_file) for r in results]
        messages = group_prompt(self.spec, task, answers)
        answer = self.ask(messages)
        order = parse_ranking(answer, len(results))
        rewards = rank_rewards(order)
        ranking = [i + 1 for i in order]
        return [
            RewardIn(value=v, details={"judge": self._record(messages, answer, ranking=ranking,
                                                              candidate=i + 1, place=order.index(i) + 1)})
            for i, v in enumerate(rewards)
        ]  # fmt: skip


def judge_from_config(section: Any, timeout_s: float) -> Judge:
    """A `Judge` from the `grader.judge` config section (the key is read from `api_key_env`)."""
    rubric = section.rubric
    if section.rubric_file:
        rubric = Path(section.rubric_file).read_text().strip()
    key = os.environ.get(section.api_key_env, "none") if section.api_key_env else "none"
    return Judge(JudgeSpec(base_url=section.base_url, model=section.model, rubric=rubric, mode=section.mode,
                           api_key=key, answer_file=section.answer_file, scale=section.scale,
                           max_tokens=section.max_tokens, temperature=section.temperature,
                           timeout_s=timeout_s))  # fmt: skip
