"""Causal language-model loss on the last stage's logits, with an optional per-token loss mask.

A packed row of ``T + 1`` tokens gives inputs ``row[:-1]`` and targets ``row[1:]``; a masked dataset
(:class:`iota_subnet.data.hf_datasets.HFTokenDataset`) gives a mask row alongside, whose ``[1:]`` marks
the targets to train on (its target rows, :meth:`~iota_subnet.data.packing.TokenDataset.target_batch`,
carry :data:`~iota_subnet.data.packing.IGNORE_INDEX` on the others). The loss is the mean cross-entropy
over the marked targets, which is what ``transformers``' ``*ForCausalLM(input_ids=row, labels=labels)``
computes with ``labels = row`` and ``-100`` on the unmarked tokens (the model shifts the labels by one
inside).

Sources: ``transformers.loss.loss_utils.ForCausalLMLoss`` / ``fixed_cross_entropy``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from iota_subnet.data.packing import IGNORE_INDEX


def masked_lm_loss(logits: torch.Tensor, targets: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean next-token cross-entropy (nats, float32 scalar) over the marked target positions.

    ``logits``: ``[B, T, V]``, any float dtype (computed in float32); ``targets``: ``[B, T]`` int64, the
    token after each input position (``row[1:]``); ``mask``: ``[B, T]`` bool or integer, nonzero where the
    target is trained (``mask_row[1:]``), or ``None`` to train every target. Targets equal to
    :data:`IGNORE_INDEX` are never trained. Unmarked positions get exactly zero gradient. With no marked
    position the loss is 0 with zero gradient (``transformers`` gives nan there).
    Raises ``ValueError`` on mismatched shapes or a float mask."""
    if logits.ndim != 3 or tuple(targets.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"logits must be [B, T, V] and targets [B, T]; got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    flat = targets.reshape(-1)
    if mask is not None:
        if tuple(mask.shape) != tuple(targets.shape):
            raise ValueError(f"mask must be [B, T] like targets {tuple(targets.shape)}; got {tuple(mask.shape)}")
        if mask.is_floating_point():
            raise ValueError("mask must be bool or integer (nonzero = trained), not a float weight")
        flat = flat.masked_fill(mask.reshape(-1) == 0, IGNORE_INDEX)
    n = (flat != IGNORE_INDEX).sum()
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat, ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return total / n.clamp(min=1)
