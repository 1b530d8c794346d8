"""Errors in the shape OpenAI clients understand: `{"error": {"message", "type", "param", "code"}}`,
or Anthropic's `{"type": "error", "error": {"type", "message"}}`; and the gateway's log of the errors
it answers with (`event=http_error`, rate-limited)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse

M = TypeVar("M", bound=BaseModel)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
}


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    502: "api_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """An error that becomes an HTTP response with a clear message."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def response(self, style: str = "openai") -> JSONResponse:
        """The error as a JSON response in OpenAI's shape, or Anthropic's when `style` is "anthropic"."""
        if style == "anthropic":
            kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
            return JSONResponse(
                {"type": "error", "error": {"type": kind, "message": self.message}},
                status_code=self.status,
                headers=self.headers,
            )
        body = {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "api_error"),
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def from_validation_error(err: ValidationError, prefix: str = "") -> APIError:
    """Turn a pydantic validation error into a 400 naming the first offending field."""
    first: Any = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    param = f"{prefix}{loc}" if loc else prefix.rstrip(".") or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        msg = "unknown field"
    n = len(err.errors())
    more = f" (and {n - 1} more problem{'s' if n > 2 else ''})" if n > 1 else ""
    return APIError(
        400, f"{param}: {msg}{more}" if param else f"{msg}{more}", param=param, code="invalid_value"
    )


def validate(model: type[M], body: Any) -> M:
    """`model.model_validate(body)`, a validation error becoming the 400 of `from_validation_error`."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def context_too_long(prompt_tokens: int, context: int, style: str, param: str = "messages") -> APIError:
    """The 400 for a prompt that leaves no room for output, worded as the API of `style` words it
    (Anthropic: "prompt is too long: N tokens > M maximum"; OpenAI: code `context_length_exceeded`)."""
    if style == "anthropic":
        return APIError(
            400, f"prompt is too long: {prompt_tokens} tokens > {context - 1} maximum", param=param
        )
    return APIError(
        400,
        f"This model's maximum context length is {context} tokens. However, your messages resulted in "
        f"{prompt_tokens} tokens. Please reduce the length of the messages.",
        param=param,
        code="context_length_exceeded",
    )


class ErrorLog:
    """Logs each error answer with its reason as `event=http_error`, at most one line per
    (path, status, reason) every `window_s` seconds; the next line says how many were suppressed."""

    def __init__(self, logger: logging.Logger, window_s: float = 5.0, max_keys: int = 10_000) -> None:
        self.log = logger
        self.window_s = window_s
        self.max_keys = max_keys
        self._last: dict[tuple[str, int, str], tuple[float, int]] = {}  # key -> (last logged, suppressed)
        self._lock = threading.Lock()

    def report(self, method: str, path: str, status: int, reason: str) -> bool:
        """Log one error answer unless an identical one was logged within the window; True if logged."""
        key = (path, status, reason)
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._last.get(key, (float("-inf"), 0))
            if now - last < self.window_s:
                self._last[key] = (last, suppressed + 1)
                return False
            if len(self._last) >= self.max_keys:
                self._last.clear()
            self._last[key] = (now, 0)
        level = logging.ERROR if status >= 500 else logging.WARNING
        self.log.log(level, "event=http_error method=%s path=%s status=%d reason=%r suppressed=%d",
                     method, path, status, reason, suppressed)  # fmt: skip
        return True
