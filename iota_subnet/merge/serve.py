"""The reducer side of a merge: a replica's answers to its stage peers' ``/merge/*`` requests.

:class:`MergeServing` is a part of :class:`~iota_subnet.merge.engine.MergeEngine` (the engine
holds the state it reads: ``sessions``, ``anchor``, ``momentum``, ``cfg``, ...):

* ``/merge/join``: this replica's readiness (epoch, attempt, merged state, work in the window);
* ``/merge/contribute``: a participant's chunk of a shard this replica reduces; checked (shape,
  quantization, finite values, plan membership, chunk order), buffered and reduced in order as soon
  as every participant's chunk is there (weighted mean, then the outer step); acknowledged with
  backpressure (:data:`STREAM_WINDOW`);
* ``/merge/result``: the reduced mean of a shard, its hash and its chunks' hashes;
* ``/merge/contribution``: this replica's own chunk of a shard, for a third party's recompute.

Refusals raise :class:`~iota_subnet.protocol.ProtocolError` (``LATE`` for a closed or merged
epoch, ``BUSY`` past :data:`MAX_SESSIONS`, ``FORBIDDEN``, ``BAD_SHAPE``, ...).
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Iterable, Optional

import torch
from loguru import logger

from iota_subnet.protocol import (MergeAck, MergeJoin, MergePayload, MergeResult, MergeResultRequest, Message,
                                  Outcome, ProtocolError, payload_nbytes)
from iota_subnet.protocol.codec import host_bytes

from .deadlines import phase_deadline_s
from .outer import dequantize, rounded, weighted_mean
from .plan import MergePlan

#: Sessions (epoch, attempt, plan) a replica keeps at once; more are refused with BUSY.
MAX_SESSIONS = 6
#: What a ``NOT_READY`` answer to ``/merge/result`` says while the shard is being reduced (ask again).
STILL_REDUCING = "is still being reduced"
#: Chunks a contributor may run ahead of a shard's reduced chunks before the reducer delays its acks.
STREAM_WINDOW = 2


class _ShardReduce:
    """A reducer's state for one shard: chunks streaming in from every participant, reduced in order.

    With ``keep`` every participant's chunks are also kept as received (``kept[sender]``: (values,
    scales) in the payload's encoding, in order) until the merge of the epoch ends: a repair attempt
    over the survivors (:mod:`.plan`, repair plans) reduces the shard again from them with no
    transfer. That is about the stage's bytes in the payload dtype per shard reduced (N contributors
    x P / N values), twice that per replica."""

    def __init__(self, chunks: list[tuple[int, int]], participants: Iterable[str], keep: bool = False):
        self.chunks = chunks
        self.inbox: dict[int, dict[str, torch.Tensor]] = {}     # chunk -> sender -> float32 values
        self.got: dict[str, int] = {p: 0 for p in participants}  # chunks received per sender (in order)
        self.contribution_h = {p: hashlib.sha256() for p in self.got}
        self.reduced = 0                                        # chunks reduced so far
        self.means: list[torch.Tensor] = []                      # reduced chunks, rounded to the gather's encoding
        self.wire: list[tuple[torch.Tensor, Optional[torch.Tensor]]] = []   # the same, encoded (values, scales)
        self.progress = asyncio.Event()
        self.kept: Optional[dict[str, list[tuple[torch.Tensor, Optional[torch.Tensor]]]]] = (
            {p: [] for p in self.got} if keep else None)

    @property
    def done(self) -> bool:
        return self.reduced >= len(self.chunks)


class _Session:
    """State of one (epoch, attempt, plan) on this replica."""

    def __init__(self, epoch: int, attempt: int, plan_id: str):
        self.epoch, self.attempt, self.plan_id = epoch, attempt, plan_id
        self.plan: Optional[MergePlan] = None
        self.planned = asyncio.Event()
        self.reduce: dict[int, _ShardReduce] = {}                # shards this replica reduces
        self.raw: list[tuple[str, MergePayload]] = []            # arrived before our plan existed
        self.mine: dict[int, list[torch.Tensor]] = {}            # my (dequantized) chunks per shard
        self.mine_wire: dict[tuple[int, int], tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
        self.results: dict[int, MergeResult] = {}                # header of each result (no tensor)
        self.honest: dict[int, list[torch.Tensor]] = {}          # means computed here (before mean_to_serve)
        self.served: dict[int, list[torch.Tensor]] = {}          # the mean chunks this replica serves
        self.served_wire: dict[int, list[tuple[torch.Tensor, Optional[torch.Tensor]]]] = {}   # encoded
        self.result_ready: dict[int, asyncio.Event] = {}
        #: set once a result holds its co-reducer's signature, or the attempt to get it ended (:meth:`_cosign`)
        self.result_cosigned: dict[int, asyncio.Event] = {}
        #: my chunks each reducer holds: (reducer, shard) -> chunks acknowledged (a repair resends the rest)
        self.acked: dict[tuple[str, int], int] = {}
        self.carry: Optional[torch.Tensor] = None                 # weights read at the start (merge.overlap)
        self.closed = False
        self.created = time.monotonic()

    def ready_event(self, s: int) -> asyncio.Event:
        return self.result_ready.setdefault(s, asyncio.Event())

    def cosigned_event(self, s: int) -> asyncio.Event:
        return self.result_cosigned.setdefault(s, asyncio.Event())


class MergeServing:
    """The ``/merge/*`` routes of :class:`~iota_subnet.merge.engine.MergeEngine` (see the module docstring)."""

    async def handle(self, route: str, msg: Message, caller: str) -> Message:
        """Serve a peer's merge request (``route`` in ``/merge/join``, ``/merge/contribute``,
        ``/merge/result``, ``/merge/contribution``). Raises ProtocolError for refusals. Tensor bytes
        served and received here count in this replica's merge byte totals."""
        self.link.note(caller, payload_nbytes(msg))
        reply = await self._handle(route, msg, caller)
        self._count(payload_nbytes(reply), payload_nbytes(msg))
        return reply

    async def _handle(self, route: str, msg: Message, caller: str) -> Message:
        if route == "/merge/join":
            return self._on_join(msg)
        if route == "/merge/contribute":
            ack = self._on_contribute(msg, caller)
            await self._throttle(msg)
            return ack
        if route == "/merge/result":
            return await self._on_result(msg, caller)
        if route == "/merge/contribution":
            return self._on_contribution(msg, caller)
        raise ProtocolError(Outcome.UNKNOWN_ROUTE, f"no merge route {route}")

    def _on_join(self, msg: MergeJoin) -> MergeJoin:
        return MergeJoin(run_id=self.run_id, stage=self.stage, epoch=msg.epoch, attempt=max(self.attempt_now, 0),
                         ready_epoch=self.ready_epoch, merged_epoch=self.merged_epoch,
                         closed_epoch=max([self.merged_epoch] + [e for e, a in self.closed_epochs.items()
                                                                 if a >= self.cfg.max_attempts]),
                         in_sync=self.in_sync, work=self.ready_work,
                         inner_step=self._inner_step(), spare=self._spare())

    def _late(self, epoch: int, attempt: int) -> bool:
        return epoch <= self.merged_epoch or self.closed_epochs.get(epoch, -1) >= attempt

    def _session(self, epoch: int, attempt: int, plan_id: str, own: bool = False) -> _Session:
        """The session of ``(epoch, attempt, plan_id)``, created when new; past :data:`MAX_SESSIONS`
        a peer's message is refused (BUSY), while this replica's own plan (``own``) evicts the oldest
        session it does not run (early contributions under a plan of another view)."""
        key = (epoch, attempt, plan_id)
        sess = self.sessions.get(key)
        if sess is None:
            if len(self.sessions) >= MAX_SESSIONS:
                self._prune()
            if own and len(self.sessions) >= MAX_SESSIONS:
                foreign = [k for k, v in self.sessions.items() if v.plan is None]
                if foreign:
                    self.sessions.pop(min(foreign, key=lambda k: self.sessions[k].created)).closed = True
            if len(self.sessions) >= MAX_SESSIONS:
                raise ProtocolError(Outcome.BUSY, f"{len(self.sessions)} merge sessions open")
            sess = self.sessions[key] = _Session(epoch, attempt, plan_id)
        return sess

    def _prune(self) -> None:
        # A finished attempt's results stay served for a while: a slower peer may still be gathering.
        for key, sess in list(self.sessions.items()):
            phase = (self.cfg.phase_timeout_s if sess.plan is None
                     else phase_deadline_s(self.cfg, self.phase_bytes(sess.plan)))
            # (the declared-rate deadline: a closed attempt's results are kept for peers gathering late,
            # not for as long as the floor rate allows a live one, which would fill the session table)
            if self.current is not None and key[:2] == self.current[:2]:
                continue
            if key[0] < self.merged_epoch or time.monotonic() - sess.created > 4 * (self.cfg.join_timeout_s + phase):
                sess.closed = True
                del self.sessions[key]

    def _on_contribute(self, msg: MergePayload, caller: str) -> MergeAck:
        if self._late(msg.epoch, msg.attempt):
            raise ProtocolError(Outcome.LATE, f"merge epoch {msg.epoch} attempt {msg.attempt} is closed "
                                              f"(merged epoch {self.merged_epoch}); pull the merged weights")
        if msg.total_numel != self.params.numel:
            raise ProtocolError(Outcome.BAD_SHAPE, f"total_numel {msg.total_numel} != this stage's {self.params.numel}")
        if msg.quant != self.cfg.scatter_quant:
            raise ProtocolError(Outcome.MALFORMED, f"quantization {msg.quant!r}, this run uses {self.cfg.scatter_quant!r}")
        if msg.shard.dim() != 1 or not (0 <= msg.offset and msg.offset + msg.shard.numel() <= msg.total_numel):
            raise ProtocolError(Outcome.BAD_SHAPE, f"slice [{msg.offset}, +{msg.shard.numel()}) outside [0, {msg.total_numel})")
        if msg.shard.numel() > self.cfg.chunk_numel:
            raise ProtocolError(Outcome.BAD_SHAPE, f"chunk of {msg.shard.numel()} values > merge.chunk_numel "
                                                   f"{self.cfg.chunk_numel}")
        if not msg.plan_id or len(msg.plan_id) > 64:
            raise ProtocolError(Outcome.MALFORMED, "plan_id missing or too long")
        try:
            x = dequantize(msg.shard, msg.scales, msg.quant, self.cfg.int8_block)
        except ValueError as e:
            raise ProtocolError(Outcome.BAD_DTYPE, str(e)) from None
        if not bool(torch.isfinite(x).all()):
            raise ProtocolError(Outcome.NON_FINITE, "dequantized slice holds NaN or inf")
        if self.observer is not None:
            self.observer.on_contribution_in(caller, msg, x)
        sess = self._session(msg.epoch, msg.attempt, msg.plan_id)
        if x.numel() == 0:       # a claim only: a repair attempt's sender whose chunks this reducer holds already
            return MergeAck()
        if sess.plan is None:
            if len(sess.raw) > 4 * 64:
                raise ProtocolError(Outcome.BUSY, "too many early contributions")
            sess.raw.append((caller, msg))
        else:
            self._accept(sess, caller, msg.shard_index, msg.chunk, msg.offset, x, (msg.shard, msg.scales))
        return MergeAck()      # an answer to the request: no coordinates (spec 2)

    async def _throttle(self, msg: MergePayload) -> None:
        """Backpressure: acknowledge chunk ``c`` only once this replica has a plan for it and the shard's
        reduced chunks are at most :data:`STREAM_WINDOW` behind, or after half the progress timeout
        (an ack held longer would look like a stalled reducer to the sender; the sender may then run
        one chunk further ahead, :mod:`.deadlines`)."""
        sess = self.sessions.get((msg.epoch, msg.attempt, msg.plan_id))
        if sess is None:
            return
        cap = min(self.cfg.phase_timeout_s, self.cfg.progress_timeout_s / 2)
        deadline = time.monotonic() + cap
        try:
            await asyncio.wait_for(sess.planned.wait(), timeout=cap)
        except asyncio.TimeoutError:
            return
        red = sess.reduce.get(msg.shard_index)
        while red is not None and red.reduced < msg.chunk - STREAM_WINDOW + 1 and not sess.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            red.progress.clear()
            try:
                await asyncio.wait_for(red.progress.wait(), timeout=left)
            except asyncio.TimeoutError:
                return

    def _accept(self, sess: _Session, sender: str, s: int, c: int, offset: int, x: torch.Tensor,
                wire: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None) -> None:
        """Take chunk ``c`` of ``sender``'s slice of shard ``s`` (``x``: dequantized; ``wire``: as
        received, kept for a repair when the shard keeps chunks)."""
        plan = sess.plan
        if sender not in plan.participants:
            raise ProtocolError(Outcome.FORBIDDEN, f"{sender[:10]} is not in plan {plan.plan_id}")
        if not 0 <= s < plan.num_shards or s not in sess.reduce:
            raise ProtocolError(Outcome.FORBIDDEN, f"this replica does not reduce shard {s} of plan {plan.plan_id}")
        red = sess.reduce[s]
        if not 0 <= c < len(red.chunks) or (offset, x.numel()) != red.chunks[c]:
            raise ProtocolError(Outcome.BAD_SHAPE, f"chunk {c} of shard {s} is {red.chunks[c] if 0 <= c < len(red.chunks) else 'none'} "
                                                   f"(offset, numel), got ({offset}, {x.numel()})")
        got = red.got[sender]
        if c < got:                                    # a resent chunk: must repeat the first one
            prev = red.inbox.get(c, {}).get(sender)
            if prev is None and red.kept is not None:
                q, sc = red.kept[sender][c]
                prev = dequantize(q, sc, self.cfg.scatter_quant, self.cfg.int8_block)
            if prev is not None and not torch.equal(prev, x):
                raise ProtocolError(Outcome.FORBIDDEN, f"{sender[:10]} sent two different chunks {c} for shard {s}")
            return
        if c > got:
            raise ProtocolError(Outcome.MALFORMED, f"chunk {c} of shard {s} before chunk {got}: chunks go in order")
        red.inbox.setdefault(c, {})[sender] = x
        red.got[sender] = c + 1
        if red.kept is not None:
            red.kept[sender].append(wire if wire is not None else (x, None))
        for view in host_bytes(x):
            red.contribution_h[sender].update(view)
        self._advance(sess, s)

    def _advance(self, sess: _Session, s: int) -> None:
        """Reduce the shard's complete chunks, in order."""
        plan, red = sess.plan, sess.reduce[s]
        order = plan.participants
        while not red.done and len(red.inbox.get(red.reduced, {})) == len(order):
            c = red.reduced
            box = red.inbox.pop(c)
            mean, wire = rounded(weighted_mean([(plan.weight(p), box[p]) for p in order]), self.cfg.gather_quant,
                                 self.cfg.int8_block)
            red.means.append(mean)
            red.wire.append(wire)
            red.reduced += 1
        red.progress.set()

    def _adopt_raw(self, sess: _Session) -> None:
        for sender, msg in sess.raw:
            try:
                x = dequantize(msg.shard, msg.scales, msg.quant, self.cfg.int8_block)
                self._accept(sess, sender, msg.shard_index, msg.chunk, msg.offset, x, (msg.shard, msg.scales))
            except (ProtocolError, ValueError) as e:
                logger.warning(f"merge: early contribution from {sender[:10]} dropped: {e}")
        sess.raw.clear()

    async def _on_result(self, msg: MergeResultRequest, caller: str) -> MergeResult:
        sess = self.sessions.get((msg.epoch, msg.attempt, msg.plan_id))
        if sess is None:
            if self._late(msg.epoch, msg.attempt):
                raise ProtocolError(Outcome.LATE, f"merge epoch {msg.epoch} attempt {msg.attempt} is closed")
            raise ProtocolError(Outcome.NOT_READY, f"no merge session for plan {msg.plan_id}")
        cap = min(self.cfg.phase_timeout_s, self.cfg.progress_timeout_s / 2)
        if sess.plan is None:           # contributions arrived, but this replica does not run this plan (yet)
            try:
                await asyncio.wait_for(sess.planned.wait(), timeout=cap)
            except asyncio.TimeoutError:
                raise ProtocolError(Outcome.NOT_READY, f"not running plan {msg.plan_id}") from None
        if msg.shard_index not in sess.reduce:
            raise ProtocolError(Outcome.FORBIDDEN, f"this replica does not reduce shard {msg.shard_index}")
        # the co-reducer gets the result as soon as it is computed (it signs the same statement); every
        # other caller once it carries the co-reducer's signature too, or the try to get it ended
        co = caller in sess.plan.reducers[msg.shard_index]
        ev = (sess.ready_event if co else sess.cosigned_event)(msg.shard_index)
        try:    # answered within half the progress timeout: the caller asks again (see .deadlines)
            await asyncio.wait_for(ev.wait(), timeout=cap)
        except asyncio.TimeoutError:
            raise ProtocolError(Outcome.NOT_READY, f"shard {msg.shard_index} {STILL_REDUCING}") from None
        res = sess.results.get(msg.shard_index)
        if res is None:
            raise ProtocolError(Outcome.FORBIDDEN, f"this replica does not reduce shard {msg.shard_index}")
        served = sess.served_wire.get(msg.shard_index)
        if not msg.with_tensor or served is None:
            return res
        if not 0 <= msg.chunk < len(served):
            raise ProtocolError(Outcome.BAD_SHAPE, f"shard {msg.shard_index} has {len(served)} chunks, not {msg.chunk}")
        values, scales = served[msg.chunk]
        # the chunk alone: its hashes and signed claims came with the header (asked first, without tensor)
        return MergeResult(chunk=msg.chunk, quant=self.cfg.gather_quant, mean=values, mean_scales=scales)

    def _on_contribution(self, msg: MergeResultRequest, caller: str) -> MergePayload:
        sess = self.sessions.get((msg.epoch, msg.attempt, msg.plan_id))
        key = (msg.shard_index, msg.chunk)
        if sess is None or sess.plan is None or key not in sess.mine_wire:
            raise ProtocolError(Outcome.NOT_READY, f"no contribution for plan {msg.plan_id} shard {msg.shard_index} "
                                                   f"chunk {msg.chunk}")
        if caller not in sess.plan.participants:
            raise ProtocolError(Outcome.FORBIDDEN, "only participants of the plan may fetch contributions")
        q, sc = sess.mine_wire[key]
        chunks = sess.plan.chunks(msg.shard_index)
        return MergePayload(run_id=self.run_id, stage=self.stage, epoch=msg.epoch, attempt=msg.attempt,
                            plan_id=msg.plan_id, shard_index=msg.shard_index, num_shards=sess.plan.num_shards,
                            chunk=msg.chunk, num_chunks=len(chunks), offset=chunks[msg.chunk][0],
                            total_numel=sess.plan.total_numel, weight=sess.plan.weight(self.me),
                            quant=self.cfg.scatter_quant, shard=q, scales=sc)
