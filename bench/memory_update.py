"""The PPO update alone, on a fixed batch shaped like a demo step: RSS before, peak during and after.

SmolLM2-135M-Instruct trained as `harnessrl demo` trains it (oneDNN matmuls when the probe accepts them,
AdamW, `micro_batch_tokens` 4096) on one batch of 4 groups × 8 rows with the shapes of the calc
example's rows (a 337-token prompt whose first 300 tokens every group shares, a first completion of
20-96 tokens, a tool result, a second completion), random token ids and non-zero advantages, so every
row runs. Unlike the run of `bench/memory.py` the batch does not depend on sampled rewards, so trees
can be compared update for update (`--tree`: another checkout's `src/`, e.g. the commit before).

    python bench/memory_update.py --updates 2 [--checkpoint-layers auto|on|off] [--out FILE --label NAME]

`--checkpoint-layers` passes `checkpoint_layers` to `ppo_update` (on/off; auto: its default); `--matmul` is
`train.matmul` (aten: no packed weight copies, slower products).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MB = 1024 * 1024


def _kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _tensor_mb(tensors: Iterator[Any]) -> float:
    import torch

    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        if t.is_mkldnn:
            total += t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return round(total / MB, 1)


def torch_view(model: Any, optimizer: Any) -> dict[str, float]:
    """MB of parameters, gradients, optimizer state and packed oneDNN copies the trainer holds now."""
    params = list(model.parameters())
    packed = (v for m in model.modules() for fwd in [m.__dict__.get("forward")] if fwd is not None
              for v in vars(fwd).values())  # fmt: skip
    return {
        "params_mb": _tensor_mb(iter(params)),
        "grads_mb": _tensor_mb(p.grad for p in params if p.grad is not None),
        "optimizer_state_mb": _tensor_mb(v for s in optimizer.state.values() for v in s.values()),
        "packed_copies_mb": _tensor_mb(packed),
    }


@contextlib.contextmanager
def saved_activations(record: list[float], exclude: set[int]) -> Iterator[None]:
    """Count the bytes autograd saves for backward inside the block (unique storages, parameters
    excluded); appends the MB to `record`."""
    import torch

    seen: set[int] = set(exclude)
    total = [0]

    def pack(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not t.is_mkldnn and t.numel():
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total[0] += s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
    record.append(round(total[0] / MB, 1))


def demo_like_batch(seed: int = 0) -> Any:
    """4 groups × 8 rows shaped like the calc example's (see the module docstring)."""
    from harnessrl.adapter import Batch, LossMode, Row, loss_weights

    rnd = random.Random(seed)
    tok = lambda n: [rnd.randint(3, 49000) for _ in range(n)]  # noqa: E731
    system = tok(300)
    rows = []
    for g in range(4):
        prompt = system + tok(37)
        for k in range(8):
            first, obs, second = tok(rnd.randint(20, 96)), tok(rnd.randint(10, 20)), tok(rnd.randint(5, 60))
            tokens = prompt + first + obs + second
            mask = [0] * len(prompt) + [1] * len(first) + [0] * len(obs) + [1] * len(second)
            old = [rnd.uniform(-3.0, -0.01) * m for m in mask]
            rows.append(Row(f"r{g}-{k}", tokens, mask, old, temperature=1.0))
    advantages = [rnd.choice((-1.0, 1.0)) * rnd.uniform(0.2, 1.5) for _ in rows]
    return Batch(rows, advantages, loss_weights(rows, LossMode.ROLLOUT_TOKEN_MEAN), {})


def profile(updates: int, checkpoint_layers: str = "auto", matmul: str = "auto") -> dict[str, Any]:
    """Load SmolLM2 as the demo's trainer does and run `updates` PPO updates on the batch."""
    import torch

    from harnessrl.modeling.loading import load_model, resolve_model
    from harnessrl.modeling.packed import use_onednn_for_training
    from harnessrl.trainer.ppo import PPOConfig, ppo_update

    torch.manual_seed(0)
    batch = demo_like_batch()
    rss0 = _kb("VmRSS")
    model = load_model(resolve_model("smollm2"))
    path = use_onednn_for_training(model, matmul, torch.device("cpu"))  # type: ignore[arg-type]
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    kwargs: dict[str, Any] = {}
    if checkpoint_layers != "auto":
        if "checkpoint_layers" not in inspect.signature(ppo_update).parameters:
            raise SystemExit("this tree's ppo_update has no checkpoint_layers")
        kwargs["checkpoint_layers"] = checkpoint_layers == "on"
    out: dict[str, Any] = {"matmul": path, "checkpoint_layers": checkpoint_layers,
                           "rss_torch_imported_mb": round(rss0 / 1024, 1),
                           "rss_model_loaded_mb": round(_kb("VmRSS") / 1024, 1), "updates": []}  # fmt: skip
    for _ in range(updates):
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before, t0 = _kb("VmRSS"), time.perf_counter()
        metrics = ppo_update(model, opt, batch, PPOConfig(micro_batch_tokens=4096), **kwargs)
        out["updates"].append({
            "seconds": round(time.perf_counter() - t0, 1), "rss_before_mb": round(before / 1024, 1),
            "rss_peak_mb": round(_kb("VmHWM") / 1024, 1), "rss_after_mb": round(_kb("VmRSS") / 1024, 1),
            "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "torch_after": torch_view(model, opt),
        })  # fmt: skip
    out["rows"], out["tokens"] = len(batch.rows), sum(len(r.tokens) for r in batch.rows)
    out["trainable_tokens"] = batch.n_trainable_tokens
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=2)
    p.add_argument("--checkpoint-layers", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--matmul", choices=["auto", "onednn", "aten"], default="auto", help="as train.matmul")
    p.add_argument("--out", type=Path, help="merge the result into this JSON file (key update_profile)")
    p.add_argument("--label", default="after")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = profile(args.updates, args.checkpoint_layers, args.matmul)
    if args.out:
        data = json.loads(args.out.read_text()) if args.out.is_file() else {}
        data.setdefault("update_profile", {})[args.label] = result
        args.out.write_text(json.dumps(data, indent=2) + "\n")
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
