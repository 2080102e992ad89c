#!/usr/bin/env python
"""Benchmark of the co-located trainer: tokens/s, MFU, and validation loss vs compression ratio.

MFU = achieved FLOP/s / peak FLOP/s, with achieved = tokens/s x training FLOPs per token
(forward + backward = 3 x forward, PaLM appendix B). Peaks: a 2048^3 matmul measured on this machine
in the training dtype before every run (the best measurement is used), and the GPU's nominal bf16
dense peak when a GPU is present. Validation losses do not depend on machine load; tokens/s and MFU
do, so measure those on a quiet machine (``--ratios 1,8 --steps 10``).

Usage:
    python scripts/bench_model.py --config configs/small.yaml --data ../shared/data/wikitext-2/wiki.valid.raw.txt \
        --steps 60 --ratios 1,8,16,32,64,128 [--json]
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

from iota_subnet.config import ConfigError, load_config  # noqa: E402
from iota_subnet.model import bottleneck_dims  # noqa: E402
from iota_subnet.train.colocated import pick_device, train_colocated  # noqa: E402

#: Nominal dense bf16 peaks (FLOP/s) by GPU name fragment.
GPU_BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}


def measured_matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 2048, seconds: float = 2.0) -> float:
    """FLOP/s of a square n x n matmul, repeated for about ``seconds``."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
        if device.type == "cuda" and reps % 10 == 0:
            torch.cuda.synchronize()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def gpu_peak() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in GPU_BF16_PEAK.items() if k in name), None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/small.yaml")
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext-2/wiki.valid.raw.txt"))
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per ratio (the fixed token budget)")
    p.add_argument("--ratios", default="1,8,16,32,64,128")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="keep run folders here (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    a = p.parse_args(argv)
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    dev = pick_device(a.device)
    base = load_config(a.config)
    d = base.model.dim
    ratios = []
    for r in (int(x) for x in a.ratios.split(",")):
        try:
            bottleneck_dims(base.model, base.pipeline.__class__(stages=2, compression_ratio=r))
            ratios.append(r)
        except ConfigError as e:
            print(f"skipping ratio {r}: {e}", file=sys.stderr)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    peak = measured_matmul_peak(dev, dtype)
    nominal = gpu_peak()
    out_root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench_model-"))
    rows = []
    for r in ratios:
        # the machine is shared: re-measure the peak before every run and keep the best seen, so MFU
        # is never computed against a peak that was measured while something else ran
        peak = max(peak, measured_matmul_peak(dev, dtype, seconds=1.0))
        t0 = time.perf_counter()
        s = train_colocated(a.config, a.data, a.steps, out_root / f"ratio{r}", device=str(dev), progress=False,
                            overrides={"pipeline": {"compression_ratio": r}, "train": {"eval_batches": a.eval_batches}})
        achieved = s["tokens_per_s"] * s["flops_per_token"]
        b, _ = bottleneck_dims(base.model, base.pipeline.__class__(stages=2, compression_ratio=r))
        row = {"ratio": r, "bottleneck_width": b, "val_loss": s["val_loss"], "final_loss": s["final_loss"],
               "tokens_per_s": s["tokens_per_s"], "flops_per_token": s["flops_per_token"],
               "mfu_measured_peak": achieved / peak,
               "mfu_gpu_bf16_peak": achieved / nominal if nominal else None, "params": s["params"],
               "wall_s": time.perf_counter() - t0}
        rows.append(row)
        print(f"ratio {r:>4} (b={b:>3}): val_loss {s['val_loss']:.4f}  tokens/s {s['tokens_per_s']:.0f}  "
              f"MFU {row['mfu_measured_peak']:.1%} of measured peak", file=sys.stderr)
    for x in rows:   # against the best peak measured during the whole run
        x["mfu_measured_peak"] = x["tokens_per_s"] * x["flops_per_token"] / peak
    ref = next((x for x in rows if x["ratio"] == 1), None)
    best = None
    if ref:
        for x in rows:
            x["val_loss_vs_uncompressed"] = x["val_loss"] / ref["val_loss"] - 1
            if x["val_loss_vs_uncompressed"] <= 0.03 and (best is None or x["ratio"] > best):
                best = x["ratio"]
    result = {"config": a.config, "model": base.model.name, "stages": base.pipeline.stages, "device": str(dev),
              "threads": torch.get_num_threads(), "steps": a.steps,
              "tokens_per_step": base.train.batch_size * base.data.seq_len,
              "matmul_peak_flops": peak, "gpu_bf16_peak_flops": nominal,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "tokens_per_s": rows[0]["tokens_per_s"] if rows else None,
              "mfu_measured_peak": rows[0]["mfu_measured_peak"] if rows else None,
              "ratios": rows, "best_ratio_within_3pct": best}
    if a.json:
        print(json.dumps(result))
    else:
        print(f"{'ratio':>6} {'b':>4} {'val_loss':>9} {'vs r=1':>8} {'tok/s':>8} {'MFU':>6}")
        for x in rows:
            print(f"{x['ratio']:>6} {x['bottleneck_width']:>4} {x['val_loss']:>9.4f} "
                  f"{x.get('val_loss_vs_uncompressed', 0):>+8.2%} {x['tokens_per_s']:>8.0f} {x['mfu_measured_peak']:>6.1%}")
        print(f"best ratio within 3% of uncompressed: {best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
