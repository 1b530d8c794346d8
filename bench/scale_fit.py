"""What fits on this 24 GB CPU machine, measured rather than computed (docs/models.md's size table):

- `full`: one full-weight PPO update of the 1.5B-shaped model (`bench/scale_load.py`'s shape: hidden 1536,
  28 layers, GQA 12/2, MLP 8,960, vocab 49,152: 1.39 B parameters) with `train.dtype: bfloat16` —
  MasterAdamW's bf16 weights and gradients, int16 low halves and fp32 moments, 14 bytes a parameter. The
  optimizer state exists before the measured update (one step with zero gradients, as after a run's first
  update), so the peak holds it. The same update in fp32 needs 16 bytes a parameter (22 GB) before any
  activation and is not attempted: it does not fit beside the OS in 24 GB.
- `lora4b`: one LoRA update (r 8 on every linear projection, fp32 adapter and AdamW) of a Qwen3-4B-shaped
  model (hidden 2560, 36 layers, GQA 32/8, head_dim 128, q/k norm, MLP 9,728, vocab 151,936, tied: 4.0 B
  parameters), its base frozen in bf16.

Both use random weights (the shapes are what memory and time depend on), build the model on the meta device
and fill it in place, and run in a fresh process each, so a peak (VmHWM, reset after building) is its own.

    python bench/scale_fit.py [--parts full full_fp32 lora4b] [--tokens 512] --out bench/results/scale_fit.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.scale_common

from bench.scale_common import finish, reset_peak, run_json, status_mb

SHAPES: dict[str, dict[str, Any]] = {
    "full": {"vocab_size": 49152, "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 8960},
    "lora4b": {"vocab_size": 151936, "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
               "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728, "qk_norm": True,
               "rope_theta": 1e6, "rms_norm_eps": 1e-6},
}  # fmt: skip
SHAPES["full_fp32"] = SHAPES["full"]  # the same update in float32 (AdamW): 16 bytes a parameter


def build(part: str) -> Any:
    """The part's shape as a builtin CausalLM in bf16, random weights (norms 1), built on meta then filled."""
    import torch

    from harnessrl.modeling.causal_lm import CausalLM
    from harnessrl.modeling.transformer import ModelConfig

    dtype = torch.float32 if part == "full_fp32" else torch.bfloat16
    with torch.device("meta"):
        model = CausalLM(ModelConfig(**SHAPES[part])).to(dtype)
    model = model.to_empty(device="cpu")
    model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def one_row(tokens: int, vocab: int) -> Any:
    """One agent-shaped row: the first half prompt, the second half sampled (trainable) tokens."""
    import torch

    from harnessrl.adapter import Batch, LossMode, Row, loss_weights

    g = torch.Generator().manual_seed(1)
    toks = torch.randint(3, vocab - 1, (tokens,), generator=g).tolist()
    half = tokens // 2
    mask = [0] * half + [1] * (tokens - half)
    rows = [Row("r0", toks, mask, [-1.0 * m for m in mask], temperature=1.0)]
    return Batch(rows, [1.0], loss_weights(rows, LossMode.ROLLOUT_TOKEN_MEAN), {})


def phase(part: str, tokens: int) -> dict[str, Any]:
    """Build, make the optimizer state, then one measured PPO update: peak RSS and seconds."""
    import torch

    from harnessrl.modeling.lora import LoraSpec, attach
    from harnessrl.modeling.memory import release_freed_memory
    from harnessrl.modeling.packed import use_onednn_for_training
    from harnessrl.trainer.ppo import PPOConfig, ppo_update
    from harnessrl.trainer.precision import make_optimizer

    t0 = time.perf_counter()
    model = build(part)
    n_params = sum(p.numel() for p in model.parameters())
    matmul = use_onednn_for_training(model, "auto", torch.device("cpu"))  # as a run's train.matmul: auto
    if part == "lora4b":
        adapter = attach(model, LoraSpec(r=8, alpha=16.0), seed=0, base_model="qwen3-4b-shaped")
        trained = list(adapter.parameters())
        optimizer = make_optimizer(trained, torch.float32, lr=1e-4, weight_decay=0.0)
    else:
        trained = list(model.parameters())
        optimizer = make_optimizer(trained, trained[0].dtype, lr=1e-5, weight_decay=0.0)
    build_s = time.perf_counter() - t0
    for p in trained:  # the optimizer state, as after a first update (zero gradients move nothing)
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    release_freed_memory()
    batch = one_row(tokens, SHAPES[part]["vocab_size"])
    rss_before = status_mb("VmRSS")
    reset_peak()
    t1, c1 = time.perf_counter(), time.process_time()
    metrics = ppo_update(model, optimizer, batch, PPOConfig())
    return {
        "params": n_params, "trainable_params": sum(p.numel() for p in trained),
        "dtype": {"full": "bfloat16 (MasterAdamW)", "full_fp32": "float32 (AdamW)"}.get(part, "bfloat16 base, fp32 adapter"),
        "tokens": tokens, "matmul": matmul, "build_seconds": round(build_s, 1), "rss_before_update_mb": rss_before,
        "update_peak_mb": status_mb("VmHWM"), "update_seconds": round(time.perf_counter() - t1, 1),
        "update_cpu_seconds": round(time.process_time() - c1, 1), "grad_norm": metrics["grad_norm"],
        "bytes_per_param_at_peak": round(status_mb("VmHWM") * 2**20 / n_params, 2),
    }  # fmt: skip


def main() -> int:
    """Command line: see the module docstring."""
    if sys.argv[1:2] == ["--phase"]:
        print(json.dumps(phase(sys.argv[2], int(sys.argv[3]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=sorted(SHAPES), default=["full", "full_fp32", "lora4b"])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    prior: dict[str, Any] = {}
    if args.out is not None and args.out.is_file():
        prior = json.loads(args.out.read_text())
    res = {k: prior[k] for k in SHAPES if k in prior}
    for part in args.parts:
        res[part] = run_json(__file__, "--phase", part, str(args.tokens))
        print(f"{part}: {json.dumps(res[part])}", file=sys.stderr, flush=True)
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    res["machine_memory_gb"] = round(
        next(int(x.split()[1]) for x in meminfo if x.startswith("MemTotal:")) / 2**20, 1
    )
    return finish(res, args.out)


if __name__ == "__main__":
    sys.exit(main())
