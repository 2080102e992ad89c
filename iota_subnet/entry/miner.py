"""``python neurons/miner.py`` / ``iota-subnet miner``: argument parsing and the process lifecycle."""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from loguru import logger

from iota_subnet.miner.hop_store import DEFAULT_KEEP_VERSIONS
from iota_subnet.entry.chain import adopt_spec_hash, open_network_chain
from iota_subnet.neuron_common import (StopRequested, add_common_args, check_external_ip, install_stop, run_id_for,
                                       setup_process, until_stopped)


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="miner", description="IOTA subnet miner: trains one pipeline stage")
    add_common_args(p)
    m = p.add_argument_group("miner")
    m.add_argument("--stage", type=int, default=None, help="stage to hold (default: the stage with fewest replicas)")
    m.add_argument("--checkpoint-every", type=int, default=10, help="inner steps between checkpoints")
    m.add_argument("--adversary", default=None, metavar="KIND",
                   help="TESTING ONLY: cheat in the way KIND (random, zero, lazy, replay, copy, stale, claim, poison, "
                        "noisy-update, precision, accuse, dodge; see iota_subnet/sim/adversary.py; with a transformers "
                        "model drop-bias, skip-qk-norm, full-attention: iota_subnet/sim/family_cheats.py), or send bad "
                        "output from lane step 5 on (bad-inf, bad-nan, bad-shape, bad-dtype, bad-hash, nan-loss; "
                        "iota_subnet/sim/bad_output.py) so validators' verification can be exercised")
    m.add_argument("--register", action="store_true",
                   help="register the hotkey if it is not (burns TAO from the coldkey; needs --max-burn)")
    m.add_argument("--max-burn", type=float, default=None, metavar="TAO",
                   help="with --register: the most TAO the registration may burn; the chain refuses it above that")
    m.add_argument("--no-register", action="store_true", help=argparse.SUPPRESS)   # the default now; kept for old scripts
    m.add_argument("--data", default=None,
                   help="text source the first and last stage read token rows from (the run's data; see the README); "
                        "default: FineWeb-Edu when the hub is reachable (else refused, unless --allow-data-fallback)")
    m.add_argument("--cache-dir", default=None, help="tokenizer and token cache (default $IOTA_CACHE or ~/.cache/iota-subnet)")
    m.add_argument("--max-in-flight", type=_positive, default=None,
                   help="micro-batches the first stage keeps waiting for their backward (default: one lane step's "
                        "worth, at most what the GPU's memory plan holds)")
    m.add_argument("--hop-timeout", type=float, default=30.0, help="seconds to deliver one hop to the next miner")
    m.add_argument("--audit-window", type=int, default=DEFAULT_KEEP_VERSIONS,
                   help="weights versions (and the hops that used them) kept for hop audits, and inner steps kept "
                        "for update audits (host memory: about 20 x K + 12 bytes per parameter of the stage); "
                        "0: off (validators then count every audit of this miner as refused)")
    m.add_argument("--relay", action="append", default=[], metavar="IP:PORT|HOTKEY@IP:PORT|auto",
                   help="behind a NAT (no port can be opened): be reached through this relay instead (repeat for "
                        "more; 'auto': the run's relay hosts, validators started with --relay-host). The relay's "
                        "address is published as this miner's axon; it cannot read keys or forge messages")
    add_emulation_args(p)
    return p


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def add_emulation_args(p: argparse.ArgumentParser) -> None:
    """``--emulate-gpu``, ``--mfu``, ``--gpu-mem`` (``--time-scale`` is a common argument)."""
    from iota_subnet.hardware import DEFAULT_MFU
    from iota_subnet.neuron_common import positive_float
    e = p.add_argument_group("emulation (measures the system, trains nothing)")
    e.add_argument("--emulate-gpu", default=None, metavar="GPU",
                   help="EMULATION: a100 | h100 | h200 | 4090 | a peak in FLOP/s; compute takes the time the stage would "
                        "take on that device (no real weights, nothing learns), in-flight micro-batches bounded by "
                        "its memory (iota-subnet plan)")
    e.add_argument("--mfu", type=positive_float, default=DEFAULT_MFU,
                   help=f"model FLOP utilisation the emulated device reaches (default {DEFAULT_MFU})")
    e.add_argument("--gpu-mem", type=positive_float, default=None,
                   help="emulated device memory in GiB (default: the named GPU's; required with a FLOP/s figure)")


