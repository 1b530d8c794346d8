"""Following a run's Jobs for the Kubernetes runner: a list + watch cache with periodic relists, and
the token bucket that rate limits Job creation.

`JobTracker` keeps the latest copy of every Job matching the run's label selector: it lists them,
watches from the list's resourceVersion with a server-side `timeoutSeconds` (plus a client-side
timeout for a stream that hangs silently), and relists when the watch ends, drops, or reports 410
Gone. So an event the watch misses is found by the next relist, at most `reconcile_interval_s` later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from harnessrl.controller.runners.kubernetes_api import KubeApi, KubeApiError

log = logging.getLogger(__name__)
JSON = dict[str, Any]


class TokenBucket:
    """Allows `rate_per_s` acquisitions per second on average, `burst` at once; waiters queue in order."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int = 1,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self.rate, self.burst = rate_per_s, burst
        self._clock, self._sleep = clock, sleep
        self._tokens, self._last = float(burst), clock()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        """Wait until a token is available and take it."""
        async with self._lock:
            while True:
                now = self._clock()
                self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
                self._last = now
                if self._tokens >= 1:
                    self._tokens -= 1
                    return
                await self._sleep((1 - self._tokens) / self.rate)


class JobTracker:
    """The latest state of a run's Jobs, kept by list + watch, relisted periodically and on errors."""

    def __init__(self, api: KubeApi, namespace: str, selector: str, reconcile_interval_s: float) -> None:
        self.api, self.namespace, self.selector = api, namespace, selector
        self.reconcile_interval_s = reconcile_interval_s
        self.jobs: dict[str, JSON] = {}
        self.gone: set[str] = set()
        self.relists = 0
        self._events: dict[str, asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the list/watch loop (once)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="harnessrl-k8s-tracker")

    async def stop(self) -> None:
        """Stop the list/watch loop."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def observe(self, job: JSON) -> None:
        """Record a Job's state (from a create, get, list or watch event) and wake its waiter."""
        name = job["metadata"]["name"]
        old = self.jobs.get(name)
        if old is not None and _rv(old) > _rv(job):
            return  # an older copy (a list that raced a watch event)
        self.jobs[name] = job
        self.gone.discard(name)
        self._wake(name)

    def mark_gone(self, name: str) -> None:
        """Record that a Job was deleted."""
        self.jobs.pop(name, None)
        self.gone.add(name)
        self._wake(name)

    def forget(self, name: str) -> None:
        """Drop what is known of a Job whose attempt is over."""
        self.jobs.pop(name, None)
        self.gone.discard(name)
        self._events.pop(name, None)

    async def wait(self, name: str, timeout_s: float) -> None:
        """Wait until the Job changes, or `timeout_s`. A cancel always propagates: `asyncio.timeout`, not
        `asyncio.wait_for`, which on Python 3.11 returns instead when cancelled in the turn the event is
        set (the tracker sets it on every watch event and relist), so a cancelled attempt ran to its end."""
        ev = self._events.setdefault(name, asyncio.Event())
        ev.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await ev.wait()

    def _wake(self, name: str) -> None:
        if name in self._events:
            self._events[name].set()

    async def relist(self) -> str:
        """List the run's Jobs; waited-on Jobs missing from the list are confirmed gone by a GET."""
        listing = await self.api.list_jobs(self.namespace, self.selector)
        self.relists += 1
        seen = set()
        for job in listing.get("items") or []:
            seen.add(job["metadata"]["name"])
            self.observe(job)
        for name in [n for n in self._events if n not in seen and n not in self.gone]:
            try:
                self.observe(await self.api.get_job(self.namespace, name))
            except KubeApiError as e:
                if e.status == 404:
                    self.mark_gone(name)
        return str((listing.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, rv: str) -> None:
        timeout = max(1, int(self.reconcile_interval_s))
        async with asyncio.timeout(self.reconcile_interval_s + 5):  # a stream that hangs silently
            async for event in self.api.watch_jobs(self.namespace, self.selector, rv, timeout):
                obj, kind = event.get("object") or {}, event.get("type")
                if kind in ("ADDED", "MODIFIED"):
                    self.observe(obj)
                elif kind == "DELETED":
                    self.mark_gone(obj["metadata"]["name"])

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self._watch(await self.relist())
            except TimeoutError:
                log.info("event=k8s_watch_silent relisting namespace=%s", self.namespace)
            except KubeApiError as e:
                log.info("event=k8s_watch_ended status=%d reason=%s relisting", e.status, e.reason)
                if e.status == 410:  # expired resourceVersion: relist at once
                    continue
            except (httpx.HTTPError, ValueError) as e:
                log.warning("event=k8s_watch_error error=%r relisting", e)
            # a stream that ends at once must not turn into a busy relist loop
            await asyncio.sleep(max(0.0, min(1.0, self.reconcile_interval_s) - (time.monotonic() - started)))


def _rv(obj: JSON) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0
