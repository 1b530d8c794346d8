"""bench/lora.py's `sync` phase: new weights into a live builtin engine on SmolLM2 through
`publish_weights`, as a run does after every update, the engine in its own process (as in a run), so
that its memory and CPU are its own.

`full`: one trainer process holds SmolLM2 in fp32 and in bf16 (`train.dtype`) with every weight changed,
and pushes them into one fp32 engine by each way in turn, `reps` rounds, interleaved so that the
machine's load falls on all alike (`reps` 5):
- file: the model written to a folder and loaded by path (`engine.weight_sync: file`, what main did);
- shm: from memory (`engine.weight_sync: memory`, the default) through a shared-memory segment, as the
  engine is on this machine;
- socket: from memory as the request body over the engine's admin socket (what a memory sync does when
  the engine cannot see the trainer's /dev/shm).
`lora`: an adapter with random (trained-like) B, a PEFT folder, `reps` syncs.

Per way: bytes moved (the folder written, or the safetensors bytes sent), median wall seconds, CPU
seconds of trainer and engine together, the engine's and the trainer's peak RSS above their RSS just
before the sync (VmHWM after `clear_refs`; a segment the engine maps counts in its RSS as it reads it),
the engine's peak RssAnon above before (its own heap) and peak RssShmem (the segment it maps), sampled
every 5 ms,
files written; then the engine-vs-trainer logprob gap on 4 x 48 sampled tokens after a last memory sync.
"""

from __future__ import annotations

