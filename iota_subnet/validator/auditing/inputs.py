"""What a validator's audit scheduler knows of each miner: its receipts, roots and update commitments.

A part of :class:`~iota_subnet.validator.auditing.scheduler.AuditScheduler`: every accepted receipt
(:meth:`AuditInputs.on_receipt`) adds a hop candidate and the weights roots it names, and announces
a restart by a newer boot time; every receipt batch's update commitments are kept
(:meth:`AuditInputs.on_updates`); training hop outcomes go to the policy's "down" excuse.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from loguru import logger

from iota_subnet.protocol import ProtocolError, Ticket, UpdateCommit
from iota_subnet.protocol.receipt import Receipt

#: Hop candidates kept per miner (the most recent receipts).
MAX_CANDIDATES = 64


@dataclass
class HopCandidate:
    """A training hop a miner reported: its ticket, its receipt, when the receipt arrived."""

    ticket: Ticket
    receipt: Receipt
    hotkey: str
    received: float


@dataclass
class _MinerView:
    key: Optional[tuple[int, str]] = None      # (uid, hotkey) when last looked up
    boot: float = 0.0
    latest: tuple[int, int] = (-1, -1)          # newest weights version its current process named
    candidates: deque = field(default_factory=lambda: deque(maxlen=MAX_CANDIDATES))
    commits: deque = field(default_factory=lambda: deque(maxlen=8))
    #: (step, merges) -> skipped, of every commitment received (the newest 1024)
    committed: dict = field(default_factory=dict)
    audited_commits: set = field(default_factory=set)
    #: weights version -> (root hex, first seen)
    roots: dict = field(default_factory=dict)
    checked_steps: set = field(default_factory=set)
    #: lane step -> indices of its micro-batches it reported accumulating (the route's own miner);
    #: ``trained``: the steps it reported accumulating every micro-batch of
    backwards: dict = field(default_factory=dict)
    trained: set = field(default_factory=set)


class AuditInputs:
    """The inputs of :class:`~iota_subnet.validator.auditing.scheduler.AuditScheduler` (see the module docstring)."""

    def on_receipt(self, ticket: Ticket, receipt: Receipt, hotkey: str) -> None:
        """An accepted receipt of ``hotkey`` about ``ticket``."""
        view = self.miners[hotkey]
        now = self.clock()
        rep = self.lookup(hotkey)
        if rep is not None:
            view.key = rep.key
        if receipt.boot > view.boot:
            # a restarted miner may not be routable yet (new endpoint): its uid is the one it had
            if view.boot > 0 and view.key is not None and self.policy.announce_restart(view.key, receipt.boot):
                logger.info("uid {} restarted (boot {:.0f}): audits of its earlier work are excused", view.key[0],
                            receipt.boot)
            view.boot = receipt.boot
            view.latest = (-1, -1)
            # the new process resumed from a checkpoint and names versions (step, merges) again, with
            # other weights: the roots its old process named no longer bind it (an honest post-restart
            # update commitment checked against them would fail)
            view.roots.clear()
            view.checked_steps.clear()
        if receipt.boot >= view.boot:
            view.latest = max(view.latest, (receipt.ws, receipt.wm), (receipt.bws, receipt.bwm))
        if any(u[0].hotkey == hotkey for u in self.unsettled):
            self.settle(hotkey=hotkey, after=receipt.t)
        for ks, km, root in ((receipt.ws, receipt.wm, receipt.wroot), (receipt.bws, receipt.bwm, receipt.bwroot)):
            if root and ks >= 0 and (ks, km) not in view.roots:
                view.roots[(ks, km)] = (root, now)
                if len(view.roots) > 256:
                    del view.roots[min(view.roots)]
        if receipt.status == "ok" and ticket.train:
            view.candidates.append(HopCandidate(ticket, receipt, hotkey, now))
            # ``accumulated``, not merely a backward: a member that jumped to its lane's next step still
            # computes the late micro-batches of the step it left, without accumulating them (counting those
            # would flag an honest miner on its backwards of steps it left incomplete)
            if receipt.accumulated and receipt.stage < ticket.n_stages and ticket.is_member(receipt.stage, hotkey):
                done = view.backwards.setdefault(receipt.step, set())
                done.add(receipt.index)
                if len(done) >= ticket.micro_per_step:
                    view.trained.add(receipt.step)
                if len(view.backwards) > 1024:
                    del view.backwards[min(view.backwards)]
                if len(view.trained) > 1024:
                    view.trained.discard(min(view.trained))

    def on_updates(self, hotkey: str, commits: list[dict]) -> int:
        """Update commitments from ``hotkey``'s receipt batch. Returns how many were well formed."""
        view = self.miners[hotkey]
        n = 0
        for raw in commits:
            try:
                c = UpdateCommit.from_dict(raw)
            except ProtocolError:
                continue
            view.commits.append((c, self.clock()))
            view.committed[(c.step, c.merges)] = c.skipped
            if len(view.committed) > 1024:
                del view.committed[min(view.committed)]
            n += 1
        return n

    def on_hop(self, key: tuple[int, str], ok: bool, at: Optional[float] = None) -> None:
        """A training hop of miner ``key`` succeeded or failed, as known at ``at`` (unix s; the arrival
        of the miner's own receipt; default now): the policy's "down" excuse and its contradiction."""
        self.policy.note_hop(key, ok, at)
