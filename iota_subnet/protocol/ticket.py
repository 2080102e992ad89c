"""Tickets: a validator's signed order for one micro-batch to travel miner to miner.

A validator (control plane) decides where each micro-batch goes; the tensors then flow between
miners directly (data plane) and never through the validator. The order is a :class:`Ticket`,
signed by the validator's hotkey (sr25519) over :meth:`Ticket.canonical`, and carried with every
hop of that micro-batch, so any miner on the route can check, without asking anyone, that

* a validator of this subnet issued it (signature + the validator's permit on the metagraph);
* it is for this run, has not expired, and names this miner for this stage (or as an alternate);
* the hop comes from the miner the ticket names for the neighbouring stage;
* the tensors have the shapes the ticket (and the run config) say.

Sample address: the head reads token ids ``[rows, seq_len]`` and the tail targets from their own
copy of the data by ``(split, seed, start, rows)`` (:meth:`iota_subnet.data.TokenDataset.batch`):
no token ids travel.

Wire form: a plain JSON object (:meth:`Ticket.to_json`); about 0.5-1 kB with three stages.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

from .wire import WIRE_TORCH_DTYPES

#: Ticket format version; a miner refuses other versions.
TICKET_VERSION = 1
#: Barred miners a ticket names at most (``Ticket.not_from``).
MAX_NOT_FROM = 32
#: Wire dtypes a ticket may ask for (see :mod:`.wire`).
WIRE_DTYPES = tuple(WIRE_TORCH_DTYPES)   # fp32, bf16, int8, fp8
SPLITS = ("train", "val")


class TicketError(ValueError):
    """A ticket is malformed, forged, expired or not for this miner; ``outcome`` names which."""

    def __init__(self, outcome: str, message: str):
        super().__init__(message)
        self.outcome = outcome


@dataclass(frozen=True)
class Ticket:
    """One micro-batch's route and sample address. Units: ``deadline``/``issued_at`` unix seconds,
    ``seq_len`` tokens, ``width`` floats per token on the wire (the bottleneck width b).

    ``step`` is the lane step (the inner step every lane member accumulates this micro-batch
    into; -1 for evaluation and probes, ``train`` False); ``index`` the micro-batch within the
    step (0 <= index < ``micro_per_step``); ``attempt`` counts re-issues of the same
    ``(lane, step, index)``: every stage accumulates each ``(lane, step, index)`` at most once.
    ``route[s]`` is the hotkey of the miner that serves stage ``s``; ``trains[s]`` whether it is the
    lane's own miner of that stage and accumulates this micro-batch (False when the validator routes
    around an unavailable lane member); ``alternates[s]`` may take the hop when ``route[s]`` fails
    (they never train on it). ``not_from``: miners the validator barred as cheaters (at most
    :data:`MAX_NOT_FROM`): a replica handed this lane does not take the lane's weights from them
    (:mod:`iota_subnet.miner.lane_handover`); left out of the signed body when empty.
    """

    run_id: str
    validator: str
    lane: int
    step: int
    index: int
    microbatch_id: str
    split: str
    seed: int
    start: int
    rows: int
    seq_len: int
    width: int
    wire_dtype: str
    train: bool
    micro_per_step: int
    route: tuple[str, ...]
    alternates: tuple[tuple[str, ...], ...] = ()
    trains: tuple[bool, ...] = ()
    attempt: int = 0
    issued_at: float = 0.0
    deadline: float = 0.0
    not_from: tuple[str, ...] = ()
    v: int = TICKET_VERSION
    signature: str = field(default="", compare=False)

    # ---- encoding --------------------------------------------------------------------------
    def body(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("signature")
        d["route"] = list(self.route)
        d["alternates"] = [list(a) for a in self.alternates]
        d["trains"] = list(self.trains)
        if self.not_from:
            d["not_from"] = list(self.not_from)
        else:
            d.pop("not_from")
        return d

    def canonical(self) -> bytes:
        """The bytes the signature covers: sorted-key compact JSON of every field but the signature."""
        return json.dumps(self.body(), sort_keys=True, separators=(",", ":")).encode()

    def to_json(self) -> dict[str, Any]:
        d = self.body()
        d["signature"] = self.signature
        return d

    @staticmethod
    def from_json(d: Any) -> "Ticket":
        """Parse and type-check; raises :class:`TicketError` (``MALFORMED``) on anything unexpected."""
        if not isinstance(d, dict):
            raise TicketError("MALFORMED", "a ticket is a JSON object")
        want = {f for f in Ticket.__dataclass_fields__}
        if set(d) | {"not_from"} != want:
            missing, extra = sorted(want - set(d)), sorted(set(d) - want)
            raise TicketError("MALFORMED", f"ticket fields differ: missing {missing}, unexpected {extra}")
        ints = ("lane", "step", "index", "seed", "start", "rows", "seq_len", "width", "micro_per_step", "attempt", "v")
        for k in ints:
            if type(d[k]) is not int:
                raise TicketError("MALFORMED", f"ticket.{k} must be an integer, got {d[k]!r}")
        for k in ("issued_at", "deadline"):
            if type(d[k]) not in (int, float) or not math.isfinite(d[k]):
                raise TicketError("MALFORMED", f"ticket.{k} must be a finite number of seconds")
        for k in ("run_id", "validator", "microbatch_id", "split", "wire_dtype", "signature"):
            if not isinstance(d[k], str) or len(d[k]) > 256:
                raise TicketError("MALFORMED", f"ticket.{k} must be a short string")
        if type(d["train"]) is not bool:
            raise TicketError("MALFORMED", "ticket.train must be true or false")
        route, alts = d["route"], d["alternates"]
        if not isinstance(route, list) or not route or not all(isinstance(h, str) and 0 < len(h) <= 64 for h in route):
            raise TicketError("MALFORMED", "ticket.route must be a non-empty list of hotkeys")
        if (not isinstance(alts, list) or len(alts) not in (0, len(route))
                or not all(isinstance(a, list) and len(a) <= 16 and all(isinstance(h, str) and 0 < len(h) <= 64
                                                                        for h in a) for a in alts)):
            raise TicketError("MALFORMED", "ticket.alternates must be one list of hotkeys per stage")
        trains = d["trains"]
        if not isinstance(trains, list) or len(trains) not in (0, len(route)) or not all(type(b) is bool for b in trains):
            raise TicketError("MALFORMED", "ticket.trains must be one true/false per stage")
        not_from = d.get("not_from", [])
        if (not isinstance(not_from, list) or len(not_from) > MAX_NOT_FROM
                or not all(isinstance(h, str) and 0 < len(h) <= 64 for h in not_from)):
            raise TicketError("MALFORMED", f"ticket.not_from must be a list of at most {MAX_NOT_FROM} hotkeys")
        t = Ticket(**{**d, "route": tuple(route), "alternates": tuple(tuple(a) for a in alts),
                      "not_from": tuple(not_from),
                      "trains": tuple(trains), "issued_at": float(d["issued_at"]), "deadline": float(d["deadline"])})
        t.check_shape_fields()
        return t

    def check_shape_fields(self) -> None:
        if self.v != TICKET_VERSION:
            raise TicketError("MALFORMED", f"ticket version {self.v}, this node reads {TICKET_VERSION}")
        if self.split not in SPLITS:
            raise TicketError("MALFORMED", f"ticket.split {self.split!r} not one of {SPLITS}")
        if self.wire_dtype not in WIRE_DTYPES:
            raise TicketError("MALFORMED", f"ticket.wire_dtype {self.wire_dtype!r} not one of {WIRE_DTYPES}")
        if self.rows < 1 or self.seq_len < 1 or self.width < 1 or self.micro_per_step < 1:
            raise TicketError("MALFORMED", "ticket rows, seq_len, width and micro_per_step must be >= 1")
        if self.start < 0 or self.lane < 0 or self.attempt < 0 or self.step < -1:
            raise TicketError("MALFORMED", "ticket start, lane, attempt must be >= 0 and step >= -1")
        if self.train and not (self.step >= 0 and 0 <= self.index < self.micro_per_step and self.split == "train"):
            raise TicketError("MALFORMED", "a training ticket needs step >= 0, 0 <= index < micro_per_step, split train")

    # ---- signing ---------------------------------------------------------------------------
    def signed(self, keypair: Any) -> "Ticket":
        """This ticket signed by ``keypair`` (a hotkey ``Keypair`` or a ``bittensor.Wallet``)."""
        kp = getattr(keypair, "hotkey", keypair)
        if kp.ss58_address != self.validator:
            raise ValueError("a ticket is signed by the validator it names")
        return replace(self, signature=kp.sign(self.canonical()).hex())

    def verify_signature(self) -> None:
        """Raises :class:`TicketError` (``BAD_TICKET``) unless the validator named signed this ticket."""
        from bittensor.sp_core import Keypair
        try:
            sig = bytes.fromhex(self.signature)
            ok = len(sig) == 64 and Keypair(ss58_address=self.validator).verify(self.canonical(), sig)
        except (ValueError, TypeError, Exception):  # noqa: BLE001 - a bad address or signature is a forgery
            ok = False
        if not ok:
            raise TicketError("BAD_TICKET", f"ticket {self.microbatch_id} is not signed by {self.validator[:10]}")

    # ---- route ----------------------------------------------------------------------------
    @property
    def n_stages(self) -> int:
        return len(self.route)

    def candidates(self, stage: int) -> tuple[str, ...]:
        """Who may serve ``stage``: the route's miner first, then the alternates."""
        alts = self.alternates[stage] if self.alternates else ()
        return (self.route[stage],) + tuple(h for h in alts if h != self.route[stage])

    def is_member(self, stage: int, hotkey: str) -> bool:
        """True when ``hotkey`` is the lane's own miner of ``stage`` on this route (it trains on this
        micro-batch)."""
        return self.route[stage] == hotkey and (not self.trains or self.trains[stage])

    def expired(self, now: Optional[float] = None) -> bool:
        return (time.time() if now is None else now) > self.deadline

    @property
    def key(self) -> tuple[int, int, int]:
        """``(lane, step, index)``: what a stage accumulates at most once."""
        return (self.lane, self.step, self.index)

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len
