"""The merge state machine of one replica: join, scatter, reduce, gather + verify, apply.

One merge epoch ``e`` of a stage, seen from replica ``me`` (all tensors float32, flat [P], in host
memory whatever device the stage trains on: :class:`ModuleParams` is the only place where values
cross between the module's device and the host):

1. **join**: ``me`` reached the boundary and waits (``merge.join_timeout_s``) for the stage's other
   replicas to report ``ready_epoch == e`` (``/merge/join``); each reports the work it did in the
   window (tokens trained since its last merge). Participants = the ready ones. A peer holding a
   later merged state (``merged_epoch`` above ``me``'s) means ``me`` is late: it returns
   ``status="late"`` and the miner pulls the merged weights (:mod:`.sync`), keeping its own progress
   since its old anchor (:meth:`MergeEngine.set_state`, ``keep_progress``), and joins ``e`` again if
   its peers have not merged it yet (else it closes ``e``: :meth:`MergeEngine.skip`); a peer with an
   older merged state is never a participant before it has pulled, and one at the boundary is
   waited for while it pulls. Epochs are labels the replicas agree on:
   a peer with the same merged state that waits at a later epoch, or already closed ``e`` without
   merging, moves ``me`` to that later epoch, so replicas whose inner steps drifted apart (one
   restarted, its lane behind) find a common epoch again. Peers found gone at an earlier boundary
   are probed briefly, not waited for (:mod:`.liveness`): a stopped replica costs one epoch.
2. **plan**: :class:`~iota_subnet.merge.plan.MergePlan` from the epoch seed, the attempt number and
   the sorted participants; a participant's weight in the mean is its validators' merge weight times
   its work in the window (a replica that did no work weighs 0: it takes part and ends with the
   merged weights, but does not dilute the others); ``plan_id`` names it in every message.
3. **scatter**: pseudo-gradient ``delta = anchor - weights`` is cut by the plan; slice ``s`` goes
   (quantized as configured; the sender keeps the dequantized copy so both reducers and the sender
   see the same values) to both reducers of ``s`` (``/merge/contribute``) as consecutive chunks of at
   most ``merge.chunk_numel`` values, one message each, one stream per (reducer, shard).
4. **reduce**: chunk ``c`` of a shard is reduced (weighted mean in the plan's participant order, then
   the outer step, :func:`.outer.outer_step`) as soon as every participant's chunk ``c`` is there;
   a reducer acknowledges a chunk only when the shard's reduced chunks are at most
   :data:`STREAM_WINDOW` behind it, so it buffers a bounded number of chunks per contributor. A
   shard still missing a contributor after ``merge.phase_timeout_s`` is ``incomplete`` (its
   ``missing`` list names who).
5. **gather + verify**: for every shard ``me`` fetches the mean chunk by chunk from one reducer and
   the hash from the other (``/merge/result``). Equal hashes (and chunks matching them): accepted.
   Different hashes, or chunks that do not match: ``me`` acts as the third party, fetches every
   participant's chunks (``/merge/contribution``), recomputes the mean, uses it and records evidence
   naming the reducer(s) whose hash differs (:attr:`MergeEngine.reports`).
6. **apply** (only with every shard verified): weights, anchor and momentum replaced together under the
   worker lock (with ``merge.overlap``: the merged weights plus the local progress made while the
   merge ran); else nothing changes and the attempt is retried without the missing / unreachable
   replicas (their shards reassigned by the new plan), at most ``merge.max_attempts`` times; then the
   epoch is abandoned (the next epoch's pseudo-gradient covers both).

Contributions for a closed or already merged epoch are refused with ``Outcome.LATE`` (410): non-fatal,
the sender pulls the merged weights. A straggler's slices are only ever used by an attempt whose
plan names it and that completes for every shard; otherwise they are dropped with the attempt.

Memory per replica (host, float32 values): anchor and momentum (2P), the pseudo-gradient (P; plus
its dequantized copy with int8 / bf16 payloads), the new anchor and momentum while they are built
(2P), the means of the two shards it reduces (2P/N), at most ``STREAM_WINDOW + 1`` chunks per
contributor of each shard it reduces, and with ``merge.overlap`` the weights read at the start (P).
"""
from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Protocol

import torch
from loguru import logger

from iota_subnet.config import MergeConfig
from iota_subnet.protocol import (MergeAck, MergeJoin, MergePayload, MergeResult, MergeResultRequest, Message,
                                  Outcome, ProtocolError, payload_nbytes, tensor_sha256)
from iota_subnet.protocol.codec import host_bytes

from iota_subnet.utils.progress import Progress

from .outer import dequantize, outer_step, quantize, weighted_mean
from .liveness import PeerLiveness
from .plan import MergePlan, epoch_seed

