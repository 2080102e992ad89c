"""Blame for output nobody can use: the miner that sent it answers for it, not the one that refused it.

A hop refused for a fault its bytes prove (:data:`~iota_subnet.protocol.refusal.PROVABLE`) reaches
this validator as a :class:`~iota_subnet.protocol.refusal.RefusalReport` from the receiver. The
report is judged (:func:`judge`) on its own evidence:

1. the sender's btauth/1 signature binds the body, the receiver (the reporter) and the path
   ``/hop``: what the sender sent, and to whom. A relay or a forger cannot make a report that
   verifies, so no miner is charged for bytes it did not sign;
2. the hop's ticket was signed by this validator, the reporter serves the hop's stage on it and the
   sender the stage before (forward) or after (backward);
3. the body is decoded and checked again here, as the receiver does: finiteness (tensors and JSON
   numbers, e.g. a tail's loss), shape and dtype against the ticket, and the data against the root
   the sender committed (``info["root"]``). Only when this finds a provable fault is it ``proven``.

A proven refusal (:meth:`BlameBook.on_report`) charges the sender a failure (ledger, routing
cooldown), fails the micro-batch's attempt with the sender to be routed around (the control plane
re-issues it through another replica of the stage or an alternate), and excuses the reporter from
any "unreachable" charge for that micro-batch. A miner whose receipt batch this validator refused
for non-finite numbers is charged the same way (:meth:`BlameBook.charge`): the validator saw that
itself. ``bar_after`` charges flag the miner as a cheater (weight 0) and bar it from routing
(:meth:`~.routing.Router.bar`). Reports that do not hold charge nobody (``unproven``).
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any, Callable, Optional

import torch
from bittensor import http_auth
from loguru import logger

from iota_subnet.audit.commit import wire_root
from iota_subnet.protocol import Hop, ProtocolError, Ticket, TicketError, decode, hop_contract
from iota_subnet.protocol.outcome import Outcome
from iota_subnet.protocol.refusal import PROVABLE, RefusalReport, hop_header
from iota_subnet.protocol.wire import WIRE_TORCH_DTYPES

Key = tuple[int, str]

#: micro-batches whose refusers are remembered (excused from "unreachable" charges)
REMEMBER = 4096


class _AnyNonce:
    """Nonce store for judging evidence: the receiver already refused replays when it took the hop."""

    def check_and_store(self, hotkey_ss58: str, nonce_ns: int) -> bool:
        return True


def judge(report: RefusalReport, reporter: str, validator: str) -> tuple[str, str, Optional[Ticket], str]:
    """(verdict, sender, ticket, detail) of ``report`` from ``reporter`` to ``validator`` (hotkeys).
    ``verdict``: ``proven`` (the sender's signed hop has the fault), ``unproven``, or ``unknown``
    (not a hop of this validator's tickets)."""
    body_t = report.body
    if body_t is None or body_t.dtype != torch.uint8 or body_t.dim() != 1 or report.path != "/hop":
        return "unproven", "", None, "not a hop body"
    body = body_t.numpy().tobytes()
    try:
        nonce = int(report.auth.get(http_auth.HEADER_NONCE, ""))
        caller = http_auth.verify(report.auth, body, method="POST", path=report.path, self_hotkey_ss58=reporter,
                                  nonce_store=_AnyNonce(), now_ns=nonce)
    except (ValueError, http_auth.AuthError) as e:
        return "unproven", "", None, f"the sender's signature does not bind this body to the reporter: {e}"
    sender = caller.hotkey_ss58
    meta = hop_header(body)
    if meta is None:
        return "unproven", sender, None, "unreadable hop header"
    try:
        t = Ticket.from_json(meta["ticket"])
        if t.validator != validator:
            return "unknown", sender, t, "not this validator's ticket"
        t.verify_signature()
    except TicketError as e:
        return "unproven", sender, None, f"ticket: {e}"
    stage, direction = meta.get("stage"), meta.get("direction")
    nbr = stage - 1 if direction == "forward" else stage + 1 if direction == "backward" else None
    if type(stage) is not int or nbr is None or not 0 <= nbr < t.n_stages or reporter not in t.candidates(stage) \
            or sender not in t.candidates(nbr):
        return "unproven", sender, t, "the sender and reporter do not hold these stages on the ticket"
    try:
        fault = _content_fault(decode(body, Hop, hop_contract(seq_len=t.seq_len, width=t.width, max_batch=t.rows)), t)
    except ProtocolError as e:
        fault = e
    if fault is None or fault.outcome not in PROVABLE:
        return "unproven", sender, t, f"the hop holds no provable fault ({fault.outcome.value if fault else 'none'})"
    return "proven", sender, t, f"{direction} hop of stage {nbr}: {fault.outcome.value}: {fault.message[:160]}"


def _content_fault(msg: Hop, t: Ticket) -> Optional[ProtocolError]:
    """What the receiver checks of a decoded hop's data against its ticket (shape, dtype, committed root)."""
    if msg.data is None:
        return ProtocolError(Outcome.MALFORMED, "no data")
    want = (t.rows, t.seq_len, t.width)
    if tuple(msg.data.shape) != want:
        return ProtocolError(Outcome.BAD_SHAPE, f"data {list(msg.data.shape)}; the ticket says {list(want)}")
    if msg.data.dtype != WIRE_TORCH_DTYPES.get(t.wire_dtype):
        return ProtocolError(Outcome.BAD_DTYPE, f"data is {msg.data.dtype}; the ticket says {t.wire_dtype}")
    claimed = msg.info.get("root")
    if claimed is not None:
        root = wire_root(msg.data if msg.scales is None else (msg.data, msg.scales)).hex()
        if claimed != root:
            return ProtocolError(Outcome.HASH_MISMATCH, "data does not match the root its sender committed")
    return None


class BlameBook:
    """Proven refusals and the charges they bring (see the module docstring).

    ``plane``: the :class:`~.control.ControlPlane` (router, ledger, flights, counters); ``flag(key, stage,
    reason)``: marks a miner as a cheater for the weights (e.g. the audit policy's flag);
    ``bar_after``: charges after which the miner is flagged and barred."""

    def __init__(self, plane: Any, flag: Optional[Callable[[Key, int, str], None]] = None, bar_after: int = 2):
        self.plane, self.flag, self.bar_after = plane, flag, max(1, int(bar_after))
        self.charges: Counter[Key] = Counter()
        self.verdicts: Counter[str] = Counter()
        self._refusers: "OrderedDict[str, set[str]]" = OrderedDict()

    def refusers(self, microbatch_id: str) -> set[str]:
        """Miners that proved they refused a hop of ``microbatch_id``: not unreachable, excused."""
        return self._refusers.get(microbatch_id, set())

    def on_report(self, report: RefusalReport, reporter: str) -> str:
        """Judge ``report`` from ``reporter`` (authenticated hotkey); charge the sender when proven.
        Returns the verdict."""
        verdict, sender, t, detail = judge(report, reporter, self.plane.hotkey)
        self.verdicts[verdict] += 1
        if verdict != "proven" or t is None:
            logger.log("INFO" if verdict == "unknown" else "WARNING", "refusal report by {} against {}: {} ({})",
                       reporter[:10], sender[:10] or "?", verdict, detail)
            return verdict
        self._refusers.setdefault(t.microbatch_id, set()).add(reporter)
        while len(self._refusers) > REMEMBER:
            self._refusers.popitem(last=False)
        self.charge(sender, f"{reporter[:10]} proved it refused its output: {detail}", t.microbatch_id)
        return verdict

    def charge(self, hotkey: str, why: str, microbatch_id: str = "") -> Optional[Key]:
        """Charge the miner ``hotkey`` a failure for output it is proven to have sent; fail the attempt
        ``microbatch_id`` (if any) so that it is re-issued around that miner. Returns its key."""
        p = self.plane
        rep = next((r for r in p.router.live_replicas() if r.hotkey == hotkey), None)
        fl = p.flights.get(microbatch_id) if microbatch_id else None
        if fl is not None:      # the route's other miners lost the attempt to this miner's output
            p.hindrances.note(fl.ticket.route, [hotkey], fl.issued, proven=True)
        p.hindrances.charged(hotkey)
        if microbatch_id:
            p.book.fail(microbatch_id, f"output of {hotkey[:10]} refused: {why}"[:300], unreachable=[hotkey])
        if rep is None:
            return None
        p.ledger.fail(rep.uid, rep.hotkey, rep.stage)
        p.router.record_failure(rep, why[:200])
        p.failures += 1
        self.charges[rep.key] += 1
        logger.warning("uid {} ({}) charged: {}", rep.uid, hotkey[:10], why[:300])
        if self.charges[rep.key] >= self.bar_after and rep.key not in p.router.barred:
            reason = f"{self.charges[rep.key]} proven refusals of its output, last: {why[:160]}"
            p.router.bar([rep.key])
            if self.flag is not None:      # flagged for the weights; a spare takes its lane seat
                self.flag(rep.key, rep.stage, reason)
            n = p.book.fail_through(hotkey, f"route through {hotkey[:10]}, barred: {reason[:160]}")
            logger.warning("uid {} ({}) is barred: {}; {} micro-batch(es) in flight through it re-issued", rep.uid,
                           hotkey[:10], reason, n)
        return rep.key

    def on_refused_receipts(self, caller: str, headers: Any, path: str, body: bytes, err: ProtocolError) -> None:
        """Transport hook of ``/receipts``: a batch this validator refused for non-finite numbers (a
        tail's NaN loss) is the signing miner's own fault."""
        if err.outcome == Outcome.NON_FINITE:
            self.charge(caller, f"receipts with non-finite numbers: {err.message[:120]}")

    def status(self) -> dict:
        return {"verdicts": dict(self.verdicts), "charges": {f"{u}|{h[:10]}": n for (u, h), n in self.charges.items()}}
