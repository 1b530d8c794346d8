"""The gateway's OpenAPI document, generated from the same pydantic models that validate requests
(served at `GET /openapi.json`; the fuzz tests drive every route from it)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from harnessrl.gateway.control import PauseRequest, ResumeRequest
from harnessrl.gateway.faces.anthropic import MessagesRequest
from harnessrl.gateway.faces.completions import CompletionRequest
from harnessrl.gateway.faces.openai_chat import ChatCompletionRequest
from harnessrl.gateway.faces.responses import ResponsesRequest
from harnessrl.schema import AnnotationIn, AttemptFinish, RewardIn, RolloutCreate, RolloutState, StateChange

_ERRORS = {str(s): {"description": d} for s, d in [
    (400, "invalid request (the message names the field)"), (401, "missing or unknown key"),
    (403, "the key may not do this"), (404, "no such rollout"), (409, "conflicts with the rollout's state"),
    (413, "body too large"), (429, "paused for a weight update; retry after Retry-After seconds"),
    (502, "the engine failed; the call is recorded as failed"),
]}  # fmt: skip
_JSON_OK = {"200": {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}}

BODIES: dict[str, type[BaseModel]] = {
    "ChatCompletionRequest": ChatCompletionRequest,
    "CompletionRequest": CompletionRequest,
    "ResponsesRequest": ResponsesRequest,
    "MessagesRequest": MessagesRequest,
    "RolloutCreate": RolloutCreate,
    "AttemptFinish": AttemptFinish,
    "StateChange": StateChange,
    "RewardIn": RewardIn,
    "AnnotationIn": AnnotationIn,
    "PauseRequest": PauseRequest,
    "ResumeRequest": ResumeRequest,
}


def _op(
    summary: str, body: str | None = None, security: str = "rolloutKey", params: list[Any] | None = None
) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {**_JSON_OK, **_ERRORS},
        "security": [{security: []}],
    }
    if body is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}},
        }
    if params:
        op["parameters"] = params
    return op


def _path_param(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": schema}


ROLLOUT_ID = _path_param("rollout_id", {"type": "string", "pattern": "^[a-z0-9]{1,64}$"})


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the gateway."""
    _, defs = models_json_schema(
        [(m, "validation") for m in BODIES.values()], ref_template="#/components/schemas/{model}"
    )
    schemas = defs.get("$defs", {})
    admin = "adminKey"
    list_params = [
        {
            "name": "state",
            "in": "query",
            "schema": {"type": "string", "enum": [s.value for s in RolloutState]},
        },
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
        {"name": "cursor", "in": "query", "schema": {"type": "string", "pattern": "^[0-9]+$"}},
    ]
    paths: dict[str, Any] = {
        "/v1/chat/completions": {"post": _op("OpenAI chat completions", "ChatCompletionRequest")},
        "/v1/completions": {"post": _op("OpenAI completions", "CompletionRequest")},
        "/v1/responses": {"post": _op("OpenAI Responses", "ResponsesRequest")},
        "/v1/messages": {"post": _op("Anthropic messages", "MessagesRequest")},
        "/v1/messages/count_tokens": {"post": _op("Anthropic: tokens a messages request would take", "MessagesRequest")},
        "/v1/models": {"get": _op("served models")},
        "/v1/models/{model_id}": {"get": _op("one model (any name resolves to the served model)", None,
                                             params=[_path_param("model_id", {"type": "string", "maxLength": 200})])},
        "/v1/harnessrl/reward": {"put": _op("the harness writes its rollout's reward (only if its task allows)", "RewardIn")},
        "/v1/harnessrl/annotations": {"post": _op("the harness annotates one of its calls (data; a step reward only if its task allows)", "AnnotationIn")},
        "/control/rollouts": {
            "post": _op("create a rollout (idempotent by client_id)", "RolloutCreate", admin),
            "get": _op("list rollouts", None, admin, list_params),
        },
        "/control/rollouts/{rollout_id}": {"get": _op("a rollout with its calls", None, admin, [ROLLOUT_ID])},
        "/control/rollouts/{rollout_id}/attempts": {"post": _op("start an attempt", None, admin, [ROLLOUT_ID])},
        "/control/rollouts/{rollout_id}/attempts/{attempt}/finish": {"post": _op(
            "finish an attempt", "AttemptFinish", admin, [ROLLOUT_ID, _path_param("attempt", {"type": "integer", "minimum": 0})]
        )},
        "/control/rollouts/{rollout_id}/state": {"post": _op("change state", "StateChange", admin, [ROLLOUT_ID])},
        "/control/rollouts/{rollout_id}/reward": {"put": _op("write the reward", "RewardIn", admin, [ROLLOUT_ID])},
        "/control/pause": {"post": _op("pause and drain", "PauseRequest", admin)},
        "/control/resume": {"post": _op("resume", "ResumeRequest", admin)},
        "/control/status": {"get": _op("gateway state", None, admin)},
    }  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {"title": "harnessrl gateway", "version": "1"},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "rolloutKey": {"type": "http", "scheme": "bearer", "description": "the rollout's API key"},
                "adminKey": {"type": "http", "scheme": "bearer", "description": "the gateway's admin key"},
            },
        },
    }
