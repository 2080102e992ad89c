#!/usr/bin/env python
"""Benchmark of the co-located trainer: tokens/s, MFU, and validation loss vs compression ratio and wire dtype.

MFU = achieved FLOP/s / peak FLOP/s, with achieved = tokens/s x training FLOPs per token
(forward + backward = 3 x forward, PaLM appendix B). Peaks: a 2048^3 matmul measured on this machine
in the training dtype before every run (the best measurement is used), and the GPU's nominal bf16
dense peak when a GPU is present. Validation losses do not depend on machine load; tokens/s and MFU
do, so measure those on a quiet machine (``--ratios 1,8 --steps 10``).

``--wire-dtypes``: each run puts the activation at every stage boundary through
``to_wire`` / ``from_wire`` (:mod:`iota_subnet.protocol.wire`) in the forward pass and its gradient in
the backward pass (:class:`iota_subnet.train.wire_boundary.WireBoundary`), as the network's miners
exchange them; one row per (ratio, wire dtype), with the bytes a token takes on one boundary
(``b x bytes per value``, + 4 for the float32 scale of int8 / fp8) and the validation loss relative
to ratio 1 in fp32 (always run). ``--seeds``: one run per seed (model init and data order); a row
gives the mean validation loss and its standard deviation over them.

Usage:
    python scripts/bench_model.py --config configs/small.yaml --data ../shared/data/wikitext-2/wiki.valid.raw.txt \
        --steps 60 --ratios 1,8,16,32,64,128 [--wire-dtypes fp32,bf16,int8,fp8] [--seeds 0,1] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from loguru import logger  # noqa: E402

from iota_subnet.config import ConfigError, load_config  # noqa: E402
from iota_subnet.model import bottleneck_dims  # noqa: E402
from iota_subnet.protocol.ticket import WIRE_DTYPES  # noqa: E402
from iota_subnet.protocol.wire import bytes_per_token  # noqa: E402
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


def parse_list(text: str, kind=str) -> list:
    """``"1,8, 16"`` -> ``[1, 8, 16]`` (empty items dropped)."""
    return [kind(x.strip()) for x in text.split(",") if x.strip()]


def summarize(runs: list[dict]) -> dict:
    """One (ratio, wire dtype) row from its runs (one per seed): means of the losses and rates, the
    per-seed validation losses and their sample standard deviation (None for one seed)."""
    vals = [r["val_loss"] for r in runs]
    mean = sum(vals) / len(vals)
    std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else None
    avg = {k: sum(r[k] for r in runs) / len(runs) for k in ("final_loss", "tokens_per_s", "wall_s")}
    return {"val_loss": mean, "val_loss_std": std, "val_loss_seeds": vals, **avg}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/small.yaml")
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext-2/wiki.valid.raw.txt"))
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per ratio (the fixed token budget)")
    p.add_argument("--ratios", default="1,8,16,32,64,128")
    p.add_argument("--wire-dtypes", default="fp32",
                   help=f"wire dtypes at the stage boundaries, comma-separated, from {','.join(WIRE_DTYPES)}: "
                        "the activation and its gradient go through to_wire / from_wire (fp32: untouched); "
                        "the reference (ratio 1, fp32) is always run")
    p.add_argument("--seeds", default="", help="comma-separated model / data seeds, each a run (default: train.seed)")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="keep run folders here (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    a = p.parse_args(argv)
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    wires = parse_list(a.wire_dtypes)
    bad = [w for w in wires if w not in WIRE_DTYPES]
    if bad or not wires:
        p.error(f"--wire-dtypes: {bad or a.wire_dtypes!r} not in {','.join(WIRE_DTYPES)}")
    seeds: list[Optional[int]] = parse_list(a.seeds, int) or [None]
    dev = pick_device(a.device)
    base = load_config(a.config)
    ratios = []
    for r in parse_list(a.ratios, int):
        try:
            bottleneck_dims(base.model, base.pipeline.__class__(stages=2, compression_ratio=r))
            ratios.append(r)
        except ConfigError as e:
            print(f"skipping ratio {r}: {e}", file=sys.stderr)
    grid = [(r, w) for r in ratios for w in wires]
    if (1, "fp32") not in grid:
        grid.insert(0, (1, "fp32"))            # the reference every row is compared with
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    peak = measured_matmul_peak(dev, dtype)
    nominal = gpu_peak()
    out_root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench_model-"))
    rows = []
    for r, w in grid:
        b, _ = bottleneck_dims(base.model, base.pipeline.__class__(stages=2, compression_ratio=r))
        runs = []
        for seed in seeds:
            # the machine is shared: re-measure the peak before every run and keep the best seen, so MFU
            # is never computed against a peak that was measured while something else ran
            peak = max(peak, measured_matmul_peak(dev, dtype, seconds=1.0))
            t0 = time.perf_counter()
            name = f"ratio{r}" + ("" if w == "fp32" else f"-{w}") + ("" if seed is None else f"-seed{seed}")
            s = train_colocated(a.config, a.data, a.steps, out_root / name, device=str(dev), progress=False, seed=seed,
                                overrides={"pipeline": {"compression_ratio": r}, "train": {"eval_batches": a.eval_batches}},
                                wire_dtype=w)
            runs.append({**s, "wall_s": time.perf_counter() - t0})
            print(f"ratio {r:>4} (b={b:>3}) wire {w:>4}{'' if seed is None else f' seed {seed}'}: "
                  f"val_loss {s['val_loss']:.4f}  tokens/s {s['tokens_per_s']:.0f}", file=sys.stderr)
        s = runs[0]
        row = {"ratio": r, "wire_dtype": w, "bottleneck_width": b,
               "bytes_per_token_per_boundary": bytes_per_token(w, b), **summarize(runs),
               "flops_per_token": s["flops_per_token"], "params": s["params"],
               "seeds": [x for x in seeds if x is not None] or None}
        achieved = row["tokens_per_s"] * row["flops_per_token"]
        row["mfu_gpu_bf16_peak"] = achieved / nominal if nominal else None
        rows.append(row)
    for x in rows:   # against the best peak measured during the whole run
        x["mfu_measured_peak"] = x["tokens_per_s"] * x["flops_per_token"] / peak
    ref = next(x for x in rows if (x["ratio"], x["wire_dtype"]) == (1, "fp32"))
    best: dict[str, Optional[int]] = {w: None for w in wires}
    for x in rows:
        x["val_loss_vs_uncompressed"] = x["val_loss"] / ref["val_loss"] - 1
        x["bytes_vs_uncompressed"] = x["bytes_per_token_per_boundary"] / ref["bytes_per_token_per_boundary"]
        w = x["wire_dtype"]
        if w in best and x["val_loss_vs_uncompressed"] <= 0.03 and (best[w] is None or x["ratio"] > best[w]):
            best[w] = x["ratio"]
    result = {"config": a.config, "model": base.model.name, "stages": base.pipeline.stages, "device": str(dev),
              "threads": torch.get_num_threads(), "steps": a.steps, "seeds": [x for x in seeds if x is not None] or None,
              "tokens_per_step": base.train.batch_size * base.data.seq_len,
              "matmul_peak_flops": peak, "gpu_bf16_peak_flops": nominal,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "tokens_per_s": rows[0]["tokens_per_s"] if rows else None,
              "mfu_measured_peak": rows[0]["mfu_measured_peak"] if rows else None,
              "ratios": rows, "best_ratio_within_3pct": best.get("fp32"), "best_ratio_within_3pct_by_wire": best}
    if a.json:
        print(json.dumps(result))
    else:
        print(f"{'ratio':>6} {'wire':>5} {'b':>4} {'B/tok':>6} {'bytes':>7} {'val_loss':>9} {'+-':>7} "
              f"{'vs r1 fp32':>10} {'tok/s':>8} {'MFU':>6}")
        for x in rows:
            sd = "" if x["val_loss_std"] is None else f"{x['val_loss_std']:.4f}"
            print(f"{x['ratio']:>6} {x['wire_dtype']:>5} {x['bottleneck_width']:>4} "
                  f"{x['bytes_per_token_per_boundary']:>6} {x['bytes_vs_uncompressed']:>7.2%} {x['val_loss']:>9.4f} "
                  f"{sd:>7} {x['val_loss_vs_uncompressed']:>+10.2%} {x['tokens_per_s']:>8.0f} {x['mfu_measured_peak']:>6.1%}")
        print("best ratio within 3% of ratio 1 fp32: " + ", ".join(f"{w} {r}" for w, r in best.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
