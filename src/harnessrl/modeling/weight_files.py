"""A model folder's weights, read lazily by its safetensors index, one tensor at a time.

A folder holds either `model.safetensors` or shards listed by `model.safetensors.index.json` (its
`weight_map`: tensor name -> shard file), as transformers writes them. `WeightReader` opens the files with
`safe_open` (memory-mapped) and reads a tensor only when asked, straight into the target dtype; a row
range of a tensor (`rows`) reads only those rows, for a rank that holds a shard of it. So loading a model
holds the model plus one tensor, never a second whole copy.

Some exporters write buffers that this code recomputes from config.json (`rotary_emb.inv_freq`); they are
skipped by name (`IGNORED`). Any other unknown or missing tensor is an error naming it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# tensors some checkpoints carry that are derived from config.json here (RoPE's inverse frequencies)
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def is_ignored(name: str) -> bool:
    """True for a tensor name that is skipped on load (a buffer recomputed from the config)."""
    return IGNORED.search(name) is not None


def weight_map(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for a .safetensors file or a model folder (its
    model.safetensors, else the shards its index names); ignored buffers left out."""
    p = Path(path)
    if p.is_file():
        files = {p: None}
    elif (p / WEIGHTS_FILE).is_file():
        files = {p / WEIGHTS_FILE: None}
    elif (p / INDEX_FILE).is_file():
        index = json.loads((p / INDEX_FILE).read_text())
        if not isinstance(index.get("weight_map"), dict):
            raise ValueError(f"{p / INDEX_FILE} has no weight_map")
        out = {name: p / file for name, file in index["weight_map"].items() if not is_ignored(name)}
        missing = sorted({f.name for f in out.values() if not f.is_file()})
        if missing:
            raise FileNotFoundError(f"{p / INDEX_FILE} names shards that are not there: {missing[:3]}")
        return out
    else:
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {p}")
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out.update({name: file for name in f.keys() if not is_ignored(name)})  # noqa: SIM118 - not a dict
    return out


class WeightReader:
    """Open shards of a model folder (or one file), reading tensors on demand; use as a context manager."""

    def __init__(self, path: str | Path) -> None:
        self.map = weight_map(path)
        self._stack = ExitStack()
        self._open: dict[Path, Any] = {}

    def __enter__(self) -> WeightReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._open.clear()

    def _file(self, name: str) -> Any:
        if name not in self.map:
            raise KeyError(f"no tensor {name!r} in the weights")
        file = self.map[name]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(str(file), framework="pt"))
        return self._open[file]

    def names(self) -> list[str]:
        """Every tensor name (ignored buffers left out)."""
        return list(self.map)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name` (no data read)."""
        return tuple(self._file(name).get_slice(name).get_shape())

    def get(self, name: str, dtype: torch.dtype | None = None, rows: slice | None = None) -> torch.Tensor:
        """Tensor `name` (only `rows` of its first dimension if given), in `dtype` if given."""
        f = self._file(name)
        t = f.get_tensor(name) if rows is None else f.get_slice(name)[rows]
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    def tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every (name, tensor), one read at a time."""
        for name in self.map:
            yield name, self.get(name, dtype)
