"""``iota-subnet``: the command-line entry point. Each subcommand lives in the module that owns it;
this file only parses arguments and turns known errors into one clear line and exit code 2."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loguru import logger

from iota_subnet.config_presets import config_path
from iota_subnet.utils.logs import log_to_stderr


def _cmd_train_colocated(a: argparse.Namespace) -> int:
    from iota_subnet.train.colocated import train_colocated
    summary = train_colocated(a.config, a.data, a.steps, a.out, seed=a.seed, device=a.device,
                              cache_dir=Path(a.cache_dir) if a.cache_dir else None,
                              allow_data_fallback=a.allow_data_fallback)
    print(json.dumps(summary, indent=2))
    return 0


def _cmd_plan(a: argparse.Namespace) -> int:
    from iota_subnet import plan
    from iota_subnet.config import load_config
    from iota_subnet.hardware import GIB, parse_accelerator
    cfg = load_config(a.config)
    mem = parse_accelerator(a.gpu, a.gpu_mem).memory_bytes if a.gpu else int((a.gpu_mem or 80) * GIB)
    ckpt = {"config": None, "on": True, "off": False, "auto": None}[a.checkpointing]
    plans = plan.plan(cfg, mem, stages=a.stages, checkpointing=ckpt, auto_checkpointing=a.checkpointing == "auto",
                      in_flight=a.in_flight, reserve_bytes=int(a.reserve * GIB))
    if a.json:
        print(plan.plans_json(plans))
    else:
        print(plan.format_table(plans))
        print(plan.summary_note(plans))
    return 0 if all(p.fits for p in plans) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="iota-subnet", description="Pipeline-parallel LLM pretraining on a Bittensor subnet")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train-colocated", help="train the whole staged model in one process (the reference run)")
    t.add_argument("--config", default="configs/tiny.yaml", type=config_path, help="YAML run config or a model name (tiny, small, ...)")
    t.add_argument("--data", default=None, help="text source: .txt/.jsonl/.parquet file or folder, hf://dataset[/subset]; "
                                                "default: FineWeb-Edu when the hub is reachable (else refused, unless --allow-data-fallback)")
    t.add_argument("--steps", type=int, default=150, help="optimizer steps (each batch_size x seq_len tokens)")
    t.add_argument("--out", default="runs/colocated", help="output folder (metrics.jsonl, summary.json, checkpoint)")
    t.add_argument("--seed", type=int, default=None)
    t.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    t.add_argument("--cache-dir", default=None, help="tokenizer and token cache (default $IOTA_CACHE or ~/.cache/iota-subnet)")
    t.add_argument("--allow-data-fallback", action="store_true",
                   help="without --data and without the Hugging Face hub, train on the Python standard library's source")
    t.set_defaults(func=_cmd_train_colocated)

    pl = sub.add_parser("plan", help="memory and compute plan per stage on a GPU (computed on the meta device); "
                                     "exit code 1 when a stage does not fit")
    pl.add_argument("--config", required=True, type=config_path, help="YAML run config, e.g. configs/8b.yaml")
    pl.add_argument("--stages", type=int, default=None,
                    help="number of stages (default: the config's; another count gets a compute-balanced split)")
    pl.add_argument("--gpu-mem", type=float, default=None, help="device memory in GiB (default 80, or --gpu's)")
    pl.add_argument("--gpu", default=None, help="a100 | h100 | h200 | 4090: take the memory from this device")
    pl.add_argument("--checkpointing", choices=["config", "on", "off", "auto"], default="config",
                    help="per-block activation checkpointing: as the config says (train.activation_checkpointing), "
                         "on, off, or auto (per stage: only where the stage does not fit without)")
    pl.add_argument("--in-flight", type=int, default=None,
                    help="micro-batches a non-tail stage must hold to fit (default: 1F1B's stages - stage index)")
    pl.add_argument("--reserve", type=float, default=2.0,
                    help="GiB kept for the CUDA context, library workspaces and fragmentation (default 2)")
    pl.add_argument("--json", action="store_true", help="a JSON array, one object per stage")
    pl.set_defaults(func=_cmd_plan)

    for register in _EXTRA_COMMANDS:
        register(sub)
    return p


#: Subcommand registrars contributed by other modules (network, chain, scores).
_EXTRA_COMMANDS: list = []


def _load_extra_commands() -> None:
    import importlib
    for mod in ("iota_subnet.chain_cli", "iota_subnet.network.cli", "iota_subnet.hf.cli", "iota_subnet.doctor",
                "iota_subnet.entry.relay"):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and mod.startswith(e.name):
                continue
            raise
        if m.register not in _EXTRA_COMMANDS:   # main() may run more than once in a process (tests)
            _EXTRA_COMMANDS.append(m.register)


def main(argv=None) -> int:
    _load_extra_commands()
    args = build_parser().parse_args(argv)
    log_to_stderr("INFO")
    from iota_subnet.errors import known_errors
    known = known_errors()
    try:
        return int(args.func(args) or 0)
    except known as e:
        logger.error(str(e))
        return 2
    except KeyboardInterrupt:
        logger.warning("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
