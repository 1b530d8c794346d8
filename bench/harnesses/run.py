"""The real-program suite: each pinned harness (see setup.sh), unmodified, through the gateway.

1. Replay: a replay engine (`replay_engine.py`) behind two gateways, one per mode (passthrough, tito).
   Each harness runs the tiny task (read notes.txt, say the secret word) once per mode: the script
   makes its first turn a call of the harness's own read/shell tool, the harness runs it, and the next
   turn answers. Reported: exit status, HTTP outcomes, calls recorded with token IDs, the tool round
   trip, the final answer, and the adapter's merge of the rollout (rows, breaks and their causes).
   Each pair runs with the scripted tool call written as the chat template renders calls back, and
   again in compact JSON, as models often write it (passthrough then re-renders it differently).
2. SmolLM2: one turn of each harness on the real builtin engine (8,192-token context) behind a tito
   gateway, with the answer capped at `--smollm2-max-tokens`; a prompt that does not fit is reported.

Harnesses reach each gateway through a transparent recording proxy (`proxy.py`), so a request the
gateway refuses is reported with its status and message. Writes bench/results/harnesses.json; prints
a summary. `make test-harnesses` installs the harnesses and runs this.

    python bench/harnesses/run.py [--harness codex ...] [--modes tito] [--skip-smollm2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import platform
import secrets
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: make `bench.harnesses` importable
    sys.path.insert(0, str(REPO))

from bench.harnesses.drivers import HARNESSES, INSTALL, Harness  # noqa: E402
from bench.harnesses.suite import Gateway, replay_run, smollm2_turn  # noqa: E402

from harnessrl.modeling.loading import smollm2_tokenizer_dir  # noqa: E402
from harnessrl.services import Service, free_port, start_engine, start_gateway, start_service  # noqa: E402

log = logging.getLogger("bench.harnesses")
SMOLLM2_CONTEXT = 8192


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
    return out.stdout.strip()


def gateway_version() -> dict[str, Any]:
    """The gateway code the run used: last commit touching it, and whether it had local changes."""
    return {"last_commit": _git("log", "-1", "--format=%h", "--", "src/harnessrl/gateway"),
            "uncommitted_changes": bool(_git("status", "--porcelain", "--", "src/harnessrl/gateway"))}  # fmt: skip


def start_gateway_pair(stack: ExitStack, mode: str, upstream: str, tok_dir: Path, logs: Path) -> Gateway:
    """A gateway in `mode` over a fresh store, and its recording proxy."""
    admin = "admin-" + secrets.token_hex(8)
    logs = logs / mode
    logs.mkdir(parents=True, exist_ok=True)
    store = logs / "store.sqlite"
    port = free_port()
    gw = start_gateway(store, upstream, port, admin, logs, 512, mode, tok_dir if mode == "tito" else None)
    stack.callback(gw.stop)
    gw.wait_healthy(60)
    pport, plog = free_port(), logs / "exchanges.jsonl"
    proxy = start_service("proxy", ["bench.harnesses.proxy", "--port", str(pport), "--upstream",
                                            gw.url, "--log", str(plog)], pport, logs)  # fmt: skip
    stack.callback(proxy.stop)
    _wait_port(proxy)
    return Gateway(mode, gw.url, proxy.url, plog, admin, store)


def _wait_port(svc: Service, timeout_s: float = 30.0) -> None:
    """Wait until a service without /health (the proxy) accepts connections."""
    import socket

    host, port = svc.url.removeprefix("http://").split(":")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if svc.proc.poll() is not None:
            raise RuntimeError(f"{svc.name} exited:\n{svc.log_tail()}")
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{svc.name} did not listen in {timeout_s}s")


def installed(h: Harness) -> str | None:
    """None when the harness's program is installed, else what is missing."""
    from bench.harnesses.drivers import NPM_BIN

    exe = {"claude-code": NPM_BIN / "claude", "codex": NPM_BIN / "codex", "opencode": NPM_BIN / "opencode",
           "openhands": INSTALL / "venv-openhands" / "bin" / "python",
           "mini-swe-agent": INSTALL / "venv-mini" / "bin" / "mini"}[h.name]  # fmt: skip
    return None if exe.exists() else f"not installed: {exe} (run bench/harnesses/setup.sh)"


def replay_phase(names: list[str], modes: list[str], styles: list[str], runs: Path, tok_dir: Path,
                 tok: Tokenizer, timeout_s: float, results: dict[str, Any]) -> None:  # fmt: skip
    """Every harness x mode x tool-call style through the replay engine."""
    logs = runs / "replay-logs"
    with ExitStack() as stack:
        port = free_port()
        replay = start_service("replay-engine", ["bench.harnesses.replay_engine", "--port", str(port),
                                                 "--tokenizer", str(tok_dir)], port, logs)  # fmt: skip
        stack.callback(replay.stop)
        replay.wait_healthy(60)
        gateways = {m: start_gateway_pair(stack, m, replay.url, tok_dir, logs) for m in modes}
        for name in names:
            h = HARNESSES[name]
            entry = results[name]
            if (missing := installed(h)) is not None:
                entry["replay"] = {"all": {"outcome": missing}}
                continue
            for (mode, gw), style in itertools.product(gateways.items(), styles):
                key = mode if style == "canonical" else f"{mode}, {style}"
                log.info("event=replay_run harness=%s run=%r", name, key)
                report = replay_run(h, gw, runs / name / key.replace(", ", "-"), replay.url, tok, timeout_s,
                                    compact=style == "compact")  # fmt: skip
                entry["replay"][key] = report
                log.info("event=replay_done harness=%s run=%r outcome=%r", name, key, report["outcome"])


