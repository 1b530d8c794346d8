"""SGLang as an upstream: its native `/generate` behind the engine protocol's `/v1/completions`.

The gateway speaks vLLM's wire (a token-ID prompt in, `token_ids` and logprobs out). SGLang's OpenAI
server does not return token IDs, its native `/generate` does, so `SGLangUpstream` translates:

- request: `prompt` (token IDs) -> `input_ids`; temperature, top_p, top_k, max_tokens -> max_new_tokens,
  stop, stop_token_ids, ignore_eos -> `sampling_params`; logprobs always asked for
  (`return_logprob: true`, output positions only);
- answer: `output_ids` -> `token_ids`, `meta_info.output_token_logprobs` ([logprob, id, text] triples)
  -> `logprobs.token_logprobs`, `meta_info.finish_reason` ({"type": "stop", "matched": id | str} or
  {"type": "length"}) -> `finish_reason` + `stop_reason`, `meta_info.weight_version` -> `weight_version`
  when it is an integer; `prompt_token_ids` is the `input_ids` sent;
- streaming: SGLang sends cumulative `text` / `output_ids` / logprob lists by default (deltas with
  `--incremental-streaming-output`); both are turned into vLLM-style delta chunks.

Only token-ID prompts are accepted (use the gateway's `--mode tito`): with a text prompt SGLang does not
report the prompt's token IDs, which the gateway must record. Shapes follow SGLang's `io_struct` and
`schedule_batch.FINISH_*` (see tests/fixtures/sglang for the bodies the tests replay).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from harnessrl.gateway.engine_client.upstream import Upstream, UpstreamClientError, UpstreamFailed

SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_tokens": "max_new_tokens",
                 "stop": "stop", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos"}  # fmt: skip


def generate_body(completions: dict[str, Any], stream: bool = False) -> dict[str, Any]:
    """The `/generate` request for a `/v1/completions` body with a token-ID prompt."""
    prompt = completions.get("prompt")
    if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        raise UpstreamClientError(400, {"error": {"message": "the SGLang upstream needs a token-ID prompt "
                                                             "(run the gateway with --mode tito)"}})  # fmt: skip
    params = {dst: completions[src] for src, dst in SAMPLING_KEYS.items() if completions.get(src) is not None}
    body: dict[str, Any] = {"input_ids": prompt, "sampling_params": params, "return_logprob": True,
                            "logprob_start_len": -1}  # fmt: skip
    if stream:
        body["stream"] = True
    return body


def _finish(meta: dict[str, Any]) -> tuple[str | None, str | int | None]:
    reason = meta.get("finish_reason")
    if reason is None:
        return None, None
    if not isinstance(reason, dict):
        raise UpstreamFailed(f"SGLang sent a finish_reason that is not an object: {reason!r}")
    kind = reason.get("type")
    if kind == "abort":
        raise UpstreamFailed(f"SGLang aborted the request: {reason.get('message', '')}")
    matched = reason.get("matched")
    return str(kind), matched if isinstance(matched, int | str) else None


def _version(meta: dict[str, Any]) -> int | None:
    v = meta.get("weight_version")
    if isinstance(v, int):
        return v
    return int(v) if isinstance(v, str) and v.isdigit() else None  # SGLang's default is "default"


def _logprobs(meta: dict[str, Any]) -> tuple[list[float], list[str]]:
    triples = meta.get("output_token_logprobs") or []
    return [float(t[0]) for t in triples], [str(t[2]) if t[2] is not None else "" for t in triples]


def completion_response(answer: dict[str, Any], prompt: list[int], model: str) -> dict[str, Any]:
    """A vLLM-style `/v1/completions` answer from a non-streamed `/generate` answer."""
    try:
        meta = answer["meta_info"]
        ids = [int(t) for t in answer["output_ids"]]
        lps, tokens = _logprobs(meta)
        finish, stop = _finish(meta)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise UpstreamFailed(f"SGLang answer lacks output_ids or logprobs: {e!r}") from e
    choice = {"index": 0, "text": answer.get("text", ""), "token_ids": ids, "prompt_token_ids": prompt,
              "logprobs": {"tokens": tokens, "token_logprobs": lps}, "finish_reason": finish, "stop_reason": stop}  # fmt: skip
    return {
        "id": f"cmpl-{meta.get('id', '')}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt) + len(ids),
        },
        "weight_version": _version(meta),
    }


async def delta_events(
    events: AsyncIterator[dict[str, Any]], prompt: list[int], model: str, incremental: bool = False
) -> AsyncIterator[dict[str, Any]]:
    """vLLM-style completion chunks from SGLang's stream: cumulative events (SGLang's default) or,
    with `incremental` (its `--incremental-streaming-output`), deltas already."""
    text, ids, n_lps, first = "", 0, 0, True
    async for event in events:
        if "error" in event:
            raise UpstreamFailed(f"SGLang stream error: {event['error']}")
        meta = event.get("meta_info") or {}
        out_ids = [int(t) for t in event.get("output_ids") or []]
        piece = str(event.get("text") or "")
        lps, tokens = _logprobs(meta)
        if not incremental:
            new_ids, new_text = out_ids[ids:], piece[len(text) :]
            new_lps, new_tokens = lps[n_lps:], tokens[n_lps:]
            text, ids, n_lps = piece, len(out_ids), len(lps)
        else:
            new_ids, new_text, new_lps, new_tokens = out_ids, piece, lps, tokens
            text, ids, n_lps = text + piece, ids + len(out_ids), n_lps + len(lps)
        finish, stop = _finish(meta)
        choice: dict[str, Any] = {"index": 0, "text": new_text, "token_ids": new_ids,
                                  "logprobs": {"tokens": new_tokens, "token_logprobs": new_lps},
                                  "finish_reason": finish, "stop_reason": stop}  # fmt: skip
        chunk: dict[str, Any] = {"id": f"cmpl-{meta.get('id', '')}", "object": "text_completion",
                                 "created": int(time.time()), "model": model, "choices": [choice]}  # fmt: skip
        if first:
            choice["prompt_token_ids"], first = prompt, False
        if finish is not None:
            chunk["weight_version"] = _version(meta)
            chunk["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": ids,
                              "total_tokens": len(prompt) + ids}  # fmt: skip
        yield chunk


class SGLangUpstream(Upstream):
    """An SGLang server reached through its native `/generate` (see the module docstring).

    Set `incremental_streaming = True` when the server runs with `--incremental-streaming-output`.
    """

    incremental_streaming = False

    async def post(self, path: str, body: dict[str, Any], deadline: float | None = None) -> dict[str, Any]:
        """`/v1/completions` translated to `/generate`; other routes are not served by this adapter."""
        if path != "/v1/completions":
            raise UpstreamClientError(400, {"error": {"message": f"the SGLang upstream serves only token-ID "
                                                                 f"completions (--mode tito), not {path}"}})  # fmt: skip
        request = generate_body(body)
        answer = await super().post("/generate", request, deadline)
        return completion_response(answer, request["input_ids"], str(body.get("model", "")))

    async def open_stream(
        self, path: str, body: dict[str, Any], deadline: float | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Streamed `/v1/completions` translated to a streamed `/generate`."""
        if path != "/v1/completions":
            raise UpstreamClientError(400, {"error": {"message": f"the SGLang upstream serves only token-ID "
                                                                 f"completions (--mode tito), not {path}"}})  # fmt: skip
        request = generate_body({k: v for k, v in body.items() if k != "stream"})
        events = await super().open_stream("/generate", request, deadline)
        model = str(body.get("model", ""))
        return delta_events(events, request["input_ids"], model, self.incremental_streaming)
