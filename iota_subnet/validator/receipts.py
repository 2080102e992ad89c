"""Receipt matching and credit: what the control plane (:mod:`.control`) makes of the miners' receipts.

A receipt is accepted only for a ticket this validator issued, for a stage the caller was a candidate
of, once per stage. A training micro-batch is done when the first stage reported its backward; a
forward-only one when the last stage reported the loss. Neighbouring receipts must agree on what was
handed over (sha256 of the wire tensors, who sent to whom); a stage is credited verified work
(:class:`~.scoring.Ledger`) only when its receipt and its neighbours' are in and agree. Miners a stage
could not reach are charged a failure unless they proved they refused the hop (:mod:`.blame`).
"""
from __future__ import annotations

from typing import Any, Optional

from loguru import logger

from iota_subnet.protocol import ReceiptAck, ReceiptBatch
from iota_subnet.protocol.receipt import MAX_RECEIPTS_PER_BATCH, Receipt, parse_receipt

from .control_context import ControlContext
from .flights import Flight


class ReceiptMatcher:
    """Matches receipts to flights and credits verified work. ``blame``: proven refusals
    (:class:`~.blame.BlameBook`): who refused a micro-batch's hop is not unreachable."""

    def __init__(self, ctx: ControlContext, blame: Optional[Any] = None):
        self.ctx, self.blame = ctx, blame

    def on_receipts(self, batch: ReceiptBatch, caller: str) -> ReceiptAck:
        """Handle a miner's receipt batch (``caller``: its hotkey, authenticated). Receipts about tickets
        this validator did not issue, or for a stage the caller did not serve, are ignored."""
        c, book = self.ctx, self.ctx.book
        accepted = 0
        touched: set[int] = set()
        for raw in batch.receipts[:MAX_RECEIPTS_PER_BATCH]:
            r = parse_receipt(raw)
            fl = book.flights.get(r.id) if r is not None else None
            if r is None or fl is None or not 0 <= r.stage < fl.ticket.n_stages \
                    or caller not in fl.ticket.candidates(r.stage) or r.stage in fl.receipts:
                c.counters.receipts_refused += 1
                continue
            accepted += 1
            fl.receipts[r.stage] = r
            fl.servers[r.stage] = caller
            fl.arrived[r.stage] = c.clock()
            if c.opts.on_receipt is not None:
                c.opts.on_receipt(fl.ticket, r, caller)
            touched.add(fl.ticket.lane)
            if r.status == "ok":
                self._note_unreachable(r)
                self._maybe_done(fl)
            elif r.status == "stale":
                fl.stale = True        # the head is past this step: an earlier attempt completed it
            else:
                self._on_failure(fl, r)
        c.counters.receipts_seen += accepted
        for lane in touched:
            book.wake(lane)
        return ReceiptAck(run_id=c.opts.run_id, accepted=accepted)

    def _note_unreachable(self, r: Receipt) -> None:
        """Miners a stage could not reach (it may have used an alternate): cooldown, probe, count. A
        miner that proved it refused the micro-batch's hop (:mod:`.blame`) is not charged."""
        c = self.ctx
        reps = c.by_hotkey()
        excused = self.blame.refusers(r.id) if self.blame is not None else set()
        fl = c.book.flights.get(r.id)
        for hk in r.unreachable:
            rep = reps.get(hk)
            if rep is not None and hk not in excused:
                c.router.record_failure(rep, r.error or f"unreachable from stage {r.stage}")
                c.ledger.fail(rep.uid, rep.hotkey, rep.stage)
                c.counters.failures += 1
                c.hindrances.charged(hk)
                if fl is not None:      # the route's other miners waited on it (a claim until probed)
                    c.hindrances.note(fl.ticket.route, [hk], fl.issued)
                if c.opts.on_hop is not None:
                    c.opts.on_hop(rep.key, False, None)

    def _on_failure(self, fl: Flight, r: Receipt) -> None:
        self._note_unreachable(r)
        self.ctx.book.fail(fl.ticket.microbatch_id, f"stage {r.stage}: {r.status}: {r.error}",
                           unreachable=list(r.unreachable))

    def _maybe_done(self, fl: Flight) -> None:
        """A training micro-batch is done when the first stage reports its backward (the end of the
        chain: every later stage has done its part); evaluation when the last stage reports the loss.
        Stages are credited as their neighbours' receipts arrive (:meth:`_credit`)."""
        t = fl.ticket
        last = t.n_stages - 1
        if not t.train:
            if last in fl.receipts:
                fl.done = True
                if fl.future is not None and not fl.future.done():
                    fl.future.set_result(fl.loss)
            return
        head = fl.receipts.get(0)
        if head is not None and head.status == "ok" and not fl.done:
            fl.done = True
        self._credit(fl)

    def _credit(self, fl: Flight) -> None:
        """Verified work: a stage is credited once its receipt and its neighbours' are in and agree on
        what was handed over (sha256 of the wire tensors, who sent to whom). A stage whose neighbour
        never reports (it died) stays unverified and unpaid for that micro-batch."""
        c = self.ctx
        t, rs = fl.ticket, fl.receipts
        reps = c.by_hotkey()
        for s, r in rs.items():
            if s in fl.credited or r.status != "ok":
                continue
            nbrs = [n for n in (s - 1, s + 1) if 0 <= n < t.n_stages]
            if not all(n in rs for n in nbrs):
                continue
            fl.credited.add(s)
            ok = True
            for a_s in (s - 1, s):
                if a_s < 0 or a_s + 1 >= t.n_stages:
                    continue
                a, b = rs[a_s], rs[a_s + 1]
                if a.fout != b.fin or a.bin != b.bout or a.next != fl.servers[a_s + 1] or b.prev != fl.servers[a_s]:
                    ok = False
                    if a_s == s:      # report each disagreeing pair once
                        c.counters.hash_mismatches += 1
                        logger.warning("micro-batch {}: stages {} and {} disagree on what they exchanged (forward "
                                       "{} / {}, backward {} / {}, {} -> {})", t.microbatch_id, a_s, a_s + 1,
                                       a.fout[:8], b.fin[:8], b.bout[:8], a.bin[:8], a.next[:8], b.prev[:8])
            hk = fl.server_of(s)
            rep = reps.get(hk)
            if rep is None or not ok:
                continue
            c.ledger.forward_ok(rep.uid, rep.hotkey, s)
            c.ledger.credit(rep.uid, rep.hotkey, s, t.tokens)
            c.hindrances.worked(hk, fl.arrived.get(s, c.clock()))
            if c.opts.on_hop is not None:
                # when its own receipt arrived, not now: a neighbour's receipt that completes the credit
                # may come while this miner is partitioned, and read as "it served a hop just then"
                c.opts.on_hop(rep.key, True, fl.arrived.get(s))
            if hk != t.route[s] or (t.trains and not t.trains[s]):
                c.ledger.reroute(rep.uid, rep.hotkey, s)
                c.counters.reroutes += 1
            c.router.record_success(rep, t.tokens, max(r.compute_s, 1e-3))
