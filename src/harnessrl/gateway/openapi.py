"""The gateway's OpenAPI document, generated from its route table (`RouteSpec`s) and the same pydantic
models that validate requests (served at `GET /openapi.json`; the fuzz tests drive the routes from it)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from harnessrl.gateway.http import RouteSpec

_ERRORS = {str(s): {"description": d} for s, d in [
    (400, "invalid request (the message names the field)"), (401, "missing or unknown key"),
    (403, "the key may not do this"), (404, "no such rollout"), (409, "conflicts with the rollout's state"),
    (413, "body too large"), (429, "paused for a weight update; retry after Retry-After seconds"),
    (502, "the engine failed; the call is recorded as failed"),
]}  # fmt: skip
_JSON_OK = {"200": {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}}
_STREAM_OK = {"200": {"description": "OK", "content": {"text/event-stream": {"schema": {"type": "string"}}}}}

# The schema of each path parameter the routes use.
PATH_PARAMS: dict[str, dict[str, Any]] = {
    "rollout_id": {"type": "string", "pattern": "^[a-z0-9]{1,64}$"},
    "attempt": {"type": "integer", "minimum": 0},
    "model_id": {"type": "string", "maxLength": 200},
    "policy": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"},
}
SECURITY_SCHEMES = {
    "rolloutKey": {"type": "http", "scheme": "bearer", "description": "the rollout's API key"},
    "adminKey": {"type": "http", "scheme": "bearer", "description": "the gateway's admin key"},
}
_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")


def openapi_path(path: str) -> str:
    """A Starlette route path as OpenAPI writes it (`{model_id:path}` → `{model_id}`)."""
    return _PARAM.sub(r"{\1}", path)


def _operation(spec: RouteSpec) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": spec.summary,
        "responses": {**(_STREAM_OK if spec.streams else _JSON_OK), **_ERRORS},
    }
    if spec.security is not None:
        op["security"] = [{spec.security: []}]
    if spec.body is not None:
        ref = {"$ref": f"#/components/schemas/{spec.body.__name__}"}
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
    params = [
        {"name": name, "in": "path", "required": True, "schema": PATH_PARAMS[name]}
        for name in _PARAM.findall(spec.path)
    ]
    if params or spec.query:
        op["parameters"] = params + list(spec.query)
    return op


def openapi_document(specs: list[RouteSpec]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the routes `specs`."""
    bodies: dict[str, type[BaseModel]] = {s.body.__name__: s.body for s in specs if s.body is not None}
    _, defs = models_json_schema(
        [(m, "validation") for m in bodies.values()], ref_template="#/components/schemas/{model}"
    )
    paths: dict[str, dict[str, Any]] = {}
    for spec in specs:
        paths.setdefault(openapi_path(spec.path), {})[spec.method.lower()] = _operation(spec)
    return {
        "openapi": "3.1.0",
        "info": {"title": "harnessrl gateway", "version": "1"},
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {}), "securitySchemes": SECURITY_SCHEMES},
    }
