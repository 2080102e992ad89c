"""The pipeline driver: pushes micro-batches through the miners, forward then backward.

One micro-batch::

    tokens -> /forward stage 0 -> ... -> /forward last stage (with targets) -> loss + grad
           -> /backward stage n-2 -> ... -> /backward stage 0          (to the same miners, in reverse)

A forward hop that fails (transport error, refusal, malformed or non-finite reply) is re-sent to
another replica of that stage (:meth:`Router.route`, SWARM-style choice); a backward hop cannot
be: only the miner that ran the forward holds its autograd state, so a failed backward ends that
micro-batch (stages after it have already done their backward; stages before it never will).
A micro-batch that failed during its *forward* pass (no stage has counted a backward for it) is
re-driven from scratch under a new id, up to ``microbatch_retries`` times, so every miner of the
lane still sees a full step's worth of backward passes.

Schedule (GPipe per lane)
    Lane ``r`` runs its lane steps one after another; the ``batch_size / micro_batch_size``
    micro-batches of one step run concurrently (``asyncio.gather``), so a miner's inner step
    ``k`` (it steps after that many backward passes) covers exactly the tokens of one co-located
    optimizer step. Lanes run concurrently.

Data addressing
    Lane ``r``, lane step ``k``, micro-batch ``m`` reads ``micro_batch_size`` rows of seed
    ``train.seed`` starting at ``((k * n_lanes + r) * batch_size + m * micro_batch_size)``; with one
    lane this is exactly the co-located trainer's addressing.

Several validators
    ``V`` validators (those with a validator permit, ordered by hotkey; this one has index
    ``v``) split every lane's steps: validator ``v`` drives the lane steps ``k`` with
    ``k % V == v``. They address the same rows for the same ``(lane, k)``, so the union of their
    work is one consistent stream per lane. Their steps of one lane run at the same time, so a
    lane's miners see micro-batches of two steps interleaved (as a replica that takes rerouted
    hops of another lane does): the miner must tolerate an optimizer step between a micro-batch's
    forward and its backward. Today's ``StageWorker`` does not (autograd refuses the backward after
    the in-place update; the miner answers INTERNAL), so such micro-batches are lost and counted as
    failures of that miner; see the validator report.
"""
from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable, Optional

import torch
from loguru import logger

from iota_subnet.config import RunConfig
from iota_subnet.model import bottleneck_dims
from iota_subnet.protocol import (Backward, BackwardResult, Forward, ForwardResult, Health, ProtocolError,
                                  payload_nbytes)
from iota_subnet.transport import TransportError

from .routing import Replica, Router
from .scoring import Ledger


class HopFailed(Exception):
    """A hop's reply could not be used (raised inside the driver only)."""


@dataclass
class MicrobatchResult:
    lane: int
    step: int
    idx: int
    microbatch_id: str
    train: bool
    tokens: int
    ok: bool = False
    loss: Optional[float] = None
    phase: str = "forward"  # where it stopped: forward | backward | done
    pathway: list[dict] = field(default_factory=list)  # per stage: {stage, uid, hotkey}
    reroutes: int = 0
    failures: list[dict] = field(default_factory=list)  # {stage, uid, hotkey, phase, error}
    latency_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    attempts: int = 1
    head_step: Optional[int] = None  # the head (stage 0) miner's inner step right after its backward

    def row(self) -> dict:
        return asdict(self)


@dataclass
class LaneStepResult:
    lane: int
    step: int
    microbatches: list[MicrobatchResult]
    elapsed_s: float

    @property
    def ok_count(self) -> int:
        return sum(1 for m in self.microbatches if m.ok)

    @property
    def tokens(self) -> int:
        return sum(m.tokens for m in self.microbatches if m.ok)

    @property
    def loss(self) -> Optional[float]:
        ls = [m.loss for m in self.microbatches if m.ok and m.loss is not None]
        return sum(ls) / len(ls) if ls else None

    @property
    def reroutes(self) -> int:
        return sum(m.reroutes for m in self.microbatches)

    @property
    def head_step(self) -> Optional[int]:
        """The head miner's inner step once this lane step's backwards were done (from its replies)."""
        steps = [m.head_step for m in self.microbatches if m.head_step is not None]
        return max(steps) if steps else None

    @property
    def failures(self) -> int:
        return sum(len(m.failures) for m in self.microbatches)


