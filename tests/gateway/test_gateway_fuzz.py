"""Property-based fuzzing of every gateway route from its OpenAPI document (schemathesis): whatever
a client sends, the answer is never a server error, and nothing is recorded half-way."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from harnessrl.gateway.app import gateway_openapi
from harnessrl.schema import CallStatus
from tests.support.gateway import GatewayHandle

# /control/events is a stream that stays open; the /r/{rollout_id}/ routes are the same handlers as /v1/...
schema = schemathesis.openapi.from_dict(gateway_openapi()).exclude(path_regex=r"^/r/|^/control/events$")


@pytest.fixture
def fuzz_gateway(
    make_gateway: Callable[..., GatewayHandle],
) -> Iterator[tuple[GatewayHandle, str, httpx.Client]]:
    gw = make_gateway(pause_wait_s=0.05, max_body_bytes=200_000)
    _, key = gw.new_rollout(sampling={"max_tokens": 2})  # valid model calls stay cheap
    with gw.admin() as admin:  # one client for all of an operation's examples (hundreds with coverage)
        yield gw, key, admin


# Deterministic in the suite (same examples every run); HARNESSRL_FUZZ_EXAMPLES=500 for a deep random run.
_DEEP = int(os.environ.get("HARNESSRL_FUZZ_EXAMPLES", "0"))


@schema.parametrize()
@settings(
    max_examples=_DEEP or 8, derandomize=not _DEEP, deadline=None, suppress_health_check=list(HealthCheck)
)
def test_no_route_answers_with_a_server_error(
    case: schemathesis.Case, fuzz_gateway: tuple[GatewayHandle, str, httpx.Client]
) -> None:
    gw, key, admin = fuzz_gateway
    token = gw.admin_key if case.path.startswith("/control") else key
    response = case.call(base_url=gw.url, headers={"Authorization": f"Bearer {token}"})
    case.validate_response(response, checks=[not_a_server_error])
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = response.json()
        assert ("error" in body) and body["error"]["message"]
    admin.post("/control/resume", json={})  # a fuzzed pause must not starve later examples
    for ro in gw.store.list_rollouts(limit=1000)[0]:
        for call in gw.store.calls(ro.rollout_id):
            complete = call.status == CallStatus.OK and call.response is not None and call.completion_ids
            assert complete or (call.status == CallStatus.FAILED and call.error)
