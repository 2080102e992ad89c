#!/usr/bin/env python
"""Honest error of the input gradient a tail hop sends, against the audit trace, per token row.

Loads the three stage checkpoints of a finished 3-stage localnet run (replica 0 of each stage,
``RUN/miners/miner-s{s}-r0/stage{s}.safetensors``; its ``config.yaml`` and ``tokenizer.json``), runs
``--micro-batches`` micro-batches of WikiText-2 through them as the data plane does (bf16 on the
wire), and compares, row by row, the gradient the tail sends (autograd in the run's precision,
rounded to the wire dtype) with the fp32 trace's (:class:`iota_subnet.audit.Tracer`): what exceeds
the wire rounding (half an ulp per value), in L2 norm, relative to (a) the row's own norm, (b) the
micro-batch's median row norm (what :meth:`iota_subnet.audit.check.LinkChecker.grad_scale`
estimates from 16 opened rows), (c) the norm of the stage's input-gradient row ``g.0``. Prints
quantiles and the worst rows (position in the sequence, norm over the median).

    python scripts/bench_grad_error.py --run runs/i11/merge-s0 --micro-batches 12 [--json]

Needs a run directory (``iota-subnet localnet --stages 3 ... --out RUN``); exits 2 without one.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from iota_subnet.audit import TraceLayout, Tracer  # noqa: E402
from iota_subnet.audit.check import half_ulp  # noqa: E402
from iota_subnet.config import load_config  # noqa: E402
from iota_subnet.miner import StageWorker  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "wiki.valid.raw.txt"
WIRE = torch.bfloat16
QUANTILES = (0.5, 0.9, 0.99, 0.999, 1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a finished 3-stage localnet's --out directory")
    ap.add_argument("--micro-batches", type=int, default=12)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    run = Path(args.run)
    ckpts = [run / "miners" / f"miner-s{s}-r0" / f"stage{s}.safetensors" for s in range(3)]
    missing = [str(p) for p in [run / "config.yaml", run / "tokenizer.json", *ckpts] if not p.exists()]
    if missing:
        print(f"error: {args.run} is not a finished 3-stage localnet run (missing {', '.join(missing)})", file=sys.stderr)
        return 2
    cfg = load_config(str(run / "config.yaml"))
    B, T = cfg.train.micro_batch, cfg.data.seq_len
    workers = []
    for s, p in enumerate(ckpts):
        w = StageWorker(cfg, s, seed=0)
        w.load(p)
        workers.append(w)
    ids = Tokenizer.from_file(str(run / "tokenizer.json")).encode(Path(args.data).read_text()[:4_000_000]).ids
    need = args.micro_batches * B * (T + 1)
    if len(ids) < need:
        print(f"error: {args.data} gives {len(ids)} tokens, {need} needed", file=sys.stderr)
        return 2
    lay = TraceLayout.build(cfg.model, cfg.pipeline, 2, batch=B, seq=T, direction="backward",
                            micro_per_step=cfg.train.batch_size // B)
    weights = {k: v.detach().clone() for k, v in workers[2].module.state_dict().items()}
    exc, own, med, g0 = [], [], [], []
    for i in range(args.micro_batches):
        rows = torch.tensor(ids[i * B * (T + 1):(i + 1) * B * (T + 1)]).view(B, T + 1)
        x, y = rows[:, :-1], rows[:, 1:]
        a0 = workers[0].forward(f"m{i}", x, train=False)["activations"].to(WIRE)
        a1 = workers[1].forward(f"m{i}", a0.float(), train=False)["activations"].to(WIRE)
        sent = workers[2].forward(f"m{i}", a1.float(), y, accumulate=False)["grad"].to(WIRE).double().reshape(B * T, -1)
        res = Tracer(lay, weights).run(a1, targets=y)
        ref = res.grad_in.double().reshape(B * T, -1)
        slack = half_ulp(torch.maximum(sent.abs(), ref.abs()), WIRE)
        e = ((sent - ref).abs() - slack).clamp_min(0).norm(dim=1)
        n = ref.norm(dim=1)
        exc.append(e)
        own.append(n)
        med.append(n.median().expand(len(n)))
        g0.append(res.records["g.0"].double().norm(dim=1))
    e, n, m, g = (torch.cat(t) for t in (exc, own, med, g0))

    def q(t: torch.Tensor) -> dict:
        return {str(p): float(torch.quantile(t.float(), p)) for p in QUANTILES}

    rel = e / n.clamp_min(1e-300)
    worst = rel.argsort(descending=True)[:8]
    out = {"run": str(run), "rows": int(len(e)), "micro_batches": args.micro_batches, "wire": "bf16",
           "precision": cfg.train.precision,
           "relative_to_row": q(rel), "relative_to_median_row": q(e / m), "relative_to_g0_row": q(e / g),
           "worst": [{"position": int(j) % T, "error_to_row": float(rel[j]), "row_over_median": float(n[j] / m[j])}
                     for j in worst]}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for k in ("relative_to_row", "relative_to_median_row", "relative_to_g0_row"):
            print(f"{k:24s} " + "  ".join(f"q{p}={v:.1e}" for p, v in out[k].items()))
        for w in out["worst"]:
            print(f"  position {w['position']:4d}: {w['error_to_row']:.2e} of its row; row = {w['row_over_median']:.4f} x median")
    return 0


if __name__ == "__main__":
    sys.exit(main())
