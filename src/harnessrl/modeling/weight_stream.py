"""Weights as one safetensors-format byte stream, written and read a chunk at a time: the full-weight
sync from the trainer to the builtin engine over its admin socket, with no file in between (on one
machine the same bytes go through a shared-memory segment instead: modeling/weight_shm.py).

The body is exactly what `safetensors.torch.save` would produce (an 8-byte little-endian header length,
a JSON header naming every tensor's dtype, shape and byte range, then the tensors' bytes back to back),
so any safetensors reader can read a captured body. The writer (`WeightStream`) yields the header and
then each tensor's bytes in chunks of `CHUNK_BYTES`, straight from the tensor's memory: its extra memory
is one chunk (plus one tensor moved to the CPU, for a model on an accelerator). The reader
(`StreamReceiver`) checks the header before it keeps any data byte (a `check` callback: the engine
compares names and shapes with its model), then fills one tensor at a time and converts each, once
complete, to the engine's dtype: its extra memory is the tensors received (one copy of the model in the
engine's dtype, which the engine must hold whole before it swaps, so that a body that ends early leaves
the weights served untouched) plus one tensor in the sent dtype.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

MEDIA_TYPE = "application/vnd.safetensors"  # the Content-Type of a body carrying weights
CHUNK_BYTES = 4 << 20
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on the JSON header
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
Entry = tuple[str, torch.dtype, tuple[int, ...], int]  # name, dtype, shape, byte count


class StreamError(ValueError):
    """A weights body that is not a well-formed safetensors stream (or not what the header says)."""


def sync_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The tensors a full sync sends: the model's state dict in its own dtype, a tied lm_head left out
    (the engine fills it from the embedding, as it does for a folder)."""
    state = model.state_dict()
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and "model.embed_tokens.weight" in state:
        state.pop("lm_head.weight", None)
    return state


class WeightStream:
    """The safetensors bytes of `state`, produced chunk by chunk (`len(stream)` is their total)."""

    def __init__(self, state: dict[str, Tensor], chunk_bytes: int = CHUNK_BYTES) -> None:
        self.state, self.chunk_bytes = state, chunk_bytes
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, t in state.items():
            if t.dtype not in DTYPE_NAMES:
                raise StreamError(f"{name}: dtype {t.dtype} cannot be synced (float32, bfloat16, float16)")
            n = t.numel() * t.element_size()
            header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [offset, offset + n]}  # fmt: skip
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
        self.header = struct.pack("<Q", len(raw)) + raw
        self.data_bytes = offset

    def __len__(self) -> int:
        return len(self.header) + self.data_bytes

    def buffers(self) -> Iterator[memoryview]:
        """The header, then each tensor's bytes as a view of its own memory (no copy on the CPU)."""
        yield memoryview(self.header)
        for t in self.state.values():
            yield t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data

    def __iter__(self) -> Iterator[bytes]:
        for view in self.buffers():
            for start in range(0, len(view), self.chunk_bytes):
                yield bytes(view[start : start + self.chunk_bytes])


def parse_header(raw: bytes) -> list[Entry]:
    """The tensors a safetensors JSON header describes, in data order; their byte ranges must tile the
    data exactly (no gap, no overlap) and match dtype x shape."""
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StreamError(f"the header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise StreamError("the header must be a JSON object of tensors")
    entries: list[tuple[int, Entry]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StreamError(
                f"{name}: needs dtype (one of {sorted(DTYPES)}), shape and data_offsets [begin, end]"
            ) from exc
        n = math.prod(shape) * (torch.finfo(dtype).bits // 8)
        if min(shape, default=0) < 0 or end - begin != n:
            raise StreamError(
                f"{name}: data_offsets {[begin, end]} do not hold {info['dtype']} {list(shape)}"
            )
        entries.append((begin, (name, dtype, shape, n)))
    entries.sort(key=lambda e: e[0])
    offset = 0
    for begin, (name, _, _, n) in entries:
        if begin != offset:
            raise StreamError(f"{name}: data starts at byte {begin}, expected {offset} (gap or overlap)")
        offset += n
    return [e for _, e in entries]


class StreamReceiver:
    """Reads a safetensors body fed in chunks into tensors of `dtype`. `check(entries)` runs once the
    header is in, before any data byte is kept (raise to refuse the body); `length` (the body's
    Content-Length, if known) must be what the header describes."""

    def __init__(
        self, check: Callable[[list[Entry]], None], dtype: torch.dtype, length: int | None = None
    ) -> None:
        self.check, self.dtype, self.length = check, dtype, length
        self._head = bytearray()
        self.entries: list[Entry] | None = None
        self.total = 0  # bytes of the whole body, once the header is in
        self.received = 0
        self.tensors: dict[str, Tensor] = {}
        self._index, self._buf, self._filled = 0, np.empty(0, np.uint8), 0

    def feed(self, chunk: bytes) -> None:
        """Take the next bytes of the body."""
        self.received += len(chunk)
        view = memoryview(chunk)
        if self.entries is None:
            view = self._feed_header(view)
            if self.entries is None:
                return
        while len(view):
            if self._index >= len(self.entries):
                raise StreamError(f"the body is longer than the {self.total} bytes its header describes")
            n = self.entries[self._index][3]
            take = min(n - self._filled, len(view))
            self._buf[self._filled : self._filled + take] = np.frombuffer(view[:take], np.uint8)
            self._filled += take
            view = view[take:]
            if self._filled == n:
                self._complete()

    def _feed_header(self, view: memoryview) -> memoryview:
        """Collect the header; once whole, parse and check it. Returns the bytes past it."""
        self._head += view
        if len(self._head) < 8:
            return memoryview(b"")
        (size,) = struct.unpack("<Q", self._head[:8])
        if size > MAX_HEADER_BYTES:
            raise StreamError(
                f"the header claims {size} bytes (more than {MAX_HEADER_BYTES}): not safetensors"
            )
        if len(self._head) < 8 + size:
            return memoryview(b"")
        entries = parse_header(bytes(self._head[8 : 8 + size]))
        self.total = 8 + size + sum(n for *_, n in entries)
        if self.length is not None and self.length != self.total:
            raise StreamError(f"the body is {self.length} bytes but its header describes {self.total}")
        self.check(entries)
        rest = memoryview(bytes(self._head[8 + size :]))
        self._head = bytearray()
        self.entries = entries
        self._start()
        return rest

    def _start(self) -> None:
        """Make room for the next tensor's bytes (an empty tensor is complete at once)."""
        assert self.entries is not None
        while self._index < len(self.entries) and self.entries[self._index][3] == 0:
            name, _, shape, _ = self.entries[self._index]
            self.tensors[name] = torch.empty(shape, dtype=self.dtype)
            self._index += 1
        if self._index < len(self.entries):
            self._buf, self._filled = np.empty(self.entries[self._index][3], np.uint8), 0

    def _complete(self) -> None:
        assert self.entries is not None
        name, dtype, shape, _ = self.entries[self._index]
        sent = torch.from_numpy(self._buf).view(dtype).reshape(shape)
        self.tensors[name] = sent.to(self.dtype)  # the sent bytes are freed once converted
        self._index, self._buf = self._index + 1, np.empty(0, np.uint8)
        self._start()

    def finish(self) -> dict[str, Tensor]:
        """The tensors, once the body has ended; a body that ended early is refused."""
        if self.entries is None or self._index < len(self.entries):
            if self.entries is None:
                raise StreamError(f"the body ended after {self.received} bytes, inside its header")
            raise StreamError(
                f"the body ended after {self.received} of the {self.total} bytes its header describes"
            )
        return self.tensors
