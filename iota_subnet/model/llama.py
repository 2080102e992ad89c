"""Llama-3 style decoder blocks: architecture only (no splitting, no training logic).

Shapes use B = micro-batch rows, T = sequence length (tokens), d = model width (``dim``),
H = query heads, K = key/value heads (grouped-query attention), D = head width = d / H,
F = SwiGLU hidden width (``ffn_dim``), V = vocabulary size.

Module and parameter names follow Hugging Face ``LlamaForCausalLM`` (``self_attn.q_proj``,
``mlp.gate_proj``, ``input_layernorm`` ...), so weights map one to one (the parity test relies on it).

Sources: Llama 3 (Grattafiori et al. 2024, arXiv 2407.21783) for RMSNorm, RoPE with the Llama 3.1
frequency scaling, grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245) and SwiGLU
(Shazeer 2020, arXiv 2002.05202).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from iota_subnet.config import ModelConfig


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32. x: [..., d] -> [..., d]."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] of rotary embeddings, with Llama 3.1 scaling when configured.

    Llama 3.1 scaling (``rope_scaling``): wavelengths longer than ``original/low_freq_factor`` are
    divided by ``factor``; shorter than ``original/high_freq_factor`` are kept; in between they are
    interpolated smoothly.
    """
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    sc = cfg.rope_scaling
    if not sc:
        return inv_freq
    factor, low, high = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_ctx = float(sc["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(cfg: ModelConfig, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables, each [T, D] (the D/2 frequencies repeated twice, half-split convention)."""
    inv_freq = rope_inv_freq(cfg).to(device)
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)                       # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)                  # [T, D]
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos, sin: [T, D] -> [B, heads, T, D]."""
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


def _sdpa_supports_gqa() -> bool:
    """Whether this torch's ``F.scaled_dot_product_attention`` takes ``enable_gqa`` (torch >= 2.5)."""
    try:
        z = torch.zeros(1, 2, 1, 2, device="cpu")
        F.scaled_dot_product_attention(z, z[:, :1], z[:, :1], enable_gqa=True)
        return True
    except TypeError:
        return False


#: Read once at import (a constant for torch.compile to trace through).
SDPA_GQA = _sdpa_supports_gqa()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention. q: [B, H, T, D]; k, v: [B, K, T, D] with K dividing H -> [B, H, T, D].

    Grouped-query attention runs inside SDPA (``enable_gqa``: each group of H/K query heads reads
    its key/value head in place, no [B, H, T, D] copies of K and V); torch versions without it fall
    back to ``repeat_interleave``."""
    H, K = q.shape[1], k.shape[1]
    if H == K:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if SDPA_GQA:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    rep = H // K
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1),
                                          is_causal=True)


class Attention(nn.Module):
    """Causal grouped-query self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)     # [B, H, T, D]
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, K, T, D]
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, K, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = causal_attention(q, k, v)                                                   # [B, H, T, D]
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)               # [B, T, d]
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); [B, T, d] -> [B, T, F] -> [B, T, d]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder block: h = x + attn(norm(x)); out = h + mlp(norm(h)). [B, T, d] -> [B, T, d]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


def init_weights(module: nn.Module, cfg: ModelConfig) -> None:
    """Normal(0, init_std) for linear and embedding weights; output projections of each residual
    branch (``o_proj``, ``down_proj``) scaled by 1/sqrt(2 * n_layers) (GPT-2, Radford et al. 2019)."""
    for name, p in module.named_parameters():
        if p.dim() < 2 or "bottleneck" in name:
            continue
        std = cfg.init_std
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            std = std / math.sqrt(2 * cfg.n_layers)
        with torch.no_grad():
            p.normal_(0.0, std)


def block_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward FLOPs per token of one block: 2 x matmul parameters + causal attention scores
    and values (2 * 2 * T * d, halved for causality is *not* applied, as in the PaLM appendix B MFU formula)."""
    d, D = cfg.dim, cfg.head_dim
    attn_params = d * cfg.n_heads * D * 2 + d * cfg.n_kv_heads * D * 2
    mlp_params = 3 * d * cfg.ffn_dim
    return 2 * (attn_params + mlp_params) + 2 * 2 * seq_len * cfg.n_heads * D
