#!/usr/bin/env python
"""Merge metadata at N replicas: per-replica dense tensor bytes and metadata bytes (sent and received
apart), wall seconds and peak RSS of one in-process all-reduce with signed claims
(:func:`iota_subnet.sim.merge_scale.run_scale`).

    OMP_NUM_THREADS=1 python scripts/bench_merge_scale.py --replicas 100 [--numel 262144] [--quant none] [--json]

With ``--kill K --kill-at scatter|reducer``: K replicas (at least 1) die after the join, and the run
is compared with the same one where nobody dies (:func:`iota_subnet.sim.merge_scale.death_cost`):
the survivors' extra dense and total bytes, attempts, contributor sets and the distance to a
single-process reference (docs/BENCHMARKS.md, "A member's death costs its shards only").
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from iota_subnet.sim.merge_scale import death_cost, run_scale  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", default="100", help="replica counts, comma-separated")
    ap.add_argument("--numel", type=int, default=1 << 18, help="values in the stage (float32)")
    ap.add_argument("--quant", default="none", choices=["none", "bf16", "int8"])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--kill", type=float, default=0, help="replicas that die after the join: a count, or a "
                    "fraction of N below 1 (at least one)")
    ap.add_argument("--kill-at", default="scatter", choices=["scatter", "reducer"])
    ap.add_argument("--progress-timeout", type=float, default=10.0, help="seconds a reducer waits for a dead "
                    "contributor (with --kill)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    for n in (int(x) for x in a.replicas.split(",")):
        if a.kill:
            k = max(1, round(a.kill * n) if a.kill < 1 else int(a.kill))
            r = death_cost(n, a.numel, quant=a.quant, kill=k, kill_at=a.kill_at, progress_timeout_s=a.progress_timeout)
            if a.json:
                print(json.dumps(r), flush=True)
                continue
            d = r["died"]
            print(f"N={n} stage {d['numel']:,} values, {k} killed ({a.kill_at}): merged {d['merged']} in "
                  f"{d['attempts']} attempts, identical {d['identical']}, contributor sets {d['contributor_sets']} "
                  f"over {d['shards']} shards, max |w - ref| {d.get('max_ref_err')}; survivors' extra dense bytes "
                  f"{100 * r['survivors_extra_dense']:+.2f} % (largest per replica {100 * r['extra_dense']:+.1f} %), "
                  f"total bytes {100 * r['survivors_extra_total']:+.2f} %; wall {r['base']['wall_s']:.1f} s without "
                  f"deaths, {d['wall_s']:.1f} s with; peak RSS {d['peak_rss_mib']:,} MiB", flush=True)
            continue
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
        print("  metadata per replica per peer, each direction, by message type: " + ", ".join(
            f"{t} {b:,.0f} B ({r['messages_per_peer_by_type'][t]:.2f} bodies)" for t, b in r["meta_per_peer_by_type"].items()),
            flush=True)


if __name__ == "__main__":
    main()
