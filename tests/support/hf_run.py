"""Files of a run that brings its own ``transformers`` model and ``datasets`` data, written under a
test's tmp folder: a jsonl corpus from the wikitext-2 validation text, a locally trained tokenizer
folder, a small Qwen2 config folder (untied, random weights optional) and the run config YAML."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import yaml

#: ../shared beside the repository (read in place, never copied)
WIKI = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2" / "wiki.valid.raw.txt"


def write_jsonl(folder: Path, max_docs: int = 400, mask: bool = False) -> Path:
    """``corpus.jsonl``: one wikitext paragraph per row in field ``text`` (and, with ``mask``, field
    ``spans`` marking the second half of each text as trained)."""
    paras = [p.strip() for p in WIKI.read_text(encoding="utf-8").split("\n") if len(p.strip()) > 40]
    out = folder / "corpus.jsonl"
    with open(out, "w", encoding="utf-8") as f:
        for p in paras[:max_docs]:
            row = {"text": p}
            if mask:
                row["spans"] = [[len(p) // 2, len(p)]]
            f.write(json.dumps(row) + "\n")
    return out


def write_tokenizer(folder: Path, vocab_size: int = 8192) -> tuple[Path, int]:
    """A byte-level BPE trained on the wikitext text, saved as a ``transformers`` tokenizer folder;
    returns (folder, number of ids)."""
    from transformers import PreTrainedTokenizerFast

    from iota_subnet.data import train_bpe
    docs = [p for p in WIKI.read_text(encoding="utf-8").split("\n") if p.strip()]
    fast = PreTrainedTokenizerFast(tokenizer_object=train_bpe(docs, vocab_size), eos_token="<|endoftext|>")
    d = folder / "tokenizer"
    fast.save_pretrained(str(d))
    return d, len(fast)


def qwen2_config(vocab: int, *, layers: int = 6, hidden: int = 128, tied: bool = False, **over) -> dict:
    """A small untied Qwen2 ``config.json`` dict (attention biases; ~2.5M parameters at vocab 8192)."""
    return {"model_type": "qwen2", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "tie_word_embeddings": tied, "rms_norm_eps": 1e-6,
            "pad_token_id": None, "eos_token_id": 0, "bos_token_id": 0, **over}


def write_model_folder(folder: Path, config: dict, weights: bool = False) -> Path:
    """``model/``: the config (``save_pretrained`` of ``AutoConfig``; with ``weights`` also random
    safetensors weights of ``AutoModelForCausalLM``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    d = folder / "model"
    c = AutoConfig.for_model(**config)
    if weights:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(c).save_pretrained(str(d))
    else:
        c.save_pretrained(str(d))
    return d


def write_run(folder: Path, *, stages: int = 3, seq_len: int = 32, vocab_size: int = 8192, layers: int = 6,
              model_over: Optional[dict] = None, data_over: Optional[dict] = None, extra: Optional[dict] = None,
              mask: bool = False) -> Path:
    """Every file of a small HF run and its ``run.yaml`` (model from a config folder, init scratch)."""
    corpus = write_jsonl(folder, mask=mask)
    tok, n = write_tokenizer(folder, vocab_size)
    model = write_model_folder(folder, qwen2_config(n, layers=layers, **(model_over or {})))
    cfg = {"model": {"hf": str(model), "init": "scratch"},
           "pipeline": {"stages": stages},
           "data": {"hf": {"path": str(corpus), "text_field": "text", **({"mask_field": "spans"} if mask else {}),
                           **(data_over or {})},
                    "tokenizer": str(tok), "seq_len": seq_len},
           "train": {"batch_size": 8, "micro_batch_size": 4, "lr": 3e-3, "warmup_steps": 2, "eval_batches": 2}}
    for k, v in (extra or {}).items():
        cfg[k] = {**cfg.get(k, {}), **v}
    p = folder / "run.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p
