"""Tensors spilled to disk and read back through a memory map (audit copies that must stay openable).

A miner keeps, for its audit windows, copies of weights, optimizer moments, gradients and merge slices
it must be able to open on any row a validator asks for. Held in host memory they cost ~76 bytes per
parameter at four kept inner steps (``docs/BENCHMARKS.md``, "Audit state that fits"). Once a copy is
hashed nothing writes to it again, so :meth:`SpillDir.put` writes it to one file (atomically: a
temporary file in the same folder, then a rename, :func:`iota_subnet.utils.atomic.atomic_write_with`)
and returns views of a private read-only memory map of that file: a row read touches only that row's
pages, which are file-backed page cache the kernel can drop, not the process's anonymous memory.

:meth:`SpillDir.drop` removes a file; views already handed out stay valid (an unlinked file lives
while it is mapped). A folder is private to one process: :class:`SpillDir` empties it when created.
Raises ``OSError`` when the disk is full or not writable (the caller keeps its copy in memory).
"""
from __future__ import annotations

import itertools
import os
import shutil
import threading
from pathlib import Path
from typing import Mapping

import torch

from .atomic import atomic_write_with

#: Byte alignment of every tensor in a spill file (any dtype's element size divides it).
ALIGN = 64


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat uint8 tensor (no copy when ``t`` is contiguous and on the CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


class SpillDir:
    """One folder of spill files (see the module docstring). ``path`` is created and emptied."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.exists():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.written_bytes = 0          # bytes written since creation
        self.files: dict[str, int] = {}  # file name -> bytes on disk now

    def put(self, tensors: Mapping[str, torch.Tensor], tag: str = "t") -> tuple[str, dict[str, torch.Tensor]]:
        """Write ``tensors`` to a new file; returns its name (for :meth:`drop`) and ``name -> view``
        of the same shapes and dtypes, read-only by contract (a write would only change this
        process's private copy of a page)."""
        with self._lock:
            fname = f"{tag}-{next(self._ids)}.bin"
        layout, off = [], 0
        for name, t in tensors.items():
            n = t.numel() * t.element_size()
            layout.append((name, off, n, t.dtype, tuple(t.shape)))
            off += -(-n // ALIGN) * ALIGN
        total = max(off, ALIGN)

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                for (name, o, n, _, _) in layout:
                    f.seek(o)
                    if n:
                        f.write(memoryview(_bytes_of(tensors[name]).numpy()))
                f.truncate(total)
        path = atomic_write_with(self.path / fname, write)
        buf = torch.from_file(str(path), shared=False, size=total, dtype=torch.uint8)
        with self._lock:
            self.written_bytes += total
            self.files[fname] = total
        out = {}
        for name, o, n, dtype, shape in layout:
            out[name] = buf[o:o + n].view(dtype).view(shape)
        return fname, out

    def drop(self, fname: str) -> None:
        """Remove one spill file (no error when it is gone)."""
        if not fname:
            return
        with self._lock:
            self.files.pop(fname, None)
        try:
            (self.path / fname).unlink()
        except FileNotFoundError:
            pass

    @property
    def disk_bytes(self) -> int:
        """Bytes of the spill files present now."""
        with self._lock:
            return sum(self.files.values())
