"""Group commit of calls: handlers hand their call to one writer thread and wait; the thread writes
whatever has queued up in one transaction. The answer still goes out only after the commit, and the
event loop never blocks on the database."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from harnessrl.schema import Call
from harnessrl.store import Store

log = logging.getLogger(__name__)

_STOP = object()


class CallWriter:
    """A writer thread that commits queued calls in batches of up to `max_batch`."""

    def __init__(self, store: Store, max_batch: int = 256) -> None:
        self.store = store
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="call-writer", daemon=True)
        self._thread.start()

    async def write(self, call: Call) -> Call:
        """Queue `call` and return once it is committed (with its index assigned)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Call] = loop.create_future()
        self._queue.put((call, done, loop))
        return await done

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    self._commit(batch)
                    return
                batch.append(nxt)
            self._commit(batch)

    def _commit(self, batch: list[object]) -> None:
        entries = [b for b in batch if isinstance(b, tuple)]
        try:
            stored = self.store.add_calls([c for c, _, _ in entries])
        except Exception as e:  # each waiting handler gets the error
            log.exception("call_write_failed batch=%d", len(entries))
            for _, fut, loop in entries:
                loop.call_soon_threadsafe(_set_exception, fut, e)
            return
        for (_, fut, loop), call in zip(entries, stored, strict=True):
            loop.call_soon_threadsafe(_set_result, fut, call)

    def close(self) -> None:
        """Write what is queued and stop the thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout=30)


def _set_result(fut: asyncio.Future[Call], call: Call) -> None:
    if not fut.done():
        fut.set_result(call)


def _set_exception(fut: asyncio.Future[Call], e: Exception) -> None:
    if not fut.done():
        fut.set_exception(e)
