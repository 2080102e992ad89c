"""Continued pretraining of a ``transformers`` checkpoint as a co-located pipeline of stages.

One process holds every stage (:class:`~iota_subnet.model.hf_family.HFStage`, e.g. from
:func:`~iota_subnet.model.hf_folder.load_stages_from_folder`) and trains them as the network's miners
would: token ids ``[B, T]`` run through the stages in order; each stage boundary passes the hidden state
``[B, T, d]`` through the wire format (``fp32``, ``bf16``, ``int8`` or ``fp8`` with one float32 scale per token,
:mod:`iota_subnet.protocol.wire`), quantised and dequantised in the forward pass, and the activation
gradient ``[B, T, d]`` the same way in the backward pass; the last stage's logits give
:func:`~iota_subnet.model.lm_loss.masked_lm_loss`. After the backward pass :func:`sum_tied_grads`
gives both copies of a tied embedding the gradient of the shared tensor, the global gradient norm is
clipped (a tied tensor counted once) and each stage's own AdamW (weight decay on matrices only) steps.

Rows: a packed row ``[B, T + 1]`` (int64) gives inputs ``row[:, :-1]`` and targets ``row[:, 1:]``; a
mask row of the same shape (bool) marks trained targets with ``mask[:, 1:]``
(:class:`~iota_subnet.data.hf_datasets.HFTokenDataset` ``batch`` / ``mask_batch``).

``precision``: ``fp32`` (float32 compute) or ``bf16`` (autocast to bfloat16 on the stages' device,
float32 master weights and optimizer state). Loss values are nats per trained target.

:func:`continue_pretraining` is the whole run in one call: checkpoint folder in, trained folder out.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from iota_subnet.model.hf_family import HFStage, sum_tied_grads
from iota_subnet.model.hf_folder import export_stages, load_stages_from_folder
from iota_subnet.model.lm_loss import masked_lm_loss
from iota_subnet.protocol.wire import WIRE_TORCH_DTYPES
from iota_subnet.train.wire_boundary import through_wire

PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class HFTrainOptions:
    """Inner-optimizer and pipeline settings: AdamW ``lr``, ``betas``, ``weight_decay`` (matrices only),
    ``eps``; ``grad_clip`` the global gradient-norm bound (``None``/0: no clipping); ``wire_dtype``
    between stages (``fp32``, ``bf16``, ``int8``, ``fp8``); ``precision`` (``fp32``, ``bf16`` autocast)."""
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    eps: float = 1e-8
    grad_clip: Optional[float] = 1.0
    wire_dtype: str = "fp32"
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.wire_dtype not in WIRE_TORCH_DTYPES:
            raise ValueError(f"wire_dtype={self.wire_dtype!r} must be one of {sorted(WIRE_TORCH_DTYPES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} must be one of {PRECISIONS}")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")


def _adamw(stage: HFStage, opts: HFTrainOptions) -> torch.optim.AdamW:
    decay = [p for p in stage.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in stage.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": opts.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opts.lr, betas=opts.betas, eps=opts.eps)


class HFPipelineTrainer:
    """Trains ``stages`` (every stage of one pipeline, in order, on one device each) in process.

    :meth:`train_step` runs one optimizer step on a batch of packed rows and returns its loss;
    :meth:`loss` evaluates without updating; :meth:`logits` runs ids through the stages (eval mode, no
    wire rounding unless asked). Raises ValueError for stages out of order or a bad row shape."""

    def __init__(self, stages: Sequence[HFStage], options: HFTrainOptions = HFTrainOptions()) -> None:
        self.stages = list(stages)
        if [s.index for s in self.stages] != list(range(len(self.stages))) or \
                any(s.n_stages != len(self.stages) for s in self.stages):
            raise ValueError(f"give every stage 0..{len(self.stages) - 1} of one pipeline in order; "
                             f"got indices {[s.index for s in self.stages]}")
        self.options = options
        self.optimizers = [_adamw(s, options) for s in self.stages]
        self.step = 0

    def set_lr(self, lr: float) -> None:
        """Set every stage's AdamW learning rate (a schedule calls this before :meth:`train_step`)."""
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["lr"] = lr

    def _autocast(self, device: torch.device):
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.options.precision == "bf16")

    def forward(self, ids: torch.Tensor, wire_dtype: Optional[str] = None) -> torch.Tensor:
        """Ids ``[B, T]`` -> logits ``[B, T, V]`` through every stage, each boundary in ``wire_dtype``
        (default: the options'), moving the hidden state to each stage's device."""
        wire = self.options.wire_dtype if wire_dtype is None else wire_dtype
        h = ids
        for i, s in enumerate(self.stages):
            dev = next(s.parameters()).device
            if i:
                h = through_wire(h, wire)
            h = h.to(dev)
            with self._autocast(dev):
                h = s(h)
        return h

    @staticmethod
    def _split(rows: torch.Tensor, mask: Optional[torch.Tensor]):
        if rows.ndim != 2 or rows.shape[1] < 2:
            raise ValueError(f"rows must be [B, T + 1] token ids with T >= 1; got {tuple(rows.shape)}")
        if mask is not None and tuple(mask.shape) != tuple(rows.shape):
            raise ValueError(f"mask must have the rows' shape {tuple(rows.shape)}; got {tuple(mask.shape)}")
        return rows[:, :-1], rows[:, 1:], (mask[:, 1:] if mask is not None else None)

    def _loss(self, rows: torch.Tensor, mask: Optional[torch.Tensor], wire_dtype: Optional[str]) -> torch.Tensor:
        ids, targets, m = self._split(rows, mask)
        logits = self.forward(ids, wire_dtype)
        return masked_lm_loss(logits, targets.to(logits.device), m.to(logits.device) if m is not None else None)

    @torch.no_grad()
    def loss(self, rows: torch.Tensor, mask: Optional[torch.Tensor] = None, wire_dtype: Optional[str] = None) -> float:
        """Mean loss (nats) of packed rows ``[B, T + 1]`` without updating (stages in eval mode for the call)."""
        modes = [s.training for s in self.stages]
        for s in self.stages:
            s.eval()
        try:
            return float(self._loss(rows, mask, wire_dtype))
        finally:
            for s, m in zip(self.stages, modes):
                s.train(m)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, wire_dtype: str = "fp32") -> torch.Tensor:
        """Logits ``[B, T, V]`` (float) of ids ``[B, T]``, eval mode, ``fp32`` wire by default."""
        modes = [s.training for s in self.stages]
        for s in self.stages:
            s.eval()
        try:
            return self.forward(ids, wire_dtype)
        finally:
            for s, m in zip(self.stages, modes):
                s.train(m)

    def _clip(self) -> float:
        """Global gradient norm (a tied tensor's two copies counted once); scales gradients to ``grad_clip``."""
        skip = self.stages[-1].lm_head.weight.grad if self.stages[0].tied and len(self.stages) > 1 else None
        grads, sq = [], 0.0
        for s in self.stages:                                  # one host sync per stage
            own = [p.grad for p in s.parameters() if p.grad is not None]
            grads += own
            counted = [g.detach().float() for g in own if g is not skip]
            if counted:
                sq += float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in counted])) ** 2)
        norm = math.sqrt(sq)
        clip = self.options.grad_clip
        if clip and norm > clip:
            for g in grads:
                g.mul_(clip / (norm + 1e-6))
        return norm

    def train_step(self, rows: torch.Tensor, mask: Optional[torch.Tensor] = None) -> float:
        """One optimizer step on packed rows ``[B, T + 1]`` (and mask rows); returns the step's loss (nats)."""
        for s, opt in zip(self.stages, self.optimizers):
            s.train()
            opt.zero_grad(set_to_none=True)
        loss = self._loss(rows, mask, None)
        loss.backward()
        sum_tied_grads(self.stages[0], self.stages[-1])
        self._clip()
        for opt in self.optimizers:
            opt.step()
        self.step += 1
        return float(loss.detach())

    def train(self, batches: Iterable[tuple[torch.Tensor, Optional[torch.Tensor]]], steps: int) -> list[float]:
        """:meth:`train_step` over the first ``steps`` ``(rows, mask)`` pairs of ``batches``; the losses."""
        losses = []
        for _, (rows, mask) in zip(range(steps), batches):
            losses.append(self.train_step(rows, mask))
        return losses


