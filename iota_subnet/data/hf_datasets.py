"""A run's data as a ``datasets`` dataset, tokenized with the model's own tokenizer.

A :class:`DatasetSpec` names the data and its fields::

    DatasetSpec(path="corpus.jsonl", text_field="text", mask_field=None)
    DatasetSpec.from_mapping({"path": "shards/", "format": "parquet", "text_field": "content"})
    DatasetSpec(path="HuggingFaceFW/fineweb-edu", name="sample-10BT")       # a hub id, streamed

Local files (``json``/``jsonl``, ``parquet``, ``text``, ``csv``; a file or a folder of them, read in
sorted order) and hub datasets are read through ``datasets.load_dataset`` (streamed by default, so
nothing is copied into the ``datasets`` cache). Rows are read in the dataset's order; a row whose text
is null or blank is skipped. ``text`` files give one row per line (``sample_by="line"``), per
blank-line separated paragraph or one per file, the text in the field ``text``.

Loss mask (``mask_field``): the field holds the character spans of the text to train on, a list of
``[start, end)`` pairs (``[[12, 40], [77, 120]]``; ``[]`` trains on none of the row). A token is marked
when its characters overlap a span; the end-of-text token after a document is marked when the
document's last token is. :class:`HFTokenDataset` packs rows exactly as :class:`TokenDataset` does and
carries a mask row (``uint8``) alongside each token row; the loss of target ``row[1:]`` uses
``mask_row[1:]`` (see :func:`iota_subnet.model.lm_loss.masked_lm_loss`).

Tokenizer: :func:`load_hf_tokenizer` reads a model's local tokenizer folder with
``transformers.AutoTokenizer`` and wraps its ``tokenizers`` backend as a :class:`TextTokenizer` (so the
tokenizer fingerprint is the usual one); :func:`check_tokenizer` refuses a tokenizer that does not fit
the model's ``vocab_size``.

Every problem raises a :class:`DataError` subclass whose message names the fix.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import datasets
import numpy as np
from loguru import logger

from ..utils.atomic import atomic_write_with
from .packing import TokenDataset, tokenize_documents
from .sources import DataError, hub_status
from .tokenizer import TextTokenizer

#: ``format`` -> file extensions read for it.
FORMATS: dict[str, tuple[str, ...]] = {"json": (".jsonl", ".json"), "parquet": (".parquet",), "text": (".txt",),
                                       "csv": (".csv",)}
SAMPLE_BY = ("line", "paragraph", "document")
_ENCODE_CHUNK = 256

Span = tuple[int, int]


class DatasetFieldError(DataError):
    """A dataset lacks the named text / mask field, or a row's value has the wrong form."""


class TokenizerMismatchError(DataError):
    """The tokenizer does not fit the model (its ids exceed ``vocab_size``, or it is another model's)."""


