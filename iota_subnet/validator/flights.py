"""Flights: the tickets the control plane (:mod:`.control`) issued and what the miners reported about them.

A *flight* is one issued ticket (one attempt at one micro-batch) with the receipts of the stages
that served it. :class:`FlightBook` keeps them by micro-batch id, the attempts of every training
micro-batch ``(lane, step, index)`` oldest first, and one wake-up event per lane (set when a
receipt or a failure touches the lane).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable, Optional

from iota_subnet.protocol import Ticket
from iota_subnet.protocol.receipt import Receipt


@dataclass
class Flight:
    """One issued ticket and what the miners reported about it."""

    ticket: Ticket
    issued: float
    receipts: dict[int, Receipt] = field(default_factory=dict)
    servers: dict[int, str] = field(default_factory=dict)      # stage -> hotkey that reported it
    arrived: dict[int, float] = field(default_factory=dict)    # stage -> when its receipt arrived (clock)
    failed: bool = False
    errors: list[str] = field(default_factory=list)
    unreachable: set[str] = field(default_factory=set)
    stale: bool = False
    done: bool = False
    credited: set[int] = field(default_factory=set)     # stages credited
    future: Optional[asyncio.Future] = None      # evaluation / probe: resolves to the loss

    @property
    def loss(self) -> Optional[float]:
        """The tail's loss, or the one it sent back with its gradient (in the first stage's receipt)."""
        for s in (self.ticket.n_stages - 1, 0):
            r = self.receipts.get(s)
            if r is not None and r.loss is not None:
                return r.loss
        return None

    def server_of(self, stage: int) -> str:
        """Who served ``stage``: the hotkey that reported it (the route's miner when none did)."""
        return self.servers.get(stage, self.ticket.route[stage])


class FlightBook:
    """Flights by micro-batch id; ``(lane, step, index)`` -> its attempts' ids, oldest first (training
    tickets only); one :class:`asyncio.Event` per lane, set when a receipt or failure touches it.
    ``clock``: seconds (the control plane's clock)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.flights: dict[str, Flight] = {}
        self.attempts: dict[tuple[int, int, int], list[str]] = {}
        self.events: dict[int, asyncio.Event] = {}

    def open(self, t: Ticket) -> Flight:
        """Record ``t`` as issued now; forward-only tickets get a future (resolves to the loss, or None
        when the flight failed). Needs a running event loop."""
        fl = Flight(t, self.clock(), future=None if t.train else asyncio.get_running_loop().create_future())
        self.flights[t.microbatch_id] = fl
        if t.train:
            self.attempts.setdefault(t.key, []).append(t.microbatch_id)
        return fl

    def n_attempts(self, lane: int, step: int, m: int) -> int:
        """Attempts issued so far for micro-batch ``m`` of lane step ``step`` (kept ones)."""
        return len(self.attempts.get((lane, step, m), []))

    def of(self, lane: int, step: int, m: int) -> list[Flight]:
        """The flights of micro-batch ``m`` of lane step ``step``, oldest first."""
        return [self.flights[i] for i in self.attempts.get((lane, step, m), []) if i in self.flights]

    def index_state(self, lane: int, step: int, m: int) -> str:
        """``done`` (some attempt completed), ``failed`` (the latest failed: re-issue), ``running``, or
        ``waiting`` (only stale attempts: an earlier one's receipts are still on their way)."""
        fls = self.of(lane, step, m)
        if any(f.done for f in fls):
            return "done"
        if not fls:
            return "failed"
        latest = fls[-1]
        if latest.stale:
            return "waiting"
        return "failed" if latest.failed else "running"

    def event(self, lane: int) -> asyncio.Event:
        """The wake-up event of ``lane`` (created on first use)."""
        return self.events.setdefault(lane, asyncio.Event())

    def wake(self, lane: int) -> None:
        """Set ``lane``'s wake-up event, if anyone follows the lane."""
        ev = self.events.get(lane)
        if ev is not None:
            ev.set()

    def fail(self, mb_id: str, error: str, unreachable: Optional[list[str]] = None) -> None:
        """Mark flight ``mb_id`` failed (``error`` kept, first 300 characters; ``unreachable``: hotkeys
        its re-issue routes around). No effect on an unknown or completed flight."""
        fl = self.flights.get(mb_id)
        if fl is None or fl.done:
            return
        fl.failed = True
        fl.errors.append(error[:300])
        fl.unreachable.update(unreachable or ())
        if fl.future is not None and not fl.future.done():
            fl.future.set_result(None)
        self.wake(fl.ticket.lane)

    def fail_through(self, hotkey: str, error: str) -> int:
        """Mark failed every flight still running whose route goes through ``hotkey`` (a miner just
        barred: tickets issued ahead still name it, and each would otherwise wait out a stall timeout
        before its re-issue routes around it). Returns how many."""
        n = 0
        for mb_id, fl in list(self.flights.items()):
            if not fl.done and not fl.failed and hotkey in fl.ticket.route:
                self.fail(mb_id, error, unreachable=[hotkey])
                n += 1
        return n

    def forget(self, lane: int, step: int) -> None:
        """Drop the flights and attempts of ``lane``'s steps up to ``step`` (forward-only ones excepted)."""
        for key in [k for k in self.attempts if k[0] == lane and k[1] <= step]:
            del self.attempts[key]
        for mb_id in [k for k, f in self.flights.items() if f.ticket.lane == lane and 0 <= f.ticket.step <= step]:
            del self.flights[mb_id]
