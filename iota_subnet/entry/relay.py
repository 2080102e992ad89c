"""``iota-subnet relay``: a relay on its own, for neurons that cannot be dialled (behind a NAT).

Run it on a machine with a public address and an open port; miners behind NATs start with
``--relay HOTKEY@IP:PORT`` (its hotkey and address, printed at start). Only hotkeys registered on the
netuid may attach (the metagraph is re-read every ``--sync-interval`` seconds; ``--open``: any signed
hotkey). It writes ``status.json`` (who is relayed, requests, bytes) to ``--out`` every second.
See :mod:`iota_subnet.transport.relay`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Optional

from loguru import logger

from iota_subnet.entry.chain import open_network_chain
from iota_subnet.neuron_common import install_stop, link_arg, positive_float, setup_process
from iota_subnet.transport import NeuronServer
from iota_subnet.transport.probe import PeerProbe
from iota_subnet.transport.relay import RelayHost
from iota_subnet.utils.atomic import atomic_write_text
from iota_subnet.wallets import load_wallet


def build_parser(p: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="relay", description=__doc__.split("\n")[0])
    p.add_argument("--wallet-name", default="default")
    p.add_argument("--wallet-hotkey", default="default")
    p.add_argument("--wallet-path", default="~/.bittensor/wallets")
    p.add_argument("--network", default=None, help="finney | test | devnet | ws://... (default: finney, devnet with --chain-db)")
    p.add_argument("--chain-db", default=None)
    p.add_argument("--netuid", type=int, default=9)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8092)
    p.add_argument("--rate", type=float, default=None, metavar="BYTES_PER_S",
                   help="at most this many bytes per second per relayed neuron, both directions (default: no cap)")
    p.add_argument("--open", action="store_true", help="let any signed hotkey attach, registered or not")
    p.add_argument("--sync-interval", type=float, default=30.0)
    p.add_argument("--out", default=None, help="folder for status.json (default: ~/.iota-subnet/relay)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--link", type=link_arg, default="loopback", metavar="RATE:DELAY",
                   help="emulate this uplink for what the relay sends (as the neurons' --link)")
    p.add_argument("--time-scale", type=positive_float, default=1.0, help=argparse.SUPPRESS)
    p.add_argument("--link-control", default=None, help=argparse.SUPPRESS)
    p.add_argument("--fault", default=None, help=argparse.SUPPRESS)     # tests: a misbehaving relay (sim.relay_faults)
    return p


async def serve(a: argparse.Namespace) -> int:
    stop = install_stop(asyncio.get_running_loop())
    wallet = load_wallet(a.wallet_name, a.wallet_hotkey, a.wallet_path)
    out = Path(a.out or Path("~/.iota-subnet/relay").expanduser())
    out.mkdir(parents=True, exist_ok=True)
    registered: set[str] = set()
    chain = None if a.open else await open_network_chain(a.network, a.chain_db)

    async def sync() -> None:
        graph = await chain.metagraph(a.netuid)
        registered.clear()
        registered.update(n.hotkey for n in graph.neurons)

    relay_cls = RelayHost
    if a.fault:
        from iota_subnet.sim.relay_faults import RELAY_FAULTS
        relay_cls = RELAY_FAULTS[a.fault]
    relay = relay_cls(wallet, authorize=None if a.open else (lambda hk: hk in registered), rate_bytes_per_s=a.rate)
    server = NeuronServer(wallet, a.host, a.port, authorizer=None, nonce_store_path=out / "nonces.sqlite")
    relay.mount(server)
    for path, handler in PeerProbe().handlers().items():          # iota-subnet doctor asks it
        server.add_public_get(path, handler)
    if chain is not None:
        await sync()
    port = await server.start()
    logger.info("relay {} serves on {}:{}{}: neurons behind a NAT start with --relay {}@<this address>:{}",
                relay.hotkey, a.host, port, f" (fault: {a.fault})" if a.fault else "", relay.hotkey, port)
    last_sync = asyncio.get_running_loop().time()
    try:
        while not stop.is_set():
            atomic_write_text(out / "status.json", json.dumps({"port": port, **relay.status()}))
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
            now = asyncio.get_running_loop().time()
            if chain is not None and now - last_sync > a.sync_interval:
                last_sync = now
                try:
                    await sync()
                except Exception as e:  # noqa: BLE001 - keep relaying with the last metagraph
                    logger.warning("relay: metagraph sync failed ({}); keeping the last one", e)
    finally:
        atomic_write_text(out / "status.json", json.dumps({"port": port, **relay.status()}))
        await server.stop()
        if chain is not None:
            await chain.close()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """``iota-subnet relay``."""
    p = sub.add_parser("relay", help="relay for neurons that cannot be dialled (behind a NAT)")
    build_parser(p)
    p.set_defaults(func=_cmd_relay)


def _cmd_relay(a: argparse.Namespace) -> int:
    setup_process(a, "relay")
    return asyncio.run(serve(a))


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    setup_process(a, "relay")
    return asyncio.run(serve(a))


if __name__ == "__main__":
    raise SystemExit(main())
