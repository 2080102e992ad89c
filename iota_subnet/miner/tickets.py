"""What a miner checks on every ticket before it does any work for it (see
:mod:`iota_subnet.protocol.ticket`). Every refusal is a typed :class:`ProtocolError`:

==================== ==================================================================================
``MALFORMED``        not a ticket (missing or ill-typed fields)
``FORBIDDEN``        another run
``BAD_SHAPE``        rows, sequence length, width or micro-batches per step that do not match this run
``NOT_ON_ROUTE``     the ticket does not name this miner for its stage, or the hop's sender is not the miner
                     the ticket names for the neighbouring stage (or the ticket's validator, for tickets)
``TICKET_EXPIRED``   past its deadline
``BAD_TICKET``       not signed by the validator it names, a validator without a permit, or a route naming
                     hotkeys that are not registered
==================== ==================================================================================

Cheap checks run first; the signature (about 40 us) last, once per ticket (cached by signature).
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from iota_subnet.protocol import Outcome, ProtocolError, Ticket, TicketError

_OUTCOMES = {"MALFORMED": Outcome.MALFORMED, "BAD_TICKET": Outcome.BAD_TICKET}


@dataclass(frozen=True)
class TicketShape:
    """What every ticket of this run must match: ``run_id``; ``n_stages`` on its route; ``seq_len``
    (tokens per row), ``width`` (the bottleneck width of the hops' activations) and ``micro_per_step``
    (micro-batches per inner step); at most ``max_rows`` rows per micro-batch."""

    run_id: str
    n_stages: int
    seq_len: int
    width: int
    micro_per_step: int
    max_rows: int

    @classmethod
    def of_run(cls, cfg: Any, *, run_id: str, width: int, max_rows: int) -> "TicketShape":
        """The shape of run ``run_id`` whose config is ``cfg`` (``pipeline.stages``, ``data.seq_len``,
        ``train.batch_size // train.micro_batch`` micro-batches per step)."""
        return cls(run_id=run_id, n_stages=cfg.pipeline.stages, seq_len=cfg.data.seq_len, width=width,
                   micro_per_step=cfg.train.batch_size // cfg.train.micro_batch, max_rows=max_rows)


class TicketChecker:
    """Checks tickets against ``shape`` (:class:`TicketShape`) for this miner (hotkey ``me``) at
    ``stage``. ``neurons()``: hotkey -> metagraph neuron (``validator_permit``) as this miner sees it
    now; ``clock``: unix time in seconds; ``cache_size``: verified signatures remembered."""

    def __init__(self, shape: TicketShape, *, stage: int, me: str, neurons: Callable[[], Mapping[str, Any]],
                 clock: Callable[[], float] = time.time, cache_size: int = 8192):
        self.run_id, self.stage, self.n_stages = shape.run_id, int(stage), int(shape.n_stages)
        self.seq_len, self.width, self.micro_per_step = shape.seq_len, shape.width, shape.micro_per_step
        self.max_rows = shape.max_rows
        self.me, self.neurons, self.clock = me, neurons, clock
        self._verified: "OrderedDict[tuple[str, str], None]" = OrderedDict()
        self._cache_size = cache_size

    def parse(self, raw: Any) -> Ticket:
        try:
            return Ticket.from_json(raw)
        except TicketError as e:
            raise ProtocolError(_OUTCOMES.get(e.outcome, Outcome.MALFORMED), str(e)) from None

    def check(self, raw: Any, *, sender: str, direction: str) -> Ticket:
        """The ticket of a ``/tickets`` entry (``direction="ticket"``) or of a hop (``forward``,
        ``backward``, ``abort``) received from ``sender``, checked for this miner's stage."""
        t = self.parse(raw)
        if t.run_id != self.run_id:
            raise ProtocolError(Outcome.FORBIDDEN, f"ticket for run {t.run_id!r}; this miner trains {self.run_id!r}")
        if t.n_stages != self.n_stages:
            raise ProtocolError(Outcome.BAD_SHAPE, f"ticket route has {t.n_stages} stages; this run has {self.n_stages}")
        if t.seq_len != self.seq_len or t.width != self.width or t.micro_per_step != self.micro_per_step:
            raise ProtocolError(Outcome.BAD_SHAPE,
                                f"ticket shape (seq {t.seq_len}, width {t.width}, {t.micro_per_step} per step) differs "
                                f"from this run's (seq {self.seq_len}, width {self.width}, {self.micro_per_step} per step)")
        if t.rows > self.max_rows:
            raise ProtocolError(Outcome.BAD_SHAPE, f"ticket asks for {t.rows} rows; at most {self.max_rows}")
        s = self.stage
        if self.me not in t.candidates(s):
            raise ProtocolError(Outcome.NOT_ON_ROUTE, f"ticket {t.microbatch_id} does not name this miner for stage {s}")
        if direction == "ticket":
            if s != 0:
                raise ProtocolError(Outcome.NOT_ON_ROUTE, "tickets go to the first stage's miner")
            if sender != t.validator:
                raise ProtocolError(Outcome.NOT_ON_ROUTE, "tickets are delivered by the validator that signed them")
        elif direction == "forward":
            if s == 0 or sender not in t.candidates(s - 1):
                raise ProtocolError(Outcome.NOT_ON_ROUTE,
                                    f"a forward hop to stage {s} comes from the ticket's stage {s - 1} miner")
        elif direction in ("backward", "abort"):
            if s == self.n_stages - 1 or sender not in t.candidates(s + 1):
                raise ProtocolError(Outcome.NOT_ON_ROUTE,
                                    f"a {direction} hop to stage {s} comes from the ticket's stage {s + 1} miner")
        else:
            raise ProtocolError(Outcome.MALFORMED, f"unknown hop direction {direction!r}")
        if t.expired(self.clock()):
            raise ProtocolError(Outcome.TICKET_EXPIRED, f"ticket {t.microbatch_id} expired "
                                                        f"{self.clock() - t.deadline:.1f} s ago")
        # a signature is remembered with the bytes it signs: a copy of a good ticket's signature over
        # other fields is checked (and refused) like any other
        key = (t.signature, hashlib.sha256(t.canonical()).hexdigest())
        if key not in self._verified:
            neurons = self.neurons()
            v = neurons.get(t.validator)
            if v is None or not bool(getattr(v, "validator_permit", False)):
                raise ProtocolError(Outcome.BAD_TICKET, f"ticket issuer {t.validator[:10]} is not a validator with a permit")
            unknown = [h for h in {*t.route, *(h for a in t.alternates for h in a)} if h not in neurons]
            if unknown:
                raise ProtocolError(Outcome.BAD_TICKET, f"ticket route names unregistered hotkeys {[h[:10] for h in unknown]}")
            try:
                t.verify_signature()
            except TicketError as e:
                raise ProtocolError(Outcome.BAD_TICKET, str(e)) from None
            self._verified[key] = None
            while len(self._verified) > self._cache_size:
                self._verified.popitem(last=False)
        return t
