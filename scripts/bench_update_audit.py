"""Update audits (issue 10, item 4): honest error, what cheats cost, bytes per audit, store bytes.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_update_audit.py --json

Prints one JSON object:

* ``honest_units``: worst deviation (row-scaled float32 units, :func:`iota_subnet.audit.update.row_units`)
  of torch's AdamW (``single``-tensor, ``foreach`` and ``fused`` CPU kernels) from the validator's
  reference over 30 steps of a 512 x 256 matrix and a 1-D parameter (gradients of two scales, a
  clipped step, the cosine schedule);
* ``noisy_update_units`` / ``no_weight_decay_units``: the same measure for the ``noisy-update``
  adversary and for a step that skips the weight decay; ``tol_units``: the tolerance;
* per ``tiny`` stage (3 stages): ``audit_bytes`` (request + answer bodies for ``--rows`` rows, as
  encoded on the wire, HTTP headers excluded), ``commit_bytes`` (one commitment as JSON, what
  receipts carry per inner step) and ``store_bytes`` (:attr:`UpdateStore.nbytes` after 3 steps with
  K = 2), ``validator_check_ms``;
* ``store_bytes_k2`` per shape (``tiny``, ``1b`` / 4 stages, ``8b`` / 8 stages; largest and middle
  stage): ``(3 (K + 1) + K) x 4 x P`` at K = 2.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time

import torch


def honest_units(steps: int = 30) -> dict:
    from iota_subnet.audit.update import adamw_reference, row_units
    out = {}
    for impl in ("single", "foreach", "fused"):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(512, 256) * 0.02), torch.nn.Parameter(torch.ones(256))]
        kw = {"foreach": False} if impl == "single" else {impl: True}
        opt = torch.optim.AdamW([{"params": [ps[0]], "weight_decay": 0.1}, {"params": [ps[1]], "weight_decay": 0.0}],
                                lr=3e-3, betas=(0.9, 0.95), eps=1e-8, **kw)
        worst = 0.0
        for k in range(steps):
            for p in ps:
                p.grad = torch.randn_like(p) * (1.0 if k == 5 else 0.01 if k % 2 else 1e-4)
            gn = float(torch.nn.utils.clip_grad_norm_(ps, 1.0))
            lr = 3e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi * k / steps)))
            for g in opt.param_groups:
                g["lr"] = lr
            before = [(p.detach().clone(), *(opt.state[p][key].clone() if p in opt.state else torch.zeros_like(p)
                                             for key in ("exp_avg", "exp_avg_sq")), p.grad.clone()) for p in ps]
            opt.step()
            for (w0, m0, v0, g), p, wd in zip(before, ps, (0.1, 0.0)):
                st = opt.state[p]
                w1, m1, v1 = adamw_reference(w0, m0, v0, g, lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd,
                                             step=int(st["step"]), clip=1.0)
                worst = max(worst, row_units(p.detach(), w1), row_units(st["exp_avg"], m1),
                            row_units(st["exp_avg_sq"], v1))
            assert gn >= 0
        out[impl] = worst
    return out


def cheat_units() -> dict:
    from iota_subnet.audit.update import adamw_reference, row_units
    torch.manual_seed(1)
    w0 = torch.randn(256) * 0.02
    m0, v0 = torch.randn(256) * 1e-3, torch.rand(256) * 1e-6
    g = torch.randn(256) * 1e-3
    kw = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, step=10, clip=1.0)
    w1, _, _ = adamw_reference(w0, m0, v0, g, weight_decay=0.1, **kw)
    no_wd, _, _ = adamw_reference(w0, m0, v0, g, weight_decay=0.0, **kw)
    noisy = w0 + torch.randn(256) * 3e-3
    return {"noisy_update_units": row_units(noisy, w1), "no_weight_decay_units": row_units(no_wd, w1)}


def tiny_audits(rows: int) -> list[dict]:
    from iota_subnet.config import load_config
    from iota_subnet.miner import StageWorker
    from iota_subnet.protocol import UpdateAuditResponse, decode, encode, update_audit_contract
    from iota_subnet.validator.update_audit import UpdateAuditor
    cfg = load_config("configs/tiny.yaml")
    out = []
    for stage in range(cfg.pipeline.stages):
        w = StageWorker(cfg, stage, seed=0, audit_window=2)
        g = torch.Generator().manual_seed(stage)
        for k in range(3 * w.micro_per_step):
            if w.spec.is_head:
                x = torch.randint(0, cfg.model.vocab_size, (1, 32), generator=g)
            else:
                x = torch.randn(1, 32, w.spec.in_width, generator=g)
            if w.spec.is_tail:
                w.forward(f"m{k}", x, torch.randint(0, cfg.model.vocab_size, (1, 32), generator=g))
            else:
                out_ = w.forward(f"m{k}", x)
                w.backward(f"m{k}", torch.randn(out_["activations"].shape, generator=g) * 1e-2)
        commit = w.updates.commitment(w.updates.steps()[-1], timeout_s=60)
        aud = UpdateAuditor(cfg, run_id="r", total_steps=cfg.train.total_steps, rows=rows, rng=random.Random(stage))
        sizes, ms = [], []
        for _ in range(5):
            req = aud.plan(stage, commit)
            resp = w.updates.open(req.inner_step, req.merges, req.rows, req.kinds)
            body = encode(resp)
            sizes.append(len(encode(req)) + len(body))
            t0 = time.perf_counter()
            chk = aud.check(stage, commit, req, decode(body, UpdateAuditResponse, update_audit_contract()))
            ms.append((time.perf_counter() - t0) * 1e3)
            assert chk.ok, chk.reason
        out.append({"stage": stage, "params": sum(p.numel() for p in w.module.parameters()),
                    "audit_bytes_mean": int(sum(sizes) / len(sizes)), "audit_bytes_max": max(sizes),
                    "commit_bytes": len(json.dumps(commit.to_dict())), "store_bytes": w.updates.nbytes,
                    "validator_check_ms": round(sorted(ms)[len(ms) // 2], 2)})
        w.updates.close()
    return out


def store_figures(K: int = 2) -> dict:
    from iota_subnet.config import load_config
    from iota_subnet.model import PipelineStage
    res = {}
    for name, stages in (("tiny", 3), ("1b", 4), ("8b", 8)):
        cfg = load_config(name, {"pipeline": {"stages": stages}})
        counts = []
        for s in range(stages):
            with torch.device("meta"):
                counts.append(sum(p.numel() for p in PipelineStage(cfg.model, cfg.pipeline, s, init=False).parameters()))
        per = (3 * (K + 1) + K) * 4
        res[name] = {"stages": stages, "largest_params": max(counts), "middle_params": counts[stages // 2],
                     "largest_store_gb": round(per * max(counts) / 1e9, 2),
                     "middle_store_gb": round(per * counts[stages // 2] / 1e9, 2)}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from iota_subnet.audit.update import UPDATE_TOL_UNITS
    res = {"honest_units": honest_units(), **cheat_units(), "tol_units": UPDATE_TOL_UNITS, "rows": a.rows,
           "tiny": tiny_audits(a.rows), "store_bytes_k2": store_figures(), "torch": torch.__version__}
    print(json.dumps(res) if a.json else json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
