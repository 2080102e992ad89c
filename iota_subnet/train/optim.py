"""Inner optimizer: AdamW (Loshchilov & Hutter 2019) with linear warmup, then cosine decay, a constant
rate or warmup-stable-decay (see :func:`lr_at`).

Used by the co-located trainer and by every miner for its stage, so both see the same schedule.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from iota_subnet.config import TrainConfig


def lr_at(step: int, total_steps: Optional[int], tcfg: TrainConfig) -> float:
    """Learning rate for 0-based optimizer step ``step``.

    Linear warmup from lr/warmup to lr over ``warmup_steps``, then ``tcfg.schedule``:

    * ``cosine``: cosine decay to ``lr * min_lr_ratio`` at the last of ``total_steps`` steps
      (SGDR, Loshchilov & Hutter 2017, without restarts);
    * ``constant``: ``lr`` (``total_steps`` may be None: an open-ended run);
    * ``wsd``: ``lr`` until ``decay_start``, then linear decay to ``lr * min_lr_ratio`` over
      ``decay_steps`` steps, then that floor (MiniCPM, arXiv 2404.06395, section 4).

    Raises ``ValueError`` for ``cosine`` without ``total_steps``.
    """
    warm = max(0, int(tcfg.warmup_steps))
    if warm and step < warm:
        return tcfg.lr * (step + 1) / warm
    floor = tcfg.lr * tcfg.min_lr_ratio
    if tcfg.schedule == "constant":
        return tcfg.lr
    if tcfg.schedule == "wsd":
        start = tcfg.decay_start
        if start is None or step < max(start, warm):
            return tcfg.lr
        progress = min(1.0, (step - max(start, warm)) / max(1, int(tcfg.decay_steps)))
        return tcfg.lr + (floor - tcfg.lr) * progress
    if total_steps is None:
        raise ValueError("the cosine schedule needs total_steps (an open-ended run uses constant or wsd)")
    span = max(1, total_steps - warm - 1)
    progress = min(1.0, max(0.0, (step - warm) / span))
    return floor + 0.5 * (tcfg.lr - floor) * (1 + math.cos(math.pi * progress))


def rewarm_factor(step: int, adam_step: int, rewarm_steps: int) -> float:
    """Learning-rate factor of an update at 0-based inner step ``step`` taken by an AdamW state whose
    step count after the update is ``adam_step``: ``min(1, adam_step / rewarm_steps)`` when the
    state is younger than the run (``adam_step < step + 1``: a replica that joined, or was synced,
    at a later step with fresh moments), else 1 (a state that took every step of the run, whose
    warmup the schedule already gives).

    Why: fresh AdamW moments make the first updates sign-like (``m / sqrt(v) = +-1`` per value at
    ``adam_step`` 1), full-size at the schedule's mid-run learning rate. Measured on ``tiny`` (3
    replicas, 5 inner steps at the step-90 learning rate from a merged model, then averaged): val
    loss 5.543 with three warm states, 5.587 with one fresh state, 5.543 with the fresh one
    re-warmed over 10 steps (docs/BENCHMARKS.md, "Churn"). Validators recompute the same factor from
    the committed ``adam_step`` (:mod:`iota_subnet.validator.update_audit`)."""
    if rewarm_steps <= 0 or adam_step >= step + 1:
        return 1.0
    return min(1.0, max(1, int(adam_step)) / int(rewarm_steps))


def update_lr(step: int, adam_step: int, total_steps: Optional[int], tcfg: TrainConfig) -> float:
    """The learning rate of the inner update at ``step`` whose AdamW step count becomes ``adam_step``:
    :func:`lr_at` times :func:`rewarm_factor`."""
    return lr_at(step, total_steps, tcfg) * rewarm_factor(step, adam_step, tcfg.rewarm_steps)


def next_adam_step(opt: torch.optim.Optimizer) -> int:
    """AdamW's step count after its next update, as update commitments report it: the largest over
    the parameters, where a parameter with a gradient advances by one and one without keeps its
    count (AdamW skips it). 0 when no parameter has a state or a gradient."""
    out = 0
    for g in opt.param_groups:
        for p in g["params"]:
            st = opt.state.get(p)
            n = int(st["step"]) if st and "step" in st else 0
            out = max(out, n + 1 if p.grad is not None else n)
    return out


def optimizer_kernel(params: list[torch.Tensor]) -> dict:
    """AdamW implementation flags for where ``params`` live: ``fused=True`` (one kernel for all
    parameters) when they are all on a CUDA device, else torch's default (``foreach`` where
    supported)."""
    if params and all(p.is_cuda for p in params) and torch.cuda.is_available():
        return {"fused": True}
    return {}


def make_optimizer(module: torch.nn.Module, tcfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains are not decayed); fused on CUDA."""
    decay, no_decay = [], []
    for _, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), eps=1e-8,
                             **optimizer_kernel(decay + no_decay))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
