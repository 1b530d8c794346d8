"""Checkpoints of the training state: model weights, optimizer, LR schedule, step, RNG states, loop
bookkeeping (for the async schedule: the next group index and the groups still in flight).

Layout: `<dir>/step-<n>/` is a complete Hugging Face model folder (config.json, model.safetensors, the
tokenizer files with the chat template, generation_config.json: modeling/hf_folder.py) that transformers
and vLLM load as it is, plus `state.json` (the loop state) and `training/optimizer.pt` (optimizer, LR
schedule, RNG states) kept apart from the model. A checkpoint is written into a temporary directory and
renamed, so a crash never leaves a half-written one. Checkpoints written before the `training/` folder
existed (optimizer.pt beside the weights) still resume.
With LoRA (`train.lora`) the checkpoint holds `adapter/` (a PEFT folder: what training resumes from,
its adapter_config.json naming the base folder) and `state.json`'s `base_model`, not a merged copy of
the model: a few MB a step instead of the whole model. `harnessrl export-model` merges it into the base
when a whole model folder is wanted. The optimizer state is the adapter's alone.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.hf_folder import save_hf_folder
from harnessrl.modeling.loading import load_weights_into, read_weights
from harnessrl.modeling.lora import LoraAdapter, is_peft_dir, read_peft, save_peft

TRAINING_STATE = Path("training") / "optimizer.pt"
ADAPTER_SUBDIR = "adapter"  # a LoRA run's adapter inside each checkpoint (PEFT layout)


def save_checkpoint(
    ckpt_dir: Path,
    step: int,
    model: CausalLM,
    optimizer: torch.optim.Optimizer | dict[str, Any],
    state: dict[str, Any],
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    lora: LoraAdapter | None = None,
) -> Path:
    """Write the checkpoint of `step` (the number of completed updates) atomically. `optimizer` may be
    an optimizer's state dict already gathered (a sharded trainer's, `trainer.fsdp`)."""
    final = ckpt_dir / f"step-{step}"
    tmp = ckpt_dir / f".step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if lora is not None:  # the adapter and the base folder's name: the base is not copied
        save_peft(lora, tmp / ADAPTER_SUBDIR, lora.base_model, step)
        state = {**state, "base_model": lora.base_model}
    else:
        save_hf_folder(model, tmp)
    (tmp / TRAINING_STATE).parent.mkdir()
    osd = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    torch.save(
        {
            "optimizer": osd,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(),
            "python_rng": random.getstate(),
        },
        tmp / TRAINING_STATE,
    )
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def checkpoint_due(step: int, last: int, every: int, stopping: bool = False) -> bool:
    """Whether the checkpoint after update `step` is written (`train.checkpoint_every`: `every`): every
    `every`-th step, the `last` one and the one a clean early stop ends on (`stopping`: a time budget),
    so `--resume` continues from exactly there; none with `every` 0."""
    return bool(every) and (step % every == 0 or step >= last or stopping)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The checkpoint with the highest step, or None."""
    if not ckpt_dir.exists():
        return None
    steps = [
        (int(p.name.split("-")[1]), p) for p in ckpt_dir.glob("step-*") if p.name.split("-")[1].isdigit()
    ]
    return max(steps)[1] if steps else None


def training_state_path(path: Path) -> Path:
    """Where a checkpoint keeps its optimizer, LR schedule and RNG states (`training/optimizer.pt`, or
    `optimizer.pt` beside the weights in a checkpoint from before `training/`)."""
    blob_path = path / TRAINING_STATE
    return blob_path if blob_path.is_file() else path / "optimizer.pt"


def load_checkpoint(
    path: Path,
    model: CausalLM,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    lora: LoraAdapter | None = None,
) -> dict[str, Any]:
    """Restore model (with `lora`: the adapter; the base is never changed), optimizer, LR schedule and
    RNG states in place; return the saved loop state (with `step`)."""
    if lora is not None:
        if not is_peft_dir(path / ADAPTER_SUBDIR):
            raise ValueError(
                f"{path} holds no LoRA adapter: it was written without train.lora; resume without it"
            )
        lora.load_peft_tensors(read_peft(path / ADAPTER_SUBDIR)[1])
    else:
        load_weights_into(model, read_weights(model, path))
    blob = torch.load(training_state_path(path), weights_only=False)
    optimizer.load_state_dict(blob["optimizer"])
    return restore_loop_state(path, blob, scheduler)


def restore_loop_state(
    path: Path, blob: dict[str, Any], scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
) -> dict[str, Any]:
    """Restore the LR schedule and RNG states of a checkpoint's `optimizer.pt` blob; return its loop state."""
    if scheduler is not None and blob.get("scheduler") is not None:
        scheduler.load_state_dict(blob["scheduler"])
    torch.set_rng_state(blob["torch_rng"])
    np.random.set_state(blob["numpy_rng"])
    random.setstate(blob["python_rng"])
    state: dict[str, Any] = json.loads((path / "state.json").read_text())
    return state


def prune_checkpoints(ckpt_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints."""
    steps = sorted(
        (int(p.name.split("-")[1]), p) for p in ckpt_dir.glob("step-*") if p.name.split("-")[1].isdigit()
    )
    for _, p in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
