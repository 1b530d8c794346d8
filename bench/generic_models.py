"""What the transformers path (modeling/hf_generic.py) costs and how exact it is, beside the builtin path.

Per architecture (tiny random Qwen3.5, Gemma 4 text, Qwen3-MoE drawn by transformers; a SmolLM2-shaped
Llama on both paths):
- engine vs trainer: max |logprob| gap between the engine's arithmetic (prefill, then one cached decode
  step per token) and the trainer's (one full forward, `selected_logprobs`) over greedy tokens;
- trainer vs transformers: the trainer's logprobs against transformers' own whole-model forward;
- MoE: how often the top-k experts of a token differ between the engine's and the trainer's pass.
On the SmolLM2-shaped model (30 layers, hidden 576, random weights: timing does not depend on them),
both paths: decode tok/s (1 and 4 sequences, 16 steps, the model's decode entry point, F.linear on
both), and one PPO update (4 rows x 160 tokens), in alternating rounds in one process, medians, and
the transformers path's figures as ratios to the builtin path's.

    PYTHONPATH=src:. python bench/generic_models.py [--threads 1] [--rounds 3] [--part all|exactness|speed]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.support.generic_families import generic_dir

from harnessrl.adapter import Batch, Row, loss_weights
from harnessrl.adapter.loss_weights import LossMode
from harnessrl.defaults import MODEL_IMPL_ENV
from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.loading import load_model, save_model, smollm2_tokenizer_dir
from harnessrl.modeling.transformer import ModelConfig
from harnessrl.trainer.forward import selected_logprobs
from harnessrl.trainer.ppo import PPOConfig, ppo_update

PROMPT = [2, *range(1000, 1031)]  # 32 tokens
STEPS = 16


def served(model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs through the engine's entry points (prefill, then decode)."""
    cache = model.new_cache(1, len(prompt) + steps + 1)
    tokens, lps = list(prompt), []
    with torch.no_grad():
        logits = model.prefill_many([(torch.tensor(prompt), 0, 0)], cache)
        for _ in range(steps):
            lp = logits[0].float().log_softmax(-1)
            tokens.append(int(lp.argmax()))
            lps.append(float(lp.max()))
            logits = model.decode(torch.tensor(tokens[-1:]), cache, torch.tensor([len(tokens) - 1]))
    return tokens, lps


def trainer_logprobs(model: Any, tokens: list[int], start: int) -> torch.Tensor:
    """The trainer's logprobs of tokens[start:] (one full forward)."""
    ids = torch.tensor([tokens])
    select = torch.zeros(1, len(tokens) - 1, dtype=torch.bool)
    select[0, start - 1 :] = True
    with torch.no_grad():
        return selected_logprobs(model, ids, select, torch.ones(1), 0).logprobs


def hf_logprobs(folder: Path, tokens: list[int], start: int) -> torch.Tensor:
    """transformers' own whole-model forward (the folder's class)."""
    import transformers

    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    hf = getattr(transformers, arch).from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        lp = hf(input_ids=ids).logits.float().log_softmax(-1)[0, :-1]
    return lp.gather(-1, ids[0, 1:, None])[start - 1 :, 0]


def routing(model: Any, run: Any) -> list[torch.Tensor]:
    """The top-k expert indices every MoE router chose during `run()`, in call order."""
    seen: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda _m, _a, out: seen.append(out[-1].detach().clone()))
        for n, m in model.named_modules()
        if n.endswith("mlp.gate") and type(m).__name__.endswith("Router")
    ]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def routing_flips(model: Any, tokens: list[int]) -> dict[str, float]:
    """Share of (token, layer) top-k expert sets that differ between the engine's and the trainer's pass."""
    layers = sum(1 for n, m in model.named_modules() if n.endswith("mlp.gate"))
    engine_calls = routing(model, lambda: served(model, tokens[: len(PROMPT)], STEPS))
    ids = torch.tensor([tokens])
    trainer_calls = routing(model, lambda: trainer_logprobs(model, tokens, len(PROMPT)))
    # engine: per layer, the prefill call then one call per decode step; trainer: one call per layer
    engine = [torch.cat(engine_calls[i::layers]) for i in range(layers)]
    flips = total = 0
    for e, t in zip(engine, trainer_calls, strict=True):
        n = min(e.shape[0], t.shape[0])
        flips += int((e[:n].sort(-1).values != t[:n].sort(-1).values).any(-1).sum())
        total += n
    del ids
    return {"routing_flip_share": flips / max(total, 1), "routed_token_layers": total}


