"""Tensors of a model folder that transformers does not load, carried into the folders a run writes.

Qwen3.5's released folders hold a multi-token-prediction head (`mtp.*`) that transformers' model has no
module for: `save_pretrained` would drop it, and a checkpoint would no longer be the folder the user
brought. `copy_unloaded_tensors` copies every top-level group of tensors (`mtp.` ...) of the source that
the written folder lacks entirely, unchanged, as one more shard listed in the safetensors index. Groups
the written folder has (`model.`, `lm_head.`) are never copied, so a tensor transformers renamed on load
cannot come back twice.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def folder_keys(folder: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file of `folder` holding it."""
    out: dict[str, str] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({k: f.name for k in s.keys()})  # noqa: SIM118 - safe_open has no __iter__
    return out


def unloaded_groups(source: dict[str, str], written: dict[str, str]) -> list[str]:
    """Names of `source` whose top-level group (text before the first dot) `written` lacks entirely."""
    groups = {k.split(".", 1)[0] for k in written}
    return sorted(k for k in source if k.split(".", 1)[0] not in groups)


def copy_unloaded_tensors(source_dir: Path, out: Path) -> list[str]:
    """Copy the tensors of `source_dir` that transformers left out (see the module docstring) into `out`
    as `model-extra.safetensors`, indexed; returns their names."""
    if source_dir.resolve() == out.resolve():
        return []
    source, written = folder_keys(source_dir), folder_keys(out)
    missing = unloaded_groups(source, written)
    if not missing:
        return []
    tensors = {}
    for name in missing:
        with safe_open(str(source_dir / source[name]), "pt") as s:
            tensors[name] = s.get_tensor(name)
    extra = "model-extra.safetensors"
    save_file(tensors, str(out / extra), metadata={"format": "pt"})
    if (out / SINGLE).is_file() and not (out / INDEX).is_file():
        renamed = "model-main.safetensors"
        (out / SINGLE).rename(out / renamed)
        written = {k: renamed for k in written}
    index = json.loads((out / INDEX).read_text()) if (out / INDEX).is_file() else {"metadata": {}}
    weight_map = {**index.get("weight_map", written), **{k: extra for k in missing}}
    index["weight_map"] = weight_map
    (out / INDEX).write_text(json.dumps(index, indent=2))
    return missing
