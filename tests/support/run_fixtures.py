"""The recorded-run fixture shared by the inspect, export and dashboard tests: a run directory written
through the real store API whose calls carry real SmolLM2 token ids (a tool call that merges, a history
edit, a retokenized answer, a truncation after an infrastructure retry, a failed call, an evaluation)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from harnessrl.chat import render_chat
from harnessrl.config import RunConfig
from harnessrl.schema import (
    AttemptFinish,
    AttemptStatus,
    Call,
    CallStatus,
    RewardIn,
    RolloutCreate,
    RolloutState,
    now,
)
from harnessrl.store import SQLiteStore

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
QUESTION = "What is 2+3?"
TOOL_TEXT = '<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call><|im_end|>'
FINAL_TEXT = "The answer is 5.<|im_end|>"


@dataclass
class Fixture:
    """A run directory written through the store API, and what went into it."""

    run_dir: Path
    tok: Tokenizer
    calls: dict[str, list[Call]]  # rollout id -> its calls, in order


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def _lps(n: int, base: float) -> list[float]:
    return [round(base - 0.01 * k, 4) for k in range(n)]


def _call(rid: str, attempt: int, prompt: list[int], completion: list[int], chat: dict[str, Any],
          finish: str = "stop", status: CallStatus = CallStatus.OK, version: int = 0) -> Call:  # fmt: skip
    ok = status == CallStatus.OK
    return Call(
        call_id=f"{rid}-c{len(prompt)}-{attempt}-{len(completion)}", rollout_id=rid, attempt=attempt,
        created_at=now(), latency_s=0.1, status=status, model="m", upstream="u", request={},
        prompt_ids=prompt, completion_ids=completion if ok else [],
        completion_logprobs=_lps(len(completion), -0.1 * (len(prompt) % 7 + 1)) if ok else [],
        weight_version=version, finish_reason=finish if ok else None, chat=chat,
        error=None if ok else "upstream 503",
    )  # fmt: skip


def _tool_rollout(tok: Tokenizer, rid: str) -> list[Call]:
    """Three calls: a tool call, its result appended (merges), then a rewritten history (breaks)."""
    msgs = [{"role": "user", "content": QUESTION}]
    tool_answer = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "2+3"}'}}]}  # fmt: skip
    p0, c0 = _ids(tok, render_chat(msgs, TOOLS)), _ids(tok, TOOL_TEXT)
    msgs1 = [*msgs, tool_answer, {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    p1 = p0 + c0 + _ids(tok, "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
    final = {"role": "assistant", "content": "The answer is 5."}
    msgs2 = [{"role": "user", "content": "Summary: 2+3 is 5. Say it."}]
    return [
        _call(rid, 0, p0, c0, {"messages": msgs, "tools": TOOLS, "answer": tool_answer}),
        _call(rid, 0, p1, _ids(tok, FINAL_TEXT), {"messages": msgs1, "tools": TOOLS, "answer": final}),
        _call(rid, 0, _ids(tok, render_chat(msgs2, TOOLS)), _ids(tok, FINAL_TEXT),
              {"messages": msgs2, "tools": TOOLS, "answer": final}),
    ]  # fmt: skip


def _retokenized_rollout(tok: Tokenizer, rid: str) -> list[Call]:
    """The engine sampled "Hel" + "lo there"; the next prompt re-encodes "Hello there" as usual."""
    msgs = [{"role": "user", "content": "Greet me."}]
    answer = {"role": "assistant", "content": "Hello there"}
    split = _ids(tok, "Hel") + _ids(tok, "lo there") + _ids(tok, "<|im_end|>")
    assert split[: len(_ids(tok, "Hello there"))] != _ids(tok, "Hello there")  # really a different split
    msgs1 = [*msgs, answer, {"role": "user", "content": "Again."}]
    return [
        _call(rid, 0, _ids(tok, render_chat(msgs)), split, {"messages": msgs, "tools": None, "answer": answer}),
        _call(rid, 0, _ids(tok, render_chat(msgs1)), _ids(tok, "Hi!<|im_end|>"),
              {"messages": msgs1, "tools": None, "answer": {"role": "assistant", "content": "Hi!"}}),
    ]  # fmt: skip


def _truncated_rollout(tok: Tokenizer, rid: str) -> list[Call]:
    """Attempt 0 (lost to the infrastructure) made one call; in attempt 1 the length limit cut the
    answer as "Hel" + "lo", and the next prompt re-encodes "Hello" (no exact prefix: a truncation break)."""
    msgs = [{"role": "user", "content": "Say hello."}]
    cut = {"role": "assistant", "content": "Hello"}
    msgs1 = [*msgs, cut, {"role": "user", "content": "Go on."}]
    p0 = _ids(tok, render_chat(msgs))
    return [
        _call(rid, 0, p0, _ids(tok, "Hi<|im_end|>"), {"messages": msgs, "tools": None, "answer": None}),
        _call(rid, 1, p0, _ids(tok, "Hel") + _ids(tok, "lo"), {"messages": msgs, "tools": None, "answer": cut},
              finish="length"),
        _call(rid, 1, _ids(tok, render_chat(msgs1)), _ids(tok, "5 6<|im_end|>"),
              {"messages": msgs1, "tools": None, "answer": {"role": "assistant", "content": "5 6"}}, version=1),
    ]  # fmt: skip


def _add(store: SQLiteStore, rid: str, client_id: str, task: str, group: str | None, meta: dict[str, Any],
         calls: list[Call], reward: float | None, infra_first: bool = False) -> None:  # fmt: skip
    store.create_rollout(
        RolloutCreate(client_id=client_id, task_id=task, group_id=group, metadata=meta, input={"q": task}),
        rid,
    )
    attempts = sorted({c.attempt for c in calls} | {0})
    for a in attempts:
        store.start_attempt(rid)
        store.add_calls([c for c in calls if c.attempt == a])
        infra = infra_first and a == 0
        status = AttemptStatus.INFRA_ERROR if infra else AttemptStatus.EXITED
        store.finish_attempt(rid, a, AttemptFinish(status=status, exit_code=None if infra else 0,
                                                   error="node lost" if infra else None))  # fmt: skip
        if infra:
            store.set_state(rid, RolloutState.QUEUED)
    store.set_state(rid, RolloutState.SUCCEEDED)
    if reward is not None:
        store.set_reward(rid, RewardIn(value=reward, details={"why": f"graded {reward}"}))


@pytest.fixture
def fixture_run(tiny_model_dir: Path, tmp_path: Path) -> Fixture:
    """Step 1: a group of three (tool merge + history edit, retokenized, truncation after an infra
    retry); step 2: one rollout with a failed call; one held-out evaluation rollout."""
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = RunConfig.model_validate({"run_dir": str(run_dir), "engine": {"model": str(tiny_model_dir)}})
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    store = SQLiteStore(run_dir / "store.sqlite")
    g1, g2 = "runx-s0-add", "runx-s1-mul"
    calls = {
        "roaaaa1111": _tool_rollout(tok, "roaaaa1111"),
        "roaaaa2222": _retokenized_rollout(tok, "roaaaa2222"),
        "robbbb3333": _truncated_rollout(tok, "robbbb3333"),
    }
    d_ok = _retokenized_rollout(tok, "rocccc4444")[:1]
    d_failed = _call("rocccc4444", 0, d_ok[0].prompt_ids, [], {}, status=CallStatus.FAILED)
    calls["rocccc4444"] = [d_failed, *d_ok]
    calls["roeeee5555"] = _tool_rollout(tok, "roeeee5555")[:1]
    _add(store, "roaaaa1111", "runx-s0-add-0", "add", g1, {"step": 0}, calls["roaaaa1111"], 1.0)
    _add(store, "roaaaa2222", "runx-s0-add-1", "add", g1, {"step": 0}, calls["roaaaa2222"], 0.0)
    _add(
        store,
        "robbbb3333",
        "runx-s0-add-2",
        "add",
        g1,
        {"step": 0},
        calls["robbbb3333"],
        0.5,
        infra_first=True,
    )
    _add(store, "rocccc4444", "runx-s1-mul-0", "mul", g2, {"step": 1}, calls["rocccc4444"], 1.0)
    _add(store, "roeeee5555", "runx-eval-before-t0-add", "add", None, {"eval": "eval-before-t0"},
         calls["roeeee5555"], 1.0)  # fmt: skip
    store.close()
    return Fixture(run_dir, tok, calls)
