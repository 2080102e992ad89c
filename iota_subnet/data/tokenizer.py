"""Tokenizers: a Hugging Face hub tokenizer by name, or a byte-level BPE trained on the corpus.

Trained tokenizers are cached as ``<cache_dir>/bpe-<corpus_key>-v<vocab_size>.json`` and hub
tokenizers as ``<cache_dir>/hf-<name>.json`` (so a hub tokenizer, once fetched, also loads offline;
without the hub and without that file, loading a named tokenizer is a :class:`DataError`).
Every file is written atomically.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from loguru import logger
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..utils.atomic import atomic_write_text
from ..utils.progress import Progress
from .sources import DataError, hub_status, limit_chars

EOS_TOKEN = "<|endoftext|>"
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
#: At most this many characters of corpus are used to train a BPE (bounds time on huge sources).
MAX_TRAIN_CHARS = 40_000_000


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the few operations the pipeline needs.

    ``name``: a hub name or ``bpe-<corpus_key>-v<vocab_size>``; ``eos_id``: the end-of-text token id
    placed between documents; ``vocab_size``: number of ids including special tokens (every id is
    ``< vocab_size``); ``fingerprint``: 16 hex chars of the sha256 of the canonical serialized
    tokenizer, equal for equal tokenizers on any machine.
    ``eos_token``: the end-of-text token to use (a model tokenizer's declared one), tried before the
    usual names.
    Raises :class:`DataError` if the tokenizer has no recognisable end-of-text token.
    """

    def __init__(self, tokenizer: Tokenizer, name: str, eos_token: Optional[str] = None):
        self.tokenizer = tokenizer
        self.name = name
        eos = None
        for tok in ((eos_token,) if eos_token else ()) + _EOS_CANDIDATES:
            eos = tokenizer.token_to_id(tok)
            if eos is not None:
                break
        if eos is None:
            raise DataError(f"tokenizer {name!r} has no end-of-text token (looked for {list(_EOS_CANDIDATES)}); "
                            "use another tokenizer or leave data.tokenizer unset to train one")
        self.eos_id: int = int(eos)
        self.vocab_size: int = int(tokenizer.get_vocab_size(with_added_tokens=True))
        canon = json.dumps(json.loads(tokenizer.to_str()), sort_keys=True, separators=(",", ":"))
        self.fingerprint: str = hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, computed in one call."""
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens kept, so ``decode(encode(x)) == x`` for a trained BPE)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_str(self) -> str:
        """The serialized tokenizer (JSON)."""
        return self.tokenizer.to_str()

    def __repr__(self) -> str:
        return f"TextTokenizer(name={self.name!r}, vocab_size={self.vocab_size}, fingerprint={self.fingerprint})"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def new_bpe(vocab_size: int) -> tuple[Tokenizer, trainers.BpeTrainer]:
    """An untrained byte-level BPE tokenizer and its trainer (``<|endoftext|>`` is id 0)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    return tok, trainer


def _counted(docs: Iterable[str], prog: Progress) -> Iterable[str]:
    for d in docs:
        prog.update(len(d))
        yield d


def train_bpe(docs: Iterable[str], vocab_size: int, total_chars: Optional[int] = None) -> Tokenizer:
    """Train a byte-level BPE with ``vocab_size`` ids (fewer if the corpus is too small) on ``docs``.
    Progress (with an ETA when ``total_chars`` is known) covers reading the corpus; the merges are
    computed after it, inside ``tokenizers``."""
    if vocab_size < 257 + 1:
        raise DataError(f"vocab_size={vocab_size} is too small for a byte-level BPE; use at least 258")
    tok, trainer = new_bpe(vocab_size)
    total = min(total_chars, MAX_TRAIN_CHARS) if total_chars else None
    with Progress(total, "tokenizer training: reading the corpus", "char", unit_scale=True,
                  min_total=4_000_000 if total else 0) as prog:
        tok.train_from_iterator(_counted(limit_chars(docs, MAX_TRAIN_CHARS), prog), trainer=trainer)
    return tok


def hub_tokenizer_path(name: str, cache_dir: Path) -> Path:
    """Where a hub tokenizer is cached (``<cache_dir>/hf-<name>.json``)."""
    return Path(cache_dir) / f"hf-{_safe(name)}.json"


