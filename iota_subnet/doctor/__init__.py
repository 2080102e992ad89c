"""``iota-subnet doctor``: checks an operator's setup before they spend TAO or hours.

Python and packages, GPU (or RAM) against the config's memory plan, disk, wallet files,
registration and stake, chain reachability and latency, clock skew against chain time, the port,
reachability from outside and bandwidth (asking a peer, :mod:`iota_subnet.transport.probe`), tokenizer and data
fingerprints. One line per check: PASS, WARN, FAIL or SKIP (with the reason), and the fix.
Exit code 1 when any check FAILs, else 0.
"""
from __future__ import annotations

import argparse

from .checks import FAIL, Check, DoctorOptions, run_checks
from iota_subnet.transport.probe import PeerProbe

__all__ = ["Check", "DoctorOptions", "PeerProbe", "run_checks", "register"]


def _cmd_doctor(a: argparse.Namespace) -> int:
    from loguru import logger
    logger.remove()            # library logs would interleave with the report; the checks say it all
    network = a.network or ("devnet" if a.chain_db else "finney")
    o = DoctorOptions(network=network, chain_db=a.chain_db, netuid=a.netuid, wallet_name=a.wallet_name,
                      wallet_hotkey=a.wallet_hotkey, wallet_path=a.wallet_path, role=a.role, config=a.config,
                      stage=a.stage, data=a.data, cache_dir=a.cache_dir, out=a.out, host=a.host, port=a.port,
                      external_ip=a.external_ip, peers=a.peer or [])
    print(f"iota-subnet doctor: {o.role} {o.wallet_name}/{o.wallet_hotkey} on netuid {o.netuid} ({o.network})")
    checks = run_checks(o)
    for c in checks:
        for line in c.lines():
            print(line, flush=True)
    counts = {s: sum(1 for c in checks if c.status == s) for s in ("PASS", "WARN", "FAIL", "SKIP")}
    print("summary: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return 1 if counts[FAIL] else 0


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("doctor", help="check this machine, wallet, chain and network before running a neuron")
    d.add_argument("--network", default=None,
                   help="finney | test | local | ws://host:port | devnet (default: devnet with --chain-db, else finney)")
    d.add_argument("--chain-db", default=None, help="devnet SQLite file (with --network devnet)")
    d.add_argument("--netuid", type=int, default=9)
    d.add_argument("--wallet-name", default="default")
    d.add_argument("--wallet-hotkey", default="default")
    d.add_argument("--wallet-path", default="~/.bittensor/wallets")
    d.add_argument("--role", choices=("miner", "validator"), default="miner")
    d.add_argument("--config", default="configs/tiny.yaml", help="the run's YAML config (memory plan)")
    d.add_argument("--stage", type=int, default=None, help="the stage to plan for (default: the largest)")
    d.add_argument("--data", default=None, help="the run's text source (tokenizer and data fingerprints)")
    d.add_argument("--cache-dir", default=None)
    d.add_argument("--out", default="~/.iota-subnet", help="where checkpoints go (disk space)")
    d.add_argument("--host", default="0.0.0.0", help="bind address for the port check")
    d.add_argument("--port", type=int, default=0, help="the port the neuron will serve on")
    d.add_argument("--external-ip", default=None, help="the address the neuron will publish")
    d.add_argument("--peer", action="append", metavar="HOST:PORT",
                   help="a running neuron to ask for reachability and bandwidth (default: neurons on chain)")
    d.set_defaults(func=_cmd_doctor)
