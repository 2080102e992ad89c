"""The chain a command line names (``--network``, ``--chain-db``): the devnet file or an SDK endpoint; and
the run a ``--spec-hash`` names on it (:func:`adopt_spec_hash`)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from loguru import logger

from iota_subnet.chain import Chain, open_chain
from iota_subnet.data import default_cache_dir
from iota_subnet.devnet import open_devnet
from iota_subnet.errors import UserError
from iota_subnet.neuron_common import DEFAULT_CHAIN_TIMEOUT_S
from iota_subnet.run_fetch import fetch_run_spec


async def open_network_chain(network: str, chain_db: Optional[str] = None, *,
                             timeout_s: float = DEFAULT_CHAIN_TIMEOUT_S):
    """The :class:`~iota_subnet.chain.Chain` that ``--network`` / ``--chain-db`` name: ``devnet`` opens
    the devnet file (:func:`iota_subnet.devnet.open_devnet`), any other network the SDK's endpoint
    (:func:`iota_subnet.chain.open_chain`; ``chain_db`` is ignored there). ``timeout_s`` bounds the
    connection and every read. Raises :class:`~iota_subnet.chain.ChainError` (a missing devnet file
    included) or :class:`~iota_subnet.chain.ChainTimeout`."""
    if network == "devnet":
        return await open_devnet(chain_db, timeout_s=timeout_s)
    return await open_chain(network, timeout_s=timeout_s)


async def adopt_spec_hash(args: argparse.Namespace, chain: Chain) -> None:
    """With ``--spec-hash``: fetch and check the run's spec from a validator advertising it
    (:func:`iota_subnet.run_fetch.fetch_run_spec`, cached under ``--cache-dir``/``$IOTA_CACHE``), and point
    ``args.config``, ``args.run_id`` and ``args.run_epoch`` at that run. Raises :class:`UserError` when
    ``--run-id`` names another run (and what ``fetch_run_spec`` raises); without ``--spec-hash`` does nothing."""
    if not getattr(args, "spec_hash", None):
        return
    cache = Path(args.cache_dir).expanduser() if getattr(args, "cache_dir", None) else default_cache_dir()
    run = await fetch_run_spec(chain, args.netuid, args.spec_hash, cache)
    if args.run_id and args.run_id != run.run_id:
        raise UserError(f"--run-id {args.run_id!r} is not the run of spec hash {run.spec_hash}: its validators "
                        f"{list(run.validators)} run {run.run_id!r}; leave --run-id out")
    if args.run_epoch not in (0, run.run_epoch):
        logger.warning("--run-epoch {} replaced by the epoch of spec hash {}: {}", args.run_epoch,
                       run.spec_hash[:12], run.run_epoch)
    args.config, args.run_id, args.run_epoch = str(run.path), run.run_id, run.run_epoch
    logger.info("joining run {!r} epoch {} by spec hash {} (validators {}; config {})", run.run_id, run.run_epoch,
                run.spec_hash, list(run.validators), run.path)