def emulation_of(args: argparse.Namespace):
    """The :class:`~iota_subnet.sim.emulated.Emulation` the arguments ask for, or None."""
    from iota_subnet.sim.emulated import emulation_from_args
    return emulation_from_args(args.emulate_gpu, args.mfu, args.time_scale, args.gpu_mem)


def miner_parts(args: argparse.Namespace, cfg, emulation):
    """The :class:`~iota_subnet.miner.parts.MinerParts` the arguments ask for: an emulated accelerator
    (``--emulate-gpu``), a cheater (``--adversary``; ConfigError for a merge cheat in a run that does
    not merge), else None (the production parts)."""
    if emulation is not None:
        from iota_subnet.sim.emulated import emulated_parts
        return emulated_parts(emulation)
    if args.adversary:
        from iota_subnet.sim.adversary import adversary_parts
        return adversary_parts(args.adversary, cfg)
    return None


async def run_miner(args: argparse.Namespace) -> int:
    from iota_subnet.config import load_config
    from iota_subnet.miner.options import DataOptions, MinerOptions, ServeOptions
    from iota_subnet.miner.service import MinerService
    from iota_subnet.train.colocated import pick_device
    from iota_subnet.wallets import load_wallet

    stop = install_stop(asyncio.get_running_loop())      # before anything that can wait on the chain
    # reached through relays, its own address is never published
    external_ip = args.external_ip if args.relay else check_external_ip(args.network, args.external_ip,
                                                                         args.allow_private_ip)
    if args.adversary:
        from iota_subnet.sim.adversary import ALL_KINDS
        if args.adversary not in ALL_KINDS:
            raise SystemExit(f"error: unknown --adversary {args.adversary!r}; one of {', '.join(ALL_KINDS)}")
    emulation = emulation_of(args)
    if emulation is not None and args.adversary:
        raise SystemExit("error: --adversary and --emulate-gpu cannot be combined (an emulated stage computes nothing)")
    if not args.spec_hash:
        load_config(args.config)            # a bad config is refused before any chain work
    wallet = load_wallet(args.wallet_name, args.wallet_hotkey, args.wallet_path)
    out = Path(args.out or Path("~/.iota-subnet/miners").expanduser() / wallet.hotkey.ss58_address)
    try:
        chain = await until_stopped(open_network_chain(args.network, args.chain_db, timeout_s=args.chain_timeout), stop)
    except StopRequested:
        logger.info("miner stopped while connecting to the chain")
        return 0
    try:
        await until_stopped(adopt_spec_hash(args, chain), stop)     # --spec-hash: the run's config, id, epoch
        cfg = load_config(args.config)
        if args.spec_hash and args.data is None and getattr(cfg.data, "hf", None) is None:
            logger.warning("joined by spec hash without --data: the run's data source is not part of its spec, so a "
                           "first or last stage reads the default (FineWeb-Edu); pass the run's --data when its "
                           "validators read another (else refused: fingerprints differ)")
        parts = miner_parts(args, cfg, emulation)
    except BaseException as e:
        await chain.close()
        if isinstance(e, StopRequested):
            logger.info("miner stopped while fetching its run's spec")
            return 0
        raise
    opts = MinerOptions(netuid=args.netuid, run_id=run_id_for(args), out_dir=out, stage=args.stage,
                        run_epoch=args.run_epoch, device=str(pick_device(args.device)), total_steps=args.steps,
                        checkpoint_every=args.checkpoint_every, register=args.register, max_burn_tao=args.max_burn,
                        max_in_flight=args.max_in_flight, hop_timeout_s=args.hop_timeout,
                        audit_window=max(0, args.audit_window),
                        serve=ServeOptions(host=args.host, port=args.port, external_ip=external_ip,
                                           dashboard_port=args.dashboard_port, relays=tuple(args.relay)),
                        data=DataOptions(source=args.data, cache_dir=args.cache_dir,
                                         allow_fallback=args.allow_data_fallback))
    svc = MinerService(cfg, wallet, chain, opts, parts=parts)
    try:
        try:
            await until_stopped(svc.start(), stop)
        except StopRequested:
            logger.info("miner stopped during start-up")
            await svc.stop()
            return 0
        await svc.run(stop)
    finally:
        await chain.close()
    logger.info("miner stopped")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    setup_process(args, "miner")
    from iota_subnet.errors import known_errors
    try:
        return asyncio.run(run_miner(args))
    except known_errors() as e:
        logger.error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
