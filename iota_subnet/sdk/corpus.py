"""Small local inputs for a run that brings its own ``transformers`` model and ``datasets`` data: a jsonl
corpus from a plain-text file and a tokenizer folder trained on it (examples and tests).

A tokenizer folder for a model family whose ``transformers`` tokenizer class builds its own text
pipeline must be trained with that pipeline. ``AutoTokenizer.from_pretrained`` of an exported model
folder picks the tokenizer class from ``config.json``'s ``model_type``, whatever
``tokenizer_config.json`` names, for the families ``transformers`` lists in
``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`` (``qwen2``, ``qwen3`` -> ``Qwen2Tokenizer``), and that class
rebuilds the normalizer (NFC) and the pre-tokenizer (its regex split, then byte level) from the
vocabulary and merges alone. A byte-level BPE trained with the GPT-2 pre-tokenizer then tokenizes 33
of 50 wikitext paragraphs differently there than the run did, and the exported model's loss on
AutoTokenizer's rows is 6.954 where the network's own evaluation (and ``iota-subnet eval``, which reads
``tokenizer.json`` as the run did) says 6.757 (docs/BENCHMARKS.md, "Qwen2 example").
:func:`write_tokenizer_folder` with ``model_type`` takes the family class's normalizer and
pre-tokenizer, so the run and ``AutoTokenizer`` on the export tokenize alike.

Sources: ``transformers.models.auto.tokenization_auto`` (``AutoTokenizer.from_pretrained``),
``transformers.models.qwen2.tokenization_qwen2``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

from iota_subnet.data import DataError
from iota_subnet.data.tokenizer import EOS_TOKEN, new_bpe


def paragraphs(text_file: str | Path, *, min_chars: int = 40, max_docs: Optional[int] = None) -> list[str]:
    """The lines of ``text_file`` (UTF-8) longer than ``min_chars`` characters once stripped, in order, at
    most ``max_docs``. Raises DataError for a missing file or one without such a line."""
    p = Path(text_file)
    if not p.is_file():
        raise DataError(f"text file {str(p)!r} does not exist; give a UTF-8 text file (one paragraph a line)")
    out = [s.strip() for s in p.read_text(encoding="utf-8").split("\n") if len(s.strip()) > min_chars]
    if not out:
        raise DataError(f"{p} has no line longer than {min_chars} characters")
    return out[:max_docs] if max_docs is not None else out


def write_jsonl(texts: Iterable[str], path: str | Path, field: str = "text") -> Path:
    """One JSON object ``{field: text}`` per line at ``path`` (a ``datasets`` json file); returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({field: t}) + "\n")
    return path


def family_text_pipeline(model_type: Optional[str]):
    """(normalizer, pre_tokenizer) that ``AutoTokenizer`` imposes on a folder of this ``model_type`` (the
    registered tokenizer class's own, built from an empty vocabulary), or None when it keeps the
    ``tokenizer.json``'s (no class registered, or the generic ``TokenizersBackend``)."""
    if not model_type:
        return None
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name
    name = TOKENIZER_MAPPING_NAMES.get(model_type)
    if name is None or name.removesuffix("Fast") in ("TokenizersBackend", "PreTrainedTokenizer", "PythonBackend"):
        return None
    cls = tokenizer_class_from_name(name)
    if cls is None or cls.__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return None
    backend = cls().backend_tokenizer
    return backend.normalizer, backend.pre_tokenizer


def write_tokenizer_folder(docs: Iterable[str], folder: str | Path, vocab_size: int = 8192,
                           model_type: Optional[str] = None) -> tuple[Path, int]:
    """Train a byte-level BPE of ``vocab_size`` ids (fewer on a small corpus; ``<|endoftext|>`` is id 0) on
    ``docs`` and save it as a ``transformers`` tokenizer folder at ``folder``; with ``model_type`` (e.g.
    ``"qwen2"``) it uses that family's normalizer and pre-tokenizer (:func:`family_text_pipeline`, see
    the module docstring). Returns (folder, number of ids). Raises DataError for ``vocab_size`` < 258."""
    from transformers import PreTrainedTokenizerFast
    if vocab_size < 258:
        raise DataError(f"vocab_size={vocab_size} is too small for a byte-level BPE; use at least 258")
    tok, trainer = new_bpe(vocab_size)
    pipeline = family_text_pipeline(model_type)
    if pipeline is not None:
        tok.normalizer, tok.pre_tokenizer = pipeline
    tok.train_from_iterator(list(docs), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN)
    d = Path(folder)
    fast.save_pretrained(str(d))
    return d, len(fast)
