"""Atomic file writes: temporary file in the same folder, fsync, rename, fsync of the folder.

A reader (or a process restarted after ``kill -9``) sees either the old file or the new one,
never a truncated mix. A write killed half-way leaves its temporary file (``.<name>.<random>.tmp``)
behind; :func:`sweep_temporaries` removes them when a process starts.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


#: Name pattern of the temporary files :func:`atomic_write_with` creates (``.<name>.<random>.tmp``).
TEMP_GLOB = ".*.tmp"


def sweep_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporary files killed atomic writes left in ``folder`` (not below it).

    Call it at start, before this process writes there: a temporary file of a write in progress
    would be removed too. Returns the removed paths; a missing folder is not an error.
    """
    folder = Path(folder)
    removed = []
    if not folder.is_dir():
        return removed
    for p in sorted(folder.glob(TEMP_GLOB)):
        if p.is_file() and not p.is_symlink():
            try:
                p.unlink()
                removed.append(p)
            except FileNotFoundError:
                pass
    return removed


def atomic_write_with(path: str | os.PathLike, writer: Callable[[str], None]) -> Path:
    """Call ``writer(tmp_path)`` to produce the file, then fsync it and rename it onto ``path``.

    Raises whatever ``writer`` raises; the previous file at ``path`` is then left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    os.close(fd)
    try:
        writer(tmp)
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)
    return path


#: Writes at least this large show progress (checkpoints of large stages take minutes on slow disks).
PROGRESS_BYTES = 256 << 20


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` (bytes) to ``path`` atomically (with progress from :data:`PROGRESS_BYTES` up)."""

    def _w(tmp: str) -> None:
        if len(data) < PROGRESS_BYTES:
            with open(tmp, "wb") as f:
                f.write(data)
            return
        from .progress import Progress
        view = memoryview(data)
        with open(tmp, "wb") as f, Progress(len(data), f"writing {Path(path).name}", "B", unit_scale=True) as p:
            for off in range(0, len(data), 64 << 20):
                f.write(view[off:off + (64 << 20)])
                p.update(min(64 << 20, len(data) - off))

    return atomic_write_with(path, _w)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextmanager
def atomic_folder(out: str | os.PathLike, prefix: str = "") -> Iterator[Path]:
    """Build a folder in a temporary sibling (``.<name>.<prefix><random>``, yielded) and put it in
    place of ``out`` when the block ends without an exception (an existing ``out`` is removed first);
    on an exception the temporary folder is removed and the exception re-raised. A process killed
    half-way leaves the sibling for the caller's start-up sweep."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{prefix}", dir=str(out.parent)))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
