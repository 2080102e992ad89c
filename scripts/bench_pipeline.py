#!/usr/bin/env python
"""Local network vs co-located trainer, same config, data and steps, measured in one run.

Prints the ratio of trained tokens per second (the whole local network, all replicas together,
over the co-located trainer; both use the whole machine) and the wire bytes per trained token
with the configured bottleneck and without it (a short second local network at ratio 1). The
pipeline is measured with verification off (``ratio``) and as shipped, with the validator's audits
and CLASP probes at their defaults (``verified_ratio``, ``verification_bytes_per_token``).

Usage:
    python scripts/bench_pipeline.py --config configs/tiny.yaml \
        --data ../shared/data/wikitext-2/wiki.valid.raw.txt --steps 30 [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loguru import logger  # noqa: E402

from iota_subnet.network.localnet import LocalNet  # noqa: E402
from iota_subnet.train.colocated import train_colocated  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext-2/wiki.valid.raw.txt"))
    p.add_argument("--steps", type=int, default=30, help="inner steps per miner (and co-located steps)")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--uncompressed-steps", type=int, default=5, help="steps of the ratio-1 network (wire bytes only)")
    p.add_argument("--out", default=None)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench_pipeline-"))
    # the pipeline alone (verification off), then as shipped (audits + CLASP at their defaults)
    ln = LocalNet(stages=a.stages, replicas=a.replicas, validators=1, config=a.config, data=a.data, steps=a.steps,
                  out=root / "localnet", progress=False,
                  extra_validator_args=["--no-audits", "--clasp-interval", "0"]).run()
    co = train_colocated(a.config, a.data, a.steps, root / "colocated", progress=False,
                         overrides={"pipeline": {"stages": a.stages}})
    ver = LocalNet(stages=a.stages, replicas=a.replicas, validators=1, config=a.config, data=a.data, steps=a.steps,
                   out=root / "localnet-verified", progress=False).run()
    raw = LocalNet(stages=a.stages, replicas=a.replicas, validators=1, config=a.config, data=a.data,
                   steps=a.uncompressed_steps, out=root / "localnet-ratio1", progress=False,
                   overrides={"pipeline": {"compression_ratio": 1}}).run()
    result = {
        "config": a.config, "stages": a.stages, "replicas": a.replicas, "steps": a.steps,
        "compression_ratio": ln["compression_ratio"],
        "localnet_tokens_per_s": ln["tokens_per_s"], "colocated_tokens_per_s": co["tokens_per_s"],
        "ratio": ln["tokens_per_s"] / co["tokens_per_s"],
        "wire_bytes_per_token": ln["wire_bytes_per_token"],
        "wire_bytes_per_token_uncompressed": raw["wire_bytes_per_token"],
        "localnet_final_loss": ln["final_loss"], "colocated_final_loss": co["final_loss"],
        "localnet_val_loss": ln["val_loss"], "colocated_val_loss": co["val_loss"],
        "reroutes": ln["reroutes"],
        "verified_localnet_tokens_per_s": ver["tokens_per_s"],
        "verified_ratio": ver["tokens_per_s"] / co["tokens_per_s"],
        "verification_bytes_per_token": ver["verification_bytes"] / ver["tokens"] if ver["tokens"] else None,
        "out": str(root),
    }
    if a.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>36}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