def exactness(name: str, folder: Path) -> dict[str, Any]:
    """Engine-vs-trainer and trainer-vs-transformers gaps of one folder."""
    model = load_model(folder)
    tokens, lps = served(model, PROMPT, STEPS)
    trainer = trainer_logprobs(model, tokens, len(PROMPT))
    out: dict[str, Any] = {
        "path": "transformers" if getattr(model, "generic", False) else "builtin",
        "engine_vs_trainer_max": float((trainer - torch.tensor(lps)).abs().max()),
        "trainer_vs_transformers_max": float(
            (trainer - hf_logprobs(folder, tokens, len(PROMPT))).abs().max()
        ),
    }
    if getattr(getattr(model, "config", None), "moe", False):
        out.update(routing_flips(model, tokens))
    print(f"{name:22} {out}")
    return out


def smollm2_shaped(root: Path) -> Path:
    """A random Llama with SmolLM2-135M's shape and tokenizer (the builtin family's own writer)."""
    from tests.support.families import _randomize

    cfg = ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = CausalLM(cfg)
    _randomize(model, 0)  # wide weights (as the tiny test folders): logits far from uniform
    out = save_model(model, root / "smollm2-shaped")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((smollm2_tokenizer_dir() / f).read_bytes())
    return out


def load_as(folder: Path, impl: str) -> Any:
    """The folder's model through the path `impl` ("builtin" or "transformers")."""
    os.environ[MODEL_IMPL_ENV] = impl
    try:
        return load_model(folder)
    finally:
        os.environ.pop(MODEL_IMPL_ENV, None)


