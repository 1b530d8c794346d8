"""An async client for the gateway's control API, used by the controller and the trainer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx

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

RETRIES = 3  # resends of a request whose connection failed or was dropped before the answer


class ControlUnreachable(ConnectionError):
    """The control API could not be reached, dropped the connection before answering (after
    `RETRIES` resends) or did not answer in time. An `OSError`: the controller fails the rollout it
    was working on instead of stopping the run."""


class ControlError(Exception):
    """The control API answered with an error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class Control(Protocol):
    """What the controller and the trainer need of the control API: `ControlClient` (one gateway) or
    `replicas.GatewayReplicas` (several gateways on one shared store)."""

    def model_url(self, rollout_id: str) -> str: ...
    async def lost(self, url: str) -> bool: ...
    async def create_rollout(self, req: RolloutCreate) -> RolloutCreated: ...
    async def start_attempt(self, rollout_id: str) -> Attempt: ...
    async def finish_attempt(self, rollout_id: str, attempt: int, finish: AttemptFinish) -> Attempt: ...
    async def set_state(self, rollout_id: str, state: RolloutState) -> Rollout: ...
    async def set_reward(self, rollout_id: str, reward: RewardIn) -> Reward: ...
    async def rollout(self, rollout_id: str) -> RolloutDetail: ...
    async def list_rollouts(
        self, state: RolloutState | None = None, limit: int = 100, cursor: str | None = None
    ) -> RolloutPage: ...
    async def pause(self, drain_timeout_s: float = 600.0, preempt: bool = False) -> dict[str, Any]: ...
    async def resume(self, weight_version: int | None = None) -> dict[str, Any]: ...
    def events(self, after: int = 0) -> AsyncIterator[RolloutEvent]: ...
    async def aclose(self) -> None: ...


