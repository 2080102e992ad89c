"""Train a ~10M-parameter Qwen2 on a 3 x 2 local network, export it and check the export.

    python examples/train_qwen2.py --out runs/qwen2-example [--text FILE] [--steps 150]

What it does (everything local, no hub):

1. ``OUT/corpus.jsonl``: the paragraphs of ``--text`` (default: wikitext-2's validation text next to the
   repository, ``../shared/data/wikitext-2/wiki.valid.raw.txt``), one ``{"text": ...}`` per line, read by
   ``datasets``;
2. ``OUT/tokenizer/``: an 8,192-token byte-level BPE trained on that text with Qwen2's own normalizer and
   pre-tokenizer (:func:`iota_subnet.sdk.corpus.write_tokenizer_folder`), so that ``AutoTokenizer`` on the
   exported folder tokenizes as the run did;
3. a scratch, untied ``Qwen2Config`` (hidden 256, 8 layers, MLP 768: about 10.5M parameters) trained by
   3 stages x 2 replicas (six miner processes, one validator, a devnet chain) for ``--steps`` inner
   steps, replicas merged every 10 steps (the hidden state crosses stages uncompressed: ratio 1);
4. ``OUT/model/``: the merged weights exported (``iota-subnet export --merged``), loaded with
   ``AutoModelForCausalLM.from_pretrained`` (no ``trust_remote_code``) and evaluated as
   ``iota-subnet eval`` does on the rows the network's final evaluation read.

It prints one JSON object (also ``OUT/example.json``): the first and last lane-step losses, the network's
final evaluation, the export's, their difference and the wall time; exit code 1 when the export's loss is
not within 1e-3 of the network's or the loss did not fall by 30 %.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from iota_subnet.errors import known_errors
from iota_subnet.sdk import DataSpec, RunSpec, launch_local
from iota_subnet.sdk.corpus import paragraphs, write_jsonl, write_tokenizer_folder

DEFAULT_TEXT = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "wikitext-2" / "wiki.valid.raw.txt"


def qwen2_config(vocab: int) -> Qwen2Config:
    """About 10.5M parameters at 8,192 ids: embeddings and head 2 x 2.1M, 8 layers of 0.79M."""
    return Qwen2Config(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=False, rms_norm_eps=1e-6, pad_token_id=None, eos_token_id=0,
                       bos_token_id=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the corpus, tokenizer, network and exported model")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="UTF-8 text, one paragraph a line")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--timeout-s", type=float, default=3600.0)
    a = p.parse_args(argv)
    if not Path(a.text).is_file():
        p.error(f"--text {a.text}: no such file (the default is wikitext-2's validation text next to the "
                "repository; give any UTF-8 text, one paragraph a line)")
    if a.steps < 1:
        p.error(f"--steps must be at least 1, not {a.steps}")
    out = Path(a.out).resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {a.out}: cannot create that folder ({e.strerror})")
    t0 = time.monotonic()

    docs = paragraphs(a.text)
    corpus = write_jsonl(docs, out / "corpus.jsonl")
    tok, n_ids = write_tokenizer_folder(docs, out / "tokenizer", a.vocab, model_type="qwen2")
    spec = RunSpec(model=qwen2_config(n_ids), data=DataSpec(corpus, text_field="text", tokenizer=tok), stages=3,
                   seq_len=32, batch_size=8, micro_batch_size=4, lr=3e-3, warmup_steps=10, eval_batches=4,
                   merge_every=10, steps=a.steps)
    run = launch_local(spec, replicas=2, validators=1, out=out / "ln", block_time=0.5, tempo=10,
                       timeout_s=a.timeout_s)
    for snap in run.watch(interval_s=15.0):
        print(f"[{snap.elapsed_s:6.0f} s] step {snap.steps_done}/{snap.steps_total} loss "
              f"{'-' if snap.loss is None else f'{snap.loss:.3f}'} miners {snap.miners_live}/{snap.miners_total}",
              file=sys.stderr, flush=True)
    summary = run.wait()
    model_dir = run.export(out / "model", merged=True, force=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))        # no trust_remote_code
    ev = run.evaluate(model_dir)                                        # as `iota-subnet eval`

    steps = [json.loads(line) for line in (out / "ln" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first, last = steps[0]["loss"], steps[-1]["loss"]
    auto = AutoTokenizer.from_pretrained(str(model_dir))
    same_tokens = all(auto(d, add_special_tokens=False)["input_ids"] ==
                      run_tokens for d, run_tokens in zip(docs[:200], _run_ids(model_dir, docs[:200])))
    res = {"command": " ".join([sys.executable, *sys.argv]), "ended": summary["ended"], "steps": summary["steps_done"],
           "params": sum(t.numel() for t in model.parameters()), "model_class": type(model).__name__,
           "first_step_loss": first, "last_step_loss": last, "final_loss": summary["final_loss"],
           "network_val_loss": summary["val_loss"], "export_eval_loss": ev["loss"], "eval_rows": ev["rows"],
           "abs_diff": abs(ev["loss"] - summary["val_loss"]), "loss_drop": 1 - last / first,
           "auto_tokenizer_matches_run": same_tokens, "wall_s": round(time.monotonic() - t0, 1)}
    (out / "example.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    ok = summary["ended"] == "done" and res["abs_diff"] < 1e-3 and res["loss_drop"] >= 0.30
    return 0 if ok else 1


@torch.no_grad()
def _run_ids(model_dir: Path, docs: list[str]) -> list[list[int]]:
    """Ids of ``docs`` under the run's own tokenizer (the exported ``tokenizer.json``, as the run read it)."""
    from tokenizers import Tokenizer
    t = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [e.ids for e in t.encode_batch(docs, add_special_tokens=False)]


def _cli() -> int:
    """:func:`main`, with what the user must fix (a vocabulary too small, a bad config value) printed as
    one line and exit code 2, as the ``iota-subnet`` commands do."""
    try:
        return main()
    except known_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_cli())
