"""A corpus of bad input for the gateway: nesting, sizes, types, encodings, cross-API bodies, slow
clients and disconnects, each sent as raw bytes over loopback. What counts is that none is answered
with a 5xx (or a stream cut without an error event), that the gateway logs no unhandled error, and
that every rollout stays readable afterwards."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bench.reliability.client import Gateway

CHAT, MSGS, RESP, COMP = "/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions"


@dataclass
class Case:
    """One request: raw body bytes to `path` with the rollout key (`auth="admin"`: the admin key)."""

    category: str
    name: str
    method: str = "POST"
    path: str = CHAT
    body: bytes = b""
    auth: str = "rollout"
    headers: str = "Content-Type: application/json\r\n"
    chunked: bool = False
    raw: Callable[[Gateway, str], Awaitable[str]] | None = None  # a socket-level case: its outcome


def j(value: Any) -> bytes:
    return json.dumps(value).encode()


HOLE = "__deep_value_here__"


def deep_bytes(depth: int, kind: str = "object") -> bytes:
    """A JSON value `depth` objects (or arrays of ints) deep, as text."""
    if kind == "object":
        return b'{"k":' * depth + b'"x"' + b"}" * depth
    return b"[" * depth + b"1" + b"]" * depth


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def anth(**extra: Any) -> dict[str, Any]:
    return {"model": "claude", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}


def nesting_cases() -> list[Case]:
    """Deep values in every field that takes arbitrary JSON, on every route that stores it."""
    targets: list[tuple[str, str, str, Callable[[Any], Any]]] = [
        ("chat.metadata", CHAT, "rollout", lambda v: chat(metadata=v)),
        ("chat.tool_parameters", CHAT, "rollout",
         lambda v: chat(tools=[{"type": "function", "function": {"name": "f", "parameters": v}}])),
        ("chat.content_list", CHAT, "rollout", lambda v: chat(messages=[{"role": "user", "content": [v]}])),
        ("anthropic.metadata", MSGS, "rollout", lambda v: anth(metadata=v)),
        ("anthropic.input_schema", MSGS, "rollout",
         lambda v: anth(tools=[{"name": "f", "input_schema": {"type": "object", "properties": {"a": v}}}])),
        ("responses.metadata", RESP, "rollout", lambda v: {"model": "m", "input": "hi", "metadata": v}),
        ("completions.prompt", COMP, "rollout", lambda v: {"model": "m", "prompt": v, "max_tokens": 2}),
        ("control.metadata", "/control/rollouts", "admin", lambda v: {"client_id": "deep", "task_id": "t", "metadata": v}),
        ("control.reward_details", "/control/rollouts/{rid}/reward", "admin", lambda v: {"value": 1.0, "details": v}),
    ]  # fmt: skip
    cases = []
    for name, path, auth, make in targets:
        method = "PUT" if path.endswith("/reward") else "POST"
        for depth in (10, 63, 65, 100, 199, 201, 254, 256, 1000, 5000):
            deep = deep_bytes(depth, "array" if name == "completions.prompt" else "object")
            body = j(make(HOLE)).replace(j(HOLE), deep)  # built as text: too deep for json.dumps
            cases.append(Case("nesting", f"{name}@{depth}", method, path, body, auth))
    for depth in (100, 1000, 100_000):
        cases.append(Case("nesting", f"body_array@{depth}", body=b"[" * depth + b"]" * depth))
    return cases


def size_cases() -> list[Case]:
    """Bodies at and over the limits, declared and streamed."""
    big = "x" * (8 * 2**20 - 200)
    messages = [{"role": "user", "content": f"m{i}"} for i in range(100_000)]
    return [
        Case("sizes", "8MiB_content", body=j(chat(messages=[{"role": "user", "content": big}]))),
        Case("sizes", "9MiB_declared", body=j(chat(messages=[{"role": "user", "content": big + "x" * 2**20}]))),
        Case("sizes", "9MiB_chunked", body=j(chat(messages=[{"role": "user", "content": big + "x" * 2**20}])), chunked=True),
        Case("sizes", "100k_messages", body=j(chat(messages=messages))),
        Case("sizes", "100k_messages_anthropic", path=MSGS, body=j(anth(messages=messages))),
        Case("sizes", "19k_messages", body=j(chat(messages=messages[:19_000]))),
        Case("sizes", "300k_token_prompt", path=COMP, body=j({"model": "m", "prompt": [1] * 300_000})),
        Case("sizes", "50k_tools", body=j(chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(50_000)]))),
        Case("sizes", "10k_stop", body=j(chat(stop=["s"] * 10_000))),
        Case("sizes", "1MiB_key", body=j({**chat(), "k" * 2**20: 1})),
        Case("sizes", "max_tokens_1e12", body=j(chat(max_tokens=10**12))),
        Case("sizes", "n_1000", body=j(chat(n=1000))),
        Case("sizes", "200k_values_list", body=j(chat(metadata={"v": [0] * 200_000}))),
        Case("sizes", "long_model_name", body=j(chat(model="m" * 2**20))),
        Case("sizes", "stream_big", body=j(chat(stream=True, messages=[{"role": "user", "content": "y" * 2**20}]))),
    ]  # fmt: skip


def type_cases() -> list[Case]:
    """Wrong types and values for each field of each API."""
    chat_bad: dict[str, Any] = {
        "messages_str": {"messages": "hi"}, "messages_null": {"messages": None}, "messages_dict": {"messages": {}},
        "messages_empty": {"messages": []}, "messages_ints": {"messages": [1, 2]}, "role_int": {"messages": [{"role": 1, "content": "x"}]},
        "role_unknown": {"messages": [{"role": "wizard", "content": "x"}]}, "content_int": {"messages": [{"role": "user", "content": 5}]},
        "content_dict": {"messages": [{"role": "user", "content": {"a": 1}}]}, "content_parts_bad": {"messages": [{"role": "user", "content": [{"type": "nope"}]}]},
        "model_list": {"model": ["m"]}, "model_null": {"model": None}, "max_tokens_neg": {"max_tokens": -1}, "max_tokens_zero": {"max_tokens": 0},
        "max_tokens_str": {"max_tokens": "10"}, "max_tokens_float": {"max_tokens": 1.5}, "max_tokens_bool": {"max_tokens": True},
        "temperature_neg": {"temperature": -1}, "temperature_huge": {"temperature": 1e300}, "temperature_str": {"temperature": "hot"},
        "top_p_2": {"top_p": 2}, "stream_str": {"stream": "yes"}, "tools_dict": {"tools": {"a": 1}}, "tools_ints": {"tools": [1]},
        "tool_choice_int": {"tool_choice": 3}, "stop_int": {"stop": 5}, "seed_str": {"seed": "x"}, "seed_huge": {"seed": 2**70},
        "logprobs_str": {"logprobs": "yes"}, "top_logprobs_100": {"top_logprobs": 100}, "stream_options_str": {"stream": True, "stream_options": "x"},
        "assistant_tool_calls_bad": {"messages": [{"role": "assistant", "tool_calls": [{"id": 1}]}, {"role": "user", "content": "x"}]},
        "tool_msg_no_id": {"messages": [{"role": "tool", "content": "x"}]}, "response_format_bad": {"response_format": {"type": "nope"}},
    }  # fmt: skip
    anth_bad: dict[str, Any] = {
        "no_messages": {"messages": None}, "max_tokens_str": {"max_tokens": "x"}, "max_tokens_missing": {"max_tokens": None},
        "system_int": {"system": 5}, "system_blocks_bad": {"system": [{"type": "image"}]}, "block_unknown": {"messages": [{"role": "user", "content": [{"type": "?"}]}]},
        "tool_use_no_id": {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]},
        "tool_result_orphan": {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "zz", "content": 5}]}]},
        "role_system": {"messages": [{"role": "system", "content": "x"}]}, "tools_bad": {"tools": [{"input_schema": 1}]},
        "thinking_bad": {"thinking": {"type": "enabled", "budget_tokens": "x"}}, "stop_sequences_int": {"stop_sequences": 3},
        "tool_choice_bad": {"tool_choice": {"type": "tool"}}, "temperature_str": {"temperature": "x"}, "image_block": {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    }  # fmt: skip
    other: list[tuple[str, str, str, Any]] = [
        ("responses.input_int", RESP, "rollout", {"model": "m", "input": 5}), ("responses.prev_unknown", RESP, "rollout", {"model": "m", "input": "x", "previous_response_id": "resp_nope"}),
        ("responses.prev_int", RESP, "rollout", {"model": "m", "input": "x", "previous_response_id": 3}), ("responses.items_bad", RESP, "rollout", {"model": "m", "input": [{"type": "?"}]}),
        ("responses.tools_bad", RESP, "rollout", {"model": "m", "input": "x", "tools": [{"type": "function"}]}), ("responses.instructions_list", RESP, "rollout", {"model": "m", "input": "x", "instructions": [1]}),
        ("completions.prompt_dict", COMP, "rollout", {"model": "m", "prompt": {"a": 1}}), ("completions.prompt_nested", COMP, "rollout", {"model": "m", "prompt": [[1, 2], [3]]}),
        ("completions.prompt_negative", COMP, "rollout", {"model": "m", "prompt": [-1]}), ("completions.prompt_huge_id", COMP, "rollout", {"model": "m", "prompt": [2**40]}),
        ("completions.prompt_empty", COMP, "rollout", {"model": "m", "prompt": []}), ("completions.logprobs_str", COMP, "rollout", {"model": "m", "prompt": "x", "logprobs": "x"}),
        ("control.client_id_int", "/control/rollouts", "admin", {"client_id": 1, "task_id": "t"}), ("control.client_id_empty", "/control/rollouts", "admin", {"client_id": "", "task_id": "t"}),
        ("control.client_id_10k", "/control/rollouts", "admin", {"client_id": "c" * 10_000, "task_id": "t"}), ("control.no_task", "/control/rollouts", "admin", {"client_id": "a"}),
        ("control.sampling_str", "/control/rollouts", "admin", {"client_id": "s", "task_id": "t", "sampling": {"temperature": "x"}}),
        ("control.group_int", "/control/rollouts", "admin", {"client_id": "g", "task_id": "t", "group_id": 5}),
        ("control.reward_str", "/control/rollouts/{rid}/reward", "admin", {"value": "x"}), ("control.reward_list_details", "/control/rollouts/{rid}/reward", "admin", {"value": 1, "details": []}),
        ("control.state_unknown", "/control/rollouts/{rid}/state", "admin", {"state": "exploded"}), ("control.finish_bad", "/control/rollouts/{rid}/attempts/0/finish", "admin", {"status": "nope"}),
        ("control.finish_attempt_str", "/control/rollouts/{rid}/attempts/x/finish", "admin", {"status": "exited"}), ("control.pause_neg", "/control/pause", "admin", {"drain_timeout_s": -1}),
        ("control.pause_str", "/control/pause", "admin", {"drain_timeout_s": "x"}), ("control.resume_str", "/control/resume", "admin", {"weight_version": "x"}),
        ("self_reward.forbidden", "/v1/harnessrl/reward", "rollout", {"value": 1}),
    ]  # fmt: skip
    cases = [Case("types", f"chat.{k}", body=j(chat(**v))) for k, v in chat_bad.items()]
    cases += [Case("types", f"anthropic.{k}", path=MSGS, body=j(anth(**v))) for k, v in anth_bad.items()]
    cases += [Case("types", n, "PUT" if p.endswith("reward") else "POST", p, j(b), a) for n, p, a, b in other]
    for q in ("limit=-5", "limit=1000000000", "cursor=zz", "state=nope", "after=x"):
        path = "/control/events?" + q if q.startswith("after") else "/control/rollouts?" + q
        cases.append(Case("types", f"control.get_{q}", "GET", path, auth="admin"))
    return cases


def encoding_cases() -> list[Case]:
    """Bytes that are not the JSON they claim to be, or JSON at its edges."""
    ok = j(chat())
    raw: dict[str, bytes] = {
        "invalid_utf8": b'{"model":"m","messages":[{"role":"user","content":"\xff\xfe"}]}',
        "lone_surrogate": b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}',
        "overlong_utf8": b'{"model":"m","messages":[{"role":"user","content":"\xc0\xaf"}]}',
        "bom": b"\xef\xbb\xbf" + ok, "utf16": json.dumps(chat()).encode("utf-16"), "raw_nul": ok.replace(b'"hi"', b'"h\x00i"'),
        "escaped_nul": ok.replace(b'"hi"', b'"h\\u0000i"'), "emoji_rtl": j(chat(messages=[{"role": "user", "content": "\U0001f600\u202eabc"}])),
        "nan": ok.replace(b'"max_tokens": 4', b'"max_tokens": NaN'), "infinity": ok.replace(b'"max_tokens": 4', b'"max_tokens": Infinity'),
        "1e999": ok.replace(b'"max_tokens": 4', b'"max_tokens": 1e999'), "neg_zero": ok.replace(b'"max_tokens": 4', b'"max_tokens": -0'),
        "trailing_comma": ok[:-1] + b",}", "single_quotes": ok.replace(b'"', b"'"), "duplicate_keys": ok[:-1] + b', "model": 5}',
        "trailing_garbage": ok + b"garbage", "empty": b"", "whitespace": b"   \n ", "null": b"null", "array": b"[]", "number": b"123",
        "string": b'"str"', "truncated": ok[: len(ok) // 2], "unclosed_string": b'{"model": "m', "comment": b"// hi\n" + ok,
        "big_float": ok.replace(b'"max_tokens": 4', b'"max_tokens": 1.7976931348623157e308'), "long_number": ok.replace(b'"max_tokens": 4', b'"max_tokens": ' + b"9" * 5000),
        "control_chars": ok.replace(b'"hi"', b'"\x01\x02\x1f"'), "escape_soup": j(chat(messages=[{"role": "user", "content": "\\" * 10_000 + '"' * 100}])),
    }  # fmt: skip
    cases = [Case("encodings", f"chat.{k}", body=v) for k, v in raw.items()]
    cases += [Case("encodings", f"anthropic.{k}", path=MSGS, body=v) for k, v in list(raw.items())[:12]]
    header_variants = {
        "text_plain": "Content-Type: text/plain\r\n", "form": "Content-Type: application/x-www-form-urlencoded\r\n",
        "gzip_claimed": "Content-Type: application/json\r\nContent-Encoding: gzip\r\n", "charset_latin1": "Content-Type: application/json; charset=latin-1\r\n",
        "no_content_type": "",
    }  # fmt: skip
    cases += [Case("encodings", f"header.{k}", body=ok, headers=v) for k, v in header_variants.items()]
    return cases


def cross_api_cases() -> list[Case]:
    """Bodies of one API sent to another, wrong methods, paths and keys."""
    bodies = {"chat": j(chat()), "anthropic": j(anth()), "responses": j({"model": "m", "input": "hi"}),
              "completions": j({"model": "m", "prompt": "hi", "max_tokens": 2}), "control": j({"client_id": "x", "task_id": "t"}),
              "reward": j({"value": 1.0})}  # fmt: skip
    routes = {"chat": CHAT, "anthropic": MSGS, "responses": RESP, "completions": COMP}
    cases = [
        Case("cross_api", f"{b}->{r}", path=p, body=bodies[b])
        for r, p in routes.items()
        for b in bodies
        if b != r
    ]
    cases += [
        Case("cross_api", "chat_to_control", path="/control/rollouts", body=bodies["chat"], auth="admin"),
        Case("cross_api", "rollout_key_on_control", path="/control/rollouts", body=bodies["control"]),
        Case("cross_api", "admin_key_on_chat", body=bodies["chat"], auth="admin"),
        Case("cross_api", "no_key", body=bodies["chat"], auth="none"),
        Case("cross_api", "forged_key", body=bodies["chat"], auth="forged"),
        Case("cross_api", "other_rollout_prefix", path="/r/ro_someone_else" + CHAT, body=bodies["chat"]),
        Case("cross_api", "get_on_chat", "GET", CHAT), Case("cross_api", "put_on_messages", "PUT", MSGS, bodies["anthropic"]),
        Case("cross_api", "unknown_path", path="/v2/chat", body=bodies["chat"]), Case("cross_api", "dotdot_path", "GET", "/v1/../control/status"),
        Case("cross_api", "metrics_rollout_key", "GET", "/metrics"), Case("cross_api", "count_tokens_chat_body", path="/v1/messages/count_tokens", body=bodies["chat"]),
    ]  # fmt: skip
    return cases


async def send(gw: Gateway, case: Case, key: str, rid: str, timeout_s: float = 60.0) -> str:
    """Send one case as raw bytes; its outcome: the status code, or what happened instead."""
    token = {"rollout": key, "admin": gw.admin, "none": "", "forged": key[:-4] + "AAAA"}[case.auth]
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    path = case.path.replace("{rid}", rid)
    if case.chunked:
        framing = "Transfer-Encoding: chunked\r\n"
        payload = b"".join(b"%x\r\n%s\r\n" % (len(case.body[i : i + 65536]), case.body[i : i + 65536])
                           for i in range(0, len(case.body), 65536)) + b"0\r\n\r\n"  # fmt: skip
    else:
        framing, payload = f"Content-Length: {len(case.body)}\r\n", case.body
    head = f"{case.method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}{case.headers}{framing}Connection: close\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.proc.port, limit=2**24)
    try:
        writer.write(head.encode() + payload)
        try:
            await writer.drain()
        except ConnectionError:
            pass  # refused mid-upload: the answer may be waiting
        data = await asyncio.wait_for(reader.read(), timeout_s)
    except TimeoutError:
        return "timeout"
    except ConnectionError:
        return "reset"
    finally:
        writer.close()
    if not data:
        return "closed"
    status = data.split(b" ", 2)[1].decode()
    if b"text/event-stream" in data.split(b"\r\n\r\n", 1)[0] and not data.endswith(b"0\r\n\r\n"):
        return f"{status}:stream_cut"
    return status


async def run_corpus(gw: Gateway, cases: list[Case], key: str, rid: str, parallel: int = 4) -> dict[str, Any]:
    """Send every case (at most `parallel` at once); outcomes by category and the server errors."""
    gate = asyncio.Semaphore(parallel)
    outcomes: dict[str, str] = {}

    async def one(case: Case) -> None:
        async with gate:
            if case.raw is not None:
                outcomes[f"{case.category}/{case.name}"] = await case.raw(gw, key)
            else:
                outcomes[f"{case.category}/{case.name}"] = await send(gw, case, key, rid)

    await asyncio.gather(*[one(c) for c in cases])
    by_category: dict[str, Counter[str]] = {}
    for name, outcome in outcomes.items():
        by_category.setdefault(name.split("/")[0], Counter())[outcome] += 1
    errors = {n: o for n, o in outcomes.items() if o[:1] == "5" or o.endswith("stream_cut")}
    return {"cases": len(cases), "server_errors_5xx": len(errors), "server_error_cases": errors,
            "outcomes_by_category": {c: dict(v) for c, v in sorted(by_category.items())}, "outcomes": outcomes}  # fmt: skip
