"""Subcommands ``localnet``, ``miner`` and ``validator`` of ``iota-subnet``."""
from __future__ import annotations

import argparse
import json
import sys

from iota_subnet.config_presets import config_path
from iota_subnet.protocol.ticket import WIRE_DTYPES


def parse_sets(items: list[str]) -> dict:
    """``["merge.every_steps=10", ...]`` -> ``{"merge": {"every_steps": 10}}`` (values parsed as YAML).
    Raises ConfigError for an item that is not ``SECTION.KEY=VALUE``."""
    import yaml

    from iota_subnet.config import ConfigError, load_yaml
    out: dict = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not section or not name:
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. merge.every_steps=10")
        try:
            v = load_yaml(value)
            out.setdefault(section, {})[name] = v
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: value is not valid YAML: {e}") from None
    return out


def _cmd_localnet(a: argparse.Namespace) -> int:
    from iota_subnet.network.localnet import run_localnet
    summary = run_localnet(overrides=parse_sets(a.set), stages=a.stages, replicas=a.replicas, validators=a.validators, config=a.config, data=a.data,
                           steps=a.steps, out=a.out, block_time=a.block_time, tempo=a.tempo,
                           restart_dead=not a.no_restart, device=a.device,
                           timeout_s=a.timeout, adversary=a.adversary, chaos=a.chaos,
                           chaos_duration_s=a.chaos_duration, link=a.link, emulate_gpu=a.emulate_gpu,
                           mfu=a.mfu, gpu_mem=a.gpu_mem, time_scale=a.time_scale, wire_dtype=a.wire_dtype,
                           home_replicas=a.home_replicas, relays=a.relays, relay_fault=a.relay_fault,
                           spares=a.spares, validator_link=a.validator_link, relay_link=a.relay_link,
                           relay_rate=a.relay_rate, join_at=a.join_at)
    short = {k: v for k, v in summary.items() if k not in ("miners", "validators_detail")}
    print(json.dumps(short, indent=2))
    print(f"per-miner results in {a.out}/summary.json; chain: iota-subnet chain metagraph --chain-db {summary['chain_db']} --netuid 9")
    if summary["ended"] == "stopped":
        print(f"stopped early, at step {summary['steps_done']} of {summary['steps']}: the figures above cover only that part")
    elif summary["ended"] == "weights late":
        print("trained every step, but the weights and incentive did not land on chain in time: the chain figures "
              "may be missing")
    return 0


def _cmd_miner(a: argparse.Namespace) -> int:
    import asyncio

    from iota_subnet.entry.miner import run_miner
    from iota_subnet.neuron_common import setup_process
    setup_process(a, "miner")
    return asyncio.run(run_miner(a))


