"""Admission of model calls: the count of calls in flight, the pause that drains them for a weight
update, preemption of non-streamed calls by such a pause, and cutting a call whose client hung up.

Every model call goes through one path: `async with admission.slot() as slot:` admits it (waiting
while paused, 429 after `pause_wait_s`) and releases it when the block ends, unless the handler hands
the slot over to a streamed answer (`slot.hand_over()` returns the release the stream calls when it
ends). A non-streamed engine call runs under `admission.run`, which a preempting pause may cut (the
call is sent again after resume) and which stops when the client hangs up (`ClientGone`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request

from harnessrl.gateway.errors import APIError

T = TypeVar("T")


class ClientGone(Exception):
    """The client of a non-streamed call hung up before its answer; the engine call was cut."""


class Slot:
    """One admitted call; released when its `slot()` block ends unless handed over to a stream."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.handed_over = False

    def hand_over(self) -> Callable[[], None]:
        """Keep the call in flight past the block; the returned function releases it (once)."""
        self.handed_over = True
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._admission.release()

        return release


class _Admitted:
    """`async with admission.slot() as slot`: admit on entry, release on exit unless handed over."""

    __slots__ = ("_admission", "_slot")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._slot: Slot | None = None

    async def __aenter__(self) -> Slot:
        await self._admission._admit()
        self._slot = Slot(self._admission)
        return self._slot

    async def __aexit__(self, *exc: object) -> None:
        if self._slot is not None and not self._slot.handed_over:
            self._admission.release()


class Admission:
    """Calls in flight and the pause state of one gateway (all on its event loop). Its waits are bounded
    with `asyncio.timeout`, never `asyncio.wait_for`, which on Python 3.11 drops a cancel that lands as
    the awaited event is set (a call cancelled as the gateway resumes was admitted anyway)."""

    def __init__(self, pause_wait_s: float) -> None:
        self.pause_wait_s = pause_wait_s
        self.in_flight = 0
        self.preempted_calls = 0
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._preemptible: set[asyncio.Task[Any]] = set()  # non-streamed engine calls a pause may cut
        self._preempted: set[asyncio.Task[Any]] = set()

    @property
    def paused(self) -> bool:
        """True while new calls are held back."""
        return not self._resumed.is_set()

    async def pause(self, drain_timeout_s: float, preempt: bool = False) -> bool:
        """Stop admitting calls and wait for in-flight ones; True if drained in time.

        With `preempt`, non-streaming calls still generating are cut instead of waited for: the engine
        aborts their sequences, and each is sent again, whole, once the gateway resumes (under the new
        weights, which its record then names). The harness sees one slower answer. Streaming calls, whose
        first bytes may be out already, are always waited for."""
        self._resumed.clear()
        if preempt:
            for task in list(self._preemptible):
                self._preempted.add(task)
                task.cancel()
        try:
            async with asyncio.timeout(drain_timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def hold(self) -> None:
        """Start paused (nothing is in flight yet): a replica restarted during a weight update."""
        self._resumed.clear()

    def resume(self) -> None:
        """Admit calls again."""
        self._resumed.set()

    def slot(self) -> _Admitted:
        """Admit one call for the block (see the module docstring)."""
        return _Admitted(self)

    async def _admit(self) -> None:
        if not self._resumed.is_set():
            try:
                async with asyncio.timeout(self.pause_wait_s):
                    await self._resumed.wait()
            except TimeoutError:
                raise APIError(
                    429,
                    "the gateway is paused for a weight update; retry shortly",
                    code="paused",
                    headers={"Retry-After": "5"},
                ) from None
        self._enter()

    def _enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def release(self) -> None:
        """One call left flight (use `Slot.hand_over`'s release for streams)."""
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def run(self, make: Callable[[], Awaitable[T]], request: Request) -> T:
        """Await `make()`, a non-streamed engine call of an admitted call.

        If a preempting pause cuts it, wait for resume (not counted in flight, so the pause drains) and
        run it again. If the client hangs up first, cut it — the engine aborts the sequence when the
        gateway's connection to it closes, so nothing is generated for nobody — and raise `ClientGone`.

        Served by the gateway's own HTTP protocol (`DisconnectHook` in the request's scope), the call
        runs in the handler's task and a hang-up or a pause cancels that task; under another server a
        task per call watches for the hang-up (`_run_watched`)."""
        hook = request.scope.get("extensions", {}).get(DISCONNECT_HOOK)
        task = asyncio.current_task()
        if not isinstance(hook, DisconnectHook) or task is None:
            return await self._run_watched(make, request)
        if hook.gone:
            raise ClientGone
        gone = False

        def cut() -> None:
            nonlocal gone
            if not gone:
                gone = True
                task.cancel()

        hook.add(cut)
        try:
            while True:
                self._preemptible.add(task)
                try:
                    return await make()
                except asyncio.CancelledError:
                    ours = gone + (task in self._preempted)  # the cancels this gateway asked for
                    if task.cancelling() > ours:
                        raise  # cancelled from outside as well (shutdown)
                    for _ in range(ours):
                        task.uncancel()
                    if gone:
                        raise ClientGone from None
                finally:
                    self._preemptible.discard(task)
                    self._preempted.discard(task)
                self.preempted_calls += 1
                self.release()
                try:
                    await self._resumed.wait()
                except asyncio.CancelledError:
                    if not gone or task.cancelling() > 1:
                        raise
                    task.uncancel()
                    raise ClientGone from None
                finally:
                    self._enter()  # in flight again (the slot releases it if this call ends here)
        finally:
            hook.remove(cut)

    async def _run_watched(self, make: Callable[[], Awaitable[T]], request: Request) -> T:
        """`run` under a server without the disconnect hook: `make()` in a task of its own, beside a
        task that waits for the client's `http.disconnect`."""
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            while True:
                task = asyncio.ensure_future(make())
                self._preemptible.add(task)
                try:
                    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if not task.done():
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await task
                        raise ClientGone
                    return await task
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if task not in self._preempted or (current is not None and current.cancelling()):
                        raise  # the handler itself was cancelled (shutdown)
                finally:
                    if not task.done():  # the handler was cancelled while waiting
                        task.cancel()
                    self._preemptible.discard(task)
                    self._preempted.discard(task)
                self.preempted_calls += 1
                self.release()
                await self._resumed.wait()
                self._enter()
        finally:
            gone.cancel()


DISCONNECT_HOOK = "harnessrl.disconnect"  # the request scope's extension holding its `DisconnectHook`


class DisconnectHook:
    """The callbacks to run when the connection of one request closes before its answer is complete;
    the gateway's HTTP protocol (`http.TimedHttpProtocol`) puts one in each request's scope."""

    __slots__ = ("_callbacks", "gone")

    def __init__(self) -> None:
        self.gone = False
        self._callbacks: list[Callable[[], None]] = []

    def add(self, callback: Callable[[], None]) -> None:
        """Run `callback` when the connection closes."""
        self._callbacks.append(callback)

    def remove(self, callback: Callable[[], None]) -> None:
        """Forget `callback`."""
        with contextlib.suppress(ValueError):
            self._callbacks.remove(callback)

    def fire(self) -> None:
        """The connection closed: run the callbacks (once)."""
        if self.gone:
            return
        self.gone = True
        for callback in list(self._callbacks):
            callback()


async def until_disconnect(request: Request) -> None:
    """Return once the client has hung up: with the body read, the server's next ASGI message for the
    request is `http.disconnect` (sent when the connection closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
