"""One harness run through one gateway, and what it shows: exit status, HTTP outcomes (from the
recording proxy), calls recorded with token IDs, whether the tool round trip was seen (a later call's
prompt tokens hold the tool's output), whether the final answer reached the harness, and how the
rollout's calls merge into rows under the adapter (with the cause of every break)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from bench.harnesses.drivers import Endpoint, Harness, Task
from bench.harnesses.proxy import read_log
from tokenizers import Tokenizer

from harnessrl.adapter.merge import MergeStats, merge_calls
from harnessrl.schema import Call, CallStatus, RolloutDetail

log = logging.getLogger(__name__)
MODEL_PATHS = ("/v1/messages", "/v1/responses", "/v1/chat/completions", "/v1/completions")
TAIL_CHARS = 1500


@dataclass(frozen=True)
class Gateway:
    """A running gateway as the suite uses it: harnesses reach it through its recording proxy."""

    mode: str  # passthrough | tito
    url: str
    proxy_url: str
    proxy_log: Path
    admin_key: str
    store_path: Path

    def new_rollout(self, client_id: str, sampling: dict[str, Any] | None = None) -> tuple[str, str]:
        """Create a rollout and open its attempt; returns (rollout_id, api_key)."""
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        body: dict[str, Any] = {"client_id": client_id, "task_id": "harness-suite"}
        if sampling:
            body["sampling"] = sampling
        with httpx.Client(base_url=self.url, headers=headers, timeout=30) as c:
            r = c.post("/control/rollouts", json=body)
            r.raise_for_status()
            rid = r.json()["rollout"]["rollout_id"]
            c.post(f"/control/rollouts/{rid}/attempts").raise_for_status()
            return rid, r.json()["api_key"]

    def calls(self, rollout_id: str) -> list[Call]:
        """The rollout's recorded calls, read through the control API."""
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        r = httpx.get(f"{self.url}/control/rollouts/{rollout_id}", headers=headers, timeout=30)
        r.raise_for_status()
        return RolloutDetail.model_validate(r.json()).calls


StopRule = Callable[[list[Call]], bool]


def _wait(proc: subprocess.Popen[bytes], timeout_s: float, poll: Callable[[], bool] | None) -> str:
    """Wait for the harness; 'exited', 'timeout', or 'stopped' (the poll said enough was seen)."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return "timeout"
        if poll is not None and poll():
            time.sleep(2.0)  # let the harness take the answer; then end it
            return "stopped" if proc.poll() is None else "exited"
        time.sleep(0.5)
    return "exited"


def _end(proc: subprocess.Popen[bytes]) -> None:
    """End the harness's whole process group: SIGTERM, then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _end_tmux(tmux_dir: Path) -> None:
    """Stop the tmux servers a harness started (they leave its process group) and their sockets."""
    for sock in tmux_dir.glob("tmux-*/*"):
        subprocess.run(["tmux", "-S", str(sock), "kill-server"], capture_output=True, check=False, timeout=10)
    shutil.rmtree(tmux_dir, ignore_errors=True)


