"""A scripted miner network for a real validator control plane, with a *black hole*: a miner that
accepts connections and never answers (every hop to it and every ``/health`` of it times out).

:class:`ScriptedNet` is the ``client`` of a :class:`~iota_subnet.validator.control.ControlPlane`. A
ticket accepted at a head runs its micro-batch through the stages the way the data plane does:
each miner computes one micro-batch at a time (``compute_s``), a forward is sent to the next stage's
candidates in the ticket's order (the route's miner, then the alternates) with at most ``senders``
sends at a time per miner, and a send to the black hole takes ``hop_timeout_s`` before the next
candidate is tried; the sender's receipt names the miners it could not reach. When the forward and
backward chain completed, every stage reports an ``ok`` receipt (the tail first) whose hashes agree
with its neighbours'; when no candidate took a forward, the sender reports ``failed``.
"""
from __future__ import annotations

import asyncio
import hashlib
from typing import Optional

from iota_subnet.protocol import Health, ReceiptBatch, Ticket, TicketAck
from iota_subnet.protocol.receipt import Receipt
from iota_subnet.transport import TransportError


def _h(*parts) -> str:
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()


class ScriptedNet:
    def __init__(self, black_holes: set[str], *, hop_timeout_s: float = 1.0, compute_s: float = 0.02,
                 senders: int = 2):
        self.black_holes = set(black_holes)
        self.hop_timeout_s, self.compute_s, self.senders = hop_timeout_s, compute_s, senders
        self.cp = None            # the ControlPlane receipts go to (set after it is built)
        self._compute: dict[str, asyncio.Lock] = {}
        self._send: dict[str, asyncio.Semaphore] = {}
        self._tasks: set[asyncio.Task] = set()

    async def call(self, endpoint, hotkey, path, msg, resp_type, timeout_s: float = 30.0, **kw):
        if hotkey in self.black_holes:
            await asyncio.sleep(min(timeout_s, self.hop_timeout_s))
            raise TransportError(hotkey[:10], "timed out")
        if path == "/tickets":
            for raw in msg.tickets:
                task = asyncio.create_task(self._run(Ticket.from_json(raw)))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            return TicketAck(run_id=msg.run_id, accepted=len(msg.tickets))
        if path == "/health":
            return Health(run_id=msg.run_id, stage=msg.stage, inner_step=0)
        raise AssertionError(f"unexpected call {path}")

    async def _work(self, hk: str) -> None:
        async with self._compute.setdefault(hk, asyncio.Lock()):
            await asyncio.sleep(self.compute_s)

    async def _run(self, t: Ticket) -> None:
        n = t.n_stages
        servers, unreachable = [t.route[0]], [[] for _ in range(n)]
        await self._work(servers[0])
        for s in range(1, n):
            sender = servers[-1]
            got: Optional[str] = None
            async with self._send.setdefault(sender, asyncio.Semaphore(self.senders)):
                for cand in t.candidates(s):
                    if cand == sender:
                        continue
                    if cand in self.black_holes:
                        await asyncio.sleep(self.hop_timeout_s)
                        unreachable[s - 1].append(cand)
                        continue
                    got = cand
                    break
            if got is None:
                self._report(t, s - 1, sender, Receipt(
                    id=t.microbatch_id, lane=t.lane, step=t.step, index=t.index, attempt=t.attempt, stage=s - 1,
                    status="failed", error=f"no miner of stage {s} took the forward",
                    unreachable=unreachable[s - 1]))
                return
            servers.append(got)
            await self._work(got)
        for s in reversed(range(n)):      # backward: the tail reports first
            if s < n - 1:
                await self._work(servers[s])
            self._report(t, s, servers[s], Receipt(
                id=t.microbatch_id, lane=t.lane, step=t.step, index=t.index, attempt=t.attempt, stage=s, status="ok",
                fin=_h(t.microbatch_id, "act", s), fout=_h(t.microbatch_id, "act", s + 1),
                bin=_h(t.microbatch_id, "grad", s + 1) if s < n - 1 else "",
                bout=_h(t.microbatch_id, "grad", s) if s else "",
                prev=servers[s - 1] if s else "", next=servers[s + 1] if s < n - 1 else "",
                loss=3.0 if s in (0, n - 1) else None, compute_s=self.compute_s, unreachable=unreachable[s]))

    def _report(self, t: Ticket, stage: int, hk: str, r: Receipt) -> None:
        self.cp.on_receipts(ReceiptBatch(run_id=t.run_id, receipts=[r.model_dump()]), hk)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
