"""A run's data through ``datasets`` (jsonl, parquet and text files holding the same documents pack to the
same rows and fingerprints), tokenized with a model's local tokenizer folder, checked against the model's
vocab_size, with an optional loss mask whose masked loss equals transformers' loss with labels=-100."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from iota_subnet.data import TokenDataset, fingerprints, train_bpe
from iota_subnet.data import hf_datasets
from iota_subnet.data.hf_datasets import (DatasetFieldError, DatasetSpec, HFTokenDataset, TokenizerMismatchError,
                                          build_hf_dataset, check_tokenizer, load_hf_tokenizer, tokenize_with_mask)
from iota_subnet.data.sources import DataError
from iota_subnet.errors import UserError
from iota_subnet.model.hf_family import build_hf_stages, load_stage_state, run_stages
from iota_subnet.model.lm_loss import masked_lm_loss

WIKI = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "wiki.valid.raw.txt"
SEQ = 32


@pytest.fixture(scope="module")
def lines() -> list[str]:
    if not WIKI.exists():
        pytest.skip(f"{WIKI} not present")
    with open(WIKI, encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(200)]


@pytest.fixture(scope="module")
def docs(lines) -> list[str]:
    return [ln for ln in lines if ln.strip()]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, docs) -> Path:
    d = tmp_path_factory.mktemp("tok")
    fast = PreTrainedTokenizerFast(tokenizer_object=train_bpe(docs, 1024), eos_token="<|endoftext|>")
    fast.save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_hf_tokenizer(tok_dir)


def _write(tmp: Path, lines: list[str], docs: list[str]) -> dict[str, Path]:
    txt, jsonl, parquet = tmp / "d.txt", tmp / "d.jsonl", tmp / "d.parquet"
    txt.write_text("\n".join(lines) + "\n", encoding="utf-8")
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    pq.write_table(pa.table({"text": docs}), str(parquet), row_group_size=37)
    return {"text": txt, "json": jsonl, "parquet": parquet}


def test_formats_give_identical_rows_and_fingerprints(tmp_path, lines, docs, tok, tok_dir):
    files = _write(tmp_path, lines, docs)
    sets = {fmt: HFTokenDataset(DatasetSpec(str(p)), tok, SEQ, 0.1) for fmt, p in files.items()}
    ref = sets["json"]
    assert ref.n_train_rows > 50 and ref.loss_mask is None
    fps = {fmt: fingerprints(tok, ds) for fmt, ds in sets.items()}
    assert len(set(fps.values())) == 1, fps
    for ds in sets.values():
        assert (ds.tokens == ref.tokens).all()
        assert torch.equal(ds.batch(7, 123, 8), ref.batch(7, 123, 8))
        assert torch.equal(ds.val_rows, ref.val_rows)
        assert ds.mask_batch(7, 123, 8).all()
    # the project's own jsonl reader packs the same documents to the same rows
    assert fingerprints(tok, TokenDataset(str(files["json"]), tok, SEQ, 0.1)) == fps["json"]
    # a folder of files, format named
    (tmp_path / "shards").mkdir()
    pq.write_table(pa.table({"text": docs[:40]}), str(tmp_path / "shards" / "a.parquet"))
    pq.write_table(pa.table({"text": docs[40:]}), str(tmp_path / "shards" / "b.parquet"))
    spec = DatasetSpec.from_mapping({"path": str(tmp_path / "shards"), "format": "parquet", "text_field": "text",
                                     "mask_field": None})
    assert fingerprints(tok, HFTokenDataset(spec, tok, SEQ, 0.1)) == fps["json"]


def test_hf_tokenizer_folder_encodes_like_transformers(tok, tok_dir, docs):
    hf = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    assert tok.eos_id == hf.eos_token_id and tok.vocab_size == len(hf)
    for d in docs[:20]:
        assert tok.encode(d) == hf(d, add_special_tokens=False)["input_ids"]
    with pytest.raises(DataError, match="does not exist"):
        load_hf_tokenizer(tok_dir / "nope")


def _qwen2(vocab: int, **kw):
    return AutoConfig.for_model("qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                max_position_embeddings=128, tie_word_embeddings=False, **kw)


def test_check_tokenizer(tok, tok_dir):
    n = tok.vocab_size
    padded = (n + 63) // 64 * 64
    assert check_tokenizer(tok, _qwen2(padded)) == n
    assert check_tokenizer(PreTrainedTokenizerFast.from_pretrained(str(tok_dir)), {"vocab_size": n}) == n
    with pytest.raises(TokenizerMismatchError, match=f"has {n} ids but the model's vocab_size is {n - 1}"):
        check_tokenizer(tok, _qwen2(n - 1))
    with pytest.raises(TokenizerMismatchError, match="not this model's tokenizer"):
        check_tokenizer(tok, {"vocab_size": 151936})
    assert issubclass(TokenizerMismatchError, UserError)


def test_bad_fields_are_refused(tmp_path, docs, tok):
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in docs[:10]))
    with pytest.raises(DatasetFieldError, match=r"no field 'text'.*\['content'\].*set text_field"):
        HFTokenDataset(DatasetSpec(str(tmp_path / "c.jsonl")), tok, SEQ)
    pq.write_table(pa.table({"body": docs[:10]}), str(tmp_path / "c.parquet"))
    with pytest.raises(DatasetFieldError, match=r"no field 'text'.*\['body'\]"):
        HFTokenDataset(DatasetSpec(str(tmp_path / "c.parquet")), tok, SEQ)
    with pytest.raises(DatasetFieldError, match=r"no field 'spans' \(the mask_field\)"):
        HFTokenDataset(DatasetSpec(str(tmp_path / "c.jsonl"), text_field="content", mask_field="spans"), tok, SEQ)
    (tmp_path / "t.txt").write_text("\n".join(docs[:10]))
    with pytest.raises(DatasetFieldError, match="single field"):
        HFTokenDataset(DatasetSpec(str(tmp_path / "t.txt"), mask_field="spans"), tok, SEQ)
    (tmp_path / "m.jsonl").write_text(json.dumps({"text": "abc", "spans": [[0, 9]]}) + "\n")
    with pytest.raises(DatasetFieldError, match=r"span \[0, 9\].*end <= 3"):
        HFTokenDataset(DatasetSpec(str(tmp_path / "m.jsonl"), mask_field="spans"), tok, SEQ)
    with pytest.raises(DataError, match="does not exist"):
        HFTokenDataset(DatasetSpec(str(tmp_path / "missing.jsonl")), tok, SEQ)
    with pytest.raises(DataError, match="unknown data spec keys"):
        DatasetSpec.from_mapping({"path": "x", "txt_field": "text"})
    assert issubclass(DatasetFieldError, UserError)


@pytest.fixture(scope="module")
def qa_spec(tmp_path_factory, docs) -> DatasetSpec:
    """Rows "Q: <doc i> A: <doc i+1>" trained on the answer only."""
    d = tmp_path_factory.mktemp("qa")
    with open(d / "qa.jsonl", "w", encoding="utf-8") as f:
        for q, a in zip(docs[0::2], docs[1::2]):
            text = f"Q: {q.strip()} A: {a.strip()}"
            f.write(json.dumps({"text": text, "spans": [[text.index(" A: ") + 4, len(text)]]}) + "\n")
    return DatasetSpec(str(d / "qa.jsonl"), mask_field="spans")


def test_mask_marks_the_answer(qa_spec, tok, docs):
    ds = HFTokenDataset(qa_spec, tok, SEQ, 0.1)
    plain = HFTokenDataset(DatasetSpec(qa_spec.path), tok, SEQ, 0.1)
    assert (ds.tokens == plain.tokens).all() and ds.loss_mask is not None
    assert 0 < ds.loss_mask.mean() < 1
    assert fingerprints(tok, ds).data != fingerprints(tok, plain).data      # same tokens, other trained spans
    # document by document: the marked tokens decode to the answer and the end-of-text token after it
    toks, mask = tokenize_with_mask([(f"Q: {docs[0].strip()} A: {docs[1].strip()}",
                                      [(len(f"Q: {docs[0].strip()} A: "), len(f"Q: {docs[0].strip()} A: ") +
                                        len(docs[1].strip()))])], tok)
    marked = tok.decode(toks[mask == 1])
    assert marked.strip() == docs[1].strip() + "<|endoftext|>"
    assert "Q:" not in tok.decode(toks[mask == 1])
    # mask rows travel with the token rows they belong to
    x, m = ds.batch(3, 40, 6), ds.mask_batch(3, 40, 6)
    for k in range(6):
        r = ds.train_row(3, 40 + k)
        row = slice(r * (SEQ + 1), (r + 1) * (SEQ + 1))
        assert torch.equal(x[k], torch.from_numpy(ds.tokens[row].astype("int64")))
        assert torch.equal(m[k], torch.from_numpy(ds.loss_mask[row].astype(bool)))
    assert ds.val_mask_batch(0, 2).shape == (2, SEQ + 1)


def test_target_batch_ignores_the_unmarked_targets(qa_spec, tok):
    """target_batch: the rows of the split with every target (``[:, 1:]``) the loss mask leaves unmarked set
    to -100 and every other token kept, in train (seed, index) order and in the wrapping validation slice;
    without a mask the rows themselves."""
    ds = HFTokenDataset(qa_spec, tok, SEQ, 0.1)
    plain = HFTokenDataset(DatasetSpec(qa_spec.path), tok, SEQ, 0.1)
    assert ds.has_loss_mask and not plain.has_loss_mask
    val_start = ds.n_val_rows - 2                                     # wraps past the end of the slice
    cases = [("train", 3, 40, 6, [ds.train_row(3, 40 + k) for k in range(6)]),
             ("val", 0, val_start, 5, [ds.n_train_rows + (val_start + k) % ds.n_val_rows for k in range(5)])]
    for split, seed, start, n, idx in cases:
        y = ds.target_batch(split, seed, start, n)
        assert y.dtype == torch.int64 and y.shape == (n, SEQ + 1)
        at = [slice(r * (SEQ + 1), (r + 1) * (SEQ + 1)) for r in idx]
        rows = torch.stack([torch.from_numpy(ds.tokens[a].astype("int64")) for a in at])
        mask = torch.stack([torch.from_numpy(ds.loss_mask[a].astype(bool)) for a in at])
        marked = mask[:, 1:]
        assert 0 < int(marked.sum()) < marked.numel(), split                  # both kinds of target are there
        assert torch.equal(y[:, 0], rows[:, 0])                               # the first token is no target
        assert torch.equal(y[:, 1:][marked], rows[:, 1:][marked])
        assert (y[:, 1:][~marked] == -100).all()
        assert torch.equal(ds.split_batch(split, seed, start, n), rows)       # the rows themselves are untouched
        assert torch.equal(plain.target_batch(split, seed, start, n), rows)   # same tokens, no mask: no -100
    with pytest.raises(ValueError, match="split"):
        ds.target_batch("test", 0, 0, 1)


def test_masked_loss_matches_transformers(qa_spec, tok):
    ds = HFTokenDataset(qa_spec, tok, SEQ, 0.1)
    cfg = _qwen2((tok.vocab_size + 63) // 64 * 64)
    check_tokenizer(tok, cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    stages = build_hf_stages(cfg, 2, seq_len=SEQ, attn_implementation="eager", init_seed=None)
    for s in stages:
        load_stage_state(s, model)
        s.eval()
    x, m = ds.batch(1, 0, 6), ds.mask_batch(1, 0, 6)
    assert 0 < m[:, 1:].sum() < m[:, 1:].numel()
    logits = run_stages(stages, x[:, :-1])
    logits.retain_grad()
    loss = masked_lm_loss(logits, x[:, 1:], m[:, 1:])
    ref = model(input_ids=x, labels=x.masked_fill(~m, -100)).loss
    assert abs(loss.item() - ref.item()) < 1e-6, (loss.item(), ref.item())
    loss.backward()
    ref.backward()
    g = logits.grad
    assert torch.count_nonzero(g[~m[:, 1:]]) == 0                               # unmarked targets: exactly zero
    assert g[m[:, 1:]].abs().sum() > 0
    emb = stages[0].embed_tokens.weight.grad
    assert torch.allclose(emb, model.model.embed_tokens.weight.grad, atol=1e-6, rtol=0)
    # no mask: every target, as labels=input_ids
    with torch.no_grad():
        full = masked_lm_loss(run_stages(stages, x[:, :-1]), x[:, 1:])
        assert abs(full.item() - model(input_ids=x, labels=x).loss.item()) < 1e-6
    # nothing marked: 0 and zero gradient (not nan)
    lg = logits.detach().requires_grad_(True)
    zero = masked_lm_loss(lg, x[:, 1:], torch.zeros_like(m[:, 1:]))
    zero.backward()
    assert zero.item() == 0.0 and torch.count_nonzero(lg.grad) == 0
    with pytest.raises(ValueError, match="float"):
        masked_lm_loss(lg, x[:, 1:], m[:, 1:].float())


def test_build_caches_packed_tokens(tmp_path, qa_spec, tok, tok_dir, monkeypatch):
    cfg = {"vocab_size": tok.vocab_size}
    spec = {"path": qa_spec.path, "format": "json", "text_field": "text", "mask_field": "spans", "streaming": False}
    t1, ds1 = build_hf_dataset(spec, tok_dir, cfg, SEQ, 0.1, cache_dir=tmp_path)
    assert t1.fingerprint == tok.fingerprint
    assert sorted(p.name.endswith("-mask.npy") for p in (tmp_path / "tokens").glob("hftokens-*.npy")) == [False, True]
    assert any((tmp_path / "datasets").iterdir())                              # not streamed: datasets' Arrow copy

    def no_read(*a, **k):
        raise AssertionError("read again despite the token cache")
    monkeypatch.setattr(hf_datasets, "open_dataset", no_read)
    _, ds2 = build_hf_dataset(spec, tok_dir, cfg, SEQ, 0.1, cache_dir=tmp_path)
    assert fingerprints(tok, ds2) == fingerprints(tok, ds1)
    assert torch.equal(ds2.mask_batch(5, 9, 4), ds1.mask_batch(5, 9, 4))
    with pytest.raises(TokenizerMismatchError):
        build_hf_dataset(spec, tok_dir, {"vocab_size": 64}, SEQ, cache_dir=tmp_path)
