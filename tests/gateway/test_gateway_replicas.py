"""Replicated gateways: two real gateway processes on one real PostgreSQL database in front of a real
engine, driven by `GatewayReplicas` (spread, stick, fail over, pause/resume everywhere)."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from harnessrl.config import load_config
from harnessrl.errors import ConfigError
from harnessrl.gateway.replicas import GatewayReplicas, rendezvous
from harnessrl.schema import AttemptFinish, AttemptStatus, RolloutCreate, RolloutState
from harnessrl.services import Service, free_port, start_gateway


def test_rendezvous_spreads_keys_and_moves_only_the_removed_replicas_keys() -> None:
    urls = ["http://a", "http://b", "http://c"]
    keys = [f"ro{i:04d}" for i in range(3000)]
    first = {k: urls[rendezvous(k, urls)[0]] for k in keys}
    counts = Counter(first.values())
    assert all(900 < counts[u] < 1100 for u in urls), counts
    without_b = [u for u in urls if u != "http://b"]
    after = {k: without_b[rendezvous(k, without_b)[0]] for k in keys}
    moved = [k for k in keys if first[k] != after[k]]
    assert moved and all(first[k] == "http://b" for k in moved)


def test_replicas_need_a_postgres_store() -> None:
    with pytest.raises(ConfigError, match=r"gateway\.replicas=2 needs a store every replica writes"):
        load_config(None, ["gateway.replicas=2"])
    assert (
        load_config(None, ["gateway.replicas=2", "store=postgresql://u@127.0.0.1:1/db"]).gateway.replicas == 2
    )


def test_running_gateways_by_url_need_their_admin_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from harnessrl.services.stack import external_admin_key

    with pytest.raises(ConfigError, match="set one"):
        load_config(None, ["gateway.replicas=2", "store=postgresql://u@h/db", "gateway.urls=[http://a:1]"])
    with pytest.raises(ConfigError, match="not an http"):
        load_config(None, ["gateway.urls=[gateway-0:8000]"])
    cfg = load_config(None, ["gateway.urls=[http://gateway-0.gw:8000, http://gateway-1.gw:8000]"])
    monkeypatch.delenv("HARNESSRL_ADMIN_KEY", raising=False)
    with pytest.raises(ConfigError, match="HARNESSRL_ADMIN_KEY"):
        external_admin_key(cfg)
    monkeypatch.setenv("HARNESSRL_ADMIN_KEY", "k" * 16)
    assert external_admin_key(cfg) == "k" * 16
    assert external_admin_key(load_config(None, [])) is None  # the run starts its own, with a fresh key


def test_running_gateways_by_url_need_the_engine_key_of_the_engine_the_run_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from harnessrl.services.stack import run_engine_key

    # gateways the run did not start, in front of the builtin engine, which the run starts
    cfg = load_config(None, ["gateway.urls=[http://gateway-0.gw:8000]"])
    monkeypatch.delenv("HARNESSRL_ENGINE_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"gateway\.urls: set HARNESSRL_ENGINE_KEY"):
        run_engine_key(cfg)
    own = load_config(None, [])
    first, second = run_engine_key(own), run_engine_key(own)
    assert first and second and first != second  # its own gateways: a fresh key per run
    assert run_engine_key(load_config(None, ["engine.kind=vllm", "engine.url=http://vllm:8000"])) is None
    monkeypatch.setenv("HARNESSRL_ENGINE_KEY", "e" * 16)
    assert run_engine_key(cfg) == "e" * 16  # the key the gateways were started with
    assert run_engine_key(own) != "e" * 16
    assert run_engine_key(load_config(None, ["engine.kind=vllm", "engine.url=http://vllm:8000"])) == "e" * 16


class Replicas:
    """Two gateway processes on one PostgreSQL database; `restart(i)` starts replica i again on its port."""

    def __init__(self, pg_url: str, engine_url: str, log_dir: Path) -> None:
        self.pg_url, self.engine_url, self.log_dir = pg_url, engine_url, log_dir
        self.admin_key = secrets.token_hex(16)
        self.ports = [free_port(), free_port()]
        self.procs: list[Service] = [self._start(i) for i in range(2)]
        for p in self.procs:
            p.wait_healthy(60)

    def _start(self, i: int) -> Service:
        return start_gateway(self.pg_url, self.engine_url, self.ports[i], self.admin_key, self.log_dir, 16,
                             name=f"gateway{i}")  # fmt: skip

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.procs]

    def kill(self, i: int) -> None:
        os.kill(self.procs[i].proc.pid, signal.SIGKILL)
        self.procs[i].proc.wait()

    def restart(self, i: int) -> None:
        self.procs[i] = self._start(i)
        self.procs[i].wait_healthy(60)

    def status(self, i: int) -> dict[str, object]:
        r = httpx.get(f"{self.urls[i]}/control/status", headers={"Authorization": f"Bearer {self.admin_key}"})
        r.raise_for_status()
        data: dict[str, object] = r.json()
        return data

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


@pytest.fixture
def replicas(pg_url: str, engine: Service, tmp_path: Path) -> Iterator[Replicas]:
    r = Replicas(pg_url, engine.url, tmp_path / "logs")
    try:
        yield r
    finally:
        r.stop()


async def _chat(url: str, key: str, text: str) -> str:
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as oai:
        out = await oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": text}], max_tokens=4
        )
    return out.id


async def test_rollouts_spread_stick_and_any_replica_takes_any_key(replicas: Replicas) -> None:
    client = GatewayReplicas(replicas.urls, replicas.admin_key)
    try:
        created = [
            await client.create_rollout(RolloutCreate(client_id=f"c{i}", task_id="t")) for i in range(12)
        ]
        homes = Counter(client.model_url(c.rollout.rollout_id) for c in created)
        assert set(homes) == set(replicas.urls), homes  # both replicas serve rollouts
        c = created[0]
        rid = c.rollout.rollout_id
        await client.start_attempt(rid)
        # the key was issued by whichever replica created the rollout; both accept it
        for url in replicas.urls:
            await _chat(url, c.api_key, f"hello from {url}")
        detail = await client.rollout(rid)
        assert [call.status.value for call in detail.calls] == ["ok", "ok"]
        assert {call.attempt for call in detail.calls} == {0}
        # a new attempt opened through one replica is seen by the other at once (no stale cache)
        await client.finish_attempt(rid, 0, AttemptFinish(status=AttemptStatus.EXITED, exit_code=0))
        await client.set_state(rid, RolloutState.QUEUED)
        await client.start_attempt(rid)
        other = next(u for u in replicas.urls if u != client.model_url(rid))
        await _chat(other, c.api_key, "second attempt")
        assert (await client.rollout(rid)).calls[-1].attempt == 1
        # a rollout finished through one replica is refused by both
        await client.set_state(rid, RolloutState.SUCCEEDED)
        for url in replicas.urls:
            async with AsyncOpenAI(base_url=f"{url}/v1", api_key=c.api_key, max_retries=0) as oai:
                with pytest.raises(Exception, match="409"):
                    await oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    finally:
        await client.aclose()


async def test_pause_and_weight_version_reach_every_replica(replicas: Replicas) -> None:
    client = GatewayReplicas(replicas.urls, replicas.admin_key)
    try:
        paused = await client.pause(drain_timeout_s=5)
        assert paused["paused"] and paused["drained"] and paused["replicas"] == 2
        assert [replicas.status(i)["paused"] for i in range(2)] == [True, True]
        resumed = await client.resume(weight_version=3)
        assert resumed["replicas"] == 2 and resumed["unreachable"] == []
        # the version each records for calls whose engine reports none (vLLM)
        assert [replicas.status(i)["weight_version"] for i in range(2)] == [3, 3]
    finally:
        await client.aclose()


async def test_a_killed_replica_fails_over_and_catches_up_when_it_returns(replicas: Replicas) -> None:
    client = GatewayReplicas(replicas.urls, replicas.admin_key, retry_down_s=0.5)
    try:
        created = [
            await client.create_rollout(RolloutCreate(client_id=f"k{i}", task_id="t")) for i in range(12)
        ]
        on_0 = [c for c in created if client.model_url(c.rollout.rollout_id) == replicas.urls[0]]
        assert on_0
        rid = on_0[0].rollout.rollout_id
        await client.start_attempt(rid)
        await _chat(replicas.urls[0], on_0[0].api_key, "before the kill")
        replicas.kill(0)
        assert await client.lost(replicas.urls[0])  # the attempt running there is void
        await client.finish_attempt(
            rid, 0, AttemptFinish(status=AttemptStatus.INFRA_ERROR, error="replica died")
        )
        assert client.model_url(rid) == replicas.urls[1]  # moved
        await client.set_state(rid, RolloutState.QUEUED)
        attempt = await client.start_attempt(rid)
        assert attempt.attempt == 1
        await _chat(client.model_url(rid), on_0[0].api_key, "after the kill")
        detail = await client.rollout(rid)
        assert [(c.attempt, c.status.value) for c in detail.calls] == [(0, "ok"), (1, "ok")]
        # pause and resume while replica 0 is down: reported, and it is brought up to date on return
        paused = await client.pause(drain_timeout_s=5)
        assert paused["replicas"] == 1 and paused["unreachable"] == [replicas.urls[0]]
        replicas.restart(0)
        assert replicas.status(0)["paused"] is True  # a restarted replica reads the pause from the store
        await asyncio.sleep(0.6)
        await client.rollout(rid)  # any request after retry_down_s probes and catches up the replica
        assert replicas.status(0)["paused"] is True
        await client.resume(weight_version=7)
        assert [replicas.status(i)["weight_version"] for i in range(2)] == [7, 7]
        assert client.model_url(rid) == replicas.urls[1]  # a moved rollout stays where it moved
        new = await client.create_rollout(RolloutCreate(client_id="after-return", task_id="t"))
        assert new.created
        assert client.failovers >= 1
    finally:
        await client.aclose()


async def test_the_event_stream_continues_on_another_replica(replicas: Replicas) -> None:
    client = GatewayReplicas(replicas.urls, replicas.admin_key, retry_down_s=60)
    seen: list[int] = []
    try:
        await client.create_rollout(RolloutCreate(client_id="e0", task_id="t"))

        async def listen() -> None:
            async for ev in client.events(after=0):
                seen.append(ev.seq)
                if len(seen) == 3:
                    return

        task = asyncio.create_task(listen())
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.05)
        first = replicas.urls.index(client.clients[client._order("events")[0]].base_url)
        replicas.kill(first)
        await asyncio.sleep(0.3)
        other = GatewayReplicas([replicas.urls[1 - first]], replicas.admin_key)
        try:
            await other.create_rollout(RolloutCreate(client_id="e1", task_id="t"))
            await other.create_rollout(RolloutCreate(client_id="e2", task_id="t"))
        finally:
            await other.aclose()
        await asyncio.wait_for(task, timeout=30)
        assert len(seen) == 3 and seen == sorted(set(seen))  # no event twice, none out of order
    finally:
        await client.aclose()
