"""Data pipeline: sources, tokenizer, packing and deterministic sampling (runs offline)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from loguru import logger

from iota_subnet.config import DataConfig
from iota_subnet.data.sources import parse_hf_spec
from iota_subnet.data import (STDLIB_SPEC, DataError, TextTokenizer, TokenDataset, build_dataset, default_source,
                              hub_reachable, hub_tokenizer_path, iter_documents, load_tokenizer, source_key)

VOCAB = DataConfig().vocab_size
SEQ = 128


@pytest.fixture()
def logs():
    records: list[str] = []
    sink = logger.add(lambda m: records.append(str(m)), level="DEBUG")
    yield records
    logger.remove(sink)


@pytest.fixture(scope="session")
def wiki_tok(wikitext_path, cache_dir) -> TextTokenizer:
    spec = str(wikitext_path)
    return load_tokenizer(None, lambda: iter_documents(spec), VOCAB, cache_dir / "tokenizers", source_key(spec))


@pytest.fixture(scope="session")
def wiki_ds(wikitext_path, wiki_tok, cache_dir) -> TokenDataset:
    return TokenDataset(str(wikitext_path), wiki_tok, SEQ, 0.05, cache_dir=cache_dir / "tokens")


def _lines(path: Path, n: int) -> list[str]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip() and not line.strip().startswith("="):
                out.append(line.rstrip("\n"))
            if len(out) >= n:
                break
    return out


# ------------------------------------------------------------------------------------ tokenizer
def test_tokenizer_roundtrip_on_real_lines(wiki_tok, wikitext_path):
    lines = _lines(wikitext_path, 300)
    assert len(lines) == 300
    for line in lines:
        ids = wiki_tok.encode(line)
        assert ids and all(0 <= i < wiki_tok.vocab_size for i in ids)
        assert wiki_tok.decode(ids) == line
    assert wiki_tok.encode_batch(lines[:5]) == [wiki_tok.encode(x) for x in lines[:5]]
    odd = "naïve café — ∑ 😀 tabs\tand  spaces\n<|endoftext|>"
    assert wiki_tok.decode(wiki_tok.encode(odd)) == odd  # byte-level: nothing is unknown


def test_tokenizer_vocab_eos_fingerprint(wiki_tok):
    assert wiki_tok.vocab_size == VOCAB
    assert wiki_tok.eos_id == wiki_tok.tokenizer.token_to_id("<|endoftext|>")
    assert wiki_tok.encode("<|endoftext|>") == [wiki_tok.eos_id]
    assert len(wiki_tok.fingerprint) == 16 and int(wiki_tok.fingerprint, 16) >= 0


def test_tokenizer_cache_reuse(wikitext_path, tmp_path, logs):
    spec = str(wikitext_path)
    calls = []

    def corpus():
        calls.append(1)
        return iter_documents(spec)

    t1 = load_tokenizer(None, corpus, 1024, tmp_path, source_key(spec))
    files = list(tmp_path.glob("bpe-*-v1024.json"))
    assert len(files) == 1 and len(calls) == 1
    assert any("trained" in r for r in logs)
    mtime = files[0].stat().st_mtime_ns
    logs.clear()
    t2 = load_tokenizer(None, corpus, 1024, tmp_path, source_key(spec))
    assert len(calls) == 1, "second load must not read the corpus again"
    assert any("loaded from cache" in r for r in logs) and not any("trained" in r for r in logs)
    assert files[0].stat().st_mtime_ns == mtime
    assert t2.fingerprint == t1.fingerprint and t2.vocab_size == 1024
    # another vocab size is another cache entry and another fingerprint
    t3 = load_tokenizer(None, corpus, 512, tmp_path, source_key(spec))
    assert t3.fingerprint != t1.fingerprint and len(calls) == 2
    # training is deterministic: a fresh cache trains the same tokenizer (same fingerprint)
    t4 = load_tokenizer(None, corpus, 1024, tmp_path / "fresh", source_key(spec))
    assert t4.fingerprint == t1.fingerprint and len(calls) == 3


def test_named_tokenizer_offline_is_a_clear_error(wikitext_path, tmp_path):
    """A named (hub) tokenizer is never silently replaced by a BPE trained here: neurons of one run
    would tokenize differently. Without the hub and without the cached file: DataError naming the path."""
    assert not hub_reachable()  # conftest sets HF_HUB_OFFLINE=1
    spec = str(wikitext_path)
    with pytest.raises(DataError, match=r"not cached at .*hf-gpt2\.json.*unreachable.*copy the file"):
        load_tokenizer("gpt2", lambda: iter_documents(spec), 512, tmp_path, source_key(spec))
    assert not list(tmp_path.iterdir())      # nothing trained, nothing cached


def test_named_tokenizer_loads_offline_from_its_cache(wikitext_path, tmp_path):
    """Once fetched (here: a tokenizer file put where the fetch would have cached it), it loads offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|end_of_text|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(iter_documents(str(wikitext_path)))[:20], trainer=trainer)
    name = "NousResearch/Meta-Llama-3-8B"
    path = hub_tokenizer_path(name, tmp_path)
    path.write_text(tok.to_str())
    got = load_tokenizer(name, None, 400, tmp_path, "unused")
    assert got.name == name and got.eos_id == tok.token_to_id("<|end_of_text|>") and got.vocab_size == 400


