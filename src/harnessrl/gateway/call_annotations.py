"""The harness annotates its own calls with its rollout key: `POST /v1/harnessrl/annotations`.

An annotation names one call of the rollout (`call`: its position among the attempt's calls, or
`tool_call_id`: a tool call its answer made) and carries a `label`, an optional `value` and `details`.
It is data: stored beside the rollout, shown by inspect, exported. Its `value` counts as a step reward
only when the rollout's task says `allow_annotation_rewards` (see `adapter.step_credit`); the gateway
stores it either way, since whether it is a reward is decided when rows are built, not here.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from harnessrl.gateway.errors import APIError, validate
from harnessrl.gateway.http import read_json
from harnessrl.gateway.state import Gateway
from harnessrl.schema import AnnotationIn

MAX_ANNOTATIONS = 10_000  # per rollout: a harness that writes more is refused with a 409


async def annotate(gw: Gateway, request: Request) -> Response:
    """Store one annotation of the rollout whose key (or `/r/{rollout_id}/` path) the request carries."""
    rollout = gw.rollout_for(request, request.path_params.get("rollout_id"))
    body = validate(AnnotationIn, await read_json(request, gw.config.max_body_bytes))
    if body.call is not None:
        made = gw.store.count_calls(rollout.rollout_id)
        if body.call >= made:
            which = f"one of 0..{made - 1}" if made else "a call once it has made one"
            raise APIError(400, f"call: this rollout has made {made} calls; annotate {which}")
    if len(gw.store.annotations(rollout.rollout_id)) >= MAX_ANNOTATIONS:
        raise APIError(409, f"this rollout already has {MAX_ANNOTATIONS} annotations (the limit)")
    stored = gw.store.add_annotation(rollout.rollout_id, body)
    return JSONResponse(stored.model_dump(mode="json", exclude_defaults=True) | {"seq": stored.seq})
