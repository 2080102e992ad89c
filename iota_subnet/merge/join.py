"""The join at a merge boundary: which of a stage's replicas take part in an attempt.

:class:`MergeJoining` is a part of :class:`~iota_subnet.merge.engine.MergeEngine`: it asks the
stage's other replicas (``/merge/join``) until they are ready at the same (epoch, attempt) with the
same merged state, or the join deadline passes, and says what it found (:class:`JoinResult`):
the participants and their work, or a reason to do something else (pull newer merged weights,
move to the epoch label the others are at, follow them to a later attempt).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Optional

from iota_subnet.protocol import MergeJoin, ProtocolError


@dataclass
class JoinResult:
    """What a join found: the participants (incl. this replica) and their work, or a reason to do
    something else: ``ahead`` (peers with newer merged state: pull), ``relabel`` (the epoch the
    stage's replicas are at instead), ``jump`` (the attempt they moved to); ``gone``: peers that
    could not be reached, ``not_ready``: reachable peers that never became ready; ``closed``: the
    highest epoch a peer with the same merged state closed without merging (-1: none)."""

    participants: list[str] = field(default_factory=list)
    works: dict[str, float] = field(default_factory=dict)
    ahead: list[str] = field(default_factory=list)
    relabel: int = -1
    jump: int = -1
    gone: set[str] = field(default_factory=set)
    not_ready: set[str] = field(default_factory=set)
    closed: int = -1


class MergeJoining:
    """:meth:`_join` of :class:`~iota_subnet.merge.engine.MergeEngine` (see the module docstring)."""

    async def _join(self, epoch: int, attempt: int, peers: list[str], exclude: set[str],
                    deadline: Optional[float] = None) -> "JoinResult":
        """Wait for the other replicas to be ready at ``(epoch, attempt)``. A peer counts as ready for
        this attempt only when it is at the same attempt of the same epoch with the same merged state
        (``merged_epoch``): one still finishing the previous attempt is waited for (its phase deadline
        is at most ``phase_timeout_s`` away); one that cannot be reached (dead, restarting, stopped)
        is not: it pulls the merged weights when it is back. Peers found gone at an earlier boundary
        (:class:`~iota_subnet.merge.liveness.PeerLiveness`) are probed briefly, not waited for.

        Epochs are labels the replicas agree on, not clocks: a peer with the same merged state that
        waits at a later epoch moves this replica to that epoch (``relabel``). A peer that already
        closed this one without merging (it went on alone while this replica was away or its lane
        was behind) is not waited for, and the next merge is labelled above the epoch it closed
        (``closed``, :attr:`label_floor`), so two live replicas whose inner steps drifted apart find
        a common epoch again at their next boundary. (Moving to the peer's next label at once would
        pause the lane until the join deadline for a peer a whole merge window away: with inner
        steps of seconds, 30-40 s waits that end alone anyway.)

        A suspect peer whose answer puts it within one inner step of this replica's boundary (its
        lane is running the window's last step) is waited for like a trusted one: lanes paced by the
        validator reach a boundary up to a step apart, and with only the short grace for suspects (a
        quarter of the join timeout) a replica once found gone would merge alone at every later
        boundary, since it would never take part in a merge again. So is a suspect whose inner step
        advances while this replica waits and is at most half a window (``every_steps // 2``, at least
        one step) behind, its last step within a grace period: its lane is training toward the
        boundary. Lanes can reach a boundary more than a step apart (a validator restart, a
        reroute): were the first replica to give up on its peer after the grace, the peer, arriving
        seconds later, would find the epoch closed and go alone too (two "alone" merges instead of
        one; ``docs/BENCHMARKS.md``, "Design notes moved from docstrings"). A peer that does not advance,
        or stopped advancing a grace period ago, is still given up; a peer that says it trains in no
        lane (``spare``) at its first answer."""
        started = time.monotonic()
        if deadline is None:
            # a later attempt also covers a peer still ending the previous one: cut at the phase timeout,
            # or, waiting on a peer that stopped, at one progress timeout
            deadline = started + (self.cfg.join_timeout_s if attempt == 0 else self.cfg.join_timeout_s
                                  + max(self.cfg.phase_timeout_s, self.cfg.progress_timeout_s))
        w = self._weights([p for p in peers if p != self.me])
        want = [p for p in peers if p != self.me and p not in exclude and w.get(p, 1.0) > 0]
        out = JoinResult(works={self.me: self.ready_work})
        ready: set[str] = set()
        closed_at: dict[str, int] = {}
        my_step = self._inner_step()
        near: set[str] = set()                  # answered within one inner step of this boundary
        first_step: dict[str, int] = {}         # each peer's inner step at its first answer in this join
        moved: dict[str, tuple[int, float]] = {}  # each peer's latest inner step and when it got there
        behind_ok = max(1, int(self.cfg.every_steps) // 2)
        first = True
        while True:
            # validators may exclude a peer while it is waited for (merge weight 0: barred as a cheater,
            # it no longer trains and never gets here): read the weights again
            w = self._weights([p for p in want if p not in ready])
            for p in [p for p in want if p not in ready and w.get(p, 1.0) <= 0]:
                want.remove(p)
                out.not_ready.add(p)
            # excluded peers are still asked once: one of them may have completed this epoch (then we are late)
            todo = [p for p in want if p not in ready] + ([p for p in peers if p in exclude and p != self.me]
                                                          if first else [])
            first = False

            async def ask(p: str):
                t = self.liveness.ask_timeout(p, deadline - time.monotonic())
                try:
                    return p, await asyncio.wait_for(self._call(p, "/merge/join", MergeJoin(
                        run_id=self.run_id, stage=self.stage, epoch=epoch, attempt=attempt), MergeJoin), timeout=t)
                except Exception as e:  # noqa: BLE001 - an unreachable (or silent) peer is simply not ready
                    return p, e
            jump, later = -1, -1
            for p, r in await asyncio.gather(*(ask(p) for p in todo)):
                if isinstance(r, MergeJoin):
                    same_state = r.in_sync and r.merged_epoch == self.merged_epoch
                    first_step.setdefault(p, r.inner_step)
                    if r.inner_step > moved.get(p, (r.inner_step - 1, 0.0))[0]:
                        moved[p] = (r.inner_step, time.monotonic())
                    # advancing: it took a step during this join, the last one within a grace period
                    advancing = (first_step[p] < r.inner_step and my_step - behind_ok <= r.inner_step <= my_step
                                 and time.monotonic() - moved[p][1] <= self.liveness.grace_s)
                    if my_step >= 0 and (my_step - 1 <= r.inner_step <= my_step or advancing):
                        near.add(p)
                    else:
                        near.discard(p)
                    if r.spare and r.ready_epoch != epoch:
                        if p in want:             # trains in no lane: never at a boundary, not waited for
                            want.remove(p)
                            out.not_ready.add(p)
                    elif r.merged_epoch > self.merged_epoch:
                        out.ahead.append(p)       # it holds newer merged weights: this replica is late
                    elif r.merged_epoch < self.merged_epoch or not r.in_sync:
                        # behind: it pulls first, never mixing its old state into this merge. One at this
                        # boundary (near) is waited for, up to the join deadline: at the boundary it finds
                        # itself late, pulls and joins again with the merged state and its window's work
                        # (``keep_progress``). Whether it has proposed yet does not matter, so that every
                        # peer decides the same way. Dropping it would keep a replica that is late once late
                        # at every boundary, its work discarded each time (its stage then merges with
                        # one replica fewer for the rest of the run)
                        if p in want and p not in near:
                            want.remove(p)
                    elif r.ready_epoch > epoch and same_state and p not in exclude:
                        later = max(later, r.ready_epoch)
                    elif r.closed_epoch >= epoch and r.ready_epoch != epoch:
                        closed_at[p] = r.closed_epoch
                        if p in want:
                            want.remove(p)        # it gave up on (or went past) this epoch: do not wait for it
                    elif r.ready_epoch == epoch and same_state and p not in exclude:
                        if r.attempt == attempt:
                            ready.add(p)
                            out.works[p] = float(r.work) if r.work >= 0 else 0.0
                        elif r.attempt > attempt:
                            jump = max(jump, r.attempt)
                elif not isinstance(r, ProtocolError) and p in want:
                    want.remove(p)                # unreachable (dead, restarting, stopped): do not hold the lane for it
                    out.gone.add(p)
            if out.ahead:
                return out
            if later > epoch:
                out.relabel = later
                return out
            if closed_at:
                out.closed = max(out.closed, *closed_at.values())
            if jump > attempt and jump < self.cfg.max_attempts:
                out.jump = jump
                return out
            now = time.monotonic()
            late_peers = [p for p in want if p not in ready and p not in near
                          and now >= self.liveness.wait_deadline(p, started)]
            for p in late_peers:                  # a suspect that answers but is not ready: short grace only
                want.remove(p)
                out.not_ready.add(p)
            if len(ready) == len(want) or now >= deadline:
                break
            await asyncio.sleep(0.1)
        out.not_ready |= {p for p in want if p not in ready}
        out.participants = sorted(ready | {self.me})
        out.works = {p: out.works[p] for p in out.participants}
        out.gone -= ready
        return out
