#!/usr/bin/env python
"""Merge benchmark: bytes per replica per merge and merge wall time vs the number of replicas.

For each replica count N: N replicas of one stage of the ``small`` model (3 stages; stage 1 by
default) start from the same seeded init, each moves its weights as a few local inner steps would
(a different random perturbation), then all merge once through :class:`MergeEngine` over the
in-process transport. Every message goes through the wire codec, so the byte counts are the exact
message bodies HTTP would carry (HTTP headers excluded). ``replicas_identical``: every replica's
weights have the same sha256 after the merge.

    python scripts/bench_merge.py --replicas 2,4,8 [--config configs/small.yaml] [--quant none|bf16|int8] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from iota_subnet.config import MergeConfig, load_config  # noqa: E402
from iota_subnet.merge import MergeEngine, ModuleParams  # noqa: E402
from iota_subnet.merge.transport import InProcessTransport  # noqa: E402
from iota_subnet.model import PipelineStage  # noqa: E402
from iota_subnet.protocol import tensor_sha256  # noqa: E402


def bench(n: int, cfg, stage: int, quant: str) -> dict:
    mc = MergeConfig(every_steps=1, quantization=quant, join_timeout_s=30, phase_timeout_s=120)
    net = InProcessTransport()
    engines, mods = [], []
    for i in range(n):
        torch.manual_seed(cfg.train.seed + 1000 * stage)
        m = PipelineStage(cfg.model, cfg.pipeline, stage)
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)
        hk = f"5Replica{i:03d}"
        e = MergeEngine(hk, mc, ModuleParams(m), net.view(hk), run_id="bench", stage=stage)
        # anchor = the shared init (undo the perturbation for the anchor)
        torch.manual_seed(cfg.train.seed + 1000 * stage)
        e.anchor = ModuleParams(PipelineStage(cfg.model, cfg.pipeline, stage)).read()
        net.register(hk, e.handle)
        engines.append(e)
        mods.append(m)
    numel = engines[0].params.numel

    async def run():
        peers = [e.me for e in engines]
        return await asyncio.gather(*(e.merge(0, peers) for e in engines))
    t0 = time.perf_counter()
    reps = asyncio.run(run())
    wall = time.perf_counter() - t0
    shas = {tensor_sha256(ModuleParams(m).read()) for m in mods}
    # both sides of every exchange (as client and as server), exact encoded body sizes
    sent, recv = [net.sent.get(e.me, 0) for e in engines], [net.received.get(e.me, 0) for e in engines]
    return {"replicas": n, "params": numel, "quantization": quant,
            "bytes_sent_per_replica": round(sum(sent) / n), "bytes_received_per_replica": round(sum(recv) / n),
            "max_bytes_sent": max(sent), "max_bytes_received": max(recv),
            "fp32_params_bytes": numel * 4, "wall_s": round(wall, 3),
            "merged": all(r.applied for r in reps), "replicas_identical": len(shas) == 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", default="2,4,8")
    ap.add_argument("--config", default="configs/small.yaml")
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--quant", default="none", choices=["none", "bf16", "int8"])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(a.config)
    rows = [bench(int(n), cfg, a.stage, a.quant) for n in a.replicas.split(",")]
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{a.config} stage {a.stage}: {rows[0]['params']:,} parameters ({rows[0]['fp32_params_bytes'] / 1e6:.1f} MB fp32), "
          f"payload {a.quant}")
    print(f"{'replicas':>8} {'sent/replica MB':>16} {'recv/replica MB':>16} {'x params':>9} {'wall s':>8} identical")
    for r in rows:
        print(f"{r['replicas']:>8} {r['bytes_sent_per_replica'] / 1e6:>16.2f} {r['bytes_received_per_replica'] / 1e6:>16.2f} "
              f"{r['bytes_sent_per_replica'] / r['fp32_params_bytes']:>9.2f} {r['wall_s']:>8.2f} {r['replicas_identical']}")


if __name__ == "__main__":
    main()
