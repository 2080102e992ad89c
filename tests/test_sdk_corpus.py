"""``iota_subnet.sdk.corpus``: a tokenizer folder trained with a family's own text pipeline tokenizes, under
``AutoTokenizer`` on a folder of that family (as on an export), exactly as the run reads it; the generic
byte-level BPE does not, and the export check (``auto_tokenizer_matches``) tells the two apart."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, Qwen2Config

from iota_subnet.hf.export_family import auto_tokenizer_matches
from iota_subnet.sdk.corpus import paragraphs, write_jsonl, write_tokenizer_folder
from support.hf_run import WIKI

pytestmark = pytest.mark.skipif(not WIKI.exists(), reason=f"{WIKI} not present")


@pytest.mark.parametrize("model_type, same", [("qwen2", True), (None, False)])
def test_family_pipeline_tokenizer_matches_autotokenizer_on_a_qwen2_folder(tmp_path, model_type, same):
    docs = paragraphs(WIKI, max_docs=300)
    assert len(docs) == 300 and all(len(d) > 40 for d in docs)
    corpus = write_jsonl(docs, tmp_path / "corpus.jsonl")
    assert json.loads(corpus.read_text().splitlines()[0]) == {"text": docs[0]}
    folder, n = write_tokenizer_folder(docs, tmp_path / "tok", 1024, model_type=model_type)
    assert n <= 1024
    Qwen2Config(vocab_size=n, eos_token_id=0).save_pretrained(str(folder))      # a folder as the export writes it
    auto, run = AutoTokenizer.from_pretrained(str(folder)), Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert type(auto).__name__ == "Qwen2Tokenizer"
    differ = sum(auto(d, add_special_tokens=False)["input_ids"] != run.encode(d, add_special_tokens=False).ids
                 for d in docs)
    assert (differ == 0) == same, differ
    assert auto_tokenizer_matches(folder) is same
