"""How to run each real harness, unmodified, against a gateway: given only a base URL, an API key and a
model name, each driver writes the harness's own config (where it has one) and returns its command
line and environment. Each also names the tools its scripted first turn may call (the first one the
harness declares is used) and how to read the harness's final answer.

The environment is built from scratch (PATH, HOME, locale, plus the harness's own variables), so no
credential or config of the machine reaches a harness, and HOME is a fresh directory per harness.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.harnesses.replay_engine import ScriptStep, ToolStep

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / ".bench" / "harnesses"
NPM_BIN = INSTALL / "npm" / "node_modules" / ".bin"
VERSIONS = {
    "claude-code": "2.1.332",
    "codex": "0.171.0",
    "opencode": "1.18.33",
    "openhands": "1.58.2",
    "mini-swe-agent": "2.4.6",
}  # fmt: skip  (setup.sh installs exactly these)
PROMPT = "Read the file notes.txt in the current directory and tell me the secret word it contains."
MINI_DONE = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@dataclass
class Task:
    """The tiny task every harness gets: a directory holding notes.txt with a secret word."""

    work: Path
    secret: str

    @property
    def notes(self) -> Path:
        """Absolute path of the file to read."""
        return self.work / "notes.txt"

    @property
    def answer(self) -> str:
        """The scripted final answer (and the line in notes.txt)."""
        return f"The secret word is {self.secret}."

    def write(self) -> None:
        """Create the work directory and the file."""
        self.work.mkdir(parents=True, exist_ok=True)
        self.notes.write_text(self.answer + "\n")


@dataclass
class Launch:
    """A harness process to start: argv, environment, working directory."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    config_files: dict[str, str] = field(default_factory=dict)  # path -> content written for it

    def shell(self) -> str:
        """The command line as one shell string (for the results file)."""
        return shlex.join(self.argv)


@dataclass(frozen=True)
class Endpoint:
    """What a user gives a harness: the gateway's base URL (no /v1), a key, a model name."""

    base_url: str
    api_key: str
    model: str


def base_env(home: Path) -> dict[str, str]:
    """A clean environment: PATH (with node), a private HOME, UTF-8 locale, no credentials."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": str(home),
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1"}  # fmt: skip


def _write(path: Path, text: str, launch_files: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    launch_files[str(path)] = text


def claude_code(ep: Endpoint, task: Task, home: Path, run: Path) -> Launch:
    """Claude Code in print mode: ANTHROPIC_BASE_URL + ANTHROPIC_API_KEY, `--model`."""
    env = base_env(home) | {"ANTHROPIC_BASE_URL": ep.base_url, "ANTHROPIC_API_KEY": ep.api_key}
    argv = [str(NPM_BIN / "claude"), "-p", PROMPT, "--model", ep.model]
    return Launch(argv, env, task.work)


def codex(ep: Endpoint, task: Task, home: Path, run: Path) -> Launch:
    """Codex CLI `exec`: a provider in $CODEX_HOME/config.toml with `wire_api = "responses"`."""
    files: dict[str, str] = {}
    codex_home = run / "codex-home"
    config = (f'model = "{ep.model}"\nmodel_provider = "harnessrl"\n\n[model_providers.harnessrl]\n'
              f'name = "harnessrl gateway"\nbase_url = "{ep.base_url}/v1"\nenv_key = "HARNESSRL_API_KEY"\n'
              'wire_api = "responses"\n')  # fmt: skip
    _write(codex_home / "config.toml", config, files)
    env = base_env(home) | {"CODEX_HOME": str(codex_home), "HARNESSRL_API_KEY": ep.api_key}
    argv = [str(NPM_BIN / "codex"), "exec", "--skip-git-repo-check", PROMPT]
    return Launch(argv, env, task.work, files)


def opencode(ep: Endpoint, task: Task, home: Path, run: Path) -> Launch:
    """OpenCode `run`: an OpenAI-compatible provider in the file $OPENCODE_CONFIG names."""
    files: dict[str, str] = {}
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"harnessrl": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "harnessrl gateway",
            "options": {"baseURL": f"{ep.base_url}/v1", "apiKey": "{env:HARNESSRL_API_KEY}"},
            "models": {ep.model: {"name": ep.model}},
        }},
        "model": f"harnessrl/{ep.model}",
    }  # fmt: skip
    path = run / "opencode.json"
    _write(path, json.dumps(config, indent=2) + "\n", files)
    env = base_env(home) | {"OPENCODE_CONFIG": str(path), "HARNESSRL_API_KEY": ep.api_key}
    return Launch([str(NPM_BIN / "opencode"), "run", PROMPT], env, task.work, files)


def openhands(ep: Endpoint, task: Task, home: Path, run: Path) -> Launch:
    """The OpenHands SDK's default agent (terminal, file editor, task tracker) in its own venv."""
    env = base_env(home) | {"LLM_BASE_URL": f"{ep.base_url}/v1", "LLM_API_KEY": ep.api_key,
                            "LLM_MODEL": f"openai/{ep.model}"}  # fmt: skip
    script = Path(__file__).with_name("openhands_agent.py")
    argv = [str(INSTALL / "venv-openhands" / "bin" / "python"), str(script), PROMPT]
    return Launch(argv, env, task.work)


