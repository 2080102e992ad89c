#!/usr/bin/env python
"""CPU cost of a miner's audit window per inner step (issue 10): a real stage trained on its own,
with the audit window off and on (update store: copies + Merkle trees of weights, moments and
gradient per inner step; hop store: a weights snapshot and its row + column trees per version).

Three runs: off, the hop store alone, both stores (the default). Measures process CPU seconds (all threads, the background hashing included) per inner step, and
the compute thread's seconds, for ``--steps`` inner steps of ``batch_size / micro_batch`` micro-batches
(forward + backward with a random incoming gradient) of stage ``--stage``.

Usage:
    OMP_NUM_THREADS=1 python scripts/bench_audit_window.py --json [--config configs/tiny.yaml] [--stage 1]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def run(cfg, stage: int, steps: int, window: int, updates: bool = True) -> dict:
    from iota_subnet.miner import StageWorker
    from iota_subnet.miner.hop_store import HopStore
    from iota_subnet.model import bottleneck_dims
    torch.manual_seed(0)
    w = StageWorker(cfg, stage, seed=0, audit_window=window if updates else 0)
    hops = HopStore(window) if window else None
    B, T = cfg.train.micro_batch, cfg.data.seq_len
    b = bottleneck_dims(cfg.model, cfg.pipeline)[0]
    mps = cfg.train.batch_size // B
    head, tail = stage == 0, stage == cfg.pipeline.stages - 1
    x = torch.randint(0, cfg.model.vocab_size, (B, T)) if head else torch.randn(B, T, b).to(torch.bfloat16)
    y = torch.randint(0, cfg.model.vocab_size, (B, T))
    g = torch.randn(B, T, b).to(torch.bfloat16) * 1e-3
    cpu0, wall_compute = time.process_time(), 0.0
    for k in range(steps):
        for i in range(mps):
            t0 = time.perf_counter()
            with w.lock:
                if hops is not None:
                    hops.observe(w)
                out = w.forward(f"{k}.{i}", x, y if tail else None)
            if not tail:
                w.backward(f"{k}.{i}", g)
            wall_compute += time.perf_counter() - t0
        t0 = time.perf_counter()
        w.step()
        wall_compute += time.perf_counter() - t0
    if w.updates is not None:                # wait for the background hashing: its CPU counts
        for s in w.updates.steps():
            w.updates.commitment(s, timeout_s=60)
    if hops is not None:
        for v in hops.versions():
            hops.commitment(v, timeout_s=60)
    cpu = time.process_time() - cpu0
    out = {"cpu_s_per_step": cpu / steps, "compute_thread_s_per_step": wall_compute / steps}
    if w.updates is not None:
        out["update_store_bytes"] = w.updates.nbytes
        w.updates.close()
    if hops is not None:
        out["hop_store_bytes"] = hops.nbytes
        out["snapshot_s_per_version"] = hops.snapshot_s / max(1, hops.snapshots)
        hops.close()
    return out


def main(argv=None) -> int:
    from iota_subnet.config import load_config
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(a.config)
    off = run(cfg, a.stage, a.steps, 0)
    hops = run(cfg, a.stage, a.steps, a.window, updates=False)
    on = run(cfg, a.stage, a.steps, a.window)
    res = {"config": a.config, "stage": a.stage, "steps": a.steps, "window": a.window, "off": off,
           "hop_store_only": hops, "on": on,
           "hop_store_cpu_overhead_ratio": hops["cpu_s_per_step"] / off["cpu_s_per_step"] - 1,
           "cpu_overhead_ratio": on["cpu_s_per_step"] / off["cpu_s_per_step"] - 1,
           "compute_thread_overhead_ratio": on["compute_thread_s_per_step"] / off["compute_thread_s_per_step"] - 1}
    print(json.dumps(res) if a.json else json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
