"""The outer optimizer and the merge payload encodings.

Outer step (DiLoCo, arXiv 2311.08105, Algorithm 1; Nesterov SGD as ``torch.optim.SGD``)::

    delta = mean over replicas of (anchor - weights)      # pseudo-gradient, float32 [n]
    m'    = mu * m + delta
    upd   = delta + mu * m'  (nesterov)  |  m'  (plain momentum)
    new   = anchor - lr * upd

Elementwise float32 operations in a fixed order: the same inputs give bit-identical outputs on
every replica, whatever the shard boundaries.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import sparse


def outer_step(anchor: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, *, lr: float, mu: float,
               nesterov: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(new_weights, new_momentum)``, float32 tensors shaped like ``anchor``."""
    if not (anchor.shape == momentum.shape == delta.shape):
        raise ValueError(f"shape mismatch: anchor {tuple(anchor.shape)}, momentum {tuple(momentum.shape)}, "
                         f"delta {tuple(delta.shape)}")
    m = momentum.float().mul(mu).add_(delta.float())
    upd = delta.float().add(m, alpha=mu) if nesterov else m
    new = anchor.float().sub(upd, alpha=lr)
    return new, m


def weighted_mean(items: list[tuple[float, torch.Tensor]]) -> torch.Tensor:
    """``sum(w * x) / sum(w)`` in float32, accumulated in the given order (callers sort by hotkey)."""
    if not items:
        raise ValueError("weighted_mean of nothing")
    acc = torch.zeros_like(items[0][1], dtype=torch.float32)
    total = 0.0
    for w, x in items:
        acc.add_(x.float(), alpha=float(w))
        total += float(w)
    return acc.div_(total)


def quantize(x: torch.Tensor, mode: str, block: int = 256) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Encode a float32 1-D tensor for the wire: ``none`` -> (float32, None); ``bf16`` -> (bfloat16, None);
    ``int8`` -> (int8 [n], float32 scales [ceil(n / block)]) with ``scale = absmax(block) / 127``;
    ``topk-*`` / ``sparse-*`` -> :func:`.sparse.encode` (``block`` unused: the mode names its own)."""
    if sparse.is_sparse(mode):
        return sparse.encode(x, mode)
    x = x.detach().float().reshape(-1)
    if mode == "none":
        return x.contiguous(), None
    if mode == "bf16":
        return x.to(torch.bfloat16), None
    if mode == "int8":
        n = x.numel()
        nb = math.ceil(n / block) if n else 0
        pad = nb * block - n
        xp = torch.nn.functional.pad(x, (0, pad)).view(nb, block) if nb else x.view(0, block)
        scales = xp.abs().amax(dim=1) / 127.0
        q = torch.round(xp / scales.clamp_min(1e-30).unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
        return q.reshape(-1)[:n].contiguous(), scales.float().contiguous()
    raise ValueError(f"unknown quantization {mode!r}; choose none, bf16 or int8")


def rounded(x: torch.Tensor, mode: str, block: int = 256) -> tuple[torch.Tensor, tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """``x`` (float32 [n]) as the wire will carry it: (``dequantize(quantize(x))``, the wire form).
    Deterministic: equal inputs give equal bits on every replica."""
    wire = quantize(x, mode, block)
    return (x if mode == "none" else dequantize(wire[0], wire[1], mode, block)), wire


def rounding_bound(x: torch.Tensor, mode: str, block: int = 256) -> torch.Tensor:
    """Per value, an upper bound on ``|rounded(x) - x|`` (float32 [n]): 0 for ``none``, ``|x| / 256``
    for ``bf16`` (8 significant bits, round to nearest), half the block's scale ``absmax / 127`` for
    ``int8``; for ``sparse-*`` :func:`.sparse.rounding_bound` (groups of at least ``block``)."""
    if sparse.is_sparse(mode):
        return sparse.rounding_bound(x, mode, block)
    x = x.detach().float().reshape(-1)
    if mode == "none":
        return torch.zeros_like(x)
    if mode == "bf16":
        return x.abs() / 256.0
    if mode == "int8":
        n = x.numel()
        nb = math.ceil(n / block) if n else 0
        xp = torch.nn.functional.pad(x.abs(), (0, nb * block - n)).view(nb, block) if nb else x.view(0, block)
        half = (xp.amax(dim=1, keepdim=True) / 254.0).expand(nb, block)
        return half.reshape(-1)[:n].contiguous()
    raise ValueError(f"unknown quantization {mode!r}; choose none, bf16 or int8")


def dequantize(q: torch.Tensor, scales: Optional[torch.Tensor], mode: str, block: int = 256) -> torch.Tensor:
    """Inverse of :func:`quantize` (float32 [n]). Raises ValueError when dtype or scales do not fit ``mode``."""
    if sparse.is_sparse(mode):
        return sparse.decode(q, scales, mode)
    if mode == "none":
        if q.dtype != torch.float32:
            raise ValueError(f"quantization none expects float32, got {q.dtype}")
        return q.float()
    if mode == "bf16":
        if q.dtype != torch.bfloat16:
            raise ValueError(f"quantization bf16 expects bfloat16, got {q.dtype}")
        return q.float()
    if mode == "int8":
        n = q.numel()
        nb = math.ceil(n / block) if n else 0
        if q.dtype != torch.int8 or scales is None or scales.numel() != nb:
            raise ValueError(f"int8 payload needs int8 values and {nb} float32 scales")
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise ValueError("int8 scales must be finite and >= 0")
        pad = nb * block - n
        xp = torch.nn.functional.pad(q.float(), (0, pad)).view(nb, block) * scales.float().unsqueeze(1)
        return xp.reshape(-1)[:n].contiguous()
    raise ValueError(f"unknown quantization {mode!r}; choose none, bf16 or int8")