def mini_swe_agent(ep: Endpoint, task: Task, home: Path, run: Path) -> Launch:
    """mini-swe-agent's `mini` (litellm): OPENAI_BASE_URL + OPENAI_API_KEY, `-m openai/<model>`."""
    env = base_env(home) | {"OPENAI_BASE_URL": f"{ep.base_url}/v1", "OPENAI_API_KEY": ep.api_key,
                            "MSWEA_CONFIGURED": "true"}  # fmt: skip
    argv = [str(INSTALL / "venv-mini" / "bin" / "mini"), "-m", f"openai/{ep.model}", "-t", PROMPT, "-y",
            "--exit-immediately", "-o", str(run / "trajectory.json")]  # fmt: skip
    return Launch(argv, env, task.work)


def _mini_answer(run: Path, stdout: str) -> str:
    path = run / "trajectory.json"
    if not path.exists():
        return ""
    info = json.loads(path.read_text()).get("info") or {}
    return str(info.get("submission") or "")


@dataclass(frozen=True)
class Harness:
    """One real harness: how to launch it, what it calls, how its answer is read."""

    name: str
    program: str
    version: str
    face: str  # the API it speaks to the gateway
    model: str  # the model name it is given (the gateway maps any name)
    launch: Callable[[Endpoint, Task, Path, Path], Launch]
    first_tools: Callable[[Task], list[ToolStep]]  # candidates for the scripted tool call
    last_step: Callable[[Task], ScriptStep] = lambda task: ScriptStep(text=task.answer)
    answer: Callable[[Path, str], str] = lambda run, stdout: stdout

    def script(self, task: Task, compact: bool = False) -> dict[str, object]:
        """The replay engine's script: a tool call first, then the final answer (tool calls in
        compact JSON with `compact`)."""
        steps = [ScriptStep(tools=self.first_tools(task)), self.last_step(task)]
        return {"steps": [s.model_dump() for s in steps], "fallback": "OK.", "compact": compact}


def _cat(task: Task) -> str:
    return f"cat {shlex.quote(str(task.notes))}"


HARNESSES: dict[str, Harness] = {h.name: h for h in [
    Harness("claude-code", "Claude Code (npm @anthropic-ai/claude-code)", VERSIONS["claude-code"],
            "anthropic /v1/messages", "claude-haiku-4-5", claude_code,
            lambda t: [ToolStep(name="Read", arguments={"file_path": str(t.notes)}),
                       ToolStep(name="Bash", arguments={"command": _cat(t), "description": "Read notes.txt"})]),
    Harness("codex", "Codex CLI (npm @openai/codex)", VERSIONS["codex"], "openai /v1/responses", "gpt-5-codex",
            codex,
            lambda t: [ToolStep(name="exec_command", arguments={"cmd": _cat(t)}),
                       ToolStep(name="shell_command", arguments={"command": _cat(t)}),
                       ToolStep(name="shell", arguments={"command": ["bash", "-lc", _cat(t)]})]),
    Harness("opencode", "OpenCode (npm opencode-ai)", VERSIONS["opencode"], "openai /v1/chat/completions",
            "smollm2", opencode,
            lambda t: [ToolStep(name="read", arguments={"filePath": str(t.notes)}),
                       ToolStep(name="bash", arguments={"command": _cat(t), "description": "Read notes.txt"})]),
    Harness("openhands", "OpenHands SDK (PyPI openhands-sdk + openhands-tools)", VERSIONS["openhands"],
            "openai /v1/chat/completions (litellm)", "smollm2", openhands,
            lambda t: [ToolStep(name="terminal", arguments={"command": _cat(t), "security_risk": "LOW"}),
                       ToolStep(name="file_editor", arguments={"command": "view", "path": str(t.notes),
                                                               "security_risk": "LOW"})],
            lambda t: ScriptStep(text=t.answer, tools=[ToolStep(name="finish", arguments={"message": t.answer})],
                                 require_tool=False)),
    Harness("mini-swe-agent", "mini-swe-agent (PyPI mini-swe-agent)", VERSIONS["mini-swe-agent"],
            "openai /v1/chat/completions (litellm)", "gpt-4o-mini", mini_swe_agent,
            lambda t: [ToolStep(name="bash", arguments={"command": _cat(t)})],
            lambda t: ScriptStep(tools=[ToolStep(name="bash", arguments={
                "command": f"echo {MINI_DONE} && echo {shlex.quote(t.answer)}"})]),
            _mini_answer),
]}  # fmt: skip
