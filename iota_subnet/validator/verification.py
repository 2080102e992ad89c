"""Spot checks: the validator replays a sampled fraction of each miner's forward and backward work.

What the validator has
    For every hop it drove: the input it sent (token ids [B, T] or activations [B, T, b]), the
    targets (last stage), the output it received (activations [B, T, b], or loss + d loss / d input
    for the last stage), and for a backward the incoming gradient [B, T, b] and the returned one.
    The weights come through the ``/state`` synapse: before every lane step the validator takes a
    snapshot of each lane member's stage weights (``snapshot_every`` steps; ``state_meta.step`` is
    the miner's inner step). Between two lane steps a miner of the lane does exactly one inner step,
    so the hops of the step that follows a snapshot run with the snapshot's weights; a miner reports
    the inner step whose weights it used (``stats.weights_step``) and a hop whose reported step
    differs from the snapshot's is *unverifiable* (skipped, counted), never failed.

Blindness
    A hop is sampled with probability ``rate`` drawn from an OS-seeded RNG *after* its reply has
    come back, and every lane member is snapshotted before every step, so nothing a miner sees
    (requests, timing, the ``/state`` calls) depends on which of its hops will be replayed. With
    ``snapshot_every > 1`` the steps without a snapshot cannot be checked and a miner can tell
    which steps those are: only the default 1 is blind.

Replay
    The stage is rebuilt on the validator (fp32, CPU unless told otherwise) with the snapshot's
    weights; the forward is recomputed from the input sent, and, when the hop's backward was
    recorded, the backward from the gradient sent (the last stage: the loss / ``micro_per_step``,
    as the miner does). The head's backward returns nothing, so only its forward is replayed; its
    training shows in its weights (the stale-weights check below).

Comparison and tolerances
    ``rel_err(got, ref) = ||got - ref||_2 / max(||ref||_2, 1e-12)`` over the whole tensor (the
    loss: ``|got - ref| / max(|ref|, 1e-12)``). A hop fails when ``rel_err > tol``, with ``tol`` set
    by the **run config** (``train.precision``, :func:`replay_tolerance`), never by the miner's
    reply (a ``bf16`` flag in a reply used to buy the 20x looser tolerance: the ``precision``
    adversary claims it and skips work within it):

    * ``fp32``: ``tol = 1e-3``. A replay of the same fp32 computation differs only by reduction
      order / kernel choice (measured ``< 1e-5`` for the tiny model on CPU; a GPU's TF32 matmuls
      reach ``~1e-3`` on long chains: an fp32 run disables TF32).
    * ``bf16`` (autocast, fp32 master weights): ``tol = 2e-2``. bf16 keeps 8 mantissa bits (unit
      round-off 2^-8 = 3.9e-3 per rounding, partly averaging out in long dot products). Measured
      bf16 autocast vs fp32 (``scripts/bench_precision.py``, CPU, seeded initialisation):
      stage 1 of ``1b`` cut in 4 (layers 4-7, 244 M parameters, 1 row x 128 tokens): 4.5e-3 on
      activations, 6.6e-3 on input gradients (3x under the tolerance); stage 1 of ``tiny``
      (3 blocks, 4 x 256 tokens): 2.1e-3 and 2.2e-3. Skipping the stage's last block (bf16) is off
      by 0.26 / 0.39 at ``1b`` (13x the tolerance) but only 2.4e-2 / 3.6e-2 on ``tiny``: lazy
      miners that skip a small fraction of a small stage need an fp32 run (33x margin) or CLASP.
      Trained weights may raise the honest bf16 error: re-measure before tightening.

    Measured errors of the cheats in the suite on the test model (fp32): lazy 4e-2..1e-1, claim
    (zero gradient) 1.0, zero 1.0, replayed / copied outputs 0.5..1.5, precision (bf16 plus a
    skipped MLP) 3.6e-3 (``tests/test_adversaries.py``).

Stale weights
    Between two snapshots of the same miner, if this validator delivered at least ``micro_per_step``
    backward passes to it, its inner step must have advanced and its weights must have changed
    (AdamW with lr > 0 and weight decay changes every parameter). Weights bit-identical although the
    step advanced, or a step that did not advance, fail the check ``stale``.

Flags
    A miner is flagged (quality factor 0, see :mod:`.scoring`) when ``failed >= fail_threshold``
    (default 1: the tolerances sit more than an order of magnitude above honest error), or, with a
    single validator driving it, when at least ``min_samples`` sampled hops were unverifiable and
    they outnumber the verified ones (a miner that misreports ``weights_step`` to dodge the replay).
    With several validators, interleaved steps make honest miners unverifiable at times, so that
    rule is off.

Cost: a replayed hop costs the validator the miner's compute for it (forward + backward), so the
validator does ``rate`` of the network's compute, plus one ``/state`` transfer (the stage's
weights, 4 bytes a parameter) per lane member per ``snapshot_every`` lane steps.
"""
from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
from loguru import logger

