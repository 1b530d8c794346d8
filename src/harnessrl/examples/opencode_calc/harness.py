"""The `opencode_calc` harness: the real OpenCode CLI (npm `opencode-ai`), run unmodified on one task.

This wrapper is all a user writes to put OpenCode behind harnessrl. From the harness contract
(`OPENAI_BASE_URL`, `OPENAI_API_KEY`, `HARNESSRL_TASK`, `HARNESSRL_OUTPUT`) it writes OpenCode's own
config file, `opencode.json`, into the attempt's folder: an OpenAI-compatible provider whose base URL
is the gateway and whose key is read by OpenCode from `OPENAI_API_KEY` (`{env:...}`; the key is not
written to the file), and a custom agent with a short prompt and only the `write` tool, so that a
call's prompt is about 975 tokens instead of OpenCode's default 7.6k (OpenCode enables `edit` with
`write`; the `bash` tool alone would be 1.4k: on 2 busy CPU cores every prefilled token counts).
Then it runs

    opencode run --pure --agent calc --title <rollout id>      (the question on stdin)

and saves what OpenCode printed (its final answer) to `$HARNESSRL_OUTPUT/opencode_stdout.txt`, and
the `answer.txt` the agent may have written with its tool to `$HARNESSRL_OUTPUT/answer.txt`, for the
grader. `--title` names the session, so OpenCode makes no title-generation call; `--pure` loads no
external plugins. The output budget of each model call is OpenCode's model `limit.output`; the
provider's `headerTimeout`/`chunkTimeout` are off, because OpenCode otherwise gives up on a call after
300 s and sends it again, which on a busy CPU only queues the same prefill twice (the controller's
`harness_timeout_s` bounds the attempt).

The binary: `$OPENCODE_BIN`, else the one `bench/harnesses/setup.sh` installs into this checkout's
`.bench/harnesses/`, else `opencode` on PATH. Standard library only; it does not import harnessrl.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

OPENCODE_VERSION = "1.18.33"  # the version bench/harnesses/setup.sh pins
AGENT = "calc"
MODEL = "smollm2"  # any name: the gateway serves every name with the model being trained
MAX_OUTPUT_TOKENS = 128  # OpenCode's max_tokens per call (it asks for 32,000 by default)
MAX_STEPS = 3  # agent loop iterations (model calls) per run
PROMPT = (
    "You answer arithmetic questions. Write the number to the file answer.txt with the write tool, "
    "then reply: The answer is N."
)
ANSWER_FILE = "answer.txt"
REPO_BIN = Path(__file__).resolve().parents[4] / ".bench/harnesses/npm/node_modules/.bin/opencode"


def opencode_config(base_url: str, model: str = MODEL) -> dict[str, Any]:
    """OpenCode's config: the gateway as an OpenAI-compatible provider, and the `calc` agent."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "harnessrl": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "harnessrl gateway",
                "options": {
                    "baseURL": base_url,
                    "apiKey": "{env:OPENAI_API_KEY}",
                    "headerTimeout": False,  # OpenCode's default: give up (and resend) after 300 s
                    "chunkTimeout": False,
                },
                "models": {model: {"name": model, "limit": {"context": 8192, "output": MAX_OUTPUT_TOKENS}}},
            }
        },
        "model": f"harnessrl/{model}",
        "small_model": f"harnessrl/{model}",
        "autoupdate": False,
        "share": "disabled",
        "snapshot": False,
        "agent": {
            AGENT: {
                "mode": "primary",
                "description": "Answers arithmetic questions and writes the answer to a file.",
                "prompt": PROMPT,
                "steps": MAX_STEPS,
                "tools": {"*": False, "write": True},
            }
        },
    }


def opencode_env(env: dict[str, str], config_path: Path) -> dict[str, str]:
    """The environment OpenCode runs with: the contract's, plus its own switches (no network fetches)."""
    return env | {
        "OPENCODE_CONFIG": str(config_path),
        "OPENCODE_DISABLE_PROJECT_CONFIG": "1",  # no opencode.json / AGENTS.md from folders above
        "OPENCODE_DISABLE_MODELS_FETCH": "1",  # no models.dev catalogue download
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        # OpenCode installs its plugin SDK (@opencode-ai/plugin, ~95 MB) from npm into ~/.config/opencode
        # in the background on every start, even with --pure; HOME is a fresh folder per attempt, so
        # that would be a download per attempt. Offline, the install fails at once (a logged warning)
        # and the run is unaffected.
        "npm_config_offline": "true",
    }


def find_opencode(env: dict[str, str]) -> str | None:
    """$OPENCODE_BIN, else this checkout's .bench install, else `opencode` on PATH."""
    if env.get("OPENCODE_BIN"):
        return env["OPENCODE_BIN"]
    if REPO_BIN.exists():
        return str(REPO_BIN)
    return shutil.which("opencode", path=env.get("PATH"))


def command(binary: str, rollout_id: str) -> list[str]:
    """OpenCode's command line: one non-interactive run with the `calc` agent."""
    return [binary, "run", "--pure", "--agent", AGENT, "--title", rollout_id or "harnessrl"]


def prepare(workdir: Path, env: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """Write opencode.json into `workdir`; return its path and OpenCode's environment."""
    for var in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "HARNESSRL_TASK", "HARNESSRL_OUTPUT"):
        if not env.get(var):
            raise KeyError(var)
    path = workdir / "opencode.json"
    path.write_text(json.dumps(opencode_config(env["OPENAI_BASE_URL"]), indent=2) + "\n")
    return path, opencode_env(env, path)


def main() -> int:
    """Run OpenCode on the task in $HARNESSRL_TASK; its stdout goes to $HARNESSRL_OUTPUT too."""
    env = dict(os.environ)
    try:
        _, oc_env = prepare(Path.cwd(), env)
    except KeyError as e:
        print(f"error: {e.args[0]} is not set; the harnessrl controller starts this harness", file=sys.stderr)
        return 2
    binary = find_opencode(env)
    if binary is None:
        print(
            f"error: no opencode binary: run `bash bench/harnesses/setup.sh opencode` (opencode-ai@"
            f"{OPENCODE_VERSION}) or set OPENCODE_BIN",
            file=sys.stderr,
        )
        return 2
    question = str(json.loads(Path(env["HARNESSRL_TASK"]).read_text())["question"])
    proc = subprocess.run(
        command(binary, env.get("HARNESSRL_ROLLOUT_ID", "")),
        input=question,
        stdout=subprocess.PIPE,
        env=oc_env,
        text=True,
        check=False,
    )
    out = Path(env["HARNESSRL_OUTPUT"])
    (out / "opencode_stdout.txt").write_text(proc.stdout)
    written = Path.cwd() / ANSWER_FILE
    if written.is_file():
        shutil.copyfile(written, out / ANSWER_FILE)
    sys.stdout.write(proc.stdout)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
