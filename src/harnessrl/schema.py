"""Wire and storage models: task, rollout (with its state machine), attempt, call, reward.

Every shape that crosses a box boundary (HTTP, the store, the trace files) is a pydantic model here.
The names follow the vocabulary of ARCHITECTURE.md.
"""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TRACE_SCHEMA_VERSION: Final = 1
"""Version of the stored/exported trace schema; bump on any incompatible change."""


def now() -> float:
    """Wall-clock timestamp in seconds, the one clock every record uses."""
    return time.time()


class RolloutState(StrEnum):
    """Lifecycle of a rollout; legal moves are listed in `ROLLOUT_TRANSITIONS`."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        """True for the three terminal states."""
        return self in FINISHED_STATES


FINISHED_STATES = frozenset({RolloutState.SUCCEEDED, RolloutState.FAILED, RolloutState.CANCELLED})

ROLLOUT_TRANSITIONS: dict[RolloutState, frozenset[RolloutState]] = {
    RolloutState.QUEUED: frozenset({RolloutState.RUNNING, RolloutState.CANCELLED, RolloutState.FAILED}),
    # running -> queued: an attempt died for infrastructure reasons and the rollout waits for a retry.
    RolloutState.RUNNING: frozenset(
        {RolloutState.QUEUED, RolloutState.SUCCEEDED, RolloutState.FAILED, RolloutState.CANCELLED}
    ),
    RolloutState.SUCCEEDED: frozenset(),
    RolloutState.FAILED: frozenset(),
    RolloutState.CANCELLED: frozenset(),
}


class InvalidTransition(ValueError):
    """A state change that the transition table does not allow."""


def check_transition(current: RolloutState, target: RolloutState) -> None:
    """Raise `InvalidTransition` unless `current -> target` is in `ROLLOUT_TRANSITIONS`."""
    if target not in ROLLOUT_TRANSITIONS[current]:
        allowed = ", ".join(sorted(ROLLOUT_TRANSITIONS[current])) or "none (terminal state)"
        raise InvalidTransition(f"rollout cannot move from {current} to {target}; allowed: {allowed}")


class AttemptStatus(StrEnum):
    """Outcome of one attempt. `infra_error` is the only retryable one."""

    RUNNING = "running"
    EXITED = "exited"  # the harness exited on its own (any exit code: the result is graded)
    TIMEOUT = "timeout"  # the harness ran past its time limit; graded like any result
    INFRA_ERROR = "infra_error"  # the machinery failed (could not start, runner lost): retryable
    CANCELLED = "cancelled"


class CallStatus(StrEnum):
    """Whether a call produced a response for the harness."""

    OK = "ok"
    FAILED = "failed"
    CANCELLED = "cancelled"  # the client went away mid-answer: what was generated is kept, not trained on


class Strict(BaseModel):
    """Base for request bodies: unknown fields are an error, not silently dropped."""

    model_config = ConfigDict(extra="forbid")


class GuardPolicy(Strict):
    """What a harness may touch (docs/security.md, "Guards"): paths hidden from it, paths it may read but
    not change, and the host:port addresses it may reach besides the gateway. Relative paths are glob
    patterns under the attempt's `home/` (its working directory, where `harness.files` and the task's
    `workspace` are put before it starts); a hidden path may also be an absolute host path."""

    hidden: list[str] = Field(default_factory=list, max_length=256)  # e.g. ["**/.git"]
    read_only: list[str] = Field(default_factory=list, max_length=256)  # e.g. ["repo/tests", "repo/*.ini"]
    egress: list[str] = Field(default_factory=list, max_length=64)  # e.g. ["pypi.org:443"]
    no_git: bool = False  # the `git` program made unrunnable (the old `controller.sandbox_disable_git`)
    # what a read-only violation found after the attempt costs: reward 0, out of the batch, or a flag only
    on_violation: Literal["zero", "drop", "flag"] = "zero"

    @model_validator(mode="after")
    def _check(self) -> GuardPolicy:
        for name, patterns in (("hidden", self.hidden), ("read_only", self.read_only)):
            for p in patterns:
                if not p or "\x00" in p or ".." in p.split("/"):
                    raise ValueError(f"guard.{name}: {p!r} must be a path without '..'")
                if name == "read_only" and p.startswith("/"):
                    raise ValueError(f"guard.read_only: {p!r} must be relative to the attempt's home/")
        for e in self.egress:
            host, sep, port = e.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
                raise ValueError(f"guard.egress: {e!r} must be host:port (e.g. pypi.org:443)")
        return self

    @property
    def empty(self) -> bool:
        """Whether the policy asks for nothing."""
        return not (self.hidden or self.read_only or self.egress or self.no_git)

    def merged(self, other: GuardPolicy | None) -> GuardPolicy:
        """Both policies together: every hidden, read-only and egress entry of either (in order, once);
        `other`'s `on_violation` where it sets one."""
        if other is None:
            return self
        return GuardPolicy(
            hidden=list(dict.fromkeys([*self.hidden, *other.hidden])),
            read_only=list(dict.fromkeys([*self.read_only, *other.read_only])),
            egress=list(dict.fromkeys([*self.egress, *other.egress])),
            no_git=self.no_git or other.no_git,
            on_violation=other.on_violation
            if "on_violation" in other.model_fields_set
            else self.on_violation,
        )


