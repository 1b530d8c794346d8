"""The gateway's admission (in flight, pause, hand-over to streams) and its bounded rollout cache, as
units; the HTTP behaviour they carry is tested over loopback in test_gateway.py / test_reliability.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from harnessrl.gateway.access import RolloutCache
from harnessrl.gateway.admission import Admission
from harnessrl.gateway.errors import APIError
from harnessrl.schema import RolloutCreate
from harnessrl.store import SQLiteStore


def test_the_rollout_cache_is_bounded_and_drops_the_least_recently_used(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.sqlite")
    rollouts = [store.create_rollout(RolloutCreate(client_id=f"c{i}", task_id="t"), f"ro{i:04x}")[0]
                for i in range(4)]  # fmt: skip
    cache = RolloutCache(3)
    for r in rollouts[:3]:
        cache.put(r)
    assert cache.get(rollouts[0].rollout_id) is not None  # now the most recently used
    cache.put(rollouts[3])  # full: the least recently used (rollouts[1]) goes
    assert len(cache) == 3
    assert cache.get(rollouts[1].rollout_id) is None
    assert all(cache.get(r.rollout_id) is not None for r in (rollouts[0], rollouts[2], rollouts[3]))
    cache.forget(rollouts[0].rollout_id)
    assert cache.get(rollouts[0].rollout_id) is None and len(cache) == 2
    with pytest.raises(ValueError, match="at least 0"):
        RolloutCache(-1)
    none = RolloutCache(0)  # replicas on a shared store keep nothing: another replica may change it
    none.put(rollouts[0])
    assert none.get(rollouts[0].rollout_id) is None and len(none) == 0


def test_admission_counts_calls_hands_them_to_streams_and_pause_drains_them() -> None:
    async def scenario() -> None:
        adm = Admission(pause_wait_s=0.2)
        async with adm.slot():
            assert adm.in_flight == 1
        assert adm.in_flight == 0
        async with adm.slot() as slot:
            release = slot.hand_over()  # a streamed answer keeps the call in flight
        assert adm.in_flight == 1
        pausing = asyncio.ensure_future(adm.pause(drain_timeout_s=5))
        await asyncio.sleep(0.05)
        assert adm.paused and not pausing.done()  # waits for the stream
        with pytest.raises(APIError) as refused:  # new calls wait pause_wait_s, then 429
            async with adm.slot():
                pass
        assert refused.value.status == 429
        release()
        release()  # once only
        assert await pausing is True and adm.in_flight == 0
        assert await adm.pause(drain_timeout_s=1) is True  # nothing in flight: drained at once
        adm.resume()
        async with adm.slot():
            assert adm.in_flight == 1 and not adm.paused

    asyncio.run(scenario())
