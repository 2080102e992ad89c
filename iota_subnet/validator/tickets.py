"""Ticket issue: the control plane's (:mod:`.control`) routes, signed tickets and their delivery to the
lanes' head miners.

A micro-batch's route is its lane's miner of every stage (another replica, by the router's choice,
where that one is unavailable or to be avoided), with up to ``n_alternates`` other replicas per stage
by measured throughput. Tickets go to the route's head (stage 0) in one ``/tickets`` request per head
(about 0.7 kB each); ``base_steps`` tell the head which earlier lane steps are complete.
"""
from __future__ import annotations

import uuid
from typing import Any, Optional

from loguru import logger

from iota_subnet.protocol import ProtocolError, Ticket, TicketBatch
from iota_subnet.protocol.ticket import MAX_NOT_FROM
from iota_subnet.transport import TransportError

from .control_context import ControlContext
from .lanes import sample_start

#: (route hotkeys per stage, whether each is the lane's own member, alternates per stage)
Route = tuple[list[str], list[bool], list[list[str]]]


class TicketIssuer:
    """Signs tickets with ``keypair`` (a wallet or its hotkey) and delivers them. Keeps, per lane, the
    lane steps whose tickets were issued and the step being followed now."""

    def __init__(self, ctx: ControlContext, keypair: Any):
        self.ctx = ctx
        self.keypair = getattr(keypair, "hotkey", keypair)
        self.hotkey: str = self.keypair.ss58_address
        #: per lane, the step being followed now (tickets tell heads that earlier steps are complete)
        self.lane_step: dict[int, int] = {}
        #: per lane, the steps whose tickets were issued
        self.issued_steps: dict[int, set[int]] = {}

    # ---------------------------------------------------------------- routes
    def _alternates(self, stage: int, exclude: set[str]) -> list[str]:
        router = self.ctx.router
        cands = [r for r in router.replicas.get(stage, []) if r.hotkey not in exclude and router.is_available(r)]
        cands.sort(key=lambda r: -router.throughput(r))
        return [r.hotkey for r in cands[:self.ctx.opts.n_alternates]]

    def route(self, lane: int, avoid: set[str] = frozenset()) -> Optional[Route]:
        """(route, trains, alternates) for a micro-batch of ``lane``, or None when a stage has nobody."""
        router = self.ctx.router
        route, trains, alts = [], [], []
        for s in range(self.ctx.n_stages):
            member = router.lane_member(lane, s)
            ok = member is not None and member.hotkey not in avoid and router.is_available(member)
            r = member if ok else router.choose(s, exclude=[x.key for x in router.replicas.get(s, [])
                                                            if x.hotkey in avoid])
            if r is None:
                return None
            route.append(r.hotkey)
            trains.append(bool(ok))
            alts.append(self._alternates(s, {r.hotkey, *avoid}))
        return route, trains, alts

    def ticket(self, lane: int, step: int, index: int, *, start: int, split: str, train: bool, attempt: int = 0,
               route: Optional[Route] = None, ahead: int = 0) -> Ticket:
        """A signed ticket; ``ahead``: lane steps before this one that are still to train (a ticket
        issued ``ahead`` steps early lives ``ticket_ttl_s`` longer per step, so the lookahead never
        issues tickets that expire in the head's queue on slow pipelines)."""
        c, o = self.ctx, self.ctx.opts
        route = route or self.route(lane)
        now = c.clock()
        mb_id = f"{o.tag}-l{lane}-k{step}-m{index}-a{attempt}-{uuid.uuid4().hex[:6]}"
        t = Ticket(run_id=o.run_id, validator=self.hotkey, lane=lane, step=step, index=index, microbatch_id=mb_id,
                   split=split, seed=o.seed, start=start, rows=c.mb, seq_len=c.cfg.data.seq_len,
                   width=c.width, wire_dtype=o.wire_dtype, train=train, micro_per_step=c.micro_per_step,
                   route=tuple(route[0]), trains=tuple(route[1]), alternates=tuple(tuple(a) for a in route[2]),
                   attempt=attempt, issued_at=now, deadline=now + o.ticket_ttl_s * (1 + max(0, ahead)),
                   not_from=tuple(sorted(h for _, h in c.router.barred))[:MAX_NOT_FROM] if train else ())
        return t.signed(self.keypair)

    # ---------------------------------------------------------------- delivery
    async def deliver(self, tickets: list[Ticket]) -> int:
        """Send tickets to their head miners (grouped). Returns how many were accepted."""
        c, book = self.ctx, self.ctx.book
        by_head: dict[str, list[Ticket]] = {}
        for t in tickets:
            by_head.setdefault(t.route[0], []).append(t)
        accepted = 0
        reps = c.by_hotkey()
        for head, ts in by_head.items():
            r = reps.get(head)
            if r is None:
                for t in ts:
                    book.fail(t.microbatch_id, f"head {head[:10]} is gone")
                continue
            for t in ts:
                book.open(t)
            try:
                base = {str(l): max(0, k - c.opts.n_validators + 1) for l, k in self.lane_step.items()
                        if any(t.lane == l for t in ts)}
                ack = await c.transport.send_tickets(r.hotkey, TicketBatch(
                    run_id=c.opts.run_id, stage=0, tickets=[t.to_json() for t in ts], base_steps=base))
            except (ProtocolError, TransportError) as e:
                c.router.record_failure(r, f"{type(e).__name__}: {e}")
                c.ledger.fail(r.uid, r.hotkey, 0)
                c.counters.failures += 1
                c.hindrances.charged(r.hotkey)
                for t in ts:
                    c.hindrances.note(t.route, [r.hotkey], book.flights[t.microbatch_id].issued, proven=True)
                if c.opts.on_hop is not None:
                    c.opts.on_hop(r.key, False, None)
                logger.warning("tickets to head {} failed: {}", r.short(), e)
                for t in ts:
                    book.fail(t.microbatch_id, f"tickets refused by {r.short()}: {e}", unreachable=[r.hotkey])
                continue
            c.counters.tickets_sent += len(ts)
            accepted += ack.accepted
            for ref in ack.refused:
                book.fail(str(ref.get("microbatch_id", "")), f"head refused: {ref.get('outcome')} "
                                                             f"{ref.get('message', '')}")
        return accepted

    async def issue_step(self, lane: int, step: int, ahead: int = 0) -> bool:
        """Tickets for every micro-batch of lane step ``step`` (once), ``ahead`` steps before it is the
        lane's current one. False when no route exists now."""
        c = self.ctx
        issued = self.issued_steps.setdefault(lane, set())
        if step in issued:
            return True
        route = self.route(lane)
        if route is None:
            return False
        tickets = [self.ticket(lane, step, m, start=self.sample_start(lane, step, m), split="train", train=True,
                               route=route, attempt=c.book.n_attempts(lane, step, m), ahead=ahead)
                   for m in range(c.micro_per_step)]
        issued.add(step)
        await self.deliver(tickets)
        return True

    def unmark(self, lane: int, step: int) -> None:
        """Lane step ``step`` is to be issued afresh (none of its micro-batches completed)."""
        self.issued_steps.get(lane, set()).discard(step)

    def sample_start(self, lane: int, step: int, m: int) -> int:
        """The first row of micro-batch ``m`` of lane step ``step`` (:func:`.lanes.sample_start`)."""
        c = self.ctx
        return sample_start(lane, step, m, c.opts.n_lanes, c.cfg.train.batch_size, c.mb)
