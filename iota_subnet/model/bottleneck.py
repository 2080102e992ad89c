r"""Residual bottleneck at a pipeline stage boundary, after ResBM (Aboudib et al. 2026,
"ResBM: Residual Bottleneck Models for Low-Bandwidth Pipeline Parallelism", arXiv 2604.11947).

The residual stream ``h`` [B, T, d] leaving the sending stage is compressed to ``z`` [B, T, b]
(b = d / compression_ratio), which is what crosses the wire; the receiving stage rebuilds
``h_hat`` [B, T, d] from it. The gradient that travels back is dL/dz, also [B, T, b].

With identity rank r (0 <= r <= b, default b / 2) and learned matrices
W_e in R^{d x (b-r)} (encoder, sending stage) and W_d in R^{(b-r) x d} (decoder, receiving stage):

    z_id  = h[..., :r]                        # explicit low-rank identity path: r residual
                                              # coordinates cross the boundary unchanged
    z_enc = RMSNorm_e(h) @ W_e                # learned compression of the whole stream
    z     = concat(z_id, z_enc)               # [B, T, b]  <- on the wire

    h_hat = concat(z_id, 0_{d-r}) + z_enc @ W_d     # [B, T, d]

so  d h_hat / d h  restricted to the first r coordinates is the identity, whatever W_e and W_d are:
the identity path carries gradient unchanged to the sending stage, which is what keeps deep
compressed pipelines trainable end to end. W_e and W_d are ordinary parameters of the two stages
and are trained with the rest of the model (no constrained optimisation). ``compression_ratio = 1``
means no bottleneck: ``h`` itself crosses the wire.

Initialisation: W_e ~ N(0, 1/d) (so z_enc has unit RMS), W_d ~ N(0, init_std^2).
"""
from __future__ import annotations


import torch
import torch.nn as nn

from iota_subnet.config import ModelConfig
from iota_subnet.model.llama import RMSNorm


class BottleneckEncoder(nn.Module):
    """Sending side: h [B, T, d] -> z [B, T, b]."""

    def __init__(self, cfg: ModelConfig, b: int, r: int):
        super().__init__()
        self.r, self.b = r, b
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.proj = nn.Linear(cfg.dim, b - r, bias=False) if b > r else None
        if self.proj is not None:
            nn.init.normal_(self.proj.weight, 0.0, cfg.dim ** -0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z_id = h[..., : self.r]                                   # [B, T, r]
        if self.proj is None:
            return z_id.contiguous()
        z_enc = self.proj(self.norm(h))                           # [B, T, b - r]
        return torch.cat((z_id, z_enc), dim=-1)                   # [B, T, b]


class BottleneckDecoder(nn.Module):
    """Receiving side: z [B, T, b] -> h_hat [B, T, d]."""

    def __init__(self, cfg: ModelConfig, b: int, r: int):
        super().__init__()
        self.r, self.b, self.d = r, b, cfg.dim
        self.proj = nn.Linear(b - r, cfg.dim, bias=False) if b > r else None
        if self.proj is not None:
            nn.init.normal_(self.proj.weight, 0.0, cfg.init_std)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z_id = z[..., : self.r]                                                     # [B, T, r]
        h = torch.nn.functional.pad(z_id, (0, self.d - self.r))                     # [B, T, d]
        if self.proj is not None:
            h = h + self.proj(z[..., self.r:])                                      # [B, T, d]
        return h
