"""Subcommands ``export``, ``generate`` and ``eval`` of ``iota-subnet``."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _cmd_export(a: argparse.Namespace) -> int:
    from .export import export_run
    info = export_run(a.run, a.out, lane=a.lane, merged=a.merged, tokenizer=a.tokenizer, data=a.data,
                      cache_dir=Path(a.cache_dir) if a.cache_dir else None, force=a.force)
    load = "AutoModelForCausalLM.from_pretrained({!r}{})".format(
        str(a.out), ", trust_remote_code=True" if info["trust_remote_code"] else "")
    print(f"exported {info['params']:,} parameters ({info['model_class']}) to {a.out}\nload it with: {load}")
    return 0


def _cmd_generate(a: argparse.Namespace) -> int:
    from .runtime import generate_text
    print(generate_text(a.model, a.prompt, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                        top_k=a.top_k, seed=a.seed, device=a.device))
    return 0


def _cmd_eval(a: argparse.Namespace) -> int:
    from .runtime import evaluate_file
    rows = None if a.rows in (None, "all") else int(a.rows)
    r = evaluate_file(a.model, a.data, rows=rows, all_rows=a.rows == "all", seq_len=a.seq_len,
                      batch_size=a.batch_size, device=a.device, cache_dir=Path(a.cache_dir) if a.cache_dir else None)
    if a.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"loss {r['loss']:.6f} nats/token  perplexity {r['perplexity']:.3f}  "
              f"({r['rows']} of {r['held_out_rows']} held-out rows x {r['seq_len']} tokens of {r['data']})")
    return 0


def _rows(text: str) -> str:
    if text != "all" and not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError("--rows takes a positive number or 'all'")
    return text


def register(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("export", help="assemble a run's stages into a Hugging Face model folder (with its tokenizer)")
    e.add_argument("--run", required=True, help="the --out folder of train-colocated or localnet")
    e.add_argument("--out", required=True, help="the model folder to write")
    e.add_argument("--lane", type=int, default=0, help="(localnet) which replica of every stage (default 0)")
    e.add_argument("--merged", action="store_true", help="(localnet) each stage's merged weights instead of a lane")
    e.add_argument("--data", default=None, help="the run's text source, to find its tokenizer when the run folder "
                                                "has no tokenizer.json")
    e.add_argument("--tokenizer", default=None, help="the run's tokenizer.json")
    e.add_argument("--cache-dir", default=None)
    e.add_argument("--force", action="store_true", help="replace a non-empty --out")
    e.set_defaults(func=_cmd_export)

    g = sub.add_parser("generate", help="sample text from an exported model folder")
    g.add_argument("--model", required=True, help="a folder written by `iota-subnet export`")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default=None)
    g.set_defaults(func=_cmd_generate)

    v = sub.add_parser("eval", help="loss and perplexity of an exported model on a text file's held-out rows")
    v.add_argument("--model", required=True, help="a folder written by `iota-subnet export`")
    v.add_argument("--data", required=True, help="text source (.txt/.jsonl/.parquet file or folder)")
    v.add_argument("--rows", type=_rows, default=None,
                   help="held-out rows to read (default: the rows the run's own final evaluation read; 'all')")
    v.add_argument("--seq-len", type=int, default=None, help="tokens per row (default: the run's)")
    v.add_argument("--batch-size", type=int, default=8)
    v.add_argument("--device", default=None)
    v.add_argument("--cache-dir", default=None)
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=_cmd_eval)