class Task(BaseModel):
    """One dataset item: `input` goes to the harness, `reference` only to the grader."""

    task_id: str
    input: dict[str, Any]
    reference: dict[str, Any] = Field(default_factory=dict)
    # The harness may write its own reward (PUT /v1/harnessrl/reward with its key); off by default:
    # then only the grader, outside the harness, can.
    allow_self_reward: bool = False
    # The harness's call annotations with a `value` count as step rewards (train.credit: step); off by
    # default: then an annotation is data for inspect and export, never a reward.
    allow_annotation_rewards: bool = False
    # What the harness may touch (merged with the config's `tasks.guard`); None: no guard of its own.
    guard: GuardPolicy | None = None
    # Files ({path under the attempt's home/: text}) written before the harness starts, e.g. the
    # repository to work on, so a guard can hide or protect them (docs/security.md).
    workspace: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _workspace_stays_home(self) -> Task:
        for rel in self.workspace:
            if not rel or rel.startswith("/") or "\x00" in rel or ".." in rel.split("/"):
                raise ValueError(f"workspace: {rel!r} must be a relative path without '..'")
        return self


class SamplingOverrides(Strict):
    """Sampling parameters the gateway imposes on every call of a rollout (None: keep the harness's)."""

    temperature: float | None = Field(default=None, ge=0.0, le=10.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: list[str] | None = Field(default=None, max_length=16)  # added to the harness's own stop strings


class RolloutCreate(Strict):
    """Control API: create a rollout. Idempotent by `client_id`."""

    client_id: str = Field(min_length=1, max_length=200)
    task_id: str = Field(min_length=1, max_length=200)
    input: dict[str, Any] = Field(default_factory=dict)
    group_id: str | None = Field(default=None, max_length=200)
    metadata: dict[str, Any] = Field(default_factory=dict)
    sampling: SamplingOverrides = Field(default_factory=SamplingOverrides)


class Rollout(BaseModel):
    """One complete try of a task by the harness."""

    rollout_id: str
    client_id: str
    task_id: str
    group_id: str | None = None
    state: RolloutState = RolloutState.QUEUED
    input: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    sampling: SamplingOverrides = Field(default_factory=SamplingOverrides)
    created_at: float
    updated_at: float
    n_attempts: int = 0


class RolloutCreated(BaseModel):
    """Answer to a create: the rollout, its scoped API key, and whether it was new."""

    rollout: Rollout
    api_key: str
    created: bool


class Attempt(BaseModel):
    """One run of the harness for a rollout."""

    rollout_id: str
    attempt: int
    status: AttemptStatus = AttemptStatus.RUNNING
    started_at: float
    ended_at: float | None = None
    exit_code: int | None = None
    error: str | None = None


class AttemptFinish(Strict):
    """Control API: how an attempt ended."""

    status: AttemptStatus
    exit_code: int | None = Field(default=None, ge=-(2**31), lt=2**31)
    error: str | None = Field(default=None, max_length=20_000)


class StateChange(Strict):
    """Control API: move a rollout to another state."""

    state: RolloutState


class Call(BaseModel):
    """One model request/response through the gateway, with the exact tokens the engine used."""

    call_id: str
    rollout_id: str
    attempt: int
    index: int = -1  # order of the call within its rollout; assigned by the store
    created_at: float
    latency_s: float
    status: CallStatus
    model: str
    upstream: str
    request: dict[str, Any]
    response: dict[str, Any] | None = None
    prompt_ids: list[int] = Field(default_factory=list)
    completion_ids: list[int] = Field(default_factory=list)
    completion_logprobs: list[float] = Field(default_factory=list)
    weight_version: int | None = None
    finish_reason: str | None = None
    temperature: float = 1.0  # the temperature the logprobs were computed at
    # with several policies (`policies:`): the policy whose LoRA adapter served the call, and which it
    # trains (its `weight_version` is that adapter's version); None: the run's one policy
    policy: str | None = None
    face: str = "openai.chat"  # the API the harness used: openai.chat | openai.completions | openai.responses | anthropic.messages
    # The conversation in one canonical form (OpenAI chat messages and tools) whatever the face:
    # {"messages": [...], "tools": [...] | None, "answer": {assistant message} | None}
    chat: dict[str, Any] | None = None
    error: str | None = None

    def conversation(self) -> tuple[list[dict[str, Any]], Any, dict[str, Any] | None]:
        """(messages, tools, answer) of the call in canonical chat form; empty when it had none."""
        if self.chat is not None:
            return list(self.chat.get("messages") or []), self.chat.get("tools"), self.chat.get("answer")
        messages = self.request.get("messages")
        answer = None
        try:
            answer = (self.response or {})["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            pass
        msgs = messages if isinstance(messages, list) else []
        return msgs, self.request.get("tools"), answer if isinstance(answer, dict) else None


class StepReward(Strict):
    """A reward for one call of a rollout, named by its position (`call`: 0 for the graded attempt's
    first model call) or by a tool call its answer made (`tool_call_id`); exactly one of the two."""

    call: int | None = Field(default=None, ge=0)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=200)
    value: float = Field(allow_inf_nan=False)
    details: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_target(self) -> StepReward:
        if (self.call is None) == (self.tool_call_id is None):
            raise ValueError("a step reward names its call by `call` (index) or `tool_call_id`, exactly one")
        return self


class RewardIn(Strict):
    """Control API: the grader's verdict for a rollout, with optional per-call rewards. The last write wins."""

    value: float
    details: dict[str, Any] = Field(default_factory=dict)
    steps: list[StepReward] = Field(default_factory=list, max_length=10_000)


class Reward(BaseModel):
    """A rollout's stored reward."""

    rollout_id: str
    value: float
    details: dict[str, Any] = Field(default_factory=dict)
    steps: list[StepReward] = Field(default_factory=list)
    updated_at: float


class AnnotationIn(StepReward):
    """Model API (rollout key): the harness annotates one of its calls. `value` is optional: without the
    task's `allow_annotation_rewards` an annotation is data (shown and exported), never a reward."""

    value: float | None = Field(default=None, allow_inf_nan=False)  # type: ignore[assignment]
    label: str | None = Field(default=None, max_length=200)


class Annotation(AnnotationIn):
    """A stored annotation: what the harness wrote, numbered in its rollout."""

    model_config = ConfigDict(extra="ignore")

    rollout_id: str
    seq: int = 0
    created_at: float


class RolloutDetail(BaseModel):
    """A rollout with everything recorded for it: the unit the trainer consumes."""

    rollout: Rollout
    attempts: list[Attempt]
    calls: list[Call]
    reward: Reward | None = None
    annotations: list[Annotation] = Field(default_factory=list)


class RolloutPage(BaseModel):
    """One page of a rollout listing; pass `next_cursor` back as `cursor` for the next page."""

    rollouts: list[Rollout]
    next_cursor: str | None = None


class RolloutEvent(BaseModel):
    """A rollout entered a state (pushed on the control API's event stream; `seq` orders all events)."""

    seq: int
    rollout_id: str
    state: RolloutState
    group_id: str | None = None
    time: float


SQL_INT_LIMIT: Final = 2**63
"""Sequence numbers, cursors and versions are SQL INTEGERs (signed 64-bit): every value is below this."""


class PauseRequest(Strict):
    """Body of `POST /control/pause`."""

    drain_timeout_s: float = Field(default=600.0, ge=0.0)
    preempt: bool = False  # cut non-streaming calls and resend them after resume instead of waiting


class ResumeRequest(Strict):
    """Body of `POST /control/resume`: optionally the weight version the engine now serves."""

    weight_version: int | None = Field(default=None, ge=0, lt=SQL_INT_LIMIT)
