"""The gateway's admission (in flight, pause, hand-over to streams) and its bounded rollout cache, as
units (and the cache's size as a gateway process takes it); the HTTP behaviour they carry is tested over
loopback in test_gateway.py / test_reliability.py."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import httpx
import pytest

from harnessrl.gateway.access import RolloutCache
from harnessrl.gateway.admission import Admission
from harnessrl.gateway.errors import APIError
from harnessrl.schema import RolloutCreate
from harnessrl.services import Service, free_port, start_gateway
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


def test_a_gateway_with_a_one_rollout_cache_reads_the_others_from_its_store(
    engine: Service, tmp_path: Path
) -> None:
    """`gateway.rollout_cache_size` reaches the process: with room for one rollout, calls of three
    interleaved rollouts all go through, and a state change is seen on the next call."""
    admin = "admin-" + secrets.token_hex(8)
    gw = start_gateway(tmp_path / "s.sqlite", engine.url, free_port(), admin, tmp_path, default_max_tokens=2,
                       rollout_cache_size=1)  # fmt: skip
    try:
        gw.wait_healthy(60)
        with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {admin}"}, timeout=60) as c:
            made = [
                c.post("/control/rollouts", json={"client_id": f"k{i}", "task_id": "t"}).json()
                for i in range(3)
            ]
            ids = [m["rollout"]["rollout_id"] for m in made]
            for rid in ids:
                c.post(f"/control/rollouts/{rid}/attempts").raise_for_status()

            def call(i: int) -> httpx.Response:
                body = {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}]}
                return c.post(
                    "/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {made[i]['api_key']}"},
                )

            assert [call(i).status_code for i in (0, 1, 2, 0, 2, 1)] == [200] * 6
            c.post(f"/control/rollouts/{ids[1]}/state", json={"state": "cancelled"}).raise_for_status()
            refused = call(1)
            assert refused.status_code == 409 and "cancelled" in refused.text
            assert call(0).status_code == 200
            counts = [len(c.get(f"/control/rollouts/{rid}").json()["calls"]) for rid in ids]
            assert counts == [3, 2, 2]
    finally:
        gw.stop()


def test_the_gateway_command_names_the_setting_it_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from harnessrl.gateway.__main__ import main

    monkeypatch.setenv("HARNESSRL_ADMIN_KEY", "admin-" + secrets.token_hex(8))
    store = str(tmp_path / "s.sqlite")
    assert main(["--store", store, "--rollout-cache-size", "0"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "error: rollout_cache_size: Input should be greater than or equal to 1"
    )
    assert main(["--store", store, "--upstream-kind", "sglang"]) == 2  # a rule across settings names none
    assert capsys.readouterr().err.startswith("error: upstream_kind 'sglang' needs mode 'tito'")
    assert not (tmp_path / "s.sqlite").exists()  # refused before the store was opened


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
