#!/usr/bin/env python
"""Merge metadata at N replicas: per-replica dense tensor bytes and metadata bytes (sent and received
apart), wall seconds and peak RSS of one in-process all-reduce with signed claims
(:func:`iota_subnet.sim.merge_scale.run_scale`).

    OMP_NUM_THREADS=1 python scripts/bench_merge_scale.py --replicas 100 [--numel 262144] [--quant none] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from iota_subnet.sim.merge_scale import run_scale  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", default="100", help="replica counts, comma-separated")
    ap.add_argument("--numel", type=int, default=1 << 18, help="values in the stage (float32)")
    ap.add_argument("--quant", default="none", choices=["none", "bf16", "int8"])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    for n in (int(x) for x in a.replicas.split(",")):
        r = run_scale(n, a.numel, quant=a.quant)
        if a.json:
            print(json.dumps(r), flush=True)
            continue
        print(f"N={n} stage {r['numel']:,} values ({r['stage_bytes']:,} B, payload {a.quant}): "
              f"dense sent {r['sent_dense'] / r['stage_bytes']:.3f}x (max {r['max_sent_dense'] / r['stage_bytes']:.3f}x), "
              f"received {r['received_dense'] / r['stage_bytes']:.3f}x (max {r['max_received_dense'] / r['stage_bytes']:.3f}x); "
              f"metadata sent {r['sent_meta'] / n:,.0f} B x N (max {r['max_sent_meta'] / n:,.0f}), "
              f"received {r['received_meta'] / n:,.0f} B x N (max {r['max_received_meta'] / n:,.0f}); "
              f"wall {r['wall_s']:.1f} s, peak RSS {r['peak_rss_mib']:,} MiB, merged {r['merged']}, "
              f"identical {r['identical']}", flush=True)


if __name__ == "__main__":
    main()
