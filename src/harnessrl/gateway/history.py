"""What the gateway remembers of a rollout's earlier calls: tito and `previous_response_id` need them.

A gateway that is the only writer of its store keeps the last few calls of recently active rollouts in
memory; a miss (a restart, an old response id) reads the store. Replicas on a shared store keep none
(`max_rollouts=0`): another replica may have recorded the rollout's latest call. Nothing is loaded for a
call that does not need history.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from harnessrl.schema import Call
from harnessrl.store import Store


class RecentCalls:
    """The last `per_rollout` calls of up to `max_rollouts` rollouts, newest last."""

    def __init__(self, store: Store, per_rollout: int = 16, max_rollouts: int = 4096) -> None:
        self.store = store
        self.per_rollout = per_rollout
        self.max_rollouts = max_rollouts
        self._cache: OrderedDict[str, deque[Call]] = OrderedDict()

    def recent(self, rollout_id: str) -> list[Call]:
        """The rollout's latest calls, oldest first (from memory, or the store on a miss)."""
        calls = self._cache.get(rollout_id)
        if calls is None:
            calls = deque(self.store.recent_calls(rollout_id, self.per_rollout), maxlen=self.per_rollout)
            self._remember(rollout_id, calls)
        else:
            self._cache.move_to_end(rollout_id)
        return list(calls)

    def add(self, call: Call) -> None:
        """Remember a call just recorded (only for rollouts already in memory)."""
        calls = self._cache.get(call.rollout_id)
        if calls is not None:
            calls.append(call)

    def _remember(self, rollout_id: str, calls: deque[Call]) -> None:
        self._cache[rollout_id] = calls
        while len(self._cache) > self.max_rollouts:
            self._cache.popitem(last=False)


class History:
    """One call's lazy view of its rollout's earlier calls in the same attempt."""

    def __init__(self, recent: RecentCalls, rollout_id: str, attempt: int) -> None:
        self._recent = recent
        self.rollout_id = rollout_id
        self.attempt = attempt

    def recent(self) -> list[Call]:
        """The latest calls of this attempt, oldest first."""
        return [c for c in self._recent.recent(self.rollout_id) if c.attempt == self.attempt]

    def all(self) -> list[Call]:
        """Every call of this attempt, oldest first (reads the store)."""
        return [c for c in self._recent.store.calls(self.rollout_id) if c.attempt == self.attempt]
