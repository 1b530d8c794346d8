"""`harnessrl export-model RUN_DIR [--step N] --out DIR`: a run's checkpoint as a model folder to serve.

Every checkpoint (trainer/checkpoint.py) already is a complete Hugging Face folder; this command copies
the model part of one (the newest, or step N) to DIR without the training state (`state.json`,
`training/`), so DIR holds exactly config.json, model.safetensors, the tokenizer files with the chat
template and generation_config.json: `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and
`vllm serve DIR` take it as it is. A checkpoint written before checkpoints carried the tokenizer gets it
from the run's base model (`engine.model` in the run's config.json).

A run with several policies (`policies:`) checkpoints one adapter per policy (`policies/<name>/`) and
no merged model: `--policy NAME` writes the base model with that policy's adapter merged in. A LoRA run
(`train.lora`) checkpoints its adapter (`adapter/`) and no merged model either: the export merges it
into the base folder its adapter_config.json names (else the run's `engine.model`).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

from harnessrl.modeling.hf_folder import GENERATION_CONFIG, copy_assets
from harnessrl.modeling.loading import load_model, read_weights, resolve_model, save_model
from harnessrl.modeling.lora import ADAPTER_CONFIG, is_peft_dir, merge_peft_dir
from harnessrl.modeling.weight_files import WEIGHTS_FILE
from harnessrl.trainer.checkpoint import ADAPTER_SUBDIR, latest_checkpoint
from harnessrl.trainer.policies import POLICIES_SUBDIR

log = logging.getLogger(__name__)

TRAINING_ONLY = {"state.json", "training", "optimizer.pt"}


class ExportModelError(ValueError):
    """The run or step asked for has no checkpoint to export (the message names the fix)."""


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The checkpoint folder of `step` (None: the newest) under `run_dir/checkpoints`."""
    ckpt_dir = run_dir / "checkpoints"
    if step is None:
        found = latest_checkpoint(ckpt_dir)
        if found is None:
            raise ExportModelError(f"{ckpt_dir} holds no checkpoint; train the run first (harnessrl train)")
        return found
    path = ckpt_dir / f"step-{step}"
    if not any((path / p).exists() for p in ("config.json", POLICIES_SUBDIR, ADAPTER_SUBDIR)):
        kept = sorted(p.name for p in ckpt_dir.glob("step-*")) if ckpt_dir.is_dir() else []
        raise ExportModelError(f"--step {step}: no checkpoint {path}; kept: {kept or 'none'}")
    return path


def _base_model_dir(run_dir: Path) -> Path | None:
    """The run's base model folder from its config.json (None when unknown)."""
    try:
        model = json.loads((run_dir / "config.json").read_text())["engine"]["model"]
        return resolve_model(model)
    except (OSError, KeyError, TypeError, ValueError):
        return None


def export_model(run_dir: Path, out: Path, step: int | None = None, policy: str | None = None) -> Path:
    """Copy the model folder of a run's checkpoint to `out` (created; must not hold a model already);
    with several policies, the base model with `policy`'s adapter merged in."""
    src = find_checkpoint(run_dir, step)
    if (out / "config.json").exists():
        raise ExportModelError(f"--out {out} already holds a model; choose an empty or new folder")
    if (src / POLICIES_SUBDIR).is_dir() or policy is not None:
        return _export_policy(run_dir, src, out, policy)
    if is_peft_dir(src / ADAPTER_SUBDIR) and not (src / WEIGHTS_FILE).is_file():
        return _export_adapter(run_dir, src / ADAPTER_SUBDIR, out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in TRAINING_ONLY and f.is_file():
            shutil.copyfile(f, out / f.name)
    if not (out / "tokenizer.json").is_file():
        base = _base_model_dir(run_dir)
        if base is None:
            raise ExportModelError(f"{src} has no tokenizer and the run's base model is unknown")
        copy_assets(base, out)
    if not (out / GENERATION_CONFIG).is_file():
        log.warning("event=export_without_generation_config out=%s", out)
    log.info("event=model_exported checkpoint=%s out=%s", src, out)
    return out


def _export_adapter(run_dir: Path, adapter: Path, out: Path) -> Path:
    """A LoRA checkpoint's adapter merged into its base model, at `out`."""
    named = json.loads((adapter / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
    base = Path(named) if named and (Path(named) / "config.json").is_file() else _base_model_dir(run_dir)
    if base is None:
        raise ExportModelError(f"the base model of {adapter} is unknown ({named!r} is not a model folder)")
    model = load_model(base)
    save_model(model, out, merge_peft_dir(read_weights(model, base), adapter))
    copy_assets(base, out)
    log.info("event=lora_model_exported adapter=%s base=%s out=%s", adapter, base, out)
    return out


def _export_policy(run_dir: Path, src: Path, out: Path, policy: str | None) -> Path:
    """The run's base model with the adapter of `policy` (from checkpoint `src`) merged in, at `out`."""
    known = (
        sorted(p.name for p in (src / POLICIES_SUBDIR).iterdir()) if (src / POLICIES_SUBDIR).is_dir() else []
    )
    if not known:
        raise ExportModelError(f"--policy {policy}: {src} is a run with one policy; leave --policy out")
    if policy not in known:
        what = (
            "holds one adapter per policy; pass --policy NAME"
            if policy is None
            else f"has no policy {policy!r}"
        )
        raise ExportModelError(f"{src} {what} (its policies: {', '.join(known)})")
    base = _base_model_dir(run_dir)
    if base is None:
        raise ExportModelError(f"the base model of {run_dir} is unknown (no engine.model in its config.json)")
    model = load_model(base)
    state = merge_peft_dir(read_weights(model, base), src / POLICIES_SUBDIR / policy)
    save_model(model, out, state)
    copy_assets(base, out)
    log.info("event=policy_model_exported checkpoint=%s policy=%s out=%s", src, policy, out)
    return out


def main(argv: list[str]) -> int:
    """Entry point of `harnessrl export-model`; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="harnessrl export-model", description="write a run's checkpoint as a Hugging Face model folder"
    )
    parser.add_argument("run_dir", type=Path, help="the run directory (run_dir of its config)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write the model to")
    parser.add_argument("--policy", default=None,
                        help="a run with several policies: the policy whose adapter is merged into the base")  # fmt: skip
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        out = export_model(args.run_dir.expanduser(), args.out.expanduser(), args.step, args.policy)
    except ExportModelError as e:
        print(f"harnessrl export-model: {e}", file=sys.stderr)
        return 2
    print(f"model written to {out} (load it with AutoModelForCausalLM.from_pretrained or vllm serve)")
    return 0
