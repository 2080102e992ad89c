"""What a :class:`~iota_subnet.miner.service.MinerService` is told to do: its run, where it serves, where
its data comes from, and how it trains, checkpoints and keeps audit copies.

:class:`MinerOptions` holds the run's identity and the miner's own settings, with two groups:
:class:`ServeOptions` (the HTTP server and the address published on chain) and :class:`DataOptions`
(where the first and last stages read token rows). Every default is the production one; the entry
point (``neurons/miner.py``) fills them from its flags.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from iota_subnet.miner.hop_store import DEFAULT_KEEP_VERSIONS
from iota_subnet.protocol.commitment import Fingerprints


@dataclass(frozen=True)
class ServeOptions:
    """The miner's HTTP server. ``host``: the interface it binds; ``port``: its port (0: the port this
    hotkey already serves on chain, else any free one); ``external_ip``: the address published on chain
    (``serve_axon``); ``dashboard_port``: the read-only web dashboard (None: off; 0: any free port);
    ``relays``: reached through these relays instead of being dialled (``--relay``, see
    :mod:`iota_subnet.miner.relaying`; empty: dialled at ``external_ip:port``)."""

    host: str = "0.0.0.0"
    port: int = 0
    external_ip: str = "127.0.0.1"
    dashboard_port: Optional[int] = None
    relays: tuple[str, ...] = ()


@dataclass(frozen=True)
class DataOptions:
    """Where the head and the tail read token rows (:mod:`iota_subnet.miner.dataplane`). ``source``: the
    data set (``--data``; None: the config's); ``cache_dir``: the tokenizer and data cache;
    ``allow_fallback``: substitute data / tokenizer when the hub is unreachable (localnet, or asked
    for); ``dataset``: a TokenDataset to use instead of building one from ``source``."""

    source: Optional[str] = None
    cache_dir: Optional[str] = None
    allow_fallback: bool = False
    dataset: Any = None


@dataclass(frozen=True)
class MinerOptions:
    """One miner's settings.

    ``netuid``, ``run_id``, ``run_epoch``: the subnet and the run it trains. ``out_dir``: checkpoint,
    nonce store, status. ``stage``: the stage to hold, or None to take the stage with the fewest
    replicas of this run. ``fingerprints``: the tokenizer and data fingerprints when this miner loads
    the run's data; then it refuses to join a run whose validators advertise others. ``device``: where
    the stage computes. ``total_steps``: inner steps of the learning-rate schedule (None: the
    config's). ``checkpoint_every``: inner steps between checkpoints. ``metagraph_refresh_s``: seconds
    between re-reads of the metagraph and commitments. ``register``: register an unregistered hotkey
    (burns TAO), at most at ``max_burn_tao``. ``max_in_flight``: micro-batches the first stage keeps
    waiting for their backward (None: one lane step's worth). ``hop_timeout_s``: seconds a hop to
    another miner may take. ``audit_window``: weights versions (and their hops) kept for hop audits
    and inner steps kept for update audits; 0: off (validators then count every audit of this miner
    as refused).
    """

    netuid: int
    run_id: str
    out_dir: str | Path
    stage: Optional[int] = None
    run_epoch: int = 0
    fingerprints: Optional[Fingerprints] = None
    device: str = "cpu"
    total_steps: Optional[int] = None
    checkpoint_every: int = 10
    metagraph_refresh_s: float = 5.0
    register: bool = False
    max_burn_tao: Optional[float] = None
    max_in_flight: Optional[int] = None
    hop_timeout_s: float = 30.0
    audit_window: int = DEFAULT_KEEP_VERSIONS
    serve: ServeOptions = field(default_factory=ServeOptions)
    data: DataOptions = field(default_factory=DataOptions)
