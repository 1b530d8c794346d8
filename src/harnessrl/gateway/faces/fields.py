"""Fields a request carries that the gateway does not use, and lenient reading of content. Pure functions.

The rule on every face: a field the upstream API defines, or an unknown one, never makes a 400. What
has no meaning for a local model (`thinking`, `context_management`, `store`, `include`, `reasoning`,
`prompt_cache_key`, `metadata`, ...) is ignored for generation, kept in the recorded request, and
reported: the call record lists it under `ignored_fields` and `/metrics` counts it by face and field.
Only a malformed value of a field the gateway uses is a 400.
"""

from __future__ import annotations

from typing import Any

from harnessrl.gateway.errors import APIError


def ignored_fields(body: Any, used: frozenset[str]) -> list[str]:
    """Top-level fields of `body` (set, not null) that the gateway does not use, sorted."""
    if not isinstance(body, dict):
        return []
    return sorted(k for k, v in body.items() if k not in used and v is not None)


def part_text(part: Any, where: str) -> str:
    """The text of one content part or block; a non-text part the model cannot see becomes a
    placeholder such as `[image]` (a malformed text part is a 400)."""
    if isinstance(part, str):
        return part
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise APIError(400, f"{where} must be an object with a string 'type'", param=where)
    kind = part["type"]
    if kind in ("text", "input_text", "output_text"):
        text = part.get("text")
        if not isinstance(text, str):
            raise APIError(400, f"{where}.text must be a string", param=f"{where}.text")
        return text
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return str(part["refusal"])
    name = part.get("filename") or part.get("title")
    return f"[{kind}: {name}]" if isinstance(name, str) and name else f"[{kind}]"


def lenient_content_text(content: Any, where: str) -> str:
    """Flatten message content (a string, null, or a list of parts) into text, leniently."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part_text(p, f"{where}.{i}") for i, p in enumerate(content))
    raise APIError(400, f"{where} must be a string, null or a list of content parts", param=where)


def notes(ignored: list[str], dropped: list[dict[str, str]], **more: Any) -> dict[str, Any]:
    """What a call record says about a request beyond its conversation (only what is non-empty)."""
    out: dict[str, Any] = {}
    if ignored:
        out["ignored_fields"] = ignored
    if dropped:
        out["dropped_tools"] = dropped
    out.update({k: v for k, v in more.items() if v})
    return out
