"""Text sources: where training documents come from.

A *source spec* is a string:

* ``path/to/file.txt``   plain text; documents are WikiText articles (split before top-level
  ``" = Title = "`` lines) when the file looks like WikiText, otherwise blank-line separated paragraphs;
* ``path/to/file.jsonl`` one JSON object per line, document in the field ``"text"``;
* ``path/to/file.parquet`` column ``"text"`` (read with pyarrow, one row group at a time);
* ``path/to/folder``     every ``.txt`` / ``.jsonl`` / ``.parquet`` file below it, in sorted order;
* ``hf://<org>/<dataset>[/<subset>]`` the ``train`` split of a Hugging Face dataset, streamed;
* ``stdlib://python``    the ``.py`` files of this Python's standard library (bounded, sorted): text
  that exists on every machine running us, used as the offline default.

Every problem with a source raises :class:`DataError`, whose message says how to fix it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import sys
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Optional
from urllib.parse import urlparse

from loguru import logger
from iota_subnet.errors import UserError


class DataError(UserError, ValueError):
    """A data source or dataset cannot be used; the message names the fix."""


SUPPORTED_EXTENSIONS = (".txt", ".jsonl", ".parquet")
HF_PREFIX = "hf://"
STDLIB_SPEC = "stdlib://python"
DEFAULT_HF_SPEC = "hf://HuggingFaceFW/fineweb-edu/sample-10BT"

#: Bounds on the ``stdlib://python`` source: at most this many files / bytes of source text.
STDLIB_MAX_FILES = 400
STDLIB_MAX_BYTES = 4_000_000
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_STDLIB_MAX_FILE_BYTES = 200_000

_TRUE = {"1", "true", "yes", "on"}
_WIKI_TITLE = re.compile(r"^ = [^=].* = \s*$")  # " = Title = " (top level only, not " = = Sub = = ")
_hub_cache: dict[tuple[str, float], tuple[bool, str]] = {}


# --------------------------------------------------------------------------------------------- hub
def hub_status(timeout: float = 2.0) -> tuple[bool, str]:
    """Whether the Hugging Face hub looks reachable, and why: ``(reachable, reason)``.

    ``HF_HUB_OFFLINE=1`` (or ``HF_DATASETS_OFFLINE=1``) counts as unreachable without touching the
    network; otherwise one TCP connection to the hub (``$HF_ENDPOINT`` or huggingface.co, port 443)
    is tried with ``timeout`` seconds. The answer is remembered for the life of the process.
    """
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return False, f"{var}={os.environ[var]} is set"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    key = (endpoint, timeout)
    if key in _hub_cache:
        return _hub_cache[key]
    u = urlparse(endpoint)
    host = u.hostname or "huggingface.co"
    port = u.port or (80 if u.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
        res = (True, f"{host}:{port} answered")
    except OSError as e:
        res = (False, f"cannot connect to {host}:{port} within {timeout:g}s ({e.__class__.__name__}: {e})")
    _hub_cache[key] = res
    return res


def hub_reachable(timeout: float = 2.0) -> bool:
    """``hub_status(timeout)[0]``."""
    return hub_status(timeout)[0]


# ------------------------------------------------------------------------------------------- specs
def parse_hf_spec(spec: str) -> tuple[str, Optional[str]]:
    """``hf://org/name[/subset]`` -> ``("org/name", subset or None)``. Raises :class:`DataError`."""
    rest = spec[len(HF_PREFIX):].strip("/")
    parts = [p for p in rest.split("/") if p]
    if len(parts) == 1:
        return parts[0], None
    if len(parts) == 2:
        return f"{parts[0]}/{parts[1]}", None
    if len(parts) == 3:
        return f"{parts[0]}/{parts[1]}", parts[2]
    raise DataError(f"bad Hugging Face source {spec!r}; write hf://<org>/<dataset> or hf://<org>/<dataset>/<subset>")


def _check_local(spec: str) -> Path:
    p = Path(spec).expanduser()
    if not p.exists():
        raise DataError(f"data path {str(p)!r} does not exist; pass an existing .txt/.jsonl/.parquet file or a folder "
                        f"of them, hf://<org>/<dataset>[/<subset>], or {STDLIB_SPEC}")
    if p.is_file() and p.suffix.lower() not in SUPPORTED_EXTENSIONS:
        raise DataError(f"unsupported data file extension {p.suffix!r} for {str(p)!r}; convert it to one of "
                        f"{', '.join(SUPPORTED_EXTENSIONS)} (text in a 'text' field/column for .jsonl/.parquet)")
    return p