def test_large_configs_name_a_hub_tokenizer_and_fail_clearly_offline(wikitext_path, tmp_path):
    from iota_subnet.config import load_config
    repo = Path(__file__).resolve().parents[1]
    for name in ("1b", "8b"):
        cfg = load_config(repo / "configs" / f"{name}.yaml")
        assert cfg.data.tokenizer and cfg.data.vocab_size == 128256 == cfg.model.vocab_size
        assert cfg.data.seq_len == 2048
        with pytest.raises(DataError, match=f"{cfg.data.tokenizer}.*not cached.*unreachable"):
            build_dataset(cfg.data, str(wikitext_path), tmp_path)


def test_named_tokenizer_offline_falls_back_to_training_only_when_asked(wikitext_path, tmp_path, logs):
    assert not hub_reachable()  # conftest sets HF_HUB_OFFLINE=1
    spec = str(wikitext_path)
    with pytest.raises(DataError, match="gpt2.*unreachable.*--allow-data-fallback"):
        load_tokenizer("gpt2", lambda: iter_documents(spec), 512, tmp_path, source_key(spec))
    tok = load_tokenizer("gpt2", lambda: iter_documents(spec), 512, tmp_path, source_key(spec), allow_fallback=True)
    assert tok.vocab_size == 512 and tok.name.startswith("bpe-")
    assert any("WARNING" in r and "gpt2" in r and "training" in r for r in logs)
    with pytest.raises(DataError, match="no corpus"):
        load_tokenizer("gpt2", None, 512, tmp_path / "empty", "k", allow_fallback=True)


# -------------------------------------------------------------------------------------- sources
def test_wikitext_split_into_articles(wikitext_path):
    docs = list(iter_documents(str(wikitext_path)))
    assert 20 < len(docs) < 1000
    assert all(d.startswith("= ") and not d.startswith("= =") for d in docs)
    assert docs[0].startswith("= Homarus gammarus =")


