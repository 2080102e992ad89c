"""One merge attempt seen from a participant: scatter, gather + verify, apply all-or-nothing.

:class:`AllReduceAttempt` is a part of :class:`~iota_subnet.merge.engine.MergeEngine`
(steps 3-6 of the engine's module docstring):

* **scatter**: the pseudo-gradient ``anchor - weights`` (host float32 [P]) is cut by the plan and
  quantized; each slice streams, chunk by chunk, to both reducers of its shard;
* **gather + verify**: for every shard the mean (rounded by its reducers to ``merge.gather_quantization``
  and sent in that encoding) is fetched chunk by chunk from one reducer, after its header, which
  carries the other reducer's signature over the same statement when the two agree
  (:func:`~.claims.co_result`; else the other's header is asked for too); equal hashes and equal
  contributions roots (the same contributors, weights and inputs; each result's metadata is O(1) in
  the number of replicas) and chunks matching them accept the shard;
* **third-party recompute** (:meth:`AllReduceAttempt._recompute`): when the reducers disagree, every
  participant's chunks are fetched, the mean recomputed and used, and evidence naming the reducer(s)
  whose hash differs is recorded (``engine.reports``, for validators);
* **apply**: with every shard verified, weights, anchor and momentum are replaced together.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
from loguru import logger

from iota_subnet.protocol import (MergeAck, MergePayload, MergeResult, MergeResultRequest, Outcome, ProtocolError,
                                  tensor_sha256)
from iota_subnet.protocol.codec import host_bytes
from iota_subnet.utils.progress import Progress

from .deadlines import bytes_per_value, phase_deadline_s
from .outer import dequantize, outer_step, quantize, rounded, weighted_mean
from .replay import AppliedMerge
from .claims import co_result, co_signature, result_from_wire, wire_contribution
from .plan import MergePlan
from .serve import STILL_REDUCING, _Session, _ShardReduce

if TYPE_CHECKING:
    from .report import MergeReport


def sha256_of(chunks: Iterable[torch.Tensor]) -> str:
    """sha256 of the concatenated raw bytes of ``chunks`` (equals ``tensor_sha256(torch.cat(chunks))``)."""
    h = hashlib.sha256()
    for x in chunks:
        for view in host_bytes(x):
            h.update(view)
    return h.hexdigest()


class AllReduceAttempt:
    """:meth:`_allreduce` (one attempt) of :class:`~iota_subnet.merge.engine.MergeEngine` and its
    third-party recompute (see the module docstring)."""

    async def _allreduce(self, plan: MergePlan, rep: MergeReport, src: Optional[_Session] = None
                         ) -> tuple[bool, list[str], str]:
        """One attempt. Returns (applied, replicas to exclude next time, reason).

        ``src``: for a repair plan (:mod:`.plan`), the session of the failed attempt whose layout it
        keeps: this replica's slices, its weights read then (``merge.overlap``), which of its chunks
        each reducer holds, and the chunks its own shards kept. Only what a reducer lacks is sent:
        a reducer of the failed attempt that holds every survivor's chunks of a shard reduces it
        again over the survivors with no transfer; a sender whose chunks a reducer holds sends it its
        signed claim for the new plan only (no values)."""
        sess = self._session(plan.epoch, plan.attempt, plan.plan_id, own=True)
        quant, block = self.cfg.scatter_quant, self.cfg.int8_block
        mine = plan.shards_of(self.me)
        keep = len(plan.participants) >= 3          # a repair needs two survivors: none after a 2-replica attempt
        if src is None:
            current = await asyncio.to_thread(self.params.read)        # host float32 [P]
            delta = self.feedback.accumulate(self.anchor - current)   # top-k: plus the unsent residual
            sess.carry = current if self.cfg.overlap else None         # the overlapped apply adds progress since now
            del current
            for s in range(plan.num_shards):
                parts = []
                for c, (off, n) in enumerate(plan.chunks(s)):
                    q, sc = quantize(delta[off:off + n], quant, block)
                    parts.append(dequantize(q, sc, quant, block))
                    sess.mine_wire[(s, c)] = (q, sc)
                sess.mine[s] = parts
            self.feedback.hold(delta, ((off, x) for s in range(plan.num_shards) for (off, _), x in
                                       zip(plan.chunks(s), sess.mine[s])), applied=plan.weight(self.me) > 0)
            del delta
        else:                                       # the failed attempt's slices: the same pseudo-gradient
            sess.mine, sess.mine_wire, sess.carry = src.mine, src.mine_wire, src.carry
        sess.plan = plan                                           # from here contributions are accepted
        for s in mine:
            sess.reduce[s] = _ShardReduce(plan.chunks(s), plan.participants, keep=keep)
            old = src.reduce.get(s) if src is not None else None
            if old is not None and old.kept is not None:           # reduce again from the chunks kept
                for c, (off, _) in enumerate(plan.chunks(s)):
                    for p in plan.participants:
                        if c < len(old.kept.get(p, ())):
                            q, sc = old.kept[p][c]
                            self._accept(sess, p, s, c, off, dequantize(q, sc, quant, block), (q, sc))
        claims: dict[int, dict] = {}
        if self.observer is not None:                              # signed contribution claims (merge/claims.py)
            claims = await asyncio.to_thread(self.observer.on_contributions, plan,
                                             {s: torch.cat(parts) for s, parts in sess.mine.items()}, [])
        sess.planned.set()
        self._adopt_raw(sess)
        for s in mine:
            for c, x in enumerate(sess.mine[s]):
                self._accept(sess, self.me, s, c, plan.chunks(s)[c][0], x, sess.mine_wire[(s, c)])

        def held(r: str, s: int) -> int:
            """My chunks of shard ``s`` reducer ``r`` holds from ``src`` (0: none, or no repair)."""
            if src is None or src.plan is None or r not in src.plan.reducers[s]:
                return 0
            return src.acked.get((r, s), 0)

        async def stream(r: str, s: int):
            """Chunks of my slice of shard ``s`` to reducer ``r``, in order, one at a time (from the
            first one it does not hold; with claims and nothing to send, the claim alone)."""
            chunks = plan.chunks(s)
            start = sess.acked[(r, s)] = held(r, s)
            todo = list(enumerate(chunks))[start:]
            if not todo and s in claims:
                off = chunks[0][0]
                q, sc = quantize(torch.zeros(0), quant, block)
                todo = [(len(chunks), (off, 0))]
            try:
                for c, (off, _) in todo:
                    q, sc = sess.mine_wire[(s, c)] if c < len(chunks) else (q, sc)
                    await self._call(r, "/merge/contribute", MergePayload(
                        run_id=self.run_id, stage=self.stage, epoch=plan.epoch, attempt=plan.attempt,
                        plan_id=plan.plan_id, shard_index=s, num_shards=plan.num_shards, chunk=c,
                        num_chunks=len(chunks), offset=off, total_numel=plan.total_numel,
                        weight=plan.weight(self.me), quant=quant, shard=q, scales=sc,
                        info={"claim": wire_contribution(claims[s], whole=len(chunks) == 1 and c < 1)}
                        if s in claims else {}), MergeAck)
                    if c < len(chunks):
                        sess.acked[(r, s)] = c + 1
                return None
            except Exception as e:  # noqa: BLE001 - a refusal or an unreachable peer
                return r, e
        streams = [(r, s) for s in range(plan.num_shards) for r in dict.fromkeys(plan.reducers[s]) if r != self.me]
        t_start = time.monotonic()
        # results are asked for until the reducers' own deadline has passed (their waits end by then)
        gather_deadline = t_start + phase_deadline_s(self.cfg, self.phase_bytes(plan), self._byte_progress) + min(
            self.cfg.progress_timeout_s, self.cfg.phase_timeout_s)
        reducers = asyncio.gather(*(self._reduce(sess, s) for s in mine))
        sending = [asyncio.ensure_future(stream(r, s)) for r, s in streams]
        try:
            await reducers
            # the streams to live reducers end as their shards are reduced; one to a stopped reducer
            # is cut by its progress timeout (in _call): neither holds the gather
            await asyncio.wait(sending, timeout=0) if sending else None
            unreachable: set[str] = set()
            late = False
            for t in sending:
                if not t.done() or t.result() is None:
                    continue
                r, e = t.result()
                if isinstance(e, ProtocolError) and e.outcome == Outcome.LATE:
                    late = True
                else:
                    unreachable.add(r)
                logger.warning(f"merge: contribution to {r[:10]} failed: {e}")
            if late:
                return False, [], "a reducer refused as LATE (it merged or closed this attempt)"
            return await self._gather_apply(plan, sess, rep, unreachable, gather_deadline, sess.carry)
        finally:
            for t in sending:
                t.cancel()

    async def _cosign(self, sess: _Session, s: int, deadline: float) -> None:
        """Ask the other reducer of shard ``s`` for its result header (it answers a co-reducer as soon
        as its result is computed) and, when it signed exactly this replica's statement, keep its
        signature in this replica's result (``info["co"]``, :func:`~.claims.co_signature`): a gatherer
        then takes both signed results from one answer. Gives up (no ``co``: gatherers ask the other
        reducer themselves) when it refuses, is unreachable, disagrees, or is not done by ``deadline``
        (monotonic seconds)."""
        plan, mine = sess.plan, sess.results[s]
        other = [r for r in plan.reducers[s] if r != self.me]
        if not other:
            return
        while True:
            try:
                res = await self._call(other[0], "/merge/result", MergeResultRequest(
                    run_id=self.run_id, stage=self.stage, epoch=plan.epoch, attempt=plan.attempt,
                    plan_id=plan.plan_id, shard_index=s, with_tensor=False), MergeResult)
                break
            except ProtocolError as e:
                if e.outcome != Outcome.NOT_READY or STILL_REDUCING not in str(e) or time.monotonic() >= deadline:
                    return
                await asyncio.sleep(0.05)
            except Exception:  # noqa: BLE001 - unreachable: gatherers find out themselves
                return
        sig = await asyncio.to_thread(co_signature, mine, res, other[0], plan)
        if sig is not None:
            mine.info = {**mine.info, "co": sig}

    async def _gather_apply(self, plan: MergePlan, sess: _Session, rep: "MergeReport", unreachable: set[str],
                            gather_deadline: float, carry: Optional[torch.Tensor]) -> tuple[bool, list[str], str]:
        """Gather + verify every shard, then apply all or nothing (steps 5 and 6)."""

        # gather + verify, applying the outer step chunk by chunk into the new anchor and momentum
        new_anchor = torch.empty_like(self.anchor)
        new_momentum = torch.empty_like(self.momentum)
        done: set[int] = set()
        missing: set[str] = set(unreachable)
        reasons: list[str] = []

        applied: dict[int, tuple[int, str, torch.Tensor, Optional[torch.Tensor]]] = {}    # what a replay re-applies

        def apply_chunk(off: int, mean: torch.Tensor, quant: str, values: torch.Tensor,
                        scales: Optional[torch.Tensor]) -> None:
            applied[off] = (off, quant, values, scales)
            n = mean.numel()
            new, mom = outer_step(self.anchor[off:off + n], self.momentum[off:off + n], mean, lr=self.cfg.outer_lr,
                                  mu=self.cfg.outer_momentum, nesterov=self.cfg.nesterov)
            new_anchor[off:off + n] = new
            new_momentum[off:off + n] = mom

        async def result(r: str, s: int, c: int, with_tensor: bool) -> Any:
            while True:     # NOT_READY: the reducer is still reducing (it answers within its progress timeout)
                try:
                    return await self._call(r, "/merge/result", MergeResultRequest(
                        run_id=self.run_id, stage=self.stage, epoch=plan.epoch, attempt=plan.attempt,
                        plan_id=plan.plan_id, shard_index=s, chunk=c, with_tensor=with_tensor), MergeResult)
                except ProtocolError as e:
                    if (e.outcome != Outcome.NOT_READY or STILL_REDUCING not in str(e)
                            or time.monotonic() >= gather_deadline):
                        return e
                    await asyncio.sleep(0.05)
                except Exception as e:  # noqa: BLE001
                    return e

        def failed(s: int, r: str, res: Any) -> bool:
            """Note why ``res`` (``r``'s answer for shard ``s``) fails the shard; False when it is a result."""
            if isinstance(res, MergeResult):
                if res.status == "ok":
                    return False
                missing.update(res.missing)
                reasons.append(f"shard {s}: {r[:10]} incomplete")
            else:
                missing.add(r)
                reasons.append(f"shard {s}: {r[:10]} unreachable ({type(res).__name__})")
            return True

        async def head(s: int) -> dict[str, Any]:
            """Phase 1: the result headers of shard ``s``: the one of the reducer this replica fetches the
            mean from, which carries the other reducer's when they signed the same statement (else the
            other reducer is asked too); from the other reducer only when this replica reduces ``s``."""
            a, b = plan.reducers[s]
            if self.me in (a, b):
                mine_res = sess.results.get(s)
                if mine_res is None or mine_res.status != "ok":
                    missing.update(mine_res.missing if mine_res is not None else [])
                    reasons.append(f"shard {s}: incomplete here")
                    return {self.me: None}
                other = [r for r in (a, b) if r != self.me]
                return {other[0]: await result(other[0], s, 0, False)} if other else {}
            prim = plan.primary_for(self.me, s)
            sec = b if prim == a else a
            got = {prim: await result(prim, s, 0, False)}
            if sec != prim:     # the secondary's signed result rides with the primary's when they agree
                co = co_result(got[prim], sec, plan) if isinstance(got[prim], MergeResult) else None
                got[sec] = co if co is not None else await result(sec, s, 0, False)
            return got

        async def gather_one(s: int, pre: dict[str, Any]) -> None:
            a, b = plan.reducers[s]
            chunks = plan.chunks(s)
            claims: dict[str, MergeResult] = {}
            got: dict[str, Any] = dict(pre)
            served_h = hashlib.sha256()
            chunks_ok = True
            if self.me in (a, b):
                mine_res = sess.results[s]
                claims[self.me] = mine_res
                prim = self.me
                for (off, _), mean, (q, sc) in zip(chunks, sess.honest[s], sess.reduce[s].wire):
                    apply_chunk(off, mean, self.cfg.gather_quant, q, sc)
                served_digest = mine_res.mean_sha256
            else:
                prim = plan.primary_for(self.me, s)
                first = got[prim]                   # its header (phase 1); the chunks come alone
                served_digest = None
                if isinstance(first, MergeResult) and first.status == "ok":
                    hashes = list(first.chunk_sha256) or [first.mean_sha256]     # one chunk: its hash is the mean's
                    chunks_ok = len(hashes) == len(chunks)
                    for c, (off, n) in enumerate(chunks):
                        reply = await result(prim, s, c, True)
                        if not isinstance(reply, MergeResult) or reply.status != "ok":
                            got[prim] = reply           # unreachable (or incomplete) mid-way
                            break
                        m = self._decode_mean(reply)
                        if m is None or m.numel() != n:
                            chunks_ok = False
                            break
                        for view in host_bytes(m):
                            served_h.update(view)
                        if not chunks_ok or tensor_sha256(m) != hashes[c]:
                            chunks_ok = False
                            continue                    # keep hashing what it serves (evidence), apply nothing
                        apply_chunk(off, m, reply.quant, reply.mean, reply.mean_scales)
                    else:
                        served_digest = served_h.hexdigest()
            for r, res in got.items():
                if failed(s, r, res):
                    return
                claims[r] = res
            hashes = {r: c.mean_sha256 for r, c in claims.items()}
            agree = len(set(hashes.values())) == 1 and len({c.contributions_root for c in claims.values()}) == 1
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
                  "contributions_root": {r: c.contributions_root for r, c in claims.items()},
                  # the reducers' signed claims, rebuilt whole from their results' fields
                  "results": {r: {"claim": full} for r, c in claims.items() if (full := result_from_wire(c, r, plan))},
                  "time": time.time()}
            self.reports.append(ev)
            rep.mismatches.append(ev)
            logger.warning(f"merge epoch {plan.epoch} shard {s}: reducers disagree; recomputed, wrong: "
                           f"{[w[:10] for w in wrong]}")
            for (off, _), mean in zip(chunks, recomputed):
                apply_chunk(off, mean, "none", mean.float().contiguous(), None)
            done.add(s)

        bpv = bytes_per_value(self.cfg.gather_quant, self.cfg.int8_block)
        prog = Progress(int(bpv * sum(plan.bounds[s][1] for s in range(plan.num_shards))), f"merge epoch {plan.epoch}: "
                        "gather", "B", unit_scale=True, min_total=64 << 20)

        async def gather_counted(s: int, pre: dict[str, Any]) -> None:
            await gather_one(s, pre)
            prog.update(int(bpv * plan.bounds[s][1]))
        # phase 1: every shard's header (no mean) first, so that no mean is fetched in an attempt that
        # fails (a dead reducer, an incomplete shard): a repair attempt then re-sends and re-gathers
        # nothing it did not need to (phase 2 waits for the slowest shard's reduce)
        heads = await asyncio.gather(*(head(s) for s in range(plan.num_shards)))
        bad = [s for s, pre in enumerate(heads) if any(r == self.me or failed(s, r, res) for r, res in pre.items())]
        if bad:
            return False, sorted(missing - {self.me}), "; ".join(reasons[:4]) or "incomplete"
        with prog:
            await asyncio.gather(*(gather_counted(s, pre) for s, pre in enumerate(heads)))
        if len(done) != plan.num_shards:
            return False, sorted(missing - {self.me}), "; ".join(reasons[:4]) or "incomplete"

        # all or nothing: one write under the worker lock
        await asyncio.to_thread(self.params.write, new_anchor, carry)
        self.feedback.commit()
        kept = AppliedMerge(self.merged_epoch, plan.epoch, self.cfg.int8_block, [applied[o] for o in sorted(applied)])
        self.merged(new_anchor, new_momentum, plan.epoch, kept)
        rep.weights_sha256 = tensor_sha256(new_anchor)
        return True, [], ""

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
                    if m.quant != self.cfg.scatter_quant or (m.offset, x.numel()) != (off, n):
                        return
                    slices[p] = x
                except Exception as e:  # noqa: BLE001
                    logger.debug(f"merge: contribution fetch from {p[:10]} failed: {e}")
            await asyncio.gather(*(get(p) for p in plan.participants if p != self.me))
            if len(slices) != len(plan.participants):
                return None
            mean = weighted_mean([(plan.weight(p), slices[p]) for p in plan.participants])
            out.append(rounded(mean, self.cfg.gather_quant, self.cfg.int8_block)[0])     # as an honest reducer serves it
        return out

    def _decode_mean(self, reply: MergeResult) -> Optional[torch.Tensor]:
        """The float32 chunk of the mean a reducer served (``reply``), or None when it is missing or not
        in this run's gather encoding."""
        if reply.mean is None or reply.quant != self.cfg.gather_quant:
            return None
        try:
            return dequantize(reply.mean, reply.mean_scales, reply.quant, self.cfg.int8_block)
        except ValueError:
            return None
