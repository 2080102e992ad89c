"""Validator entry point: ``python neurons/validator.py --wallet-name V --wallet-hotkey default ...``.

Everything happens in :mod:`iota_subnet.validator.service`; this file only parses arguments.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from iota_subnet.validator.service import (WEIGHTS_VERSION_KEY, ValidatorError, ValidatorOptions,  # noqa: E402
                                           run_validator)


def parse_args(argv: Optional[list[str]] = None) -> ValidatorOptions:
    p = argparse.ArgumentParser(description="IOTA-style pipeline validator: drives micro-batches through the "
                                            "miners, scores verified work, sets weights every tempo.")
    p.add_argument("--wallet-name", default="default")
    p.add_argument("--wallet-hotkey", default="default")
    p.add_argument("--wallet-path", default="~/.bittensor/wallets")
    p.add_argument("--network", default="devnet", help="devnet | local | test | finney | ws://...")
    p.add_argument("--chain-db", default=None, help="the devnet's SQLite file (network devnet)")
    p.add_argument("--netuid", type=int, default=9)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--data", default=None, help="data source spec (default: the data package's default)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--steps", type=int, default=10, help="inner steps per lane in total")
    p.add_argument("--out", default="runs/validator", help="folder for status.json, metrics.jsonl, state")
    p.add_argument("--run-id", default="iota")
    p.add_argument("--port", type=int, default=0, help="JSON endpoint port (reserved; 0 = none)")
    p.add_argument("--lanes", type=int, default=None, help="drive at most this many lanes")
    p.add_argument("--hop-timeout", type=float, default=30.0, help="seconds per forward/backward hop")
    p.add_argument("--sync-interval", type=float, default=5.0, help="seconds between metagraph syncs")
    p.add_argument("--version-key", type=int, default=WEIGHTS_VERSION_KEY)
    p.add_argument("--exit-when-done", action="store_true",
                   help="exit after the evaluation once weights have been set (default: run until SIGTERM)")
    a = p.parse_args(argv)
    return ValidatorOptions(wallet_name=a.wallet_name, wallet_hotkey=a.wallet_hotkey, wallet_path=a.wallet_path,
                            network=a.network, chain_db=a.chain_db, netuid=a.netuid, config=a.config, data=a.data,
                            cache_dir=a.cache_dir, steps=a.steps, out=a.out, run_id=a.run_id, port=a.port,
                            n_lanes=a.lanes, hop_timeout_s=a.hop_timeout, sync_interval_s=a.sync_interval,
                            version_key=a.version_key, exit_when_done=a.exit_when_done)


def main(argv: Optional[list[str]] = None) -> int:
    opts = parse_args(argv)
    try:
        return asyncio.run(run_validator(opts))
    except ValidatorError as e:
        print(f"validator: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