def sample_start(lane: int, step: int, m: int, n_lanes: int, batch_size: int, micro_batch_size: int) -> int:
    """First row of micro-batch ``m`` of lane step ``step`` of lane ``lane`` (see the module docstring)."""
    return (step * n_lanes + lane) * batch_size + m * micro_batch_size


#: ``total`` lane steps of an open-ended run (``train.total_steps: null``): never reached.
OPEN_ENDED_STEPS = 1 << 62


def steps_of(validator_index: int, n_validators: int, start: int, total: int) -> range:
    """The lane steps in ``[start, total)`` this validator drives (``k % V == v``), as a range
    (``total`` may be :data:`OPEN_ENDED_STEPS`)."""
    v, V = int(validator_index), max(1, int(n_validators))
    start = max(0, int(start))
    first = start + (v % V - start % V) % V
    return range(first, max(first, int(total)), V)


class PipelineDriver:
    """Drives micro-batches through the miners of a :class:`Router`.

    ``client``: a :class:`~iota_subnet.transport.NeuronClient` (or anything with its ``call``).
    ``dataset``: a :class:`~iota_subnet.data.TokenDataset` (``batch``, ``val_batch``).
    ``ledger``: per-miner accounting, credited as hops are verified.
    """

    def __init__(self, cfg: RunConfig, *, run_id: str, router: Router, client: Any, dataset: Any, ledger: Ledger,
                 n_lanes: int, validator_index: int = 0, n_validators: int = 1, seed: Optional[int] = None,
                 hop_timeout_s: float = 30.0, retries: int = 1, backoff_s: float = 0.1, max_hop_attempts: int = 3,
                 microbatch_retries: int = 2, empty_step_wait_s: float = 1.0, eval_retries: int = 3, tag: str = "",
                 verifier: Any = None):
        self.cfg, self.run_id, self.router, self.client = cfg, run_id, router, client
        #: client for CLASP probe traffic (kept apart so wire bytes count training hops only)
        self.probe_client = client
        self.dataset, self.ledger = dataset, ledger
        self.n_stages = cfg.pipeline.stages
        self.n_lanes = int(n_lanes)
        self.validator_index, self.n_validators = int(validator_index), max(1, int(n_validators))
        self.seed = cfg.train.seed if seed is None else int(seed)
        self.hop_timeout_s, self.retries, self.backoff_s = hop_timeout_s, retries, backoff_s
        self._turn_base: dict[int, int] = {}   # lane -> head inner step after our last step (await_turn)
        self._no_turns: set[int] = set()       # lanes that stopped waiting for other validators
        self._turn_timeouts: dict[int, int] = {}
        self.max_hop_attempts = max(1, int(max_hop_attempts))
        self.microbatch_retries = max(0, int(microbatch_retries))
        self.empty_step_wait_s = empty_step_wait_s
        self.eval_retries = max(0, int(eval_retries))
        self.tag = tag or uuid.uuid4().hex[:6]
        #: a :class:`~iota_subnet.validator.verification.SpotChecker` (or None): sees every verified hop
        self.verifier = verifier
        self.mb = cfg.train.micro_batch
        self.micro_per_step = cfg.train.batch_size // self.mb
        self.width = bottleneck_dims(cfg.model, cfg.pipeline)[0]
        # totals for status output
        self.tokens = 0
        self.reroutes = 0
        self.failures = 0
        self.microbatches_ok = 0
        self.microbatches_failed = 0
        self._probe_lock = asyncio.Lock()

    # ---------------------------------------------------------------- health probes
    async def probe(self, timeout_s: float = 5.0) -> int:
        """``/health`` of every failed replica whose cooldown has run out: a ready one is back in
        its lane, a failing one gets a longer cooldown. Returns how many came back."""
        async with self._probe_lock:
            due = self.router.probe_due()
            if not due:
                return 0

            async def one(r: Replica) -> bool:
                try:
                    h = await self.client.call(r.endpoint, r.hotkey, "/health", Health(run_id=self.run_id, stage=r.stage),
                                               Health, timeout_s=timeout_s, retries=0)
                    if not h.ready:
                        raise HopFailed("not ready")
                except (ProtocolError, TransportError, HopFailed) as e:
                    cd = self.router.probe_failed(r, f"{type(e).__name__}: {e}")
                    logger.info("{} still down ({}); next probe in {:.1f} s", r.short(), type(e).__name__, cd)
                    return False
                self.router.mark_healthy(r)
                logger.info("{} is healthy again", r.short())
                return True

            return sum(await asyncio.gather(*(one(r) for r in due)))

    async def wait_and_probe(self, max_wait_s: float) -> None:
        """Sleep until the next failed replica is due for a probe (at most ``max_wait_s``), then probe."""
        wait = self.router.next_probe_in()
        await asyncio.sleep(min(max_wait_s, wait if wait is not None else max_wait_s))
        await self.probe()

    # ---------------------------------------------------------------- one micro-batch
    def _check(self, t: Optional[torch.Tensor], shape: tuple[int, ...], what: str) -> torch.Tensor:
        if t is None:
            raise HopFailed(f"reply without {what}")
        if tuple(t.shape) != shape:
            raise HopFailed(f"{what} has shape {list(t.shape)}, expected {list(shape)}")
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise HopFailed(f"{what} is not finite floating point")
        return t

    def _failed(self, res: MicrobatchResult, r: Replica, phase: str, error: BaseException | str) -> None:
        err = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
        cd = self.router.record_failure(r, err)
        self.ledger.fail(r.uid, r.hotkey, r.stage)
        self.failures += 1
        res.failures.append({"stage": r.stage, "uid": r.uid, "hotkey": r.hotkey, "phase": phase, "error": err[:300]})
        logger.warning("lane {} step {} mb {}: {} of {} failed ({}); cooldown {:.1f} s", res.lane, res.step, res.idx,
                       phase, r.short(), err[:200], cd)

    async def _forward_hop(self, res: MicrobatchResult, stage: int, x: torch.Tensor, targets: Optional[torch.Tensor],
                           train: bool) -> tuple[Replica, ForwardResult]:
        last = stage == self.n_stages - 1
        B, T = int(x.shape[0]), int(x.shape[1])
        tried: list = []
        for _ in range(self.max_hop_attempts):
            r = self.router.route(res.lane, stage, exclude=tried)
            if r is None:
                break
            tried.append(r.key)
            member = self.router.lane_member(res.lane, stage)
            if member is None or member.key != r.key:
                res.reroutes += 1
                self.reroutes += 1
                self.ledger.reroute(r.uid, r.hotkey, stage)
            msg = Forward(run_id=self.run_id, stage=stage, microbatch_id=res.microbatch_id, inner_step=max(res.step, 0),
                          activations=x, targets=targets if last else None, keep_for_backward=train)
            t0 = time.perf_counter()
            try:
                reply = await self.client.call(r.endpoint, r.hotkey, "/forward", msg, ForwardResult,
                                               timeout_s=self.hop_timeout_s, retries=self.retries,
                                               backoff_s=self.backoff_s)
                res.bytes_sent += payload_nbytes(msg)
                res.bytes_received += payload_nbytes(reply)
                if last:
                    if reply.loss is None or not math.isfinite(float(reply.loss)):
                        raise HopFailed(f"loss {reply.loss!r} is not finite")
                    if train and self.n_stages > 1:
                        self._check(reply.grad, (B, T, self.width), "grad")
                else:
                    self._check(reply.activations, (B, T, self.width), "activations")
            except (ProtocolError, TransportError, HopFailed) as e:
                self._failed(res, r, "forward", e)
                continue
            self.router.record_success(r, res.tokens, time.perf_counter() - t0)
            self.ledger.forward_ok(r.uid, r.hotkey, stage)
            if self.verifier is not None:
                self.verifier.on_forward(res.lane, res.step, res.microbatch_id, r, x,
                                         targets if last and train else None, reply, train)
            return r, reply
        raise HopFailed(f"no replica of stage {stage} completed the forward (tried {len(tried)})")

    async def _backward_hop(self, res: MicrobatchResult, r: Replica, grad: torch.Tensor) -> Optional[torch.Tensor]:
        msg = Backward(run_id=self.run_id, stage=r.stage, microbatch_id=res.microbatch_id, inner_step=max(res.step, 0),
                       grad=grad)
        t0 = time.perf_counter()
        try:
            reply = await self.client.call(r.endpoint, r.hotkey, "/backward", msg, BackwardResult,
                                           timeout_s=self.hop_timeout_s, retries=self.retries, backoff_s=self.backoff_s)
            res.bytes_sent += payload_nbytes(msg)
            res.bytes_received += payload_nbytes(reply)
            out = None if r.stage == 0 else self._check(reply.grad, tuple(grad.shape), "grad")
            if r.stage == 0:
                res.head_step = int(reply.inner_step)
        except (ProtocolError, TransportError, HopFailed) as e:
            self._failed(res, r, "backward", e)
            raise HopFailed(f"backward of stage {r.stage} failed") from e
        self.router.record_success(r, res.tokens, time.perf_counter() - t0)
        self.ledger.credit(r.uid, r.hotkey, r.stage, res.tokens)
        if self.verifier is not None:
            self.verifier.on_backward(res.microbatch_id, r, grad, out, reply)
        return out

    async def run_microbatch(self, lane: int, step: int, idx: int, rows: torch.Tensor, *,
                             train: bool = True) -> MicrobatchResult:
        """Drive one micro-batch (``rows``: int64 [B, T+1]) through the pipeline; never raises on
        a miner's failure (the result says what happened)."""
        res = MicrobatchResult(lane, step, idx, "", train, int(rows.shape[0] * (rows.shape[1] - 1)))
        for attempt in range(1 + (self.microbatch_retries if train else 0)):
            res.attempts = attempt + 1
            res.microbatch_id = f"{self.tag}-l{lane}-k{step}-m{idx}-{uuid.uuid4().hex[:8]}"
            res.pathway, res.phase, res.loss = [], "forward", None
            if await self._drive(res, rows, train):
                break
            if res.phase != "forward":
                break  # some stage already counted a backward for it: re-driving would double count
        res.ok = res.phase == "done"
        if train:
            if res.ok:
                self.microbatches_ok += 1
                self.tokens += res.tokens
            else:
                self.microbatches_failed += 1
        return res

    async def _drive(self, res: MicrobatchResult, rows: torch.Tensor, train: bool) -> bool:
        t0 = time.perf_counter()
        try:
            x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
            act: torch.Tensor = x
            path: list[Replica] = []
            grad: Optional[torch.Tensor] = None
            for s in range(self.n_stages):
                r, reply = await self._forward_hop(res, s, act, y, train)
                path.append(r)
                res.pathway.append({"stage": s, "uid": r.uid, "hotkey": r.hotkey})
                if s == self.n_stages - 1:
                    res.loss = float(reply.loss)
                    grad = reply.grad
                else:
                    act = reply.activations
            if not train:
                res.phase = "done"
                return True
            tail = path[-1]
            res.phase = "backward"
            self.ledger.credit(tail.uid, tail.hotkey, tail.stage, res.tokens)  # its backward ran with its forward
            for s in range(self.n_stages - 2, -1, -1):
                grad = await self._backward_hop(res, path[s], grad)
            res.phase = "done"
            return True
        except HopFailed as e:
            logger.debug("lane {} step {} mb {}: {}", res.lane, res.step, res.idx, e)
            return False
        finally:
            res.latency_s += time.perf_counter() - t0

    # ---------------------------------------------------------------- steps and lanes
    def sample_start(self, lane: int, step: int, m: int) -> int:
        return sample_start(lane, step, m, self.n_lanes, self.cfg.train.batch_size, self.mb)

    async def run_lane_step(self, lane: int, step: int) -> LaneStepResult:
        """All micro-batches of one lane step, concurrently."""
        t0 = time.perf_counter()
        batches = [self.dataset.batch(self.seed, self.sample_start(lane, step, m), self.mb)
                   for m in range(self.micro_per_step)]
        if self.verifier is not None:
            await self.verifier.before_step(lane, step, [self.router.lane_member(lane, s) for s in range(self.n_stages)])
        results = await asyncio.gather(*(self.run_microbatch(lane, step, m, rows) for m, rows in enumerate(batches)))
        if self.verifier is not None:
            await self.verifier.after_step(lane, step)
        return LaneStepResult(lane, step, list(results), time.perf_counter() - t0)

    async def _head_step(self, lane: int) -> Optional[int]:
        head = self.router.lane_member(lane, 0)
        if head is None or not self.router.is_available(head):
            return None
        try:
            h = await self.client.call(head.endpoint, head.hotkey, "/health", Health(run_id=self.run_id, stage=0),
                                       Health, timeout_s=5.0, retries=0)
            return int(h.inner_step)
        except (ProtocolError, TransportError):
            return None

    async def await_turn(self, lane: int, step: int, stop: Optional[asyncio.Event] = None,
                         timeout_s: float = 120.0, poll_s: float = 0.05, give_up_after: int = 3) -> bool:
        """With several validators, start lane step ``step`` only once the steps before it (driven by
        the other validators) are finished, so every lane stays synchronous as with one validator:
        no miner mixes two steps of a lane, and the run matches the co-located update rule.

        The lane's head miner is the clock: it takes its inner step last (after every backward of
        a step). After our previous step of the lane its inner step was ``base``; the other V - 1
        validators' steps are done when it reaches ``base + V - 1`` (before our first step: when
        it reaches ``step``). A head that restarted (its step went backwards) or is unreachable ends
        the wait. Without progress for ``timeout_s`` we go ahead with this step; after
        ``give_up_after`` such time-outs in a row (another validator is gone) the lane stops waiting
        for the rest of the run. Returns True when the turn came."""
        if self.n_validators <= 1 or lane in self._no_turns:
            return False
        base = self._turn_base.get(lane)
        need = base + self.n_validators - 1 if base is not None else step
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if stop is not None and stop.is_set():
                return False
            cur = await self._head_step(lane)
            if cur is None or cur >= need or (base is not None and cur < base):
                self._turn_timeouts[lane] = 0
                return cur is not None and cur >= need
            if cur != last:                     # progress: the other validator is alive
                deadline = time.monotonic() + timeout_s
                last = cur
            await asyncio.sleep(poll_s)
        self._turn_timeouts[lane] = self._turn_timeouts.get(lane, 0) + 1
        if self._turn_timeouts[lane] >= give_up_after:
            self._no_turns.add(lane)
            logger.warning("lane {}: {} waits in a row for the other validators timed out; driving without "
                           "waiting from now on", lane, give_up_after)
        else:
            logger.warning("lane {} step {}: no progress from the other validators in {:.0f} s; going ahead",
                           lane, step, timeout_s)
        return False

    async def run_lane(self, lane: int, start_step: int, total_steps: int,
                       on_step: Optional[Callable[[LaneStepResult, int], Awaitable[None] | None]] = None,
                       stop: Optional[asyncio.Event] = None) -> int:
        """Drive this validator's lane steps of ``lane`` in ``[start_step, total_steps)``, one after
        another. A step in which no micro-batch completed (every route down) is retried after a
        pause. ``on_step(result, next_step)`` is called after each completed step (commit it there).
        Returns the next lane step to drive."""
        todo = steps_of(self.validator_index, self.n_validators, start_step, total_steps)
        i = 0
        next_step = todo[0] if todo else max(start_step, total_steps)
        while i < len(todo):
            if stop is not None and stop.is_set():
                break
            k = todo[i]
            await self.probe()
            await self.await_turn(lane, k, stop)
            res = await self.run_lane_step(lane, k)
            if res.ok_count == 0:
                logger.warning("lane {} step {}: no micro-batch completed; retrying", lane, k)
                await self.wait_and_probe(self.empty_step_wait_s)
                continue
            i += 1
            next_step = todo[i] if i < len(todo) else total_steps
            if self.n_validators > 1:
                # the head's step as our step left it (from its own replies): asking /health now
                # could already see the next validator's step and wait for a step nobody drives
                self._turn_base[lane] = res.head_step if res.head_step is not None else await self._head_step(lane)
                if self._turn_base[lane] is None:
                    del self._turn_base[lane]
            if on_step is not None:
                out = on_step(res, next_step)
                if asyncio.iscoroutine(out):
                    await out
            logger.info("lane {} step {} loss {} ({} / {} micro-batches, {} reroutes) in {:.2f} s", lane, k,
                        f"{res.loss:.4f}" if res.loss is not None else "-", res.ok_count, len(res.microbatches),
                        res.reroutes, res.elapsed_s)
        return next_step

    async def run(self, start_steps: dict[int, int], total_steps: int,
                  on_step: Optional[Callable[[LaneStepResult, int], Awaitable[None] | None]] = None,
                  stop: Optional[asyncio.Event] = None) -> dict[int, int]:
        """All lanes concurrently; ``start_steps``: lane -> next lane step (missing: 0)."""
        lanes = list(range(self.n_lanes))
        nxt = await asyncio.gather(*(self.run_lane(l, start_steps.get(l, 0), total_steps, on_step, stop)
                                     for l in lanes))
        return dict(zip(lanes, nxt))

    async def evaluate(self, n_batches: Optional[int] = None, lane: int = 0) -> Optional[float]:
        """Mean validation loss over ``n_batches`` micro-batches of ``val_batch`` through ``lane``
        (``keep_for_backward=False``: the miners cache nothing). None if none completed."""
        n = self.cfg.train.eval_batches if n_batches is None else int(n_batches)
        rows = [self.dataset.val_batch(i * self.mb, self.mb) for i in range(n)]
        losses: dict[int, float] = {}
        for attempt in range(1 + self.eval_retries):
            if attempt:
                await self.wait_and_probe(self.empty_step_wait_s * 2)
            else:
                await self.probe()
            todo = [i for i in range(n) if i not in losses]
            results = await asyncio.gather(*(self.run_microbatch(lane, -1, i, rows[i], train=False) for i in todo))
            losses.update({r.idx: r.loss for r in results if r.ok and r.loss is not None})
            if len(losses) == n:
                break
        if len(losses) < n:
            logger.warning("evaluation: {} of {} micro-batches completed", len(losses), n)
        losses = list(losses.values())
        if not losses:
            return None
        return sum(losses) / len(losses)

    # ---------------------------------------------------------------- CLASP probes
    async def clasp_round(self, round_id: int, paths: int, rng, batch_index: Optional[int] = None) -> list[dict]:
        """One CLASP probe round (:mod:`.clasp`): one held-out micro-batch forward-only through
        ``paths`` pathways drawn uniformly per stage among available replicas. Returns
        ``[{"round", "loss", "pathway"}]`` for the pathways that completed (a failed hop drops its
        pathway; it is not counted against the miner here)."""
        from .clasp import choose_pathway

        by_stage = {s: [r for r in self.router.live_replicas() if r.stage == s and self.router.is_available(r)]
                    for s in range(self.n_stages)}
        n_val = max(1, int(getattr(self.dataset, "n_val_rows", 0) or 64))
        idx = rng.randrange(max(1, n_val - self.mb)) if batch_index is None else int(batch_index)
        rows = self.dataset.val_batch(idx, self.mb)
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

        async def one(p: int) -> Optional[dict]:
            path = choose_pathway(by_stage, rng)
            if path is None:
                return None
            act = x
            mb_id = f"{self.tag}-clasp{round_id}-p{p}-{uuid.uuid4().hex[:6]}"
            for r in path:
                last = r.stage == self.n_stages - 1
                msg = Forward(run_id=self.run_id, stage=r.stage, microbatch_id=mb_id, inner_step=0, activations=act,
                              targets=y if last else None, keep_for_backward=False)
                try:
                    reply = await self.probe_client.call(r.endpoint, r.hotkey, "/forward", msg, ForwardResult,
                                                   timeout_s=self.hop_timeout_s, retries=0)
                    if last:
                        if reply.loss is None or not math.isfinite(float(reply.loss)):
                            raise HopFailed("loss not finite")
                        return {"round": int(round_id), "loss": float(reply.loss),
                                "pathway": [{"stage": q.stage, "uid": q.uid, "hotkey": q.hotkey} for q in path]}
                    act = self._check(reply.activations, (int(x.shape[0]), int(x.shape[1]), self.width), "activations")
                except (ProtocolError, TransportError, HopFailed) as e:
                    logger.debug("CLASP probe {} through {} failed: {}", mb_id, r.short(), e)
                    return None
            return None

        got = await asyncio.gather(*(one(p) for p in range(max(2, int(paths)))))
        return [g for g in got if g is not None]
