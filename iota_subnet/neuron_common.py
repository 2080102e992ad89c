"""Arguments and process plumbing shared by the miner and validator entry points."""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import signal
import sys
from pathlib import Path
from typing import Optional

from loguru import logger

from iota_subnet.config_presets import config_path
from iota_subnet.utils.aio import StopRequested, until_stopped  # noqa: F401 (re-exported for the entry points)
from iota_subnet.utils.logs import log_to_stderr
from iota_subnet.utils.malloc import tune_malloc

#: Seconds a chain call may go unanswered before the neuron gives up on it (``--chain-timeout``).
DEFAULT_CHAIN_TIMEOUT_S = 30.0


def add_common_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("wallet and chain")
    g.add_argument("--wallet-name", default="default", help="coldkey wallet name")
    g.add_argument("--wallet-hotkey", default="default", help="hotkey name")
    g.add_argument("--wallet-path", default="~/.bittensor/wallets", help="wallets folder")
    g.add_argument("--network", default=None,
                   help="finney | test | local | ws://host:port | devnet (default: devnet with --chain-db, else finney)")
    g.add_argument("--chain-db", default=None, help="devnet SQLite file (with --network devnet)")
    g.add_argument("--netuid", type=int, default=9)
    g.add_argument("--chain-timeout", type=_positive, default=DEFAULT_CHAIN_TIMEOUT_S,
                   help="seconds a chain call may go unanswered before it is given up (then retried after a "
                        "reconnect)")
    r = p.add_argument_group("run")
    r.add_argument("--config", default="configs/tiny.yaml", type=config_path, help="YAML run config (must match the subnet's run)")
    r.add_argument("--run-id", default=None, help="run identifier shared by the run's neurons (default: config name)")
    r.add_argument("--spec-hash", default=None, metavar="SHA256",
                   help="join the run whose validators advertise this spec hash (64 hex, their commitment's h): "
                        "its config is fetched from one of them, refused unless its sha256 is SHA256, cached under "
                        "--cache-dir/runs/, and used with the run id and epoch they publish (replaces --config)")
    r.add_argument("--run-epoch", type=int, default=0,
                   help="the run's epoch: a new epoch is a new run under the same id (state of the old one is set "
                        "aside in --out/previous/)")
    r.add_argument("--allow-data-fallback", action="store_true",
                   help="when the Hugging Face hub is unreachable, train a BPE / use the Python standard library's "
                        "source instead of refusing (every neuron of the run must do the same)")
    r.add_argument("--steps", type=int, default=None, help="inner steps of the run (default: train.total_steps)")
    r.add_argument("--out", default=None, help="state folder (checkpoints, nonce store, status.json)")
    r.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    r.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    r.add_argument("--log-level", default="INFO")
    n = p.add_argument_group("network")
    n.add_argument("--host", default="0.0.0.0", help="bind address")
    n.add_argument("--port", type=_port, default=0, help="listen port (0: any free port)")
    n.add_argument("--external-ip", default=None,
                   help="public IP address published on chain for other neurons to reach this one (required off the "
                        "devnet; default on the devnet: 127.0.0.1)")
    n.add_argument("--allow-private-ip", action="store_true",
                   help="accept a loopback or private --external-ip off the devnet (a private test network)")
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


def _positive(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def check_external_ip(network: Optional[str], ip: Optional[str], allow_private: bool = False) -> str:
    """The address to publish on chain (``ServeAxon``). On the devnet anything goes (default
    127.0.0.1); elsewhere it must be a public IP address, since other neurons connect to it.
    Raises :class:`~iota_subnet.config.ConfigError` saying what to pass."""
    from iota_subnet.config import ConfigError
    fix = ("pass this machine's public IP address with --external-ip (e.g. the output of `curl -4 ifconfig.me`), "
           "and open --port to the internet")
    if network == "devnet":
        return ip or "127.0.0.1"
    if not ip:
        raise ConfigError(f"--external-ip is required on {network}: other neurons connect to the address published on "
                          f"chain; {fix}")
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        raise ConfigError(f"--external-ip {ip!r} is not an IP address; {fix}") from None
    kind = ("unspecified" if addr.is_unspecified else "loopback" if addr.is_loopback else
            "link-local" if addr.is_link_local else "multicast" if addr.is_multicast else
            "private" if addr.is_private else "reserved" if addr.is_reserved else None)
    if kind is not None and not allow_private:
        article = "an" if kind[0] in "aeiou" else "a"
        raise ConfigError(f"--external-ip {ip} is {article} {kind} address: no neuron on {network} can reach it; {fix} "
                          "(--allow-private-ip accepts it on a private test network)")
    return ip


def setup_process(args: argparse.Namespace, name: str) -> None:
    tune_malloc()                       # before the neuron's threads start (see iota_subnet.utils.malloc)
    if args.network is None:
        args.network = "devnet" if args.chain_db else "finney"
    log_to_stderr(args.log_level, "<green>{time:HH:mm:ss}</green> " + name + " <level>{level: <7}</level> {message}")
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
        what = "uplink/downlink" if args.link.down_rate_bps is not None else "uplink"
        logger.info(f"EMULATED LINK: {what} {args.link} (time scale x{args.time_scale:g}: {shaper.link} "
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


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop a neuron cleanly: SIGINT, SIGTERM, and SIGHUP unless it is ignored
    (``nohup``: the neuron must outlive its terminal)."""
    hup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGINT, signal.SIGTERM, *hup)


def install_stop(loop: asyncio.AbstractEventLoop, stop: Optional[asyncio.Event] = None) -> asyncio.Event:
    """Map SIGINT / SIGTERM / SIGHUP (Ctrl-C, ``kill``, a closed terminal) to ``stop`` (a new event
    by default): the neuron stops as at the end of its run, checkpoint saved. SIGHUP stays ignored
    where it was (``nohup``). Install it first thing, before any chain call: a stop request must be
    honoured during start-up too (see :func:`until_stopped`)."""
    stop = stop or asyncio.Event()
    for sig in stop_signals():
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):   # not the main thread (tests)
            pass
    return stop


def run_id_for(args: argparse.Namespace) -> str:
    return args.run_id or Path(args.config).stem