from iota_subnet.config import RunConfig
from iota_subnet.protocol import ProtocolError, StateRequest, StateResponse
from iota_subnet.transport import TransportError

Key = tuple[int, str]

#: Relative L2 tolerance of a replayed hop, by the run's precision (``train.precision``; see the module docstring).
TOLERANCES = {"fp32": 1e-3, "bf16": 2e-2}


def replay_precision(cfg: RunConfig) -> str:
    """The precision a replay is judged at: the run config's ``train.precision`` (a miner's reply
    cannot loosen its own tolerance, issue 10 item 5)."""
    return cfg.train.precision


def replay_tolerance(cfg: RunConfig) -> float:
    """Relative L2 tolerance of a replayed hop for this run (:data:`TOLERANCES`)."""
    return TOLERANCES[replay_precision(cfg)]


def rel_err(got: Any, ref: Any) -> float:
    """``||got - ref|| / max(||ref||, 1e-12)`` (tensors of equal shape, or floats); inf on a shape mismatch
    or anything non-finite."""
    if isinstance(ref, (int, float)) or isinstance(got, (int, float)):
        try:
            g, r = float(got), float(ref)
        except (TypeError, ValueError):
            return math.inf
        e = abs(g - r) / max(abs(r), 1e-12)
        return e if math.isfinite(e) else math.inf
    if got is None or ref is None or tuple(got.shape) != tuple(ref.shape):
        return math.inf
    g, r = got.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)   # any devices
    e = float((g - r).norm() / max(float(r.norm()), 1e-12))
    return e if math.isfinite(e) else math.inf


@dataclass
class Snapshot:
    """A miner's stage weights at inner step ``step`` (what ``/state`` returned)."""

    uid: int
    hotkey: str
    stage: int
    step: int
    tensors: dict[str, torch.Tensor]
    taken_at: float = field(default_factory=time.time)
    merges: Optional[int] = None     #: weights replaced by replica merges so far (``state_meta.merges``)


@dataclass
class Sample:
    """One sampled hop: what was sent and what came back."""

    uid: int
    hotkey: str
    stage: int
    lane: int
    step: int
    microbatch_id: str
    x: torch.Tensor
    targets: Optional[torch.Tensor]
    weights_step: Optional[int]
    precision: str
    out: Optional[torch.Tensor] = None       # activations (head/body)
    loss: Optional[float] = None             # tail
    grad_out: Optional[torch.Tensor] = None  # tail: d loss / d input it returned
    grad_in: Optional[torch.Tensor] = None   # body/head backward: the gradient sent
    grad_back: Optional[torch.Tensor] = None  # body backward: the gradient it returned
    backward_step: Optional[int] = None
    weights_merges: Optional[int] = None      # stats.weights_merges of the forward
    backward_merges: Optional[int] = None


@dataclass
class CheckStats:
    """Per miner (uid, hotkey): outcome counts of its spot checks."""

    uid: int
    hotkey: str
    stage: int
    sampled: int = 0
    passed: int = 0
    failed: int = 0
    unverifiable: int = 0         # reported weights step != snapshot step
    no_snapshot: int = 0          # sampled but no snapshot of it (a spare that took a rerouted hop)
    stale_checks: int = 0
    stale_failed: int = 0
    max_err_passed: float = 0.0
    flagged: bool = False
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def flag(self, reason: str) -> None:
        self.flagged = True
        if reason not in self.reasons:
            self.reasons.append(reason)
            del self.reasons[:-8]


