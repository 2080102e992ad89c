#!/usr/bin/env python
"""Memory and pause benchmark of one stage worker: what a cached forward really holds, and how long
a checkpoint stops the compute thread.

For each stage: one training forward of a micro-batch (``train.micro_batch_size`` x ``data.seq_len``)
with and without ``train.activation_checkpointing``; ``cache_entry_bytes`` is what the activation
cache charges (measured: saved tensors on CPU, allocator growth on CUDA), ``io_bytes`` what the old
bound counted (input + output activations). Then ``snapshot_s`` (host copy under the worker lock:
the compute pause now) against ``save_s`` (snapshot + serialise + atomic write: the pause before).

    python scripts/bench_memory.py --config configs/tiny.yaml [--stages 1,2] [--device cuda] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from loguru import logger  # noqa: E402

from iota_subnet.config import load_config  # noqa: E402
from iota_subnet.miner import ActivationCache, StageWorker  # noqa: E402
from iota_subnet.network.cli import parse_sets  # noqa: E402


def measure(cfg, stage: int, device: str, ckpt: bool) -> dict:
    c = load_config_with(cfg, ckpt)
    w = StageWorker(c, stage, device=device)
    B, T = c.train.micro_batch, c.data.seq_len
    x = torch.randint(0, c.model.vocab_size, (B, T)) if w.spec.is_head else torch.randn(B, T, w.spec.in_width)
    w.forward("probe", x)
    e = w.cache.get("probe")
    row = {"stage": stage, "activation_checkpointing": ckpt, "micro_batch": [B, T],
           "cache_entry_bytes": e.nbytes, "io_bytes": ActivationCache.entry_bytes(e.inputs, e.outputs),
           "method": w.meter.cuda and "cuda_allocated" or "saved_tensors"}
    row["ratio"] = round(row["cache_entry_bytes"] / max(1, row["io_bytes"]), 1)
    w.cache.clear()
    if not ckpt:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            snap = w.snapshot()
            row["snapshot_s"] = round(time.perf_counter() - t0, 4)
            t0 = time.perf_counter()
            w.write_snapshot(snap, Path(d) / "a.safetensors")
            row["write_s"] = round(time.perf_counter() - t0, 4)
            t0 = time.perf_counter()
            w.save(Path(d) / "b.safetensors")
            row["save_s"] = round(time.perf_counter() - t0, 4)
            row["state_bytes"] = snap.nbytes
    w.cache.close()
    return row


def load_config_with(cfg, ckpt: bool):
    import dataclasses
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, activation_checkpointing=ckpt))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--stages", default=None, help="stage indices (default: all but the tail)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    logger.remove()
    torch.set_num_threads(1)
    cfg = load_config(a.config, parse_sets(a.set))
    stages = [int(s) for s in a.stages.split(",")] if a.stages else list(range(max(1, cfg.pipeline.stages - 1)))
    rows = [measure(cfg, s, a.device, ck) for s in stages for ck in (False, True)]
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        print(f"stage {r['stage']} ckpt={r['activation_checkpointing']!s:5} entry {r['cache_entry_bytes'] / 2**20:8.2f} MiB "
              f"(io {r['io_bytes'] / 2**10:7.1f} KiB, x{r['ratio']})"
              + (f"  snapshot {r['snapshot_s']:.3f}s write {r['write_s']:.3f}s save {r['save_s']:.3f}s"
                 if "snapshot_s" in r else ""))


if __name__ == "__main__":
    main()
