"""Judges: a model grades what a harness answered, for tasks without a checkable answer (`grader.judge`).

The judge is any OpenAI-compatible chat endpoint (an external API, a local engine, a frozen copy of the
run's own model). It reads the task, the rubric and the answer the harness wrote to its output folder
(`answer_file`), fenced as data it is told not to obey (`judge_prompts`), and answers in a fixed format
that is parsed strictly:

- **single** mode: one judge call per rollout; the judge ends with `SCORE: <s>` for 0 ≤ s ≤ `scale`,
  and the reward is s / `scale`.
- **group** mode: one judge call per group; the group's distinct answers are shown side by side in a
  shuffled order (drawn per judgment, recorded, undone), and the judge ends with `RANKING: 3 > 1 = 2`
  (every candidate once; `=` a tie). Rewards by place, ties sharing theirs (`judge_ranking`): 1 for the
  best, 0 for the worst. Identical answers are shown once, so they always get equal rewards. With
  `debias: swap` a second call shows the reverse order and the rewards are averaged; the two calls'
  `agreement` is recorded. A group of one is scored in single mode.
- **logprob** mode: one judge call per rollout for a one-digit rating 0..9 (`max_tokens: 1`,
  `top_logprobs: 20`); the reward is the expected digit under the judge's probabilities of the digits
  among its 20 most likely answer tokens (renormalised over those digits), divided by 9. A judge that
  thinks first (its answer opens with `<think>`) is asked again with `max_tokens` to think in, and the
  digit is read at the first token after its thinking block closes; `template_kwargs` (sent as
  `chat_template_kwargs`, e.g. `{enable_thinking: false}`) can turn the thinking off instead. No
  format to follow: what a judge too small to write `SCORE:` lines can still give, a graded number.

Every judge call is recorded in the reward's details under `judge` (mode, model, the prompt messages,
the judge's raw answer, the parsed score or ranking), so `harnessrl inspect` shows why a rollout got its
reward; an answer that tries to talk to the judge is flagged under `details["hacking"]["judge_injection"]`.
A judge that cannot be reached, answers with an error, or answers nothing parsable (no score line, a
score out of range, a ranking that is not a permutation, no digit) raises `JudgeError`: a grader error,
never a silent 0 (the rollout fails as "grader"; `controller.grader_retries` asks again).
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from harnessrl.controller.judge_prompts import (
    Messages,
    group_prompt,
    injection_flags,
    logprob_prompt,
    new_tag,
    single_prompt,
)
from harnessrl.controller.judge_ranking import agreement, parse_ranking, shuffled, tier_rewards, unshuffle
from harnessrl.controller.runner import AttemptResult
from harnessrl.schema import RewardIn, Task

log = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 4000  # of each answer shown to the judge (the rest is cut, and the cut is said)
SCORE_RE = re.compile(r"SCORE:\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


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
    max_tokens: int = 256  # of an answer (logprob mode: of a thinking judge's thinking and digit)
    temperature: float = 0.0
    timeout_s: float = 120.0
    debias: Literal["none", "swap"] = "none"  # group mode: a second judgment in the reverse order
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # sent as `chat_template_kwargs`
    seed: int | None = None  # of the group shuffles (None: drawn from the OS, unpredictable)


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


DIGITS = frozenset("0123456789")


def digit_expectation(top: list[dict[str, Any]]) -> tuple[float, float, dict[str, float]]:
    """From an answer token's `top_logprobs` (OpenAI chat shape): the expected digit under the judge's
    probabilities renormalised over the digits 0..9 among them, the digits' total probability, and
    each digit's probability. No digit among them is a `JudgeError`."""
    probs: dict[str, float] = {}
    for alt in top:
        token = str(alt.get("token", "")).strip()
        lp = alt.get("logprob")
        if token in DIGITS and isinstance(lp, int | float) and math.isfinite(lp):  # ASCII only ("٣" is no 3)
            probs[token] = probs.get(token, 0.0) + math.exp(lp)
    mass = sum(probs.values())
    if mass <= 0.0:
        shown = [alt.get("token") for alt in top[:10]]
        raise JudgeError(f"no digit 0-9 among the judge's {len(top)} most likely answer tokens: {shown!r}")
    expected = sum(int(d) * p for d, p in probs.items()) / mass
    return min(9.0, max(0.0, expected)), mass, probs  # (rounding can land a hair outside 0..9)


def thinks(tokens: list[dict[str, Any]]) -> bool:
    """Whether the judge's answer opens with a thinking block (its first non-blank token is `<think>`)."""
    text = "".join(str(t.get("token", "")) for t in tokens).lstrip()
    return text.startswith(THINK_OPEN) or (bool(text) and THINK_OPEN.startswith(text))


