"""Round 2 of a hop audit: random projections (Freivalds' check) that let a validator verify a
product with a matrix it never downloads.

Why (Freivalds 1977, "Probabilistic machines can use less running time"): to check ``y = W x`` for
a token without W, the validator picks a random vector ``r`` *after* the miner has committed to its
trace, the miner returns ``w = W^T r`` (one vector per weight matrix, shared by every token), and the
validator checks ``r . y_t == w . x_t`` on sampled tokens and ``w_i == r . W[:, i]`` on sampled
columns i (opened with proofs against the weights root). A wrong row ``y_t`` passes with
probability ~0 (``r`` was unknown when it was committed); a wrong ``w`` that rescues wrong rows must
differ from ``W^T r`` on almost every entry, because the honest token rows span the input space
(``N >= in``), so one sampled column catches it; fake weights ``W'`` used consistently give
``w' - w = (W' - W)^T r``, nonzero on every column where W' differs. The backward uses ``W r``
(rows). Attention products with committed activations work the same way: the scores ``s = q k^T``
with ``kappa = K^T rho`` (opened columns of K), and the sums ``y_t = sum_s P_ts v_s`` with the
committed per-position projection ``c_s = r . v_s`` (spot-checked at random positions: a ``c``
that rescues forged rows must be wrong from the first forged position on, because the system is
triangular).

Random vectors are derived from the validator's 32-byte seed with SHAKE-256 (FIPS 202), so both
sides compute them identically on any platform: :func:`rvec`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from .layout import TraceLayout

DOMAIN = b"iota-audit/1\x00"
#: Weight matrices up to this many values are projected in float64 (a transient copy of one matrix).
F64_MAX_NUMEL = 1 << 27


def rvec(seed: bytes, label: str, n: int) -> torch.Tensor:
    """``n`` float64 values uniform in [-1, 1), a deterministic function of (seed, label)."""
    raw = hashlib.shake_256(DOMAIN + bytes(seed) + b"\x00" + label.encode()).digest(4 * int(n))
    u = np.frombuffer(raw, dtype="<u4").astype(np.float64)
    return torch.from_numpy(u / 2.0 ** 31 - 1.0)


@dataclass(frozen=True)
class Randoms:
    """The random vectors of one audit, by label (see :func:`randoms`)."""

    seed: bytes
    vec: dict[str, torch.Tensor]

    def __getitem__(self, k: str) -> torch.Tensor:
        return self.vec[k]


def randoms(layout: TraceLayout, seed: bytes) -> Randoms:
    """Every random vector an audit of ``layout`` uses (labels are the keys), derived from ``seed``."""
    m = layout.dims
    d, F, HD, KD, T = m.d, m.F, m.HD, m.KD, m.T
    sizes: dict[str, int] = {}
    for j in range(len(m.layers)):
        p = f"L{j}."
        sizes.update({p + "r_q": HD, p + "r_k": KD, p + "r_v": KD, p + "r_o": d, p + "r_g": F, p + "r_u": F,
                      p + "r_d": d, p + "rho": T, p + "r_c": KD})
        if layout.backward:
            sizes.update({p + "r_da": F, p + "r_dn2": d, p + "r_dy": HD, p + "rho2": T, p + "sigma": T,
                          p + "sigma2": T, p + "r_dq": KD, p + "r_dk": KD, p + "r_dv": KD, p + "r_dn1": d})
    if m.dec_proj:
        sizes["dec.r"] = d
        if layout.backward:
            sizes["dec.r_b"] = m.b - m.r
    if m.tail:
        sizes["lm.rho"] = m.V
        sizes["lm.r_b"] = d
    elif m.enc_proj:
        sizes["enc.r"] = m.b - m.r
        if layout.backward:
            sizes["enc.r_b"] = d
    return Randoms(bytes(seed), {k: rvec(seed, k, n) for k, n in sizes.items()})


def _group_dot(x: torch.Tensor, r: torch.Tensor, groups: int, D: int, rep: int = 1) -> torch.Tensor:
    """x [B, T, heads*D] (heads = groups*rep), r [groups*D] -> [B, T, heads]: x_h . r_{h // rep}."""
    B, T, _ = x.shape
    xh = x.view(B, T, groups * rep, D)
    rr = r.view(groups, D).repeat_interleave(rep, dim=0)             # [heads, D]
    return (xh * rr).sum(-1)


def _by_group(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, T, heads] -> [B * groups, heads / groups * T]: row ``b * groups + g`` holds the heads of kv
    group g, head-major (the layout's per-group rows, so an audit opens only the groups it checks)."""
    B, T, heads = x.shape
    return x.permute(0, 2, 1).reshape(B * groups, heads // groups * T)


def projections(layout: TraceLayout, records: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
                rnd: Randoms) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Miner side: the round-2 answer for trace ``records`` and ``weights`` (host tensors), for the
    blocks ``layout`` covers (:meth:`~.layout.TraceLayout.for_blocks`).

    Returns ``(vectors, committed)``: ``vectors`` name -> float32 tensor of the shape in
    ``layout.vectors`` (sent in full); ``committed`` ``p:`` name -> 2-D float32 tensor (committed by
    root, opened by rows in round 3). Computed in float64 on the host, weight projections one matrix
    at a time on the weights' device (no float64 copy of the whole stage: an 8b stage holds 1.4B
    parameters); matrices above :data:`F64_MAX_NUMEL` values (the 8b embedding and LM head) in float32,
    which errs by ~1e-6 relative, two orders below the link tolerance.
    """
    m = layout.dims
    B, T, K, D, H, rep = m.B, m.T, m.K, m.D, m.H, m.rep
    R = {k: v for k, v in rnd.vec.items()}

    class _W:
        """``W.T @ r`` and ``W @ r`` in float32 on the weight's device, results in float64 on the host."""

        def __init__(self, t: torch.Tensor):
            self.t = t.detach()

        @property
        def T(self) -> "_W":
            return _W(self.t.t())

        def __matmul__(self, r: torch.Tensor) -> torch.Tensor:
            dt = torch.float64 if self.t.numel() <= F64_MAX_NUMEL else torch.float32
            t = self.t.to(dt)
            return (t @ r.to(t.device, dt)).to("cpu", torch.float64)

    W = {k: _W(v) for k, v in weights.items()}

    def rec(name: str) -> torch.Tensor:
        return records[name].to(torch.float64)

    def wp(j: int, suffix: str) -> "_W":
        return W[layout.block_param(j, suffix)]

    vec: dict[str, torch.Tensor] = {}
    com: dict[str, torch.Tensor] = {}
    for j in layout.block_ids():
        p = f"L{j}."
        Wq, Wk, Wv = wp(j, "self_attn.q_proj.weight"), wp(j, "self_attn.k_proj.weight"), wp(j, "self_attn.v_proj.weight")
        Wo, Wg, Wu = wp(j, "self_attn.o_proj.weight"), wp(j, "mlp.gate_proj.weight"), wp(j, "mlp.up_proj.weight")
        Wd = wp(j, "mlp.down_proj.weight")
        vec[p + "w_qkv"] = Wq.T @ R[p + "r_q"] + Wk.T @ R[p + "r_k"] + Wv.T @ R[p + "r_v"]
        vec[p + "w_o"] = Wo.T @ R[p + "r_o"]
        vec[p + "w_gu"] = Wg.T @ R[p + "r_g"] + Wu.T @ R[p + "r_u"]
        vec[p + "w_d"] = Wd.T @ R[p + "r_d"]
        k = rec(p + "k").view(B, T, K * D)
        v = rec(p + "v").view(B, T, K * D)
        com["p:" + p + "kappa"] = torch.einsum("btk,t->bk", k, R[p + "rho"])
        com["p:" + p + "c"] = _by_group(_group_dot(v, R[p + "r_c"], K, D), K)
        if layout.backward:
            q = rec(p + "q").view(B, T, H * D)
            dy = rec(p + "dy").view(B, T, H * D)
            vec[p + "o_d"] = Wd @ R[p + "r_da"]
            vec[p + "o_g"] = Wg @ R[p + "r_dn2"]
            vec[p + "o_u"] = Wu @ R[p + "r_dn2"]
            vec[p + "o_o"] = Wo @ R[p + "r_dy"]
            vec[p + "o_q"] = Wq @ R[p + "r_dn1"]
            vec[p + "o_k"] = Wk @ R[p + "r_dn1"]
            vec[p + "o_v"] = Wv @ R[p + "r_dn1"]
            com["p:" + p + "nu"] = torch.einsum("btk,t->bk", v, R[p + "rho2"])
            com["p:" + p + "phi"] = torch.einsum("btk,t->bk", q, R[p + "sigma"])
            com["p:" + p + "psi"] = torch.einsum("btk,t->bk", dy, R[p + "sigma2"])
            com["p:" + p + "ck"] = _by_group(_group_dot(k, R[p + "r_dq"], K, D), K)
            com["p:" + p + "e"] = _by_group(_group_dot(q, R[p + "r_dk"], K, D, rep), K)
            com["p:" + p + "f"] = _by_group(_group_dot(dy, R[p + "r_dv"], K, D, rep), K)
    if m.dec_proj:
        Wdec = W["bottleneck_in.proj.weight"]                   # [d, b - r]
        vec["dec.w"] = Wdec.T @ R["dec.r"]
        if layout.backward:
            vec["dec.o"] = Wdec @ R["dec.r_b"]
    if m.tail:
        Wlm = W["lm_head.weight"]                               # [V, d]
        vec["lm.w"] = Wlm.T @ R["lm.rho"]
        vec["lm.o"] = Wlm @ R["lm.r_b"]
    elif m.enc_proj:
        We = W["bottleneck_out.proj.weight"]                    # [b - r, d]
        vec["enc.w"] = We.T @ R["enc.r"]
        if layout.backward:
            vec["enc.o"] = We @ R["enc.r_b"]
    vec = {k: v.to(torch.float32).reshape(layout.vectors[k]).contiguous() for k, v in vec.items()}
    com = {k: v.to(torch.float32).contiguous() for k, v in com.items()}
    missing = set(layout.vectors) ^ set(vec)
    if missing or set(layout.committed) ^ set(com):
        raise RuntimeError(f"projection set differs from the layout: {sorted(missing)}")
    return vec, com
