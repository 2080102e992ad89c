"""Fingerprints of what a run trains on, so that every neuron of a run can check it has the same
tokens: neurons publish them in their run commitment (:mod:`iota_subnet.protocol.commitment`) and
refuse to join a run whose fingerprints differ from theirs.

* tokenizer: 16 hex chars of the sha256 of the canonical serialized tokenizer
  (:attr:`TextTokenizer.fingerprint`): equal for equal tokenizers on any machine;
* data: 16 hex chars of the sha256 over ``seq_len``, the train/validation row split and every token
  of those rows (int32, little endian), i.e. over exactly what ``(seed, index)`` sampling can return;
  for a dataset with a loss mask (a ``loss_mask`` array, see :mod:`iota_subnet.data.hf_datasets`) also
  over the mask of those rows (uint8), so the same tokens trained on other spans differ.
"""
from __future__ import annotations

import hashlib
import sys

import numpy as np

from ..protocol.commitment import Fingerprints
from .packing import TokenDataset
from .tokenizer import TextTokenizer


def tokenizer_fingerprint(tokenizer: TextTokenizer) -> str:
    """The tokenizer's fingerprint (16 hex chars)."""
    return tokenizer.fingerprint


def data_fingerprint(dataset: TokenDataset) -> str:
    """The packed dataset's fingerprint (16 hex chars); hashes every token of its rows (about 0.1 s
    per 20M tokens)."""
    row = dataset.seq_len + 1
    n_rows = dataset.n_train_rows + dataset.n_val_rows
    mask = dataset.loss_mask
    h = hashlib.sha256(f"iota-data/1 seq_len={dataset.seq_len} train={dataset.n_train_rows} "
                       f"val={dataset.n_val_rows}{' mask=1' if mask is not None else ''}\n".encode())
    tokens = np.ascontiguousarray(dataset.tokens[: n_rows * row], dtype=np.int32)
    if sys.byteorder != "little":
        tokens = tokens.byteswap()
    h.update(memoryview(tokens).cast("B"))
    if mask is not None:
        h.update(memoryview(np.ascontiguousarray(mask[: n_rows * row], dtype=np.uint8)).cast("B"))
    return h.hexdigest()[:16]


def fingerprints(tokenizer: TextTokenizer, dataset: TokenDataset) -> Fingerprints:
    """Both fingerprints of a built run dataset."""
    return Fingerprints(tokenizer=tokenizer_fingerprint(tokenizer), data=data_fingerprint(dataset))