def answer_token(tokens: list[dict[str, Any]], max_tokens: int) -> tuple[int, dict[str, Any]]:
    """The token the rating is read at: the first one, or, when the answer opens with a thinking block,
    the first non-blank one after the block closes. Its index and entry; a `JudgeError` that says
    which when there is none."""
    if not thinks(tokens):
        return 0, tokens[0]
    text, start = "", -1
    for k, t in enumerate(tokens):
        text += str(t.get("token", ""))
        if THINK_CLOSE in text:
            start = k + 1
            break
    if start < 0:
        raise JudgeError(
            f"the judge thinks (its answer opens with {THINK_OPEN}) and its thinking did not close within "
            f"max_tokens={max_tokens}: raise grader.judge.max_tokens, or turn its thinking off "
            "(grader.judge.template_kwargs: {enable_thinking: false})"
        )
    for k in range(start, len(tokens)):
        if str(tokens[k].get("token", "")).strip():
            return k, tokens[k]
    raise JudgeError(
        f"the judge wrote no rating after its thinking block closed (token {start}): {text[-300:]!r}"
    )


def parse_score(text: str, scale: float) -> float:
    """The last `SCORE: s` of the judge's answer, checked to lie in [0, scale]."""
    found = SCORE_RE.findall(text)
    if not found:
        raise JudgeError(f"the judge's answer has no 'SCORE: <number>' line: {text[-300:]!r}")
    score = float(found[-1])
    if not (math.isfinite(score) and 0.0 <= score <= scale):
        raise JudgeError(f"the judge's score {score:g} is outside 0..{scale:g}: {text[-300:]!r}")
    return score


def flagged(reward: RewardIn, answer: str) -> RewardIn:
    """The reward with the answer's injection flags under `details["hacking"]["judge_injection"]`."""
    flags = injection_flags(answer)
    if not flags:
        return reward
    log.warning("event=judge_injection flags=%s", ",".join(flags))
    details = dict(reward.details)
    own = details.get("hacking")
    details["hacking"] = {**(own if isinstance(own, dict) else {}), "judge_injection": flags}
    return reward.model_copy(update={"details": details})