import asyncio
import copy
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _status_kb(pid: int | str, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _reset_peak(pid: int | str) -> None:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    except OSError:
        pass


def _cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid`."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


WAYS = ("file", "shm", "socket")


def _changed(dtype: Any) -> Any:
    """SmolLM2 as the trainer holds it after a full update: every weight changed."""
    import torch

    from harnessrl.modeling.loading import load_model, resolve_model

    model = load_model(resolve_model("smollm2"), dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.001)
    return model


class Bench:
    """One engine process and the syncs into it, each measured."""

    def __init__(self, tmp: Path) -> None:
        from harnessrl.modeling.loading import resolve_model
        from harnessrl.services import free_port, start_engine

        threads = int(os.environ.get("BENCH_THREADS", "1"))
        self.tmp, self.version = tmp, 0
        self.engine = start_engine(resolve_model("smollm2"), free_port(), tmp / "logs", 2, 512, threads)
        self.engine.wait_healthy(1800)
        self.pid = self.engine.proc.pid

    def sync(self, model: Any, way: str, adapter: Any = None) -> dict[str, Any]:
        """One publish_weights by `way`, measured."""
        from harnessrl.modeling.weight_stream import WeightStream, sync_state
        from harnessrl.trainer.weights import EngineAdmin, publish_weights

        self.version += 1
        weights = self.tmp / "weights"
        admin = EngineAdmin(self.engine.url, weight_sync="file" if way == "file" else "memory")
        admin.shared_memory = way == "shm"
        rss = {"engine": _status_kb(self.pid, "VmRSS"), "trainer": _status_kb("self", "VmRSS")}
        _reset_peak(self.pid)
        _reset_peak("self")
        c0, e0 = time.process_time(), _cpu_seconds(self.pid)

        async def publish() -> float:
            try:
                return await publish_weights(model, admin, weights, self.version, adapter)
            finally:
                await admin.aclose()

        with _Sampler(self.pid) as sampled:
            wall = asyncio.run(publish())
        out = {"seconds": wall, "cpu_seconds": time.process_time() - c0 + _cpu_seconds(self.pid) - e0,
               "engine_rss_mb": rss["engine"] / 1024,
               "engine_peak_extra_mb": (_status_kb(self.pid, "VmHWM") - rss["engine"]) / 1024,
               "trainer_peak_extra_mb": (_status_kb("self", "VmHWM") - rss["trainer"]) / 1024,
               "engine_anon_peak_extra_mb": (sampled.peak["RssAnon"] - sampled.before["RssAnon"]) / 1024,
               "engine_shmem_peak_mb": sampled.peak["RssShmem"] / 1024,
               "transport": admin.transport if way != "file" else "file"}  # fmt: skip
        written = list(weights.glob("v*"))
        out["files_written"] = len(written)
        if way == "file":
            out["bytes"] = sum(p.stat().st_size for p in written[0].iterdir())
            out["tensor_bytes"] = _tensor_bytes(written[0])
        else:
            body = WeightStream(sync_state(model))
            out["bytes"], out["tensor_bytes"] = len(body), body.data_bytes
        return out

    def stop(self) -> None:
        """Stop the engine."""
        self.engine.stop()


class _Sampler:
    """The engine's RssAnon (its own heap) and RssShmem (shared memory it maps) every 5 ms while a sync
    runs: VmHWM counts both, so this splits the peak into what the engine allocates and what it maps."""

    KEYS = ("RssAnon", "RssShmem")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = {k: _status_kb(pid, k) for k in self.KEYS}
        self.peak = dict(self.before)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            for k in self.KEYS:
                self.peak[k] = max(self.peak[k], _status_kb(self.pid, k))

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    med = lambda key: round(statistics.median(r[key] for r in runs), 3)  # noqa: E731
    keys = (
        "seconds",
        "cpu_seconds",
        "engine_rss_mb",
        "engine_peak_extra_mb",
        "engine_anon_peak_extra_mb",
        "engine_shmem_peak_mb",
        "trainer_peak_extra_mb",
    )
    return {**{k: runs[-1][k] for k in ("transport", "bytes", "tensor_bytes", "files_written")},
            **{k: med(k) for k in keys}, "syncs": len(runs), "runs": runs}  # fmt: skip


def phase_sync(kind: str, attach: Callable[..., Any], reps: int = 5) -> dict[str, Any]:
    """`full`: every way x dtype, interleaved (module docstring); `lora`: the adapter's syncs."""
    import torch

    from harnessrl.modeling.loading import load_model, resolve_model

    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(Path(tmp))
        try:
            if kind == "lora":
                model = load_model(resolve_model("smollm2"))
                adapter = attach(model, seed=1, random_b=True)
                lora = _summary([bench.sync(model, "file", adapter) for _ in range(reps)])
                gaps, served = _gaps(bench.engine.url, model)
                trained = sum(p.numel() * p.element_size() for p in adapter.parameters())
                return {**lora, "trained_bytes": trained, "weight_version": served, **_gap_stats(gaps)}
            models = {"": _changed(torch.float32), "_bf16": _changed(torch.bfloat16)}
            runs: dict[str, list[dict[str, Any]]] = {}
            for _ in range(reps):
                for suffix, model in models.items():
                    for way in WAYS:
                        runs.setdefault(way + suffix, []).append(bench.sync(model, way))
            out: dict[str, Any] = {name: _summary(r) for name, r in runs.items()}
            for suffix, model in models.items():  # the engine's answers after a memory sync
                bench.sync(model, "shm")
                gaps, served = _gaps(bench.engine.url, copy.deepcopy(model).float())
                out["shm" + suffix].update(weight_version=served, **_gap_stats(gaps))
            for suffix, model in models.items():
                trained = sum(p.numel() * p.element_size() for p in model.parameters())
                for way in WAYS:
                    out[way + suffix]["trainer_dtype"] = str(next(model.parameters()).dtype).removeprefix(
                        "torch."
                    )
                    out[way + suffix]["trained_bytes"] = trained
            return out
        finally:
            bench.stop()


def _gap_stats(gaps: list[float]) -> dict[str, Any]:
    return {
        "logprob_gap_max": max(gaps),
        "logprob_gap_mean": sum(gaps) / len(gaps),
        "sampled_tokens": len(gaps),
    }


def _tensor_bytes(folder: Path) -> int:
    """Bytes of the tensors in a folder's safetensors files (headers and config left out)."""
    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - not a dict
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
    return total


def _gaps(url: str, model: Any, prompts: int = 4, tokens: int = 48) -> tuple[list[float], int]:
    """|engine logprob - trainer logprob| of every token sampled (T = 1) for `prompts` prompts."""
    import httpx
    import torch

    from harnessrl.modeling.logprobs import next_token_logprobs

    gaps: list[float] = []
    version = -1
    for i in range(prompts):
        body = {"prompt": [1, 4093, 198, 2683 + 7 * i, 314, 253, 1345], "max_tokens": tokens, "temperature": 1.0,
                "seed": i, "ignore_eos": True, "logprobs": 0}  # fmt: skip
        res = httpx.post(f"{url}/v1/completions", json=body, timeout=1800).json()  # a loaded machine
        choice, version = res["choices"][0], res["weight_version"]
        ids = torch.tensor([res["prompt_token_ids"] + choice["token_ids"]])
        with torch.no_grad():
            ours = next_token_logprobs(model(ids), ids, 1.0)[0, len(res["prompt_token_ids"]) - 1 :]
        gaps += (torch.tensor(choice["logprobs"]["token_logprobs"]) - ours).abs().tolist()
    return gaps, version
