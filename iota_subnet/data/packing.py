"""Packed token dataset with deterministic sample addressing.

Documents are tokenized and joined into one flat ``int32`` array, each followed by the EOS token::

    doc0 EOS doc1 EOS doc2 EOS ...

The array is cut into non-overlapping rows of ``seq_len + 1`` tokens (a row's inputs are
``row[:-1]``, its targets ``row[1:]``); trailing tokens that do not fill a row are dropped. The last
``val_fraction`` of the rows (at least one) is the validation slice and is never used for training.

Sample ``index`` under ``seed`` is train row ``perm(seed, index // n_train_rows)[index % n_train_rows]``
where ``perm(seed, epoch)`` is a permutation drawn with numpy's PCG64 seeded by ``(seed, epoch)``: the
same (seed, index) gives the same tokens on any machine, and every epoch is reshuffled.

A dataset may carry a loss mask (one ``uint8`` per token, see :mod:`iota_subnet.data.hf_datasets`): its
target rows (:meth:`TokenDataset.target_batch`) hold :data:`IGNORE_INDEX` on the targets the mask leaves
unmarked, which the loss never trains (:func:`iota_subnet.model.lm_loss.masked_lm_loss`).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch
from loguru import logger

from ..protocol.ticket import SPLITS
from ..utils.atomic import atomic_write_json, atomic_write_with
from ..utils.progress import Progress
from .sources import HF_PREFIX, DataError, describe, iter_documents, local_size, source_key
from .tokenizer import TextTokenizer

#: Token cap applied to streamed (``hf://``) sources when no ``max_tokens`` is given.
DEFAULT_STREAM_MAX_TOKENS = 20_000_000
_ENCODE_CHUNK = 256  # documents per encode_batch call

IGNORE_INDEX = -100
"""Target value that is never trained (``transformers``' and PyTorch's ``ignore_index``)."""


def masked_target_rows(rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Packed rows ``[B, T + 1]`` (int64) whose targets (``[:, 1:]``) are :data:`IGNORE_INDEX` where the
    mask row ``[B, T + 1]`` is zero: what a last stage that reads its targets as ``rows[:, 1:]`` trains on
    (the inputs ``[:, :-1]`` then hold ignored ids too; only a stage that takes no token input may use
    them). Returns a new tensor on ``rows``' device (``mask`` must be on it too). Raises ``ValueError``
    for mismatched shapes."""
    if tuple(rows.shape) != tuple(mask.shape):
        raise ValueError(f"rows {tuple(rows.shape)} and mask {tuple(mask.shape)} must have the same shape")
    out = rows.clone()
    out[:, 1:] = out[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
    return out


def tokenize_documents(docs: Iterable[str], tokenizer: TextTokenizer, max_tokens: Optional[int] = None,
                       total_chars: Optional[int] = None) -> np.ndarray:
    """Tokenize ``docs`` into one flat ``np.int32`` array, each document followed by ``tokenizer.eos_id``;
    cut to at most ``max_tokens`` tokens (reading stops once the cap is reached). Progress with an
    ETA against ``max_tokens``, else against ``total_chars`` (the source's size) when known; sources
    under 4 M characters tokenize in seconds and show none."""
    prog = (Progress(max_tokens, "tokenizing", "tok", unit_scale=True) if max_tokens else
            Progress(total_chars, "tokenizing", "char", unit_scale=True, min_total=4_000_000 if total_chars else 0))
    parts: list[np.ndarray] = []
    total = 0
    eos = np.array([tokenizer.eos_id], dtype=np.int32)
    chunk: list[str] = []

    def flush() -> bool:
        nonlocal total
        before = total
        if not max_tokens:
            prog.update(sum(len(d) for d in chunk))
        for ids in tokenizer.encode_batch(chunk):
            parts.append(np.asarray(ids, dtype=np.int32))
            parts.append(eos)
            total += len(ids) + 1
            if max_tokens is not None and total >= max_tokens:
                return True
        if max_tokens:
            prog.update(total - before)
        chunk.clear()
        return False

    with prog:
        for d in docs:
            chunk.append(d)
            if len(chunk) >= _ENCODE_CHUNK and flush():
                break
        else:
            if chunk:
                flush()
    out = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    if max_tokens is not None:
        out = out[:max_tokens]
    return np.ascontiguousarray(out, dtype=np.int32)


class TokenDataset:
    """Packed rows of ``seq_len + 1`` tokens with a held-out validation slice.

    Build from a source spec (tokenized once, cached as ``<cache_dir>/tokens-<source_key>-<tokenizer
    fingerprint>-<cap>.npy``) or from an existing token array with :meth:`from_tokens`.

    ``seq_len``: tokens per input row; ``val_fraction``: share of rows held out (at least 1 row);
    ``max_tokens``: cap on the packed tokens (``hf://`` sources default to
    :data:`DEFAULT_STREAM_MAX_TOKENS`); ``cache_dir``: ``None`` disables the disk cache.
    Raises :class:`DataError` for a bad source or when the data holds fewer than ``2 * (seq_len + 1)``
    tokens; ``ValueError`` for ``seq_len < 1`` or ``val_fraction`` outside [0, 1).
    """

    def __init__(self, spec: str, tokenizer: TextTokenizer, seq_len: int, val_fraction: float = 0.05,
                 max_tokens: Optional[int] = None, cache_dir: Optional[Path] = None):
        if max_tokens is None and spec.startswith(HF_PREFIX):
            max_tokens = DEFAULT_STREAM_MAX_TOKENS
            logger.info(f"{spec} is streamed: packing at most {max_tokens:,} tokens (set data.max_tokens to change)")
        self.spec = spec
        self.tokenizer_fingerprint = tokenizer.fingerprint
        tokens = self._load_or_build(spec, tokenizer, max_tokens, cache_dir)
        self._init(tokens, seq_len, val_fraction, eos_id=tokenizer.eos_id, what=spec)

    @classmethod
    def from_tokens(cls, tokens: np.ndarray, seq_len: int, val_fraction: float = 0.05,
                    eos_id: Optional[int] = None) -> "TokenDataset":
        """A dataset over an existing 1-D token array (copied to ``np.int32``); no tokenizer, no cache."""
        self = cls.__new__(cls)
        self.spec = "<tokens>"
        self.tokenizer_fingerprint = None
        self._init(np.ascontiguousarray(np.asarray(tokens).reshape(-1), dtype=np.int32), seq_len, val_fraction,
                   eos_id=eos_id, what="token array")
        return self

    # ------------------------------------------------------------------------------------ building
    @staticmethod
    def _load_or_build(spec: str, tokenizer: TextTokenizer, max_tokens: Optional[int],
                       cache_dir: Optional[Path]) -> np.ndarray:
        key = source_key(spec)
        path = None
        if cache_dir is not None:
            path = Path(cache_dir) / f"tokens-{key}-{tokenizer.fingerprint}-{max_tokens or 'all'}.npy"
            if path.exists():
                try:
                    tokens = np.load(path, mmap_mode="r")
                    logger.info(f"packed tokens loaded from cache {path} ({len(tokens):,} tokens)")
                    return tokens
                except (OSError, ValueError) as e:
                    logger.warning(f"ignoring unreadable token cache {path} ({e}); rebuilding")
        t0 = time.monotonic()
        tokens = tokenize_documents(iter_documents(spec), tokenizer, max_tokens, local_size(spec))
        logger.info(f"tokenized {describe(spec)}: {len(tokens):,} tokens in {time.monotonic() - t0:.1f}s")
        if path is not None and len(tokens):
            def _w(tmp: str) -> None:
                with open(tmp, "wb") as f:
                    np.save(f, tokens)
            atomic_write_with(path, _w)
            atomic_write_json(path.with_suffix(".json"), {
                "spec": spec, "source_key": key, "tokenizer": tokenizer.name,
                "tokenizer_fingerprint": tokenizer.fingerprint, "max_tokens": max_tokens, "n_tokens": int(len(tokens))})
        return tokens

    def _init(self, tokens: np.ndarray, seq_len: int, val_fraction: float, eos_id: Optional[int], what: str,
              mask: Optional[np.ndarray] = None) -> None:
        """Rows of ``tokens`` (and of the loss ``mask``, one entry per token, ``None`` for none).
        Raises ``ValueError`` for a bad ``seq_len``, ``val_fraction`` or mask length."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if mask is not None and len(mask) != len(tokens):
            raise ValueError(f"the loss mask has {len(mask):,} entries for {len(tokens):,} tokens")
        self._tokens = tokens
        self._seq_len = int(seq_len)
        self.eos_id = eos_id
        row = seq_len + 1
        n_rows = len(tokens) // row
        if n_rows < 2:
            raise DataError(f"{what} has {len(tokens):,} tokens, fewer than 2 rows of seq_len+1={row}; "
                            f"use more data or a smaller data.seq_len")
        self._rows = tokens[: n_rows * row].reshape(n_rows, row)
        self._n_val = min(n_rows - 1, max(1, int(round(n_rows * val_fraction))))
        self._n_train = n_rows - self._n_val
        #: the loss mask, one ``uint8`` per token (nonzero: the target is trained), or ``None``: all are
        self.loss_mask: Optional[np.ndarray] = mask
        self._mask_rows = mask[: n_rows * row].reshape(n_rows, row) if mask is not None else None
        self._perms: "OrderedDict[tuple[int, int], np.ndarray]" = OrderedDict()
        logger.info(f"dataset: {len(tokens):,} tokens -> {self._n_train} train + {self._n_val} val rows of {row} tokens")

    # --------------------------------------------------------------------------------- properties
    @property
    def seq_len(self) -> int:
        """Input tokens per sample (a sample holds ``seq_len + 1`` tokens)."""
        return self._seq_len

    @property
    def n_tokens(self) -> int:
        """Tokens in the packed array (before cutting into rows)."""
        return int(len(self._tokens))

    @property
    def n_train_rows(self) -> int:
        return self._n_train

    @property
    def n_val_rows(self) -> int:
        return self._n_val

    @property
    def tokens(self) -> np.ndarray:
        """The flat ``np.int32`` token array (read-only view; may be memory-mapped)."""
        return self._tokens

    @property
    def has_loss_mask(self) -> bool:
        """Whether only the targets a loss mask marks are trained (:attr:`loss_mask` is not ``None``)."""
        return self.loss_mask is not None

    @property
    def val_rows(self) -> torch.LongTensor:
        """All validation rows: ``LongTensor[n_val_rows, seq_len + 1]``."""
        return torch.from_numpy(np.array(self._rows[self._n_train:], dtype=np.int64))

    # ------------------------------------------------------------------------------------ sampling
    def _perm(self, seed: int, epoch: int) -> np.ndarray:
        key = (seed, epoch)
        p = self._perms.get(key)
        if p is None:
            p = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(self._n_train)
            self._perms[key] = p
            if len(self._perms) > 8:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(key)
        return p

    def train_row(self, seed: int, index: int) -> int:
        """The train row (0 <= row < n_train_rows) that sample ``index`` maps to under ``seed``.
        Raises ``ValueError`` for a negative seed or index."""
        seed, index = int(seed), int(index)
        if seed < 0 or index < 0:
            raise ValueError(f"seed and index must be >= 0, got seed={seed}, index={index}")
        epoch, pos = divmod(index, self._n_train)
        return int(self._perm(seed, epoch)[pos])

    def sample(self, seed: int, index: int) -> torch.LongTensor:
        """Sample ``index`` under ``seed``: ``LongTensor[seq_len + 1]`` (inputs ``[:-1]``, targets ``[1:]``)."""
        return torch.from_numpy(np.array(self._rows[self.train_row(seed, index)], dtype=np.int64))

    def batch(self, seed: int, start_index: int, n: int) -> torch.LongTensor:
        """Samples ``start_index .. start_index + n - 1``: ``LongTensor[n, seq_len + 1]``."""
        rows = [self.train_row(seed, start_index + k) for k in range(n)]
        return torch.from_numpy(np.array(self._rows[rows], dtype=np.int64).reshape(n, self._seq_len + 1))

    def val_batch(self, start: int, n: int) -> torch.LongTensor:
        """Validation rows ``start .. start + n - 1`` (counted within the validation slice, wrapping
        modulo ``n_val_rows``), as ``LongTensor[n, seq_len + 1]``. Like :meth:`batch`, the first
        argument is a row index, not a batch number: batch ``i`` of size ``n`` is ``val_batch(i * n, n)``."""
        idx = self._val_idx(start, n)
        return torch.from_numpy(np.array(self._rows[idx], dtype=np.int64).reshape(n, self._seq_len + 1))

    def _val_idx(self, start: int, n: int) -> list[int]:
        return [self._n_train + (int(start) + k) % self._n_val for k in range(n)]

    def _mask_of(self, rows: list[int]) -> torch.BoolTensor:
        if self._mask_rows is None:
            return torch.ones(len(rows), self.seq_len + 1, dtype=torch.bool)
        return torch.from_numpy(np.array(self._mask_rows[rows], dtype=np.bool_).reshape(len(rows), self.seq_len + 1))

    def mask_batch(self, seed: int, start_index: int, n: int) -> torch.BoolTensor:
        """Loss masks of :meth:`batch`'s rows: ``BoolTensor[n, seq_len + 1]`` (targets use ``[:, 1:]``; all
        ``True`` without a loss mask)."""
        return self._mask_of([self.train_row(seed, start_index + k) for k in range(n)])

    def val_mask_batch(self, start: int, n: int) -> torch.BoolTensor:
        """Loss masks of :meth:`val_batch`'s rows: ``BoolTensor[n, seq_len + 1]``."""
        return self._mask_of(self._val_idx(start, n))

    def split_batch(self, split: str, seed: int, start: int, n: int) -> torch.LongTensor:
        """Rows of a split: ``batch(seed, start, n)`` for ``"train"``, ``val_batch(start, n)`` for
        ``"val"`` (``seed`` unused), as ``LongTensor[n, seq_len + 1]``. Raises ``ValueError`` for another
        split."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return self.batch(seed, start, n) if split == "train" else self.val_batch(start, n)

    def target_batch(self, split: str, seed: int, start: int, n: int) -> torch.LongTensor:
        """The rows of :meth:`split_batch` as a last stage reads its targets (``[:, 1:]``): with a loss
        mask, the targets it leaves unmarked are :data:`IGNORE_INDEX` (:func:`masked_target_rows`; the
        inputs ``[:, :-1]`` then hold ignored ids too), without one the rows themselves.
        ``LongTensor[n, seq_len + 1]`` on the CPU. Raises ``ValueError`` for another split."""
        rows = self.split_batch(split, seed, start, n)
        if not self.has_loss_mask:
            return rows
        mask = self.mask_batch(seed, start, n) if split == "train" else self.val_mask_batch(start, n)
        return masked_target_rows(rows, mask)

    def __len__(self) -> int:
        return self._n_train

    def __repr__(self) -> str:
        return (f"TokenDataset(spec={self.spec!r}, n_tokens={self.n_tokens}, seq_len={self.seq_len}, "
                f"n_train_rows={self.n_train_rows}, n_val_rows={self.n_val_rows})")
