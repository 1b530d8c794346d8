"""A control client for several gateway replicas on one shared store (PostgreSQL).

Every replica serves every rollout (the key secret and all state live in the store), so the client is
free to choose. It keeps each rollout on one replica — the harness's model calls and the controller's
control calls for that rollout go to the same process — and moves it only when that replica stops
answering:

- a rollout's replica is picked once (rendezvous hashing of its id over the replicas answering at the
  time) and pinned; a pinned rollout moves to the next replica in its own order when a request to its
  replica fails to connect, and never moves back (the old replica's memory of the rollout may be
  stale);
- a replica that failed to connect is left out for `retry_down_s`, then asked for `/health` before it
  takes work again; on its return it is told the pause state and the weight version it missed;
- pause and resume go to every replica (the run's weight version reaches all of them); a replica that
  cannot be reached is reported in the answer and brought up to date (paused, or resumed with the
  last weight version) when it returns;
- an attempt whose replica died while the harness ran is reported by `lost(url)`, so the controller
  records it as an infrastructure failure and runs the rollout again on another replica.

`ControlClient` is the one-gateway case; this class has the same methods plus `urls`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

import httpx

from harnessrl.gateway.client import ControlClient, ControlUnreachable
from harnessrl.schema import (
    Attempt,
    AttemptFinish,
    AttemptStatus,
    Reward,
    RewardIn,
    Rollout,
    RolloutCreate,
    RolloutCreated,
    RolloutDetail,
    RolloutEvent,
    RolloutPage,
    RolloutState,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


def rendezvous(key: str, urls: list[str]) -> list[int]:
    """Indices of `urls` in `key`'s preference order (highest random weight first): each key spreads
    evenly, and removing one URL moves only the keys that preferred it."""

    def weight(i: int) -> bytes:
        return hashlib.blake2b(f"{urls[i]}|{key}".encode(), digest_size=8).digest()

    return sorted(range(len(urls)), key=weight, reverse=True)


class GatewayReplicas:
    """Control client over gateway replicas (see the module's description). `clients` (one
    `ControlClient` per URL) may be given for tests."""

    def __init__(
        self,
        urls: list[str],
        admin_key: str,
        timeout_s: float = 700.0,
        retry_down_s: float = 5.0,
        health_timeout_s: float = 2.0,
    ) -> None:
        if not urls:
            raise ValueError("GatewayReplicas needs at least one gateway URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"gateway URLs repeat: {urls}")
        self.urls = [u.rstrip("/") for u in urls]
        self.clients = [ControlClient(u, admin_key, timeout_s) for u in self.urls]
        self.retry_down_s = retry_down_s
        self._health = httpx.AsyncClient(timeout=health_timeout_s)
        self._down_until: dict[int, float] = {}  # replica -> monotonic time it may be probed again
        self._pinned: dict[str, int] = {}  # rollout id -> its replica
        self._paused = False
        self._weight_version: int | None = None
        self._lock = asyncio.Lock()  # replica comebacks (probe + catch-up) one at a time
        self.failovers = 0  # rollouts moved off a replica that stopped answering

    # choosing replicas ---------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """The first replica's URL (what a one-gateway caller would use)."""
        return self.urls[0]

    def _up(self, i: int) -> bool:
        return i not in self._down_until

    def _mark_down(self, i: int, error: BaseException) -> None:
        if self._up(i):
            log.warning("event=gateway_replica_down url=%s error=%s", self.urls[i], error)
        self._down_until[i] = time.monotonic() + self.retry_down_s

    async def _revive(self) -> None:
        """Probe the replicas whose retry time has come; one that answers is brought up to date."""
        due = [i for i, t in self._down_until.items() if t <= time.monotonic()]
        if not due:
            return
        async with self._lock:
            for i in due:
                if i not in self._down_until or self._down_until[i] > time.monotonic():
                    continue
                if await self._healthy(i) and await self._catch_up(i):
                    del self._down_until[i]
                    log.info("event=gateway_replica_up url=%s", self.urls[i])
                else:
                    self._down_until[i] = time.monotonic() + self.retry_down_s

    async def _healthy(self, i: int) -> bool:
        try:
            return (await self._health.get(f"{self.urls[i]}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def _catch_up(self, i: int) -> bool:
        """Tell a returning replica the pause, or the weight version of the last resume: it may have
        missed them, or restarted and forgotten them."""
        try:
            if self._paused:
                await self.clients[i].pause(drain_timeout_s=0.0)
            else:
                await self.clients[i].resume(self._weight_version)
        except (ControlUnreachable, OSError) as e:
            log.warning("event=gateway_replica_catch_up_failed url=%s error=%s", self.urls[i], e)
            return False
        return True

    def _order(self, key: str) -> list[int]:
        """Replicas for `key`: those up in its rendezvous order, then the down ones (a last resort)."""
        order = rendezvous(key, self.urls)
        return [i for i in order if self._up(i)] + [i for i in order if not self._up(i)]

    def replica_of(self, rollout_id: str) -> int:
        """The replica serving `rollout_id` (pinned on first use)."""
        i = self._pinned.get(rollout_id)
        if i is None or not self._up(i):
            j = self._order(rollout_id)[0]
            if i is not None and j != i:
                self.failovers += 1
                log.warning(
                    "event=rollout_failover rollout=%s from=%s to=%s", rollout_id, self.urls[i], self.urls[j]
                )
            self._pinned[rollout_id] = i = j
        return i

    def model_url(self, rollout_id: str) -> str:
        """The gateway URL the rollout's harness should call."""
        return self.urls[self.replica_of(rollout_id)]

    async def lost(self, url: str) -> bool:
        """True if the replica at `url` stopped answering (its attempt in progress is void)."""
        i = self.urls.index(url.rstrip("/"))
        if self._up(i) and await self._healthy(i):
            return False
        self._mark_down(i, ConnectionError("no answer to /health after an attempt"))
        return True

    async def _on(self, rollout_id: str, do: Callable[[ControlClient], Awaitable[T]]) -> T:
        """`do` on the rollout's replica; on a connection failure, on the next one (the rollout moves)."""
        return await self._first_answer(lambda: (self.replica_of(rollout_id) for _ in self.urls), do)

    async def _any(self, key: str, do: Callable[[ControlClient], Awaitable[T]]) -> T:
        """`do` on any replica that answers, in `key`'s order."""
        return await self._first_answer(lambda: self._order(key), do)

    async def _first_answer(
        self, replicas: Callable[[], Iterable[int]], do: Callable[[ControlClient], Awaitable[T]]
    ) -> T:
        """`do` on the replicas in turn (`replicas()` is read after reviving those due a retry; an
        unreachable one is marked down before the next is picked) until one answers."""
        await self._revive()
        last: BaseException | None = None
        for i in replicas():
            try:
                return await do(self.clients[i])
            except ControlUnreachable as e:
                last = e
                self._mark_down(i, e)
        assert last is not None
        raise last

    # the control API -----------------------------------------------------------------------------
    async def create_rollout(self, req: RolloutCreate) -> RolloutCreated:
        """Create (or fetch, by client id) a rollout on any replica (creates are idempotent, so a
        resend to another replica after a dropped connection is safe), then pin it."""
        created = await self._any(req.client_id, lambda c: c.create_rollout(req))
        self.replica_of(created.rollout.rollout_id)
        return created

    async def start_attempt(self, rollout_id: str) -> Attempt:
        """Open the rollout's next attempt. If its replica dropped the request, the next replica first
        looks whether the attempt was opened (the newest attempt running) and adopts it."""
        i = self.replica_of(rollout_id)
        try:
            await self._revive()
            return await self.clients[i].start_attempt(rollout_id)
        except ControlUnreachable as e:
            self._mark_down(i, e)

        async def adopt_or_start(c: ControlClient) -> Attempt:
            attempts = (await c.rollout(rollout_id)).attempts
            if attempts and attempts[-1].status == AttemptStatus.RUNNING:
                return attempts[-1]
            return await c.start_attempt(rollout_id)

        return await self._on(rollout_id, adopt_or_start)

    async def finish_attempt(self, rollout_id: str, attempt: int, finish: AttemptFinish) -> Attempt:
        """Record how an attempt ended."""
        return await self._on(rollout_id, lambda c: c.finish_attempt(rollout_id, attempt, finish))

    async def set_state(self, rollout_id: str, state: RolloutState) -> Rollout:
        """Move a rollout to another state."""
        return await self._on(rollout_id, lambda c: c.set_state(rollout_id, state))

    async def set_reward(self, rollout_id: str, reward: RewardIn) -> Reward:
        """Write a rollout's reward."""
        return await self._on(rollout_id, lambda c: c.set_reward(rollout_id, reward))

    async def rollout(self, rollout_id: str) -> RolloutDetail:
        """A rollout with its attempts, calls and reward."""
        return await self._on(rollout_id, lambda c: c.rollout(rollout_id))

    async def list_rollouts(
        self, state: RolloutState | None = None, limit: int = 100, cursor: str | None = None
    ) -> RolloutPage:
        """One page of rollouts (the store is shared: any replica gives the same page)."""
        return await self._any("list", lambda c: c.list_rollouts(state, limit, cursor))

    async def _everywhere(self, do: Callable[[ControlClient], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """`do` on every replica at once; those that cannot be reached are marked down (and caught up
        when they answer again)."""
        await self._revive()
        results = await asyncio.gather(*(do(c) for c in self.clients), return_exceptions=True)
        answers: list[dict[str, Any]] = []
        unreachable: list[str] = []
        for i, r in enumerate(results):
            if isinstance(r, ControlUnreachable | OSError):
                self._mark_down(i, r)
                unreachable.append(self.urls[i])
            elif isinstance(r, BaseException):
                raise r
            else:
                answers.append(r)
        if not answers:
            raise ControlUnreachable(f"no gateway replica answered: {', '.join(unreachable)}")
        return {"replicas": len(answers), "unreachable": unreachable, "answers": answers}

    async def pause(self, drain_timeout_s: float = 600.0, preempt: bool = False) -> dict[str, Any]:
        """Pause every replica and wait for each to drain; `drained` only if all drained."""
        self._paused = True
        out = await self._everywhere(lambda c: c.pause(drain_timeout_s, preempt))
        answers = out.pop("answers")
        return {"paused": True, "drained": all(a.get("drained") for a in answers),
                "in_flight": sum(int(a.get("in_flight", 0)) for a in answers),
                "preempted_calls": sum(int(a.get("preempted_calls", 0)) for a in answers), **out}  # fmt: skip

    async def resume(self, weight_version: int | None = None) -> dict[str, Any]:
        """Resume every replica with the engine's weight version."""
        self._paused = False
        if weight_version is not None:
            self._weight_version = weight_version
        out = await self._everywhere(lambda c: c.resume(weight_version))
        out.pop("answers")
        return {"paused": False, "weight_version": weight_version, **out}

    async def events(self, after: int = 0) -> AsyncIterator[RolloutEvent]:
        """Rollout state changes after `after` (the store numbers them for all replicas): from one
        replica, continuing on another from the last number seen when it goes away."""
        while True:
            await self._revive()
            i = self._order("events")[0]
            try:
                async for ev in self.clients[i].events(after):
                    after = ev.seq
                    yield ev
                return
            except (httpx.TransportError, ControlUnreachable) as e:
                self._mark_down(i, e)
                await asyncio.sleep(0.1)

    async def aclose(self) -> None:
        """Close every replica's HTTP client."""
        for c in self.clients:
            await c.aclose()
        await self._health.aclose()