def _cmd_scores(a: argparse.Namespace) -> int:
    from iota_subnet.validator import explain
    try:
        d = explain.load(a.validator_state)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.uid is not None:
        d = {**d, "miners": [m for m in d.get("miners", []) if m["uid"] == a.uid]}
        if not d["miners"]:
            print(f"error: no miner with uid {a.uid} in these scores", file=sys.stderr)
            return 2
    print(json.dumps(d, indent=2) if a.json else explain.format_table(d))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    sc = sub.add_parser("scores", help="explain a validator's scores: per miner work, audits, CLASP, weight, why")
    sc.add_argument("--validator-state", required=True,
                    help="the validator's output folder or its validator.sqlite")
    sc.add_argument("--uid", type=int, default=None, help="only this miner")
    sc.add_argument("--json", action="store_true", help="JSON instead of a table")
    sc.set_defaults(func=_cmd_scores)

    p = sub.add_parser("localnet", help="run a whole subnet (devnet chain, miners, validators) on this machine")
    p.add_argument("--stages", type=int, default=None,
                   help="pipeline stages (default: the config's pipeline.stages, 3 in configs/tiny.yaml); must "
                        "match a pipeline.layer_split the config fixes")
    p.add_argument("--replicas", type=int, default=2, help="miners per stage")
    p.add_argument("--validators", type=int, default=1)
    p.add_argument("--config", default="configs/tiny.yaml", type=config_path,
                   help="YAML run config (configs/<file> is found in the repository from any folder)")
    p.add_argument("--data", default=None, help="text source (default: FineWeb-Edu online, else an offline corpus)")
    p.add_argument("--steps", type=int, default=150, help="inner optimizer steps per miner")
    p.add_argument("--out", default="runs/localnet")
    p.add_argument("--block-time", type=float, default=1.0, help="devnet seconds per block")
    p.add_argument("--tempo", type=int, default=20, help="blocks per epoch (weights and emission)")
    p.add_argument("--no-restart", action="store_true", help="do not restart miners that die")
    p.add_argument("--device", default=None)
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set merge.every_steps=10 "
                        "--set merge.quantization=int8")
    p.add_argument("--adversary", default=None, metavar="KIND",
                   help="one replica of the middle stage cheats this way (random, zero, lazy, replay, copy, stale, "
                        "claim, noisy-update, precision, dodge; poison (turns merging on) and accuse need merging "
                        "and 3 or more replicas); or the output of a stage-0 miner goes bad from lane step 5 on "
                        "(bad-inf, bad-nan, bad-shape, bad-dtype, bad-hash), or a tail reports NaN losses (nan-loss); with a "
                        "transformers model, family cheats: drop-bias (Qwen2), skip-qk-norm (Qwen3), full-attention "
                        "(a sliding window); "
                        "several kinds: comma separated, e.g. bad-inf,nan-loss; summary.json lists adversary_uids "
                        "and each miner's weight")
    p.add_argument("--spares", type=int, default=0, metavar="N",
                   help="validators drive --replicas minus N lanes: N replicas of every stage wait as spares, "
                        "handed a lane whose member departs or is barred")
    p.add_argument("--chaos", default=None, metavar="SPEC",
                   help="inject faults on a seeded schedule, e.g. kill=2/min,pause=1/min,join=0.5/min,seed=7,min_live=2 "
                        "(kinds: kill, pause, leave, join, partition, slow, validator-kill; rates per minute, or /s; "
                        "seed defaults to 0; a miner fault hits only a stage with more than min_live live replicas, "
                        "default 1); every event and recovery goes to OUT/chaos.jsonl and the summary")
    p.add_argument("--chaos-duration", type=float, default=None,
                   help="seconds of run time the chaos schedule covers, from the end of start-up (default 3600; "
                        "faults stop when training ends)")
    p.add_argument("--join-at", default=None, metavar="STEP[:STAGE]",
                   help="one fresh miner registers and starts on STAGE (default 0) when the lanes reach inner step "
                        "STEP; summary.json's joiner says when it joined, when it was in sync, its sync seconds "
                        "(wall and emulated) and bytes")
    p.add_argument("--link", default="loopback", metavar="RATE:DELAY",
                   help="emulate this uplink for every neuron (token bucket + one-way delay), e.g. 100mbit:50ms, "
                        "or UP/DOWN:DELAY (20mbit/100mbit:100ms) to shape the downlink too; --validator-link and "
                        "--relay-link replace it for those roles")
    p.add_argument("--validator-link", default=None, metavar="RATE:DELAY",
                   help="the validators' link instead of --link (so also the relay they host with --home-replicas), "
                        "e.g. 1gbit:10ms; summary.json lists every role's under links")
    p.add_argument("--relay-link", default=None, metavar="RATE:DELAY",
                   help="with --relays: the standalone relays' link instead of --link, e.g. 1gbit:10ms")
    p.add_argument("--emulate-gpu", default=None, metavar="GPU",
                   help="EMULATION: miners emulate a100 | h100 | h200 | 4090 | a FLOP/s figure (no training; see iota-subnet "
                        "miner --help)")
    p.add_argument("--mfu", type=float, default=None, help="MFU of the emulated GPU (default 0.5)")
    p.add_argument("--gpu-mem", type=float, default=None, help="memory of the emulated GPU in GiB")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="run emulated links and compute this many times slower (host CPU headroom)")
    p.add_argument("--relays", type=int, default=0, metavar="K",
                   help="with --home-replicas: K standalone relays (iota-subnet relay) the home miners attach to, "
                        "all of them at once, instead of the validators")
    p.add_argument("--relay-fault", default=None, choices=["drop", "drop30", "alter", "replay"],
                   help="relay 0 misbehaves so (testing: the home miners' callers must go around it)")
    p.add_argument("--relay-rate", type=float, default=None, metavar="BYTES_PER_S",
                   help="with --home-replicas: cap every relayed miner at this many (emulated) bytes per second, "
                        "both directions, on the validators' relay (--relay-rate) or the standalone relays' "
                        "(--rate); default: no cap")
    p.add_argument("--home-replicas", type=int, default=0, metavar="N",
                   help="the last N replicas of every stage are home miners: reached only through relays "
                        "(--relay auto), which every validator hosts (--relay-host)")
    p.add_argument("--wire-dtype", choices=WIRE_DTYPES, default=None,
                   help="activations and gradients on the wire between miners, given to every validator "
                        "(default: the validator's, bf16); summary.json reports the one used")
    p.set_defaults(func=_cmd_localnet)

    from iota_subnet.entry.miner import build_parser as miner_parser
    m = sub.add_parser("miner", help="run a miner (same options as neurons/miner.py)")
    miner_parser(m)
    m.set_defaults(func=_cmd_miner)
    try:
        from iota_subnet.entry.validator import build_parser as validator_parser, run_validator_cli
    except ImportError:
        return
    v = sub.add_parser("validator", help="run a validator (same options as neurons/validator.py)")
    validator_parser(v)
    v.set_defaults(func=run_validator_cli)
