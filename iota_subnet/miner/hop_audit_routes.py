"""A miner's hop-audit routes (validators only; the three rounds of :mod:`iota_subnet.audit`):

* ``/audit/trace``   AuditTraceRequest -> AuditTraceCommit: recompute the hop's trace from what the
  audit window kept (:class:`~iota_subnet.miner.hop_store.HopStore`) with the weights version the
  receipt named, commit (opens a session ``audit_id``);
* ``/audit/project`` AuditProjectRequest -> AuditProjection: the projections for the validator's seed;
* ``/audit/open``    AuditOpenRequest -> AuditOpening: the requested rows with proofs (ends the session,
  unless ``more``: a replay audit opens a stage's weights in several parts, each within the
  prover's ``max_open_bytes``, and the last one ends it). What one session opens is bounded
  (:func:`open_budget`): its distinct parts together at most the bytes of every row of the layout's
  wire tensors and weights (or ``max_open_bytes``, if larger), and each part served at most
  ``1 + MAX_PART_REASKS`` times (the validator's re-asks of a part whose answer was lost); a request
  past either is refused ``MALFORMED`` and the session stays open for its other parts.

A validator whose connection dropped sends a round's request again, unchanged
(:mod:`iota_subnet.validator.auditing`): a round-1 request asked again while its trace runs waits for
that trace, and once it is done gets the same commitment; round 2 is answered again from the open
session; round 3's answer is kept for ``session_ttl_s`` (a caller's newest two, at most
``max_sessions`` in all: the openings only, never a trace) so the same request gets it again, and a
different round-3 request for a finished session is refused. Every round refreshes its session's
time to live.

Refusals are typed 4xx: ``LATE`` (410) for a hop or weights version outside the window,
``HASH_MISMATCH`` for a weights root other than the one kept for that version, ``MALFORMED`` for a
bad request, ``UNKNOWN_MICROBATCH`` for a session that does not exist (expired or never opened),
``BUSY`` (503) when ``max_sessions`` sessions are open or tracing, or ``max_per_caller`` of the
caller's traces are still running (one validator cannot hold every slot and make the miner refuse
the others). Sessions are dropped after round 3, after ``session_ttl_s`` seconds without a round, and when their
validator opens a new one: a validator audits a miner's hops one at a time
(:class:`iota_subnet.validator.auditing.AuditScheduler`), so a new round 1 from it means it gave up
on its older sessions (it timed out on them); a trace still running for a request it has since
superseded is discarded when it ends. Without that, the sessions a validator abandoned on a slow
(paused, overloaded) miner would fill its slots for two minutes and the miner's next answers would
be ``BUSY`` refusals, counted against it as unanswered audits (enough to flag an honest miner). The
trace runs on a worker thread, never on the stage's compute thread: audits do not wait for
training and training does not wait for audits (they share the CPU).
Memory: the trace of an open session (tiny: 63-177 MB; ``docs/hop-audit.md``).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from iota_subnet.audit import codec
from iota_subnet.audit.layout import LayoutError, TraceLayout
from iota_subnet.audit.prover import HopProver, OpenRequestError
from iota_subnet.protocol import (AuditOpening, AuditOpenRequest, AuditProjection, AuditProjectRequest,
                                  AuditTraceCommit, AuditTraceRequest, Outcome, ProtocolError)

from .hop_store import HopStore


@dataclass
class _Session:
    prover: HopProver
    layout: TraceLayout
    caller: str
    opened_at: float                 # time.monotonic() of its latest round (the time to live counts from it)
    lock: asyncio.Lock
    request: AuditTraceRequest       # round 1, and its answer: the same request again gets the same answer
    commit: AuditTraceCommit
    opened_bytes: int = 0            # round 3: bytes of the distinct parts served (``open_budget``)
    parts: dict[bytes, int] = field(default_factory=dict)   # round 3: a part's digest -> times served


#: times a round-3 part may be served again (its answer lost on the way: the validator's re-asks,
#: ``retry_delays_s``, two by default)
MAX_PART_REASKS = 2


def open_budget(layout: TraceLayout, max_open_bytes: int) -> int:
    """The most row-value bytes (``rows x width x 4``, :meth:`HopProver.check_request`'s count) the
    distinct parts of one audit session may open: every row of the layout's wire tensors and weights
    (their rows, not their columns: a replay opens each once, :func:`~iota_subnet.audit.replay.replay_openings`),
    or ``max_open_bytes`` (one sampled opening) if that is larger."""
    rows = sum(e.rows * e.width * 4 for e in layout.wire.values())
    rows += sum(e.rows * e.width * 4 for k, e in layout.weights.items() if not k.endswith("^T"))
    return max(int(max_open_bytes), rows)


def _part_digest(msg: AuditOpenRequest) -> bytes:
    return hashlib.sha256(json.dumps([msg.rows, msg.whole], sort_keys=True).encode()).digest()


@dataclass(frozen=True)
class HopAuditLimits:
    """How many hop audits a miner holds, and for how long (see the module docstring).

    ``max_sessions``: audits open (or tracing) at once, at most ``max_per_caller`` of one validator;
    ``session_ttl_s``: seconds a session (and a finished round 3's answer) is kept without a round;
    ``commit_wait_s``: seconds round 1 waits for the hashing of the weights version the hop used
    (then ``NOT_READY``); ``max_open_bytes``: the most row-value bytes one round-3 answer opens
    (:class:`~iota_subnet.audit.prover.HopProver`)."""

    max_sessions: int = 8
    max_per_caller: int = 2
    session_ttl_s: float = 180.0
    commit_wait_s: float = 30.0
    max_open_bytes: int = 64 << 20


class HopAuditRoutes:
    """The three routes over one stage's :class:`HopStore`. ``cfg``: the run config (layouts are
    built from it, never from the request); ``device``: where traces run; ``limits``:
    :class:`HopAuditLimits` (its fields are kept as attributes of the same names)."""

    def __init__(self, store: HopStore, cfg: Any, *, run_id: str, stage: int, device: Any = "cpu",
                 limits: HopAuditLimits = HopAuditLimits()):
        self.store, self.cfg, self.run_id, self.stage = store, cfg, run_id, int(stage)
        #: where traces run: the stage's own device (its GPU when it has one), in fp32
        self.device = torch.device(device)
        self.max_sessions, self.max_per_caller = int(limits.max_sessions), int(limits.max_per_caller)
        self.session_ttl_s, self.commit_wait_s = float(limits.session_ttl_s), float(limits.commit_wait_s)
        self.max_open_bytes = int(limits.max_open_bytes)
        self.micro_per_step = cfg.train.batch_size // cfg.train.micro_batch
        self.sessions: dict[str, _Session] = {}
        #: audit_id -> (caller, request, answer, time) of the latest finished sessions (round 3 asked again)
        self.opened: dict[str, tuple[str, AuditOpenRequest, AuditOpening, float]] = {}
        #: caller -> traces running for it; caller -> number of its latest round-1 request
        self.tracing: dict[str, int] = {}
        #: audit_id -> (caller, round-1 request, its trace) while it runs
        self.running: dict[str, tuple[str, AuditTraceRequest, asyncio.Task]] = {}
        self.latest: dict[str, int] = {}
        self.superseded = 0
        self.served = 0
        self.refused = 0

    def mount(self, server: Any) -> None:
        server.add_route("/audit/trace", self.trace, AuditTraceRequest, None)
        server.add_route("/audit/project", self.project, AuditProjectRequest, None)
        server.add_route("/audit/open", self.open, AuditOpenRequest, None)

    def prover(self, layout: Any, weights: Any, hop: Any) -> HopProver:
        """The prover of one audit of ``hop``: its trace runs on :attr:`device`."""
        return HopProver(layout, weights, hop.inputs(layout.direction), device=self.device,
                         max_open_bytes=self.max_open_bytes)

    def _check(self, msg: Any) -> None:
        if msg.run_id != self.run_id or msg.stage != self.stage:
            raise ProtocolError(Outcome.FORBIDDEN, f"this miner trains run {self.run_id!r} stage {self.stage}, not "
                                                   f"{msg.run_id!r} stage {msg.stage}")

    def _sweep(self) -> None:
        now = time.monotonic()
        for k in [k for k, s in self.sessions.items() if now - s.opened_at > self.session_ttl_s]:
            del self.sessions[k]
        for k in [k for k, o in self.opened.items() if now - o[3] > self.session_ttl_s]:
            del self.opened[k]

    def _session(self, audit_id: str, caller: str) -> _Session:
        self._sweep()
        s = self.sessions.get(audit_id)
        if s is None or s.caller != caller:
            raise ProtocolError(Outcome.UNKNOWN_MICROBATCH, f"no open audit session {audit_id[:40]!r} (expired, "
                                                            "finished or never opened)")
        s.opened_at = time.monotonic()
        return s

    # ---- round 1 ---------------------------------------------------------------------------------
    async def trace(self, msg: AuditTraceRequest, ctx: Any) -> AuditTraceCommit:
        self._check(msg)
        self._sweep()
        caller = ctx.caller_hotkey
        s = self.sessions.get(msg.audit_id)
        if s is not None and s.caller == caller and s.request == msg:     # its answer was lost on the way
            s.opened_at = time.monotonic()
            return s.commit
        run = self.running.get(msg.audit_id)
        if run is not None and run[0] == caller and run[1] == msg:        # asked again while it traces
            return await asyncio.shield(run[2])
        if not msg.audit_id or len(msg.audit_id) > 64 or msg.audit_id in self.sessions \
                or msg.audit_id in self.running:
            raise ProtocolError(Outcome.MALFORMED, "audit_id must be a fresh id of 1-64 characters")
        for k in [k for k, s in self.sessions.items() if s.caller == caller]:      # abandoned by their validator
            del self.sessions[k]
            self.superseded += 1
        mine = self.tracing.get(caller, 0)
        if len(self.sessions) + sum(self.tracing.values()) >= self.max_sessions or mine >= self.max_per_caller:
            raise ProtocolError(Outcome.BUSY, f"{len(self.sessions)} audits open, {sum(self.tracing.values())} "
                                              f"tracing ({mine} of yours); retry shortly")
        self.latest[caller] = turn = self.latest.get(caller, 0) + 1
        self.tracing[caller] = mine + 1
        # the trace outlives a dropped connection: the same request asked again waits for it
        task = asyncio.ensure_future(self._trace(msg, caller, turn))
        self.running[msg.audit_id] = (caller, msg, task)

        def done(t: asyncio.Task, audit_id: str = msg.audit_id) -> None:
            self.running.pop(audit_id, None)
            self.tracing[caller] -= 1
            if not self.tracing[caller]:
                del self.tracing[caller]
            if not t.cancelled():
                t.exception()              # retrieved: an answer nobody waits for any more is no error
        task.add_done_callback(done)
        return await asyncio.shield(task)

    async def _trace(self, msg: AuditTraceRequest, caller: str, turn: int) -> AuditTraceCommit:
        hop = self.store.hop(msg.microbatch_id)
        if hop is None:
            self.refused += 1
            raise ProtocolError(Outcome.LATE, f"micro-batch {msg.microbatch_id[:60]} is not in this miner's audit "
                                              f"window (weights versions kept: {self.store.versions()})")
        if msg.direction == "backward" and hop.grad is None and not self.stage == self.cfg.pipeline.stages - 1:
            raise ProtocolError(Outcome.LATE, f"no backward of micro-batch {msg.microbatch_id[:60]} was kept")
        version = hop.version_for(msg.direction)
        if (msg.weights_step, msg.weights_merges) != tuple(version):
            raise ProtocolError(Outcome.MALFORMED, f"that hop used weights version {list(version)}, not "
                                                   f"{[msg.weights_step, msg.weights_merges]}")
        try:
            layout = TraceLayout.build(self.cfg.model, self.cfg.pipeline, self.stage, batch=int(hop.x.shape[0]),
                                       seq=int(hop.x.shape[1]), direction=msg.direction,
                                       micro_per_step=self.micro_per_step, wire_format=hop.wire_format)
        except LayoutError as e:
            raise ProtocolError(Outcome.MALFORMED, str(e)) from None
        try:
            weights = await asyncio.to_thread(self.store.commitment, version, self.commit_wait_s)
        except TimeoutError:
            raise ProtocolError(Outcome.NOT_READY, f"weights version {list(version)} is still being hashed") from None
        if weights is None:
            self.refused += 1
            raise ProtocolError(Outcome.LATE, f"weights version {list(version)} is no longer kept")
        if weights.root.hex() != msg.weights_root:
            raise ProtocolError(Outcome.HASH_MISMATCH, f"weights version {list(version)} has root "
                                                       f"{weights.root.hex()[:16]}, not {msg.weights_root[:16]}")
        prover = self.prover(layout, weights, hop)
        try:
            troots, wroots = await asyncio.to_thread(prover.commit)
        except ValueError as e:
            raise ProtocolError(Outcome.BAD_SHAPE, f"the kept hop does not fit the audit: {e}") from None
        if self.latest.get(caller) != turn:        # its validator has opened a newer audit since: not kept
            self.superseded += 1
            raise ProtocolError(Outcome.LATE, "this audit was superseded by a newer one from you while it traced")
        commit = codec.commit_message(msg, troots, wroots)
        self.sessions[msg.audit_id] = _Session(prover, layout, caller, time.monotonic(), asyncio.Lock(), msg, commit)
        return commit

    # ---- round 2 ---------------------------------------------------------------------------------
    async def project(self, msg: AuditProjectRequest, ctx: Any) -> AuditProjection:
        self._check(msg)
        s = self._session(msg.audit_id, ctx.caller_hotkey)
        seed = codec.read_seed(msg)
        blocks = codec.read_blocks(msg, s.layout)
        async with s.lock:
            try:
                vec, roots = await asyncio.to_thread(s.prover.project, seed, blocks)
            except LayoutError as e:           # a replayed stage has no round 2
                raise ProtocolError(Outcome.MALFORMED, str(e)) from None
        return codec.projection_message(msg, s.prover.round2, vec, roots)

    # ---- round 3 ---------------------------------------------------------------------------------
    async def open(self, msg: AuditOpenRequest, ctx: Any) -> AuditOpening:
        self._check(msg)
        self._sweep()
        done = self.opened.get(msg.audit_id)
        if done is not None and msg.audit_id not in self.sessions and done[0] == ctx.caller_hotkey:
            if done[1] != msg:
                raise ProtocolError(Outcome.MALFORMED, f"audit {msg.audit_id[:40]!r} was opened already, for other rows")
            return done[2]                    # its answer was lost on the way: the same again
        s = self._session(msg.audit_id, ctx.caller_hotkey)
        request = codec.read_open_request(msg, s.layout)
        async with s.lock:
            try:
                key, nbytes = self._within_budget(s, msg, request)
                opened = await asyncio.to_thread(s.prover.open, request, list(msg.whole))
            except OpenRequestError as e:
                raise ProtocolError(Outcome.MALFORMED, str(e)) from None
            except RuntimeError as e:          # open() before project()
                raise ProtocolError(Outcome.MALFORMED, str(e)) from None
            if key not in s.parts:
                s.opened_bytes += nbytes
            s.parts[key] = s.parts.get(key, 0) + 1
        answer = codec.opening_message(msg, s.layout, opened)
        if msg.more:                           # more parts follow: asked again, a part is served again
            return answer
        self.sessions.pop(msg.audit_id, None)
        self.served += 1
        self.opened[msg.audit_id] = (ctx.caller_hotkey, msg, answer, time.monotonic())
        mine = [k for k, o in self.opened.items() if o[0] == ctx.caller_hotkey]
        for k in mine[:-2]:                    # a caller's newest two (it audits one hop at a time)
            del self.opened[k]
        while len(self.opened) > self.max_sessions:
            del self.opened[next(iter(self.opened))]
        return answer

    def _within_budget(self, s: _Session, msg: AuditOpenRequest, request: dict[str, list[int]]) -> tuple[bytes, int]:
        """The digest of this part and its bytes; raises ``ProtocolError`` (``MALFORMED``) when the session
        has served it ``1 + MAX_PART_REASKS`` times, or a new part would take its distinct parts past
        :func:`open_budget` (the module docstring), and :class:`OpenRequestError` for a bad request."""
        nbytes = s.prover.check_request(request)
        key = _part_digest(msg)
        times = s.parts.get(key, 0)
        if times > MAX_PART_REASKS:
            self.refused += 1
            raise ProtocolError(Outcome.MALFORMED, f"audit {msg.audit_id[:40]!r}: this part was opened {times} times "
                                                   f"already (at most {1 + MAX_PART_REASKS})")
        budget = open_budget(s.layout, s.prover.max_open_bytes)
        if not times and s.opened_bytes + nbytes > budget:
            self.refused += 1
            raise ProtocolError(Outcome.MALFORMED, f"audit {msg.audit_id[:40]!r}: {s.opened_bytes} + {nbytes} bytes "
                                                   f"opened > {budget}, the most one audit of this layout opens")
        return key, nbytes

    def status(self) -> dict:
        return {"open": len(self.sessions), "served": self.served, "refused": self.refused,
                "superseded": self.superseded}

