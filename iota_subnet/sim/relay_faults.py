"""Relays that misbehave, for tests and ``localnet --relay-fault``: subclasses of
:class:`~iota_subnet.transport.relay.RelayHost` over its public :meth:`~RelayHost.send`.

* ``drop``: forwards nothing (every relayed request waits out the relay's forward timeout, then its
  connection drops);
* ``drop30``: drops 30 % of the requests, forwards the rest;
* ``alter``: flips one byte of every request body it forwards (the receiver refuses it: the caller's
  signature no longer matches);
* ``replay``: forwards every request twice (the receiver's nonce store refuses the second).
"""
from __future__ import annotations

import asyncio
import random
from typing import Any

from iota_subnet.transport.relay import RelayHost


class DroppingRelay(RelayHost):
    """Forwards a request with probability ``keep`` and never answers the others."""

    keep = 0.0

    def __init__(self, *args: Any, seed: int = 0, **kw: Any):
        super().__init__(*args, **kw)
        self.rng = random.Random(seed)

    async def send(self, peer, header, body):
        if self.rng.random() >= self.keep:
            self.counts["fault_dropped"] += 1
            await asyncio.Event().wait()
        return await super().send(peer, header, body)


class LossyRelay(DroppingRelay):
    keep = 0.7


class AlteringRelay(RelayHost):
    """Flips one byte in the middle of every body it forwards."""

    async def send(self, peer, header, body):
        b = bytearray(body)
        if b:
            b[len(b) // 2] ^= 0x01
        self.counts["fault_altered"] += 1
        return await super().send(peer, header, bytes(b))


class ReplayingRelay(RelayHost):
    """Forwards every request a second time once the first is answered."""

    async def send(self, peer, header, body):
        first = await super().send(peer, header, body)
        self.counts["fault_replayed"] += 1
        await super().send(peer, header, body)
        return first


RELAY_FAULTS = {"drop": DroppingRelay, "drop30": LossyRelay, "alter": AlteringRelay, "replay": ReplayingRelay}
