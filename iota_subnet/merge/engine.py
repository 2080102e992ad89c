"""The merge state machine of one replica: join, scatter, reduce, gather + verify, apply.

One merge epoch ``e`` of a stage, seen from replica ``me`` (all tensors float32, flat [P]):

1. **join**: ``me`` reached the boundary and waits (``merge.join_timeout_s``) for the stage's other
   replicas to report ``ready_epoch == e`` (``/merge/join``). Participants = the ready ones. A peer
   that already merged ``e`` means ``me`` is late: it returns ``status="late"`` and the miner pulls
   the merged weights (:mod:`.sync`).
2. **plan**: :class:`~iota_subnet.merge.plan.MergePlan` from the epoch seed, the attempt number and
   the sorted participants (and their merge weights); ``plan_id`` names it in every message.
3. **scatter**: pseudo-gradient ``delta = anchor - weights`` is cut by the plan; slice ``s`` goes
   (quantized as configured; the sender keeps the dequantized copy so both reducers and the sender
   see the same values) to both reducers of ``s`` (``/merge/contribute``).
4. **reduce**: for each of its shards ``me`` waits (``merge.phase_timeout_s``) for every participant's
   slice, then computes the weighted mean and the outer step (:func:`.outer.outer_step`); a shard
   missing a contributor is ``incomplete`` (its ``missing`` list names who).
5. **gather + verify**: for every shard ``me`` fetches the mean from one reducer and the hash from the
   other (``/merge/result``). Equal hashes (and a tensor matching them): accepted. Different hashes,
   or a tensor that does not match its hash: ``me`` acts as the third party, fetches every
   participant's slice (``/merge/contribution``), recomputes the mean, uses it and records evidence
   naming the reducer(s) whose hash differs (:attr:`MergeEngine.reports`).
6. **apply** (only with every shard verified): weights, anchor and momentum replaced together under the
   worker lock; else nothing changes and the attempt is retried without the missing / unreachable
   replicas (their shards reassigned by the new plan), at most ``merge.max_attempts`` times; then the
   epoch is abandoned (the next epoch's pseudo-gradient covers both).

Contributions for a closed or already merged epoch are refused with ``Outcome.LATE`` (410): non-fatal,
the sender pulls the merged weights. A straggler's slices are only ever used by an attempt whose
plan names it and that completes for every shard; otherwise they are dropped with the attempt.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Protocol

import torch
from loguru import logger

from iota_subnet.config import MergeConfig
from iota_subnet.protocol import (MergeAck, MergeJoin, MergePayload, MergeResult, MergeResultRequest, Message,
                                  Outcome, ProtocolError, payload_nbytes, tensor_sha256)

from iota_subnet.utils.progress import Progress

from .outer import dequantize, outer_step, quantize, weighted_mean
from .plan import MergePlan, epoch_seed

#: Sessions (epoch, attempt, plan) a replica keeps at once; more are refused with BUSY.
MAX_SESSIONS = 6


class PeerTransport(Protocol):
    """How the engine calls a peer: ``await call(peer_hotkey, route, msg, response_type)``; raises
    :class:`~iota_subnet.protocol.ProtocolError` for refusals and any other exception when unreachable.
    Returns ``(reply, bytes_sent, bytes_received)``."""

    async def call(self, peer: str, route: str, msg: Message, response_type: type) -> tuple[Any, int, int]: ...


def flat_numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class ModuleParams:
    """Flat float32 view of a module's parameters (in ``module.parameters()`` order), read and
    written under ``lock`` (the stage worker's lock); ``on_write()`` runs under the lock after
    every write (the stage worker's :meth:`~iota_subnet.miner.stage_worker.StageWorker.weights_replaced`)."""

    def __init__(self, module: torch.nn.Module, lock: Any = None, on_write: Optional[Callable[[], Any]] = None):
        import threading
        self.module = module
        self.lock = lock or threading.RLock()
        self.numel = flat_numel(module)
        self.on_write = on_write

    def read(self) -> torch.Tensor:
        with self.lock, torch.no_grad():
            return torch.cat([p.detach().float().reshape(-1) for p in self.module.parameters()]).clone()

    def write(self, flat: torch.Tensor) -> None:
        if flat.numel() != self.numel:
            raise ValueError(f"flat vector of {flat.numel()} values for {self.numel} parameters")
        with self.lock, torch.no_grad():
            off = 0
            for p in self.module.parameters():
                n = p.numel()
                p.copy_(flat[off:off + n].view_as(p).to(p.dtype))
                off += n
            if self.on_write is not None:
                self.on_write()


@dataclass
class MergeReport:
    """Outcome of one merge epoch on one replica. ``status``: ``merged`` | ``alone`` (no peer ready) |
    ``late`` (a peer merged this epoch already: pull its weights) | ``abandoned``. Bytes are encoded
    message bodies this replica sent / received for the merge (as client and as server)."""

    epoch: int
    status: str = "abandoned"
    attempts: int = 0
    participants: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    mismatches: list[dict] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    wall_s: float = 0.0
    reason: str = ""
    weights_sha256: str = ""

    @property
    def applied(self) -> bool:
        return self.status == "merged"


class _Session:
    """State of one (epoch, attempt, plan) on this replica."""

    def __init__(self, epoch: int, attempt: int, plan_id: str):
        self.epoch, self.attempt, self.plan_id = epoch, attempt, plan_id
        self.plan: Optional[MergePlan] = None
        self.inbox: dict[int, dict[str, torch.Tensor]] = {}     # shard -> sender -> float32 slice
        self.raw: list[tuple[str, MergePayload]] = []            # arrived before our plan existed
        self.mine: dict[int, torch.Tensor] = {}                  # my (dequantized) slices, for third parties
        self.mine_wire: dict[int, tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
        self.results: dict[int, MergeResult] = {}
        self.honest: dict[int, torch.Tensor] = {}                # means computed here (before any tamper hook)
        self.result_ready: dict[int, asyncio.Event] = {}
        self.arrived = asyncio.Event()
        self.closed = False
        self.created = time.monotonic()

    def ready_event(self, s: int) -> asyncio.Event:
        return self.result_ready.setdefault(s, asyncio.Event())


class MergeEngine:
    """Merges one replica with its stage's other replicas (see the module docstring).

    ``me``: this replica's hotkey. ``params``: :class:`ModuleParams`. ``transport``: :class:`PeerTransport`.
    ``weights_fn(participants) -> {hotkey: weight}``: validators' merge weights (0 excludes; default 1).
    ``run_id``/``stage`` seed the plans. ``on_applied(report)``: called after a merge is applied.
    ``tamper``: test hook ``(shard_index, mean) -> mean`` applied to the means this replica *serves*.
    ``before_attempt()``: called (and awaited) before every attempt, e.g. to re-read the merge
    weights from the chain.
    """

    def __init__(self, me: str, cfg: MergeConfig, params: ModuleParams, transport: Optional[PeerTransport] = None, *,
                 run_id: str = "", stage: int = 0,
                 weights_fn: Optional[Callable[[list[str]], dict[str, float]]] = None,
                 on_applied: Optional[Callable[[MergeReport], Any]] = None,
                 tamper: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None,
                 before_attempt: Optional[Callable[[], Any]] = None):
        self.me, self.cfg, self.params, self.transport = me, cfg, params, transport
        self.run_id, self.stage = run_id, stage
        self.weights_fn, self.on_applied, self.tamper = weights_fn, on_applied, tamper
        self.before_attempt = before_attempt
        self.anchor = params.read()                  # weights at the last merge (the run's seeded init before)
        self.momentum = torch.zeros_like(self.anchor)
        self.merged_epoch = -1
        self.ready_epoch = -1
        self.attempt_now = -1                        # the attempt of ready_epoch this replica is at
        self.current: Optional[tuple[int, int, list[str]]] = None   # (epoch, attempt, participants) in progress
        self.in_sync = True
        self.sessions: dict[tuple[int, int, str], _Session] = {}
        self.closed_epochs: dict[int, int] = {}      # epoch -> highest attempt closed
        self.reports: list[dict] = []                # mismatch evidence, for validators
        self.history: list[MergeReport] = []
        self._bytes = [0, 0]
        self._lock = asyncio.Lock()                  # one merge at a time

    # ------------------------------------------------------------------ state
    def set_state(self, anchor: torch.Tensor, momentum: torch.Tensor, merged_epoch: int, *, write_params: bool = True
                  ) -> None:
        """Adopt a synced (or checkpointed) merge state all at once."""
        if anchor.numel() != self.params.numel or momentum.numel() != self.params.numel:
            raise ValueError(f"state of {anchor.numel()}/{momentum.numel()} values for {self.params.numel} parameters")
        if write_params:
            self.params.write(anchor)
        self.anchor, self.momentum = anchor.float().clone(), momentum.float().clone()
        self.merged_epoch = int(merged_epoch)

    def status(self) -> dict:
        return {"merged_epoch": self.merged_epoch, "ready_epoch": self.ready_epoch, "in_sync": self.in_sync,
                "merges": sum(1 for r in self.history if r.applied), "abandoned": sum(1 for r in self.history
                                                                                      if r.status == "abandoned"),
                "mismatch_reports": len(self.reports),
                "last": None if not self.history else {k: getattr(self.history[-1], k) for k in
                                                      ("epoch", "status", "attempts", "participants", "missing",
                                                       "bytes_sent", "bytes_received", "wall_s", "reason")}}

    def _count(self, sent: int, received: int) -> None:
        self._bytes[0] += sent
        self._bytes[1] += received

    # ------------------------------------------------------------------ server side
    async def handle(self, route: str, msg: Message, caller: str) -> Message:
        """Serve a peer's merge request (``route`` in ``/merge/join``, ``/merge/contribute``,
        ``/merge/result``, ``/merge/contribution``). Raises ProtocolError for refusals. Tensor bytes
        served and received here count in this replica's merge byte totals."""
        reply = await self._handle(route, msg, caller)
        self._count(payload_nbytes(reply), payload_nbytes(msg))
        return reply

    async def _handle(self, route: str, msg: Message, caller: str) -> Message:
        if route == "/merge/join":
            return self._on_join(msg)
        if route == "/merge/contribute":
            return self._on_contribute(msg, caller)
        if route == "/merge/result":
            return await self._on_result(msg, caller)
        if route == "/merge/contribution":
            return self._on_contribution(msg, caller)
        raise ProtocolError(Outcome.UNKNOWN_ROUTE, f"no merge route {route}")

    def _on_join(self, msg: MergeJoin) -> MergeJoin:
        cur = self.current
        return MergeJoin(run_id=self.run_id, stage=self.stage, epoch=msg.epoch, attempt=max(self.attempt_now, 0),
                         ready_epoch=self.ready_epoch, merged_epoch=self.merged_epoch,
                         closed_epoch=max([self.merged_epoch] + [e for e, a in self.closed_epochs.items()
                                                                 if a >= self.cfg.max_attempts]),
                         participants=list(cur[2]) if cur else [], in_sync=self.in_sync)

    def _late(self, epoch: int, attempt: int) -> bool:
        return epoch <= self.merged_epoch or self.closed_epochs.get(epoch, -1) >= attempt

    def _session(self, epoch: int, attempt: int, plan_id: str) -> _Session:
        key = (epoch, attempt, plan_id)
        sess = self.sessions.get(key)
        if sess is None:
            if len(self.sessions) >= MAX_SESSIONS:
                self._prune()
            if len(self.sessions) >= MAX_SESSIONS:
                raise ProtocolError(Outcome.BUSY, f"{len(self.sessions)} merge sessions open")
            sess = self.sessions[key] = _Session(epoch, attempt, plan_id)
        return sess

    def _prune(self) -> None:
        # A finished attempt's results stay served for a while: a slower peer may still be gathering.
        for key, sess in list(self.sessions.items()):
            if key[0] < self.merged_epoch or time.monotonic() - sess.created > 4 * (self.cfg.join_timeout_s
                                                                                     + self.cfg.phase_timeout_s):
                sess.closed = True
                del self.sessions[key]

    def _on_contribute(self, msg: MergePayload, caller: str) -> MergeAck:
        if self._late(msg.epoch, msg.attempt):
            raise ProtocolError(Outcome.LATE, f"merge epoch {msg.epoch} attempt {msg.attempt} is closed "
                                              f"(merged epoch {self.merged_epoch}); pull the merged weights")
        if msg.total_numel != self.params.numel:
            raise ProtocolError(Outcome.BAD_SHAPE, f"total_numel {msg.total_numel} != this stage's {self.params.numel}")
        if msg.quant != self.cfg.quantization:
            raise ProtocolError(Outcome.MALFORMED, f"quantization {msg.quant!r}, this run uses {self.cfg.quantization!r}")
        if msg.shard.dim() != 1 or not (0 <= msg.offset and msg.offset + msg.shard.numel() <= msg.total_numel):
            raise ProtocolError(Outcome.BAD_SHAPE, f"slice [{msg.offset}, +{msg.shard.numel()}) outside [0, {msg.total_numel})")
        if not msg.plan_id or len(msg.plan_id) > 64:
            raise ProtocolError(Outcome.MALFORMED, "plan_id missing or too long")
        try:
            x = dequantize(msg.shard, msg.scales, msg.quant, self.cfg.int8_block)
        except ValueError as e:
            raise ProtocolError(Outcome.BAD_DTYPE, str(e)) from None
        if not bool(torch.isfinite(x).all()):
            raise ProtocolError(Outcome.NON_FINITE, "dequantized slice holds NaN or inf")
        sess = self._session(msg.epoch, msg.attempt, msg.plan_id)
        if sess.plan is None:
            if len(sess.raw) > 4 * 64:
                raise ProtocolError(Outcome.BUSY, "too many early contributions")
            sess.raw.append((caller, msg))
        else:
            self._accept(sess, caller, msg.shard_index, msg.offset, x)
        sess.arrived.set()
        return MergeAck(run_id=self.run_id, stage=self.stage, status="ok")

    def _accept(self, sess: _Session, sender: str, s: int, offset: int, x: torch.Tensor) -> None:
        plan = sess.plan
        if sender not in plan.participants:
            raise ProtocolError(Outcome.FORBIDDEN, f"{sender[:10]} is not in plan {plan.plan_id}")
        if not 0 <= s < plan.num_shards or self.me not in plan.reducers[s]:
            raise ProtocolError(Outcome.FORBIDDEN, f"this replica does not reduce shard {s} of plan {plan.plan_id}")
        if (offset, x.numel()) != plan.bounds[s]:
            raise ProtocolError(Outcome.BAD_SHAPE, f"shard {s} is {plan.bounds[s]} (offset, numel), got ({offset}, {x.numel()})")
        box = sess.inbox.setdefault(s, {})
        if sender in box and not torch.equal(box[sender], x):
            raise ProtocolError(Outcome.FORBIDDEN, f"{sender[:10]} sent two different slices for shard {s}")
        box[sender] = x

    def _adopt_raw(self, sess: _Session) -> None:
        for sender, msg in sess.raw:
            try:
                x = dequantize(msg.shard, msg.scales, msg.quant, self.cfg.int8_block)
                self._accept(sess, sender, msg.shard_index, msg.offset, x)
            except (ProtocolError, ValueError) as e:
                logger.warning(f"merge: early contribution from {sender[:10]} dropped: {e}")
        sess.raw.clear()

    async def _on_result(self, msg: MergeResultRequest, caller: str) -> MergeResult:
        sess = self.sessions.get((msg.epoch, msg.attempt, msg.plan_id))
        if sess is None:
            if self._late(msg.epoch, msg.attempt):
                raise ProtocolError(Outcome.LATE, f"merge epoch {msg.epoch} attempt {msg.attempt} is closed")
            raise ProtocolError(Outcome.NOT_READY, f"no merge session for plan {msg.plan_id}")
        ev = sess.ready_event(msg.shard_index)
        try:
            await asyncio.wait_for(ev.wait(), timeout=self.cfg.phase_timeout_s)
        except asyncio.TimeoutError:
            raise ProtocolError(Outcome.NOT_READY, f"shard {msg.shard_index} not reduced yet") from None
        res = sess.results.get(msg.shard_index)
        if res is None:
            raise ProtocolError(Outcome.FORBIDDEN, f"this replica does not reduce shard {msg.shard_index}")
        if not msg.with_tensor:
            return MergeResult(**{**res.__dict__, "mean": None})
        return res

    def _on_contribution(self, msg: MergeResultRequest, caller: str) -> MergePayload:
        sess = self.sessions.get((msg.epoch, msg.attempt, msg.plan_id))
        if sess is None or sess.plan is None or msg.shard_index not in sess.mine_wire:
            raise ProtocolError(Outcome.NOT_READY, f"no contribution for plan {msg.plan_id} shard {msg.shard_index}")
        if caller not in sess.plan.participants:
            raise ProtocolError(Outcome.FORBIDDEN, "only participants of the plan may fetch contributions")
        q, sc = sess.mine_wire[msg.shard_index]
        off, _ = sess.plan.bounds[msg.shard_index]
        return MergePayload(run_id=self.run_id, stage=self.stage, epoch=msg.epoch, attempt=msg.attempt,
                            plan_id=msg.plan_id, shard_index=msg.shard_index, num_shards=sess.plan.num_shards,
                            offset=off, total_numel=sess.plan.total_numel, weight=sess.plan.weight(self.me),
                            quant=self.cfg.quantization, shard=q, scales=sc)

    # ------------------------------------------------------------------ client side
    async def _call(self, peer: str, route: str, msg: Message, rtype: type) -> Any:
        if peer == self.me:
            raise RuntimeError("no self calls")
        reply, sent, received = await self.transport.call(peer, route, msg, rtype)
        self._count(sent, received)
        return reply

    async def _join(self, epoch: int, attempt: int, peers: list[str], exclude: set[str]
                    ) -> tuple[list[str], list[str], int]:
        """Returns (participants incl. me, peers that merged ``epoch`` already, the highest attempt a
        peer is at when above ``attempt``, else -1). A peer counts as ready for this attempt only
        when it is at the same attempt of the same epoch: one still finishing the previous attempt
        is waited for (its phase deadline is at most ``phase_timeout_s`` away)."""
        deadline = time.monotonic() + (self.cfg.join_timeout_s if attempt == 0
                                       else self.cfg.join_timeout_s + self.cfg.phase_timeout_s)
        w = self._weights([p for p in peers if p != self.me])
        want = [p for p in peers if p != self.me and p not in exclude and w.get(p, 1.0) > 0]
        ready: set[str] = set()
        ahead: list[str] = []
        first = True
        while True:
            # excluded peers are still asked once: one of them may have completed this epoch (then we are late)
            todo = [p for p in want if p not in ready] + ([p for p in peers if p in exclude and p != self.me]
                                                          if first else [])
            first = False

            async def ask(p: str):
                try:
                    return p, await self._call(p, "/merge/join", MergeJoin(run_id=self.run_id, stage=self.stage,
                                                                            epoch=epoch, attempt=attempt), MergeJoin)
                except Exception as e:  # noqa: BLE001 - an unreachable peer is simply not ready
                    return p, e
            jump = -1
            for p, r in await asyncio.gather(*(ask(p) for p in todo)):
                if isinstance(r, MergeJoin):
                    if r.merged_epoch >= epoch:
                        ahead.append(p)
                    elif r.closed_epoch >= epoch and r.ready_epoch != epoch and p in want:
                        want.remove(p)            # it gave up on this epoch: do not wait for it
                    elif r.ready_epoch == epoch and r.in_sync and p not in exclude:
                        if r.attempt == attempt:
                            ready.add(p)
                        elif r.attempt > attempt:
                            jump = max(jump, r.attempt)
            if ahead:
                return [], ahead, -1
            if jump > attempt and jump < self.cfg.max_attempts:
                return [], [], jump
            if len(ready) == len(want) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.1)
        return sorted(ready | {self.me}), [], -1

    def _weights(self, participants: list[str]) -> dict[str, float]:
        if self.weights_fn is None:
            return {p: 1.0 for p in participants}
        w = self.weights_fn(list(participants)) or {}
        return {p: float(w.get(p, 1.0)) for p in participants}

    async def merge(self, epoch: int, peers: list[str] | Callable[[], list[str]]) -> MergeReport:
        """Run merge epoch ``epoch`` with the stage's other replicas ``peers`` (hotkeys, or a callable
        returning them, read again at every attempt after ``before_attempt``: a replica's view of who
        serves its stage may be seconds old). Never raises for peer faults: the report says what
        happened. Weights change only when ``report.applied``."""
        async with self._lock:
            t0 = time.monotonic()
            b0 = list(self._bytes)
            rep = MergeReport(epoch=epoch)
            self.ready_epoch = epoch
            exclude: set[str] = set()
            try:
                if epoch <= self.merged_epoch:
                    rep.status, rep.reason = "late", f"epoch {epoch} <= merged epoch {self.merged_epoch}"
                    return rep
                seed = epoch_seed(self.run_id, self.stage, epoch)
                attempt = -1
                while attempt + 1 < self.cfg.max_attempts:
                    attempt += 1
                    self.attempt_now = attempt
                    rep.attempts = attempt + 1
                    if self.before_attempt is not None:
                        res = self.before_attempt()
                        if asyncio.iscoroutine(res):
                            await res
                    if self._weights([self.me]).get(self.me, 1.0) <= 0:     # validators excluded this replica
                        rep.status, rep.reason = "abandoned", "this replica has merge weight 0"
                        return rep
                    peer_list = list(peers()) if callable(peers) else list(peers)
                    participants, ahead, jump = await self._join(epoch, attempt, peer_list, exclude)
                    if jump > attempt:                  # the peers gave up on this attempt: follow them
                        self.closed_epochs[epoch] = max(self.closed_epochs.get(epoch, -1), attempt)
                        attempt = jump - 1
                        continue
                    if ahead:
                        rep.status, rep.reason = "late", f"{len(ahead)} peer(s) merged epoch {epoch} already"
                        return rep
                    weights = self._weights(participants)
                    zero = {p for p, w in weights.items() if w <= 0}
                    participants = [p for p in participants if p not in zero]
                    rep.participants = participants
                    if self.me not in participants:
                        rep.status, rep.reason = "abandoned", "this replica has merge weight 0"
                        return rep
                    if len(participants) < 2:
                        rep.status, rep.reason = "alone", "no other replica ready"
                        return rep
                    plan = MergePlan.make(epoch, attempt, seed, participants, self.params.numel,
                                          {p: weights[p] for p in participants})
                    self.current = (epoch, attempt, list(plan.participants))
                    ok, missing, why = await self._allreduce(plan, rep)
                    self.closed_epochs[epoch] = attempt
                    if ok:
                        rep.status, rep.missing = "merged", sorted(exclude)
                        return rep
                    # peers that contributed to this attempt under another plan built it from another
                    # view (merge weights changed between reads): not missing, retry with them
                    other_plan = {sender for (e, a, pid), ss in self.sessions.items()
                                  if e == epoch and a == attempt and pid != plan.plan_id for sender, _ in ss.raw}
                    if other_plan:
                        why = f"{why}; plan mismatch with {len(other_plan)} peer(s) (another view of the merge weights)"
                    missing = [m for m in missing if m not in other_plan]
                    rep.reason = why
                    exclude |= set(missing)
                    rep.missing = sorted(exclude)
                    logger.info(f"merge epoch {epoch} attempt {attempt} failed ({why}); excluding {sorted(missing)}")
                rep.status = "abandoned"
                return rep
            finally:
                self.current = None
                self.ready_epoch = -1
                self.attempt_now = -1
                self.closed_epochs[epoch] = max(self.closed_epochs.get(epoch, -1), self.cfg.max_attempts)
                self._prune()
                rep.bytes_sent, rep.bytes_received = self._bytes[0] - b0[0], self._bytes[1] - b0[1]
                rep.wall_s = round(time.monotonic() - t0, 4)
                self.history.append(rep)
                self.history = self.history[-50:]
                if rep.applied and self.on_applied is not None:
                    res = self.on_applied(rep)
                    if asyncio.iscoroutine(res):
                        await res

    async def _allreduce(self, plan: MergePlan, rep: MergeReport) -> tuple[bool, list[str], str]:
        """One attempt. Returns (applied, replicas to exclude next time, reason)."""
        sess = self._session(plan.epoch, plan.attempt, plan.plan_id)
        sess.plan = plan
        self._adopt_raw(sess)
        current = await asyncio.to_thread(self.params.read)
        delta = self.anchor - current
        quant, block = self.cfg.quantization, self.cfg.int8_block
        unreachable: set[str] = set()
        sends = []
        for s, (off, n) in enumerate(plan.bounds):
            q, sc = quantize(delta[off:off + n], quant, block)
            x = dequantize(q, sc, quant, block)
            sess.mine[s], sess.mine_wire[s] = x, (q, sc)
            for r in dict.fromkeys(plan.reducers[s]):
                if r == self.me:
                    sess.inbox.setdefault(s, {})[self.me] = x
                else:
                    sends.append((r, MergePayload(run_id=self.run_id, stage=self.stage, epoch=plan.epoch,
                                                  attempt=plan.attempt, plan_id=plan.plan_id, shard_index=s,
                                                  num_shards=plan.num_shards, offset=off, total_numel=plan.total_numel,
                                                  weight=plan.weight(self.me), quant=quant, shard=q, scales=sc)))
        sess.arrived.set()

        async def send(r: str, m: MergePayload):
            try:
                await self._call(r, "/merge/contribute", m, MergeAck)
                return None
            except ProtocolError as e:
                return r, e
            except Exception as e:  # noqa: BLE001
                return r, e
        reducers = asyncio.gather(*(self._reduce(sess, s) for s in plan.shards_of(self.me)))
        send_res = await asyncio.gather(*(send(r, m) for r, m in sends))
        late = False
        for item in send_res:
            if item is None:
                continue
            r, e = item
            if isinstance(e, ProtocolError) and e.outcome == Outcome.LATE:
                late = True
            else:
                unreachable.add(r)
            logger.warning(f"merge: contribution to {r[:10]} failed: {e}")
        await reducers
        if late:
            return False, [], "a reducer refused as LATE (it merged or closed this attempt)"

        # gather + verify
        means: dict[int, torch.Tensor] = {}
        missing: set[str] = set(unreachable)
        reasons: list[str] = []

        async def gather_one(s: int) -> None:
            a, b = plan.reducers[s]
            others = [r for r in (a, b) if r != self.me]
            if self.me in (a, b):
                mine = sess.results.get(s)
                if mine is None or mine.status != "ok":
                    missing.update(mine.missing if mine is not None else [])
                    reasons.append(f"shard {s}: incomplete here")
                    return
                fetch = {others[0]: False} if others else {}
                primary_res = mine
                primary_mean = sess_means[s]
            else:
                prim = plan.primary_for(self.me, s)
                fetch = {a: a == prim, b: b == prim}
                primary_res, primary_mean = None, None
            got: dict[str, Any] = {}

            async def fetch_one(r: str, with_tensor: bool):
                try:
                    got[r] = await self._call(r, "/merge/result", MergeResultRequest(
                        run_id=self.run_id, stage=self.stage, epoch=plan.epoch, attempt=plan.attempt,
                        plan_id=plan.plan_id, shard_index=s, with_tensor=with_tensor), MergeResult)
                except Exception as e:  # noqa: BLE001
                    got[r] = e
            await asyncio.gather(*(fetch_one(r, wt) for r, wt in fetch.items()))
            claims: dict[str, MergeResult] = {}
            if primary_res is not None:
                claims[self.me] = primary_res
            for r, res in got.items():
                if isinstance(res, MergeResult):
                    if res.status != "ok":
                        missing.update(res.missing)
                        reasons.append(f"shard {s}: {r[:10]} incomplete")
                        return
                    claims[r] = res
                else:
                    missing.add(r)
                    reasons.append(f"shard {s}: {r[:10]} unreachable ({type(res).__name__})")
                    return
            if primary_mean is None:
                prim = plan.primary_for(self.me, s)
                primary_mean = claims[prim].mean
                if primary_mean is None or primary_mean.dtype != torch.float32 or primary_mean.numel() != plan.bounds[s][1]:
                    primary_mean = None
            hashes = {r: c.mean_sha256 for r, c in claims.items()}
            agree = len(set(hashes.values())) == 1 and len({(tuple(c.contributors), tuple(c.weights))
                                                             for c in claims.values()}) == 1
            if agree and primary_mean is not None and tensor_sha256(primary_mean) == next(iter(hashes.values())):
                means[s] = primary_mean
                return
            # mismatch: recompute as a third party from every participant's slice
            recomputed = await self._recompute(plan, sess, s)
            if recomputed is None:
                missing.update(r for r in (a, b) if r != self.me)
                reasons.append(f"shard {s}: mismatch and contributions unavailable")
                return
            digest = tensor_sha256(recomputed)
            served = {} if primary_mean is None else {plan.primary_for(self.me, s): tensor_sha256(primary_mean)}
            wrong = sorted(r for r in (a, b) if hashes.get(r) != digest or served.get(r, digest) != digest)
            ev = {"epoch": plan.epoch, "attempt": plan.attempt, "plan_id": plan.plan_id, "shard": s,
                  "reducers": [a, b], "claimed_sha256": hashes, "served_sha256": served, "recomputed_sha256": digest,
                  "wrong": wrong, "reporter": self.me, "stage": self.stage, "run_id": self.run_id,
                  "contribution_sha256": {r: dict(zip(c.contributors, c.contribution_sha256)) for r, c in claims.items()},
                  "time": time.time()}
            self.reports.append(ev)
            rep.mismatches.append(ev)
            logger.warning(f"merge epoch {plan.epoch} shard {s}: reducers disagree; recomputed, wrong: "
                           f"{[w[:10] for w in wrong]}")
            means[s] = recomputed

        sess_means = dict(sess.honest)   # the means this replica computed itself
        prog = Progress(4 * sum(plan.bounds[s][1] for s in range(plan.num_shards)), f"merge epoch {plan.epoch}: "
                        "gather", "B", unit_scale=True, min_total=64 << 20)

        async def gather_counted(s: int) -> None:
            await gather_one(s)
            prog.update(4 * plan.bounds[s][1])
        with prog:
            await asyncio.gather(*(gather_counted(s) for s in range(plan.num_shards)))
        if len(means) != plan.num_shards:
            return False, sorted(missing - {self.me}), "; ".join(reasons[:4]) or "incomplete"

        mean = torch.cat([means[s] for s in range(plan.num_shards)])
        new, mom = outer_step(self.anchor, self.momentum, mean, lr=self.cfg.outer_lr, mu=self.cfg.outer_momentum,
                              nesterov=self.cfg.nesterov)
        await asyncio.to_thread(self.params.write, new)          # all or nothing: one write under the lock
        self.anchor, self.momentum, self.merged_epoch = new, mom, plan.epoch
        rep.weights_sha256 = tensor_sha256(new)
        return True, [], ""

    async def _reduce(self, sess: _Session, s: int) -> None:
        plan = sess.plan
        deadline = time.monotonic() + self.cfg.phase_timeout_s
        box = sess.inbox.setdefault(s, {})
        while len(box) < len(plan.participants) and time.monotonic() < deadline:
            sess.arrived.clear()
            if len(box) >= len(plan.participants):
                break
            try:
                await asyncio.wait_for(sess.arrived.wait(), timeout=max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
        off, n = plan.bounds[s]
        base = dict(run_id=self.run_id, stage=self.stage, epoch=plan.epoch, attempt=plan.attempt,
                    plan_id=plan.plan_id, shard_index=s)
        missing = [p for p in plan.participants if p not in box]
        if missing:
            sess.results[s] = MergeResult(**base, status="incomplete", missing=missing)
        else:
            order = list(plan.participants)
            mean = weighted_mean([(plan.weight(p), box[p]) for p in order])
            new, mom = outer_step(self.anchor[off:off + n], self.momentum[off:off + n], mean, lr=self.cfg.outer_lr,
                                  mu=self.cfg.outer_momentum, nesterov=self.cfg.nesterov)
            sess.honest[s] = mean
            served = mean if self.tamper is None else self.tamper(s, mean.clone())
            sess.results[s] = MergeResult(**base, status="ok", contributors=order,
                                          weights=[plan.weight(p) for p in order],
                                          contribution_sha256=[tensor_sha256(box[p]) for p in order],
                                          mean_sha256=tensor_sha256(served), shard_sha256=tensor_sha256(new),
                                          momentum_sha256=tensor_sha256(mom), mean=served)
        sess.ready_event(s).set()

    async def _recompute(self, plan: MergePlan, sess: _Session, s: int) -> Optional[torch.Tensor]:
        """Third-party check: fetch shard ``s`` of every participant's pseudo-gradient, recompute the mean."""
        off, n = plan.bounds[s]
        slices: dict[str, torch.Tensor] = {self.me: sess.mine[s]}

        async def get(p: str):
            try:
                m = await self._call(p, "/merge/contribution", MergeResultRequest(
                    run_id=self.run_id, stage=self.stage, epoch=plan.epoch, attempt=plan.attempt,
                    plan_id=plan.plan_id, shard_index=s), MergePayload)
                x = dequantize(m.shard, m.scales, m.quant, self.cfg.int8_block)
                if m.quant != self.cfg.quantization or (m.offset, x.numel()) != (off, n):
                    return
                slices[p] = x
            except Exception as e:  # noqa: BLE001
                logger.debug(f"merge: contribution fetch from {p[:10]} failed: {e}")
        await asyncio.gather(*(get(p) for p in plan.participants if p != self.me))
        if len(slices) != len(plan.participants):
            return None
        return weighted_mean([(plan.weight(p), slices[p]) for p in plan.participants])
