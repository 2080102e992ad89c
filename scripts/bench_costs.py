"""Every cost of one lane step of the largest stage, as a fraction of its training compute (estimates).

For ``8b`` (A100, 100 Mbit/s) and ``100b`` (H200, 1 Gbit/s, MFU 0.47) by default, computed from the
code's own formulas: training FLOPs per token and host holders from :mod:`iota_subnet.plan` /
:mod:`iota_subnet.host_plan` (meta device, nothing allocated), merge bytes from the merge plan
itself (:class:`iota_subnet.merge.plan.MergePlan`: who sends which shard to whom). Paths:

* ``compute``: ``train FLOPs/token x tokens per lane step / (peak x MFU)`` seconds;
* ``hops``: the stage's uplink per lane step (activation out + activation gradient out per row,
  ``d / ratio`` values per token in the wire dtype) / uplink rate; overlapped with compute;
* ``merge``: uplink bytes of one merge for the replica that sends the most (its slice of every shard
  to both reducers in ``merge.quantization``, the means it serves as a shard's primary reducer in
  ``merge.gather_quantization``; at N = 2 both replicas reduce every shard and nothing is gathered)
  / rate, divided by ``merge.every_steps``; ``merge topk N=2`` / ``N=3``: the same with
  ``merge.quantization: topk`` at the config's ``topk_density`` / ``topk_bits`` / ``topk_chunk`` (the
  mean of N top-k contributions counted at its worst, N x k nonzeros per block,
  :func:`iota_subnet.merge.sparse.wire_bytes`);
* ``audits``: ``--audit-bytes-per-token`` (default 100 B, the measured ``tiny`` figure) x tokens
  / rate (the validator's link; a miner serves its share);
* ``update store``: ``16 P`` bytes device -> host per inner step at ``--pcie-gbps`` and the same to
  disk at ``--disk-gbps`` (both in the background of the next step);
* ``checkpoint``: ``24 P`` bytes (weights, moments, merge anchor and momentum) per
  ``train.checkpoint_every`` steps at ``--disk-gbps``;
* ``sync``: a joiner's ``8 P`` bytes (merged weights and outer momentum) / its downlink, once.

Usage: ``python scripts/bench_costs.py [--json]``; one row per config.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dataclasses  # noqa: E402

from iota_subnet.config import MergeConfig, load_config  # noqa: E402
from iota_subnet.hardware import GIB, GPUS  # noqa: E402
from iota_subnet.host_plan import DISK_WRITE_BYTES_PER_S, PCIE_D2H_BYTES_PER_S  # noqa: E402
from iota_subnet.merge.deadlines import bytes_per_value  # noqa: E402
from iota_subnet.merge import sparse  # noqa: E402
from iota_subnet.merge.plan import MergePlan  # noqa: E402
from iota_subnet.plan import meta_stage, plan_stage  # noqa: E402

ROWS = {  # name: (config, stages, accelerator, mfu, link bits/s, replicas)
    "8b": ("configs/8b.yaml", 8, "a100", 0.5, 100e6, 2),
    "100b": ("configs/100b.yaml", 16, "h200", 0.47, 1e9, 3),
}


def merge_bytes_sent(n: int, numel: int, quant: str, gather_quant: str, block: int = 256) -> float:
    """Payload bytes the busiest of ``n`` replicas sends in one merge of ``numel`` values: its slice of
    each shard to the shard's reducers (not itself), and each mean it serves as the primary of a
    gatherer (:meth:`MergePlan.primary_for`). ``quant`` / ``gather_quant``: wire modes
    (:attr:`MergeConfig.scatter_quant`, :attr:`MergeConfig.gather_quant`); a ``sparse-*`` mean of
    ``topk-*`` contributions counts ``n x k`` nonzeros per block."""
    parts = [f"replica{i:04d}" for i in range(n)]
    plan = MergePlan.make(0, 0, b"bench", parts, numel)
    sq, gq = bytes_per_value(quant, block), bytes_per_value(gather_quant, block)
    if sparse.is_sparse(gather_quant) and sparse.is_sparse(quant):
        gq = sparse.bytes_per_value(gather_quant, nnz_per_block=n * sparse.parse(quant)[1])
    sent = dict.fromkeys(parts, 0.0)
    for s, (_, size) in enumerate(plan.bounds):
        reducers = set(plan.reducers[s])
        for p in parts:
            sent[p] += sq * size * len(reducers - {p})
            if p not in reducers:
                sent[plan.primary_for(p, s)] += gq * size
    return max(sent.values())


def topk_merge_bytes(mc: MergeConfig, n: int, numel: int) -> float:
    """Bytes the busiest of ``n`` replicas sends in one ``topk`` merge of ``numel`` values with the
    density, bits and block of ``mc`` (its ``quantization`` set to ``topk``, gather ``same``)."""
    t = dataclasses.replace(mc, quantization="topk", gather_quantization="same").validate()
    return merge_bytes_sent(n, numel, t.scatter_quant, t.gather_quant, t.int8_block)


def costs(name: str, audit_b_per_token: float, pcie_gbps: float, disk_gbps: float) -> dict:
    path, stages, gpu, mfu, link_bps, n = ROWS[name]
    cfg = load_config(path)
    acc = GPUS[gpu]
    p = plan_stage(cfg, 0, acc.memory_bytes, module=meta_stage(cfg, 0))   # stage 0: the largest
    P = p.params
    tokens = cfg.train.batch_size * cfg.data.seq_len
    rate = link_bps / 8                                                     # bytes/s
    compute_s = p.train_flops_per_token * tokens / (acc.peak_flops * mfu)
    wire_values = cfg.model.dim // cfg.pipeline.compression_ratio
    hop_bytes = 2 * tokens * wire_values * 2                                 # bf16 activation + gradient out
    mc = cfg.merge
    merge_bytes = merge_bytes_sent(n, P, mc.quantization, mc.gather_quant, mc.int8_block)
    out = {"config": name, "accelerator": acc.name, "mfu": mfu, "link_mbit_s": link_bps / 1e6, "replicas": n,
           "stage_params": P, "tokens_per_lane_step": tokens, "compute_s": compute_s, "paths": {}}

    def path_row(label: str, nbytes: float, seconds: float, per_steps: int = 1, note: str = "") -> None:
        out["paths"][label] = {"bytes": nbytes, "seconds": seconds, "every_steps": per_steps,
                               "fraction_of_compute": seconds / per_steps / compute_s, "note": note}

    path_row("hops", hop_bytes, hop_bytes / rate, note="uplink, overlapped with compute")
    path_row("merge", merge_bytes, merge_bytes / rate, cfg.merge.every_steps,
             note=f"{mc.quantization} scatter + {mc.gather_quant} means, N={n}, busiest replica")
    path_row("merge at H=10", merge_bytes, merge_bytes / rate, 10, note="the bench row's H")
    for k in (2, 3):
        tb = topk_merge_bytes(mc, k, P)
        path_row(f"merge topk N={k}", tb, tb / rate, cfg.merge.every_steps,
                 note=f"topk k={mc.topk_k}/{mc.topk_chunk} {mc.topk_bits}-bit + sparse means, busiest replica")
    path_row("audits", audit_b_per_token * tokens, audit_b_per_token * tokens / rate,
             note=f"{audit_b_per_token:.0f} B/token on the validator's link")
    d2h = p.host["d2h_bytes_per_step"]
    path_row("update store D2H", d2h, d2h / (pcie_gbps * 1e9), note=f"PCIe {pcie_gbps:.0f} GB/s")
    path_row("update store to disk", d2h, d2h / (disk_gbps * 1e9), note=f"disk {disk_gbps:.1f} GB/s, background")
    ckpt = 24 * P
    path_row("checkpoint", ckpt, ckpt / (disk_gbps * 1e9), cfg.train.checkpoint_every,
             note=f"disk {disk_gbps:.1f} GB/s")
    sync = 8 * P
    path_row("joiner sync (once)", sync, sync / rate, note="lane steps of compute it spans: "
             f"{sync / rate / compute_s:.1f}")
    out["host_peak_bytes"] = p.host["peak_bytes"]
    out["gpu_total_gib"] = p.total_bytes / GIB
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="8b,100b")
    ap.add_argument("--audit-bytes-per-token", type=float, default=100.0)
    ap.add_argument("--pcie-gbps", type=float, default=PCIE_D2H_BYTES_PER_S / 1e9,
                    help="device -> host GB/s (PCIe 4 x16, pinned)")
    ap.add_argument("--disk-gbps", type=float, default=DISK_WRITE_BYTES_PER_S / 1e9,
                    help="sustained NVMe write GB/s")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = [costs(r.strip(), a.audit_bytes_per_token, a.pcie_gbps, a.disk_gbps) for r in a.rows.split(",") if r.strip()]
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        print(f"\n{r['config']}: stage 0 {r['stage_params'] / 1e9:.3f} B params, {r['accelerator']} MFU {r['mfu']}, "
              f"{r['link_mbit_s']:.0f} Mbit/s, N={r['replicas']}; compute {r['compute_s']:.1f} s per lane step "
              f"({r['tokens_per_lane_step']:,} tokens); host peak {r['host_peak_bytes'] / 1e9:.1f} GB")
        print(f"  {'path':24s} {'GB':>9s} {'s':>9s} {'every':>6s} {'x compute':>10s}  note")
        for k, v in r["paths"].items():
            print(f"  {k:24s} {v['bytes'] / 1e9:9.3f} {v['seconds']:9.1f} {v['every_steps']:6d} "
                  f"{v['fraction_of_compute']:10.4f}  {v['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