class SmolLM2Engine:
    """The builtin engine on SmolLM2, restartable on the same port: a harness stopped mid-turn may
    leave a generation running (a non-streamed request the harness resent), which would otherwise
    delay the next harness's turn."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.port = logs, free_port()
        self.service: Service | None = None

    def start(self) -> str:
        """Start (one sequence at a time: a side call is answered before the agent turn's long
        prefill instead of sharing every step with it); returns the URL."""
        self.service = start_engine(Path("smollm2"), self.port, self.logs, 1, SMOLLM2_CONTEXT, None)
        self.service.wait_healthy(300)
        return self.service.url

    def busy(self) -> bool:
        """True while the engine still runs or queues a sequence."""
        assert self.service is not None
        stats = httpx.get(f"{self.service.url}/admin/stats", timeout=10).json()
        return bool(stats.get("running") or stats.get("waiting"))

    def restart_if_busy(self) -> bool:
        """Restart when a left-over generation is running; True if it did."""
        if self.service is None or not self.busy():
            return False
        self.service.stop()
        self.start()
        return True

    def stop(self) -> None:
        """Stop the engine."""
        if self.service is not None:
            self.service.stop()


def smollm2_phase(names: list[str], runs: Path, tok_dir: Path, tok: Tokenizer, timeout_s: float,
                  max_tokens: int, results: dict[str, Any]) -> None:  # fmt: skip
    """One turn of each harness on the real SmolLM2 engine behind a tito gateway."""
    logs = runs / "smollm2-logs"
    with ExitStack() as stack:
        engine = SmolLM2Engine(logs)
        stack.callback(engine.stop)
        gw = start_gateway_pair(stack, "tito", engine.start(), tok_dir, logs)
        for name in names:
            h = HARNESSES[name]
            if (missing := installed(h)) is not None:
                results[name]["smollm2"] = {"outcome": missing}
                continue
            log.info("event=smollm2_run harness=%s", name)
            report = smollm2_turn(h, gw, runs / name / "smollm2", tok, timeout_s, max_tokens, SMOLLM2_CONTEXT)
            report["engine_restarted_after"] = engine.restart_if_busy()
            results[name]["smollm2"] = report
            log.info("event=smollm2_done harness=%s outcome=%r", name, report["outcome"])


def summary(results: dict[str, Any]) -> str:
    """A plain-text table of the run."""
    lines = [f"{'harness':16} {'run':22} {'outcome':50} calls ids rt  merge"]
    for name, entry in results.items():
        for mode, r in entry.get("replay", {}).items():
            c = r.get("calls") or {}
            merge = (c.get("merge_all_calls") or {}).get("merge_rate")
            lines.append(f"{name:16} {mode:22} {r['outcome'][:50]:50} {c.get('recorded', 0):5} "
                         f"{c.get('with_token_ids', 0):3} {str(c.get('tool_round_trip', '-'))[:1]:3} {merge}")  # fmt: skip
        s = entry.get("smollm2")
        if s:
            lines.append(f"{name:16} {'smollm2':22} {s['outcome'][:50]:50} {s.get('recorded', 0):5}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the suite and write the results file."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--harness", action="append", choices=sorted(HARNESSES), help="default: all")
    p.add_argument("--modes", nargs="+", default=["passthrough", "tito"], choices=["passthrough", "tito"])
    p.add_argument(
        "--styles",
        nargs="+",
        default=["canonical", "compact"],
        choices=["canonical", "compact"],
        help="tool calls as the template renders them, and as compact JSON (as models often write)",
    )
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "harnesses.json")
    p.add_argument("--runs-dir", type=Path, default=INSTALL / "runs")
    p.add_argument("--timeout-s", type=float, default=240.0, help="per harness run")
    p.add_argument("--skip-replay", action="store_true")
    p.add_argument("--skip-smollm2", action="store_true")
    p.add_argument("--smollm2-max-tokens", type=int, default=32)
    p.add_argument("--smollm2-timeout-s", type=float, default=600.0, help="per harness turn on SmolLM2")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    os.chdir(REPO)  # the services are started as `python -m bench.harnesses...` from here
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop harnesses and services
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    names = args.harness or list(HARNESSES)
    runs = args.runs_dir / time.strftime("%Y%m%d-%H%M%S")
    tok_dir = smollm2_tokenizer_dir()
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    results: dict[str, Any] = {n: {"program": HARNESSES[n].program, "version": HARNESSES[n].version,
                                   "face": HARNESSES[n].face, "model": HARNESSES[n].model, "replay": {}}
                               for n in names}  # fmt: skip
    t0 = time.monotonic()
    if not args.skip_replay:
        replay_phase(names, args.modes, args.styles, runs, tok_dir, tok, args.timeout_s, results)
    if not args.skip_smollm2:
        smollm2_phase(names, runs, tok_dir, tok, args.smollm2_timeout_s, args.smollm2_max_tokens, results)
    doc = {"generated_at": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(time.monotonic() - t0),
           "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
           "gateway": gateway_version(), "runs_dir": str(runs), "smollm2_max_tokens": args.smollm2_max_tokens,
           "harnesses": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(summary(results))
    print(f"results: {args.out}  (logs and transcripts under {runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
