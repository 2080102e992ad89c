"""The validator's options, in typed groups (:class:`ValidatorOptions`), and :class:`ValidatorError`.

Each group holds the options of one part of the validator: the chain and wallet (:class:`ChainOptions`),
the run it drives (:class:`RunOptions`), ticketing and lane pacing (:class:`TicketOptions`), audits
(:class:`AuditOptions`), merge evidence (:class:`MergeOptions`), scoring and CLASP
(:class:`ScoringOptions`) and what it serves and writes (:class:`OutputOptions`).
:meth:`ValidatorOptions.from_flat` builds the groups from the flat option names the command line
(:mod:`iota_subnet.entry.validator`) and tests use.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from iota_subnet.version import weights_version_key
from iota_subnet.wallets import WalletError
from iota_subnet.wallets import load_wallet as _load_wallet

#: Version key sent with the weights (from the package version); the chain refuses keys older than
#: the subnet's ``weights_version``, and the validator stops at start when it is older.
WEIGHTS_VERSION_KEY = weights_version_key()


class ValidatorError(RuntimeError):
    """The validator cannot start; the message says how to fix it."""


def load_wallet(name: str, hotkey: str, path: str) -> Any:
    """The wallet's keys; a missing or unreadable one raises :class:`ValidatorError`."""
    try:
        return _load_wallet(name, hotkey, path)
    except WalletError as e:
        raise ValidatorError(str(e)) from e


@dataclass
class ChainOptions:
    """Wallet, chain and the chain rounds (metagraph sync, weights)."""
    wallet_name: str = "default"
    wallet_hotkey: str = "default"
    wallet_path: str = "~/.bittensor/wallets"
    network: str = "devnet"
    chain_db: Optional[str] = None
    netuid: int = 9
    chain_timeout_s: float = 30.0  # deadline of every chain call
    peer_alive_blocks: Optional[int] = None  # liveness window of the other validators (default: 2 tempos + 10)
    sync_interval_s: float = 5.0  # seconds between metagraph syncs
    #: seconds a starting validator waits, syncing, for permit holders without a commitment to publish
    #: one before it splits the lane steps (a validator started beside it publishes within seconds)
    wait_peers_s: float = 15.0
    weights_check_s: float = 2.0  # seconds between checks whether weights are due
    version_key: int = WEIGHTS_VERSION_KEY


@dataclass
class RunOptions:
    """The run this validator drives: config, data, lane steps, lanes."""
    config: str = "configs/tiny.yaml"
    data: Optional[str] = None
    cache_dir: Optional[str] = None
    allow_data_fallback: bool = False  # substitute data / tokenizer when the hub is unreachable
    steps: Optional[int] = 10  # lane steps per lane; None: an open-ended run (until stopped)
    run_id: str = "iota"
    run_epoch: int = 0
    n_lanes: Optional[int] = None  # cap on the lanes driven (default: every complete lane)
    wait_miners_s: float = 600.0
    min_lanes: int = 1  # wait (up to wait_miners_s) for this many complete lanes before driving
    exit_when_done: bool = False


@dataclass
class TicketOptions:
    """Tickets and lane pacing of the control plane."""
    wire_dtype: str = "bf16"  # activations and gradients on the wire (miner to miner): bf16, fp32, int8 or fp8
    ticket_lookahead: int = 8  # lane steps of tickets a head miner holds ahead
    stall_s: float = 30.0  # at most this long without progress before a lane step's micro-batches are re-issued


@dataclass
class AuditOptions:
    """Hop and update audits of every miner."""
    audits: bool = True  # hop and update audits of every miner (off: nothing is verified but CLASP)
    audits_per_tempo: int = 1  # hop audits (and update audits) of each miner per tempo
    audit_interval_s: float = 2.0  # seconds between audit rounds (each audits the miners still due)
    # seconds a miner has to answer each round of an audit (a trace recomputation, not a training hop:
    # independent of hop_timeout_s, which sets how fast a dead training hop is routed around)
    audit_timeout_s: float = 30.0
    # seconds before each re-ask of an audit request whose connection dropped or timed out (a link
    # that blips for a few seconds must not fail an honest miner's audit); () = none
    audit_retry_s: tuple[float, ...] = (5.0, 15.0)


@dataclass
class MergeOptions:
    """Merge evidence the validator collects from the replicas."""
    hop_timeout_s: float = 30.0  # seconds a miner has to answer a request for merge evidence


@dataclass
class ScoringOptions:
    """CLASP probes and the scoreboard."""
    clasp_interval_s: float = 5.0  # seconds between CLASP probe rounds; 0 = off
    clasp_paths: int = 6  # pathways per CLASP round
    clasp_window: int = 600  # most recent probes used for attribution
    clasp_penalty: float = 0.5  # quality factor of a CLASP-flagged miner
    score_window: int = 16  # active tempos over which verified work rates are measured
    stale_grace: int = 2  # tempos without verified work before a score counts as stale and loses weight
    burn_uid: Optional[int] = 0  # where the weight stale scores lost goes (uid 0: the subnet owner's); None: nowhere


@dataclass
class OutputOptions:
    """The state folder, the validator's server, the dashboard and ``status.json``."""
    out: str = "runs/validator"
    port: int = 0  # the validator's server: /receipts (signed) and GET /scores; 0 = any free port
    dashboard_port: Optional[int] = None  # the web dashboard and GET /metrics (None: off; 0: any free port)
    host: str = "0.0.0.0"
    external_ip: str = "127.0.0.1"  # published on chain (ServeAxon) so miners can deliver receipts
    status_interval_s: float = 1.0  # seconds between rewrites of status.json
    relay_host: bool = False  # relay for the run's miners that cannot be dialled (iota_subnet.transport.relay)
    relay_rate_bytes_per_s: Optional[float] = None  # per relayed miner, both directions (None: no cap)


@dataclass
class ValidatorOptions:
    """Every option of a validator, one group per part."""
    chain: ChainOptions = field(default_factory=ChainOptions)
    run: RunOptions = field(default_factory=RunOptions)
    tickets: TicketOptions = field(default_factory=TicketOptions)
    audits: AuditOptions = field(default_factory=AuditOptions)
    merges: MergeOptions = field(default_factory=MergeOptions)
    scoring: ScoringOptions = field(default_factory=ScoringOptions)
    outputs: OutputOptions = field(default_factory=OutputOptions)

    @classmethod
    def from_flat(cls, **flat: Any) -> "ValidatorOptions":
        """The groups from flat option names (``steps=3, audits=False, ...``: each the name of a field
        of one group). Raises :class:`TypeError` on a name no group has."""
        groups = {f.name: f.default_factory() for f in fields(cls)}
        owner = {g.name: name for name, grp in groups.items() for g in fields(grp)}
        for key, value in flat.items():
            if key not in owner:
                raise TypeError(f"ValidatorOptions has no option {key!r}")
            setattr(groups[owner[key]], key, value)
        return cls(**groups)
