"""The `coding` harness: a thin launcher around the real, unmodified `mini-swe-agent` loop.

It knows nothing of harnessrl (standard library + `minisweagent` only) and follows the harness
contract: it reads the task from `HARNESSRL_TASK` (a statement and a repository as {path: text}),
writes the repository to `$HOME/repo` (unless the task's workspace already put it there), runs mini-swe-agent's own `DefaultAgent` there with its
builtin `mini.yaml` config (tool-calling bash agent, `LocalEnvironment` executing in the repository,
`LitellmModel` with model `openai/<MODEL>` whose base URL and key litellm takes from
`OPENAI_BASE_URL` / `OPENAI_API_KEY`; cost tracking set to ignore unknown models and the cost limit
off, the step limit on), then compares the repository with the original files (git is disabled in
the sandbox, so with difflib) and writes to `$HARNESSRL_OUTPUT`:

    patch.diff     unified diff of the agent's changes
    files/<path>   every changed or added file, as it is now
    changes.json   {"changed": [...], "added": [...], "deleted": [...], "exit_status": ..., ...}
    traj.json      mini-swe-agent's own trajectory file
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

MODEL = "openai/gpt-4o-mini"  # litellm's OpenAI-compatible provider; the gateway maps the name
STEP_LIMIT = 10
COMMAND_TIMEOUT_S = 30
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".git", ".mypy_cache", ".ruff_cache"}
MAX_FILE_BYTES = 1 << 20


def _prepare_env(home: Path) -> None:
    """Settings mini-swe-agent and litellm read at import: no startup banner, a writable config dir,
    litellm's bundled model-cost map (no download: the sandbox has no network but the gateway)."""
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", str(home / ".config" / "mini-swe-agent"))
    os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def write_repo(root: Path, files: dict[str, str]) -> None:
    """Write the task's repository under `root`."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def read_repo(root: Path) -> dict[str, str]:
    """The repository's text files now ({relative path: text}), caches and binaries left out."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath, name)
            if name.endswith((".pyc", ".pyo")) or path.is_symlink() or path.stat().st_size > MAX_FILE_BYTES:
                continue
            try:
                out[path.relative_to(root).as_posix()] = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
    return out


def diff_repo(before: dict[str, str], after: dict[str, str]) -> tuple[str, dict[str, list[str]]]:
    """(unified diff, {"changed", "added", "deleted"} paths) between two repository snapshots."""
    changes: dict[str, list[str]] = {"changed": [], "added": [], "deleted": []}
    parts: list[str] = []
    for rel in sorted(set(before) | set(after)):
        old, new = before.get(rel), after.get(rel)
        if old == new:
            continue
        key = "added" if old is None else "deleted" if new is None else "changed"
        changes[key].append(rel)
        parts += difflib.unified_diff(
            (old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True),
            fromfile="/dev/null" if old is None else f"a/{rel}", tofile="/dev/null" if new is None else f"b/{rel}",
        )  # fmt: skip
    return "".join(p if p.endswith("\n") else p + "\n" for p in parts), changes


def run_agent(statement: str, repo: Path, output: Path, step_limit: int) -> dict[str, Any]:
    """Run mini-swe-agent's own loop on the statement in `repo`; returns its exit info."""
    from minisweagent.agents import get_agent
    from minisweagent.config import get_config_from_spec
    from minisweagent.environments import get_environment
    from minisweagent.models import get_model

    config = get_config_from_spec("mini.yaml")  # the package's own config of its `mini` CLI
    agent_cfg = {**config.get("agent", {}), "step_limit": step_limit, "cost_limit": 0.0,
                 "output_path": output / "traj.json"}  # fmt: skip
    agent_cfg.pop("mode", None)  # the interactive agent's setting; the default agent never asks
    model_cfg = {**config.get("model", {}), "model_name": MODEL, "cost_tracking": "ignore_errors"}
    env_cfg = {**config.get("environment", {}), "cwd": str(repo), "timeout": COMMAND_TIMEOUT_S}
    model = get_model(config=model_cfg)
    env = get_environment(env_cfg, default_type="local")
    agent = get_agent(model, env, agent_cfg, default_type="default")
    try:
        info = agent.run(statement)
    except Exception as e:  # the loop re-raises what it did not handle; the attempt is still graded
        info = {"exit_status": type(e).__name__, "error": str(e), "traceback": traceback.format_exc()[-4000:]}
    return {"exit_status": info.get("exit_status", ""), "error": info.get("error"),
            "n_calls": getattr(agent, "n_calls", 0)}  # fmt: skip


def write_outputs(
    output: Path, before: dict[str, str], after: dict[str, str], info: dict[str, Any]
) -> dict[str, list[str]]:
    """Write patch.diff, files/<path> of every changed or added file and changes.json; returns the
    changed/added/deleted paths."""
    patch, changes = diff_repo(before, after)
    (output / "patch.diff").write_text(patch)
    for rel in changes["changed"] + changes["added"]:
        dest = output / "files" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(after[rel])
    (output / "changes.json").write_text(json.dumps({**changes, **info}, indent=1))
    return changes


def main() -> int:
    """Entry point: solve the task in $HARNESSRL_TASK, write the diff and files to $HARNESSRL_OUTPUT."""
    if "HARNESSRL_TASK" not in os.environ:
        print("error: HARNESSRL_TASK is not set; the controller starts this harness", file=sys.stderr)
        return 2
    task = json.loads(Path(os.environ["HARNESSRL_TASK"]).read_text())
    output = Path(os.environ["HARNESSRL_OUTPUT"])
    home = Path(os.environ.get("HOME") or Path.cwd())
    repo = home / "repo"
    _prepare_env(home)
    files: dict[str, str] = task["files"]
    if not repo.is_dir():  # the controller puts it there first when the task has a workspace
        write_repo(repo, files)
    info = run_agent(task["statement"], repo, output, int(task.get("step_limit", STEP_LIMIT)))
    changes = write_outputs(output, files, read_repo(repo), info)
    n_changed = len(changes["changed"] + changes["added"] + changes["deleted"])
    print(f"mini-swe-agent exit={info['exit_status']} calls={info['n_calls']} files_changed={n_changed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
