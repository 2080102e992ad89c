"""How long a merge waits for its peers: deadlines from the payload's bytes, cuts from byte progress.

A fixed phase deadline fails every merge whose payload takes longer than it at the replicas' uplink
(at ``8b`` an int8 scatter is 1.64 GB per replica: 131 s at 100 Mbit/s, against 30 s). So:

* **progress**: a wait is cut when the peers it waits for made no progress for
  ``merge.progress_timeout_s`` (:class:`LinkProgress`: a whole message, or half of what the floor rate
  moves in that time, so a peer trickling a byte now and then does not look alive). Bytes, not messages: the transports report
  the bytes of a message as they cross the link, piece by piece (over HTTP both ends: the sender's
  client as it sends, the receiver's server as the body arrives, :mod:`iota_subnet.transport.streaming`),
  and every message a peer sends or answers counts as its bytes at the end;
* **deadline** of a phase, a backstop against a peer that trickles: ``merge.phase_timeout_s +
  bytes / FLOOR_RATE_BPS``, ``bytes`` what one replica sends in the phase (its scatter:
  :func:`scatter_bytes`): a transfer still moving at :data:`FLOOR_RATE_BPS` (64 kbit/s) or more is
  never cut, however large. A transport that reports no bytes inside a message gets the older
  rule: ``merge.phase_timeout_s + 2 x bytes / merge.assumed_uplink_bps`` (a transfer under half the
  declared rate is cut there) and a per-call allowance of ``2 x bytes / rate`` on top of the
  progress timeout (:func:`call_allowance_s`).

Waits on the serving side (a contribution's ack held for backpressure, a result request waiting for
its shard) are capped at half the progress timeout and answered (the ack, or ``NOT_READY`` to ask
again), so a live peer never looks stalled to its caller.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable

from . import sparse

#: Safety factor on the time a payload takes at the declared uplink rate.
RATE_SLACK = 2.0
#: The slowest transfer a merge waits for when its transport reports bytes as they move (bit/s).
FLOOR_RATE_BPS = 64e3


def bytes_per_value(quant: str, int8_block: int = 256) -> float:
    """Wire bytes per merged value: fp32 4, bf16 2, int8 1 plus a float32 scale per block; ``topk-*``
    exact, ``sparse-*`` its dense bound (:func:`.sparse.bytes_per_value`)."""
    if sparse.is_sparse(quant):
        return sparse.bytes_per_value(quant)
    return {"none": 4.0, "bf16": 2.0}.get(quant, 1.0 + 4.0 / max(1, int8_block))


def scatter_bytes(num_participants: int, total_numel: int, quant: str, int8_block: int = 256) -> float:
    """Bytes one replica sends in a scatter: its slice of every shard to both reducers, less its own
    (``(2N - 2) / N x P`` values)."""
    n = max(1, int(num_participants))
    return (2 * n - 2) / n * total_numel * bytes_per_value(quant, int8_block)


def phase_deadline_s(cfg, nbytes: float, byte_progress: bool = False) -> float:
    """Seconds a phase moving ``nbytes`` per replica may take: ``phase_timeout_s + bytes / floor rate``
    when the transport reports bytes as they move (``byte_progress``), else ``phase_timeout_s + 2 x
    bytes / merge.assumed_uplink_bps``."""
    if byte_progress:
        return float(cfg.phase_timeout_s) + 8.0 * float(nbytes) / FLOOR_RATE_BPS
    return float(cfg.phase_timeout_s) + RATE_SLACK * 8.0 * float(nbytes) / float(cfg.assumed_uplink_bps)


def call_allowance_s(cfg, nbytes: float) -> float:
    """Seconds one call moving ``nbytes`` (request and reply) may take beyond its progress timeout
    on a transport that reports no bytes inside a message."""
    return RATE_SLACK * 8.0 * float(nbytes) / float(cfg.assumed_uplink_bps)


class LinkProgress:
    """When each peer last made progress with this replica (monotonic seconds), either way: a whole
    message (:meth:`note`), or ``min_bytes`` more of messages still on the wire (:meth:`moving`; a
    peer that trickles a byte now and then to look alive does not count; the engine sets it to half
    of what :data:`FLOOR_RATE_BPS` moves in a progress timeout)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, min_bytes: int = 1):
        self.clock = clock
        self.min_bytes = max(1, int(min_bytes))
        self.last: dict[str, float] = {}
        self.bytes: dict[str, int] = {}
        self.partial: dict[str, int] = {}       # bytes of messages in flight since the peer's last progress
        #: peers found stalled (no byte for a progress timeout) in the running attempt: calls to them
        #: fail at once instead of waiting out another progress timeout; cleared by their next byte
        self.stalled: set[str] = set()

    def note(self, peer: str, nbytes: int = 0) -> None:
        """A whole message of ``nbytes`` to or from ``peer``: progress."""
        self.last[peer] = self.clock()
        self.bytes[peer] = self.bytes.get(peer, 0) + int(nbytes)
        self.partial[peer] = 0
        self.stalled.discard(peer)

    def moving(self, peer: str, nbytes: int) -> None:
        """``nbytes`` more of a message still crossing the link: progress once ``min_bytes`` moved."""
        got = self.partial.get(peer, 0) + int(nbytes)
        if got >= self.min_bytes:
            self.note(peer, got)
        else:
            self.partial[peer] = got

    def idle_s(self, peers: Iterable[str], since: float) -> float:
        """Seconds since any of ``peers`` last moved a byte, counting from ``since`` at the earliest
        (a wait that began later than a peer's last byte starts its own clock)."""
        latest = max([since] + [self.last.get(p, since) for p in peers])
        return self.clock() - latest
