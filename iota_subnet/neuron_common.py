"""Arguments and process plumbing shared by the miner and validator entry points."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from loguru import logger


def add_common_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("wallet and chain")
    g.add_argument("--wallet-name", default="default", help="coldkey wallet name")
    g.add_argument("--wallet-hotkey", default="default", help="hotkey name")
    g.add_argument("--wallet-path", default="~/.bittensor/wallets", help="wallets folder")
    g.add_argument("--network", default=None,
                   help="finney | test | local | ws://host:port | devnet (default: devnet with --chain-db, else finney)")
    g.add_argument("--chain-db", default=None, help="devnet SQLite file (with --network devnet)")
    g.add_argument("--netuid", type=int, default=9)
    r = p.add_argument_group("run")
    r.add_argument("--config", default="configs/tiny.yaml", help="YAML run config (must match the subnet's run)")
    r.add_argument("--run-id", default=None, help="run identifier shared by the run's neurons (default: config name)")
    r.add_argument("--steps", type=int, default=None, help="inner steps of the run (default: train.total_steps)")
    r.add_argument("--out", default=None, help="state folder (checkpoints, nonce store, status.json)")
    r.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    r.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    r.add_argument("--log-level", default="INFO")
    n = p.add_argument_group("network")
    n.add_argument("--host", default="0.0.0.0", help="bind address")
    n.add_argument("--port", type=_port, default=0, help="listen port (0: any free port)")
    n.add_argument("--external-ip", default="127.0.0.1", help="address published on chain")
    n.add_argument("--link", type=link_arg, default="loopback", metavar="RATE:DELAY",
                   help="emulate this uplink for everything the neuron sends (token bucket + one-way delay per "
                        "message), e.g. 100mbit:50ms, 1gbit:10ms; loopback (default) = no shaping")
    n.add_argument("--link-control", default=None, metavar="FILE",
                   help="fault injection: a JSON file re-read a few times a second; {\"down\": true} partitions "
                        "this neuron's uplink, {\"slow\": F} slows it F times, {} heals (localnet --chaos writes it)")
    n.add_argument("--time-scale", type=positive_float, default=1.0,
                   help="emulation only: run emulated links (and --emulate-gpu compute) this many times slower, "
                        "so the host keeps up; figures in emulated time = wall time / time scale")
    n.add_argument("--dashboard-port", type=_port, default=None,
                   help="serve the read-only web dashboard (and /metrics) on this port (0: any free port; "
                        "default: off)")


def link_arg(text: str):
    """argparse type of ``--link``: a :class:`~iota_subnet.transport.shaping.LinkSpec` (exit 2 if malformed)."""
    from iota_subnet.config import ConfigError
    from iota_subnet.transport.shaping import parse_link
    try:
        return parse_link(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return v


def _port(text: str) -> int:
    v = int(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0-65535, got {v}")
    return v


def setup_process(args: argparse.Namespace, name: str) -> None:
    if args.network is None:
        args.network = "devnet" if args.chain_db else "finney"
    logger.remove()
    logger.add(sys.stderr, level=args.log_level,
               format="<green>{time:HH:mm:ss}</green> " + name + " <level>{level: <7}</level> {message}")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    configure_link(args)
    _die_with_parent()


def configure_link(args: argparse.Namespace) -> None:
    """Install the process's emulated uplink from ``--link`` and ``--time-scale``."""
    from iota_subnet.transport.shaping import configure_process_link
    shaper = configure_process_link(args.link, args.time_scale, control_path=args.link_control)
    if shaper is not None and not args.link.loopback:
        logger.info(f"EMULATED LINK: uplink {args.link} (time scale x{args.time_scale:g}: {shaper.link} "
                    "on the wall clock)")


def _die_with_parent() -> None:
    """On Linux, ask the kernel to SIGTERM us if the process that started us dies (no orphans)."""
    if os.environ.get("IOTA_DIE_WITH_PARENT") != "1" or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() == 1:
            os._exit(0)
    except OSError:
        pass


def install_stop(loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def run_id_for(args: argparse.Namespace) -> str:
    return args.run_id or Path(args.config).stem
