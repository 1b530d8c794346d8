"""Weights through a POSIX shared-memory segment, for a trainer and an engine on one machine: the
trainer writes the safetensors bytes of its tensors (`WeightStream`) into `/dev/shm/<name>` (one copy,
in the model's dtype, straight from the parameters' memory), sends the name, and the engine maps the
segment and reads every tensor as a view of it (no copy of its own unless it converts the dtype). The
trainer removes the segment once the engine has answered (the engine's mapping stays valid until its
swap is done). A segment is refused whole before anything is kept: a bad name, a missing segment, a
size other than its header describes, a name or shape the model does not have.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from harnessrl.modeling.weight_stream import MAX_HEADER_BYTES, Entry, StreamError, WeightStream, parse_header

SHM_DIR = Path("/dev/shm")
SHM_NAME = re.compile(r"harnessrl-weights-[A-Za-z0-9_-]{1,64}")
SHM_HEADROOM = 1.05  # a segment is written only where /dev/shm has this much more room than it needs


def shm_room(nbytes: int, shm_dir: Path = SHM_DIR) -> bool:
    """Whether `shm_dir` exists and has room for a segment of `nbytes` (containers often give it 64 MB)."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= nbytes * SHM_HEADROOM


@contextlib.contextmanager
def shared_weights(stream: WeightStream, name: str, shm_dir: Path = SHM_DIR) -> Iterator[str]:
    """Write `stream` into the segment `name` (readable by this user only), yield its name, remove it
    (on a thread of its own: freeing the pages takes ~0.15 s for 538 MB here, and nobody waits for it;
    not a daemon thread, so the interpreter finishes it before it exits)."""
    if not SHM_NAME.fullmatch(name):
        raise ValueError(f"shared-memory segment name {name!r} must match {SHM_NAME.pattern}")
    path = shm_dir / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        try:
            for view in stream.buffers():
                while len(view):
                    view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        yield name
    finally:
        threading.Thread(target=path.unlink, kwargs={"missing_ok": True}, name="shm-unlink").start()


def read_shared(
    name: str, check: Callable[[list[Entry]], None], shm_dir: Path = SHM_DIR
) -> dict[str, Tensor]:
    """The tensors of the segment `name`, as views of a private mapping of it (in the dtype sent);
    `check(entries)` runs on its header first. Raises StreamError for a segment that is not what its
    header says, FileNotFoundError for one that is not there."""
    if not SHM_NAME.fullmatch(name):
        raise StreamError(f"a shared-memory segment name must match {SHM_NAME.pattern}, not {name!r}")
    fd = os.open(shm_dir / name, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise StreamError(f"the segment holds {size} bytes: no safetensors header")
        # private: the views may be written (torch wants writable memory), the segment never is. Not
        # MAP_POPULATE: on a private writable mapping it copies every page (3x slower measured here)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    (hsize,) = struct.unpack("<Q", mm[:8])
    if hsize > min(MAX_HEADER_BYTES, size - 8):
        raise StreamError(f"the header claims {hsize} bytes, the segment holds {size}")
    entries = parse_header(mm[8 : 8 + hsize])
    total = 8 + hsize + sum(n for *_, n in entries)
    if total != size:
        raise StreamError(f"the segment holds {size} bytes but its header describes {total}")
    check(entries)
    tensors, offset = {}, 8 + hsize
    for name_, dtype, shape, n in entries:
        if n == 0:
            tensors[name_] = torch.empty(shape, dtype=dtype)
        else:
            count = n // (torch.finfo(dtype).bits // 8)
            tensors[name_] = torch.frombuffer(mm, dtype=dtype, count=count, offset=offset).reshape(shape)
        offset += n
    return tensors  # the mapping lives as long as these views
