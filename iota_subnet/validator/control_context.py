"""What the parts of the validator's control plane (:mod:`.control`) share: its options
(:class:`ControlOptions`), its counters (:class:`ControlCounters`) and its collaborators
(:class:`ControlContext`: run config, router, transport, ledger, hindrances, flights)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from iota_subnet.config import RunConfig
from iota_subnet.model import bottleneck_dims
from iota_subnet.protocol import Ticket
from iota_subnet.protocol.receipt import Receipt
from iota_subnet.protocol.ticket import WIRE_DTYPES

from .flights import FlightBook
from .hindrance import Hindrances
from .routing import Replica, Router
from .scoring import Ledger


@dataclass
class ControlOptions:
    """How a :class:`~.control.ControlPlane` drives its lanes.

    ``run_id``: the run the tickets belong to; ``n_lanes``: lanes driven; ``validator_index`` of
    ``n_validators`` coordinating validators (this one drives lane steps ``k`` with
    ``k % n_validators == validator_index``); ``seed``: the sample seed (None: ``train.seed``);
    ``tag``: prefix of micro-batch ids (empty: random); ``lookahead``: lane steps whose tickets are at
    the head before they are needed; ``ticket_ttl_s``: a ticket's life, seconds (per step ahead);
    ``stall_s`` / ``min_stall_s``: bounds of the stall timeout, seconds (:meth:`.lane_steps.LaneStepper.stall_timeout`);
    ``max_attempts``: attempts per micro-batch and lane step; ``wire_dtype``: of the activations and their gradients between miners (one of
    :data:`~iota_subnet.protocol.ticket.WIRE_DTYPES`: fp32, bf16, int8, fp8);
    ``n_alternates``: other replicas named per stage; ``empty_step_wait_s``: wait before retrying a lane
    step none of whose micro-batches completed; ``turn_timeout_s``: how long the head may wait at
    another validator's step before this one drives it; ``eval_timeout_s``: per evaluation round;
    ``pace_every``: the merge window the lanes are paced by (None: ``merge.every_steps``; 0: no pacing);
    ``pace_stall_s``: seconds without progress after which a lane no longer holds the others back
    (:mod:`.pacing`); ``reissue_backoff_s``: a failed attempt ``a`` is re-issued no earlier than
    ``reissue_backoff_s * 2 ** a`` seconds after it was issued; ``clock``: seconds.

    Observers (the audit scheduler): ``on_receipt(ticket, receipt, reporter's hotkey)`` for every
    accepted receipt, ``on_hop((uid, hotkey), ok, when)`` for every training hop outcome per miner.
    ``on_flag((uid, hotkey), stage, reason)``: a miner proven to have sent bad output was barred
    (:class:`~.blame.BlameBook`'s ``flag``; e.g. the audit policy's flag, weight 0).
    """

    run_id: str
    n_lanes: int
    validator_index: int = 0
    n_validators: int = 1
    seed: Optional[int] = None
    tag: str = ""
    lookahead: int = 8
    ticket_ttl_s: float = 600.0
    stall_s: float = 30.0
    min_stall_s: float = 3.0
    max_attempts: int = 6
    wire_dtype: str = "bf16"
    n_alternates: int = 2
    empty_step_wait_s: float = 1.0
    turn_timeout_s: float = 120.0
    eval_timeout_s: float = 120.0
    pace_every: Optional[int] = None
    pace_stall_s: float = 120.0
    reissue_backoff_s: float = 0.5
    clock: Callable[[], float] = time.time
    on_receipt: Optional[Callable[[Ticket, Receipt, str], None]] = None
    on_hop: Optional[Callable[[tuple[int, str], bool, Optional[float]], None]] = None
    on_flag: Optional[Callable[[tuple[int, str], int, str], None]] = None

    def resolved(self, cfg: RunConfig) -> ControlOptions:
        """A copy with the defaults that depend on ``cfg`` or chance filled in and the numbers coerced
        (at least one validator and one step of lookahead). Raises ValueError for an unknown ``wire_dtype``."""
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype {self.wire_dtype!r} is not one of {WIRE_DTYPES}")
        return replace(self, n_lanes=int(self.n_lanes), validator_index=int(self.validator_index),
                       n_validators=max(1, int(self.n_validators)),
                       seed=cfg.train.seed if self.seed is None else int(self.seed),
                       tag=self.tag or uuid.uuid4().hex[:6], lookahead=max(1, int(self.lookahead)),
                       ticket_ttl_s=float(self.ticket_ttl_s), stall_s=float(self.stall_s),
                       min_stall_s=float(self.min_stall_s), max_attempts=int(self.max_attempts),
                       n_alternates=int(self.n_alternates))


@dataclass
class ControlCounters:
    """Running totals of a control plane: tokens of completed micro-batches, verified hops served by a
    replica other than the ticket's lane member, failures charged to miners, micro-batches completed /
    lost, receipts accepted / refused, neighbouring receipts that disagreed, tickets sent."""

    tokens: int = 0
    reroutes: int = 0
    failures: int = 0
    microbatches_ok: int = 0
    microbatches_failed: int = 0
    receipts_seen: int = 0
    receipts_refused: int = 0
    hash_mismatches: int = 0
    tickets_sent: int = 0


@dataclass
class ControlContext:
    """The collaborators every part of a control plane uses. ``transport``: a
    :class:`~.control_transport.ControlTransport` (tickets, health probes); ``opts`` already :meth:`~ControlOptions.resolved`.
    Derived: ``n_stages``, ``mb`` (rows per micro-batch), ``micro_per_step``, ``width`` (wire
    activation width)."""

    cfg: RunConfig
    opts: ControlOptions
    router: Router
    transport: Any
    ledger: Ledger
    hindrances: Hindrances
    book: FlightBook
    counters: ControlCounters = field(default_factory=ControlCounters)
    n_stages: int = field(init=False)
    mb: int = field(init=False)
    micro_per_step: int = field(init=False)
    width: int = field(init=False)

    def __post_init__(self) -> None:
        self.n_stages = self.cfg.pipeline.stages
        self.mb = self.cfg.train.micro_batch
        self.micro_per_step = self.cfg.train.batch_size // self.mb
        self.width = bottleneck_dims(self.cfg.model, self.cfg.pipeline)[0]

    def clock(self) -> float:
        return self.opts.clock()

    @property
    def mb_tokens(self) -> int:
        """Tokens in one micro-batch."""
        return self.mb * self.cfg.data.seq_len

    def by_hotkey(self) -> dict[str, Replica]:
        """The live replicas by hotkey."""
        return {r.hotkey: r for r in self.router.live_replicas()}
