"""What a project declares (`harness`, `tasks`, `grader`, and a judge for tasks without a checkable
answer), and the base every config section shares: unknown keys are errors."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from harnessrl.schema import GuardPolicy


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HarnessSection(_Section):
    """The harness: any program that follows the harness contract (docs/your-harness.md)."""

    # argv of one attempt; an argument naming a file next to the config is made absolute, and
    # `python`/`python3` as the program means the interpreter harnessrl runs in
    command: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)  # extra variables (never the admin key)
    files: list[str] = Field(default_factory=list)  # files/folders copied into each attempt's home/ (its cwd)

    @field_validator("command")
    @classmethod
    def _nonempty(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or not all(isinstance(a, str) and a for a in v)):
            raise ValueError("must be a non-empty list of arguments, e.g. [python, harness.py]")
        return v

    @field_validator("env")
    @classmethod
    def _no_reserved(cls, v: dict[str, str]) -> dict[str, str]:
        bad = sorted(k for k in v if k in RESERVED_ENV or k.startswith("HARNESSRL_"))
        if bad:
            raise ValueError(f"{', '.join(bad)}: set by the controller (the harness contract), not by config")
        return v


RESERVED_ENV = frozenset(
    {"OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"}
)


class TasksSection(_Section):
    """Where tasks come from: task files, or a Python generator."""

    train: str | None = None  # JSONL (or Parquet) of {"task_id", "input", "reference", ...}
    heldout: str | None = None  # the same format; held-out tasks also found in train are dropped
    heldout_fraction: float | None = Field(default=None, gt=0, lt=1)  # or: a seeded, disjoint split of train
    # or: `module:function` called with (n_train, n_heldout, seed), returning (train, heldout) task lists
    generator: str | None = None
    # What every task's harness may touch, merged with a task's own `guard` (docs/security.md, Guards):
    # {hidden: [glob under the attempt's home/ or host path], read_only: [glob], egress: [host:port],
    # no_git: bool, on_violation: zero | drop | flag}; the sandbox enforces all of it, the plain runners
    # check read_only (a change is undone before grading and costs the reward: on_violation, default
    # zero) and refuse the rest
    guard: GuardPolicy | None = None

    @model_validator(mode="after")
    def _one_source(self) -> TasksSection:
        if self.generator is not None and (self.train or self.heldout or self.heldout_fraction):
            raise ValueError("give either tasks.generator or task files (tasks.train ...), not both")
        if self.heldout is not None and self.heldout_fraction is not None:
            raise ValueError("give tasks.heldout or tasks.heldout_fraction, not both")
        if (self.heldout or self.heldout_fraction) and not self.train:
            raise ValueError("tasks.heldout / tasks.heldout_fraction need tasks.train")
        if self.generator is not None:
            _check_target(self.generator, "tasks.generator")
        return self


class JudgeSection(_Section):
    """A model grades the answers (controller/judge.py, docs/credit.md): an OpenAI-compatible endpoint."""

    base_url: str  # the judge's OpenAI-compatible URL, ending in /v1 (an external API or a local engine)
    model: str = "judge"  # the model name sent to it
    api_key_env: str | None = None  # the environment variable holding its API key (None: no key)
    rubric: str = ""  # what a good answer is, in words the judge reads
    rubric_file: str | None = None  # or: a text file with the rubric (relative to the config's folder)
    # single: score each rollout alone (SCORE: 0..scale); group: rank a whole group in one call;
    # logprob: each rollout alone, the expected digit 0..9 under the judge's top_logprobs (small judges)
    mode: Literal["single", "group", "logprob"] = "single"
    answer_file: str = "answer.txt"  # the answer, in the attempt's output folder (HARNESSRL_OUTPUT)
    scale: float = Field(default=10.0, gt=0)  # single mode: the judge's top score (reward = score / scale)
    max_tokens: int = Field(default=256, ge=1)  # of the judge's answer
    temperature: float = Field(default=0.0, ge=0)  # of the judge's sampling
    debias: Literal["none", "swap"] = "none"  # group mode: a second judgment in reverse order, averaged
    # the judge's chat template variables, sent as `chat_template_kwargs` (e.g. {enable_thinking: false})
    template_kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _has_rubric(self) -> JudgeSection:
        if not (self.rubric.strip() or self.rubric_file):
            raise ValueError("grader.judge needs a rubric (or rubric_file): what a good answer is")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"grader.judge.base_url: {self.base_url!r} is not an http(s):// URL")
        return self


class GraderSection(_Section):
    """The grader, run by the controller outside the harness: a Python function, a command or a judge."""

    # `module:function` called with (task, result); returns a float, (float, details) or RewardIn.
    # A module next to the config (grader.py → `grader:grade`) is found without installing it.
    python: str | None = None
    # or: argv of a command that gets the task and the attempt's output and prints the reward
    command: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)  # extra variables for a grader command
    judge: JudgeSection | None = None  # or: a judge model scores (or ranks) the answers

    @model_validator(mode="after")
    def _one_kind(self) -> GraderSection:
        if sum(x is not None for x in (self.python, self.command, self.judge)) > 1:
            raise ValueError("give one of grader.python, grader.command or grader.judge")
        if self.python is not None:
            _check_target(self.python, "grader.python")
        if self.command is not None and not self.command:
            raise ValueError("grader.command must be a non-empty list of arguments")
        return self


def _check_target(target: str, name: str) -> None:
    if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", target):
        raise ValueError(f"{name} must look like module:function (e.g. grader:grade), not {target!r}")