class Judge:
    """A grader backed by a judge model; `grades_groups` tells the controller to hand it whole groups."""

    def __init__(self, spec: JudgeSpec) -> None:
        self.spec = spec
        self.grades_groups = spec.mode == "group"
        self.rng = random.Random(spec.seed) if spec.seed is not None else random.SystemRandom()
        self.http = httpx.Client(timeout=spec.timeout_s, headers={"Authorization": f"Bearer {spec.api_key}"})

    def ask(self, messages: Messages) -> str:
        """One chat call to the judge; its text. Transport errors and non-200 answers are `JudgeError`."""
        content = self._choice(messages)["message"]["content"]
        if not isinstance(content, str) or not content.strip():
            raise JudgeError("the judge answered nothing")
        return content

    def _choice(self, messages: Messages, **extra: Any) -> dict[str, Any]:
        s = self.spec
        body = {"model": s.model, "messages": messages, "max_tokens": s.max_tokens, "temperature": s.temperature,
                **({"chat_template_kwargs": s.template_kwargs} if s.template_kwargs else {}), **extra}  # fmt: skip
        try:
            r = self.http.post(f"{s.base_url.rstrip('/')}/chat/completions", json=body)
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

    def _record(self, messages: Messages, answer: str, **parsed: Any) -> dict[str, Any]:
        return {
            "mode": self.spec.mode,
            "model": self.spec.model,
            "prompt": messages,
            "answer": answer,
            **parsed,
        }

    def __call__(self, task: Task, result: AttemptResult) -> RewardIn:
        """Single mode: score one rollout's answer alone (logprob mode: from the rating's probabilities)."""
        text = read_answer(result, self.spec.answer_file)
        if self.spec.mode == "logprob":
            return flagged(self._logprob_score(task, text), text)
        messages = single_prompt(self.spec, task, text, new_tag([text]))
        answer = self.ask(messages)
        try:
            score = parse_score(answer, self.spec.scale)
        except JudgeError as e:
            log.warning("event=judge_unparsable task=%s error=%s", task.task_id, e)
            raise
        judge = self._record(messages, answer, score=score, mode="single")
        return flagged(RewardIn(value=score / self.spec.scale, details={"judge": judge}), text)

    def _logprob_tokens(
        self, messages: Messages, max_tokens: int
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        choice = self._choice(messages, max_tokens=max_tokens, logprobs=True, top_logprobs=20)
        try:
            tokens = choice["logprobs"]["content"]
            if not isinstance(tokens, list) or not tokens or not all(isinstance(t, dict) for t in tokens):
                raise TypeError("logprobs.content")
        except (KeyError, TypeError) as e:
            raise JudgeError(
                f"the judge's answer carries no logprobs (logprob mode needs an endpoint that returns "
                f"them): {str(choice)[:300]}"
            ) from e
        return choice, tokens

    def _logprob_score(self, task: Task, text: str) -> RewardIn:
        messages = logprob_prompt(self.spec, task, text, new_tag([text]))
        choice, tokens = self._logprob_tokens(messages, 1)
        thought = thinks(tokens)
        if thought:  # a thinking judge: let it think, then read the digit after its thinking block
            choice, tokens = self._logprob_tokens(messages, self.spec.max_tokens)
        at, entry = answer_token(tokens, self.spec.max_tokens)
        top = entry.get("top_logprobs")
        if not isinstance(top, list):
            raise JudgeError(f"the judge's answer token {at} carries no top_logprobs: {str(entry)[:300]}")
        expected, mass, probs = digit_expectation(top)
        judge = self._record(messages, str(choice["message"]["content"]), score=round(expected, 4),
                             digit_mass=round(mass, 4), digits={d: round(p, 4) for d, p in sorted(probs.items())},
                             thinking=thought, rating_token=at)  # fmt: skip
        return RewardIn(value=expected / 9.0, details={"judge": judge})

    def grade_group(self, task: Task, results: list[AttemptResult]) -> list[RewardIn]:
        """Group mode: rank the group's distinct answers, shuffled, in one judge call (two with `debias:
        swap`); each rollout gets the reward of its answer."""
        if len(results) == 1:
            return [self(task, results[0])]
        texts = [read_answer(r, self.spec.answer_file) for r in results]
        distinct = list(dict.fromkeys(texts))  # identical answers: one candidate, one reward
        of = [distinct.index(t) for t in texts]
        if len(distinct) == 1:
            note = {"mode": "group", "model": self.spec.model, "identical_answers": len(texts)}
            return [flagged(RewardIn(value=0.5, details={"judge": note}), t) for t in texts]
        first = shuffled(len(distinct), self.rng)
        judgments = [self._judge_order(task, distinct, first)]
        if self.spec.debias == "swap":
            judgments.append(self._judge_order(task, distinct, first[::-1]))
        values = [sum(j["rewards"][c] for j in judgments) / len(judgments) for c in range(len(distinct))]
        agreed = agreement(judgments[0]["rewards"], judgments[-1]["rewards"]) if len(judgments) > 1 else None
        levels = sorted(set(values), reverse=True)  # the final ranking: tiers of equal reward, best first
        ranking = " > ".join(
            " = ".join(str(c + 1) for c in range(len(distinct)) if values[c] == v) for v in levels
        )
        out = []
        for i, text in enumerate(texts):
            members = [k + 1 for k, c in enumerate(of) if c == of[i]]  # the rollouts with this answer
            record = {"mode": "group", "model": self.spec.model, "candidate": of[i] + 1, "rollouts": members,
                      "ranking": ranking, "place": levels.index(values[of[i]]) + 1, "judgments": judgments,
                      **({"agreement": agreed} if agreed is not None else {})}  # fmt: skip
            out.append(flagged(RewardIn(value=values[of[i]], details={"judge": record}), text))
        return out

    def _judge_order(self, task: Task, distinct: list[str], shown: list[int]) -> dict[str, Any]:
        """One judgment of the candidates `distinct` shown in the order `shown`: the ranking undone to
        candidates, and the rewards by candidate."""
        messages = group_prompt(self.spec, task, [distinct[c] for c in shown], new_tag(distinct))
        answer = self.ask(messages)
        try:
            tiers = unshuffle(parse_ranking(answer, len(distinct)), shown)
        except ValueError as e:
            raise JudgeError(str(e)) from None
        ranking = " > ".join(" = ".join(str(c + 1) for c in tier) for tier in tiers)
        return {"prompt": messages, "answer": answer, "shown": [c + 1 for c in shown], "ranking": ranking,
                "rewards": tier_rewards(tiers)}  # fmt: skip


def judge_from_config(section: Any, timeout_s: float) -> Judge:
    """A `Judge` from the `grader.judge` config section (the key is read from `api_key_env`)."""
    rubric = section.rubric
    if section.rubric_file:
        rubric = Path(section.rubric_file).read_text().strip()
    key = os.environ.get(section.api_key_env, "none") if section.api_key_env else "none"
    return Judge(JudgeSpec(base_url=section.base_url, model=section.model, rubric=rubric, mode=section.mode,
                           api_key=key, answer_file=section.answer_file, scale=section.scale,
                           max_tokens=section.max_tokens, temperature=section.temperature,
                           timeout_s=timeout_s, debias=section.debias,
                           template_kwargs=dict(section.template_kwargs)))  # fmt: skip
