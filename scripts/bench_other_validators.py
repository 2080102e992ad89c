#!/usr/bin/env python
"""Step rate of a lone validator among 60 foreign validator-permit holders (issue 12, item 1).

A ``tiny`` 3 x 1 network (rows of 32 tokens, batch 4 in micro-batches of 2) on the SQLite devnet
(block 0.1 s, tempo ``--tempo`` blocks), the validator and the three miners in this process, with
the services' default 5 s metagraph refresh and chain sync. "Crowd" runs add 60 permit holders
seeded into the chain's state: 20 without a commitment, 20 advertising other runs, 20 advertising
this run but silent for longer than the liveness window. After one unmeasured warm-up run, alone (A)
and crowd (B) runs alternate A B B A, ``--cycles`` times (a drift in the machine's load affects
both sides alike). The step rate of a run is read from the validator's ``metrics.jsonl`` (lane
steps after the first over the seconds they took); ``ratio`` = mean(crowd) / mean(alone). Target:
``ratio >= 0.9``. The spread between runs of the same kind is printed beside it (``spread``: max /
min rate per kind): on a shared machine it can exceed the difference being measured.

The harness (``_one_run``) is the one the fast test ``tests/test_other_validators.py`` uses to
check the behaviour behind the figure (the lone coordinating validator drives every lane step).

Usage:
    OMP_NUM_THREADS=1 python scripts/bench_other_validators.py --json [--cycles 2] [--steps 12]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from iota_subnet.config import load_config  # noqa: E402
from test_other_validators import OVR, STEPS, _check_crowd_status, _one_run  # noqa: E402


async def measure(tmp: Path, cycles: int, steps: int, tempo: int) -> list[tuple[bool, dict]]:
    home = tmp / "home"
    home.mkdir()
    os.environ["HOME"] = str(home)             # the bittensor SDK writes under ~/.bittensor
    ovr = {**OVR, "train": {**OVR["train"], "total_steps": steps}}
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), ovr)
    await _one_run(tmp / "warmup", home, cfg, foreign=False, steps=4)
    runs = []
    for i, foreign in enumerate((False, True, True, False) * cycles):
        r = await _one_run(tmp / f"run{i}", home, cfg, foreign=foreign, steps=steps, refresh_s=5.0, tempo=tempo)
        if foreign:
            _check_crowd_status(r["status"], steps)
        print(f"run {i} ({'crowd' if foreign else 'alone'}): {r['rate']:.3f} steps/s", file=sys.stderr)
        runs.append((foreign, r))
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=2, help="A B B A cycles (alone, crowd, crowd, alone)")
    ap.add_argument("--steps", type=int, default=STEPS, help="lane steps per run")
    ap.add_argument("--tempo", type=int, default=100, help="blocks of 0.1 s (the live chain's is 360 of 12 s)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.cycles < 1 or a.steps < 3:
        ap.error("--cycles must be >= 1 and --steps >= 3 (the rate needs two steps after the first)")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_other_validators_") as tmp:
        runs = asyncio.run(measure(Path(tmp), a.cycles, a.steps, a.tempo))
    alone = [r["rate"] for f, r in runs if not f]
    crowd = [r["rate"] for f, r in runs if f]
    res = {"cycles": a.cycles, "steps": a.steps, "tempo_blocks": a.tempo,
           "alone_steps_per_s": sum(alone) / len(alone), "crowd_steps_per_s": sum(crowd) / len(crowd),
           "ratio": (sum(crowd) / len(crowd)) / (sum(alone) / len(alone)),
           "spread": {"alone": max(alone) / min(alone), "crowd": max(crowd) / min(crowd)},
           "runs": [("crowd" if f else "alone", round(r["rate"], 3)) for f, r in runs],
           "load_avg_1m": os.getloadavg()[0], "wall_s": round(time.monotonic() - t0, 1)}
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