def test_plain_text_paragraphs(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("first para\nline two\n\n\nsecond para\n\nthird\n")
    assert list(iter_documents(str(p))) == ["first para\nline two", "second para", "third"]


def test_jsonl_parquet_and_directory_sources(wikitext_path, tmp_path, wiki_tok):
    lines = _lines(wikitext_path, 40)
    d = tmp_path / "corpus"
    d.mkdir()
    with open(d / "a.jsonl", "w") as f:
        for x in lines[:20]:
            f.write(json.dumps({"text": x, "id": 1}) + "\n")
    pq.write_table(pa.table({"text": lines[20:], "n": list(range(20))}), d / "b.parquet", row_group_size=7)
    (d / "notes.md").write_text("ignored: unsupported extension inside a folder")
    assert list(iter_documents(str(d / "a.jsonl"))) == lines[:20]
    assert list(iter_documents(str(d / "b.parquet"))) == lines[20:]
    assert list(iter_documents(str(d))) == lines  # sorted: a.jsonl then b.parquet
    k = source_key(str(d))
    assert k == source_key(str(d)) and len(k) == 16
    (d / "c.txt").write_text("more text\n")
    assert source_key(str(d)) != k
    ds = TokenDataset(str(d), wiki_tok, 16, 0.1)
    assert ds.n_train_rows >= 1 and ds.n_val_rows >= 1


def test_error_missing_path(tmp_path):
    with pytest.raises(DataError, match="does not exist.*pass an existing"):
        iter_documents(str(tmp_path / "nope.txt"))
    with pytest.raises(DataError, match="does not exist"):
        source_key(str(tmp_path / "nope.txt"))


def test_error_empty_file(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text("")
    with pytest.raises(DataError, match="is empty.*fill it with text"):
        list(iter_documents(str(p)))
    p2 = tmp_path / "blank.txt"
    p2.write_text("\n   \n\n")
    with pytest.raises(DataError, match="is empty"):
        list(iter_documents(str(p2)))
    p3 = tmp_path / "e.jsonl"
    p3.write_text('{"text": ""}\n')
    with pytest.raises(DataError, match="is empty"):
        list(iter_documents(str(p3)))
    d = tmp_path / "d"
    d.mkdir()
    (d / "x.txt").write_text("")
    with pytest.raises(DataError, match="holds no text"):
        list(iter_documents(str(d)))


def test_error_unsupported_extension_and_bad_fields(tmp_path):
    p = tmp_path / "data.csv"
    p.write_text("a,b\n")
    with pytest.raises(DataError, match=r"unsupported data file extension '\.csv'.*convert it to one of"):
        iter_documents(str(p))
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(DataError, match="holds no"):
        iter_documents(str(d))
    j = tmp_path / "x.jsonl"
    j.write_text('{"body": "hello"}\n')
    with pytest.raises(DataError, match='no "text" field'):
        list(iter_documents(str(j)))
    q = tmp_path / "x.parquet"
    pq.write_table(pa.table({"body": ["hello"]}), q)
    with pytest.raises(DataError, match='no "text" column'):
        list(iter_documents(str(q)))


def test_hf_spec_parsing():
    assert parse_hf_spec("hf://HuggingFaceFW/fineweb-edu/sample-10BT") == ("HuggingFaceFW/fineweb-edu", "sample-10BT")
    assert parse_hf_spec("hf://Salesforce/wikitext") == ("Salesforce/wikitext", None)
    with pytest.raises(DataError, match="write hf://"):
        parse_hf_spec("hf://a/b/c/d")
    assert source_key("hf://a/b") != source_key("hf://a/b/c")


def test_error_hub_unreachable():
    with pytest.raises(DataError, match="unreachable.*pass a local"):
        iter_documents("hf://HuggingFaceFW/fineweb-edu/sample-10BT")


def test_stdlib_default_source_offline():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    spec, desc = default_source()
    assert spec == STDLIB_SPEC and "unreachable" in desc
    docs = []
    for d in iter_documents(spec):
        docs.append(d)
        if len(docs) >= 20:
            break
    assert len(docs) == 20 and all(isinstance(d, str) and d.strip() for d in docs)
    assert any("def " in d or "import " in d for d in docs)
    assert source_key(spec) == source_key(spec)


# -------------------------------------------------------------------------------------- packing
def test_eos_separates_documents(wiki_ds, wiki_tok, wikitext_path):
    docs = list(iter_documents(str(wikitext_path)))
    toks = wiki_ds.tokens
    eos_at = np.flatnonzero(np.asarray(toks) == wiki_tok.eos_id)
    assert len(eos_at) == len(docs)  # one EOS after every document, none inside
    first = wiki_tok.encode(docs[0])
    assert eos_at[0] == len(first) and list(toks[: len(first)]) == first
    second = wiki_tok.encode(docs[1])
    assert list(toks[eos_at[0] + 1: eos_at[1]]) == second
    assert toks.dtype == np.int32 and wiki_ds.n_tokens == len(toks)


def test_rows_shapes_and_counts(wiki_ds):
    n_rows = wiki_ds.n_tokens // (SEQ + 1)
    assert wiki_ds.n_train_rows + wiki_ds.n_val_rows == n_rows
    assert wiki_ds.n_val_rows == max(1, round(n_rows * 0.05))
    s = wiki_ds.sample(0, 0)
    assert s.dtype == torch.long and s.shape == (SEQ + 1,)
    b = wiki_ds.batch(3, 10, 4)
    assert b.shape == (4, SEQ + 1)
    assert torch.equal(b, torch.stack([wiki_ds.sample(3, 10 + k) for k in range(4)]))
    assert wiki_ds.val_rows.shape == (wiki_ds.n_val_rows, SEQ + 1)
    assert wiki_ds.val_batch(0, 3).shape == (3, SEQ + 1)


def test_deterministic_sampling(wikitext_path, wiki_tok, wiki_ds):
    # independently built (no cache, from the same text) -> identical samples
    other = TokenDataset(str(wikitext_path), wiki_tok, SEQ, 0.05, cache_dir=None)
    assert np.array_equal(np.asarray(other.tokens), np.asarray(wiki_ds.tokens))
    idx = [0, 1, 7, wiki_ds.n_train_rows - 1, wiki_ds.n_train_rows, 5 * wiki_ds.n_train_rows + 3]
    for i in idx:
        assert torch.equal(other.sample(42, i), wiki_ds.sample(42, i))
    # pinned addressing: PCG64 seeded by (seed, epoch)
    perm = np.random.Generator(np.random.PCG64([42, 0])).permutation(wiki_ds.n_train_rows)
    assert wiki_ds.train_row(42, 5) == perm[5]
    # different seeds differ; epochs reshuffle but each epoch covers every train row once
    a = wiki_ds.batch(1, 0, 8)
    assert not torch.equal(a, wiki_ds.batch(2, 0, 8))
    n = wiki_ds.n_train_rows
    ep0 = [wiki_ds.train_row(1, i) for i in range(n)]
    ep1 = [wiki_ds.train_row(1, n + i) for i in range(n)]
    assert sorted(ep0) == list(range(n)) == sorted(ep1) and ep0 != ep1
    with pytest.raises(ValueError):
        wiki_ds.sample(-1, 0)


def test_val_rows_disjoint_from_train(wiki_ds):
    n = wiki_ds.n_train_rows
    rows = np.asarray(wiki_ds.tokens)[: (n + wiki_ds.n_val_rows) * (SEQ + 1)].reshape(-1, SEQ + 1)
    used = {wiki_ds.train_row(s, i) for s in (0, 1) for i in range(2 * n)}
    assert used == set(range(n))  # training only ever addresses the first n rows
    assert np.array_equal(wiki_ds.val_rows.numpy(), rows[n:])
    train_set = {rows[r].tobytes() for r in range(n)}
    assert not any(rows[r].tobytes() in train_set for r in range(n, len(rows)))
    assert np.array_equal(wiki_ds.val_batch(2, 3).numpy(), rows[n + 2: n + 5])  # start row, like batch()
    vb = wiki_ds.val_batch(1, wiki_ds.n_val_rows + 2)  # wraps around the val slice
    val_set = {r.tobytes() for r in rows[n:]}
    assert all(r.astype(np.int32).tobytes() in val_set for r in vb.numpy())


def test_too_little_data_and_max_tokens(tmp_path, wiki_tok, wikitext_path):
    p = tmp_path / "tiny.txt"
    p.write_text("just a few words\n")
    with pytest.raises(DataError, match="fewer than 2 rows"):
        TokenDataset(str(p), wiki_tok, SEQ)
    capped = TokenDataset(str(wikitext_path), wiki_tok, 32, 0.1, max_tokens=1000, cache_dir=tmp_path)
    assert capped.n_tokens == 1000 and capped.n_train_rows + capped.n_val_rows == 1000 // 33
    again = TokenDataset(str(wikitext_path), wiki_tok, 32, 0.1, max_tokens=1000, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("tokens-*.npy"))) == 1 and torch.equal(again.sample(0, 3), capped.sample(0, 3))
    ft = TokenDataset.from_tokens(np.arange(100), 9, 0.2)
    assert ft.n_train_rows == 8 and ft.n_val_rows == 2 and ft.sample(0, 0).shape == (10,)


def test_build_dataset(wikitext_path, cache_dir, wiki_tok):
    cfg = DataConfig(seq_len=SEQ)
    tok, ds = build_dataset(cfg, str(wikitext_path), cache_dir)
    assert tok.fingerprint == wiki_tok.fingerprint and ds.seq_len == SEQ
    tok2, ds2 = build_dataset(DataConfig(vocab_size=300, seq_len=SEQ), str(wikitext_path), cache_dir)
    assert tok2.vocab_size == 300 and tok2.fingerprint != tok.fingerprint and ds2.n_tokens > ds.n_tokens