def _dir_files(d: Path) -> list[Path]:
    files = sorted(f for f in d.rglob("*") if f.is_file() and f.suffix.lower() in SUPPORTED_EXTENSIONS
                   and not any(part.startswith(".") for part in f.relative_to(d).parts))
    if not files:
        raise DataError(f"folder {str(d)!r} holds no {'/'.join(SUPPORTED_EXTENSIONS)} files; put data files there "
                        "or pass a file directly")
    return files


def stdlib_files() -> list[Path]:
    """The ``.py`` files used by ``stdlib://python``: sorted by relative path, tests and site-packages
    skipped, at most :data:`STDLIB_MAX_FILES` files and about :data:`STDLIB_MAX_BYTES` bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"Python standard library folder {str(root)!r} not found; pass a data file with --data")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith(".")]
        for fn in filenames:
            if fn.endswith(".py"):
                f = Path(dirpath) / fn
                found.append((f.relative_to(root).as_posix(), f))
    found.sort()
    out, total = [], 0
    for _, f in found:
        try:
            size = f.stat().st_size
        except OSError:
            continue
        if size == 0 or size > _STDLIB_MAX_FILE_BYTES:
            continue
        if len(out) >= STDLIB_MAX_FILES or total + size > STDLIB_MAX_BYTES:
            break
        out.append(f)
        total += size
    if not out:
        raise DataError(f"no Python source files found under {str(root)!r}; pass a data file with --data")
    return out


def local_size(spec: str) -> Optional[int]:
    """Bytes of a local file or folder source (about its characters, for progress), else None."""
    p = Path(spec).expanduser()
    try:
        if p.is_file():
            return p.stat().st_size
        if p.is_dir():
            return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and f.suffix in SUPPORTED_EXTENSIONS)
    except OSError:
        return None
    return None


def source_key(spec: str) -> str:
    """A stable short hex key (16 chars) for caching what was derived from ``spec``.

    Local files: hash of resolved path, size (bytes) and mtime of every file; ``hf://``: hash of
    the spec; ``stdlib://python``: hash of the Python version and the chosen files' paths/sizes.
    Raises :class:`DataError` for a missing path or unsupported extension.
    """
    h = hashlib.sha256()
    if spec.startswith(HF_PREFIX):
        ds, sub = parse_hf_spec(spec)
        h.update(f"hf|{ds}|{sub}|train".encode())
    elif spec == STDLIB_SPEC:
        h.update(f"stdlib|{sys.version_info[:3]}".encode())
        for f in stdlib_files():
            h.update(f"|{f}|{f.stat().st_size}".encode())
    else:
        p = _check_local(spec)
        files = _dir_files(p) if p.is_dir() else [p]
        for f in files:
            st = f.stat()
            h.update(f"file|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def describe(spec: str) -> str:
    """A short human description of a source spec (for logs)."""
    if spec.startswith(HF_PREFIX):
        ds, sub = parse_hf_spec(spec)
        return f"Hugging Face dataset {ds}" + (f" (subset {sub})" if sub else "") + ", streamed"
    if spec == STDLIB_SPEC:
        return f"Python {sys.version_info.major}.{sys.version_info.minor} standard library sources (offline default)"
    return f"local data {spec}"


# ---------------------------------------------------------------------------------------- readers
def _read_txt(path: Path) -> Iterator[str]:
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        head = []
        for line in f:
            head.append(line)
            if len(head) >= 200:
                break
        wiki = any(_WIKI_TITLE.match(line) for line in head)

        def lines() -> Iterator[str]:
            yield from head
            yield from f

        buf: list[str] = []
        for line in lines():
            boundary = _WIKI_TITLE.match(line) if wiki else not line.strip()
            if boundary:
                doc = "".join(buf).strip()
                if doc:
                    yield doc
                buf = [line] if wiki else []
            else:
                buf.append(line)
        doc = "".join(buf).strip()
        if doc:
            yield doc


def _read_jsonl(path: Path) -> Iterator[str]:
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e}); each line of a .jsonl file must be one JSON object")
            if not isinstance(obj, dict) or "text" not in obj:
                raise DataError(f"{path}:{n}: no \"text\" field; each line must look like {{\"text\": \"...\"}}")
            text = obj["text"]
            if isinstance(text, str) and text.strip():
                yield text


def _read_parquet(path: Path) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(path))
    except Exception as e:  # pyarrow raises several types for corrupt / empty files
        raise DataError(f"{path}: cannot read as parquet ({e}); check the file or convert it to .jsonl/.txt")
    if "text" not in pf.schema_arrow.names:
        raise DataError(f"{path}: no \"text\" column (columns: {pf.schema_arrow.names}); rename the text column to 'text'")
    for rg in range(pf.num_row_groups):
        for text in pf.read_row_group(rg, columns=["text"]).column("text").to_pylist():
            if isinstance(text, str) and text.strip():
                yield text


_READERS = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}


def _read_file(path: Path) -> Iterator[str]:
    n = 0
    for doc in _READERS[path.suffix.lower()](path):
        n += 1
        yield doc
    if n == 0:
        raise DataError(f"data file {str(path)!r} is empty (no text found); fill it with text "
                        f"(or a 'text' field/column for .jsonl/.parquet) or pass another file")


def _read_dir(files: list[Path], root: Path) -> Iterator[str]:
    n = 0
    for f in files:
        try:
            for doc in _read_file(f):
                n += 1
                yield doc
        except DataError as e:
            if "is empty" not in str(e):
                raise
            logger.warning(f"skipping empty data file {f}")
    if n == 0:
        raise DataError(f"folder {str(root)!r} holds no text (all files empty); fill the files with text")


def _read_stdlib(files: list[Path]) -> Iterator[str]:
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            yield text


def _read_hf(spec: str) -> Iterator[str]:
    ds_name, subset = parse_hf_spec(spec)
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is a dependency
        raise DataError(f"the 'datasets' package is needed for {spec}; pip install datasets ({e})")
    try:
        ds = datasets.load_dataset(ds_name, subset, split="train", streaming=True)
    except Exception as e:
        raise DataError(f"cannot open Hugging Face dataset {spec} ({e.__class__.__name__}: {e}); check the name, "
                        "or pass a local .txt/.jsonl/.parquet file or folder instead")
    it = iter(ds)
    while True:
        try:
            row = next(it)
        except StopIteration:
            return
        except Exception as e:  # network errors surface lazily while streaming
            raise DataError(f"streaming {spec} failed ({e.__class__.__name__}: {e}); retry, or pass a local "
                            ".txt/.jsonl/.parquet file or folder instead")
        text = row.get("text") if isinstance(row, dict) else None
        if isinstance(text, str) and text.strip():
            yield text


def iter_documents(spec: str) -> Iterator[str]:
    """Iterate the documents (non-empty ``str``) of a source spec, in a fixed order.

    The spec is checked at call time: a missing path, an unsupported extension, an empty folder or an
    unreachable hub (for ``hf://``) raise :class:`DataError` immediately. A file that turns out to
    hold no text raises :class:`DataError` when its iteration ends (in a folder it is skipped with a
    warning, unless every file is empty); so do malformed .jsonl lines and a missing ``text`` column.
    """
    if spec.startswith(HF_PREFIX):
        parse_hf_spec(spec)
        ok, why = hub_status()
        if not ok:
            raise DataError(f"Hugging Face hub unreachable for {spec} ({why}); pass a local .txt/.jsonl/.parquet "
                            f"file or folder, or {STDLIB_SPEC}, or restore network access and unset HF_HUB_OFFLINE")
        return _read_hf(spec)
    if spec.startswith("stdlib://"):
        if spec != STDLIB_SPEC:
            raise DataError(f"unknown source {spec!r}; the only stdlib source is {STDLIB_SPEC}")
        return _read_stdlib(stdlib_files())
    p = _check_local(spec)
    if p.is_dir():
        return _read_dir(_dir_files(p), p)
    if p.stat().st_size == 0:
        raise DataError(f"data file {str(p)!r} is empty (0 bytes); fill it with text or pass another file")
    return _read_file(p)


def default_source(timeout: float = 2.0) -> tuple[str, str]:
    """The source for a run given no data: ``(spec, description)``.

    FineWeb-Edu (``hf://HuggingFaceFW/fineweb-edu/sample-10BT``) when the hub is reachable, otherwise
    ``stdlib://python``. Logs which one is used and why.
    """
    ok, why = hub_status(timeout)
    if ok:
        spec = DEFAULT_HF_SPEC
        desc = f"{describe(spec)} (hub reachable: {why})"
    else:
        spec = STDLIB_SPEC
        desc = f"{describe(spec)}; Hugging Face hub unreachable: {why}"
    logger.info(f"no data given; using {spec}: {desc}")
    return spec, desc


def limit_chars(docs: Iterable[str], max_chars: int) -> Iterator[str]:
    """Yield documents until about ``max_chars`` characters have been yielded (bounds training corpora)."""
    total = 0
    for d in docs:
        yield d
        total += len(d)
        if total >= max_chars:
            return
