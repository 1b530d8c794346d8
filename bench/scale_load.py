"""Loading a model onto FSDP ranks, 2 ranks vs 1 (`fsdp_load_rank_peak_mb_ratio`): part of `make bench-scale`
(`bench/scale.py`), or alone:

    python bench/scale_load.py --out bench/results/scale_load.json

The model is 1.5B-shaped (Qwen2.5-1.5B's layers: hidden 1536, 28 layers, 12 heads / 2 KV heads,
intermediate 8960; SmolLM2's 49,152-token vocabulary, tied: 1.39 B parameters), random bf16 weights written
once as one shard per layer plus `model.safetensors.index.json`. Each rank does what a `train.parallel: fsdp`
rank does at start (`trainer/fsdp.py`): the policy built on the meta device, sharded (fp32 master shards),
its own rows read from the index (`fill_shards`). Per-rank peak RSS (VmHWM) with 1 rank and with 2, in
fresh processes over gloo; and, for scale, `load_model` of the whole model in one process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.scale_common

from bench.scale_common import finish, run_json, status_mb

SHAPE = {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "intermediate": 8960, "vocab": 49152}


def write_model(out: Path) -> Path:
    """The 1.5B-shaped folder: config.json + a shard per layer + the index (one layer in memory at a time)."""
    import torch
    from safetensors.torch import save_file

    from harnessrl.modeling.causal_lm import CausalLM
    from harnessrl.modeling.families import config_to_hf
    from harnessrl.modeling.transformer import ModelConfig

    if (out / "model.safetensors.index.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    s = SHAPE
    cfg = ModelConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                      head_dim=s["hidden"] // s["heads"], intermediate_size=s["intermediate"])  # fmt: skip
    with torch.device("meta"):
        model = CausalLM(cfg)
    gen = torch.Generator().manual_seed(0)
    groups: dict[str, dict[str, Any]] = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        part = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        groups.setdefault(part, {})[name] = p.shape
    weight_map = {}
    for part, shapes in groups.items():
        file = f"model-{part}.safetensors"
        tensors = {
            n: (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16) for n, shape in shapes.items()
        }
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    hf = config_to_hf(cfg)
    hf["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def rank_main(rank: int, world: int, port: int, model_dir: str) -> dict[str, Any]:
    """One rank: meta model, sharded, filled with its own rows; its peak RSS and parameter bytes."""
    import torch
    import torch.distributed as dist

    from harnessrl.trainer.fsdp import fill_shards, local_state_bytes, meta_model, shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = meta_model(model_dir)
    shard(model, device=torch.device("cpu"))
    fill_shards(model, model_dir, torch.device("cpu"))
    held = local_state_bytes(model, torch.optim.SGD(model.parameters(), lr=0.0))["params"]
    dist.destroy_process_group()
    return {"rank": rank, "peak_mb": status_mb("VmHWM"), "param_mb": held // 2**20}


def whole_main(model_dir: str) -> dict[str, Any]:
    """`load_model` of the whole model in fp32 in one process: its peak RSS."""
    from harnessrl.modeling.loading import load_model

    model = load_model(model_dir)
    return {"peak_mb": status_mb("VmHWM"), "params": sum(p.numel() for p in model.parameters())}


def _run(world: int, model_dir: Path) -> list[dict[str, Any]]:
    from harnessrl.services import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(world), str(port), str(model_dir)],
                              stdout=subprocess.PIPE, text=True) for r in range(world)]  # fmt: skip
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: {[p.returncode for p in procs]}")
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def bench_load(model_dir: Path) -> dict[str, Any]:
    """The figures of the module docstring."""
    one = _run(1, model_dir)
    two = _run(2, model_dir)
    try:
        whole = run_json(__file__, "--whole", str(model_dir))
    except RuntimeError as exc:  # the whole fp32 model may not fit where the shards do
        whole = {"error": str(exc)[-500:]}
    return {"shape": SHAPE, "one_rank": one, "two_ranks": two, "load_model_whole": whole,
            "fsdp_load_rank_peak_mb_ratio": round(max(r["peak_mb"] for r in two) / one[0]["peak_mb"], 3)}  # fmt: skip


def main() -> int:
    """Command line: see the module docstring."""
    if sys.argv[1:2] == ["--rank"]:
        rank, world, port, model_dir = sys.argv[2:6]
        print(json.dumps(rank_main(int(rank), int(world), int(port), model_dir)))
        return 0
    if sys.argv[1:2] == ["--whole"]:
        print(json.dumps(whole_main(sys.argv[2])))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "harnessrl-1.5b-shaped")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    return finish(bench_load(write_model(args.model_dir)), args.out)


if __name__ == "__main__":
    sys.exit(main())
