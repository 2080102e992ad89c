#!/usr/bin/env python
"""Outer-optimizer benchmark: R replicas merging every H inner steps, simulated in one process.

What a localnet with R replicas per stage does, without the network: lane r (replica r of every
stage) trains its own copy of the staged model on its own micro-batch stream (the validator's
addressing, :func:`iota_subnet.validator.lanes.sample_start`), with the miners' inner optimizer and
schedule; every H inner steps each stage's pseudo-gradients (anchor - weights) are averaged and the
outer step (:func:`iota_subnet.merge.outer_step`, the function the merge engine applies) moves the
anchor, which every lane adopts (inner AdamW state stays local, as on miners). The final validation
loss is lane 0's after the last merge, over the co-located trainer's held-out micro-batches.

Cheap enough to compare outer settings (lr, momentum) and H before spending a long localnet run on
the winner; it does not model stragglers, failed merges or reroutes.

``--quant`` other than ``none`` merges as the engine does with that ``merge.quantization`` (and
``--topk-density``, ``--topk-bits``, ``--error-feedback`` for ``topk``), with the engine's own
functions: each lane's pseudo-gradient (plus its error feedback, :class:`iota_subnet.merge.sparse.ErrorFeedback`)
is encoded and decoded per message chunk (:func:`iota_subnet.merge.outer.quantize` /
``dequantize``; chunks of ``merge.chunk_numel`` from the stage's start, where the engine starts
them at each shard), averaged (``weighted_mean``, equal weights), rounded to the gather's encoding
(``rounded``) and applied by ``outer_step``.

    python scripts/bench_outer.py --config configs/tiny.yaml --replicas 3 --steps 150 --every 5 \\
        --quant topk --seeds 0,1,2 --json

    python scripts/bench_outer.py --config configs/tiny.yaml --replicas 3 --steps 150 --every 10 \\
        --outer 1.0:0.0 --outer 0.7:0.9 --outer 1.0:0.5 --seeds 0 --json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from loguru import logger  # noqa: E402

from iota_subnet.config import MergeConfig, load_config  # noqa: E402
from iota_subnet.data import build_dataset  # noqa: E402
from iota_subnet.merge import ModuleParams, outer_step  # noqa: E402
from iota_subnet.merge.outer import dequantize, quantize, rounded, weighted_mean  # noqa: E402
from iota_subnet.merge.sparse import ErrorFeedback  # noqa: E402
from iota_subnet.model import StagedModel, build_stages  # noqa: E402
from iota_subnet.train.colocated import evaluate, split_rows  # noqa: E402
from iota_subnet.train.optim import lr_at, make_optimizer, set_lr  # noqa: E402
from iota_subnet.validator.lanes import sample_start  # noqa: E402


def compressed_mean(mc: MergeConfig, anchor: torch.Tensor, lanes: list[torch.Tensor],
                    feedback: list[ErrorFeedback]) -> torch.Tensor:
    """The mean pseudo-gradient the engine applies with ``mc``'s payload encodings (float32 [P]): each
    lane's ``anchor - weights`` plus its error feedback, encoded per chunk of ``mc.chunk_numel``, the
    decoded chunks averaged with equal weights and rounded to the gather's encoding; each lane's
    feedback keeps what it did not send (committed: every merge here is applied)."""
    quant, gq, block = mc.scatter_quant, mc.gather_quant, mc.int8_block
    P = anchor.numel()
    bounds = [(o, min(mc.chunk_numel, P - o)) for o in range(0, P, mc.chunk_numel)]
    sent = []
    for w, fb in zip(lanes, feedback):
        acc = fb.accumulate(anchor - w)
        parts = [(o, dequantize(*quantize(acc[o:o + n], quant, block), quant, block)) for o, n in bounds]
        fb.hold(acc, parts)
        fb.commit()
        sent.append(parts)
    out = torch.empty_like(anchor)
    for c, (o, n) in enumerate(bounds):
        out[o:o + n] = rounded(weighted_mean([(1.0, parts[c][1]) for parts in sent]), gq, block)[0]
    return out


def simulate(cfg, dataset, *, replicas: int, steps: int, every: int, lr: float, mu: float, nesterov: bool,
             seed: int, mc: MergeConfig = MergeConfig()) -> dict:
    cfg_seed = seed
    lanes = [StagedModel(build_stages(cfg, seed=cfg_seed)) for _ in range(replicas)]   # same init everywhere
    opts = [make_optimizer(m, cfg.train) for m in lanes]
    S = cfg.pipeline.stages
    params = [[ModuleParams(m.stages[s]) for s in range(S)] for m in lanes]
    anchors = [params[0][s].read() for s in range(S)]
    moms = [torch.zeros_like(a) for a in anchors]
    feedback = [[ErrorFeedback(mc.error_feedback if mc.quantization == "topk" else None) for _ in range(replicas)]
                for _ in range(S)]
    B, mb = cfg.train.batch_size, cfg.train.micro_batch
    n_micro = B // mb
    losses, merges = [], 0
    t0 = time.perf_counter()
    for k in range(steps):
        step_loss = []
        for r, (m, opt) in enumerate(zip(lanes, opts)):
            set_lr(opt, lr_at(k, steps, cfg.train))
            tot = 0.0
            for j in range(n_micro):
                rows = dataset.batch(seed, sample_start(r, k, j, replicas, B, mb), mb)
                x, y = split_rows(rows)
                loss = m(x, y)
                (loss / n_micro).backward()
                tot += float(loss.detach())
            for st in m.stages:
                torch.nn.utils.clip_grad_norm_(st.parameters(), cfg.train.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step_loss.append(tot / n_micro)
        losses.append(sum(step_loss) / replicas)
        if every and (k + 1) % every == 0 and replicas > 1:
            for s in range(S):
                if mc.quantization == "none" and mc.gather_quant == "none":
                    mean = sum(anchors[s] - params[r][s].read() for r in range(replicas)) / replicas
                else:
                    mean = compressed_mean(mc, anchors[s], [params[r][s].read() for r in range(replicas)], feedback[s])
                anchors[s], moms[s] = outer_step(anchors[s], moms[s], mean, lr=lr, mu=mu, nesterov=nesterov)
                for r in range(replicas):
                    params[r][s].write(anchors[s])
            merges += 1
    val = evaluate(lanes[0], dataset, cfg, torch.device("cpu"))
    return {"replicas": replicas, "steps": steps, "every": every, "outer_lr": lr, "outer_momentum": mu,
            "nesterov": nesterov, "seed": seed, "merges": merges, "quant": mc.scatter_quant, "gather": mc.gather_quant,
            "error_feedback": mc.error_feedback if mc.quantization == "topk" else None, "val_loss": round(val, 4),
            "train_loss_last10": round(sum(losses[-10:]) / len(losses[-10:]), 4),
            "tokens": steps * replicas * B * cfg.data.seq_len, "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext-2/wiki.valid.raw.txt"))
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", default="10", help="H values, comma separated (0: never merge)")
    ap.add_argument("--outer", action="append", default=[], metavar="LR:MOMENTUM",
                    help="outer settings to try (repeatable; Nesterov when momentum > 0), default 1.0:0.0")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--quant", default="none", help="merge.quantization: none, bf16, int8 or topk")
    ap.add_argument("--topk-density", type=float, default=MergeConfig.topk_density)
    ap.add_argument("--topk-bits", type=int, default=MergeConfig.topk_bits)
    ap.add_argument("--error-feedback", type=float, default=MergeConfig.error_feedback)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    cfg = load_config(a.config)
    mc = MergeConfig(quantization=a.quant, topk_density=a.topk_density, topk_bits=a.topk_bits,
                     error_feedback=a.error_feedback).validate()
    _, dataset = build_dataset(cfg.data, a.data, None)
    rows = []
    for seed in (int(s) for s in a.seeds.split(",")):
        for every in (int(h) for h in a.every.split(",")):
            for spec in a.outer or ["1.0:0.0"]:
                lr, mu = (float(v) for v in spec.split(":"))
                row = simulate(cfg, dataset, replicas=a.replicas, steps=a.steps, every=every, lr=lr, mu=mu,
                               nesterov=mu > 0, seed=seed, mc=mc)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"H={r['every']:>3} lr={r['outer_lr']:.2f} mu={r['outer_momentum']:.2f} seed={r['seed']} "
                  f"val {r['val_loss']:.4f} train {r['train_loss_last10']:.4f} ({r['wall_s']:.0f}s)")


if __name__ == "__main__":
    main()
