"""bf16 replay error of one pipeline stage (issue 10, item 5): sets the bf16 replay tolerance.

For stage ``--stage`` of ``--config`` (a named shape: ``tiny``, ``1b``, ...) cut into ``--stages``
stages, with the run's seeded initialisation, the script runs forward and backward of ``--rows``
rows of ``--seq`` tokens twice: in fp32 (the validator's replay) and under bf16 autocast (fp32
master weights, what a ``train.precision: bf16`` miner computes), and prints the relative L2 error
``||bf16 - fp32|| / ||fp32||`` of the stage output (activations; the loss for the tail) and of the
input gradient. Inputs: token ids for the head, else N(0, 1) activations of the boundary width; the
output gradient is N(0, 1) (the tail: its own loss). It also prints the error of the cheapest cheat
the bf16 tolerance must still catch: skipping the stage's last block (bf16 as well).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_precision.py --config 1b --stages 4 --stage 1 --rows 1 --seq 128 --json

CPU only is fine (torch's CPU bf16 autocast); memory: about 4 x 4 bytes per parameter of the stage.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import torch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def run(config: str, stages: int, stage: int, rows: int, seq: int, ratio: int, seed: int = 0) -> dict:
    from iota_subnet.config import load_config
    from iota_subnet.model import PipelineStage

    cfg = load_config(config, {"pipeline": {"stages": stages, "compression_ratio": ratio},
                               "data": {"seq_len": seq}})
    torch.manual_seed(seed + 1000 * stage)
    m = PipelineStage(cfg.model, cfg.pipeline, stage)
    spec = m.spec
    g = torch.Generator().manual_seed(seed + 7)
    if spec.is_head:
        x = torch.randint(0, cfg.model.vocab_size, (rows, seq), generator=g)
    else:
        x = torch.randn(rows, seq, spec.in_width, generator=g)
    targets = torch.randint(0, cfg.model.vocab_size, (rows, seq), generator=g) if spec.is_tail else None
    gout = None if spec.is_tail else torch.randn(rows, seq, spec.out_width, generator=g)

    def once(bf16: bool, skip_last: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        m.zero_grad(set_to_none=True)
        inp = x if spec.is_head else x.clone().requires_grad_(True)
        full = m.layers
        if skip_last:
            keys = list(full.keys())
            m._modules["layers"] = torch.nn.ModuleDict({k: full[k] for k in keys[:-1]})
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        t0 = time.perf_counter()
        try:
            with ctx:
                out = m(inp, targets) if spec.is_tail else m(inp)
            if spec.is_tail:
                out.backward()
            else:
                out.backward(gout.to(out.dtype))
        finally:
            m._modules["layers"] = full
        dt = time.perf_counter() - t0
        return out.detach().float(), (None if spec.is_head else inp.grad.detach().float()), dt

    ref_out, ref_grad, t32 = once(False)
    out16, grad16, t16 = once(True)
    skip_out, skip_grad, _ = once(True, skip_last=True)
    res = {"config": config, "stages": stages, "stage": stage, "layers": [spec.layers.start, spec.layers.stop - 1],
           "params": m.param_count(), "rows": rows, "seq": seq, "tokens": rows * seq, "compression_ratio": ratio,
           "init": "seeded initialisation (untrained)", "out_rel_err_bf16": _rel(out16, ref_out),
           "grad_rel_err_bf16": None if ref_grad is None else _rel(grad16, ref_grad),
           "out_rel_err_skip_last_block_bf16": _rel(skip_out, ref_out),
           "grad_rel_err_skip_last_block_bf16": None if ref_grad is None else _rel(skip_grad, ref_grad),
           "fp32_s": round(t32, 2), "bf16_s": round(t16, 2), "threads": torch.get_num_threads()}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="1b")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--ratio", type=int, default=8, help="pipeline compression ratio (boundary width d / b)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if not 0 <= a.stage < a.stages:
        print(f"--stage {a.stage} outside 0..{a.stages - 1}", file=sys.stderr)
        return 2
    res = run(a.config, a.stages, a.stage, a.rows, a.seq, a.ratio)
    print(json.dumps(res) if a.json else "\n".join(f"{k}: {v}" for k, v in res.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