def _load_hub(name: str, cache_dir: Path, allow_fallback: bool) -> Optional[TextTokenizer]:
    path = hub_tokenizer_path(name, cache_dir)
    if path.exists():
        logger.info(f"tokenizer {name!r} loaded from cache {path}")
        return TextTokenizer(Tokenizer.from_file(str(path)), name)
    fix = (f"fetch it once where the hub is reachable, e.g. python -c \"from tokenizers import Tokenizer; "
           f"open('{path.name}', 'w').write(Tokenizer.from_pretrained('{name}').to_str())\", and copy the file "
           f"to {path} (or point $IOTA_CACHE at a cache that has it)")
    ok, why = hub_status()
    error = None
    if not ok:
        why = f"is not cached at {path} and the Hugging Face hub is unreachable ({why})"
    else:
        try:
            tok = Tokenizer.from_pretrained(name)
        except Exception as e:
            why, error = f"could not be loaded from the Hugging Face hub ({e.__class__.__name__}: {e})", e
    if not ok or error is not None:
        if not allow_fallback:
            raise DataError(f"tokenizer {name!r} {why}; every neuron of a run must use the same tokenizer, so none is "
                            f"substituted: {fix}; or pass --allow-data-fallback to train a byte-level BPE instead")
        logger.warning(f"tokenizer {name!r} {why}; falling back to training a byte-level BPE on the corpus (asked for)")
        return None
    atomic_write_text(path, tok.to_str())
    logger.info(f"tokenizer {name!r} downloaded from the Hugging Face hub, cached at {path}")
    return TextTokenizer(tok, name)


def load_tokenizer(name: Optional[str], corpus_docs: Optional[Callable[[], Iterable[str]]], vocab_size: int,
                   cache_dir: Path, corpus_key: str, total_chars: Optional[int] = None, *,
                   allow_fallback: bool = False) -> TextTokenizer:
    """Load or train the tokenizer.

    ``name``: a hub tokenizer, read from its cache file or fetched from the hub (then cached). Every
    neuron of a run must tokenize alike, so a named tokenizer is never replaced by another one unless
    ``allow_fallback`` (localnet, or asked for): then, with a warning, a BPE trained instead.
    ``total_chars``: the corpus size, for progress while training.
    ``None``: a byte-level BPE with ``vocab_size`` ids trained on
    ``corpus_docs()`` (at most :data:`MAX_TRAIN_CHARS` characters), cached in ``cache_dir`` under
    (``corpus_key``, ``vocab_size``) and reused on later calls.
    Raises :class:`DataError` when a named tokenizer is neither cached nor fetchable (the message
    says where to put the file), when a BPE must be trained but ``corpus_docs`` is ``None`` or yields
    no text, or when the tokenizer lacks an end-of-text token.
    """
    cache_dir = Path(cache_dir)
    if name:
        got = _load_hub(name, cache_dir, allow_fallback)
        if got is not None:
            if got.vocab_size != vocab_size:
                logger.warning(f"tokenizer {name!r} has {got.vocab_size} ids, data.vocab_size is {vocab_size}")
            return got
    bpe_name = f"bpe-{_safe(corpus_key)}-v{vocab_size}"
    path = cache_dir / f"{bpe_name}.json"
    if path.exists():
        tt = TextTokenizer(Tokenizer.from_file(str(path)), bpe_name)
        logger.info(f"tokenizer {bpe_name} loaded from cache {path} ({tt.vocab_size} ids)")
        return tt
    if corpus_docs is None:
        raise DataError(f"no cached tokenizer at {path} and no corpus to train one on; pass data (or a reachable "
                        "hub tokenizer name)")
    t0 = time.monotonic()
    tok = train_bpe(corpus_docs(), vocab_size, total_chars)
    tt = TextTokenizer(tok, bpe_name)
    if tt.vocab_size <= 257:
        raise DataError(f"the corpus for {bpe_name} yielded no text to train a tokenizer on; pass data with text")
    if tt.vocab_size < vocab_size:
        logger.warning(f"corpus too small for {vocab_size} ids: the BPE has only {tt.vocab_size}")
    atomic_write_text(path, tok.to_str())
    logger.info(f"tokenizer {bpe_name} trained in {time.monotonic() - t0:.1f}s ({tt.vocab_size} ids), "
                f"cached at {path}")
    return tt
