"""Data pipeline: text sources -> tokenizer -> packed token rows with deterministic sampling.

Typical use::

    tok, ds = build_dataset(cfg.data, data="path/to/corpus.txt")
    x = ds.batch(seed, start_index, n)        # LongTensor[n, seq_len + 1]
    inputs, targets = x[:, :-1], x[:, 1:]
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from loguru import logger

from ..config import DataConfig
from .fingerprint import data_fingerprint, fingerprints, tokenizer_fingerprint
from .packing import DEFAULT_STREAM_MAX_TOKENS, TokenDataset, tokenize_documents
from .sources import (DEFAULT_HF_SPEC, STDLIB_SPEC, SUPPORTED_EXTENSIONS, DataError, default_source, describe,
                      hub_reachable, hub_status, iter_documents, local_size, source_key)
from .tokenizer import EOS_TOKEN, TextTokenizer, hub_tokenizer_path, load_tokenizer, train_bpe

__all__ = [
    "DataError", "TextTokenizer", "TokenDataset", "build_dataset", "default_cache_dir", "default_source",
    "describe", "hub_reachable", "hub_status", "hub_tokenizer_path", "iter_documents", "load_tokenizer", "source_key",
    "tokenize_documents", "train_bpe", "DEFAULT_HF_SPEC", "DEFAULT_STREAM_MAX_TOKENS", "EOS_TOKEN",
    "STDLIB_SPEC", "SUPPORTED_EXTENSIONS", "data_fingerprint", "fingerprints", "tokenizer_fingerprint",
]


def default_cache_dir() -> Path:
    """``$IOTA_CACHE`` if set, else ``~/.cache/iota-subnet``."""
    env = os.environ.get("IOTA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "iota-subnet"


def build_dataset(cfg: DataConfig, data: Optional[str], cache_dir: Optional[Path] = None, *,
                  allow_fallback: bool = False) -> tuple[TextTokenizer, TokenDataset]:
    """Tokenizer and packed dataset for a run.

    ``data``: a source spec (see :mod:`iota_subnet.data.sources`); ``None`` picks
    :func:`default_source`. ``cache_dir`` (default :func:`default_cache_dir`) holds tokenizers under
    ``tokenizers/`` and packed tokens under ``tokens/``.

    ``allow_fallback``: when the Hugging Face hub is unreachable, train on the Python standard
    library's source (no ``data`` given) and train a BPE instead of the named tokenizer. Off by
    default: every neuron of a run must train on the same tokens, so a silent substitute is refused
    (``localnet`` turns it on; neurons take ``--allow-data-fallback``).
    Raises :class:`DataError` for a bad source, too little data, a tokenizer with more ids than
    ``cfg.vocab_size`` (the model's embedding could not hold them), or a refused fallback.
    """
    if getattr(cfg, "hf", None) is not None:     # a datasets dataset and the model's tokenizer folder
        if data is not None:
            raise DataError(f"the run config names its data (data.hf: {cfg.hf.get('path')!r}) but --data {data!r} was "
                            "given too; drop --data (every neuron reads the config's dataset)")
        from .hf_datasets import build_hf_dataset
        cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        return build_hf_dataset(cfg.hf, cfg.tokenizer, {"vocab_size": cfg.vocab_size}, cfg.seq_len, cfg.val_fraction,
                                cfg.max_tokens, cache_dir / "hf")
    if data is None:
        data, why = default_source()
        if data == STDLIB_SPEC and not allow_fallback:
            raise DataError(f"no data given and the run's default ({DEFAULT_HF_SPEC}) is out of reach ({why}); pass "
                            "the run's data with --data PATH (or hf://... once the hub is reachable), or "
                            "--allow-data-fallback to train on the Python standard library's source (every neuron of "
                            "the run must then do the same)")
    else:
        data = str(data)
        logger.info(f"data: {describe(data)}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = source_key(data)
    tok = load_tokenizer(cfg.tokenizer, lambda: iter_documents(data), cfg.vocab_size, cache_dir / "tokenizers", key,
                         local_size(data), allow_fallback=allow_fallback)
    if tok.vocab_size > cfg.vocab_size:
        raise DataError(f"tokenizer {tok.name!r} has {tok.vocab_size} ids but data.vocab_size is {cfg.vocab_size}; "
                        f"set data.vocab_size and model.vocab_size to at least {tok.vocab_size}")
    ds = TokenDataset(data, tok, cfg.seq_len, cfg.val_fraction, cfg.max_tokens, cache_dir / "tokens")
    return tok, ds
