"""The compute core of a miner: one pipeline stage, its inner optimizer and its activation cache.

No networking here: the miner service (transport) calls :meth:`StageWorker.forward` and
:meth:`StageWorker.backward` from a single compute thread.

Gradient accumulation: one inner step = ``train.batch_size / train.micro_batch_size`` micro-batches
(the same tokens as one co-located optimizer step). The tail divides each micro-batch loss by that
count before ``backward``, so gradients arrive at every stage already scaled; each stage steps
AdamW after that many backward passes, with the co-located trainer's schedule (:func:`lr_at`) and
per-stage gradient clipping.
"""
from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Optional

import torch
from loguru import logger

from iota_subnet.config import RunConfig
from iota_subnet.miner.activation_cache import ActivationCache
from iota_subnet.model import PipelineStage
from iota_subnet.train.checkpoint import (CheckpointError, checkpoint_bytes, config_fingerprint, read_checkpoint,
                                          restore, save_checkpoint)
from iota_subnet.train.colocated import autocast_ctx
from iota_subnet.train.optim import lr_at, make_optimizer, set_lr


class UnknownMicrobatch(KeyError):
    """A backward arrived for a micro-batch this stage has no cached forward for (never seen, or evicted)."""


class StageWorker:
    """One stage's weights, optimizer and in-flight micro-batches.

    ``total_steps``: length of the learning-rate schedule in inner steps.
    """

    def __init__(self, cfg: RunConfig, stage: int, *, device: str | torch.device = "cpu", seed: int = 0,
                 total_steps: Optional[int] = None, cache: Optional[ActivationCache] = None):
        self.cfg, self.stage = cfg, stage
        self.device = torch.device(device)
        torch.manual_seed(seed + 1000 * stage)       # same init as build_stages(cfg, seed)
        self.module = PipelineStage(cfg.model, cfg.pipeline, stage).to(self.device)
        self.opt = make_optimizer(self.module, cfg.train)
        self.spec = self.module.spec
        self.cache = cache if cache is not None else ActivationCache()
        self.micro_per_step = cfg.train.batch_size // cfg.train.micro_batch
        #: step after every ``micro_per_step`` accumulated backward passes (the relay driver); the
        #: data plane (:mod:`iota_subnet.miner.dataplane`) sets it False and calls :meth:`step` itself
        #: once every micro-batch of the lane step has been accumulated
        self.auto_step = True
        self.total_steps = total_steps if total_steps is not None else cfg.train.total_steps  # None: open-ended
        self.inner_step = 0
        self.version = 0                    # bumped by every optimizer step (see _recompute_backward)
        self.recomputes = 0
        self.pending = 0                    # backward passes accumulated since the last inner step
        self.forwards = self.backwards = 0
        self.tokens = 0                     # tokens processed forward+backward (training only)
        self.fingerprint = config_fingerprint(cfg.model, cfg.pipeline, stage)
        self.lock = threading.RLock()
        #: inner step of the weights the last backward used (reported to validators for spot checks)
        self.last_weights_step = 0
        #: weights replaced from outside the inner optimizer (replica merges, state syncs): with the
        #: inner step it names the weights a result was computed with
        self.merges = 0
        self.last_weights_merges = 0
        #: "bf16" under autocast on GPU, else "fp32" (sets the validator's replay tolerance)
        self.precision = "bf16" if self.device.type == "cuda" else "fp32"

    # ---- compute -----------------------------------------------------------------------------
    def forward(self, mb_id: str, x: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                train: bool = True, accumulate: bool = True) -> dict:
        """Run the stage on one micro-batch.

        x: token ids int64 [B, T] (head) or activations float [B, T, b] (others).
        Returns ``{"activations": [B, T, b]}`` for head/body; for the tail (``targets`` [B, T]
        required) ``{"loss": float, "grad": [B, T, b]}``: the tail does its backward at once and
        returns the activation gradient for the previous stage. With ``train=False`` nothing is
        cached or accumulated (evaluation) and the tail returns only the loss. Every result also
        carries ``weights_step``: the inner step of the weights used (spot checks replay with them).

        ``accumulate=False`` (a micro-batch this stage serves without training on it: another lane's,
        or one it already accumulated): the tail returns the input gradient without touching the
        parameters' gradients, and the later :meth:`backward` does the same.
        """
        with self.lock:
            step = self.inner_step
            res = self._forward(mb_id, x, targets, train=train, accumulate=accumulate)
            res.setdefault("weights_step", step)
            res.setdefault("weights_merges", self.merges)
            return res

    def _forward(self, mb_id: str, x: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                 train: bool = True, accumulate: bool = True) -> dict:
        with self.lock:
            x = x.to(self.device)
            if not train:
                with torch.no_grad(), autocast_ctx(self.device):
                    if self.spec.is_tail:
                        if targets is None:
                            raise ValueError("the tail stage needs targets")
                        return {"loss": float(self.module(x, targets.to(self.device)))}
                    return {"activations": self.module(x).float()}
            inp = None
            tokens_in = x
            if not self.spec.is_head:
                inp = x.detach().float().requires_grad_(True)
                x = inp
            with autocast_ctx(self.device):
                if self.spec.is_tail:
                    if targets is None:
                        raise ValueError("the tail stage needs targets")
                    loss = self.module(x, targets.to(self.device))
                else:
                    out = self.module(x)
            self.forwards += 1
            if self.spec.is_tail:
                loss_v = float(loss.detach())
                if accumulate:
                    (loss / self.micro_per_step).backward()
                    grad = inp.grad.detach() if inp is not None else None
                    self._count_backward(targets.numel())
                else:
                    grad = (torch.autograd.grad(loss / self.micro_per_step, inp)[0].detach()
                            if inp is not None else None)
                    self.tokens += int(targets.numel())
                res = {"loss": loss_v}
                if grad is not None:
                    res["grad"] = grad
                return res
            self.cache.put(mb_id, inp, out, tokens=int(x.shape[0] * x.shape[1]), version=self.version,
                           token_ids=tokens_in if self.spec.is_head else None, step=self.inner_step,
                           merges=self.merges, accumulate=accumulate)
            return {"activations": out.detach().float()}

    def backward(self, mb_id: str, grad: torch.Tensor, accumulate: Optional[bool] = None) -> Optional[torch.Tensor]:
        """Backpropagate the activation gradient [B, T, b] of micro-batch ``mb_id``.

        Returns dL/d(input) [B, T, b], or None for the head. Raises UnknownMicrobatch when the
        forward is not (or no longer) cached; shape mismatches raise ValueError. Steps the inner
        optimizer when a full batch of micro-batches has been accumulated (``auto_step``).
        ``accumulate=False`` overrides the forward's choice: input gradient only (the stage moved past
        the step this micro-batch belonged to while it waited).
        """
        with self.lock:
            entry = self.cache.pop(mb_id)
            if entry is None:
                raise UnknownMicrobatch(mb_id)
            if tuple(grad.shape) != tuple(entry.outputs.shape):
                raise ValueError(f"gradient shape {tuple(grad.shape)} != activation shape {tuple(entry.outputs.shape)}")
            if accumulate is False or not entry.meta.get("accumulate", True):
                return self._input_grad_only(entry, grad)
            if entry.meta.get("version") == self.version:
                self.last_weights_step = int(entry.meta.get("step", self.inner_step))
                self.last_weights_merges = int(entry.meta.get("merges", self.merges))
                entry.outputs.backward(grad.to(self.device, entry.outputs.dtype))
                gin = entry.inputs.grad.detach() if entry.inputs is not None else None
            else:
                self.last_weights_step, self.last_weights_merges = self.inner_step, self.merges
                gin = self._recompute_backward(entry, grad)
            self._count_backward(entry.meta.get("tokens", 0))
            return gin

    def _input_grad_only(self, entry, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """Backward of a micro-batch this stage does not train on: d loss / d input only (the
        parameters' gradients are left alone); the head has nothing to return."""
        self.last_weights_step = int(entry.meta.get("step", self.inner_step))
        self.last_weights_merges = int(entry.meta.get("merges", self.merges))
        self.tokens += int(entry.meta.get("tokens", 0))
        if self.spec.is_head:
            return None
        if entry.meta.get("version") != self.version:      # weights replaced since: recompute
            x = entry.inputs.detach().requires_grad_(True)
            with autocast_ctx(self.device):
                out = self.module(x)
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
        with autocast_ctx(self.device):
            out = self.module(x)
        out.backward(grad.to(self.device, out.dtype))
        return None if self.spec.is_head else x.grad.detach()

    def _count_backward(self, tokens: int) -> None:
        self.backwards += 1
        self.tokens += int(tokens)
        self.pending += 1
        if self.auto_step and self.pending >= self.micro_per_step:
            self.step()

    def step(self) -> None:
        """One inner optimizer step over the accumulated gradients."""
        with self.lock:
            set_lr(self.opt, lr_at(self.inner_step, self.total_steps, self.cfg.train))
            gnorm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.train.grad_clip))
            if math.isfinite(gnorm):
                self.opt.step()
            else:
                logger.warning(f"stage {self.stage}: non-finite gradient norm at inner step {self.inner_step}; step skipped")
            self.opt.zero_grad(set_to_none=True)
            self.inner_step += 1
            self.version += 1
            self.pending = 0

    def weights_replaced(self) -> None:
        """Call (under :attr:`lock`) after overwriting the weights from outside (a replica merge,
        a state sync): cached forwards are recomputed at their backward, and results name the new
        weights (``weights_merges``) so spot checks never compare them with an older snapshot."""
        with self.lock:
            self.version += 1
            self.merges += 1

    # ---- state -------------------------------------------------------------------------------
    def meta(self) -> dict:
        return {"step": self.inner_step, "merges": self.merges, "stage": self.stage, "config_fingerprint": self.fingerprint,
                "forwards": self.forwards, "backwards": self.backwards, "tokens": self.tokens,
                "saved_at": time.time()}

    def save(self, path: str | Path) -> Path:
        """Atomic checkpoint of weights + optimizer state (safetensors)."""
        with self.lock:
            return save_checkpoint(path, self.module, self.opt, self.meta())

    def state_bytes(self, with_optimizer: bool = False) -> bytes:
        """The stage weights (and optionally optimizer state) as safetensors bytes (state sync)."""
        with self.lock:
            return checkpoint_bytes(self.module, self.opt if with_optimizer else None, self.meta())

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
            self.inner_step = int(meta["step"])
            self.forwards, self.backwards = int(meta.get("forwards", 0)), int(meta.get("backwards", 0))
            self.tokens = int(meta.get("tokens", 0))
            self.pending = 0
        logger.info(f"stage {self.stage}: resumed from {path} at inner step {self.inner_step}")
        return True
