"""``iota-subnet doctor``: checks an operator's setup before they spend TAO or hours.

Python and packages, GPU (or RAM) against the config's memory plan, disk, wallet files,
registration and stake, chain reachability and latency, clock skew against chain time, the port,
reachability from outside and bandwidth (asking a peer, :mod:`iota_subnet.transport.probe`), tokenizer and data
fingerprints. One line per check: PASS, WARN, FAIL or SKIP (with the reason), and the fix.
Exit code 1 when any check FAILs, else 0.

``--spec-hash H`` (a run joined by its hash, as ``iota-subnet miner --spec-hash``): the run's spec is
fetched from a validator advertising it and checked against H (:func:`iota_subnet.run_fetch.fetch_run_spec`,
cached under ``--cache-dir``/``runs/``), and the checks use it as the config. A malformed hash, no
validator advertising it, or none serving a matching spec: one line on stderr, exit code 2.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from .checks import FAIL, PASS, Check, DoctorOptions, run_checks
from iota_subnet.config_presets import config_path
from iota_subnet.data import default_cache_dir
from iota_subnet.entry.chain import open_network_chain
from iota_subnet.errors import UserError
from iota_subnet.protocol.run_spec import check_spec_hash
from iota_subnet.run_fetch import AdoptedRun, fetch_run_spec
from iota_subnet.transport.probe import PeerProbe

#: seconds the spec fetch (chain connection, metagraph, commitments, one validator's GET) may take
SPEC_FETCH_TIMEOUT_S = 60.0

__all__ = ["Check", "DoctorOptions", "PeerProbe", "run_checks", "register"]


async def fetch_spec(o: DoctorOptions, spec_hash: str) -> AdoptedRun:
    """The run ``spec_hash`` addresses on ``o.netuid`` of ``o.network``: its spec fetched from an advertising
    validator and checked (:func:`iota_subnet.run_fetch.fetch_run_spec`, cached under ``o.cache_dir`` or
    ``$IOTA_CACHE``). Raises :class:`UserError` for a malformed hash, an unreachable chain, no advertiser,
    a spec that does not match, or no answer within :data:`SPEC_FETCH_TIMEOUT_S` seconds."""
    spec_hash = check_spec_hash(spec_hash)
    cache = Path(o.cache_dir).expanduser() if o.cache_dir else default_cache_dir()

    async def fetch() -> AdoptedRun:
        chain = await open_network_chain(o.network, o.chain_db)
        try:
            return await fetch_run_spec(chain, o.netuid, spec_hash, cache)
        finally:
            await chain.close()
    try:
        return await asyncio.wait_for(fetch(), timeout=SPEC_FETCH_TIMEOUT_S)
    except (asyncio.TimeoutError, OSError) as e:
        raise UserError(f"spec hash {spec_hash}: no answer from {o.network} netuid {o.netuid} or its validators "
                        f"within {SPEC_FETCH_TIMEOUT_S:.0f} s ({type(e).__name__}: {e}); check --network / "
                        "--chain-db and --netuid") from None


def _cmd_doctor(a: argparse.Namespace) -> int:
    from loguru import logger
    logger.remove()            # library logs would interleave with the report; the checks say it all
    network = a.network or ("devnet" if a.chain_db else "finney")
    o = DoctorOptions(network=network, chain_db=a.chain_db, netuid=a.netuid, wallet_name=a.wallet_name,
                      wallet_hotkey=a.wallet_hotkey, wallet_path=a.wallet_path, role=a.role, config=a.config,
                      stage=a.stage, data=a.data, cache_dir=a.cache_dir, out=a.out, host=a.host, port=a.port,
                      external_ip=a.external_ip, peers=a.peer or [])
    spec = None
    if a.spec_hash:
        try:
            run = asyncio.run(fetch_spec(o, a.spec_hash))
        except UserError as e:
            print(f"iota-subnet doctor: {e}", file=sys.stderr, flush=True)
            return 2
        o.config = str(run.path)
        spec = Check("spec", PASS, f"{run.spec_hash}: run {run.run_id!r} epoch {run.run_epoch}, served by "
                     f"validator(s) {list(run.validators)}, content checked; config {run.path}")
    print(f"iota-subnet doctor: {o.role} {o.wallet_name}/{o.wallet_hotkey} on netuid {o.netuid} ({o.network})")
    checks = ([spec] if spec else []) + run_checks(o)
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
    d.add_argument("--config", default="configs/tiny.yaml", type=config_path,
                   help="the run's YAML config (memory plan); configs/<file> is found in the repository from any "
                        "folder")
    d.add_argument("--spec-hash", default=None, metavar="SHA256",
                   help="check the run whose validators advertise this spec hash (as miner/validator --spec-hash): "
                        "its config is fetched from one of them, refused unless its sha256 is SHA256, and checked "
                        "(replaces --config)")
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
