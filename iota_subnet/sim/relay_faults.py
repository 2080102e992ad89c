"""Relays that misbehave, for tests and ``localnet --relay-fault``: subclasses of
:class:`~iota_subnet.transport.relay.RelayHost` over its public :meth:`~RelayHost.send`.

* ``drop``: forwards nothing (every relayed request waits out the relay's forward timeout, then its
  connection drops);
* ``drop30``: drops 30 % of the requests, forwards the rest;
* ``alter``: flips one byte of every request body it forwards (in its first piece) (the receiver refuses it: the caller's
  signature no longer matches);
* ``replay``: forwards every request twice (the receiver's nonce store refuses the second); it holds
  each body whole to send it again.
"""
from __future__ import annotations

import asyncio
import random
from typing import Any, AsyncIterable, AsyncIterator, Optional

from iota_subnet.transport.relay import RelayHost, Relayed
from iota_subnet.transport.relay_frames import chunks_of


class DroppingRelay(RelayHost):
    """Forwards a request with probability ``keep`` and never answers the others."""

    keep = 0.0

    def __init__(self, *args: Any, seed: int = 0, **kw: Any):
        super().__init__(*args, **kw)
        self.rng = random.Random(seed)

    async def send(self, peer, header, body, on_frame=None):
        if self.rng.random() >= self.keep:
            self.counts["fault_dropped"] += 1
            await asyncio.Event().wait()
        return await super().send(peer, header, body, on_frame)


class LossyRelay(DroppingRelay):
    keep = 0.7


async def _flipped(body: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """``body`` with one byte flipped in the middle of its first non-empty piece."""
    flipped = False
    async for c in body:
        if c and not flipped:
            b = bytearray(c)
            b[len(b) // 2] ^= 0x01
            c, flipped = bytes(b), True
        yield c


class AlteringRelay(RelayHost):
    """Flips one byte of every body it forwards."""

    async def send(self, peer, header, body, on_frame=None):
        self.counts["fault_altered"] += 1
        return await super().send(peer, header, _flipped(body), on_frame)


class ReplayingRelay(RelayHost):
    """Forwards every request a second time once the first is answered (``second``: that answer)."""

    second: Optional[Relayed] = None

    async def send(self, peer, header, body, on_frame=None):
        data = b"".join([c async for c in body])
        first = await super().send(peer, header, chunks_of(data), on_frame)
        out = await first.read()
        self.counts["fault_replayed"] += 1
        self.second = await super().send(peer, header, chunks_of(data), on_frame)
        await self.second.read()
        return Relayed(first.head, chunks_of(out))


RELAY_FAULTS = {"drop": DroppingRelay, "drop30": LossyRelay, "alter": AlteringRelay, "replay": ReplayingRelay}
