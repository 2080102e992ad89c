"""Which peers of a stage a replica still waits for at a merge boundary.

A replica that was found gone at one merge (it could not be reached, its answer timed out because
its process is stopped, it was excluded from an attempt, or it never became ready before the join
deadline) is *suspect*: at later boundaries it is asked with a short probe timeout and, if it
answers but is not ready, waited for only a short grace period, so it costs one epoch at most
instead of every later epoch (a stopped process accepts TCP connections and never answers: without
this every boundary would wait the full join timeout, or the transport timeout, for it). A suspect
that shows up ready at a join, or takes part in an applied merge, is trusted again. A stalled peer
that comes back is late: it finds its peers' merged epoch above its own and pulls the merged weights
(:mod:`iota_subnet.merge.sync`).
"""
from __future__ import annotations

import time
from typing import Callable, Iterable


class PeerLiveness:
    """Suspect peers and the timeouts that apply to them (seconds).

    ``join_timeout_s``: the full wait for a trusted peer. ``probe_s``: how long a suspect's
    ``/merge/join`` answer is awaited; ``grace_s``: how long a suspect that answered (alive, not
    ready yet) is waited for."""

    def __init__(self, join_timeout_s: float, *, probe_s: float = 1.0, grace_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.join_timeout_s = float(join_timeout_s)
        self.probe_s = min(float(probe_s), self.join_timeout_s)
        self.grace_s = min(self.join_timeout_s, max(2.0, self.join_timeout_s / 4) if grace_s is None else grace_s)
        self.clock = clock
        self.suspects: dict[str, str] = {}        # hotkey -> why

    def suspect(self, peers: Iterable[str], why: str) -> None:
        for p in peers:
            self.suspects.setdefault(p, why)

    def trust(self, peers: Iterable[str]) -> None:
        for p in peers:
            self.suspects.pop(p, None)

    def ask_timeout(self, peer: str, left_s: float) -> float:
        """How long to wait for ``peer``'s join answer with ``left_s`` seconds left before the deadline."""
        cap = self.probe_s if peer in self.suspects else left_s
        return max(0.05, min(cap, left_s))

    def wait_deadline(self, peer: str, started: float) -> float:
        """Until when a reachable ``peer`` that is not ready yet is waited for (monotonic seconds; a
        trusted peer: until the join's own deadline, ``inf`` here)."""
        return started + self.grace_s if peer in self.suspects else float("inf")

    def status(self) -> dict[str, str]:
        return dict(self.suspects)
