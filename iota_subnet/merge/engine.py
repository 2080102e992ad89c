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
4. **reduce**: chunk ``c`` of a shard is reduced (weighted mean in the plan's participant order) as
   soon as every participant's chunk ``c`` is there;
   a reducer acknowledges a chunk only when the shard's reduced chunks are at most
   :data:`.serve.STREAM_WINDOW` behind it, so it buffers a bounded number of chunks per contributor. A
   shard is ``incomplete`` (its ``missing`` list names who) when the contributors it waits for
   moved no byte for ``merge.progress_timeout_s``, or at the phase deadline derived from the
   scatter's bytes and the declared uplink rate (:mod:`.deadlines`). With signed claims a reducer
   then asks the shard's other reducer for its result; when both signed the same statement, its
   result carries the other's signature too (``info["co"]``, :func:`.claims.co_signature`).
5. **gather + verify**: for every shard ``me`` fetches the result header from one reducer, with the
   other reducer's co-signature (without one, ``me`` asks the other reducer for its header itself),
   then the mean chunk by chunk from the same reducer (``/merge/result``). Equal hashes and
   contributions roots (and chunks matching them): accepted.
   Different hashes, or chunks that do not match: ``me`` acts as the third party, fetches every
   participant's chunks (``/merge/contribution``), recomputes the mean, uses it and records evidence
   naming the reducer(s) whose hash differs (:attr:`MergeEngine.reports`).
6. **apply** (only with every shard verified): weights, anchor and momentum replaced together under the
   worker lock (with ``merge.overlap``: the merged weights plus the local progress made while the
   merge ran); else nothing changes and the attempt is retried without the missing / unreachable
   replicas, at most ``merge.max_attempts`` times; then the epoch is abandoned (the next epoch's
   pseudo-gradient covers both). A retry over survivors of the failed attempt is a *repair*
   (:mod:`.plan`): the same shards and reducers (a dead reducer's shards get a live one), every
   shard's mean over the survivors (the same contributor set everywhere; a member that died, mid-scatter
   or as a reducer after its scatter, is no contributor any more: its slices may be incomplete, and
   forwarding them would rest on its partner's word), reduced again from the chunks the reducers kept
   (:class:`.serve._ShardReduce`), so only the dead reducers' shards travel again; means are fetched
   only once every shard's header is in (step 5), so a failed attempt fetched none. A death costs
   the survivors about its shards' bytes, not a second merge. A retry after a plan mismatch, or with
   a replica that was not in the failed attempt, is planned afresh.

Contributions for a closed or already merged epoch are refused with ``Outcome.LATE`` (410): non-fatal,
the sender pulls the merged weights. A straggler's slices are only ever used by an attempt whose
plan names it and that completes for every shard; otherwise they are dropped with the attempt.

Memory per replica (host, float32 values): anchor and momentum (2P), the pseudo-gradient (P; plus
its dequantized copy with int8 / bf16 payloads), the new anchor and momentum while they are built
(2P), the means of the two shards it reduces (2P/N), every contributor's chunks of the shards it
reduces as received (about 2P in the payload dtype, until the epoch's merge ends; kept for a repair,
with three participants or more), and with ``merge.overlap`` the weights read at the start (P).

:class:`MergeEngine` holds the replica's merge state and runs the epoch/attempt state machine
(:meth:`MergeEngine.merge`); its parts live in their own modules: :mod:`.join` (step 1),
:mod:`.allreduce` (steps 3, 5, 6 and the third-party recompute), :mod:`.serve` (the reducer side,
step 4: the ``/merge/*`` routes peers call), :mod:`.params` (the flat host copy of the parameters).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
from loguru import logger

from iota_subnet.config import MergeConfig
from iota_subnet.protocol import Message, MergeResult, payload_nbytes, tensor_sha256

from .allreduce import AllReduceAttempt, sha256_of
from .claims import contributions_root
from .deadlines import FLOOR_RATE_BPS, LinkProgress, call_allowance_s, phase_deadline_s, scatter_bytes
from .join import MergeJoining
from .liveness import PeerLiveness
from .outer import rounded
from .params import ModuleParams
from .replay import AppliedMerge
from .report import MergeReport
from .plan import MergePlan, epoch_seed
from .serve import MergeServing, _Session
from .sparse import ErrorFeedback

#: Times one merge may move to a later epoch label the stage's other replicas are at.
MAX_RELABELS = 8


class PeerTransport(Protocol):
    """How the engine calls a peer: ``await call(peer_hotkey, route, msg, response_type)``; raises
    :class:`~iota_subnet.protocol.ProtocolError` for refusals and any other exception when unreachable.
    Returns ``(reply, bytes_sent, bytes_received)``."""

    async def call(self, peer: str, route: str, msg: Message, response_type: type) -> tuple[Any, int, int]: ...


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


@dataclass(frozen=True)
class MergeEngineOptions:
    """What a :class:`MergeEngine` reads from and tells the rest of its replica (every field optional).

    ``weights_fn(participants) -> {hotkey: weight}``: validators' merge weights (0 excludes; None:
    every weight 1). ``work_fn() -> float``: this replica's cumulative work (tokens trained); its
    weight in a merge is proportional to the work done since its last merge (None: every replica
    weighs the same). ``on_applied(report)``: called (and awaited when it returns a coroutine) after a
    merge is applied. ``before_attempt()``: called (and awaited) before every attempt, e.g. to re-read
    the merge weights from the chain. ``observer``: signs and checks merge claims
    (:class:`~iota_subnet.merge.claims.MergeClaims`): outgoing slices, incoming slices, results.
    ``step_fn() -> int``: this replica's inner step (said in join answers; None: -1).
    ``spare_fn() -> bool``: True while this replica has trained nothing in any lane (a spare never
    handed one; said in join answers, so that its stage's replicas do not wait for it at a boundary
    it cannot reach; None: never).
    """

    weights_fn: Optional[Callable[[list[str]], dict[str, float]]] = None
    work_fn: Optional[Callable[[], float]] = None
    on_applied: Optional[Callable[[MergeReport], Any]] = None
    before_attempt: Optional[Callable[[], Any]] = None
    observer: Any = None
    step_fn: Optional[Callable[[], int]] = None
    spare_fn: Optional[Callable[[], bool]] = None


class MergeEngine(MergeServing, MergeJoining, AllReduceAttempt):
    """Merges one replica with its stage's other replicas (see the module docstring).

    ``me``: this replica's hotkey. ``params``: :class:`ModuleParams`. ``transport``: :class:`PeerTransport`.
    ``run_id``/``stage`` seed the plans. ``options``: :class:`MergeEngineOptions` (merge weights, work,
    inner step, claims observer, callbacks); its fields are kept as the engine's attributes of the
    same names.
    """

    def __init__(self, me: str, cfg: MergeConfig, params: ModuleParams, transport: Optional[PeerTransport] = None, *,
                 run_id: str = "", stage: int = 0, options: MergeEngineOptions = MergeEngineOptions()):
        self.me, self.cfg, self.params, self.transport = me, cfg, params, transport
        self.step_fn, self.spare_fn = options.step_fn, options.spare_fn
        self.observer = options.observer
        self.run_id, self.stage = run_id, stage
        self.weights_fn, self.work_fn, self.on_applied = options.weights_fn, options.work_fn, options.on_applied
        self.before_attempt = options.before_attempt
        self.anchor = params.read()                  # weights at the last merge (the run's seeded init before), host
        self.momentum = torch.zeros_like(self.anchor)
        #: top-k merges: what this replica has not sent yet (:mod:`.sparse`; zero for a fresh joiner)
        self.feedback = ErrorFeedback(cfg.error_feedback if cfg.quantization == "topk" else None)
        self.merged_epoch = -1
        #: what the last applied merge applied (its mean pseudo-gradient as the gather carried it): a
        #: donor keeps it for replicas that replay it (:mod:`.replay`)
        self.last_applied: Optional[AppliedMerge] = None
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
        #: when each peer last made progress: whole messages, or the floor rate's bytes inside them
        self.link = LinkProgress(min_bytes=int(FLOOR_RATE_BPS / 8 * cfg.progress_timeout_s / 2))
        #: the transport reports bytes inside a message (then a call is cut on progress alone)
        self._byte_progress = hasattr(transport, "on_progress")
        if self._byte_progress:
            transport.on_progress = self.link.moving

    # ------------------------------------------------------------------ state
    def _work_total(self) -> float:
        return float(self.work_fn()) if self.work_fn is not None else 0.0

    def _inner_step(self) -> int:
        return int(self.step_fn()) if self.step_fn is not None else -1

    def _spare(self) -> bool:
        return bool(self.spare_fn()) if self.spare_fn is not None else False

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
        if not keep_progress:               # its own unsent progress is gone with its weights
            self.feedback.reset()
        self.anchor, self.momentum = anchor, momentum
        self.merged_epoch = int(merged_epoch)

    def merged(self, anchor: torch.Tensor, momentum: torch.Tensor, epoch: int,
               applied: Optional[AppliedMerge] = None) -> None:
        """The all-reduce of ``epoch`` applied: ``anchor`` and ``momentum`` (float32 [P], host) are this
        replica's new anchor and outer momentum (the parameters were written already); ``applied``:
        the mean it applied on the state of the previous merged epoch (:attr:`last_applied`)."""
        self.last_applied = applied
        self.anchor, self.momentum, self.merged_epoch = anchor, momentum, int(epoch)

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

    # ------------------------------------------------------------------ peers
    async def _call(self, peer: str, route: str, msg: Message, rtype: type) -> Any:
        if peer == self.me:
            raise RuntimeError("no self calls")
        if peer in self.link.stalled:
            raise ConnectionError(f"{peer[:10]} moved no byte for a progress timeout in this attempt")
        task = asyncio.ensure_future(self.transport.call(peer, route, msg, rtype))
        t0 = time.monotonic()
        pt = float(self.cfg.progress_timeout_s)
        allowance = 0.0
        if not self._byte_progress:         # no bytes seen inside a message: allow for its size
            reply_bytes = 4 * self.cfg.chunk_numel if route in ("/merge/result", "/merge/contribution") else 0
            allowance = call_allowance_s(self.cfg, payload_nbytes(msg) + reply_bytes)
        try:
            while True:
                idle = self.link.idle_s([peer], t0)
                left = max(pt - idle, t0 + allowance - time.monotonic())
                if left <= 0:
                    task.cancel()
                    self.link.stalled.add(peer)
                    raise ConnectionError(f"{peer[:10]}: no byte moved for {idle:.1f} s on {route}")
                done, _ = await asyncio.wait({task}, timeout=max(0.01, left))
                if done:
                    break
        except asyncio.CancelledError:
            task.cancel()
            raise
        reply, sent, received = task.result()
        self.link.note(peer, sent + received)
        self._count(sent, received)
        return reply

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
            src: Optional[_Session] = None         # the failed attempt a repair plan keeps the layout of
            try:
                seed = epoch_seed(self.run_id, self.stage, epoch)
                attempt = -1
                while attempt + 1 < self.cfg.max_attempts:
                    attempt += 1
                    self.attempt_now = attempt
                    self.link.stalled.clear()
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
                        attempt, src = -1, None
                        continue
                    if joined.closed >= epoch:          # peers went past this epoch: meet them above it next time
                        self.label_floor = max(self.label_floor, joined.closed + 1)
                    if joined.jump > attempt:           # the peers gave up on this attempt: follow them
                        self.closed_epochs[epoch] = max(self.closed_epochs.get(epoch, -1), attempt)
                        attempt, src = joined.jump - 1, None
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
                    if src is not None and not set(participants) <= set(src.plan.layout):
                        src = None                      # someone new: a fresh layout
                    plan = MergePlan.make(epoch, attempt, seed, participants, self.params.numel, contrib,
                                          chunk_numel=self.cfg.chunk_numel,
                                          base=None if src is None else (src.plan.base or (src.plan.attempt,
                                                                                           src.plan.participants)))
                    self.current = (epoch, attempt, list(plan.participants))
                    ok, missing, why = await (self._allreduce(plan, rep) if src is None
                                              else self._allreduce(plan, rep, src))
                    src = self.sessions.get((epoch, attempt, plan.plan_id))
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
                        src = None                      # the peers ran another layout: the next plan is fresh
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
                for (e, _, _), sess in self.sessions.items():   # the chunks kept for a repair: not needed any more
                    if e == epoch:
                        sess.carry = None
                        for red in sess.reduce.values():
                            red.kept = None
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

    async def _reduce(self, sess: _Session, s: int) -> None:
        """Wait until shard ``s`` is reduced (chunks are reduced as they arrive, see :meth:`_advance`),
        or the contributors holding up its next chunk moved no byte for ``merge.progress_timeout_s``,
        or the phase deadline passes (:mod:`.deadlines`), then publish the result."""
        plan, red = sess.plan, sess.reduce[s]
        t0 = time.monotonic()
        deadline = t0 + phase_deadline_s(self.cfg, self.phase_bytes(plan), self._byte_progress)
        pt = float(self.cfg.progress_timeout_s)
        reduced, since = red.reduced, t0
        while not red.done:
            now = time.monotonic()
            if red.reduced != reduced:
                reduced, since = red.reduced, now
            owing = [p for p in plan.participants if red.got[p] <= red.reduced and p != self.me]
            idle = self.link.idle_s(owing, since)
            if idle >= pt or now >= deadline:
                if idle >= pt:
                    self.link.stalled.update(owing)
                break
            red.progress.clear()
            try:
                await asyncio.wait_for(red.progress.wait(), timeout=max(0.01, min(pt - idle, deadline - now)))
            except asyncio.TimeoutError:
                pass
        base = dict(run_id=self.run_id, stage=self.stage, epoch=plan.epoch, attempt=plan.attempt,
                    plan_id=plan.plan_id, shard_index=s)
        if not red.done:
            missing = [p for p in plan.participants if red.got[p] < len(red.chunks)]
            sess.results[s] = MergeResult(**base, status="incomplete", missing=missing)
        else:
            order = list(plan.participants)
            honest = red.means
            served = self.mean_to_serve(s, honest)
            if served is honest:
                wire = red.wire
            else:                 # what a subclass serves travels in the gather's encoding too
                pairs = [rounded(t, self.cfg.gather_quant, self.cfg.int8_block) for t in served]
                served, wire = [x for x, _ in pairs], [w for _, w in pairs]
            sess.honest[s], sess.served[s], sess.served_wire[s] = honest, served, wire
            weights = [plan.weight(p) for p in order]
            hashes = [red.contribution_h[p].hexdigest() for p in order]
            sess.results[s] = MergeResult(**base, status="ok", contributions_root=contributions_root(order, weights, hashes),
                                          mean_sha256=sha256_of(served),
                                          chunk_sha256=[tensor_sha256(t) for t in served] if len(served) > 1 else [])
            if self.observer is not None:
                await asyncio.to_thread(self.observer.on_result, sess.results[s], torch.cat(served), plan.bounds[s][0],
                                        plan.chunk_numel, contributors=order, weights=weights,
                                        contribution_sha256=hashes,
                                        **({} if plan.base is None else {"base": [plan.base[0], list(plan.base[1])]}))
        sess.ready_event(s).set()
        if self.observer is not None and sess.results[s].status == "ok":
            await self._cosign(sess, s, deadline)
        sess.cosigned_event(s).set()

    def phase_bytes(self, plan: MergePlan) -> float:
        """Bytes this replica sends in the scatter of ``plan`` (:func:`.deadlines.scatter_bytes` of its
        participants, values and scatter encoding): what the phase deadlines of the attempt follow
        (:func:`.deadlines.phase_deadline_s`). A subclass whose messages stand for more bytes on the
        link than they hold (the simulation's virtual payloads, :mod:`iota_subnet.sim.virtual_merge`)
        may override it."""
        return scatter_bytes(len(plan.participants), plan.total_numel, self.cfg.scatter_quant, self.cfg.int8_block)

    def mean_to_serve(self, shard_index: int, mean: list[torch.Tensor]) -> list[torch.Tensor]:
        """The mean pseudo-gradient of shard ``shard_index`` this replica, as its reducer, signs and
        serves: ``mean`` itself (its chunks, float32, as reduced and rounded to the gather's encoding). A subclass may override it; the
        replicas gathering the shard check what it serves against their own recomputation."""
        return mean
