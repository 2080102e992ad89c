"""``python neurons/validator.py`` / ``iota-subnet validator``: argument parsing and the process lifecycle."""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from loguru import logger

from iota_subnet.entry.chain import adopt_spec_hash, open_network_chain
from iota_subnet.neuron_common import add_common_args, check_external_ip, run_id_for, setup_process
from iota_subnet.protocol.ticket import WIRE_DTYPES
from iota_subnet.validator.service import ValidatorError, ValidatorOptions, run_validator
from iota_subnet.validator.state import StateError


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="validator", description="IOTA subnet validator: drives micro-batches "
                                     "through the miners, scores verified work, sets weights every tempo")
    add_common_args(p)
    v = p.add_argument_group("validator")
    v.add_argument("--data", default=None, help="data source (default: FineWeb-Edu online, else an offline corpus)")
    v.add_argument("--cache-dir", default=None)
    v.add_argument("--lanes", type=int, default=None, help="drive at most this many lanes")
    v.add_argument("--hop-timeout", type=float, default=30.0, help="seconds a miner has to answer a request for merge evidence")
    v.add_argument("--sync-interval", type=float, default=5.0, help="seconds between metagraph syncs")
    v.add_argument("--min-lanes", type=int, default=1,
                   help="wait (up to 10 minutes) for this many complete lanes before driving")
    v.add_argument("--clasp-interval", type=float, default=5.0,
                   help="seconds between CLASP probe rounds (random pathways, forward only; 0: off)")
    v.add_argument("--clasp-paths", type=int, default=6, help="pathways per CLASP probe round")
    v.add_argument("--score-window", type=int, default=16,
                   help="tempos (with verified work) over which miners' verified work rates are measured")
    v.add_argument("--stale-grace", type=int, default=2,
                   help="tempos without verified work before a miner's score is stale and loses weight")
    v.add_argument("--burn-uid", type=int, default=0,
                   help="uid that receives the weight stale scores lose (0: the subnet owner's; -1: none)")
    v.add_argument("--wire-dtype", choices=WIRE_DTYPES, default="bf16",
                   help="activations and gradients on the wire between miners (int8, fp8: 1 byte a value "
                        "plus a float32 scale per token)")
    v.add_argument("--ticket-lookahead", type=int, default=8, help="lane steps of tickets a head miner holds ahead")
    v.add_argument("--stall", type=float, default=30.0,
                   help="at most this many seconds without progress before a lane step's micro-batches are re-issued "
                        "(less when lane steps are fast: 5 x the mean lane-step time, at least 3 s)")
    v.add_argument("--no-audits", dest="audits", action="store_false",
                   help="do not audit miners' hops and inner steps (nothing but CLASP is then verified)")
    v.add_argument("--audits-per-tempo", type=int, default=1,
                   help="hop audits and update audits of every miner per tempo")
    v.add_argument("--audit-timeout", type=float, default=30.0,
                   help="seconds a miner has to answer each round of an audit (it recomputes a hop: "
                        "independent of --hop-timeout, which only sets how fast dead training hops are routed around)")
    v.add_argument("--exit-when-done", action="store_true",
                   help="exit once the steps, the evaluation and one round of weights are done")
    v.add_argument("--relay-host", action="store_true",
                   help="relay for this run's miners that cannot be dialled (behind a NAT; they start with "
                        "--relay auto): their traffic passes through this validator's port, signed end to end")
    v.add_argument("--relay-rate", type=float, default=None, metavar="BYTES_PER_S",
                   help="with --relay-host: at most this many bytes per second per relayed miner (default: no cap)")
    return p


def options_from(a: argparse.Namespace) -> ValidatorOptions:
    from iota_subnet.config import load_config
    for name, ok, want in (("--lanes", a.lanes is None or a.lanes >= 1, ">= 1"),
                           ("--min-lanes", a.min_lanes >= 1, ">= 1"),
                           ("--hop-timeout", a.hop_timeout > 0, "> 0"),
                           ("--sync-interval", a.sync_interval > 0, "> 0"),
                           ("--clasp-interval", a.clasp_interval >= 0, ">= 0 (0 = off)"),
                           ("--clasp-paths", a.clasp_paths >= 1, ">= 1"),
                           ("--score-window", a.score_window >= 1, ">= 1"),
                           ("--stale-grace", a.stale_grace >= 0, ">= 0"),
                           ("--burn-uid", a.burn_uid >= -1, ">= -1 (-1: none)"),
                           ("--steps", a.steps is None or a.steps >= 1, ">= 1"),
                           ("--ticket-lookahead", a.ticket_lookahead >= 1, ">= 1"),
                           ("--stall", a.stall > 0, "> 0"),
                           ("--audits-per-tempo", a.audits_per_tempo >= 1, ">= 1"),
                           ("--audit-timeout", a.audit_timeout > 0, "> 0"),
                           ("--relay-rate", a.relay_rate is None or a.relay_rate > 0, "> 0")):
        if not ok:
            raise ValidatorError(f"{name} must be {want}")
    steps = a.steps if a.steps is not None else load_config(a.config).train.total_steps
    out = a.out or str(Path("~/.iota-subnet/validators").expanduser() / a.wallet_name)
    return ValidatorOptions.from_flat(wallet_name=a.wallet_name, wallet_hotkey=a.wallet_hotkey, wallet_path=a.wallet_path,
                            network=a.network, chain_db=a.chain_db, netuid=a.netuid, config=a.config, data=a.data,
                            cache_dir=a.cache_dir, steps=steps, out=out, run_id=run_id_for(a), port=a.port,
                            dashboard_port=a.dashboard_port,
                            run_epoch=a.run_epoch, allow_data_fallback=a.allow_data_fallback,
                            chain_timeout_s=a.chain_timeout,
                            n_lanes=a.lanes, hop_timeout_s=a.hop_timeout, sync_interval_s=a.sync_interval,
                            exit_when_done=a.exit_when_done,
                            min_lanes=a.min_lanes,
                            clasp_interval_s=a.clasp_interval, clasp_paths=a.clasp_paths, score_window=a.score_window,
                            stale_grace=a.stale_grace, burn_uid=None if a.burn_uid < 0 else a.burn_uid,
                            relay_host=a.relay_host, relay_rate_bytes_per_s=a.relay_rate,
                            host=a.host, external_ip=check_external_ip(a.network, a.external_ip, a.allow_private_ip),
                            wire_dtype=a.wire_dtype,
                            ticket_lookahead=a.ticket_lookahead, stall_s=a.stall, audits=a.audits,
                            audits_per_tempo=a.audits_per_tempo, audit_timeout_s=a.audit_timeout)


async def _adopt(a: argparse.Namespace) -> None:
    """``--spec-hash``: the run's config, id and epoch from a validator already serving it."""
    chain = await open_network_chain(a.network, a.chain_db, timeout_s=a.chain_timeout)
    try:
        await adopt_spec_hash(a, chain)
    finally:
        await chain.close()


def run_validator_cli(a: argparse.Namespace) -> int:
    setup_process(a, "validator")
    from iota_subnet.errors import known_errors
    try:
        if a.spec_hash:
            asyncio.run(_adopt(a))
        return asyncio.run(run_validator(options_from(a), chain_opener=open_network_chain))
    except (ValidatorError, StateError, *known_errors()) as e:
        logger.error(str(e))
        return 2


def main(argv=None) -> int:
    return run_validator_cli(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