class ControlClient:
    """Typed access to `/control/*` with the admin key, on one gateway."""

    def __init__(self, base_url: str, admin_key: str, timeout_s: float = 700.0) -> None:
        self.base_url = base_url.rstrip("/")
        # A pooled connection idle for longer than the server's keep-alive timeout (uvicorn: 5 s by
        # default, 30 s in our services) may be closed by the server just as a request goes out on it
        # ("Server disconnected without sending a response"); never reuse one idle for 2 s or more.
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {admin_key}"},
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(keepalive_expiry=2.0),
            transport=httpx.AsyncHTTPTransport(retries=2),  # connection failures only: never a resend
        )

    async def _req(
        self, method: str, path: str, json: Any = None, params: Any = None, resend: bool = True
    ) -> Any:
        """One request; a dropped connection is resent (every control request but `start_attempt` is
        idempotent: a repeat of one already carried out changes nothing)."""
        for i in range(RETRIES + 1 if resend else 1):
            try:
                resp = await self._http.request(method, path, json=json, params=params)
                break
            except (httpx.NetworkError, httpx.RemoteProtocolError) as e:
                if not resend or i == RETRIES:
                    raise ControlUnreachable(f"{method} {path}: {type(e).__name__}: {e}") from e
                log.warning("event=control_resend method=%s path=%s try=%d error=%r", method, path, i + 1, e)
                await asyncio.sleep(0.2 * 2**i)
            except httpx.TimeoutException as e:
                raise ControlUnreachable(f"{method} {path}: no answer in time ({type(e).__name__})") from e
        if resp.status_code >= 400:
            try:
                msg = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = resp.text[:500]
            raise ControlError(resp.status_code, msg)
        return resp.json()

    def model_url(self, rollout_id: str) -> str:
        """The gateway URL a rollout's harness calls: this gateway."""
        return self.base_url

    async def lost(self, url: str) -> bool:
        """Whether the gateway an attempt used went away: with one gateway, every later request
        fails on its own, so never."""
        return False

    async def create_rollout(self, req: RolloutCreate) -> RolloutCreated:
        """Create (or fetch, by client id) a rollout and its key."""
        return RolloutCreated.model_validate(
            await self._req("POST", "/control/rollouts", json=req.model_dump(mode="json"))
        )

    async def start_attempt(self, rollout_id: str) -> Attempt:
        """Open the rollout's next attempt. Not idempotent, so not resent blindly: if the connection
        drops, the request may have been carried out with its answer lost; the caller opens an attempt
        only when none of the rollout's is running (one controller drives a rollout at a time), so a
        running newest attempt is the one this request opened."""
        path = f"/control/rollouts/{rollout_id}/attempts"
        try:
            return Attempt.model_validate(await self._req("POST", path, resend=False))
        except ControlUnreachable as e:
            attempts = (await self.rollout(rollout_id)).attempts
            if attempts and attempts[-1].status == AttemptStatus.RUNNING:
                log.warning("event=control_attempt_adopted rollout=%s attempt=%d error=%s", rollout_id,
                            attempts[-1].attempt, e)  # fmt: skip
                return attempts[-1]
            log.warning("event=control_resend method=POST path=%s error=%s", path, e)
            return Attempt.model_validate(await self._req("POST", path))

    async def finish_attempt(self, rollout_id: str, attempt: int, finish: AttemptFinish) -> Attempt:
        """Record how an attempt ended."""
        data = await self._req(
            "POST",
            f"/control/rollouts/{rollout_id}/attempts/{attempt}/finish",
            json=finish.model_dump(mode="json"),
        )
        return Attempt.model_validate(data)

    async def set_state(self, rollout_id: str, state: RolloutState) -> Rollout:
        """Move a rollout to another state."""
        data = await self._req("POST", f"/control/rollouts/{rollout_id}/state", json={"state": state.value})
        return Rollout.model_validate(data)

    async def set_reward(self, rollout_id: str, reward: RewardIn) -> Reward:
        """Write a rollout's reward."""
        data = await self._req(
            "PUT", f"/control/rollouts/{rollout_id}/reward", json=reward.model_dump(mode="json")
        )
        return Reward.model_validate(data)

    async def rollout(self, rollout_id: str) -> RolloutDetail:
        """A rollout with its attempts, calls and reward."""
        return RolloutDetail.model_validate(await self._req("GET", f"/control/rollouts/{rollout_id}"))

    async def list_rollouts(
        self, state: RolloutState | None = None, limit: int = 100, cursor: str | None = None
    ) -> RolloutPage:
        """One page of rollouts, optionally filtered by state."""
        params: dict[str, Any] = {"limit": limit}
        if state is not None:
            params["state"] = state.value
        if cursor is not None:
            params["cursor"] = cursor
        return RolloutPage.model_validate(await self._req("GET", "/control/rollouts", params=params))

    async def pause(self, drain_timeout_s: float = 600.0, preempt: bool = False) -> dict[str, Any]:
        """Hold new calls and wait for in-flight ones to finish (`preempt`: cut non-streaming ones, which
        the gateway resends after resume)."""
        result: dict[str, Any] = await self._req(
            "POST", "/control/pause", json={"drain_timeout_s": drain_timeout_s, "preempt": preempt}
        )
        return result

    async def resume(self, weight_version: int | None = None) -> dict[str, Any]:
        """Admit calls again, telling the gateway the engine's weight version."""
        result: dict[str, Any] = await self._req(
            "POST", "/control/resume", json={"weight_version": weight_version}
        )
        return result

    async def events(self, after: int = 0) -> AsyncIterator[RolloutEvent]:
        """Rollout state changes after sequence number `after`, pushed as they happen (never ends)."""
        async with self._http.stream("GET", "/control/events", params={"after": after}, timeout=None) as resp:
            if resp.status_code >= 400:
                raise ControlError(resp.status_code, (await resp.aread()).decode(errors="replace")[:500])
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    yield RolloutEvent.model_validate_json(line[6:])

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._http.aclose()
