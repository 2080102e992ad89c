"""Checks of ``iota-subnet localnet``'s arguments, and what they turn into (config, neuron arguments).

Both raise :class:`~iota_subnet.config.ConfigError` for arguments that do not fit together.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import yaml
from loguru import logger

from iota_subnet.config import ConfigError, RunConfig, load_config, load_yaml
from iota_subnet.protocol.ticket import WIRE_DTYPES


def localnet_config(config: str, overrides: Optional[dict], *, stages: Optional[int], replicas: int, validators: int,
                    steps: int, adversary: Optional[str]) -> RunConfig:
    """The run's config: ``config`` (a YAML path) with ``overrides`` (``{section: {key: value}}``),
    ``--stages`` (None: the config's own ``pipeline.stages``) and ``--steps`` applied; ``--adversary
    poison`` turns merges on (every 5 inner steps) when the config has none. Raises ConfigError for
    counts below 1, a ``--stages`` other than the stage count of a ``pipeline.layer_split`` the config
    (or an override) fixes, an unknown adversary kind, or ``poison`` with fewer than 3 replicas."""
    if (stages is not None and stages < 1) or replicas < 1 or validators < 1:
        raise ConfigError("--stages, --replicas and --validators must each be >= 1")
    ovr = {k: dict(v) for k, v in (overrides or {}).items()}
    if stages is not None:
        split = fixed_layer_split(config, ovr)
        if split is not None and len(split) != stages:
            raise ConfigError(f"--stages {stages} conflicts with pipeline.layer_split {list(split)} of {config} "
                              f"({len(split)} stages): leave --stages out (the config's stage count), pass "
                              f"--stages {len(split)}, or --set pipeline.layer_split=[...] with {stages} counts")
        ovr.setdefault("pipeline", {})["stages"] = stages
    ovr.setdefault("train", {})["total_steps"] = steps
    cfg = load_config(config, ovr)
    if adversary is not None:
        adversary_positions(adversary, cfg.pipeline.stages, replicas)      # the kinds and where they go
        if adversary == "poison" and replicas < 3:
            raise ConfigError("--adversary poison needs --replicas 3 or more: a poisoning reducer is penalised "
                              "when two other replicas of its stage prove it wrong (with two replicas either "
                              "one could be lying)")
    if adversary == "poison" and not cfg.merge.enabled:
        # merge-shard poisoning needs merges: every 5 inner steps unless the config says otherwise
        ovr.setdefault("merge", {})["every_steps"] = 5
        cfg = load_config(config, ovr)
        logger.info("--adversary poison: merging every 5 inner steps (merge.every_steps)")
    return cfg


def adversary_positions(adversary: Optional[str], stages: int, replicas: int) -> dict[tuple[int, int], str]:
    """Where ``--adversary KIND[,KIND...]`` puts each kind: ``(stage, replica) -> kind``. A cheater
    (:data:`~iota_subnet.sim.adversary.ADVERSARY_KINDS`) is the middle stage's last replica; a
    ``bad-*`` kind the first replica of stage 0 (a head whose forwards go bad); ``nan-loss`` the
    second replica of the last stage (a tail in another lane, colluding with a ``bad-*`` head).
    Raises ConfigError for an unknown kind or two kinds on one miner."""
    from iota_subnet.sim.adversary import ALL_KINDS
    out: dict[tuple[int, int], str] = {}
    for kind in (k.strip() for k in (adversary or "").split(",") if k.strip()):
        if kind not in ALL_KINDS:
            raise ConfigError(f"unknown --adversary {kind!r}; one of {', '.join(ALL_KINDS)}")
        if kind.startswith("bad-"):
            pos = (0, 0)
        elif kind == "nan-loss":
            pos = (stages - 1, min(1, replicas - 1))
        else:
            pos = (stages // 2, replicas - 1)
        if pos in out:
            raise ConfigError(f"--adversary {adversary!r}: {out[pos]} and {kind} would be the same miner "
                              f"(stage {pos[0]}, replica {pos[1]})")
        out[pos] = kind
    return out


def fixed_layer_split(config: str, overrides: dict) -> Optional[list]:
    """The ``pipeline.layer_split`` that ``overrides`` or the YAML file ``config`` itself gives (one
    layer count per stage), None when neither does (a split balanced or derived when the config is
    loaded is not fixed). A file that cannot be read or parsed gives None: :func:`load_config` then
    reports it."""
    if "layer_split" in (overrides.get("pipeline") or {}):
        split = overrides["pipeline"]["layer_split"]
    else:
        try:
            raw = load_yaml(Path(config).read_text())
        except (OSError, yaml.YAMLError):
            return None
        pipeline = raw.get("pipeline") if isinstance(raw, dict) else None
        split = pipeline.get("layer_split") if isinstance(pipeline, dict) else None
    return list(split) if isinstance(split, (list, tuple)) else None


def wire_dtype_argv(wire_dtype: Optional[str]) -> list[str]:
    """``--wire-dtype`` for every validator of the localnet (the dtype its tickets ask miners to send
    activations and their gradients in, :mod:`iota_subnet.protocol.wire`); None: no flag, the
    validator's own default. Raises ConfigError for a dtype not in ``WIRE_DTYPES``."""
    if wire_dtype is None:
        return []
    if wire_dtype not in WIRE_DTYPES:
        raise ConfigError(f"--wire-dtype {wire_dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
    return ["--wire-dtype", wire_dtype]


def checked_link(flag: str, text: Optional[str]) -> str:
    """``text`` (a ``--link`` spec: ``RATE:DELAY``, ``UP/DOWN:DELAY`` or ``loopback``, see
    :func:`~iota_subnet.transport.shaping.parse_link`) in its canonical form (``20mbit/100mbit:100ms``).
    Raises ConfigError naming ``flag`` (e.g. ``--validator-link``) for a malformed spec."""
    from iota_subnet.transport.shaping import parse_link
    try:
        return str(parse_link(text))
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(flag + msg[len("--link"):] if msg.startswith("--link") else f"{flag}: {msg}") from None


def role_links(link: str, validator_link: Optional[str] = None, relay_link: Optional[str] = None, *,
               relays: int = 0, home_replicas: int = 0) -> dict[str, str]:
    """Each role's emulated link: ``{"miner": ..., "validator": ..., "relay": ...}`` (canonical specs).
    ``--link`` is every role's default; ``--validator-link`` replaces it for the validators (and so for the
    relay they host with ``--home-replicas``), ``--relay-link`` for the standalone relays (``--relays K``).
    Raises ConfigError for a malformed spec (naming its flag), or ``--relay-link`` without ``--relays``
    (the validators relay then: give their link with ``--validator-link``)."""
    default = checked_link("--link", link)
    out = {"miner": default,
           "validator": default if validator_link is None else checked_link("--validator-link", validator_link),
           "relay": default if relay_link is None else checked_link("--relay-link", relay_link)}
    if relay_link is not None and not relays:
        hint = ("the validators relay for the home miners: give their link with --validator-link"
                if home_replicas else "add --home-replicas N --relays K")
        raise ConfigError(f"--relay-link needs standalone relays (--relays K): {hint}")
    return out


def relay_rate_argv(relay_rate: Optional[float], *, relays: int, home_replicas: int,
                    time_scale: float) -> tuple[list[str], list[str]]:
    """``--relay-rate`` (emulated bytes per second per relayed miner, both directions; None: no cap) as
    (validator argv, standalone relay argv): ``--relay-rate`` for validators that host the relay
    (``--home-replicas`` without ``--relays``), ``--rate`` for standalone relays; divided by ``time_scale``
    as the links are (emulated time = wall time / time_scale). Raises ConfigError for a cap <= 0 or one
    with no home miners to relay."""
    if relay_rate is None:
        return [], []
    if not (relay_rate > 0 and math.isfinite(relay_rate)):
        raise ConfigError(f"--relay-rate {relay_rate!r} must be > 0 (bytes per second per relayed miner)")
    if not home_replicas:
        raise ConfigError("--relay-rate needs --home-replicas: nobody is relayed")
    wall = repr(float(relay_rate) / float(time_scale))
    return ([], ["--rate", wall]) if relays else (["--relay-rate", wall], [])


def emulation_argv(link: str, emulate_gpu: Optional[str], mfu: Optional[float], gpu_mem: Optional[float],
                   time_scale: float, *, validator_link: Optional[str] = None
                   ) -> tuple[str, Optional[dict], list[str], list[str]]:
    """Check ``--link`` / ``--emulate-gpu`` / ``--mfu`` / ``--gpu-mem`` / ``--time-scale`` (ConfigError) and
    turn them into (link, emulation summary or None, miner argv, validator argv). ``validator_link``:
    the validators' own link (None: ``link``; see :func:`role_links`). Emulated miners hold no
    weights, so the validator's replays and CLASP probes are turned off with them."""
    from iota_subnet.hardware import DEFAULT_MFU
    from iota_subnet.sim.emulated import emulation_from_args
    spec = checked_link("--link", link)
    v_spec = spec if validator_link is None else checked_link("--validator-link", validator_link)
    emu = emulation_from_args(emulate_gpu, DEFAULT_MFU if mfu is None else mfu, time_scale, gpu_mem)
    if emu is None and (mfu is not None or gpu_mem is not None):
        raise ConfigError("--mfu and --gpu-mem describe an emulated GPU: add --emulate-gpu")
    if not time_scale > 0:
        raise ConfigError(f"--time-scale {time_scale!r} must be > 0")
    miner = ["--link", spec, "--time-scale", repr(float(time_scale))]
    validator = ["--link", v_spec, "--time-scale", repr(float(time_scale))]
    if emu is not None:
        miner += ["--emulate-gpu", str(emulate_gpu), "--mfu", repr(emu.mfu)]
        if gpu_mem is not None:
            miner += ["--gpu-mem", repr(float(gpu_mem))]
        validator += ["--clasp-interval", "0", "--no-audits"]
    return spec, (emu.to_json() if emu is not None else None), miner, validator


def devnet_block_time(block_time: float, time_scale: float, emulated: bool) -> float:
    """The devnet's wall seconds per block for ``--block-time`` (seconds per block; emulated seconds in
    an emulated run) and ``--time-scale``: with ``emulated`` (``--emulate-gpu``) ``block_time x
    time_scale``, so a tempo is a tempo of emulated time (compute, links and chain all run
    ``time_scale`` times slower on the wall clock); else ``block_time`` (real compute runs at wall
    speed, so the chain does too). Raises ConfigError for a block time or time scale <= 0."""
    if not (block_time > 0 and math.isfinite(block_time)):
        raise ConfigError(f"--block-time {block_time!r} must be > 0 (seconds per block)")
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ConfigError(f"--time-scale {time_scale!r} must be > 0")
    return float(block_time) * float(time_scale) if emulated else float(block_time)
