"""Several policies through the gateway (official OpenAI and Anthropic SDKs, a real engine serving two
LoRA adapters per request, a real SQLite store): the model name a harness sends, or the route
`/p/<name>/v1`, chooses the policy; a name of no policy goes to the first (the default); every call
records its policy and the version of the adapter that served it; an unknown policy route is a 404."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anthropic
import httpx
import pytest
from openai import OpenAI

from harnessrl.engine.server import ServerThread
from tests.support.engine_server import random_adapter_dir, start_server
from tests.support.gateway import GatewayHandle

pytest_plugins = ["tests.support.engine_fixtures"]

POLICIES = {"planner": ["planner", "gpt-4o-planner"], "solver": ["solver"]}


@pytest.fixture(scope="module")
def adapter_engine(engine_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ServerThread:
    server = start_server(engine_tiny_dir, "gateway-policies", lora_adapters=True)
    root = tmp_path_factory.mktemp("adapters")
    for name, version, seed in (("planner", 3, 1), ("solver", 5, 2)):
        path = random_adapter_dir(engine_tiny_dir, root / name, seed)
        r = httpx.post(server.url + "/admin/load_weights",
                       json={"path": str(path), "version": version, "adapter": name}, timeout=60)  # fmt: skip
        r.raise_for_status()
    return server


def _chat(gw: GatewayHandle, key: str, model: str, prefix: str = "") -> None:
    client = OpenAI(base_url=f"{gw.url}{prefix}/v1", api_key=key, max_retries=0)
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)


def test_each_call_is_served_and_recorded_by_its_policy(
    make_gateway: Callable[..., GatewayHandle], adapter_engine: ServerThread
) -> None:
    gw = make_gateway(upstream_url=adapter_engine.url, policies=POLICIES)
    rid, key = gw.new_rollout()
    _chat(gw, key, "planner")
    _chat(gw, key, "solver")
    _chat(gw, key, "gpt-4o-planner")  # another name of the planner
    _chat(gw, key, "gpt-4o")  # no policy's name: the default (the first listed)
    _chat(gw, key, "gpt-4o", prefix="/p/solver")  # the route chooses
    anthropic.Anthropic(base_url=f"{gw.url}/p/solver", api_key=key, max_retries=0).messages.create(
        model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
    )
    calls = gw.store.calls(rid)
    got = [(c.policy, c.model, c.weight_version) for c in calls]
    assert got == [("planner", "planner", 3), ("solver", "solver", 5), ("planner", "planner", 3),
                   ("planner", "planner", 3), ("solver", "solver", 5), ("solver", "solver", 5)]  # fmt: skip
    assert all(c.status == "ok" and c.completion_ids for c in calls)


def test_an_unknown_policy_route_is_a_clear_404(
    make_gateway: Callable[..., GatewayHandle], adapter_engine: ServerThread
) -> None:
    gw = make_gateway(upstream_url=adapter_engine.url, policies=POLICIES)
    _, key = gw.new_rollout()
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{gw.url}/p/coder/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert r.status_code == 404 and "no policy 'coder'" in r.text and "planner, solver" in r.text
    plain = make_gateway(upstream_url=adapter_engine.url)  # a gateway without policies
    rid, key = plain.new_rollout()
    r = httpx.post(f"{plain.url}/p/coder/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert r.status_code == 404 and "serves no policies" in r.text
    _chat(plain, key, "planner")  # without policies a name is just a name: the base serves it
    (call,) = plain.store.calls(rid)
    assert call.policy is None and call.weight_version == 0


def test_policy_names_are_checked() -> None:
    from pydantic import ValidationError

    from harnessrl.gateway.state import GatewayConfig

    with pytest.raises(ValidationError, match="not a valid policy name"):
        GatewayConfig(admin_key="k" * 8, policies={"../x": ["../x"]})


def test_models_lists_every_name_that_chooses_a_policy(
    make_gateway: Callable[..., GatewayHandle], adapter_engine: ServerThread
) -> None:
    gw = make_gateway(upstream_url=adapter_engine.url, policies=POLICIES)
    _, key = gw.new_rollout()
    client = OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    names = [m.id for m in client.models.list()]
    assert {"planner", "gpt-4o-planner", "solver"} <= set(names)
    assert client.models.retrieve("solver").id == "solver"
    routed = OpenAI(base_url=f"{gw.url}/p/solver/v1", api_key=key, max_retries=0)
    assert [m.id for m in routed.models.list()] == names
    listing = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0).models.list()
    shown = {m.id: m.display_name for m in listing.data}
    assert shown["gpt-4o-planner"] == "gpt-4o-planner (served by planner)"
    assert shown["solver"] == "solver (served by solver)"
    r = httpx.get(f"{gw.url}/p/coder/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 404 and "no policy 'coder'" in r.text
    plain = make_gateway(upstream_url=adapter_engine.url)  # without policies: no policy names
    _, key = plain.new_rollout()
    plain_names = [m.id for m in OpenAI(base_url=f"{plain.url}/v1", api_key=key, max_retries=0).models.list()]
    assert "planner" not in plain_names