#: Sessions (epoch, attempt, plan) a replica keeps at once; more are refused with BUSY.
MAX_SESSIONS = 6
#: Times one merge may move to a later epoch label the stage's other replicas are at.
MAX_RELABELS = 8
#: Chunks a contributor may run ahead of a shard's reduced chunks before the reducer delays its acks.
STREAM_WINDOW = 2


class PeerTransport(Protocol):
    """How the engine calls a peer: ``await call(peer_hotkey, route, msg, response_type)``; raises
    :class:`~iota_subnet.protocol.ProtocolError` for refusals and any other exception when unreachable.
    Returns ``(reply, bytes_sent, bytes_received)``."""

    async def call(self, peer: str, route: str, msg: Message, response_type: type) -> tuple[Any, int, int]: ...


def flat_numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def sha256_of(chunks: Iterable[torch.Tensor]) -> str:
    """sha256 of the concatenated raw bytes of ``chunks`` (equals ``tensor_sha256(torch.cat(chunks))``)."""
    h = hashlib.sha256()
    for x in chunks:
        for view in host_bytes(x):
            h.update(view)
    return h.hexdigest()


def cap_work(works: dict[str, float]) -> dict[str, float]:
    """Work reported by the participants, each capped at twice the median (a replica cannot buy
    itself a larger share of the mean by claiming more work than it could have done; with the
    median at 0 only relative weights among the working replicas matter, nothing to cap)."""
    vals = sorted(works.values())
    if not vals:
        return {}
    k = len(vals)
    med = vals[k // 2] if k % 2 else (vals[k // 2 - 1] + vals[k // 2]) / 2
    return {p: min(w, 2 * med) if med > 0 else w for p, w in works.items()}


class ModuleParams:
    """Flat float32 host copy of a module's parameters (in ``module.parameters()`` order), read and
    written under ``lock`` (the stage worker's lock); ``on_write()`` runs under the lock after
    every write (the stage worker's :meth:`~iota_subnet.miner.stage_worker.StageWorker.weights_replaced`).

    The module may live on any device; values cross to and from the host one parameter at a time
    (no device-side concatenation of the whole stage)."""

    def __init__(self, module: torch.nn.Module, lock: Any = None, on_write: Optional[Callable[[], Any]] = None):
        self.module = module
        self.lock = lock or threading.RLock()
        self.numel = flat_numel(module)
        self.on_write = on_write

    def read(self) -> torch.Tensor:
        """Host float32 [P] copy of the parameters."""
        with self.lock, torch.no_grad():
            out = torch.empty(self.numel, dtype=torch.float32)
            off = 0
            for p in self.module.parameters():
                n = p.numel()
                out[off:off + n].view(p.shape).copy_(p.detach())
                off += n
            return out

    def write(self, flat: torch.Tensor, carry_from: Optional[torch.Tensor] = None) -> None:
        """Set the parameters to ``flat`` (host or device, [P]). With ``carry_from`` (the values
        read when the merge started, [P]), add the progress made since then instead:
        ``p = flat + (p - carry_from)`` (an overlapped merge keeps the steps taken meanwhile)."""
        if flat.numel() != self.numel or (carry_from is not None and carry_from.numel() != self.numel):
            raise ValueError(f"flat vector of {flat.numel()} values for {self.numel} parameters")
        with self.lock, torch.no_grad():
            off = 0
            for p in self.module.parameters():
                n = p.numel()
                src = flat[off:off + n].view(p.shape)
                if carry_from is None:
                    p.copy_(src)
                else:       # flat + (p - start): exactly flat where nothing moved
                    start = carry_from[off:off + n].view(p.shape).to(p.device, p.dtype)
                    p.copy_(src.to(p.device, p.dtype) + (p - start))
                off += n
            if self.on_write is not None:
                self.on_write()


@dataclass
class MergeReport:
    """Outcome of one merge epoch on one replica. ``status``: ``merged`` | ``alone`` (no peer ready,
    or no participant did any work) | ``late`` (a peer merged this epoch already: pull its weights) |
    ``abandoned``. Bytes are encoded message bodies this replica sent / received for the merge (as
    client and as server). ``weights``: each participant's weight in the mean (merge weight x work)."""

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
    weights: dict[str, float] = field(default_factory=dict)
    work: float = 0.0

    @property
    def applied(self) -> bool:
        return self.status == "merged"


class _ShardReduce:
    """A reducer's state for one shard: chunks streaming in from every participant, reduced in order."""

    def __init__(self, chunks: list[tuple[int, int]], participants: Iterable[str]):
        self.chunks = chunks
        self.inbox: dict[int, dict[str, torch.Tensor]] = {}     # chunk -> sender -> float32 values
        self.got: dict[str, int] = {p: 0 for p in participants}  # chunks received per sender (in order)
        self.contribution_h = {p: hashlib.sha256() for p in self.got}
        self.reduced = 0                                        # chunks reduced so far
        self.means: list[torch.Tensor] = []
        self.shard_h, self.momentum_h = hashlib.sha256(), hashlib.sha256()
        self.progress = asyncio.Event()

    @property
    def done(self) -> bool:
        return self.reduced >= len(self.chunks)


@dataclass
class _JoinResult:
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
        self.result_ready: dict[int, asyncio.Event] = {}
        self.closed = False
        self.created = time.monotonic()

    def ready_event(self, s: int) -> asyncio.Event:
        return self.result_ready.setdefault(s, asyncio.Event())


class MergeEngine:
    """Merges one replica with its stage's other replicas (see the module docstring).

    ``me``: this replica's hotkey. ``params``: :class:`ModuleParams`. ``transport``: :class:`PeerTransport`.
    ``weights_fn(participants) -> {hotkey: weight}``: validators' merge weights (0 excludes; default 1).
    ``work_fn() -> float``: this replica's cumulative work (tokens trained); its weight in a merge is
    proportional to the work done since its last merge (None: every replica weighs the same).
    ``run_id``/``stage`` seed the plans. ``on_applied(report)``: called after a merge is applied.
    ``before_attempt()``: called (and awaited) before every attempt, e.g. to re-read the merge
    weights from the chain. ``observer``: signs and checks merge claims
    (:class:`~iota_subnet.merge.claims.MergeClaims`): outgoing slices, incoming slices, results.
    ``step_fn() -> int``: this replica's inner step (said in join answers; see :meth:`_join`).
    """

    def __init__(self, me: str, cfg: MergeConfig, params: ModuleParams, transport: Optional[PeerTransport] = None, *,
                 run_id: str = "", stage: int = 0,
                 weights_fn: Optional[Callable[[list[str]], dict[str, float]]] = None,
                 work_fn: Optional[Callable[[], float]] = None,
                 on_applied: Optional[Callable[[MergeReport], Any]] = None,
                 before_attempt: Optional[Callable[[], Any]] = None, observer: Any = None,
                 step_fn: Optional[Callable[[], int]] = None):
        self.me, self.cfg, self.params, self.transport = me, cfg, params, transport
        self.step_fn = step_fn
        self.observer = observer
        self.run_id, self.stage = run_id, stage
        self.weights_fn, self.work_fn, self.on_applied = weights_fn, work_fn, on_applied
        self.before_attempt = before_attempt
        self.anchor = params.read()                  # weights at the last merge (the run's seeded init before), host
        self.momentum = torch.zeros_like(self.anchor)
        self.merged_epoch = -1
        self.ready_epoch = -1
        self.ready_work = 0.0                        # work in the window of ready_epoch (reported at join)
        self.work_base = self._work_total()          # cumulative work at the last merge
        self.attempt_now = -1                        # the attempt of ready_epoch this replica is at
        self.current: Optional[tuple[int, int, list[str]]] = None   # (epoch, attempt, participants) in progress
        self.in_sync = True
        self.sessions: dict[tuple[int, int, str], _Session] = {}
        self.closed_epochs: dict[int, int] = {}      # epoch -> highest attempt closed
        #: the lowest label the next merge may use: one above the highest epoch a peer (same merged
        #: state) was found to have closed without merging (see :meth:`_join`)
        self.label_floor = -1
        self.reports: list[dict] = []                # mismatch evidence, for validators
        self.history: list[MergeReport] = []
        self._bytes = [0, 0]
        self._lock = asyncio.Lock()                  # one merge at a time
        self.liveness = PeerLiveness(cfg.join_timeout_s)   # peers found gone: probed, not waited for

    # ------------------------------------------------------------------ state
    def _work_total(self) -> float:
        return float(self.work_fn()) if self.work_fn is not None else 0.0

    def window_work(self) -> float:
        """Work done since the last merge (1.0 without ``work_fn``: every replica weighs the same)."""
        if self.work_fn is None:
            return 1.0
        return max(0.0, self._work_total() - self.work_base)

    def set_state(self, anchor: torch.Tensor, momentum: torch.Tensor, merged_epoch: int, *, write_params: bool = True,
                  keep_progress: bool = False) -> None:
        """Adopt a synced (or checkpointed) merge state all at once (tensors on any device; kept on the host).
        ``keep_progress`` (a replica late to a merge, see :meth:`merge`): the weights become the new
        anchor plus this replica's own progress since its old anchor, ``w = anchor + (w - old_anchor)``,
        and its work since its last merge still counts; its next merge contributes that progress (a
        pseudo-gradient applied one outer step late instead of dropped). Otherwise the weights become
        the anchor (with ``write_params``) and the window's work starts from zero."""
        if anchor.numel() != self.params.numel or momentum.numel() != self.params.numel:
            raise ValueError(f"state of {anchor.numel()}/{momentum.numel()} values for {self.params.numel} parameters")
        anchor = anchor.detach().to("cpu", torch.float32).reshape(-1).clone()
        momentum = momentum.detach().to("cpu", torch.float32).reshape(-1).clone()
        if keep_progress:
            self.params.write(anchor, carry_from=self.anchor)
        elif write_params:
            self.params.write(anchor)
            self.work_base = self._work_total()
        self.anchor, self.momentum = anchor, momentum
        self.merged_epoch = int(merged_epoch)

    def skip(self, epoch: int) -> None:
        """This replica will not merge ``epoch`` (its lane jumped it past that boundary): its join
        answers say the epoch is closed, so peers at the boundary do not wait for it."""
        self.closed_epochs[int(epoch)] = max(self.closed_epochs.get(int(epoch), -1), self.cfg.max_attempts)

    def next_epoch(self, epoch: int) -> int:
        """The epoch label a merge proposed at ``epoch`` runs at: never one this replica merged or
        closed already, nor one its peers closed (its inner steps may lag the labels after a restart
        or a relabel)."""
        return max(int(epoch), self.merged_epoch + 1, max(self.closed_epochs, default=-1) + 1, self.label_floor)

    def status(self) -> dict:
        return {"merged_epoch": self.merged_epoch, "ready_epoch": self.ready_epoch, "in_sync": self.in_sync,
                "merges": sum(1 for r in self.history if r.applied), "abandoned": sum(1 for r in self.history
                                                                                      if r.status == "abandoned"),
                "mismatch_reports": len(self.reports), "window_work": self.window_work(),
                "suspect_peers": self.liveness.status(),
                "last": None if not self.history else {k: getattr(self.history[-1], k) for k in
                                                      ("epoch", "status", "attempts", "participants", "missing",
                                                       "bytes_sent", "bytes_received", "wall_s", "reason",
                                                       "weights")}}

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
            ack = self._on_contribute(msg, caller)
            await self._throttle(msg)
            return ack
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
                         participants=list(cur[2]) if cur else [], in_sync=self.in_sync, work=self.ready_work,
                         inner_step=self._inner_step())

    def _inner_step(self) -> int:
        return int(self.step_fn()) if self.step_fn is not None else -1

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
        if sess.plan is None:
            if len(sess.raw) > 4 * 64:
                raise ProtocolError(Outcome.BUSY, "too many early contributions")
            sess.raw.append((caller, msg))
        else:
            self._accept(sess, caller, msg.shard_index, msg.chunk, msg.offset, x)
        return MergeAck(run_id=self.run_id, stage=self.stage, status="ok")

    async def _throttle(self, msg: MergePayload) -> None:
        """Backpressure: acknowledge chunk ``c`` only once this replica has a plan for it and the shard's
        reduced chunks are at most :data:`STREAM_WINDOW` behind (or the phase deadline passes)."""
        sess = self.sessions.get((msg.epoch, msg.attempt, msg.plan_id))
        if sess is None:
            return
        deadline = time.monotonic() + self.cfg.phase_timeout_s
        try:
            await asyncio.wait_for(sess.planned.wait(), timeout=self.cfg.phase_timeout_s)
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

    def _accept(self, sess: _Session, sender: str, s: int, c: int, offset: int, x: torch.Tensor) -> None:
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
            if prev is not None and not torch.equal(prev, x):
                raise ProtocolError(Outcome.FORBIDDEN, f"{sender[:10]} sent two different chunks {c} for shard {s}")
            return
        if c > got:
            raise ProtocolError(Outcome.MALFORMED, f"chunk {c} of shard {s} before chunk {got}: chunks go in order")
        red.inbox.setdefault(c, {})[sender] = x
        red.got[sender] = c + 1
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
            off, n = red.chunks[c]
            mean = weighted_mean([(plan.weight(p), box[p]) for p in order])
            new, mom = outer_step(self.anchor[off:off + n], self.momentum[off:off + n], mean, lr=self.cfg.outer_lr,
                                  mu=self.cfg.outer_momentum, nesterov=self.cfg.nesterov)
            for h, t in ((red.shard_h, new), (red.momentum_h, mom)):
                for view in host_bytes(t):
                    h.update(view)
            red.means.append(mean)
            red.reduced += 1
        red.progress.set()

    def _adopt_raw(self, sess: _Session) -> None:
        for sender, msg in sess.raw:
            try:
                x = dequantize(msg.shard, msg.scales, msg.quant, self.cfg.int8_block)
                self._accept(sess, sender, msg.shard_index, msg.chunk, msg.offset, x)
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
        served = sess.served.get(msg.shard_index)
        if not msg.with_tensor or served is None:
            return res
        if not 0 <= msg.chunk < len(served):
            raise ProtocolError(Outcome.BAD_SHAPE, f"shard {msg.shard_index} has {len(served)} chunks, not {msg.chunk}")
        return MergeResult(**{**res.__dict__, "chunk": msg.chunk, "mean": served[msg.chunk]})

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
                            quant=self.cfg.quantization, shard=q, scales=sc)

    # ------------------------------------------------------------------ client side
    async def _call(self, peer: str, route: str, msg: Message, rtype: type) -> Any:
        if peer == self.me:
            raise RuntimeError("no self calls")
        reply, sent, received = await self.transport.call(peer, route, msg, rtype)
        self._count(sent, received)
        return reply

    async def _join(self, epoch: int, attempt: int, peers: list[str], exclude: set[str],
                    deadline: Optional[float] = None) -> "_JoinResult":
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
        a common epoch again at their next boundary. (Moving to the peer's next label at once, as
        before, paused the lane until the join deadline for a peer a whole merge window away: with
        inner steps of seconds, 30-40 s waits that ended alone anyway; chaos run, 2026-12-02.)

        A suspect peer whose answer puts it within one inner step of this replica's boundary (its
        lane is running the window's last step) is waited for like a trusted one: lanes paced by the
        validator reach a boundary up to a step apart, and the short grace for suspects (a quarter of
        the join timeout) made a replica once found gone merge alone at every later boundary, since
        it never took part in a merge again (chaos run, 2026-12-02). So is a suspect whose inner step
        advances while this replica waits and is at most half a window (``every_steps // 2``, at least
        one step) behind, its last step within a grace period: its lane is training toward the
        boundary. Lanes can reach a boundary more than a step apart (a validator restart, a
        reroute): the first replica gave up on its peer after the grace, and the peer, arriving
        seconds later, found the epoch closed and went alone too (18 of the 41 "alone" merges of
        the chaos run at 832facd were the second of such a pair). A peer that does not advance (a
        spare), or stopped advancing a grace period ago, is still given up."""
        started = time.monotonic()
        if deadline is None:
            deadline = started + (self.cfg.join_timeout_s if attempt == 0
                                  else self.cfg.join_timeout_s + self.cfg.phase_timeout_s)
        w = self._weights([p for p in peers if p != self.me])
        want = [p for p in peers if p != self.me and p not in exclude and w.get(p, 1.0) > 0]
        out = _JoinResult(works={self.me: self.ready_work})
        ready: set[str] = set()
        closed_at: dict[str, int] = {}
        my_step = self._inner_step()
        near: set[str] = set()                  # answered within one inner step of this boundary
        first_step: dict[str, int] = {}         # each peer's inner step at its first answer in this join
        moved: dict[str, tuple[int, float]] = {}  # each peer's latest inner step and when it got there
        behind_ok = max(1, int(self.cfg.every_steps) // 2)
        first = True
        while True:
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
                    if r.merged_epoch > self.merged_epoch:
                        out.ahead.append(p)       # it holds newer merged weights: this replica is late
                    elif r.merged_epoch < self.merged_epoch or not r.in_sync:
                        # behind: it pulls first, never mixing its old state into this merge. One at this
                        # boundary (near) is waited for, up to the join deadline: at the boundary it finds
                        # itself late, pulls and joins again with the merged state and its window's work
                        # (``keep_progress``). Whether it has proposed yet does not matter, so that every
                        # peer decides the same way. Dropping it made a replica late once late at every
                        # boundary, its work discarded each time (chaos run at 4fbca7f: stage 2 merged
                        # with 2 of 3 replicas all run)
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
            epoch = self.next_epoch(epoch)
            rep = MergeReport(epoch=epoch)
            work_at_ready = self._work_total()
            self.ready_work = rep.work = self.window_work()   # fixed while ready: every peer reads the same value
            self.ready_epoch = epoch
            exclude: set[str] = set()
            unreachable: set[str] = set()          # peers that could not be reached at a join
            not_ready: set[str] = set()            # peers waited for that never became ready
            join_deadline = t0 + self.cfg.join_timeout_s
            relabels = 0
            try:
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
                    joined = await self._join(epoch, attempt, peer_list, exclude,
                                              deadline=max(join_deadline, time.monotonic() + 0.5) if attempt == 0
                                              else None)
                    participants, works = joined.participants, joined.works
                    unreachable |= joined.gone
                    not_ready |= joined.not_ready
                    self.liveness.suspect(joined.gone, "unreachable at a merge join")
                    if joined.relabel > epoch and relabels < MAX_RELABELS:   # the stage merges at a later epoch
                        relabels += 1
                        logger.info(f"merge: epoch {epoch} -> {joined.relabel} (the stage's other replicas are "
                                    f"there with the same merged state)")
                        self.closed_epochs[epoch] = max(self.closed_epochs.get(epoch, -1), self.cfg.max_attempts)
                        epoch = rep.epoch = self.ready_epoch = joined.relabel
                        seed = epoch_seed(self.run_id, self.stage, epoch)
                        exclude.clear()
                        attempt = -1
                        continue
                    if joined.closed >= epoch:          # peers went past this epoch: meet them above it next time
                        self.label_floor = max(self.label_floor, joined.closed + 1)
                    if joined.jump > attempt:           # the peers gave up on this attempt: follow them
                        self.closed_epochs[epoch] = max(self.closed_epochs.get(epoch, -1), attempt)
                        attempt = joined.jump - 1
                        continue
                    if joined.ahead:
                        rep.status, rep.reason = "late", (f"{len(joined.ahead)} peer(s) merged a later epoch than "
                                                          f"{self.merged_epoch} already")
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
                        if joined.closed >= epoch:
                            rep.reason += (f" (the others closed epoch {joined.closed} without merging; the next "
                                           f"merge is labelled {self.label_floor} or later)")
                        return rep
                    works = cap_work({p: works.get(p, 0.0) for p in participants})
                    contrib = {p: weights[p] * works[p] for p in participants}
                    rep.weights = dict(contrib)
                    if not sum(contrib.values()) > 0:
                        rep.status, rep.reason = "alone", "no participant did any work in this window"
                        return rep
                    plan = MergePlan.make(epoch, attempt, seed, participants, self.params.numel, contrib,
                                          chunk_numel=self.cfg.chunk_numel)
                    self.current = (epoch, attempt, list(plan.participants))
                    ok, missing, why = await self._allreduce(plan, rep)
                    self.closed_epochs[epoch] = attempt
                    if ok:
                        rep.status, rep.missing = "merged", sorted(exclude | (unreachable - set(participants)))
                        self.work_base = work_at_ready
                        self.liveness.trust(participants)
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
                    self.liveness.suspect(missing, "missing from a merge attempt")
                    rep.missing = sorted(exclude)
                    logger.info(f"merge epoch {epoch} attempt {attempt} failed ({why}); excluding {sorted(missing)}")
                rep.status = "abandoned"
                return rep
            finally:
                self.liveness.suspect(unreachable, "unreachable at a merge join")
                self.liveness.suspect(exclude, "missing from a merge attempt")
                self.liveness.suspect(not_ready, "not ready by the join deadline")
                self.current = None
                self.ready_epoch = -1
                self.ready_work = 0.0
                self.attempt_now = -1
                if rep.status != "late":            # late: the caller pulls, then joins again or closes it (skip)
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
        current = await asyncio.to_thread(self.params.read)        # host float32 [P]
        delta = self.anchor - current
        carry = current if self.cfg.overlap else None              # the overlapped apply adds progress since now
        del current
        quant, block = self.cfg.quantization, self.cfg.int8_block
        mine = plan.shards_of(self.me)
        sess.plan = plan                                           # from here contributions are accepted
        for s in mine:
            sess.reduce[s] = _ShardReduce(plan.chunks(s), plan.participants)
        for s in range(plan.num_shards):
            parts = []
            for c, (off, n) in enumerate(plan.chunks(s)):
                q, sc = quantize(delta[off:off + n], quant, block)
                parts.append(dequantize(q, sc, quant, block))
                sess.mine_wire[(s, c)] = (q, sc)
            sess.mine[s] = parts
        claims: dict[int, dict] = {}
        if self.observer is not None:                              # signed contribution claims (merge/claims.py)
            claims = await asyncio.to_thread(self.observer.on_contributions, plan,
                                             {s: torch.cat(parts) for s, parts in sess.mine.items()}, [])
        sess.planned.set()
        self._adopt_raw(sess)
        for s in mine:
            for c, x in enumerate(sess.mine[s]):
                self._accept(sess, self.me, s, c, plan.chunks(s)[c][0], x)

        async def stream(r: str, s: int):
            """Chunks of my slice of shard ``s`` to reducer ``r``, in order, one at a time."""
            chunks = plan.chunks(s)
            try:
                for c, (off, _) in enumerate(chunks):
                    q, sc = sess.mine_wire[(s, c)]
                    await self._call(r, "/merge/contribute", MergePayload(
                        run_id=self.run_id, stage=self.stage, epoch=plan.epoch, attempt=plan.attempt,
                        plan_id=plan.plan_id, shard_index=s, num_shards=plan.num_shards, chunk=c,
                        num_chunks=len(chunks), offset=off, total_numel=plan.total_numel,
                        weight=plan.weight(self.me), quant=quant, shard=q, scales=sc,
                        info={"claim": claims[s]} if s in claims else {}), MergeAck)
                return None
            except Exception as e:  # noqa: BLE001 - a refusal or an unreachable peer
                return r, e
        streams = [(r, s) for s in range(plan.num_shards) for r in dict.fromkeys(plan.reducers[s]) if r != self.me]
        reducers = asyncio.gather(*(self._reduce(sess, s) for s in mine))
        send_res = await asyncio.gather(*(stream(r, s) for r, s in streams))
        unreachable: set[str] = set()
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

        # gather + verify, applying the outer step chunk by chunk into the new anchor and momentum
        new_anchor = torch.empty_like(self.anchor)
        new_momentum = torch.empty_like(self.momentum)
        done: set[int] = set()
        missing: set[str] = set(unreachable)
        reasons: list[str] = []

        def apply_chunk(off: int, mean: torch.Tensor) -> None:
            n = mean.numel()
            new, mom = outer_step(self.anchor[off:off + n], self.momentum[off:off + n], mean, lr=self.cfg.outer_lr,
                                  mu=self.cfg.outer_momentum, nesterov=self.cfg.nesterov)
            new_anchor[off:off + n] = new
            new_momentum[off:off + n] = mom

        async def result(r: str, s: int, c: int, with_tensor: bool) -> Any:
            try:
                return await self._call(r, "/merge/result", MergeResultRequest(
                    run_id=self.run_id, stage=self.stage, epoch=plan.epoch, attempt=plan.attempt, plan_id=plan.plan_id,
                    shard_index=s, chunk=c, with_tensor=with_tensor), MergeResult)
            except Exception as e:  # noqa: BLE001
                return e

        async def gather_one(s: int) -> None:
            a, b = plan.reducers[s]
            chunks = plan.chunks(s)
            claims: dict[str, MergeResult] = {}
            got: dict[str, Any] = {}
            served_h = hashlib.sha256()
            chunks_ok = True
            if self.me in (a, b):
                mine_res = sess.results.get(s)
                if mine_res is None or mine_res.status != "ok":
                    missing.update(mine_res.missing if mine_res is not None else [])
                    reasons.append(f"shard {s}: incomplete here")
                    return
                claims[self.me] = mine_res
                prim = self.me
                other = [r for r in (a, b) if r != self.me]
                if other:
                    got[other[0]] = await result(other[0], s, 0, False)
                for (off, _), mean in zip(chunks, sess.honest[s]):
                    apply_chunk(off, mean)
                served_digest = mine_res.mean_sha256
            else:
                prim = plan.primary_for(self.me, s)
                sec = b if prim == a else a
                first, got[sec] = await asyncio.gather(result(prim, s, 0, True), result(sec, s, 0, False))
                got[prim] = first
                served_digest = None
                if isinstance(first, MergeResult) and first.status == "ok":
                    hashes = list(first.chunk_sha256)
                    chunks_ok = len(hashes) == len(chunks)
                    reply = first
                    for c, (off, n) in enumerate(chunks):
                        if c:
                            reply = await result(prim, s, c, True)
                            if not isinstance(reply, MergeResult):
                                got[prim] = reply           # unreachable mid-way
                                break
                        m = reply.mean
                        if m is None or m.dtype != torch.float32 or m.numel() != n:
                            chunks_ok = False
                            break
                        for view in host_bytes(m):
                            served_h.update(view)
                        if not chunks_ok or tensor_sha256(m) != hashes[c]:
                            chunks_ok = False
                            continue                    # keep hashing what it serves (evidence), apply nothing
                        apply_chunk(off, m)
                    else:
                        served_digest = served_h.hexdigest()
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
            hashes = {r: c.mean_sha256 for r, c in claims.items()}
            agree = len(set(hashes.values())) == 1 and len({(tuple(c.contributors), tuple(c.weights))
                                                             for c in claims.values()}) == 1
            if agree and chunks_ok and served_digest == next(iter(hashes.values())):
                done.add(s)
                return
            # mismatch: recompute as a third party from every participant's chunks
            recomputed = await self._recompute(plan, sess, s)
            if recomputed is None:
                missing.update(r for r in (a, b) if r != self.me)
                reasons.append(f"shard {s}: mismatch and contributions unavailable")
                return
            digest = sha256_of(recomputed)
            served = {} if prim == self.me else {prim: served_digest or served_h.hexdigest()}
            wrong = sorted(r for r in (a, b) if hashes.get(r) != digest or served.get(r, digest) != digest)
            ev = {"epoch": plan.epoch, "attempt": plan.attempt, "plan_id": plan.plan_id, "shard": s,
                  "reducers": [a, b], "claimed_sha256": hashes, "served_sha256": served, "recomputed_sha256": digest,
                  "wrong": wrong, "reporter": self.me, "stage": self.stage, "run_id": self.run_id,
                  "contribution_sha256": {r: dict(zip(c.contributors, c.contribution_sha256)) for r, c in claims.items()},
                  "results": {r: dict(c.info) for r, c in claims.items() if c.info},   # reducers' signed claims
                  "time": time.time()}
            self.reports.append(ev)
            rep.mismatches.append(ev)
            logger.warning(f"merge epoch {plan.epoch} shard {s}: reducers disagree; recomputed, wrong: "
                           f"{[w[:10] for w in wrong]}")
            for (off, _), mean in zip(chunks, recomputed):
                apply_chunk(off, mean)
            done.add(s)

        prog = Progress(4 * sum(plan.bounds[s][1] for s in range(plan.num_shards)), f"merge epoch {plan.epoch}: "
                        "gather", "B", unit_scale=True, min_total=64 << 20)

        async def gather_counted(s: int) -> None:
            await gather_one(s)
            prog.update(4 * plan.bounds[s][1])
        with prog:
            await asyncio.gather(*(gather_counted(s) for s in range(plan.num_shards)))
        if len(done) != plan.num_shards:
            return False, sorted(missing - {self.me}), "; ".join(reasons[:4]) or "incomplete"

        # all or nothing: one write under the worker lock
        await asyncio.to_thread(self.params.write, new_anchor, carry)
        self.anchor, self.momentum, self.merged_epoch = new_anchor, new_momentum, plan.epoch
        rep.weights_sha256 = tensor_sha256(new_anchor)
        return True, [], ""

    async def _reduce(self, sess: _Session, s: int) -> None:
        """Wait until shard ``s`` is reduced (chunks are reduced as they arrive, see :meth:`_advance`)
        or the phase deadline passes, then publish the result."""
        plan, red = sess.plan, sess.reduce[s]
        deadline = time.monotonic() + self.cfg.phase_timeout_s
        while not red.done and time.monotonic() < deadline:
            red.progress.clear()
            try:
                await asyncio.wait_for(red.progress.wait(), timeout=max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
        base = dict(run_id=self.run_id, stage=self.stage, epoch=plan.epoch, attempt=plan.attempt,
                    plan_id=plan.plan_id, shard_index=s)
        if not red.done:
            missing = [p for p in plan.participants if red.got[p] < len(red.chunks)]
            sess.results[s] = MergeResult(**base, status="incomplete", missing=missing)
        else:
            order = list(plan.participants)
            honest = red.means
            served = self.mean_to_serve(s, honest)
            sess.honest[s], sess.served[s] = honest, served
            sess.results[s] = MergeResult(**base, status="ok", contributors=order,
                                          weights=[plan.weight(p) for p in order],
                                          contribution_sha256=[red.contribution_h[p].hexdigest() for p in order],
                                          mean_sha256=sha256_of(served), shard_sha256=red.shard_h.hexdigest(),
                                          momentum_sha256=red.momentum_h.hexdigest(),
                                          chunk_sha256=[tensor_sha256(t) for t in served])
            if self.observer is not None:
                await asyncio.to_thread(self.observer.on_result, sess.results[s], torch.cat(served), plan.bounds[s][0],
                                        plan.chunk_numel)
        sess.ready_event(s).set()

    def mean_to_serve(self, shard_index: int, mean: list[torch.Tensor]) -> list[torch.Tensor]:
        """The mean pseudo-gradient of shard ``shard_index`` this replica, as its reducer, signs and
        serves: ``mean`` itself (its chunks, float32, as reduced). A subclass may override it; the
        replicas gathering the shard check what it serves against their own recomputation."""
        return mean

    async def _recompute(self, plan: MergePlan, sess: _Session, s: int) -> Optional[list[torch.Tensor]]:
        """Third-party check: fetch shard ``s`` of every participant's pseudo-gradient chunk by chunk and
        recompute the mean (a list of chunks), or None when a participant cannot provide its chunks."""
        out = []
        for c, (off, n) in enumerate(plan.chunks(s)):
            slices: dict[str, torch.Tensor] = {self.me: sess.mine[s][c]}

            async def get(p: str):
                try:
                    m = await self._call(p, "/merge/contribution", MergeResultRequest(
                        run_id=self.run_id, stage=self.stage, epoch=plan.epoch, attempt=plan.attempt,
                        plan_id=plan.plan_id, shard_index=s, chunk=c), MergePayload)
                    x = dequantize(m.shard, m.scales, m.quant, self.cfg.int8_block)
                    if m.quant != self.cfg.quantization or (m.offset, x.numel()) != (off, n):
                        return
                    slices[p] = x
                except Exception as e:  # noqa: BLE001
                    logger.debug(f"merge: contribution fetch from {p[:10]} failed: {e}")
            await asyncio.gather(*(get(p) for p in plan.participants if p != self.me))
            if len(slices) != len(plan.participants):
                return None
            out.append(weighted_mean([(plan.weight(p), slices[p]) for p in plan.participants]))
        return out