def dataset_batches(dataset, batch_size: int, seed: int = 0):
    """Endless ``(rows [B, T + 1], mask [B, T + 1] or None)`` from a packed dataset's ``batch``
    (and ``mask_batch`` when the dataset carries a loss mask), in its ``(seed, index)`` order."""
    index = 0
    while True:
        rows = dataset.batch(seed, index, batch_size)
        mask = dataset.mask_batch(seed, index, batch_size) if dataset.has_loss_mask else None
        yield rows, mask
        index += batch_size


def continue_pretraining(source, out, batches: Iterable[tuple[torch.Tensor, Optional[torch.Tensor]]], steps: int,
                         n_stages: int, options: HFTrainOptions = HFTrainOptions(), *,
                         layer_ranges: Optional[Sequence] = None, force: bool = False) -> list[float]:
    """Load the ``transformers`` checkpoint folder ``source`` as ``n_stages`` stages
    (:func:`~iota_subnet.model.hf_folder.load_stages_from_folder`, CPU), train ``steps`` steps on
    ``batches`` (e.g. :func:`dataset_batches`) and export the result to ``out``
    (:func:`~iota_subnet.model.hf_folder.export_stages`). Returns the per-step losses (nats).
    Raises the errors of those functions."""
    stages = load_stages_from_folder(source, n_stages, layer_ranges=layer_ranges)
    trainer = HFPipelineTrainer(stages, options)
    losses = trainer.train(batches, steps)
    export_stages(stages, source, out, force=force)
    return losses
