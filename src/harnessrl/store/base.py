"""The `Store` interface: everything the gateway records, behind one small contract."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

from harnessrl.schema import (
    Annotation,
    AnnotationIn,
    Attempt,
    AttemptFinish,
    Call,
    Reward,
    RewardIn,
    Rollout,
    RolloutCreate,
    RolloutDetail,
    RolloutEvent,
    RolloutState,
)


class StoreError(Exception):
    """Base for store errors that map to a client error (4xx)."""


class NotFound(StoreError):
    """The rollout (or attempt) does not exist."""


class Conflict(StoreError):
    """The write conflicts with the stored state (illegal transition, finished rollout...)."""


class Store(ABC):
    """Durable record of rollouts, attempts, calls and rewards. Every write is committed on return."""

    # True when other processes' writes wake `wait_events` (a shared database); False when this
    # process is the only writer, so its own notifications suffice (SQLite)
    pushes_events: bool = False

    @abstractmethod
    def create_rollout(self, req: RolloutCreate, rollout_id: str) -> tuple[Rollout, bool]:
        """Create a rollout, or return the existing one with the same `client_id` (created=False)."""

    @abstractmethod
    def get_rollout(self, rollout_id: str) -> Rollout | None:
        """The rollout, or None."""

    @abstractmethod
    def list_rollouts(
        self, state: RolloutState | None = None, limit: int = 100, after: int = 0
    ) -> tuple[list[Rollout], int | None]:
        """Rollouts in creation order after cursor `after`; returns (page, next cursor or None)."""

    @abstractmethod
    def set_state(self, rollout_id: str, state: RolloutState) -> Rollout:
        """Move a rollout to `state`, checking the transition table."""

    @abstractmethod
    def start_attempt(self, rollout_id: str) -> Attempt:
        """Open the next attempt of a queued rollout and mark the rollout running."""

    @abstractmethod
    def finish_attempt(self, rollout_id: str, attempt: int, finish: AttemptFinish) -> Attempt:
        """Record how an attempt ended."""

    @abstractmethod
    def attempts(self, rollout_id: str) -> list[Attempt]:
        """All attempts of a rollout, oldest first."""

    @abstractmethod
    def events(self, after: int = 0, limit: int = 1000) -> list[RolloutEvent]:
        """Rollout state changes after sequence number `after`, oldest first."""

    def wait_events(self, after: int, timeout_s: float) -> bool:
        """Block until an event after `after` is stored or `timeout_s` passes; returns whether one is
        there. This default polls; a backend with a push channel (PostgreSQL's LISTEN/NOTIFY) wakes
        on other processes' writes at once."""
        deadline = time.monotonic() + timeout_s
        while not self.events(after=after, limit=1):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.05, left))
        return True

    @abstractmethod
    def add_call(self, call: Call) -> Call:
        """Record one call (its `index` is assigned here); durable when this returns."""

    def add_calls(self, calls: list[Call]) -> list[Call]:
        """Record several calls at once (one transaction where the backend can); durable on return."""
        return [self.add_call(c) for c in calls]

    @abstractmethod
    def calls(self, rollout_id: str) -> list[Call]:
        """All calls of a rollout in the order they were made."""

    @abstractmethod
    def recent_calls(self, rollout_id: str, limit: int) -> list[Call]:
        """The rollout's last `limit` calls, oldest first."""

    @abstractmethod
    def count_calls(self, rollout_id: str) -> int:
        """Number of calls recorded for a rollout (the next call's index)."""

    @abstractmethod
    def set_reward(self, rollout_id: str, reward: RewardIn) -> Reward:
        """Write the rollout's reward; the last write wins."""

    @abstractmethod
    def get_reward(self, rollout_id: str) -> Reward | None:
        """The rollout's reward, or None."""

    def add_annotation(self, rollout_id: str, annotation: AnnotationIn) -> Annotation:
        """Record the harness's annotation of one of its calls (`NotFound` for an unknown rollout)."""
        raise NotImplementedError(f"{type(self).__name__} does not keep annotations")

    def annotations(self, rollout_id: str) -> list[Annotation]:
        """The rollout's annotations in the order they were written (none where a store keeps none)."""
        return []

    @abstractmethod
    def get_meta(self, key: str) -> str | None:
        """A store-level setting (for example the key-signing secret)."""

    @abstractmethod
    def set_meta_if_absent(self, key: str, value: str) -> str:
        """Set a store-level setting unless present; returns the stored value."""

    @abstractmethod
    def set_meta(self, key: str, value: str) -> None:
        """Set a store-level setting (the last write wins)."""

    @abstractmethod
    def close(self) -> None:
        """Release the store's resources."""

    def detail(self, rollout_id: str) -> RolloutDetail:
        """The rollout with its attempts, calls and reward."""
        rollout = self.get_rollout(rollout_id)
        if rollout is None:
            raise NotFound(f"rollout '{rollout_id}' not found")
        return RolloutDetail(
            rollout=rollout,
            attempts=self.attempts(rollout_id),
            calls=self.calls(rollout_id),
            reward=self.get_reward(rollout_id),
            annotations=self.annotations(rollout_id),
        )
