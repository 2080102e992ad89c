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
