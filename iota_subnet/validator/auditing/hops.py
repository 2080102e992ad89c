"""Hop audits: which recent hop of a miner to audit, and the three rounds that check it.

A part of :class:`~iota_subnet.validator.auditing.scheduler.AuditScheduler`. The hop is drawn only
when the audit starts (:meth:`HopAudits.pick_hop`, blind), the direction follows the stage (the
head's forward, every other stage's backward), and the audit runs the trace commit, projection and
opening rounds (:class:`~iota_subnet.audit.auditor.HopAuditor`), each request asked again unchanged
after a transport failure.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from typing import Any, Callable, Optional

from iota_subnet.audit import codec
from iota_subnet.audit.auditor import AuditFailure, HopAuditor
from iota_subnet.audit.layout import BACKWARD, FORWARD, LayoutError, TraceLayout
from iota_subnet.protocol import (AuditOpening, AuditProjection, AuditTraceCommit, AuditTraceRequest, ProtocolError,
                                  Ticket, encode)
from iota_subnet.protocol.receipt import Receipt
from iota_subnet.transport import TransportError

from ..deadlines import hop_open_work, hop_round_work
from ..routing import Replica
from ..update_audit import HTTP_HEADER_BYTES
from .inputs import HopCandidate
from .records import AuditRecord


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _thread_timed(fn: Callable, *args) -> tuple[Any, float]:
    t0 = time.thread_time()
    out = fn(*args)
    return out, time.thread_time() - t0


class HopAudits:
    """Hop audits of :class:`~iota_subnet.validator.auditing.scheduler.AuditScheduler` (see the module docstring)."""

    def pick_hop(self, hotkey: str) -> Optional[HopCandidate]:
        """One of the miner's recent hops, drawn now (blind): received in the last ``fresh_s`` seconds
        and computed with one of the two latest weights versions its receipts named (a miner keeps
        at least three: ``--audit-window``, default 4), by its current process (work from before a
        restart is gone with its audit window: auditing it would only spend the excuses)."""
        now = self.clock()
        view = self.miners[hotkey]
        cands = [c for c in view.candidates if now - c.received <= self.fresh_s and c.receipt.boot >= view.boot]
        latest = sorted({(c.receipt.ws, c.receipt.wm) for c in cands})[-2:]
        fresh = [c for c in cands if (c.receipt.ws, c.receipt.wm) in latest]
        return self.rng.choice(fresh) if fresh else None

    def direction(self, stage: int, r: Receipt) -> str:
        if stage == 0:
            return FORWARD
        if stage == self.n_stages - 1:
            return BACKWARD
        if r.bws >= 0 and not r.bwroot:
            # the backward ran on other weights than the forward (an inner step or a merge landed in
            # between) and that version's root is not named: only the forward can be replayed
            return FORWARD
        return BACKWARD if (r.bin and r.bout) else FORWARD

    def _layout(self, stage: int, t: Ticket, direction: str) -> TraceLayout:
        key = (stage, t.rows, t.seq_len, direction, t.wire_dtype)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = TraceLayout.build(self.cfg.model, self.cfg.pipeline, stage, batch=t.rows,
                                                         seq=t.seq_len, direction=direction,
                                                         micro_per_step=self.micro_per_step, wire_format=t.wire_dtype)
        return lay
    def hop_auditor(self, c: HopCandidate, direction: str) -> tuple[HopAuditor, AuditTraceRequest]:
        """The validator's session for candidate ``c``; raises ValueError / LayoutError when its
        receipt does not name what the audit needs."""
        t, r = c.ticket, c.receipt
        stage = r.stage
        lay = self._layout(stage, t, direction)
        other = direction == BACKWARD and r.bws >= 0         # the backward used other weights than the forward
        wroot = r.bwroot if other else r.wroot
        version = (r.bws, r.bwm) if other else (r.ws, r.wm)
        if not wroot:
            raise ValueError("its receipt names no weights version root for the weights it used (no audit window)")
        names = {"wire.x": r.fin, "wire.z": r.fout, "wire.dz": r.bin, "wire.dx": r.bout}
        if direction == FORWARD:
            names = {k: v for k, v in names.items() if k in ("wire.x", "wire.z")}
        if other:
            names.pop("wire.z", None)        # the forward used other weights than the backward audited
        roots = {k: bytes.fromhex(v) for k, v in names.items() if k in lay.wire and v}
        tokens = targets = None
        if stage == 0 or stage == self.n_stages - 1:
            rows = self.rows(t)
            tokens, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
            if lay.replay and stage == self.n_stages - 1:
                targets = self.target_rows(t)[:, 1:].contiguous()
        aud = HopAuditor(lay, weights_root=bytes.fromhex(wroot), wire_roots=roots, tol=self.tol,
                         sampling=self.sampling, rng=self.rng, tokens=tokens if stage == 0 else None,
                         targets=targets if stage == self.n_stages - 1 else None,
                         loss=r.loss if stage == self.n_stages - 1 else None)
        req = AuditTraceRequest(run_id=self.run_id, stage=stage, microbatch_id=t.microbatch_id,
                                inner_step=version[0], audit_id=uuid.uuid4().hex, direction=lay.direction,
                                weights_step=version[0], weights_merges=version[1], weights_root=wroot)
        return aud, req

    async def audit_hop(self, rep: Replica, tempo: int, candidate: Optional[HopCandidate] = None
                        ) -> Optional[AuditRecord]:
        """Audit one of ``rep``'s recent hops (or ``candidate``). None when it has none to audit."""
        c = candidate or self.pick_hop(rep.hotkey)
        if c is None:
            return None
        direction = self.direction(rep.stage, c.receipt)
        r = c.receipt
        version = (r.bws, r.bwm) if direction == BACKWARD and r.bws >= 0 else (r.ws, r.wm)
        rec = AuditRecord("hop", rep.uid, rep.hotkey, rep.stage, "passed", direction=direction, tempo=tempo,
                          version=version)
        try:
            aud, req = self.hop_auditor(c, direction)
        except (ValueError, LayoutError) as e:
            rec.raw, rec.detail = "refused", f"unauditable hop {c.ticket.microbatch_id[:40]}: {e}"
            return self._finish(rec, c.receipt.t)
        rec.started = t0 = time.monotonic()
        sizes: list[int] = []
        try:
            rec.raw, rec.detail, rec.cpu_s = await self._hop_rounds(rep, aud, req, sizes, rec)
        except ProtocolError as e:
            rec.raw, rec.detail, rec.code = "refused", f"{e.outcome.value}: {e.message}"[:200], e.outcome.value
        except (TransportError, asyncio.TimeoutError) as e:       # health probed by _reask
            rec.raw, rec.detail = "timeout", f"{type(e).__name__}: {e}"[:200]
        except AuditFailure as e:
            rec.raw, rec.detail = "failed", str(e)[:200]
        self._count_reasks(rec)
        rec.bytes = sum(sizes) + HTTP_HEADER_BYTES * len(sizes)
        rec.wall_s = time.monotonic() - t0
        rec.detail = f"{c.ticket.microbatch_id[:32]}: {rec.detail}"
        return self._finish(rec, c.receipt.t)

    async def _hop_rounds(self, rep: Replica, aud: HopAuditor, req: AuditTraceRequest, sizes: list[int],
                          rec: AuditRecord) -> tuple[str, str, float]:
        """The three rounds; ``sizes`` gets the encoded body size of every message sent and received.
        A request that fails on the transport is sent again unchanged after each of ``retry_delays_s``
        (:meth:`_reask`)."""
        lay = aud.layout
        kw = dict(timeout_s=self.deadlines.deadline_s(*hop_round_work(self.cfg, rep.stage, lay.direction)), retries=0)

        async def call(ep, hk, path, msg, typ, **kw2):
            delays = deque(self.retry_delays_s)
            while True:
                sizes.append(len(encode(msg)))
                try:
                    resp = await self.client.call(ep, hk, path, msg, typ, **kw2)
                    break
                except (TransportError, asyncio.TimeoutError) as e:
                    if not await self._reask(rep, rec, path, _why(e), delays):
                        raise
            rec.unanswered_since = None
            sizes.append(len(await asyncio.to_thread(encode, resp)))
            return resp
        commit = await call(rep.endpoint, rep.hotkey, "/audit/trace", req, AuditTraceCommit,
                            response_contract=codec.commit_contract(lay), **kw)
        seed, cpu = _thread_timed(aud.on_commit, *codec.read_commit(commit))
        if lay.replay:          # a replayed stage has no round 2 (:mod:`iota_subnet.audit.replay`)
            _, c2 = await asyncio.to_thread(_thread_timed, aud.on_projection, {}, [])
        else:
            proj = await call(rep.endpoint, rep.hotkey, "/audit/project", codec.project_request(req, seed, aud.blocks),
                              AuditProjection, response_contract=codec.projection_contract(aud.round2), **kw)
            _, c2 = await asyncio.to_thread(_thread_timed, aud.on_projection,
                                               *codec.read_projection(proj, aud.round2))
        c3 = 0.0
        for k, part in enumerate(aud.parts):    # a replay's rows in parts, each within the miner's cap
            whole = aud.whole_of(part)
            nbytes = codec.opening_bytes(lay, part, weights_dtype=aud.weights_dtype, whole=whole)
            oreq = codec.open_request(req, part, whole, more=k + 1 < len(aud.parts))
            opening = await call(rep.endpoint, rep.hotkey, "/audit/open", oreq, AuditOpening,
                                 response_contract=codec.opening_contract(lay, part, weights_dtype=aud.weights_dtype,
                                                                          whole=whole),
                                 timeout_s=self.deadlines.deadline_s(*hop_open_work(nbytes)), retries=0)
            _, c = await asyncio.to_thread(_thread_timed, aud.accept, part,
                                           codec.read_opening(opening, lay, part, whole))
            c3 += c
        verdict, c = await asyncio.to_thread(_thread_timed, aud.check)
        c3 += c
        cpu += c2 + c3
        if verdict.ok:
            return "passed", f"{verdict.checks} checks", cpu
        return "failed", verdict.reason, cpu
