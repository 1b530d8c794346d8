"""One sharded update with ranks started by torchrun, checked against the same update in one process.

Rank 0 (this script) joins the ranks torchrun started (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT),
sends them the settings, runs one PPO update with `train.parallel` sharded (`--parallel`, default fsdp)
and compares the gathered weights with a 1-process update from the same weights. The other ranks run
`python -m harnessrl.trainer.rank` with no arguments (or this script: a rank other than 0 serves).
Two "nodes" on this machine, rendezvous over loopback:

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank 1 --master-addr 127.0.0.1 --master-port 29511 \\
        -m harnessrl.trainer.rank &
    torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 --master-addr 127.0.0.1 --master-port 29511 \\
        bench/torchrun_update.py --model-dir MODEL_DIR

On one machine with k GPUs (bf16 compute and fp32 reduction: expect differences near 1e-3, not 1e-5):

    torchrun --standalone --nproc-per-node 2 bench/torchrun_update.py --model-dir DIR --device cuda --tol 1e-2

Prints one JSON line (`max_weight_diff`, `weight_change` of the update, `ranks`, `loss`, `loss_1rank`); exits 1 when the difference exceeds `--tol`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.scale


def main() -> int:
    """Rank 0 of a torchrun launch: one update on all ranks, compared with one process."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="fsdp")
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: one GPU per rank (bf16 compute with fsdp)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if int(os.environ["RANK"]) != 0:  # `torchrun --nproc-per-node k` runs this script on every rank
        from harnessrl.trainer.distributed import serve_from_env

        serve_from_env()
        return 0
    import torch
    from bench.scale import demo_batch

    from harnessrl.modeling.loading import load_model
    from harnessrl.trainer.distributed import DataParallel
    from harnessrl.trainer.ppo import PPOConfig, ppo_update

    batch, cfg = demo_batch(2, 3, seed=31), PPOConfig(micro_batch_tokens=1024)  # several micro-batches
    device = "cuda:0" if args.device.startswith("cuda") else "cpu"
    single = load_model(args.model_dir, device=device)
    one = ppo_update(single, torch.optim.AdamW(single.parameters(), lr=1e-3), batch, cfg)
    model = load_model(args.model_dir, device=device)
    world = int(os.environ["WORLD_SIZE"])
    dp = DataParallel(model, torch.optim.AdamW(model.parameters(), lr=1e-3), Path(args.model_dir), world,
                      threads=1, parallel=args.parallel)  # fmt: skip
    try:
        metrics = dp.update(batch, cfg)
        gathered = dp.full_model().state_dict()
    finally:
        dp.close()
    ref, init = single.state_dict(), load_model(args.model_dir, device=device).state_dict()
    diff = max(float((ref[k].cpu() - gathered[k].cpu()).abs().max()) for k in gathered)
    moved = max(float((ref[k] - init[k]).abs().max()) for k in gathered)
    print(json.dumps({"max_weight_diff": diff, "weight_change": moved, "ranks": metrics["ranks"],
                      "loss": metrics["loss"], "loss_1rank": one["loss"], "parallel": args.parallel}), flush=True)  # fmt: skip
    return 0 if diff <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
