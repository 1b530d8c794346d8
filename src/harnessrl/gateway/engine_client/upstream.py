"""Clients for the engines behind the gateway, with retries and backoff."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import orjson

from harnessrl.defaults import ENGINE_KEY_ENV
from harnessrl.gateway.engine_client.httpclient import HTTPError, HTTPPool

log = logging.getLogger(__name__)
R = TypeVar("R")

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
# The engine refused the gateway's own key: never the client's fault.
KEY_REFUSED_STATUS = frozenset({401, 403})


class UpstreamClientError(Exception):
    """The engine rejected the request as invalid (4xx other than 401, 403 and 429): the client's fault."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.body = body

    @property
    def message(self) -> str:
        """The engine's error message, if it sent one."""
        if isinstance(self.body, dict):
            err = self.body.get("error")
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                return err["message"]
            if isinstance(err, str):
                return err
        return f"the engine rejected the request with status {self.status}"


class UpstreamFailed(Exception):
    """The engine could not answer after all retries."""


class UpstreamKeyRefused(UpstreamFailed):
    """The engine answered 401/403: it does not accept the key this gateway sends (its engine key is set
    up wrong, an operator's error). Not retried on that replica; the message names the variable to fix and
    says nothing of the key."""


class Upstream:
    """One engine replica reached over HTTP (engine protocol: OpenAI routes + token-ID extensions).

    Time limits: each try waits at most `timeout_s` for a whole answer (or, streaming, between two
    pieces of it) and a streamed try at most `open_timeout_s` for the answer to begin (an engine sends
    its headers at once, before generating); a try that runs out is retried like a 5xx. A `deadline`
    (a `time.monotonic()` instant, set per call by the pool) bounds all tries together."""

    def __init__(
        self,
        name: str,
        base_url: str,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.25,
        open_timeout_s: float = 30.0,
        api_key: str | None = None,
    ) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.open_timeout_s = open_timeout_s
        self._http = HTTPPool(self.base_url, timeout_s=timeout_s, api_key=api_key)  # api_key: the engine's
        self._keyed = bool(api_key)

    async def post(self, path: str, body: dict[str, Any], deadline: float | None = None) -> dict[str, Any]:
        """POST JSON and return the JSON answer, retrying timeouts, 429 and 5xx with backoff."""
        payload = _encode(body)
        last = "no attempt made"
        for attempt in range(self.max_retries + 1):
            if attempt and not await _backoff(self.backoff_s * 2 ** (attempt - 1), deadline):
                raise UpstreamFailed(self._gave_up(attempt, last, out_of_time=True))
            try:
                status, raw = await self._http.post(path, payload, _remaining(self.timeout_s, deadline))
            except HTTPError as e:
                last = f"ConnectError: {e}"
                log.warning("event=upstream_retry upstream=%s attempt=%d error=%s", self.name, attempt, last)
                continue
            if status in RETRYABLE_STATUS:
                last = f"status {status}: {raw[:300].decode(errors='replace')}"
                log.warning("event=upstream_retry upstream=%s attempt=%d error=%s", self.name, attempt, last)
                continue
            if status in KEY_REFUSED_STATUS:
                raise self._key_refused(status)
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                raise UpstreamFailed(f"upstream {self.name} sent a non-JSON answer ({status})") from e
            if status >= 400:
                raise UpstreamClientError(status, data)
            if not isinstance(data, dict):
                raise UpstreamFailed(f"upstream {self.name} sent JSON that is not an object")
            return data
        raise UpstreamFailed(self._gave_up(self.max_retries + 1, last))

    async def open_stream(
        self, path: str, body: dict[str, Any], deadline: float | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """POST with `stream: true`; once the engine has answered 200, return its SSE events as dicts.
        Failures before the answer begins (no headers within `open_timeout_s` included) are retried
        like `post`; later ones raise `UpstreamFailed`."""
        payload = _encode({**body, "stream": True})
        last = "no attempt made"
        for attempt in range(self.max_retries + 1):
            if attempt and not await _backoff(self.backoff_s * 2 ** (attempt - 1), deadline):
                raise UpstreamFailed(self._gave_up(attempt, last, out_of_time=True))
            try:
                status, pieces = await self._http.stream(path, payload, self.open_timeout_s, deadline)
            except HTTPError as e:
                last = f"ConnectError: {e}"
                log.warning("event=upstream_retry upstream=%s attempt=%d error=%s", self.name, attempt, last)
                continue
            if status == 200:
                return _sse_events(pieces, self.name)
            try:
                raw = b"".join([p async for p in pieces])
            except HTTPError as e:
                last = f"status {status}, then: {e}"
                continue
            if status in RETRYABLE_STATUS:
                last = f"status {status}: {raw[:300].decode(errors='replace')}"
                continue
            if status in KEY_REFUSED_STATUS:
                raise self._key_refused(status)
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError:
                data = raw.decode(errors="replace")
            raise UpstreamClientError(status, data)
        raise UpstreamFailed(self._gave_up(self.max_retries + 1, last))

    def _key_refused(self, status: int) -> UpstreamKeyRefused:
        """The engine's 401/403 as the operator's error, naming the variable that sets the key (the
        engine's own message is left out, in case it repeats what it was sent)."""
        log.error("event=upstream_key_refused upstream=%s status=%d keyed=%s", self.name, status, self._keyed)
        sent = (
            f"the key in its ${ENGINE_KEY_ENV}" if self._keyed else f"no key (its ${ENGINE_KEY_ENV} is unset)"
        )
        return UpstreamKeyRefused(
            f"upstream {self.name} refused the gateway's engine key ({status}): the gateway sent {sent}; "
            f"start the gateway with ${ENGINE_KEY_ENV} set to the key the engine was started with"
        )

    def _gave_up(self, tries: int, last: str, out_of_time: bool = False) -> str:
        """The failure after `tries` tries; `out_of_time`: the call's time limit left no room for another."""
        said = f"upstream {self.name} failed after {tries} {'try' if tries == 1 else 'tries'}: {last}"
        return said + ("; the call's time limit left no time for another try" if out_of_time else "")

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()


def _encode(body: dict[str, Any]) -> bytes:
    """The engine request as JSON; a body that cannot be encoded is the client's fault."""
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError as e:
        raise UpstreamClientError(400, {"error": {"message": f"the request cannot be encoded: {e}"}}) from e


def _remaining(wait_s: float, deadline: float | None) -> float:
    return wait_s if deadline is None else max(0.0, min(wait_s, deadline - time.monotonic()))


async def _backoff(delay_s: float, deadline: float | None) -> bool:
    """Sleep before a retry; False (without sleeping) when the retry would start past `deadline`."""
    if deadline is not None and time.monotonic() + delay_s >= deadline:
        return False
    await asyncio.sleep(delay_s)
    return True


async def _sse_events(pieces: AsyncIterator[bytes], name: str) -> AsyncIterator[dict[str, Any]]:
    """`data:` payloads of an SSE body as dicts, until `[DONE]`."""
    buf = b""
    try:
        async for piece in pieces:
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    try:
                        yield orjson.loads(data)
                    except orjson.JSONDecodeError as e:
                        raise UpstreamFailed(f"upstream {name} sent a malformed stream event") from e
    except HTTPError as e:
        raise UpstreamFailed(f"upstream {name} broke off its stream: {e}") from e


class UpstreamPool:
    """The replicas serving one model. Each rollout sticks to one replica (its prefix cache stays
    warm); when that replica fails after its retries, the next replica in the rollout's own order
    (rendezvous hashing) is tried, so failover spreads evenly and is stable. `call_timeout_s` bounds
    each call's tries on all replicas together (None: no bound beyond each replica's own)."""

    def __init__(self, replicas: list[Upstream], call_timeout_s: float | None = None) -> None:
        if not replicas:
            raise ValueError("an upstream pool needs at least one replica")
        self.replicas = replicas
        self.call_timeout_s = call_timeout_s

    def order(self, rollout_id: str) -> list[Upstream]:
        """Replicas in the rollout's preference order."""

        def score(u: Upstream) -> bytes:
            return hashlib.blake2b(f"{rollout_id}|{u.name}".encode(), digest_size=8).digest()

        return sorted(self.replicas, key=score, reverse=True)

    def _deadline(self) -> float | None:
        return None if self.call_timeout_s is None else time.monotonic() + self.call_timeout_s

    async def post(self, rollout_id: str, path: str, body: dict[str, Any]) -> tuple[Upstream, dict[str, Any]]:
        """POST to the rollout's replica, failing over to the next ones; returns (replica, answer)."""
        return await self._failover(rollout_id, lambda u, deadline: u.post(path, body, deadline))

    async def open_stream(
        self, rollout_id: str, path: str, body: dict[str, Any]
    ) -> tuple[Upstream, AsyncIterator[dict[str, Any]]]:
        """Open a stream on the rollout's replica, failing over before the answer begins."""
        return await self._failover(rollout_id, lambda u, deadline: u.open_stream(path, body, deadline))

    async def _failover(
        self, rollout_id: str, attempt: Callable[[Upstream, float | None], Awaitable[R]]
    ) -> tuple[Upstream, R]:
        """`attempt` on the rollout's replicas in its order until one answers or the call's time is up."""
        errors = []
        deadline = self._deadline()
        for upstream in self.order(rollout_id):
            try:
                return upstream, await attempt(upstream, deadline)
            except UpstreamFailed as e:
                errors.append(str(e))
                log.warning("event=upstream_failover rollout=%s from=%s", rollout_id, upstream.name)
            if deadline is not None and time.monotonic() >= deadline:
                errors.append(f"the call's time limit ({self.call_timeout_s:g} s) ran out")
                break
        raise UpstreamFailed("; ".join(errors))

    async def aclose(self) -> None:
        """Close every replica's connections."""
        for u in self.replicas:
            await u.aclose()


class StickyUpstream:
    """One rollout's view of a pool: `post` goes to its replica; `served_by` names the one that answered."""

    def __init__(self, pool: UpstreamPool, rollout_id: str) -> None:
        self.pool = pool
        self.rollout_id = rollout_id
        self.served_by = pool.order(rollout_id)[0].name

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST through the pool with this rollout's stickiness."""
        upstream, answer = await self.pool.post(self.rollout_id, path, body)
        self.served_by = upstream.name
        return answer

    async def open_stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """A streamed POST through the pool with this rollout's stickiness."""
        upstream, events = await self.pool.open_stream(self.rollout_id, path, body)
        self.served_by = upstream.name
        return events