class SpotChecker:
    """Samples hops, snapshots weights, replays, keeps :class:`CheckStats` per miner.

    ``client``: a :class:`~iota_subnet.transport.NeuronClient` (``/state`` calls); ``rate``: fraction of
    hops replayed (0 disables); ``rng``: a ``random.Random`` (default ``random.SystemRandom``, the OS CSPRNG, so a
    miner cannot predict the draws); ``single_validator``: whether the unverifiable-hops rule applies.
    """

    def __init__(self, cfg: RunConfig, *, run_id: str, client: Any = None, rate: float = 0.1,
                 snapshot_every: int = 1, fail_threshold: int = 1, min_samples: int = 8,
                 single_validator: bool = True, rng: Optional[random.Random] = None, state_timeout_s: float = 30.0,
                 device: str = "cpu"):
        self.cfg, self.run_id, self.client = cfg, run_id, client
        self.rate = max(0.0, min(1.0, float(rate)))
        self.snapshot_every = max(1, int(snapshot_every))
        self.fail_threshold = max(1, int(fail_threshold))
        self.min_samples = int(min_samples)
        self.single_validator = single_validator
        self.rng = rng or random.SystemRandom()   # the OS CSPRNG: draws a miner cannot predict
        self.state_timeout_s = state_timeout_s
        self.device = torch.device(device)
        self.micro_per_step = cfg.train.batch_size // cfg.train.micro_batch
        self.stats: dict[Key, CheckStats] = {}
        self.snaps: dict[Key, Snapshot] = {}
        self.delivered: dict[Key, int] = {}       # backward passes delivered since its last snapshot
        self.pending: dict[tuple[str, int], Sample] = {}
        self.events: list[dict] = []              # recent check outcomes (for explanations)
        self._modules: dict[int, torch.nn.Module] = {}
        self._replay_lock = threading.Lock()   # lanes replay from several threads; one module per stage

    # ---------------------------------------------------------------- bookkeeping
    def stat(self, uid: int, hotkey: str, stage: int) -> CheckStats:
        key = (int(uid), str(hotkey))
        s = self.stats.get(key)
        if s is None:
            s = self.stats[key] = CheckStats(int(uid), str(hotkey), int(stage))
        s.stage = int(stage)
        return s

    def flagged(self) -> set[Key]:
        return {k for k, s in self.stats.items() if s.flagged}

    def _event(self, s: CheckStats, kind: str, ok: bool, detail: str) -> None:
        self.events.append({"uid": s.uid, "hotkey": s.hotkey, "stage": s.stage, "kind": kind, "ok": ok,
                            "detail": detail, "ts": time.time()})
        del self.events[:-500]

    def _fail(self, s: CheckStats, kind: str, detail: str) -> None:
        s.failed += 1
        self._event(s, kind, False, detail)
        logger.warning("spot check FAILED for uid {} (stage {}): {} {}", s.uid, s.stage, kind, detail)
        if s.failed >= self.fail_threshold:
            s.flag(f"{kind}: {detail}")

    # ---------------------------------------------------------------- hooks called by the driver
    async def before_step(self, lane: int, step: int, members: list) -> None:
        """Snapshot every lane member (``Replica`` or None) before lane step ``step`` (every
        ``snapshot_every`` steps). A failed ``/state`` call leaves the miner unsnapshotted (its hops
        of this step are not checkable) and is not a failure of the check."""
        if self.rate <= 0 or self.client is None or step % self.snapshot_every:
            for r in members:
                if r is not None:
                    self.snaps.pop(r.key, None)
            return
        await asyncio.gather(*(self._snapshot(r) for r in members if r is not None))

    async def _snapshot(self, r) -> None:
        try:
            resp = await self.client.call(r.endpoint, r.hotkey, "/state", StateRequest(run_id=self.run_id, stage=r.stage),
                                          StateResponse, timeout_s=self.state_timeout_s, retries=1)
            merges = resp.state_meta.get("merges")
            snap = Snapshot(r.uid, r.hotkey, r.stage, int(resp.state_meta.get("step", resp.inner_step)),
                            {k: v.detach().float() if v.is_floating_point() else v for k, v in resp.tensors.items()},
                            merges=None if merges is None else int(merges))
        except (ProtocolError, TransportError, ValueError, TypeError) as e:
            logger.info("no /state snapshot of uid {}: {}: {}", r.uid, type(e).__name__, e)
            self.snaps.pop(r.key, None)
            return
        self._check_stale(r, snap)
        self.snaps[r.key] = snap
        self.delivered[r.key] = 0

    def _check_stale(self, r, new: Snapshot) -> None:
        prev = self.snaps.get(r.key)
        n = self.delivered.get(r.key, 0)
        if prev is None or n < self.micro_per_step:
            return
        s = self.stat(r.uid, r.hotkey, r.stage)
        s.stale_checks += 1
        if new.step <= prev.step:
            s.stale_failed += 1
            self._fail(s, "stale", f"inner step stayed at {new.step} after {n} backward passes")
            return
        same = prev.tensors.keys() == new.tensors.keys() and all(
            torch.equal(prev.tensors[k], new.tensors[k]) for k in new.tensors)
        if same:
            s.stale_failed += 1
            self._fail(s, "stale", f"weights unchanged from inner step {prev.step} to {new.step} "
                                   f"after {n} backward passes")
        else:
            self._event(s, "stale", True, f"weights changed {prev.step} -> {new.step}")

    def on_forward(self, lane: int, step: int, microbatch_id: str, r, x: torch.Tensor, targets: Optional[torch.Tensor],
                   reply: Any, train: bool) -> None:
        """A forward hop came back well formed. Draws whether to sample it."""
        if not train:
            return
        last = targets is not None
        if last:
            self.delivered[r.key] = self.delivered.get(r.key, 0) + 1  # the tail's backward ran with its forward
        if self.rate <= 0 or self.rng.random() >= self.rate:
            return
        stats = getattr(reply, "stats", None) or {}
        ws = stats.get("weights_step", getattr(reply, "inner_step", None))
        prec = replay_precision(self.cfg)       # the run's, never what the miner's reply says
        smp = Sample(r.uid, r.hotkey, r.stage, lane, step, microbatch_id, x.detach().clone(),
                     targets.detach().clone() if last else None, None if ws is None else int(ws), prec)
        wm = stats.get("weights_merges")
        smp.weights_merges = None if wm is None else int(wm)
        if last:
            smp.loss = float(reply.loss)
            smp.grad_out = reply.grad.detach().clone() if reply.grad is not None else None
        else:
            smp.out = reply.activations.detach().clone()
        self.pending[(microbatch_id, r.stage)] = smp

    def on_backward(self, microbatch_id: str, r, grad_in: torch.Tensor, grad_back: Optional[torch.Tensor],
                    reply: Any) -> None:
        """A backward hop came back well formed."""
        self.delivered[r.key] = self.delivered.get(r.key, 0) + 1
        smp = self.pending.get((microbatch_id, r.stage))
        if smp is None or smp.hotkey != r.hotkey:
            return
        stats = getattr(reply, "stats", None) or {}
        bs = stats.get("weights_step")
        smp.backward_step = None if bs is None else int(bs)
        bm = stats.get("weights_merges")
        smp.backward_merges = None if bm is None else int(bm)
        smp.grad_in = grad_in.detach().clone()
        smp.grad_back = None if grad_back is None else grad_back.detach().clone()

    async def after_step(self, lane: int, step: int) -> None:
        """Replay the samples of lane step ``step`` of ``lane`` (off the event loop)."""
        todo = [k for k, s in self.pending.items() if s.lane == lane and s.step == step]
        samples = [self.pending.pop(k) for k in todo]
        if samples:
            await asyncio.to_thread(self.check_samples, samples)

    # ---------------------------------------------------------------- replay
    def _module(self, stage: int) -> torch.nn.Module:
        from iota_subnet.model import PipelineStage
        m = self._modules.get(stage)
        if m is None:
            # shapes only on the meta device (no host copy of a full-size stage, no init), then
            # storage on the replay device; every value comes from the snapshot (load_state_dict, strict)
            with torch.device("meta"):
                m = PipelineStage(self.cfg.model, self.cfg.pipeline, stage, init=False)
            m = self._modules[stage] = m.to_empty(device=self.device)
        return m

    def check_samples(self, samples: list[Sample]) -> None:
        with self._replay_lock:
            self._check_samples(samples)

    def _check_samples(self, samples: list[Sample]) -> None:
        for smp in samples:
            try:
                self.check(smp)
            except Exception as e:  # noqa: BLE001 - a replay bug must not stop the validator
                logger.warning("replay of uid {} stage {} crashed: {}: {}", smp.uid, smp.stage, type(e).__name__, e)

    def check(self, smp: Sample) -> Optional[bool]:
        """Replay one sample. True: passed; False: failed; None: not checkable (counted)."""
        s = self.stat(smp.uid, smp.hotkey, smp.stage)
        s.sampled += 1
        snap = self.snaps.get((smp.uid, smp.hotkey))
        if snap is None:
            s.no_snapshot += 1
            return None
        if smp.weights_step != snap.step or (snap.merges is not None and smp.weights_merges is not None
                                             and smp.weights_merges != snap.merges):
            s.unverifiable += 1
            self._event(s, "unverifiable", True, f"reported weights step {smp.weights_step} (merges "
                                                 f"{smp.weights_merges}), snapshot {snap.step} (merges {snap.merges})")
            if (self.single_validator and s.unverifiable >= self.min_samples
                    and s.unverifiable > s.passed + s.failed):
                s.flag(f"evades checks: {s.unverifiable} sampled hops report a weights step that no snapshot has")
            return None
        tol = TOLERANCES[smp.precision]
        m = self._module(smp.stage)
        try:
            m.load_state_dict(snap.tensors, strict=True)
        except RuntimeError as e:
            self._fail(s, "state", f"/state weights do not fit the stage: {str(e)[:120]}")
            return False
        m.zero_grad(set_to_none=True)
        head, tail = m.spec.is_head, m.spec.is_tail
        x = smp.x.to(self.device)
        inp = x if head else x.float().requires_grad_(True)
        errs: dict[str, float] = {}
        with torch.enable_grad():
            if tail:
                loss = m(inp, smp.targets.to(self.device))
                errs["loss"] = rel_err(smp.loss, float(loss.detach()))
                if smp.grad_out is not None and not head:
                    (loss / self.micro_per_step).backward()
                    errs["grad"] = rel_err(smp.grad_out, inp.grad)
            else:
                out = m(inp)
                errs["activations"] = rel_err(smp.out, out.detach())
                check_bwd = smp.grad_in is not None and not head and (
                    smp.backward_step is None or smp.backward_step == snap.step) and (
                    snap.merges is None or smp.backward_merges in (None, snap.merges))
                if check_bwd:
                    out.backward(smp.grad_in.to(self.device, out.dtype))
                    errs["grad"] = rel_err(smp.grad_back, inp.grad)
        worst = max(errs.values())
        detail = ", ".join(f"{k} rel err {v:.2e}" for k, v in errs.items()) + f" (tol {tol:g}, {smp.precision})"
        if worst > tol:
            self._fail(s, "replay", f"step {smp.step} mb {smp.microbatch_id[-8:]}: {detail}")
            return False
        s.passed += 1
        s.max_err_passed = max(s.max_err_passed, worst)
        self._event(s, "replay", True, detail)
        return True

    # ---------------------------------------------------------------- persistence
    def to_dict(self) -> dict:
        return {"stats": [s.to_dict() for s in self.stats.values()], "events": self.events[-200:]}

    def load_dict(self, d: dict) -> None:
        for row in d.get("stats", []):
            s = CheckStats(**row)
            self.stats[(s.uid, s.hotkey)] = s
        self.events = list(d.get("events", []))