@dataclass(frozen=True)
class DatasetSpec:
    """Where a run's data is and which fields hold what.

    ``path``: a local file or folder, or a hub dataset id (``org/name``); ``format``: ``json``,
    ``parquet``, ``text`` or ``csv`` (``None``: from the file extension; a hub id when ``path`` does not
    exist locally); ``text_field``: the field holding a document; ``mask_field``: the field holding the
    trained character spans, or ``None`` to train on every token; ``name``: the hub dataset's subset;
    ``split``: the hub split (local files are one split); ``streaming``: read rows lazily instead of
    building an Arrow copy first; ``sample_by``: rows of a ``text`` file (``line``, ``paragraph``,
    ``document``)."""
    path: str
    format: Optional[str] = None
    text_field: str = "text"
    mask_field: Optional[str] = None
    name: Optional[str] = None
    split: str = "train"
    streaming: bool = True
    sample_by: str = "line"

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in FORMATS:
            raise DataError(f"data format {self.format!r} is not supported; use one of {', '.join(FORMATS)} "
                            "(or leave it unset to take it from the file extension)")
        if self.sample_by not in SAMPLE_BY:
            raise DataError(f"sample_by={self.sample_by!r}; use one of {', '.join(SAMPLE_BY)}")
        if not self.text_field:
            raise DataError("text_field is empty; name the field that holds the documents, e.g. \"text\"")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "DatasetSpec":
        """A spec from a dict such as ``{"path": ..., "format": "json", "text_field": "text", "mask_field":
        null}``. Raises :class:`DataError` for unknown keys or a missing ``path``."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(m) - known)
        if unknown:
            raise DataError(f"unknown data spec keys {unknown}; the keys are {sorted(known)}")
        if not m.get("path"):
            raise DataError("the data spec has no \"path\"; give a local file or folder or a hub dataset id")
        return cls(**dict(m))

    def describe(self) -> str:
        """One line for logs, e.g. ``json corpus.jsonl [text=text, mask=spans]``."""
        fmt = self.format or "hub"
        if self.format is None and _is_local(self.path):
            try:
                fmt = _infer_format(Path(self.path).expanduser())
            except DataError:
                fmt = "?"
        sub = f"/{self.name}" if self.name else ""
        mask = f", mask={self.mask_field}" if self.mask_field else ""
        return f"{fmt} {self.path}{sub} [text={self.text_field}{mask}]"


# --------------------------------------------------------------------------------------- opening
def _is_local(path: str) -> bool:
    return Path(path).expanduser().exists()


def _infer_format(p: Path) -> str:
    files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
    for fmt, exts in FORMATS.items():
        if any(f.suffix.lower() in exts for f in files):
            return fmt
    raise DataError(f"cannot tell the format of {str(p)!r} from its file extensions; set format to one of "
                    f"{', '.join(FORMATS)}")


def _data_files(p: Path, fmt: str) -> list[str]:
    if p.is_file():
        return [str(p)]
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in FORMATS[fmt]
                   and not any(part.startswith(".") for part in f.relative_to(p).parts))
    if not files:
        raise DataError(f"folder {str(p)!r} holds no {'/'.join(FORMATS[fmt])} files for format {fmt!r}; put the "
                        "data files there or set format to the files' format")
    return [str(f) for f in files]


def open_dataset(spec: DatasetSpec, cache_dir: Optional[Path] = None):
    """The ``datasets`` dataset (``IterableDataset`` when ``spec.streaming``, else ``Dataset``) of ``spec``.

    ``cache_dir``: the ``datasets`` cache (used when not streaming; default ``datasets``' own).
    Raises :class:`DataError` for a missing path, an unknown format, an unreachable hub, a text file with
    a field other than ``text`` or a mask, or anything ``load_dataset`` refuses."""
    cache = str(cache_dir) if cache_dir is not None else None
    p = Path(spec.path).expanduser()
    if p.exists():
        fmt = spec.format or _infer_format(p)
        kw: dict[str, Any] = {}
        if fmt == "text":
            if spec.text_field != "text" or spec.mask_field:
                raise DatasetFieldError(f"text files have a single field, \"text\" (got text_field={spec.text_field!r}, "
                                        f"mask_field={spec.mask_field!r}); set text_field to \"text\" and mask_field to "
                                        "null, or use json/parquet for masked data")
            kw["sample_by"] = spec.sample_by
        args, kw = (fmt,), dict(kw, data_files=_data_files(p, fmt), split="train")
    elif spec.format is not None or p.suffix.lower() in {e for exts in FORMATS.values() for e in exts} \
            or spec.path.startswith((".", "/", "~")):
        raise DataError(f"data path {spec.path!r} does not exist; give an existing file or folder, or a hub dataset "
                        "id (org/name) with format unset")
    else:
        ok, why = hub_status()
        if not ok:
            raise DataError(f"Hugging Face hub unreachable for dataset {spec.path!r} ({why}); download it where the hub "
                            "is reachable and pass the local files, or restore network access")
        args, kw = (spec.path, spec.name), {"split": spec.split}
    try:
        return datasets.load_dataset(*args, streaming=spec.streaming, cache_dir=cache, **kw)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"cannot load {spec.describe()} with datasets.load_dataset ({e.__class__.__name__}: {e}); "
                        "check the path, format and subset") from e


# --------------------------------------------------------------------------------------- records
def _check_columns(spec: DatasetSpec, columns) -> None:
    if columns is None:
        return
    for role, field in (("text_field", spec.text_field), ("mask_field", spec.mask_field)):
        if field is not None and field not in columns:
            raise DatasetFieldError(f"{spec.path}: no field {field!r} (the {role}); its fields are {sorted(columns)}; "
                                    f"set {role} to the field that holds the "
                                    f"{'documents' if role == 'text_field' else 'trained character spans'}")


def _spans(value, text: str, row: int, spec: DatasetSpec) -> list[Span]:
    fix = (f"the {spec.mask_field!r} field must hold a list of [start, end) character spans of the text to train "
           "on, e.g. [[0, 12], [30, 41]] ([] for none)")
    if value is None or not isinstance(value, (list, tuple)):
        raise DatasetFieldError(f"{spec.path}: row {row}: {spec.mask_field!r} is {value!r}; {fix}")
    out = []
    for s in value:
        if not isinstance(s, (list, tuple)) or len(s) != 2 or not all(isinstance(x, int) for x in s) \
                or not 0 <= s[0] <= s[1] <= len(text):
            raise DatasetFieldError(f"{spec.path}: row {row}: span {s!r} is not [start, end) with "
                                    f"0 <= start <= end <= {len(text)} (the text's length); {fix}")
        out.append((int(s[0]), int(s[1])))
    return out


def iter_records(spec: DatasetSpec, cache_dir: Optional[Path] = None) -> Iterator[tuple[str, Optional[list[Span]]]]:
    """``(text, spans)`` for each row of ``spec`` with non-blank text, in the dataset's order; ``spans``
    is ``None`` without a ``mask_field``. Raises :class:`DatasetFieldError` for a missing field, a text
    that is not a string or a malformed mask, :class:`DataError` when reading fails or no row has text."""
    ds = open_dataset(spec, cache_dir)
    _check_columns(spec, getattr(ds, "column_names", None))
    n = skipped = 0
    it = iter(ds)
    i = -1
    while True:
        try:
            row = next(it)
        except StopIteration:
            break
        except DataError:
            raise
        except Exception as e:  # parse errors and network errors surface while iterating
            raise DataError(f"reading {spec.describe()} failed at row {i + 1} ({e.__class__.__name__}: {e}); fix the "
                            "file or retry") from e
        i += 1
        if i == 0:
            _check_columns(spec, list(row))
        text = row.get(spec.text_field)
        if text is not None and not isinstance(text, str):
            raise DatasetFieldError(f"{spec.path}: row {i}: {spec.text_field!r} holds {type(text).__name__}, not text; "
                                    "set text_field to a string field")
        if not text or not text.strip():
            skipped += 1
            continue
        n += 1
        yield text, (_spans(row.get(spec.mask_field), text, i, spec) if spec.mask_field else None)
    if n == 0:
        raise DataError(f"{spec.describe()} holds no text ({i + 1} rows, none with text in {spec.text_field!r}); "
                        "check text_field and the files")
    if skipped:
        logger.info(f"{spec.describe()}: skipped {skipped} rows without text")


# ------------------------------------------------------------------------------------- tokenizer
def load_hf_tokenizer(folder: str | Path, eos_token: Optional[str] = None) -> TextTokenizer:
    """A model's tokenizer from its local folder (``tokenizer.json`` and ``tokenizer_config.json``, as
    ``save_pretrained`` writes them), as a :class:`TextTokenizer` over its ``tokenizers`` backend: ids are
    what ``tokenizer(text, add_special_tokens=False)`` gives. Documents are separated by ``eos_token``
    (default: the tokenizer's own ``eos_token``). Never touches the hub.
    Raises :class:`DataError` for a missing folder, a tokenizer without a ``tokenizers`` backend (only
    a slow tokenizer) or without an end-of-text token."""
    from transformers import AutoTokenizer

    p = Path(folder).expanduser()
    if not p.is_dir():
        raise DataError(f"tokenizer folder {str(p)!r} does not exist; give the model's local folder holding "
                        "tokenizer.json (save it with tokenizer.save_pretrained(folder))")
    try:
        hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:
        raise DataError(f"cannot load a tokenizer from {str(p)!r} ({e.__class__.__name__}: {e}); the folder must hold "
                        "tokenizer.json and tokenizer_config.json as save_pretrained writes them") from e
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise DataError(f"the tokenizer in {str(p)!r} has no fast (tokenizers) backend; save a tokenizer.json "
                        "(PreTrainedTokenizerFast) in the folder")
    return TextTokenizer(backend, f"hf-{p.name}", eos_token=eos_token or getattr(hf, "eos_token", None))


def tokenizer_size(tokenizer) -> int:
    """Number of ids of a :class:`TextTokenizer` or a ``transformers`` tokenizer (added tokens included)."""
    if isinstance(tokenizer, TextTokenizer):
        return tokenizer.vocab_size
    return len(tokenizer)


def check_tokenizer(tokenizer, hf_config, max_unused: Optional[int] = None) -> int:
    """Refuse a tokenizer that does not fit the model; returns its number of ids.

    ``tokenizer``: a :class:`TextTokenizer` or ``transformers`` tokenizer; ``hf_config``: the model's
    config object or ``config.json`` dict. Models round ``vocab_size`` up past the tokenizer's ids, so
    up to ``max_unused`` ids (default ``max(256, vocab_size // 64)``) may be unused; more means the
    tokenizer is another model's. Raises :class:`TokenizerMismatchError` when the tokenizer has more ids
    than ``vocab_size`` (they would have no embedding row) or fewer than ``vocab_size - max_unused``."""
    v = hf_config.get("vocab_size") if isinstance(hf_config, Mapping) else getattr(hf_config, "vocab_size", None)
    if not isinstance(v, int) or v < 1:
        raise TokenizerMismatchError(f"the model config has no vocab_size (got {v!r}); give the model's config")
    n = tokenizer_size(tokenizer)
    slack = max(256, v // 64) if max_unused is None else int(max_unused)
    name = getattr(tokenizer, "name", None) or getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    if n > v:
        raise TokenizerMismatchError(f"tokenizer {name!r} has {n} ids but the model's vocab_size is {v}: ids {v}.."
                                     f"{n - 1} have no embedding row; use the model's own tokenizer (its folder's "
                                     f"tokenizer.json) or a model config with vocab_size >= {n}")
    if v - n > slack:
        raise TokenizerMismatchError(f"tokenizer {name!r} has {n} ids but the model's vocab_size is {v} ({v - n} ids "
                                     f"never used, more than {slack}): it is not this model's tokenizer; use the "
                                     "model's own tokenizer folder, or set the model's vocab_size to fit this one")
    return n


# --------------------------------------------------------------------------------------- packing
def _mark(offsets: np.ndarray, spans: list[Span]) -> np.ndarray:
    """``uint8[n_tokens]``: 1 where a token's characters ``[a, b)`` overlap a span (an empty token
    counts when its position lies inside one)."""
    if not len(offsets) or not spans:
        return np.zeros(len(offsets), dtype=np.uint8)
    a, b = offsets[:, :1], offsets[:, 1:]
    s, e = np.array(spans, dtype=np.int64).T[:, None, :]
    hit = ((a < e) & (s < b)) | ((a == b) & (s <= a) & (a < e))
    return hit.any(axis=1).astype(np.uint8)


def tokenize_with_mask(records, tokenizer: TextTokenizer,
                       max_tokens: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
    """Like :func:`tokenize_documents` for ``(text, spans)`` records: ``(tokens int32[N], mask uint8[N])``,
    each document followed by ``tokenizer.eos_id`` (marked when the document's last token is), cut to at
    most ``max_tokens``. The token array equals ``tokenize_documents`` over the texts."""
    toks: list[np.ndarray] = []
    marks: list[np.ndarray] = []
    total = 0
    eos = np.array([tokenizer.eos_id], dtype=np.int32)
    chunk: list[tuple[str, list[Span]]] = []

    def flush() -> bool:
        nonlocal total
        encs = tokenizer.tokenizer.encode_batch([t for t, _ in chunk], add_special_tokens=False)
        for enc, (_, spans) in zip(encs, chunk):
            ids = np.asarray(enc.ids, dtype=np.int32)
            m = _mark(np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2), spans or [])
            toks.extend((ids, eos))
            marks.extend((m, m[-1:] if len(m) else np.zeros(1, dtype=np.uint8)))
            total += len(ids) + 1
            if max_tokens is not None and total >= max_tokens:
                return True
        chunk.clear()
        return False

    for rec in records:
        chunk.append(rec)
        if len(chunk) >= _ENCODE_CHUNK and flush():
            break
    else:
        if chunk:
            flush()
    tokens = np.concatenate(toks) if toks else np.zeros(0, dtype=np.int32)
    mask = np.concatenate(marks) if marks else np.zeros(0, dtype=np.uint8)
    if max_tokens is not None:
        tokens, mask = tokens[:max_tokens], mask[:max_tokens]
    return np.ascontiguousarray(tokens, dtype=np.int32), np.ascontiguousarray(mask, dtype=np.uint8)


def spec_key(spec: DatasetSpec, tokenizer: TextTokenizer, max_tokens: Optional[int]) -> str:
    """16 hex chars naming what packing ``spec`` with ``tokenizer`` gives: the spec's fields, the
    tokenizer's fingerprint and end-of-text id, ``max_tokens`` and, for local data, every file's resolved
    path, size and modification time (a hub dataset by its id, subset and split)."""
    h = hashlib.sha256(json.dumps([dataclasses.asdict(spec), tokenizer.fingerprint, tokenizer.eos_id, max_tokens],
                                  sort_keys=True, default=str).encode())
    p = Path(spec.path).expanduser()
    if p.exists():
        for f in _data_files(p, spec.format or _infer_format(p)):
            st = Path(f).stat()
            h.update(f"|{Path(f).resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _load_cached(path: Path, masked: bool) -> Optional[tuple[np.ndarray, Optional[np.ndarray]]]:
    mpath = path.with_name(path.stem + "-mask.npy")
    if not path.exists() or (masked and not mpath.exists()):
        return None
    try:
        tokens = np.load(path, mmap_mode="r")
        mask = np.load(mpath, mmap_mode="r") if masked else None
    except (OSError, ValueError) as e:
        logger.warning(f"ignoring unreadable token cache {path} ({e}); rebuilding")
        return None
    if mask is not None and len(mask) != len(tokens):
        logger.warning(f"ignoring token cache {path}: its mask has {len(mask)} entries for {len(tokens)} tokens")
        return None
    logger.info(f"packed tokens loaded from cache {path} ({len(tokens):,} tokens)")
    return tokens, mask


def _save(path: Path, arr: np.ndarray) -> None:
    def _w(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.save(f, arr)
    atomic_write_with(path, _w)


class HFTokenDataset(TokenDataset):
    """A :class:`TokenDataset` over a ``datasets`` dataset: the same rows, ``(seed, index)`` addresses and
    validation slice as packing the same documents from a source spec, plus a loss-mask row per token
    row when ``spec.mask_field`` is set (:attr:`loss_mask` is ``None`` otherwise and every target is
    trained; :meth:`~TokenDataset.target_batch` gives the rows with the unmarked targets ignored).

    ``cache_dir``: the ``datasets`` cache (see :func:`open_dataset`); ``token_cache_dir``: where packed
    tokens (and masks) are kept as ``hftokens-<spec_key>.npy`` (``-mask.npy``) and reused, ``None`` to
    read and tokenize on every construction.
    Raises :class:`DataError` subclasses as :func:`iter_records`, and as :class:`TokenDataset` for too
    few tokens."""

    def __init__(self, spec: DatasetSpec, tokenizer: TextTokenizer, seq_len: int, val_fraction: float = 0.05,
                 max_tokens: Optional[int] = None, cache_dir: Optional[Path] = None,
                 token_cache_dir: Optional[Path] = None):
        # TokenDataset.__init__ reads a source spec string; the rows come from ``datasets`` here.
        self.spec = spec.describe()
        self.dataset_spec = spec
        self.tokenizer_fingerprint = tokenizer.fingerprint
        path = Path(token_cache_dir) / f"hftokens-{spec_key(spec, tokenizer, max_tokens)}.npy" \
            if token_cache_dir is not None else None
        got = _load_cached(path, bool(spec.mask_field)) if path is not None else None
        if got is None:
            t0 = time.monotonic()
            records = iter_records(spec, cache_dir)
            if spec.mask_field:
                got = tokenize_with_mask(records, tokenizer, max_tokens)
            else:
                got = tokenize_documents((t for t, _ in records), tokenizer, max_tokens), None
            logger.info(f"tokenized {self.spec}: {len(got[0]):,} tokens in {time.monotonic() - t0:.1f}s")
            if path is not None and len(got[0]):
                if got[1] is not None:
                    _save(path.with_name(path.stem + "-mask.npy"), got[1])
                _save(path, got[0])
        tokens, mask = got
        self._init(tokens, seq_len, val_fraction, eos_id=tokenizer.eos_id, what=self.spec, mask=mask)


def build_hf_dataset(spec: DatasetSpec | Mapping[str, Any], tokenizer_folder: str | Path, hf_config, seq_len: int,
                     val_fraction: float = 0.05, max_tokens: Optional[int] = None,
                     cache_dir: Optional[Path] = None) -> tuple[TextTokenizer, HFTokenDataset]:
    """The tokenizer and packed dataset of a run that brings its own model and data: ``spec`` (a
    :class:`DatasetSpec` or its dict), the model's local ``tokenizer_folder``, checked against
    ``hf_config``'s ``vocab_size`` (:func:`check_tokenizer`). ``cache_dir`` holds packed tokens under
    ``tokens/`` and the ``datasets`` cache under ``datasets/`` (``None``: no token cache, ``datasets``'
    own cache). Raises the :class:`DataError` subclasses of the steps."""
    if not isinstance(spec, DatasetSpec):
        spec = DatasetSpec.from_mapping(spec)
    tok = load_hf_tokenizer(tokenizer_folder)
    check_tokenizer(tok, hf_config)
    root = Path(cache_dir) if cache_dir is not None else None
    ds = HFTokenDataset(spec, tok, seq_len, val_fraction, max_tokens, root / "datasets" if root else None,
                        root / "tokens" if root else None)
    return tok, ds
