"""Model listing in both APIs' shapes (`GET /v1/models`, `GET /v1/models/{id}`). Pure functions.

Every model name a client sends is served by the mapped model, so a listing names the served model
and the configured aliases (with several policies, every name that chooses a policy, served by that
policy's adapter), and any id can be retrieved. Anthropic's shape (`type: model`,
`display_name`, `created_at`, `has_more`) is used when the request looks like an Anthropic client's:
an `anthropic-version` header, or the key in `x-api-key` rather than `Authorization: Bearer`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

EPOCH = "1970-01-01T00:00:00Z"


def wants_anthropic(headers: Mapping[str, str]) -> bool:
    """True when the request comes from an Anthropic client."""
    if headers.get("anthropic-version"):
        return True
    return bool(headers.get("x-api-key")) and not headers.get("authorization")


def model_card(name: str, anthropic: bool, served: str) -> dict[str, Any]:
    """One model, as either API describes it (`served`: the model that answers for `name`)."""
    if anthropic:
        return {
            "type": "model",
            "id": name,
            "display_name": f"{name} (served by {served})",
            "created_at": EPOCH,
        }
    return {"id": name, "object": "model", "created": 0, "owned_by": "harnessrl"}


def model_list(names: list[str], anthropic: bool, served: Mapping[str, str]) -> dict[str, Any]:
    """The model listing (`served`: the served model of each name)."""
    data = [model_card(n, anthropic, served[n]) for n in names]
    if anthropic:
        return {"data": data, "has_more": False, "first_id": names[0] if names else None,
                "last_id": names[-1] if names else None}  # fmt: skip
    return {"object": "list", "data": data}
