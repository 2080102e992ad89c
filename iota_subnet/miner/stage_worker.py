"""The compute core of a miner: one pipeline stage, its inner optimizer and its activation cache.

No networking here: the miner service (transport) calls :meth:`StageWorker.forward` and
:meth:`StageWorker.backward` from a single compute thread. Tensors come in and go out in host
memory; the stage computes on ``device`` (inputs and outputs cross through
:class:`~iota_subnet.utils.device.DeviceIO`: pinned buffers, non-blocking copies on a side stream).

Memory: a cached forward is charged what its autograd graph really holds (measured by
:class:`~iota_subnet.miner.activation_cache.SavedTensorMeter`), and the cache is bounded by
``train.activation_cache_mib`` / ``_entries`` / ``_ttl_s``. ``train.activation_checkpointing`` keeps
only block inputs; ``train.compile`` runs the stage through ``torch.compile``.

Checkpoints: :meth:`snapshot` copies weights and optimizer state to host memory under the lock
(fast); :meth:`write_snapshot` serialises and writes them on any other thread.

Gradient accumulation: one inner step = ``train.batch_size / train.micro_batch_size`` micro-batches
(the same tokens as one co-located optimizer step). The tail divides each micro-batch loss by that
count before ``backward``, so gradients arrive at every stage already scaled; each stage steps
AdamW after that many backward passes, with the co-located trainer's schedule (:func:`lr_at`; an
optimizer state younger than the run, as after a join, re-warms: :func:`update_lr`) and per-stage
gradient clipping.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from pathlib import Path
from typing import Optional

import torch
from loguru import logger

from iota_subnet.audit.update import clip_coef
from iota_subnet.config import RunConfig
from iota_subnet.miner.activation_cache import ActivationCache, SavedTensorMeter
from iota_subnet.miner.update_store import UpdateStore
from iota_subnet.utils.spill import SpillDir
from iota_subnet.model import make_stage
from iota_subnet.train.checkpoint import (checkpoint_bytes, config_fingerprint, read_checkpoint,
                                          restore, save_checkpoint)
from iota_subnet.train.colocated import autocast_ctx
from iota_subnet.train.optim import make_optimizer, next_adam_step, set_lr, update_lr
from iota_subnet.train.precision import prepare_device
from iota_subnet.train.snapshot import StateSnapshot
from iota_subnet.utils.device import DeviceIO


class UnknownMicrobatch(KeyError):
    """A backward arrived for a micro-batch this stage has no cached forward for (never seen, or evicted)."""


class StageWorker:
    """One stage's weights, optimizer and in-flight micro-batches.

    ``total_steps``: length of the learning-rate schedule in inner steps. ``audit_window``: inner
    steps kept for update audits (:class:`~iota_subnet.miner.update_store.UpdateStore`; 0 = no
    commitments, e.g. in benchmarks of the compute alone); ``audit_spill``: where the update store
    spills its copies (:mod:`iota_subnet.utils.spill`; None: host memory).

    :meth:`compute_forward`, :meth:`backward`, :meth:`step` and :meth:`apply_update` are the parts a
    subclass may override.
    """

    #: real weights (merged, synced, audited); an emulated worker has none
    has_weights = True

    @property
    def merge_module(self) -> torch.nn.Module:
        """What the stage's replica merges read and write (:class:`~iota_subnet.merge.params.ModuleParams`):
        its module. A worker without one (None) is not merged; an emulated worker's is a proxy of its
        stage (:mod:`iota_subnet.sim.virtual_merge`)."""
        return self.module

    def __init__(self, cfg: RunConfig, stage: int, *, device: str | torch.device = "cpu", seed: int = 0,
                 total_steps: Optional[int] = None, cache: Optional[ActivationCache] = None,
                 audit_window: int = 0, audit_spill: Optional[SpillDir] = None):
        self.cfg, self.stage = cfg, stage
        self.device = prepare_device(device, cfg)      # TF32 by train.precision on CUDA
        torch.manual_seed(seed + 1000 * stage)       # same init as build_stages(cfg, seed)
        self.module = make_stage(cfg.model, cfg.pipeline, stage, seed=seed,
                                 checkpointing=cfg.train.activation_checkpointing).to(self.device)
        self.opt = make_optimizer(self.module, cfg.train)
        self.spec = self.module.spec
        t = cfg.train
        self.cache = cache if cache is not None else ActivationCache(
            ttl_s=t.activation_cache_ttl_s, max_bytes=t.activation_cache_mib << 20, max_entries=t.activation_cache_entries)
        self.io = DeviceIO(self.device)
        self.meter = SavedTensorMeter(self.module, self.device)
        #: the stage as torch.compile'd (``train.compile``), else None (eager)
        self.compiled = torch.compile(self.module, backend=t.compile) if t.compile else None
        self.micro_per_step = cfg.train.batch_size // cfg.train.micro_batch
        #: step after every ``micro_per_step`` accumulated backward passes (standalone use); the
        #: data plane (:mod:`iota_subnet.miner.dataplane`) sets it False and calls :meth:`step` itself
        #: once every micro-batch of the lane step has been accumulated
        self.auto_step = True
        self.total_steps = total_steps if total_steps is not None else cfg.train.total_steps  # None: open-ended
        self.inner_step = 0
        self.version = 0                    # bumped by every optimizer step (see _recompute_backward)
        #: (from, to) inner steps of the last :meth:`skip_to` jump ((0, 0): none): merge boundaries in
        #: (from, to] were jumped over, not trained to
        self.last_skip: tuple[int, int] = (0, 0)
        #: the lane this replica last trained in as the lane's own miner of its stage (None: none yet);
        #: its weights are that lane's (the data plane takes a lane's weights before it trains in another)
        self.lane: Optional[int] = None
        self.recomputes = 0
        self.pending = 0                    # backward passes accumulated since the last inner step
        self.forwards = self.backwards = 0
        self.tokens = 0                     # tokens processed forward+backward (training only)
        #: tokens whose gradients this stage accumulated into its own weights (its work in a merge window)
        self.trained_tokens = 0
        self.fingerprint = config_fingerprint(cfg.model, cfg.pipeline, stage)
        self.lock = threading.RLock()
        #: inner step of the weights the last backward used (named in the hop's receipt)
        self.last_weights_step = 0
        #: weights replaced from outside the inner optimizer (replica merges, state syncs): with the
        #: inner step it names the weights a result was computed with
        self.merges = 0
        self.last_weights_merges = 0
        #: the run's compute precision (``train.precision``; validators read it from the run config)
        self.precision = cfg.train.precision
        #: commitments to every inner step and what update audits open (None: off)
        self.updates: Optional[UpdateStore] = (UpdateStore(self.module, self.opt, keep_steps=audit_window,
                                                           spill=audit_spill) if audit_window > 0 else None)
        #: seconds spent computing (forward, backward, inner steps); stage utilisation = busy_s / wall
        self.busy_s = 0.0
        self._busy_depth = 0

    @contextlib.contextmanager
    def _busy(self):
        """Count the enclosed compute in :attr:`busy_s` (outermost call only; GPU work is waited for)."""
        if self._busy_depth:
            yield
            return
        self._busy_depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._busy_depth -= 1
            self.busy_s += time.perf_counter() - t0

    # ---- compute -----------------------------------------------------------------------------
    def forward(self, mb_id: str, x: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                train: bool = True, accumulate: bool = True) -> dict:
        """Run the stage on one micro-batch.

        x: token ids int64 [B, T] (head) or activations float [B, T, b] (others).
        Returns ``{"activations": [B, T, b]}`` for head/body; for the tail (``targets`` [B, T]
        required) ``{"loss": float, "grad": [B, T, b]}``: the tail does its backward at once and
        returns the activation gradient for the previous stage. With ``train=False`` nothing is
        cached or accumulated (evaluation) and the tail returns only the loss. Every result also
        carries ``weights_step``: the inner step of the weights used (receipts and audits name it).

        ``accumulate=False`` (a micro-batch this stage serves without training on it: another lane's,
        or one it already accumulated): the tail returns the input gradient without touching the
        parameters' gradients, and the later :meth:`backward` does the same.
        """
        with self.lock, self._busy():
            step = self.inner_step
            res = self.compute_forward(mb_id, x, targets, train=train, accumulate=accumulate)
            res.setdefault("weights_step", step)
            res.setdefault("weights_merges", self.merges)
            return res

    def _run(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The stage itself (compiled when configured)."""
        fn = self.compiled if self.compiled is not None else self.module
        return fn(x) if targets is None else fn(x, targets)

    def compute_forward(self, mb_id: str, x: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                        train: bool = True, accumulate: bool = True) -> dict:
        """The forward proper, called by :meth:`forward` under :attr:`lock` (same arguments and result,
        without ``weights_step`` / ``weights_merges``): caches a training forward for its backward (the
        tail backpropagates at once and counts it with :meth:`count_backward`). A subclass may override it."""
        with self.lock:
            x = self.io.to_device(x)
            if self.spec.is_tail:
                if targets is None:
                    raise ValueError("the tail stage needs targets")
                targets = self.io.to_device(targets)
            if not train:
                with torch.no_grad(), autocast_ctx(self.device, self.precision):
                    if self.spec.is_tail:
                        return {"loss": float(self._run(x, targets))}
                    return {"activations": self.io.to_host(self._run(x).float())}
            inp = None
            tokens_in = x
            if not self.spec.is_head:
                inp = x.detach().float().requires_grad_(True)
                x = inp
            if self.spec.is_tail:
                with autocast_ctx(self.device, self.precision):
                    loss = self._run(x, targets)
                self.forwards += 1
                loss_v = float(loss.detach())
                if accumulate:
                    (loss / self.micro_per_step).backward()
                    grad = inp.grad.detach() if inp is not None else None
                    self.count_backward(targets.numel())
                else:
                    grad = (torch.autograd.grad(loss / self.micro_per_step, inp)[0].detach()
                            if inp is not None else None)
                    self.tokens += int(targets.numel())
                res = {"loss": loss_v}
                if grad is not None:
                    res["grad"] = self.io.to_host(grad)
                return res
            with self.meter.measure(inputs=inp) as m, autocast_ctx(self.device, self.precision):
                out = self._run(x)
            self.forwards += 1
            self.cache.put(mb_id, inp, out, nbytes=self.meter.finish(m, out), tokens=int(x.shape[0] * x.shape[1]),
                           version=self.version, token_ids=tokens_in if self.spec.is_head else None,
                           step=self.inner_step, merges=self.merges, accumulate=accumulate)
            return {"activations": self.io.to_host(out.detach().float())}

    def backward(self, mb_id: str, grad: torch.Tensor, accumulate: Optional[bool] = None) -> Optional[torch.Tensor]:
        """Backpropagate the activation gradient [B, T, b] of micro-batch ``mb_id``.

        Returns dL/d(input) [B, T, b], or None for the head. Raises UnknownMicrobatch when the
        forward is not (or no longer) cached; shape mismatches raise ValueError. Steps the inner
        optimizer when a full batch of micro-batches has been accumulated (``auto_step``).
        ``accumulate=False`` overrides the forward's choice: input gradient only (the stage moved past
        the step this micro-batch belonged to while it waited).
        """
        with self.lock, self._busy():
            entry = self.cache.pop(mb_id)
            if entry is None:
                raise UnknownMicrobatch(mb_id)
            if tuple(grad.shape) != tuple(entry.outputs.shape):
                raise ValueError(f"gradient shape {tuple(grad.shape)} != activation shape {tuple(entry.outputs.shape)}")
            grad = self.io.to_device(grad)
            if accumulate is False or not entry.meta.get("accumulate", True):
                gin = self._input_grad_only(entry, grad)
                return None if gin is None else self.io.to_host(gin)
            if entry.meta.get("version") == self.version:
                self.last_weights_step = int(entry.meta.get("step", self.inner_step))
                self.last_weights_merges = int(entry.meta.get("merges", self.merges))
                entry.outputs.backward(grad.to(entry.outputs.dtype))
                gin = entry.inputs.grad.detach() if entry.inputs is not None else None
            else:
                self.last_weights_step, self.last_weights_merges = self.inner_step, self.merges
                gin = self._recompute_backward(entry, grad)
            self.count_backward(entry.meta.get("tokens", 0))
            return None if gin is None else self.io.to_host(gin)

    def _input_grad_only(self, entry, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """Backward of a micro-batch this stage does not train on: d loss / d input only (the
        parameters' gradients are left alone); the head has nothing to return."""
        self.last_weights_step = int(entry.meta.get("step", self.inner_step))
        self.last_weights_merges = int(entry.meta.get("merges", self.merges))
        self.tokens += int(entry.meta.get("tokens", 0))
        if self.spec.is_head:
            return None
        if entry.meta.get("version") != self.version:      # weights replaced since: recompute with today's
            self.last_weights_step, self.last_weights_merges = self.inner_step, self.merges
            x = entry.inputs.detach().requires_grad_(True)
            with autocast_ctx(self.device, self.precision):
                out = self._run(x)
            return torch.autograd.grad(out, x, grad.to(self.device, out.dtype))[0].detach()
        return torch.autograd.grad(entry.outputs, entry.inputs, grad.to(self.device, entry.outputs.dtype))[0].detach()

    def drop(self, mb_id: str) -> bool:
        """Forget a cached forward (its micro-batch died downstream). True if one was cached."""
        with self.lock:
            return self.cache.pop(mb_id) is not None

    def skip_to(self, step: int) -> int:
        """Jump the inner step forward to ``step`` (a lane member that missed whole lane steps while it
        was away): accumulated gradients are dropped; the learning-rate schedule follows the lane.
        Returns how many steps were skipped."""
        with self.lock:
            skipped = max(0, int(step) - self.inner_step)
            if skipped:
                self.opt.zero_grad(set_to_none=True)
                self.pending = 0
                if self.updates is not None:
                    # say so in an update commitment (skipped, weights unchanged) of the last inner step
                    # jumped over: validators flag a weights root that stays the same over inner steps
                    # nothing explains (the ``stale`` cheat); a lane that skips one step at a time
                    # under churn looks exactly like that
                    pending = self.updates.begin(int(step) - 1, self.merges)
                    self.updates.finish(pending, lr=0.0, grad_norm=0.0, clip_coef=0.0, skipped=True)
                self.last_skip = (self.inner_step, int(step))
                self.inner_step = int(step)
                self.version += 1
            return skipped

    def _recompute_backward(self, entry, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """The weights changed (an inner step) since this micro-batch's forward: its cached graph
        refers to overwritten tensors, so recompute the forward with the current weights and
        backpropagate through that (activation recomputation, as in Chen et al. 2016)."""
        self.recomputes += 1
        entry.outputs = None  # drop the stale graph before building a new one
        if self.spec.is_head:
            x = entry.meta["token_ids"]
        else:
            x = entry.inputs.detach().requires_grad_(True)
        with autocast_ctx(self.device, self.precision):
            out = self._run(x)
        out.backward(grad.to(self.device, out.dtype))
        return None if self.spec.is_head else x.grad.detach()

    def count_backward(self, tokens: int) -> None:
        """Count one backward pass of ``tokens`` tokens accumulated into this stage's gradients; with
        :attr:`auto_step`, step once a batch of micro-batches has been accumulated."""
        self.backwards += 1
        self.tokens += int(tokens)
        self.trained_tokens += int(tokens)
        self.pending += 1
        if self.auto_step and self.pending >= self.micro_per_step:
            self.step()

    def step(self) -> None:
        """One inner optimizer step over the accumulated gradients (committed for update audits when
        :attr:`updates` is on: the gradient before clipping, the state before and after)."""
        with self.lock, self._busy():
            lr = update_lr(self.inner_step, next_adam_step(self.opt), self.total_steps, self.cfg.train)
            set_lr(self.opt, lr)
            pending = self.updates.begin(self.inner_step, self.merges) if self.updates is not None else None
            gnorm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.train.grad_clip))
            applied = math.isfinite(gnorm)
            if applied:
                self.apply_update()
            else:
                logger.warning(f"stage {self.stage}: non-finite gradient norm at inner step {self.inner_step}; step skipped")
            if pending is not None:
                self.updates.finish(pending, lr=lr, grad_norm=gnorm,
                                    clip_coef=clip_coef(gnorm, self.cfg.train.grad_clip) if applied else 0.0,
                                    skipped=not applied)
            self.opt.zero_grad(set_to_none=True)
            self.inner_step += 1
            self.version += 1
            self.pending = 0

    def apply_update(self) -> None:
        """The optimizer update proper (AdamW on the clipped gradients), called by :meth:`step` under
        :attr:`lock` after clipping and before the update commitment is finished."""
        self.opt.step()

    def weights_replaced(self) -> None:
        """Call (under :attr:`lock`) after overwriting the weights from outside (a replica merge,
        a state sync): cached forwards are recomputed at their backward, and results name the new
        weights (``weights_merges``) so audits never check them against older weights."""
        with self.lock:
            self.version += 1
            self.merges += 1

    # ---- state -------------------------------------------------------------------------------
    def meta(self) -> dict:
        return {"step": self.inner_step, "merges": self.merges, "stage": self.stage, "lane": self.lane,
                "config_fingerprint": self.fingerprint,
                "forwards": self.forwards, "backwards": self.backwards, "tokens": self.tokens,
                "trained_tokens": self.trained_tokens, "busy_s": round(self.busy_s, 3), "saved_at": time.time()}

    def snapshot(self) -> StateSnapshot:
        """Host copy of weights + optimizer state + meta, taken under the lock (device-to-host copies
        only; call on the compute thread, then :meth:`write_snapshot` anywhere)."""
        with self.lock:
            return StateSnapshot(self.module, self.opt, self.meta())

    def write_snapshot(self, snap: StateSnapshot, path: str | Path) -> Path:
        """Serialise and atomically write a :meth:`snapshot` (safetensors); safe off the compute thread."""
        return save_checkpoint(path, snap.module, snap.optimizer, snap.meta)

    def save(self, path: str | Path) -> Path:
        """Atomic checkpoint of weights + optimizer state (safetensors), snapshot and write in one call."""
        return self.write_snapshot(self.snapshot(), path)

    def state_bytes(self, with_optimizer: bool = False) -> bytes:
        """The stage weights (and optionally optimizer state) as safetensors bytes (state sync)."""
        snap = self.snapshot()
        return checkpoint_bytes(snap.module, snap.optimizer if with_optimizer else None, snap.meta)

    def load(self, path: str | Path) -> bool:
        """Resume from a checkpoint if it exists. Returns True if loaded.

        Raises CheckpointError for a corrupt file or one written for another stage/config.
        """
        path = Path(path)
        if not path.exists():
            return False
        tensors, meta = read_checkpoint(path)
        with self.lock:
            restore(self.module, self.opt, tensors, meta, expect_fingerprint=self.fingerprint, path=str(path))
            if self.opt.defaults.get("fused"):      # fused AdamW keeps its step counts on the parameters' device
                for p, st in self.opt.state.items():
                    if torch.is_tensor(st.get("step")):
                        st["step"] = st["step"].to(p.device, torch.float32)
            self.inner_step = int(meta["step"])
            self.forwards, self.backwards = int(meta.get("forwards", 0)), int(meta.get("backwards", 0))
            self.tokens = int(meta.get("tokens", 0))
            self.trained_tokens = int(meta.get("trained_tokens", self.tokens))
            self.lane = int(meta["lane"]) if isinstance(meta.get("lane"), int) else None
            self.pending = 0
        logger.info(f"stage {self.stage}: resumed from {path} at inner step {self.inner_step}")
        return True
