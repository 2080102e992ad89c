"""A stage's forward and backward of a micro-batch, and its inner step, on the compute thread.

A part of :class:`~iota_subnet.miner.dataplane.plane.DataPlane`: only the route's own miner of a
stage accumulates weight gradients (:meth:`StageCompute._accumulates`); every training hop is
recorded in the audit window (:class:`~iota_subnet.miner.hop_store.HopStore`) with the weights
version it used; the stage takes its inner step when every index of a lane step is accumulated.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from loguru import logger

from iota_subnet.protocol import Ticket, from_wire, to_wire

from ..hop_store import wire_pair, wire_values
from .tracking import Pending, _Task


class StageCompute:
    """Forward, backward and inner step of :class:`~iota_subnet.miner.dataplane.plane.DataPlane`."""

    def _accumulates(self, t: Ticket) -> bool:
        """Claim ``t`` for accumulation when this miner is the route's own miner of its stage."""
        w = self.worker
        if not t.train or not t.is_member(self.stage, self.me) or t.step < w.inner_step:
            return False
        if t.step > w.inner_step:
            if any(self.steps.busy(t.lane, s) for s in range(w.inner_step, t.step)):
                logger.warning(f"stage {self.stage}: lane {t.lane} step {t.step} arrived while step "
                               f"{w.inner_step} is incomplete here; its missing micro-batches are lost")
                for s in range(w.inner_step, t.step):
                    self.steps.forget(t.lane, s)
            skipped = w.skip_to(t.step)
            logger.warning(f"stage {self.stage}: skipped {skipped} inner step(s) to lane {t.lane} step {t.step}")
        ok, superseded = self.steps.claim(t)
        if superseded is not None:
            old = self.pending.pop(superseded, None)
            if old is not None:
                self.worker.drop(self._key(old.ticket))
        if ok:
            w.lane = t.lane
        return ok

    async def _forward(self, task: _Task) -> None:
        t, w = task.ticket, self.worker
        if not self._lane_ready(t):          # the lane's weights first (:mod:`.handover`)
            self._park(task)
            return
        accumulate = self._accumulates(t)
        targets = None
        t0 = time.perf_counter()
        if self.is_head or self.is_tail:
            rows = self.rows(t.split, t.seed, t.start, t.rows)            # [B, T + 1]
            if rows.shape != (t.rows, t.seq_len + 1):
                raise ValueError(f"data gives rows {tuple(rows.shape)} for ticket shape {(t.rows, t.seq_len + 1)}")
            targets = rows[:, 1:].contiguous() if self.is_tail else None
            x = rows[:, :-1].contiguous() if self.is_head else None
        if not self.is_head:
            x = from_wire(task.data, task.scales)

        def run():
            with w.lock:            # the weights version the audit window names is the one the hop uses
                if self.hops is not None and t.train:
                    self.hops.observe(w)
                out = w.forward(self._key(t), x, targets, train=t.train, accumulate=accumulate)
            wire = None
            if not self.is_tail:
                wire = to_wire(out["activations"], t.wire_dtype)
            elif t.train and out.get("grad") is not None:
                wire = to_wire(out["grad"], t.wire_dtype)
            return out, wire
        out, wire = await self.compute(run)
        dt = time.perf_counter() - t0
        self.busy_s += dt
        self.counts["forwards"] += 1
        path = task.path + [self.me]
        weights = (int(out.get("weights_step", w.inner_step)), int(out.get("weights_merges", w.merges)))
        if self.hops is not None and t.train:
            self._record_forward(t, x, targets, task, wire, weights)
        if self.is_tail:
            loss = float(out["loss"])
            if not t.train:
                self._receipt(t, fin=task.in_sha, loss=loss, compute_s=dt, weights=weights, prev=path[-2:-1])
                return
            stepped = accumulate and self.steps.complete(t)
            receipt = dict(fin=task.in_sha, loss=loss, compute_s=dt, weights=weights, accumulated=accumulate,
                           prev=path[-2:-1])
            if stepped:
                await self._step(t.lane, t.step)
            if wire is not None:
                self._queue_send((0,), lambda: self._send_backward(t, path[:-1], wire, loss, receipt))
            else:
                self._receipt(t, **receipt)
            return
        pend = Pending(t, path, accumulate, fwd_in=task.in_sha, started=task.received, compute_s=dt, weights=weights)
        if t.train:
            self.pending[t.microbatch_id] = pend
        self._queue_send((1, t.step, t.index, t.attempt), lambda: self._send_forward(t, path, wire, pend))

    async def _backward(self, task: _Task) -> None:
        t, w = task.ticket, self.worker
        pend = self.pending.pop(t.microbatch_id, None)
        if pend is None:
            self.counts["unknown_backward"] += 1
            self._receipt(t, status="failed", error="backward for a micro-batch this stage no longer holds")
            return
        grad = from_wire(task.data, task.scales)
        if pend.accumulate and t.step != w.inner_step:
            # the stage moved on while this micro-batch was away (it was paused, or skipped to a later
            # step): its gradient belongs to a step already taken or abandoned, so it is not applied
            pend.accumulate = False
            self.steps.release(t)
            self.counts["stale_backwards"] += 1
        t0 = time.perf_counter()

        def run():
            with w.lock:
                if self.hops is not None:
                    self.hops.observe(w)
                g = w.backward(self._key(t), grad, accumulate=pend.accumulate)
                used = (int(w.last_weights_step), int(w.last_weights_merges))
            return (None if g is None else to_wire(g, t.wire_dtype)), used
        wire, used = await self.compute(run)
        if used != pend.weights:
            pend.bweights = used
        if self.hops is not None and not self.is_head:
            self.hops.record_backward(t.microbatch_id, grad=wire_values(task.data, task.scales),
                                      version=used, wire={"wire.dz": wire_pair(task.data, task.scales),
                                                          **({"wire.dx": wire_pair(*wire)} if wire is not None else {})})
        dt = time.perf_counter() - t0
        self.busy_s += dt
        self.counts["backwards"] += 1
        stepped = pend.accumulate and self.steps.complete(t)
        receipt = dict(fin=pend.fwd_in, fout=pend.fwd_out, bin=task.in_sha, loss=task.loss,
                       compute_s=pend.compute_s + dt, weights=pend.weights, bweights=pend.bweights,
                       accumulated=pend.accumulate,
                       prev=pend.path[-2:-1], next_=pend.sent_to, unreachable=pend.unreachable)
        if stepped:
            await self._step(t.lane, t.step)
        if wire is not None:
            self._queue_send((0,), lambda: self._send_backward(t, pend.path[:-1], wire, task.loss, receipt))
        else:
            self._receipt(t, **receipt)
            self._wake.set()            # the head: a window slot is free

    def _record_forward(self, t: Ticket, x: torch.Tensor, targets: Optional[torch.Tensor], task: _Task, wire,
                        weights: tuple[int, int]) -> None:
        """Keep a training forward for audits: its inputs as the stage used them and its wire tensors
        (``wire.x`` received, ``wire.z`` sent; the tail's ``wire.dx``): references, not copies."""
        tensors = {}
        if not self.is_head:
            tensors["wire.x"] = wire_pair(task.data, task.scales)
            x = wire_values(task.data, task.scales)
        if wire is not None:
            tensors["wire.dx" if self.is_tail else "wire.z"] = wire_pair(*wire)
        self.hops.record_forward(t.microbatch_id, wire_format=t.wire_dtype, x=x, version=weights, targets=targets,
                                 wire=tensors)

    async def _step(self, lane: int, step: int) -> None:
        """Every index of lane step ``step`` is accumulated here (or the lane completed the rest
        elsewhere, see :meth:`_settle_before`): take the inner step."""
        w = self.worker
        t0 = time.perf_counter()
        await self.compute(w.step)
        self.busy_s += time.perf_counter() - t0
        self.steps.forget(lane, step)
        self.counts["steps"] += 1
        logger.debug(f"stage {self.stage}: lane {lane} step {step} done -> inner step {w.inner_step}")
        self._wake.set()
