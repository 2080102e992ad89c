#!/usr/bin/env python
"""What verification costs in the data plane, measured on a real local network (issue 10).

Runs ``localnet`` (real processes, devnet chain) with the validator's default audit policy: every
miner's hops audited once per tempo (hop audits, :mod:`iota_subnet.audit`) and its inner steps
(update audits), chosen after its receipts are in. Prints:

* ``training_bytes_per_token``: the data plane (hops between miners, bodies and headers) per trained token;
* ``verification_bytes_per_token``: the validator's verification client (audits, merge evidence;
  bodies and headers, both ways) per trained token, and the same by endpoint path;
* ``audits``, ``audits_failed``, ``audits_per_miner_per_tempo`` (the least any miner got in a full
  tempo) and its mean, ``flagged`` (uids; with ``--adversary`` the cheater must be there and only it);
* ``validator_audit_cpu_s_per_token``: the validator's CPU for the audit checks per trained token.

Usage:
    OMP_NUM_THREADS=1 python scripts/bench_verification.py --json [--steps 40] [--adversary KIND]
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext-2/wiki.valid.raw.txt"))
    p.add_argument("--steps", type=int, default=40, help="inner steps per lane")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--tempo", type=int, default=20, help="blocks per tempo (localnet default)")
    p.add_argument("--block-time", type=float, default=1.0, help="seconds per block (localnet default)")
    p.add_argument("--adversary", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench_verification-"))
    s = LocalNet(stages=a.stages, replicas=a.replicas, validators=1, config=a.config, data=a.data, steps=a.steps,
                 out=root, progress=False, tempo=a.tempo, block_time=a.block_time, adversary=a.adversary,
                 timeout_s=3600).run()
    tokens = s["tokens"] or 0
    au = s["audits"]
    result = {
        "config": a.config, "stages": a.stages, "replicas": a.replicas, "steps": a.steps,
        "tempo_s": a.tempo * a.block_time, "tokens": tokens, "tokens_per_s": s["tokens_per_s"],
        "training_bytes_per_token": s["miner_bytes_per_token"],
        "verification_bytes_per_token": s["verification_bytes"] / tokens if tokens else None,
        # by endpoint path: /audit/trace, /audit/project, /audit/open (hop audits), /audit/update, the merge
        # evidence
        "verification_bytes_per_token_by_path": {k: round(v / tokens, 2) for k, v in
                                                 sorted((s.get("verification_bytes_by_path") or {}).items())}
        if tokens else None,
        "audits": au["audits"], "audits_failed": au["audits_failed"],
        "audits_per_miner_per_tempo": au["audits_per_miner_per_tempo_min"],
        "audits_per_miner_per_tempo_mean": au["audits_per_miner_per_tempo_mean"],
        "flagged": au["flagged"], "adversary_uids": s["adversary_uids"],
        "validator_audit_cpu_s_per_token": au["audit_cpu_s"] / tokens if tokens else None,
        "validator_bytes_per_token": s["validator_bytes_per_token"],
        "weights": {m["uid"]: round(m["weight"], 4) for m in s["miners"]},
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
