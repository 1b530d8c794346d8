"""A harness's `seed`: forwarded to the engine by default; with `forward_seed` off (the run sets it for
vLLM, whose CPU engine core dies under many concurrent seeded requests) it is dropped, and the call's
record says so."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from openai import OpenAI

from tests.support.gateway import GatewayHandle


def _chat(gw: GatewayHandle, key: str, **extra: object) -> None:
    client = OpenAI(base_url=f"{gw.url}/v1", api_key=key, http_client=httpx.Client(timeout=60))
    client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2, **extra
    )  # type: ignore[call-overload]


def test_a_seed_is_dropped_and_noted_only_when_the_gateway_does_not_forward_seeds(
    make_gateway: Callable[..., GatewayHandle],
) -> None:
    keeps, drops = make_gateway(), make_gateway(forward_seed=False)
    for gw in (keeps, drops):
        rid, key = gw.new_rollout()
        _chat(gw, key, seed=1234)
        _chat(gw, key)
        seeded, plain = gw.store.calls(rid)
        assert seeded.status == plain.status == "ok" and seeded.request["seed"] == 1234
        assert "seed_dropped" not in plain.chat
        if gw is drops:
            assert seeded.chat["seed_dropped"] == 1234
            with gw.admin() as c:
                assert "harnessrl_gateway_seeds_dropped_total 1\n" in c.get("/metrics").text
        else:
            assert "seed_dropped" not in seeded.chat
