"""Several policies through the trainer (trainer/policies.py), with real parts: a tiny model, the builtin
engine serving two adapters per request, the gateway over a SQLite store, the OpenAI SDK. A planner and
a solver call per rollout, one reward per rollout: the batch's rows are split by policy, a step trains
both adapters, an update on policy A's rows never changes policy B's adapter (nor gives it optimizer
state), and after the weight sync every call records its adapter's new version, served with the
trainer's logprobs."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import torch
from openai import OpenAI

from harnessrl.adapter import build_batch
from harnessrl.gateway.app import GatewayConfig, create_app
from harnessrl.modeling.loading import load_model
from harnessrl.modeling.lora import LoraSpec, attach
from harnessrl.schema import RewardIn, RolloutCreate, RolloutState
from harnessrl.store import SQLiteStore
from harnessrl.trainer.policies import PolicyState, only, policies_update, publish_policies
from harnessrl.trainer.ppo import PPOConfig
from harnessrl.trainer.weights import EngineAdmin
from tests.support.engine_server import full_forward_logprobs, start_server
from tests.support.gateway import ThreadServer

pytest_plugins = ["tests.support.engine_fixtures"]

NAMES = ("planner", "solver")


def _policies(model: torch.nn.Module, model_dir: Path) -> dict[str, PolicyState]:
    out = {}
    for i, name in enumerate(NAMES):
        adapter = attach(model, LoraSpec(r=4, alpha=8.0), seed=i, base_model=str(model_dir))
        adapter.enabled = False
        out[name] = PolicyState(name, adapter, torch.optim.AdamW(adapter.parameters(), lr=5e-2))
    return out


def _snapshot(p: PolicyState) -> list[torch.Tensor]:
    return [t.detach().clone() for t in p.adapter.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _rollout(store: SQLiteStore, client: OpenAI, rid: str, reward: float) -> None:
    """One rollout: a planner call writes a plan, a solver call follows it; then graded."""
    plan = client.chat.completions.create(
        model="planner", messages=[{"role": "user", "content": "Plan: 2+3?"}], max_tokens=6, temperature=1.0
    )
    client.chat.completions.create(
        model="solver", max_tokens=6, temperature=1.0,
        messages=[{"role": "user", "content": f"Follow the plan: {plan.choices[0].message.content}"}],
    )  # fmt: skip
    store.set_reward(rid, RewardIn(value=reward))
    store.set_state(rid, RolloutState.SUCCEEDED)


def test_a_step_trains_each_policy_into_its_own_adapter(engine_tiny_dir: Path, tmp_path: Path) -> None:
    engine = start_server(engine_tiny_dir, "trainer-policies", lora_adapters=True)
    model = load_model(engine_tiny_dir)
    policies = _policies(model, engine_tiny_dir)
    asyncio.run(_publish(policies, engine.url, tmp_path / "weights", 0))
    store = SQLiteStore(tmp_path / "store.sqlite")
    cfg = GatewayConfig(admin_key=secrets.token_hex(8), upstream_url=engine.url,
                        policies={n: [n] for n in NAMES})  # fmt: skip
    with ThreadServer(create_app(cfg, store)) as gw:
        rids = []
        for i, reward in enumerate((1.0, 0.0, 0.5)):
            rid = f"r{i}"
            store.create_rollout(RolloutCreate(client_id=rid, task_id="t", group_id="g"), rid)
            store.start_attempt(rid)
            key = _key(gw.url, cfg.admin_key, rid)
            _rollout(store, OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0), rid, reward)
            rids.append(rid)
        batch = build_batch([store.detail(r) for r in rids])
        by_policy = batch.policy_rows()
        assert sorted(by_policy) == sorted(NAMES) and all(len(ix) == 3 for ix in by_policy.values())
        assert all(v == 0 for r in batch.rows for v in r.weight_versions)

        # an update on the planner's rows alone: the solver's adapter is untouched, bit for bit
        before = {n: _snapshot(p) for n, p in policies.items()}
        planner_only = batch.select(by_policy["planner"])
        policies_update(model, {"planner": policies["planner"]}, planner_only, PPOConfig())
        assert not _same(before["planner"], _snapshot(policies["planner"]))
        assert _same(before["solver"], _snapshot(policies["solver"]))
        assert not policies["solver"].optimizer.state  # no moments for the other policy either
        # a step on the whole batch trains both
        mid = {n: _snapshot(p) for n, p in policies.items()}
        metrics = policies_update(model, policies, batch, PPOConfig())
        assert all(not _same(mid[n], _snapshot(policies[n])) for n in NAMES)
        assert metrics["policies"]["solver"]["rows"] == 3 and metrics["rows_of_no_policy"] == 0

        asyncio.run(_publish(policies, engine.url, tmp_path / "weights", 1))
        rid = "after"
        store.create_rollout(RolloutCreate(client_id=rid, task_id="t"), rid)
        store.start_attempt(rid)
        _rollout(store, OpenAI(base_url=f"{gw.url}/v1", api_key=_key(gw.url, cfg.admin_key, rid),
                               max_retries=0), rid, 1.0)  # fmt: skip
    calls = store.calls(rid)
    assert [(c.policy, c.weight_version) for c in calls] == [("planner", 1), ("solver", 1)]
    for call in calls:  # each call was served by its own trained adapter
        only(policies, call.policy)
        ref = full_forward_logprobs(model, call.prompt_ids, call.completion_ids, 1.0)
        gap = float((torch.tensor(call.completion_logprobs) - ref).abs().max())
        assert gap < 1e-4, (call.policy, gap)
    only(policies, None)


async def _publish(policies: dict[str, PolicyState], url: str, weights: Path, version: int) -> None:
    admin = EngineAdmin(url)
    try:
        await publish_policies(policies, admin, weights, version)
    finally:
        await admin.aclose()


def _key(url: str, admin_key: str, rid: str) -> str:
    """The rollout's API key, as the control API hands it out (create is idempotent by client id)."""
    import httpx

    r = httpx.post(f"{url}/control/rollouts", json={"client_id": rid, "task_id": "t"},
                   headers={"Authorization": f"Bearer {admin_key}"})  # fmt: skip
    r.raise_for_status()
    return str(r.json()["api_key"])
