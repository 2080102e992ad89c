#!/usr/bin/env python
"""Merge benchmark: bytes per replica per merge, the largest message, merge wall time and memory vs
the number of replicas.

For each replica count N: N replicas of one stage (3-stage ``small`` by default, stage 1) start from
the same seeded init, each moves its weights as a few local inner steps would (a different random
perturbation), then all merge once through :class:`MergeEngine` over the in-process transport. Every
message goes through the wire codec, so the byte counts are the exact message bodies HTTP would
carry (HTTP headers excluded). ``replicas_identical``: every replica's weights have the same sha256
after the merge. ``max_message_bytes``: the largest body any message had (a shard travels as chunks
of ``merge.chunk_numel`` values). ``peak_rss_mib``: the process's peak resident memory so far.

    python scripts/bench_merge.py --replicas 2,4,8 [--config configs/small.yaml] [--quant none|bf16|int8] [--json]
    # a stage over 256 MiB (77.6M parameters, 296 MiB fp32), chunked merge:
    python scripts/bench_merge.py --replicas 2 --set model.name=100m --set model.n_layers=4 \\
        --set pipeline.stages=1 --set data.vocab_size=32000 --stage 0 --json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from iota_subnet.config import MergeConfig, load_config  # noqa: E402
from iota_subnet.merge import MergeEngine, ModuleParams  # noqa: E402
from iota_subnet.merge.transport import InProcessTransport  # noqa: E402
from iota_subnet.model import PipelineStage  # noqa: E402
from iota_subnet.network.cli import parse_sets  # noqa: E402
from iota_subnet.protocol import tensor_sha256  # noqa: E402


def bench(n: int, cfg, stage: int, quant: str, chunk_numel: int) -> dict:
    mc = MergeConfig(every_steps=1, quantization=quant, join_timeout_s=60, phase_timeout_s=600, chunk_numel=chunk_numel)
    net = InProcessTransport()
    engines, mods = [], []
    torch.manual_seed(cfg.train.seed + 1000 * stage)
    init = PipelineStage(cfg.model, cfg.pipeline, stage)
    anchor = ModuleParams(init).read()          # the shared init
    for i in range(n):
        m = PipelineStage(cfg.model, cfg.pipeline, stage, init=False)
        m.load_state_dict(init.state_dict())
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)
        hk = f"5Replica{i:03d}"
        e = MergeEngine(hk, mc, ModuleParams(m), net.view(hk), run_id="bench", stage=stage)
        e.anchor = anchor.clone()
        net.register(hk, e.handle)
        engines.append(e)
        mods.append(m)
    del init
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
    return {"replicas": n, "params": numel, "quantization": quant, "chunk_numel": chunk_numel,
            "bytes_sent_per_replica": round(sum(sent) / n), "bytes_received_per_replica": round(sum(recv) / n),
            "max_bytes_sent": max(sent), "max_bytes_received": max(recv),
            "fp32_params_bytes": numel * 4, "sent_x_fp32": round(sum(sent) / n / (numel * 4), 4),
            "max_message_bytes": net.max_body, "wall_s": round(wall, 3),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "merged": all(r.applied for r in reps), "replicas_identical": len(shas) == 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", default="2,4,8")
    ap.add_argument("--config", default="configs/small.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value (repeatable), e.g. --set model.n_layers=4")
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--quant", default="none", choices=["none", "bf16", "int8"])
    ap.add_argument("--chunk-numel", type=int, default=MergeConfig().chunk_numel,
                    help="values per merge message (merge.chunk_numel)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(a.config, parse_sets(a.set))
    rows = [bench(int(n), cfg, a.stage, a.quant, a.chunk_numel) for n in a.replicas.split(",")]
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{a.config} stage {a.stage}: {rows[0]['params']:,} parameters ({rows[0]['fp32_params_bytes'] / 2**20:.1f} MiB fp32), "
          f"payload {a.quant}, chunks of {a.chunk_numel:,} values")
    print(f"{'replicas':>8} {'sent/replica MB':>16} {'recv/replica MB':>16} {'x fp32':>7} {'max msg MB':>11} "
          f"{'wall s':>8} {'peak RSS MiB':>13} identical")
    for r in rows:
        print(f"{r['replicas']:>8} {r['bytes_sent_per_replica'] / 1e6:>16.2f} {r['bytes_received_per_replica'] / 1e6:>16.2f} "
              f"{r['sent_x_fp32']:>7.2f} {r['max_message_bytes'] / 1e6:>11.2f} {r['wall_s']:>8.2f} {r['peak_rss_mib']:>13} "
              f"{r['replicas_identical']}")


if __name__ == "__main__":
    main()
