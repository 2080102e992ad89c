"""Miners whose output goes bad from a lane step on (a bug or an attacker), made from an honest
:class:`~iota_subnet.miner.service.MinerService` through public interfaces only: the data plane's
``send(hotkey, hop)`` and ``post_receipts(validator, receipts)`` callables are wrapped, so the miner
signs and sends what the wrapper makes of its honest output. No hook in production code.

Modes of :func:`corrupt_forwards` (each hop refused by an honest receiver for a provable reason):

* ``inf`` / ``nan``: one activation value non-finite (the hop's committed root matches the bad data);
* ``shape``: one token position short (``[B, T - 1, b]``);
* ``dtype``: fp32 where the ticket says bf16 (the root matches);
* ``hash``: finite data of the right shape and dtype that differs from the root the honest code committed.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from iota_subnet.miner.dataplane import commit_wire
from iota_subnet.protocol import Hop

MODES = ("inf", "nan", "shape", "dtype", "hash")


async def _corrupt(hop: Hop, mode: str) -> Hop:
    data = hop.data.clone()
    if mode in ("inf", "nan"):
        data.view(-1)[0] = float(mode)
    elif mode == "shape":
        data = data[:, :-1].contiguous()
    elif mode == "dtype":
        data = data.float()
    elif mode == "hash":
        data = data + 1.0
        return dataclasses.replace(hop, data=data)         # the honest root stays: it no longer matches
    else:
        raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
    return dataclasses.replace(hop, data=data, info={**hop.info, "root": await commit_wire(data, hop.scales)})


def corrupt_forwards(miner: Any, mode: str, from_step: int = 1) -> Counter:
    """From lane step ``from_step`` on, ``miner``'s outgoing training forwards are corrupted (``mode``).
    Returns a counter of the hops corrupted (filled as they go)."""
    plane = miner.node.plane
    send = plane.send
    counts: Counter = Counter()

    async def bad_send(hotkey: str, hop: Hop):
        t = hop.ticket
        if hop.direction == "forward" and hop.data is not None and t.get("train") and t.get("step", 0) >= from_step:
            hop = await _corrupt(hop, mode)
            counts[mode] += 1
        return await send(hotkey, hop)

    plane.send = bad_send
    return counts


def nan_losses(miner: Any, from_step: int = 1) -> Counter:
    """A tail that reports NaN losses from lane step ``from_step`` on: in the loss its backward hops
    carry and in its receipts."""
    plane = miner.node.plane
    send, post = plane.send, plane.post_receipts
    counts: Counter = Counter()

    async def bad_send(hotkey: str, hop: Hop):
        if hop.direction == "backward" and hop.ticket.get("step", 0) >= from_step and "loss" in hop.info:
            hop = dataclasses.replace(hop, info={**hop.info, "loss": float("nan")})
            counts["hop"] += 1
        return await send(hotkey, hop)

    async def bad_post(validator: str, receipts: list[dict]):
        bad = [dict(r, loss=float("nan")) if r.get("loss") is not None and r.get("step", 0) >= from_step else r
               for r in receipts]
        counts["receipts"] += sum(1 for a, b in zip(receipts, bad) if a is not b)
        return await post(validator, bad)

    plane.send, plane.post_receipts = bad_send, bad_post
    return counts

