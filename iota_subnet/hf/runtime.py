"""Use an exported model folder with ``transformers``: ``iota-subnet generate`` and ``iota-subnet eval``.

:func:`load` opens the folder with ``AutoModelForCausalLM`` (``trust_remote_code`` only for the
bottleneck model, whose code the folder carries) and the run's own tokenizer (:func:`run_tokenizer`:
``tokenizer.json`` as saved; ``AutoTokenizer`` only for a folder without one).

:func:`evaluate_file` packs a text file exactly as training did (the project's packer:
documents joined by the end-of-text token, rows of ``seq_len + 1`` tokens, the same held-out
slice), runs the model on the held-out rows and returns the mean next-token loss in nats/token
and its perplexity ``exp(loss)``. By default it reads the rows the run's own final evaluation read
(the first ``train.eval_batches x micro_batch_size`` held-out rows), so the two numbers compare.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch
from loguru import logger
from iota_subnet.errors import UserError


class ModelFolderError(UserError, RuntimeError):
    """The folder is not a loadable model export; the message says what is missing."""


def export_info(model_dir: str | Path) -> dict:
    """``iota_export.json`` of the folder ({} for a folder not written by ``iota-subnet export``)."""
    p = Path(model_dir) / "iota_export.json"
    return json.loads(p.read_text()) if p.exists() else {}


def load(model_dir: str | Path, device: Optional[str] = None):
    """(model in eval mode, tokenizer) from a Hugging Face folder. Raises ModelFolderError."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()       # stdout carries the command's output only
    d = Path(model_dir)
    if not (d / "config.json").exists():
        raise ModelFolderError(f"{d} has no config.json; pass the --out folder of `iota-subnet export`")
    conf = json.loads((d / "config.json").read_text())
    trust = conf.get("model_type") == "iota_resbm"
    model = AutoModelForCausalLM.from_pretrained(str(d), trust_remote_code=trust, dtype=torch.float32)
    tok = run_tokenizer(d)
    if tok is None:
        tok = AutoTokenizer.from_pretrained(str(d), trust_remote_code=trust)
    model.eval()
    if device:
        model.to(device)
    return model, tok


def run_tokenizer(model_dir: str | Path):
    """The tokenizer the run tokenized with: ``tokenizer.json`` of the folder as saved, in a
    ``PreTrainedTokenizerFast`` (end-of-text token from ``tokenizer_config.json``), or None when the folder
    has no ``tokenizer.json`` or no end-of-text token named as a string.

    Not ``AutoTokenizer``: for some families (``qwen2``, ``qwen3``) it takes the class from
    ``config.json`` and rebuilds the normalizer and pre-tokenizer from the vocabulary, which tokenizes
    text differently from the run when the run's tokenizer was trained with another pipeline
    (:mod:`iota_subnet.sdk.corpus`: 33 of 50 wikitext paragraphs, export loss 6.954 instead of 6.757)."""
    from transformers import PreTrainedTokenizerFast
    d = Path(model_dir)
    conf_file = d / "tokenizer_config.json"
    eos = json.loads(conf_file.read_text()).get("eos_token") if conf_file.exists() else None
    if not (d / "tokenizer.json").exists() or not isinstance(eos, str):
        return None
    return PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), eos_token=eos, pad_token=eos)


@torch.no_grad()
def generate_text(model_dir: str | Path, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.8,
                  top_k: int = 50, seed: int = 0, device: Optional[str] = None) -> str:
    """``prompt`` followed by up to ``max_new_tokens`` sampled tokens (``temperature`` 0: greedy)."""
    model, tok = load(model_dir, device)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(model.device)
    if ids.shape[1] == 0:
        ids = torch.tensor([[tok.eos_token_id]], device=model.device)
    limit = int(model.config.max_position_embeddings) - ids.shape[1]
    n = max(0, min(int(max_new_tokens), limit))
    torch.manual_seed(seed)
    kw = dict(do_sample=True, temperature=float(temperature), top_k=int(top_k)) if temperature > 0 else \
        dict(do_sample=False)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, use_cache=False,
                         pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, **kw)
    return tok.decode(out[0], skip_special_tokens=False)


@torch.no_grad()
def evaluate_file(model_dir: str | Path, data: str, *, rows: Optional[int] = None, all_rows: bool = False,
                  seq_len: Optional[int] = None, batch_size: int = 8, device: Optional[str] = None,
                  cache_dir: Optional[Path] = None) -> dict:
    """Mean held-out loss (nats/token) and perplexity of the model on ``data`` (a text source).

    ``rows``: how many held-out rows (default: the run's evaluation rows from ``iota_export.json``;
    ``all_rows``: every held-out row). ``seq_len``: tokens per row (default: the run's).
    Raises ModelFolderError / DataError."""
    from tokenizers import Tokenizer

    from iota_subnet.data import TextTokenizer, TokenDataset, default_cache_dir
    d = Path(model_dir)
    info = export_info(d)
    if not (d / "tokenizer.json").exists():
        raise ModelFolderError(f"{d} has no tokenizer.json; export it with `iota-subnet export`")
    T = int(seq_len or info.get("seq_len") or 0)
    if T < 1:
        raise ModelFolderError(f"{d}: no seq_len in iota_export.json; pass --seq-len")
    cache = (Path(cache_dir) if cache_dir else default_cache_dir()) / "tokens"
    hf_spec = ((info.get("run_config") or {}).get("data") or {}).get("hf")
    if hf_spec:        # a run that read a datasets dataset (data.hf): the same fields, masks and rows from ``data``
        from iota_subnet.data.hf_datasets import DatasetSpec, HFTokenDataset
        # the backend the run tokenized with (tokenizer.json as saved): AutoTokenizer on this folder may pick
        # the family's tokenizer class from config.json, which can rebuild the pre-tokenizer differently
        eos = json.loads((d / "tokenizer_config.json").read_text()).get("eos_token") \
            if (d / "tokenizer_config.json").exists() else None
        tt = TextTokenizer(Tokenizer.from_file(str(d / "tokenizer.json")), f"hf-{d.name}",
                           **({"eos_token": eos} if isinstance(eos, str) else {}))
        ds = HFTokenDataset(DatasetSpec.from_mapping({**hf_spec, "path": str(data)}), tt, T,
                            float(info.get("val_fraction", 0.05)), info.get("data_max_tokens"), token_cache_dir=cache)
    else:
        tt = TextTokenizer(Tokenizer.from_file(str(d / "tokenizer.json")), "export")
        ds = TokenDataset(str(data), tt, T, float(info.get("val_fraction", 0.05)), info.get("data_max_tokens"), cache)
    if all_rows:
        n = ds.n_val_rows
    else:
        n = int(rows or info.get("eval_rows") or ds.n_val_rows)
    n = max(1, min(n, ds.n_val_rows))
    model, _ = load(d, device)
    total, tokens = 0.0, 0
    for start in range(0, n, batch_size):
        k = min(batch_size, n - start)
        x = ds.val_batch(start, k).to(model.device)[:, :-1]
        y = ds.target_batch("val", 0, start, k).to(model.device)[:, 1:]   # with a loss mask: the marked targets only
        logits = model(input_ids=x).logits                               # [B, T, V]
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                 reduction="sum", ignore_index=-100)
        total += float(loss)
        tokens += int((y != -100).sum())
    mean = total / tokens
    logger.debug(f"evaluated {n} rows x {T} tokens of {data}")
    return {"loss": mean, "perplexity": math.exp(min(mean, 700.0)), "rows": n, "tokens": tokens, "seq_len": T,
            "held_out_rows": ds.n_val_rows, "data": str(data)}
