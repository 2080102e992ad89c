"""Miners whose output goes bad from a lane step on (a bug or an attacker), as data plane transports.

Made of an honest miner whose :class:`~iota_subnet.miner.dataplane.transport.HttpDataPlaneTransport`
is replaced by a subclass (the ``make_dataplane_transport`` part of
:class:`~iota_subnet.miner.parts.MinerParts`): the miner computes honestly, and the transport signs and
sends what it makes of the honest output. Used by ``iota-subnet miner --adversary KIND`` /
``iota-subnet localnet --adversary KIND`` and by tests; no hook in production code.

Kinds (:data:`BAD_OUTPUT_KINDS`), from lane step :data:`FROM_STEP` on:

``bad-inf`` / ``bad-nan``  one activation value of each training forward non-finite (the hop's
            committed root matches the bad data);
``bad-shape``  one token position short (``[B, T - 1, b]``);
``bad-dtype``  fp32 where the ticket says bf16 (the root matches);
``bad-hash``   finite data of the right shape and dtype that differs from the root the honest code
            committed;
``nan-loss``   a tail that reports NaN losses, in the loss its backward hops carry and in its receipts.

The first four are refused by an honest receiver for a reason it proves to the validator with the
sender's signed body (:mod:`iota_subnet.miner.refusals`); ``nan-loss`` is refused by the head and by
the validator's receipt checks. Each transport counts what it corrupted (``corrupted`` in its status).
"""
from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from typing import Any

from iota_subnet.miner.dataplane import commit_wire
from iota_subnet.miner.dataplane.transport import HttpDataPlaneTransport
from iota_subnet.miner.parts import MinerParts
from iota_subnet.protocol import Hop, HopAck, ReceiptAck, ReceiptBatch

#: How a stage-0 miner's forwards are corrupted: ``bad-<mode>``.
MODES = ("inf", "nan", "shape", "dtype", "hash")
BAD_OUTPUT_KINDS = tuple(f"bad-{m}" for m in MODES) + ("nan-loss",)
#: The first lane step whose output goes bad.
FROM_STEP = 5


async def corrupt_hop(hop: Hop, mode: str) -> Hop:
    """``hop`` with its activation corrupted (``mode``, one of :data:`MODES`); raises ValueError for
    another mode. Its root is recomputed over the bad data except for ``hash``."""
    data = hop.data.clone()
    if mode in ("inf", "nan"):
        data.view(-1)[0] = float(mode)
    elif mode == "shape":
        data = data[:, :-1].contiguous()
    elif mode == "dtype":
        data = data.float()
    elif mode == "hash":
        return dataclasses.replace(hop, data=data + 1.0)    # the honest root stays: it no longer matches
    else:
        raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
    return dataclasses.replace(hop, data=data, info={**hop.info, "root": await commit_wire(data, hop.scales)})


class CorruptingTransport(HttpDataPlaneTransport):
    """Corrupts every outgoing training forward from lane step ``from_step`` on (``mode``)."""

    def __init__(self, *args: Any, mode: str, from_step: int = FROM_STEP, **kw: Any):
        super().__init__(*args, **kw)
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
        self.mode, self.from_step = mode, int(from_step)
        self.corrupted: Counter = Counter()

    async def send_hop(self, hotkey: str, hop: Hop) -> HopAck:
        t = hop.ticket
        if hop.direction == "forward" and hop.data is not None and t.get("train") and t.get("step", 0) >= self.from_step:
            hop = await corrupt_hop(hop, self.mode)
            self.corrupted[self.mode] += 1
        return await super().send_hop(hotkey, hop)

    def status(self) -> dict:
        return {**super().status(), "corrupted": dict(self.corrupted)}


class NanLossTransport(HttpDataPlaneTransport):
    """A tail's transport that reports NaN losses from lane step ``from_step`` on."""

    def __init__(self, *args: Any, from_step: int = FROM_STEP, **kw: Any):
        super().__init__(*args, **kw)
        self.from_step = int(from_step)
        self.corrupted: Counter = Counter()

    async def send_hop(self, hotkey: str, hop: Hop) -> HopAck:
        if hop.direction == "backward" and hop.ticket.get("step", 0) >= self.from_step and "loss" in hop.info:
            hop = dataclasses.replace(hop, info={**hop.info, "loss": float("nan")})
            self.corrupted["hop"] += 1
        return await super().send_hop(hotkey, hop)

    async def post_receipts(self, validator: str, batch: ReceiptBatch) -> ReceiptAck:
        bad = [dict(r, loss=float("nan")) if r.get("loss") is not None and r.get("step", 0) >= self.from_step else r
               for r in batch.receipts]
        self.corrupted["receipts"] += sum(1 for a, b in zip(batch.receipts, bad) if a is not b)
        return await super().post_receipts(validator, dataclasses.replace(batch, receipts=bad))

    def status(self) -> dict:
        return {**super().status(), "corrupted": dict(self.corrupted)}


def bad_output_parts(kind: str, from_step: int = FROM_STEP) -> MinerParts:
    """The :class:`~iota_subnet.miner.parts.MinerParts` of an honest miner whose output goes bad
    (``kind``, one of :data:`BAD_OUTPUT_KINDS`) from lane step ``from_step`` on; raises ValueError
    for another kind."""
    if kind == "nan-loss":
        make = functools.partial(NanLossTransport, from_step=from_step)
    elif kind in BAD_OUTPUT_KINDS:
        make = functools.partial(CorruptingTransport, mode=kind.removeprefix("bad-"), from_step=from_step)
    else:
        raise ValueError(f"unknown bad-output kind {kind!r}; one of {', '.join(BAD_OUTPUT_KINDS)}")
    return MinerParts(make_dataplane_transport=make, status={"adversary": kind})