def launch_and_wait(harness: Harness, gw: Gateway, run_dir: Path, timeout_s: float,
                    replay_url: str | None, sampling: dict[str, Any] | None = None,
                    stop_rule: StopRule | None = None, compact: bool = False) -> dict[str, Any]:  # fmt: skip
    """Run `harness` once through `gw` on a fresh task; return the raw facts of the run."""
    task = Task(run_dir / "work", secret=f"plum-{secrets.token_hex(3)}")
    task.write()
    rid, key = gw.new_rollout(f"{harness.name}-{gw.mode}-{secrets.token_hex(4)}", sampling)
    if replay_url is not None:
        script = harness.script(task, compact)
        httpx.post(f"{replay_url}/admin/script", json=script, timeout=10).raise_for_status()
    launch = harness.launch(Endpoint(gw.proxy_url, key, harness.model), task, run_dir / "home", run_dir)
    tmux_dir = Path(tempfile.mkdtemp(prefix="hrl-tmux-"))  # short: a socket path is at most 107 bytes
    launch.env["TMUX_TMPDIR"] = str(tmux_dir)  # OpenHands' terminal runs in a tmux server of its own
    out, err = run_dir / "stdout.txt", run_dir / "stderr.txt"
    t0 = time.monotonic()
    with out.open("wb") as fo, err.open("wb") as fe:
        proc = subprocess.Popen(launch.argv, env=launch.env, cwd=launch.cwd, stdout=fo, stderr=fe,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        poll = (lambda: stop_rule(gw.calls(rid))) if stop_rule is not None else None
        try:
            how = _wait(proc, timeout_s, poll)
        finally:
            _end(proc)  # also when the suite itself is interrupted: no harness is left running
            _end_tmux(tmux_dir)
    if how != "exited":
        time.sleep(3.0)  # the gateway records the calls the harness left unfinished (as cancelled)
    stdout = out.read_text(errors="replace")
    return {"task": task, "rollout_id": rid, "key": key, "launch": launch, "how": how,
            "exit_code": proc.returncode, "seconds": round(time.monotonic() - t0, 1), "stdout": stdout,
            "stderr": err.read_text(errors="replace"), "answer": harness.answer(run_dir, stdout),
            "calls": gw.calls(rid), "exchanges": read_log(gw.proxy_log, key)}  # fmt: skip


def http_outcome(exchanges: list[dict[str, Any]]) -> dict[str, Any]:
    """Status counts of model-API requests, the distinct errors, faces and streaming seen."""
    model = [e for e in exchanges if e["method"] == "POST" and e["path"].endswith(MODEL_PATHS)]
    errors = sorted({f"{e['status']} {e['path']}: {e.get('error', '')}" for e in model if e["status"] >= 400})
    return {"requests": len(model), "status": dict(Counter(str(e["status"]) for e in model)),
            "errors": errors, "paths": sorted({e["path"] for e in model}),
            "streaming": sorted({bool(e.get("stream")) for e in model}),
            "other_requests": sorted({f"{e['method']} {e['path']} {e['status']}" for e in exchanges
                                      if e not in model})}  # fmt: skip


def _tools(call: Call) -> list[str]:
    _, tools, _ = call.conversation()
    return [str((t.get("function") or t).get("name")) for t in tools or [] if isinstance(t, dict)]


def _has_ids(call: Call) -> bool:
    return (call.status == CallStatus.OK and bool(call.prompt_ids) and bool(call.completion_ids)
            and len(call.completion_ids) == len(call.completion_logprobs))  # fmt: skip


def merge_report(calls: list[Call]) -> dict[str, Any]:
    """The adapter's merge of one rollout: rows, breaks with causes, whether it became one row, and
    the share of call-to-call transitions that extended a row."""
    result = merge_calls(calls)
    stats = MergeStats()
    stats.add(result)
    n = result.n_calls
    return {"calls": n, "rows": len(result.rows), "merge_rate": stats.merge_rate,
            "transitions_merged": (n - len(result.rows)) / (n - 1) if n > 1 else None,
            "breaks": [str(b) for b in result.breaks]}  # fmt: skip


def gateway_notes(calls: list[Call]) -> dict[str, Any]:
    """What the gateway noted about the harness's requests (fields ignored, tools dropped) and what
    the requests asked for (model names, output budgets)."""
    ignored = sorted({f for c in calls for f in (c.chat or {}).get("ignored_fields") or []})
    dropped = sorted(
        {f"{d.get('type')}:{d.get('name')}" for c in calls for d in (c.chat or {}).get("dropped_tools") or []}
    )
    budgets = sorted({c.request.get(k) for c in calls for k in ("max_tokens", "max_output_tokens", "max_completion_tokens")
                      if isinstance(c.request.get(k), int)})  # fmt: skip
    return {"ignored_fields": ignored, "dropped_tools": dropped, "max_tokens_requested": budgets,
            "models_requested": sorted({str(c.request.get("model")) for c in calls})}  # fmt: skip


def call_report(calls: list[Call], task: Task, tok: Tokenizer) -> dict[str, Any]:
    """What the store holds: calls, token IDs, the tool round trip, the main conversation's calls."""
    main = [c for c in calls if _tools(c)]  # the agent's own conversation (side calls declare no tools)
    prompts = [tok.decode(c.prompt_ids, skip_special_tokens=False) for c in calls]
    tool_calls = [c for c in calls if (c.conversation()[2] or {}).get("tool_calls")]
    return {
        "recorded": len(calls),
        "ok": sum(c.status == CallStatus.OK for c in calls),
        "with_token_ids": sum(_has_ids(c) for c in calls),
        "faces": sorted({c.face for c in calls}),
        "tools_declared": max((len(_tools(c)) for c in calls), default=0),
        "tool_names": sorted({n for c in main for n in _tools(c)})[:40],
        "tool_call_answered": len(tool_calls),
        "tools_called": sorted(
            {tc["function"]["name"] for c in tool_calls for tc in c.conversation()[2]["tool_calls"]}
        ),
        "tool_round_trip": any(task.secret in p for p in prompts),
        "prompt_tokens": [len(c.prompt_ids) for c in calls],
        "completion_tokens": [len(c.completion_ids) for c in calls],
        "main_prompt_tokens": len(main[0].prompt_ids) if main else None,
        "merge_all_calls": merge_report(calls),
        "merge_main_conversation": merge_report(main),
        "gateway_notes": gateway_notes(calls),
    }


def outcome(raw: dict[str, Any], calls: dict[str, Any], http: dict[str, Any]) -> str:
    """One line: pass, blocked by gateway (its HTTP error), or fail with the reason."""
    task: Task = raw["task"]
    answered = task.secret in raw["answer"]
    if raw["exit_code"] == 0 and calls["tool_round_trip"] and answered and calls["with_token_ids"] >= 2:
        return "pass"
    if http["errors"] and calls["with_token_ids"] == 0:
        return f"blocked by gateway: {http['errors'][0]}"
    reasons = []
    if raw["how"] == "timeout":
        reasons.append("timed out")
    elif raw["exit_code"] != 0:
        reasons.append(f"exit {raw['exit_code']}")
    if http["errors"]:
        reasons.append(f"gateway answered {http['errors'][0]}")
    if not calls["tool_round_trip"]:
        reasons.append("no tool round trip")
    if not answered:
        reasons.append("final answer not in the harness's output")
    return "fail: " + "; ".join(reasons)


def replay_run(harness: Harness, gw: Gateway, run_dir: Path, replay_url: str, tok: Tokenizer,
               timeout_s: float, compact: bool = False) -> dict[str, Any]:  # fmt: skip
    """A full tool loop scripted by the replay engine; the report of that run."""
    raw = launch_and_wait(harness, gw, run_dir, timeout_s, replay_url, compact=compact)
    http = http_outcome(raw["exchanges"])
    calls = call_report(raw["calls"], raw["task"], tok)
    (run_dir / "exchanges.json").write_text(json.dumps(raw["exchanges"], indent=1))
    return {"outcome": outcome(raw, calls, http), "exit_code": raw["exit_code"], "ended": raw["how"],
            "seconds": raw["seconds"], "final_answer_seen": raw["task"].secret in raw["answer"],
            "http": http, "calls": calls, "command": raw["launch"].shell(),
            "stdout_tail": raw["stdout"][-TAIL_CHARS:], "stderr_tail": raw["stderr"][-TAIL_CHARS:]}  # fmt: skip


def _main_turn_done(calls: list[Call]) -> bool:
    """The agent's turn (a call that declares tools) was answered, or failed other than by the
    harness hanging up (a harness that gives up on a slow answer retries: that is its turn too)."""
    return any(_tools(c) and (c.status == CallStatus.OK or not (c.error or "").startswith("cancelled"))
               for c in calls)  # fmt: skip


def smollm2_turn(harness: Harness, gw: Gateway, run_dir: Path, tok: Tokenizer, timeout_s: float,
                 max_tokens: int, context: int) -> dict[str, Any]:  # fmt: skip
    """One turn on the real SmolLM2 engine: the harness is ended once its main call is answered."""
    raw = launch_and_wait(harness, gw, run_dir, timeout_s, None, {"max_tokens": max_tokens}, _main_turn_done)
    http = http_outcome(raw["exchanges"])
    calls: list[Call] = raw["calls"]
    main = [c for c in calls if _tools(c)] or calls
    first = main[0] if main else None
    report: dict[str, Any] = {"ended": raw["how"], "exit_code": raw["exit_code"], "seconds": raw["seconds"],
                              "http": http, "recorded": len(calls),
                              "with_token_ids": sum(_has_ids(c) for c in calls)}  # fmt: skip
    if first is not None and _has_ids(first):
        text = tok.decode(first.completion_ids, skip_special_tokens=False)
        report.update(outcome="answered", prompt_tokens=len(first.prompt_ids),
                      completion_tokens=len(first.completion_ids), finish_reason=first.finish_reason,
                      latency_s=round(first.latency_s, 1), completion=text[:300])  # fmt: skip
    elif any("context" in e or "too long" in e for e in http["errors"]):
        report["outcome"] = f"prompt > context {context}: {http['errors'][0]}"
    elif http["errors"]:
        report["outcome"] = f"blocked by gateway: {http['errors'][0]}"
    elif calls:
        report["outcome"] = f"no answer in {timeout_s:.0f} s ({len(calls)} calls cut: {calls[0].error})"
    else:
        report["outcome"] = f"no call recorded ({raw['how']}, exit {raw['exit_code']})"
    report["stderr_tail"] = raw["stderr"][-TAIL_CHARS:]
    return report
