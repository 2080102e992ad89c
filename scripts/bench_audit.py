#!/usr/bin/env python
"""Hop-audit benchmark: bytes per audit, validator CPU seconds, miner recomputation seconds.

``tiny`` (measured): a real 3-stage pipeline of StageWorkers (``--config``, default configs/tiny.yaml)
runs one micro-batch of WikiText-2 bytes (bf16 on the wire); every case (stage, direction) is then
audited ``--audits`` times through :func:`iota_subnet.audit.run_local_audit`: every message encoded
and decoded against its contract, so ``bytes`` are the bodies HTTP would carry, plus
``--header-bytes`` (default 1,024) of HTTP headers per message (6 messages per audit). CPU seconds
are ``time.process_time`` of each side (this process; the machine may be shared).

``8b`` (computed, ``--no-8b`` to skip): the same audit of an 8b-shaped stage (8 stages, compression
ratio 64, one 2,048-token row per micro-batch): message bytes exact (the messages are built with
zero tensors of the real shapes and encoded); miner FLOPs and hashed bytes from the layout, turned
into seconds with ``--gpu-fp32-tflops`` (A100 fp32, TF32 off: 19.5 peak x 0.6 by default) and the
sha256 rate measured here; validator CPU scaled from tiny by opened bytes. Weights root cost: bytes
hashed per version (rows and columns) at the measured rate, 1 and ``--hash-threads`` threads.

    python scripts/bench_audit.py [--config configs/tiny.yaml] [--audits 3] [--tokens 2] [--json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from iota_subnet.audit import (HopAuditor, HopInputs, HopProver, SamplingParams, Tolerances, TraceLayout,  # noqa: E402
                               run_local_audit, weights_commitment, wire_root)
from iota_subnet.audit.cost import audit_bytes, committed_bytes, trace_flops, weights_hash_bytes  # noqa: E402
from iota_subnet.config import MODEL_CONFIGS, PipelineConfig, load_config  # noqa: E402
from iota_subnet.miner import StageWorker  # noqa: E402

WIRE = torch.bfloat16
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "wiki.valid.raw.txt"
CASES = [(0, "forward"), (1, "forward"), (1, "backward"), (2, "backward")]


def text_rows(n: int, seq: int) -> torch.Tensor:
    if DATA.exists():
        raw = DATA.read_bytes()[10_000:10_000 + n * (seq + 1)]
        return torch.tensor(list(raw), dtype=torch.int64).view(n, seq + 1)
    return torch.randint(0, 256, (n, seq + 1), generator=torch.Generator().manual_seed(0))


def hop_records(cfg) -> list[dict]:
    """One micro-batch through three StageWorkers, bf16 on the wire: what each miner keeps."""
    B, T = cfg.train.micro_batch, cfg.data.seq_len
    w = [StageWorker(cfg, s, seed=0) for s in range(3)]
    weights = [{k: v.detach().clone() for k, v in x.module.state_dict().items()} for x in w]
    rows = text_rows(B, T)
    x, y = rows[:, :-1], rows[:, 1:]
    a0 = w[0].forward("m", x)["activations"].to(WIRE)
    a1 = w[1].forward("m", a0)["activations"].to(WIRE)
    out = w[2].forward("m", a1, y)
    g2 = out["grad"].to(WIRE)
    g1 = w[1].backward("m", g2).to(WIRE)
    return [dict(inputs=HopInputs(x, wire={"wire.z": a0}), weights=weights[0], tokens=x),
            dict(inputs=HopInputs(a0, grad=g2, wire={"wire.x": a0, "wire.z": a1, "wire.dz": g2, "wire.dx": g1}),
                 weights=weights[1]),
            dict(inputs=HopInputs(a1, targets=y, wire={"wire.x": a1, "wire.dx": g2}), weights=weights[2],
                 targets=y, loss=out["loss"])]


def bench_tiny(cfg, args, sampling: SamplingParams) -> list[dict]:
    hops = hop_records(cfg)
    B, T = cfg.train.micro_batch, cfg.data.seq_len
    mps = cfg.train.batch_size // B
    rows = []
    for stage, direction in CASES:
        h = hops[stage]
        lay = TraceLayout.build(cfg.model, cfg.pipeline, stage, batch=B, seq=T, direction=direction, micro_per_step=mps)
        t0 = time.process_time()
        wc = weights_commitment(h["weights"])
        wroot_s = time.process_time() - t0
        roots = {k: wire_root(v) for k, v in h["inputs"].wire.items()
                 if k in lay.wire and (direction == "backward" or k in ("wire.x", "wire.z"))}
        runs = []
        for i in range(args.audits):
            aud = HopAuditor(lay, weights_root=wc.root, wire_roots=roots, tol=Tolerances.for_precision("fp32"),
                             sampling=sampling, rng=random.Random(1000 + i),
                             tokens=h.get("tokens"), targets=h.get("targets"), loss=h.get("loss"))
            runs.append(run_local_audit(HopProver(lay, wc, h["inputs"]), aud, stage=stage))
        est = audit_bytes(lay, sampling)
        errs: dict[str, float] = {}
        for r in runs:
            for k, e in r.verdict.errors.items():
                errs[k] = max(errs.get(k, 0.0), e)
        inner = {k: e for k, e in errs.items() if k not in ("output", "grad_in", "loss")}
        med = lambda k: statistics.median(r.seconds.get(k, 0.0) for r in runs)  # noqa: E731
        rows.append({
            "mode": "measured", "config": cfg.model.name, "stage": stage, "direction": direction,
            "audits": len(runs), "all_passed": all(r.verdict.ok for r in runs),
            "checks": runs[0].verdict.checks,
            "bytes_per_audit": int(statistics.median(r.total_bytes(args.header_bytes) for r in runs)),
            "bytes_by_message": runs[0].bytes,
            "bytes_per_audit_computed": est.total(args.header_bytes),
            "bytes_per_audit_flat_sha256_receipts": audit_bytes(lay, sampling, wire_commit="sha256").total(args.header_bytes),
            "opened_row_bytes": est.rows, "proof_bytes": est.proofs,
            "validator_cpu_s": round(med("validator"), 3),
            "miner_trace_s": round(med("miner_trace"), 3),
            "miner_project_s": round(med("miner_project"), 3),
            "miner_open_s": round(med("miner_open"), 3),
            "miner_trace_mb": round(committed_bytes(lay) / 1e6, 1),
            "weights_root_s": round(wroot_s, 3), "weights_root_hashed_mb": round(weights_hash_bytes(lay) / 1e6, 1),
            "trace_gflop": round(trace_flops(lay) / 1e9, 2),
            "max_link_err": max(inner.values()) if inner else 0.0,
            "max_output_err": max((errs.get(k, 0.0) for k in ("output", "grad_in")), default=0.0),
        })
    return rows


def hash_rate() -> float:
    """sha256 bytes per second on one core, measured on 64 MiB."""
    buf = os.urandom(64 << 20)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        hashlib.sha256(buf).digest()
        best = max(best, len(buf) / (time.perf_counter() - t))
    return best


def bench_8b(args, sampling: SamplingParams, rate: float, tiny_rows: list[dict]) -> list[dict]:
    cfg = MODEL_CONFIGS["8b"]
    pcfg = PipelineConfig(stages=8, compression_ratio=64)
    # validator CPU per opened byte, from the measured tiny audits
    per_byte = max(r["validator_cpu_s"] / max(1, r["opened_row_bytes"] + r["proof_bytes"]) for r in tiny_rows) \
        if tiny_rows else 0.0
    gpu = args.gpu_fp32_tflops * 1e12
    rows = []
    for stage, direction in ((0, "forward"), (3, "forward"), (3, "backward"), (7, "backward")):
        lay = TraceLayout.build(cfg, pcfg, stage, batch=args.rows_8b, seq=2048, direction=direction, micro_per_step=16)
        est = audit_bytes(lay, sampling)
        sha = audit_bytes(lay, sampling, wire_commit="sha256")
        hashed = committed_bytes(lay)
        fl = trace_flops(lay)
        wbytes = weights_hash_bytes(lay)
        params = sum(int(torch.Size(s).numel()) for _, s in lay.params)
        rows.append({
            "mode": "computed", "config": "8b", "stages": 8, "compression_ratio": 64, "stage": stage,
            "direction": direction, "tokens_per_microbatch": lay.dims.N, "stage_params": params,
            "bytes_per_audit": est.total(args.header_bytes), "bytes_by_message": est.messages,
            "bytes_per_audit_flat_sha256_receipts": sha.total(args.header_bytes),
            "opened_row_bytes": est.rows, "proof_bytes": est.proofs,
            "validator_cpu_s_est": round(per_byte * (est.rows + est.proofs), 3),
            "miner_trace_gflop": round(fl / 1e9, 1),
            "miner_trace_gpu_s_est": round(fl / gpu, 2),
            "miner_hashed_gb": round(hashed / 1e9, 2),
            "miner_hash_s_1_thread": round(hashed / rate, 1),
            f"miner_hash_s_{args.hash_threads}_threads": round(hashed / rate / args.hash_threads, 2),
            "miner_trace_host_gb": round(hashed / 1e9, 2),
            "weights_root_hashed_gb": round(wbytes / 1e9, 2),
            "weights_root_s_1_thread": round(wbytes / rate, 1),
            f"weights_root_s_{args.hash_threads}_threads": round(wbytes / rate / args.hash_threads, 2),
            "weights_host_copy_gb": round(params * 4 / 1e9, 2),
        })
    return rows


def policy(rows: list[dict], tokens_per_s: float, tempo_s: float, replicas: int, header: int) -> dict:
    """Bytes per trained token when every miner is audited once per tempo: the head forward, the middle
    stage forward and backward alternately, the tail's hop (forward and backward at once)."""
    measured = [r for r in rows if r["mode"] == "measured"]
    if not measured:
        return {}
    tokens = tokens_per_s * tempo_s

    def lane(key: str) -> float:
        by = {(r["stage"], r["direction"]): r[key] for r in measured}
        return by[(0, "forward")] + (by[(1, "forward")] + by[(1, "backward")]) / 2 + by[(2, "backward")]
    by = {(r["stage"], r["direction"]): r["bytes_per_audit"] for r in measured}
    per_lane = lane("bytes_per_audit")
    return {"mode": "policy", "config": "tiny", "replicas": replicas, "tempo_s": tempo_s,
            "tokens_per_s_assumed": tokens_per_s, "audit_bytes_per_tempo": int(per_lane * replicas),
            "verification_bytes_per_token": round(per_lane * replicas / tokens, 1),
            "verification_bytes_per_token_all_backward": round(
                (by[(0, "forward")] + by[(1, "backward")] + by[(2, "backward")]) * replicas / tokens, 1),
            "verification_bytes_per_token_flat_sha256_receipts": round(
                lane("bytes_per_audit_flat_sha256_receipts") * replicas / tokens, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--audits", type=int, default=3)
    ap.add_argument("--rows", type=int, default=SamplingParams.rows, help="batch rows sampled per audit")
    ap.add_argument("--tokens", type=int, default=SamplingParams.tokens, help="token rows per sampled batch row")
    ap.add_argument("--spots", type=int, default=SamplingParams.spots)
    ap.add_argument("--header-bytes", type=int, default=1024)
    ap.add_argument("--tokens-per-s", type=float, default=2259.0,
                    help="tiny 3x2 localnet throughput for the per-token figure (docs/BENCHMARKS.md)")
    ap.add_argument("--tempo-s", type=float, default=20.0)
    ap.add_argument("--no-8b", action="store_true")
    ap.add_argument("--rows-8b", type=int, default=1, help="2,048-token rows per 8b micro-batch")
    ap.add_argument("--gpu-fp32-tflops", type=float, default=19.5 * 0.6)
    ap.add_argument("--hash-threads", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.audits < 1:
        print("--audits must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = load_config(args.config)
    sampling = SamplingParams(rows=args.rows, tokens=args.tokens, spots=args.spots)
    rows = bench_tiny(cfg, args, sampling)
    rate = hash_rate()
    pol = policy(rows, args.tokens_per_s, args.tempo_s, 2, args.header_bytes)
    if not args.no_8b:
        rows += bench_8b(args, sampling, rate, rows)
    extra = [{"mode": "machine", "sha256_bytes_per_s_1_core": int(rate), "cpu_count": os.cpu_count(),
              "sampling": {"rows": args.rows, "tokens": args.tokens, "spots": args.spots}}]
    if pol:
        extra.append(pol)
    for r in rows + extra:
        if args.json:
            print(json.dumps(r))
        else:
            print(", ".join(f"{k}={v}" for k, v in r.items()))
    return 0 if all(r.get("all_passed", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
