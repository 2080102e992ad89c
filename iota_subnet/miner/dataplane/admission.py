"""The head's admission of tickets: which micro-batch starts next, under the window and the step flush.

A part of :class:`~iota_subnet.miner.dataplane.plane.DataPlane` (stage 0 only): the head admits the
forwards of its lane step ``k`` only once it has taken inner step ``k - 1`` (a flush per lane
step) and while fewer than ``max_in_flight`` forwards wait for their backward. It also stands in
for other lanes' first-stage miners (:meth:`HeadAdmission._alternate_may_start`) and settles the
forwards of steps its lane completed through another head (:meth:`HeadAdmission._settle_before`).
"""
from __future__ import annotations

import itertools
from typing import Callable, Optional

from loguru import logger

from iota_subnet.protocol import Ticket

from .tracking import Pending, _Task

#: Seconds a stand-in head's forward without its backward holds the lane's later steps (see
#: :meth:`HeadAdmission._alternate_may_start`); after that the backward is taken as lost (a miner down the
#: route died without an abort, or another validator re-issued it elsewhere and has not said so yet).
STAND_IN_HOLD_S = 60.0


class HeadAdmission:
    """Ticket admission at the head (see the module docstring)."""

    def _admit(self) -> Optional[_Task]:
        """Head: the next ticket to start, if the window and the step flush allow one."""
        if not self.tickets:
            return None
        w = self.worker
        in_flight = sum(1 for p in self.pending.values() if p.ticket.train)
        members = sorted(k for k, t in self.tickets.items() if t.train and t.is_member(0, self.me))
        if members and not self._lane_ready(self.tickets[members[0]]):
            members = []            # the lane's weights first (:mod:`.handover`); its tickets wait here
        if members:
            lane, step, _ = members[0]
            if step < w.inner_step and not self.steps.busy(lane, step):
                for k in [k for k in members if k[1] < w.inner_step]:          # stale: already stepped past
                    t = self.tickets.pop(k)
                    self._receipt(t, status="stale", error=f"head already at inner step {w.inner_step}")
                return self._admit()
            base = min(step, self.base_steps.get(lane, 0))
            if base > w.inner_step:
                if self._settle_before(lane, base):
                    return _Task((0,), next(self._seq), "step", self.tickets[members[0]], [])
                if not any(self.steps.busy(lane, s) for s in range(w.inner_step, base)):
                    skipped = w.skip_to(base)      # restarted behind the lane: its validator says < base is done
                    logger.warning(f"stage 0: lane {lane} has completed steps before {base}; this head was at "
                                   f"{base - skipped}: skipped {skipped} inner step(s)")
            if step == w.inner_step and in_flight < self.max_in_flight:
                return self._task_from_ticket(self.tickets.pop(members[0]))
        open_steps: Optional[dict[int, int]] = None
        for k in sorted(k for k, t in self.tickets.items() if not (t.train and t.is_member(0, self.me))):
            t = self.tickets[k]
            if not t.train:
                return self._task_from_ticket(self.tickets.pop(k))
            if in_flight < self.max_in_flight:
                open_steps = self._stand_in_open_steps() if open_steps is None else open_steps
                if self._alternate_may_start(t, open_steps):
                    return self._task_from_ticket(self.tickets.pop(k))
        return None

    def _drop_completed_stand_in(self, lane: int, base: int) -> None:
        """Head standing in for ``lane``'s own first-stage miner: its tickets and forwards of steps the
        validator has seen complete (``< base``) went through another head; drop them (a ``stale``
        receipt for each ticket) so that they neither run again nor hold window slots."""
        for k, t in list(self.tickets.items()):
            if t.train and t.lane == lane and t.step < base and not t.is_member(0, self.me):
                self.tickets.pop(k)
                self._receipt(t, status="stale", error=f"lane {lane} completed steps before {base} elsewhere")
        self._settle_pending(lambda p: p.ticket.train and p.ticket.lane == lane and p.ticket.step < base
                             and not p.accumulate)

    def _settle_pending(self, completed: Callable[[Pending], bool]) -> list[Ticket]:
        """Drop the forwards waiting here for a backward that will not come (their micro-batches
        completed elsewhere): window slots, stored activations, step claims. Returns their tickets."""
        out = []
        for mb, p in list(self.pending.items()):
            if completed(p):
                self.pending.pop(mb, None)
                self.worker.drop(self._key(p.ticket))
                self.steps.release(p.ticket)
                self.counts["settled"] += 1
                out.append(p.ticket)
        return out

    def _stand_in_open_steps(self) -> dict[int, int]:
        """Per lane, the lowest step at or above the validator's base that is still queued here or
        whose forward (started within ``STAND_IN_HOLD_S``) waits for its backward: a stand-in head
        may start no later step of that lane (see :meth:`_alternate_may_start`)."""
        held_since = self.clock() - STAND_IN_HOLD_S
        low: dict[int, int] = {}
        for o, recent in itertools.chain(((o, True) for o in self.tickets.values()),
                                         ((p.ticket, p.started >= held_since) for p in self.pending.values())):
            if o.train and recent and o.step >= self.base_steps.get(o.lane, 0):
                low[o.lane] = min(low.get(o.lane, o.step), o.step)
        return low

    def _alternate_may_start(self, t: Ticket, open_steps: dict[int, int]) -> bool:
        """Head standing in for a lane's own first-stage miner (it does not train on ``t``, the lane
        members of later stages do): start lane step ``k`` only once this head's forwards of the
        lane's earlier steps have come back, as the lane's own head does (a flush per lane step).
        Steps the validator has seen complete (``base_steps``) do not hold it. Without this a stand-in
        head would run every look-ahead ticket at once: the later stages' lane members would receive
        step k + 4 while step k is in flight, skip their inner steps to it and lose the micro-batches
        of the steps between."""
        return t.step <= self.base_steps.get(t.lane, 0) or t.step <= open_steps.get(t.lane, t.step)

    def _settle_before(self, lane: int, base: int) -> bool:
        """Head, behind its lane: the lane's validator has seen every step before ``base`` complete. It
        counts a micro-batch done on the head's receipt, which a head sends after its backward, so the
        forwards this head still holds for those steps are attempts completed through another head
        (a reroute after a failure here): their backward will not come, and waiting for it stalled the
        lane until the tickets' deadline. They are dropped (window slots, stored activations). What
        this head did accumulate of its current inner step, micro-batches counted done through it,
        is applied rather than thrown away: returns True when that partial inner step is due (the
        caller runs it; the next admission skips the rest of the way to ``base``)."""
        w = self.worker
        for o in self._settle_pending(lambda p: p.ticket.train and p.ticket.lane == lane and p.ticket.step < base):
            logger.info(f"stage 0: lane {lane} step {o.step} completed through another head; dropped "
                        f"{o.microbatch_id} (its backward will not come here)")
        done = self.steps.done.get((lane, w.inner_step))
        if done and not self.steps.claims.get((lane, w.inner_step)):
            logger.warning(f"stage 0: lane {lane} has completed steps before {base}; this head accumulated "
                           f"{len(done)} of step {w.inner_step}'s micro-batches (the rest went through other "
                           f"heads): applying them as its inner step {w.inner_step}")
            return True
        return False

    def _task_from_ticket(self, t: Ticket) -> _Task:
        return _Task((1, t.step, t.index, t.attempt), next(self._seq), "forward", t, [], received=self.clock())