class Clock:
    """Wall and CPU seconds (this process, all threads) of the block inside."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *_: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def decode_rates(model: Any, batch: int, steps: int = 16) -> dict[str, float]:
    """Decode throughput over `batch` sequences of a 64-token prompt: tokens per wall second and per
    CPU second."""
    cache = model.new_cache(batch, 64 + steps + 1)
    prompts = [torch.arange(100 + 64 * i, 164 + 64 * i) for i in range(batch)]
    with torch.no_grad():
        model.prefill_many([(p, i, 0) for i, p in enumerate(prompts)], cache)
        tokens = torch.full((batch,), 5)
        with Clock() as c:
            for s in range(steps):
                logits = model.decode(tokens, cache, torch.full((batch,), 64 + s))
                tokens = logits.argmax(-1)
    return {
        f"decode_tok_per_cpu_s_{batch}": batch * steps / c.cpu,
        f"decode_tok_s_{batch}": batch * steps / c.wall,
    }


def update_seconds(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Wall and CPU seconds of one PPO update over 4 rows of 160 tokens (96 trainable)."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(4):
        tokens = torch.randint(3, 40000, (160,), generator=gen).tolist()
        mask = [0] * 64 + [1] * 96
        rows.append(Row(f"r{i // 2}", tokens, mask, [-2.0 * m for m in mask], 1.0))
    batch = Batch(rows, [1.0, -1.0, 0.5, -0.5], loss_weights(rows, LossMode.ROLLOUT_TOKEN_MEAN), {})
    with Clock() as c:
        ppo_update(model, optimizer, batch, PPOConfig())
    return {"update_cpu_s": c.cpu, "update_s": c.wall}


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def speed(folder: Path, rounds: int) -> dict[str, Any]:
    """Decode rates (1 and 4 sequences) and update seconds of both paths on the same folder, in
    alternating rounds in one process (builtin, transformers, builtin, ...), medians and their ratios.
    CPU seconds (`time.process_time`, one torch thread) are the work each path does, whatever share of
    a shared CPU the process got; wall seconds are kept beside them. The folder's weights are drawn as
    the builtin init draws them (std 0.02), not the wide test weights (which overflow over 30 layers
    into inf/subnormal arithmetic)."""
    torch.set_flush_denormal(True)
    model = CausalLM(load_model(folder).config)
    model.init_weights(0)
    save_model(model, folder)
    models = {impl: load_as(folder, impl) for impl in ("builtin", "transformers")}
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-6) for k, m in models.items()}
    runs: dict[str, dict[str, list[float]]] = {k: {} for k in models}
    for k, m in models.items():  # warm-up: first calls, optimizer state allocated
        decode_rates(m, 1, 2)
        update_seconds(m, optims[k])
    for r in range(rounds):
        for k, m in models.items():
            got = {**decode_rates(m, 1), **decode_rates(m, 4), **update_seconds(m, optims[k])}
            for name, value in got.items():
                runs[k].setdefault(name, []).append(value)
            shown = {n: round(v, 2) for n, v in got.items()}
            print(f"round {r} {k:12} {shown} load {os.getloadavg()[0]:.1f}", flush=True)
    out: dict[str, Any] = {k: {n: _median(v) for n, v in d.items()} | {"runs": d} for k, d in runs.items()}
    b, t = out["builtin"], out["transformers"]
    out["transformers_vs_builtin"] = {n: t[n] / b[n] for n in runs["builtin"]}
    print(out["transformers_vs_builtin"])
    return out


def threads_probe(repeat: int = 500) -> dict[str, Any]:
    """Wall and CPU ms of one decode-sized product (4 x 576 by 576 x 1536, F.linear) with 1 and 2 torch
    threads, alternated: what the thread count does to the small products of a decode step on this CPU
    as loaded now (a 2-thread OpenMP team waits at each product for a worker the kernel has descheduled)."""
    x, w = torch.randn(4, 576), torch.randn(1536, 576) * 0.02
    before = torch.get_num_threads()
    out: dict[str, list[float]] = {}
    try:
        for _ in range(3):
            for n in (1, 2):
                torch.set_num_threads(n)
                torch.nn.functional.linear(x, w)
                with Clock() as c:
                    for _ in range(repeat):
                        torch.nn.functional.linear(x, w)
                out.setdefault(f"wall_ms_{n}_threads", []).append(1000 * c.wall / repeat)
                out.setdefault(f"cpu_ms_{n}_threads", []).append(1000 * c.cpu / repeat)
    finally:
        torch.set_num_threads(before)
    result: dict[str, Any] = {k: _median(v) for k, v in out.items()} | {
        "runs": out,
        "load_avg_1m": os.getloadavg()[0],
    }
    result["wall_2_vs_1"] = result["wall_ms_2_threads"] / result["wall_ms_1_threads"]
    result["cpu_2_vs_1"] = result["cpu_ms_2_threads"] / result["cpu_ms_1_threads"]
    print("threads probe", {k: round(v, 3) for k, v in result.items() if k != "runs"})
    return result


def main() -> None:
    """Run every measurement, print them and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; 1 by default: on a shared, busy CPU a 2-thread OpenMP team "
        "waits at every parallel region for a descheduled worker (10-20x slower)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating speed rounds (medians)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/generic_models.json"))
    parser.add_argument("--part", choices=["all", "exactness", "speed", "threads"], default="all",
                        help="run one part only (its results replace that part of --out's)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="bench-generic-"))
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.is_file() else {}
    load_before = os.getloadavg()[0]
    smol = smollm2_shaped(root) if args.part in ("all", "exactness", "speed") else None
    if smol is not None and args.part in ("all", "exactness"):
        results["exactness"] = {
            name: exactness(name, generic_dir(name)) for name in ("qwen3_5", "gemma4", "qwen3_moe")
        }
        for impl in ("builtin", "transformers"):
            os.environ[MODEL_IMPL_ENV] = impl
            results["exactness"][f"smollm2_shaped_{impl}"] = exactness(f"smollm2_shaped_{impl}", smol)
            os.environ.pop(MODEL_IMPL_ENV, None)
    if args.part in ("all", "threads"):
        results["threads_probe"] = threads_probe()
    if smol is not None and args.part in ("all", "speed"):
        results["speed_smollm2_shaped"] = speed(smol, args.rounds)
    results.setdefault("machine_by_part", {})[args.part] = {
        "threads": args.threads, "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "load_avg_1m_start": load_before,
        "load_avg_1m_end": os.getloadavg()[0], "rounds": args.rounds,
        "command": "python bench/generic_models.py " + " ".join(sys.argv[1:]),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
