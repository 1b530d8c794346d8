"""Several policies in one run (`policies:`, docs/lora.md): one LoRA adapter per policy on the shared,
frozen base, each with its own AdamW state and LR schedule.

An update splits the batch by the policy of each row (the policy of the calls merged into it) and
runs one PPO update per policy with only that policy's adapter switched on:

    L = Σ_p L_p,    L_p = Σ_{rows i of p} Σ_t w_{i,t} ℓ_{i,t}

The loss weights w and the advantages are the whole batch's (rollout-level advantages stay per
rollout, `rollout-token-mean` counts a rollout's tokens over all its rows), so ∂L/∂θ_p = ∂L_p/∂θ_p:
each policy's update is the joint loss's gradient for its adapter. A policy's optimizer holds its
adapter's parameters alone and the other adapters are switched off during its forward, so its update
cannot move another policy's adapter.

Weight sync pushes every adapter under its policy's name with the update's version (the engine serves
them per request, modeling/served_lora.py); checkpoints hold each policy's PEFT folder and training
state under `policies/<name>/`.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harnessrl.adapter import Batch
from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.lora import LoraAdapter, read_peft, save_peft
from harnessrl.trainer.ppo import PPOConfig, ppo_update
from harnessrl.trainer.weights import EngineAdmin

log = logging.getLogger(__name__)
POLICIES_SUBDIR = "policies"  # in a checkpoint and in the run's weights folder


@dataclass
class PolicyState:
    """One policy: its adapter (hooked into the shared model), optimizer and LR schedule."""

    name: str
    adapter: LoraAdapter
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None


def only(policies: dict[str, PolicyState], name: str | None) -> None:
    """Switch on the adapter of policy `name` alone (None: every adapter off, the base model)."""
    for p in policies.values():
        p.adapter.enabled = p.name == name


def policies_update(
    model: CausalLM,
    policies: dict[str, PolicyState],
    batch: Batch,
    cfg: PPOConfig,
    ref_model: CausalLM | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """One PPO update per policy on its rows (every policy's schedule advances, rows or not); rows of
    no known policy are left out and counted. Returns the summed loss, the joint gradient norm and
    each policy's metrics under `policies`."""
    by_policy = batch.policy_rows()
    unknown = sum(len(ix) for name, ix in by_policy.items() if name not in policies)
    per: dict[str, dict[str, float]] = {}
    try:
        for name, state in policies.items():
            only(policies, name)
            per[name] = ppo_update(model, state.optimizer, batch.select(by_policy.get(name, [])), cfg,
                                   ref_model, state.scheduler, progress)  # fmt: skip
            per[name]["rows"] = float(len(by_policy.get(name, [])))
    finally:
        only(policies, None)
    if unknown:
        log.warning("event=rows_of_no_policy rows=%d policies=%s", unknown, list(policies))
    return {
        "loss": sum(m["loss"] for m in per.values()),
        "grad_norm": math.sqrt(sum(m["grad_norm"] ** 2 for m in per.values())),
        "clip_frac": max((m["clip_frac"] for m in per.values()), default=0.0),
        "mismatch": max((m["mismatch"] for m in per.values()), default=0.0),
        "rows_of_no_policy": unknown,
        "policies": per,
    }


async def publish_policies(
    policies: dict[str, PolicyState], engine: EngineAdmin, weights_dir: Path, version: int
) -> None:
    """Push every policy's adapter to the engine under its name, as `version` (older versions deleted)."""
    for name, state in policies.items():
        target = weights_dir / POLICIES_SUBDIR / name / f"v{version}"
        save_peft(state.adapter, target, state.adapter.base_model, version)
        loaded = await engine.load_weights(target, version, adapter=name)
        if loaded != version:
            raise RuntimeError(
                f"engine reports version {loaded} for adapter {name!r} after loading {version}"
            )
        for old in target.parent.glob("v*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
    log.info("event=policies_published version=%d policies=%s", version, list(policies))


def save_policies_checkpoint(
    ckpt_dir: Path, step: int, policies: dict[str, PolicyState], state: dict[str, Any]
) -> Path:
    """Write checkpoint `step-N/` atomically: `policies/<name>/` (PEFT folder + `training.pt` with the
    optimizer and schedule), the RNG states and `state.json`. The frozen base is the run's model folder."""
    final, tmp = ckpt_dir / f"step-{step}", ckpt_dir / f".step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for name, p in policies.items():
        folder = save_peft(p.adapter, tmp / POLICIES_SUBDIR / name, p.adapter.base_model, step)
        sched = p.scheduler.state_dict() if p.scheduler is not None else None
        torch.save({"optimizer": p.optimizer.state_dict(), "scheduler": sched}, folder / "training.pt")
    rng = {
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
    }
    torch.save(rng, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def load_policies_checkpoint(path: Path, policies: dict[str, PolicyState]) -> dict[str, Any]:
    """Restore every policy's adapter, optimizer and schedule, and the RNG states; the loop state."""
    for name, p in policies.items():
        folder = path / POLICIES_SUBDIR / name
        if not (folder / "training.pt").is_file():
            raise ValueError(
                f"{path} holds no adapter of policy {name!r}: it was written with other policies"
            )
        p.adapter.load_peft_tensors(read_peft(folder)[1])
        blob = torch.load(folder / "training.pt", weights_only=False)
        p.optimizer.load_state_dict(blob["optimizer"])
        if p.scheduler is not None and blob["scheduler"] is not None:
            p.scheduler.load_state_dict(blob["scheduler"])
    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch_rng"])
    np.random.set_state(rng["numpy_rng"])
    random.setstate(rng["python_rng"])
    loop: dict[str, Any] = json.loads((path / "state.json").read_text())
    return loop
