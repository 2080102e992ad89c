"""A stage's forward (and backward) recomputed op by op in fp32, every intermediate named.

The miner runs this when a hop is audited, from the inputs it stored (the wire tensor it received,
or the token ids; the gradient it received) and the weights version the hop's receipt names. The
trace is *a recomputation*, not the hop itself: its inputs are the committed wire tensors (bit for
bit), its internal links are checked at fp32 precision whatever precision the run trains in, and
only its outputs are compared with what the hop sent, within the run's tolerance (see
:mod:`.check`).

Ops (Llama 3 block, :mod:`iota_subnet.model.llama`; bottleneck, :mod:`iota_subnet.model.bottleneck`)::

    n1 = rmsnorm(h) * w_in;  q = rope(n1 Wq^T);  k = rope(n1 Wk^T);  v = n1 Wv^T
    s = q k^T / sqrt(D)      (all positions: the causal mask is applied after)
    lse = logsumexp_{s <= t}(s);  P = exp(s - lse) (causal);  y = P v;  h1 = h + y Wo^T
    n2 = rmsnorm(h1) * w_post;  g = n2 Wg^T;  u = n2 Wu^T;  h' = h1 + (silu(g) * u) Wd^T

Backward (the chain rule written out; flash-attention's form of the softmax backward, Dao et al.
2022, arXiv 2205.14135, algorithm 4)::

    da = dh' Wd;  dg = da * u * silu'(g);  du = da * silu(g);  dn2 = dg Wg + du Wu
    dh1 = dh' + rmsnorm_bwd(h1, w_post, dn2);  dy = dh1 Wo
    dp = dy v^T (all positions);  delta = rowsum(dy * y);  ds = P * (dp - delta)
    dq = ds k / sqrt(D);  dk = ds^T q / sqrt(D);  dv = P^T dy    (summed over the heads of a kv group)
    dn1 = rope^-1(dq) Wq + rope^-1(dk) Wk + dv Wv;  dh = dh1 + rmsnorm_bwd(h, w_in, dn1)

Device: compute runs on the weights' device (TF32 off on CUDA, so fp32 is fp32); every recorded
tensor is copied to host memory as a C-contiguous 2-D fp32 tensor in the layout of
:mod:`.layout`. Memory: :meth:`TraceLayout.trace_bytes` (tiny, 4 x 256 tokens: ~0.2 GB for a
backward audit of a 3-block stage; the scores and dP matrices dominate, B*H*T^2 values each per
block).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .layout import TraceLayout


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * x / sqrt(mean(x^2) + eps)`` over the last dim (any float dtype)."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rmsnorm_backward(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, eps: float) -> torch.Tensor:
    """d loss / dx of :func:`rmsnorm` given d loss / dy (the weight's gradient is not needed)."""
    rs = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    xhat = x * rs
    dxhat = dy * w
    return rs * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, D] rotated by position (cos, sin [T, D], as :func:`~iota_subnet.model.llama.apply_rope`)."""
    c, s = cos[:, None, :], sin[:, None, :]
    return x * c + rotate_half(x) * s


def unrope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse (= transpose) of :func:`rope`: x [..., T, heads, D]."""
    c, s = cos[:, None, :], sin[:, None, :]
    return x * c - rotate_half(x) * s


@dataclass
class TraceResult:
    """``records``: name -> 2-D host fp32 tensor (layout names); ``out``: the forward output [B, T, b]
    (non-tail); ``loss``: mean loss (tail); ``grad_in``: d loss / d stage input [B, T, b] (backward,
    non-head)."""

    records: dict[str, torch.Tensor]
    out: Optional[torch.Tensor] = None
    loss: Optional[float] = None
    grad_in: Optional[torch.Tensor] = None


class Tracer:
    """Traced fp32 forward/backward of one stage for one micro-batch.

    ``weights``: the stage's ``state_dict`` (any device, any float dtype), moved to ``device`` (default:
    where the weights are) and cast to fp32 there. :meth:`emit` is called with every committed
    intermediate in its natural shape and returns the tensor the rest of the computation uses (the
    identity here; a subclass may record or alter it). On CUDA the trace turns TF32 off while it runs
    (a process-wide flag: matmuls of other threads meanwhile run in full fp32 too).
    """

    def __init__(self, layout: TraceLayout, weights: dict[str, torch.Tensor], device: Optional[torch.device] = None):
        self.layout = layout
        first = next(iter(weights.values()))
        self.device = torch.device(device) if device is not None else first.device
        self.W = {k: v.detach().to(self.device, torch.float32) for k, v in weights.items()}
        self.records: dict[str, torch.Tensor] = {}

    # ---- hooks -------------------------------------------------------------------------------
    def emit(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return t

    def _rec(self, name: str, t2d: torch.Tensor) -> None:
        e = self.layout.trace[name]
        t2d = t2d.detach().reshape(e.rows, e.width)
        self.records[name] = t2d.to("cpu", torch.float32).contiguous()

    def _w(self, suffix: str, j: Optional[int] = None) -> torch.Tensor:
        name = suffix if j is None else self.layout.block_param(j, suffix)
        return self.W[name]

    # ---- the trace ---------------------------------------------------------------------------
    def run(self, x: torch.Tensor, *, targets: Optional[torch.Tensor] = None,
            grad: Optional[torch.Tensor] = None) -> TraceResult:
        """x: token ids [B, T] (head) or the received activations [B, T, b] (wire dtype; used as
        ``x.float()``, as the stage does); targets [B, T] (tail); grad: the received gradient
        [B, T, b] (backward audits of non-tail stages). Raises ValueError on a shape mismatch."""
        lay, m = self.layout, self.layout.dims
        B, T = m.B, m.T
        want = (B, T) if m.head else (B, T, m.b)
        if tuple(x.shape) != want:
            raise ValueError(f"trace input has shape {tuple(x.shape)}, layout expects {want}")
        if m.tail and (targets is None or tuple(targets.shape) != (B, T)):
            raise ValueError(f"the tail's trace needs targets [{B}, {T}]")
        if lay.backward and not m.tail and (grad is None or tuple(grad.shape) != (B, T, m.b)):
            raise ValueError(f"a backward trace needs the received gradient [{B}, {T}, {m.b}]")
        ctx = contextlib.nullcontext()
        if self.device.type == "cuda":
            ctx = _no_tf32()
        with torch.no_grad(), ctx:
            return self._run(x.to(self.device), targets, grad)

    def _run(self, x, targets, grad) -> TraceResult:
        lay, m = self.layout, self.layout.dims
        B, T, N, d, H, K, D = m.B, m.T, m.N, m.d, m.H, m.K, m.D
        eps, rep = m.eps, m.rep
        res = TraceResult(self.records)
        # ---- stage input
        if m.head:
            h = self._w("embed_tokens.weight")[x.reshape(-1).long()]
        else:
            z = x.reshape(N, m.b).float()
            if m.compressed:
                h = F.pad(z[:, :m.r], (0, d - m.r))
                if m.dec_proj:
                    h = h + z[:, m.r:] @ self._w("bottleneck_in.proj.weight").T
            else:
                h = z
        h = self.emit("h.0", h)
        self._rec("h.0", h)
        cos, sin = lay.rope_tables(self.device)
        mask = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
        saved = []
        for j in range(len(m.layers)):
            p = f"L{j}."
            hin = h
            n1 = rmsnorm(h, self._w("input_layernorm.weight", j), eps)
            q = rope((n1 @ self._w("self_attn.q_proj.weight", j).T).view(B, T, H, D), cos, sin)
            k = rope((n1 @ self._w("self_attn.k_proj.weight", j).T).view(B, T, K, D), cos, sin)
            v = (n1 @ self._w("self_attn.v_proj.weight", j).T).view(B, T, K, D)
            q, k, v = self.emit(p + "q", q), self.emit(p + "k", k), self.emit(p + "v", v)
            self._rec(p + "q", q)
            self._rec(p + "k", k)
            self._rec(p + "v", v)
            self._rec(p + "k^T", k.reshape(B, T, K * D).transpose(1, 2))
            qh = q.permute(0, 2, 1, 3)                                      # [B, H, T, D]
            kh = k.permute(0, 2, 1, 3).repeat_interleave(rep, dim=1)       # [B, H, T, D]
            vh = v.permute(0, 2, 1, 3).repeat_interleave(rep, dim=1)
            s = self.emit(p + "s", qh @ kh.transpose(-1, -2) / math.sqrt(D))    # [B, H, T, T] unmasked
            self._rec(p + "s", s.permute(0, 2, 1, 3))
            sm = s.masked_fill(~mask, float("-inf"))
            lse = self.emit(p + "lse", torch.logsumexp(sm, dim=-1))         # [B, H, T]
            self._rec(p + "lse", lse.permute(0, 2, 1))
            P = torch.exp(sm - lse[..., None])                              # [B, H, T, T], 0 above diag
            y = self.emit(p + "y", (P @ vh).permute(0, 2, 1, 3).reshape(N, H * D))
            self._rec(p + "y", y)
            h1 = self.emit(p + "h1", h + y @ self._w("self_attn.o_proj.weight", j).T)
            self._rec(p + "h1", h1)
            n2 = rmsnorm(h1, self._w("post_attention_layernorm.weight", j), eps)
            g = self.emit(p + "g", n2 @ self._w("mlp.gate_proj.weight", j).T)
            u = self.emit(p + "u", n2 @ self._w("mlp.up_proj.weight", j).T)
            self._rec(p + "g", g)
            self._rec(p + "u", u)
            h = self.emit(f"h.{j + 1}", h1 + (F.silu(g) * u) @ self._w("mlp.down_proj.weight", j).T)
            self._rec(f"h.{j + 1}", h)
            saved.append((hin, q, k, v, qh, kh, vh, s, lse, P, y, h1, g, u))
        # ---- stage output
        hL = h
        if m.tail:
            nf = rmsnorm(hL, self._w("norm.weight"), eps)
            logits = self.emit("lm.logits", nf @ self._w("lm_head.weight").T)       # [N, V]
            self._rec("lm.logits", logits)
            tg = targets.reshape(-1).long().to(self.device)
            lse_v = torch.logsumexp(logits, dim=-1)
            loss_tok = self.emit("lm.loss", (lse_v - logits.gather(1, tg[:, None])[:, 0]).view(B, T))
            self._rec("lm.loss", loss_tok)
            res.loss = float(loss_tok.double().mean())
        else:
            if m.compressed:
                zid = hL[:, :m.r]
                if m.enc_proj:
                    ne = rmsnorm(hL, self._w("bottleneck_out.norm.weight"), eps)
                    zout = torch.cat((zid, ne @ self._w("bottleneck_out.proj.weight").T), dim=-1)
                    zout = self.emit("out.z", zout)
                    self._rec("out.z", zout)
                else:
                    zout = zid
            else:
                zout = hL
            res.out = zout.view(B, T, m.b).to("cpu", torch.float32)
        if not lay.backward:
            return res
        # ---- backward: gradient at the stage output
        if m.tail:
            scale = 1.0 / (N * lay.micro_per_step)
            # softmax - onehot in float64: at a confident token (p ~ 1) float32 leaves 1 - p to rounding,
            # and the validator's single-row softmax rounds differently (see check.token_backward)
            dlog = torch.softmax(logits.double(), dim=-1)
            dlog[torch.arange(N, device=self.device), tg] -= 1.0
            dlog = (dlog * scale).float()
            dn = self.emit("lm.dn", dlog @ self._w("lm_head.weight"))
            self._rec("lm.dn", dn)
            gr = rmsnorm_backward(hL, self._w("norm.weight"), dn, eps)
        else:
            dz = grad.to(self.device).reshape(N, m.b).float()
            if m.compressed:
                gr = F.pad(dz[:, :m.r], (0, d - m.r))
                if m.enc_proj:
                    dne = self.emit("out.dne", dz[:, m.r:] @ self._w("bottleneck_out.proj.weight"))
                    self._rec("out.dne", dne)
                    gr = gr + rmsnorm_backward(hL, self._w("bottleneck_out.norm.weight"), dne, eps)
            else:
                gr = dz
        L = len(m.layers)
        gr = self.emit(f"g.{L}", gr)
        self._rec(f"g.{L}", gr)
        inv = 1.0 / math.sqrt(D)
        for j in reversed(range(L)):
            p = f"L{j}."
            hin, q, k, v, qh, kh, vh, s, lse, P, y, h1, g, u = saved[j]
            da = self.emit(p + "da", gr @ self._w("mlp.down_proj.weight", j))
            self._rec(p + "da", da)
            sg = torch.sigmoid(g)
            dg = da * u * (sg * (1 + g * (1 - sg)))
            du = da * (g * sg)
            dn2 = self.emit(p + "dn2", dg @ self._w("mlp.gate_proj.weight", j) + du @ self._w("mlp.up_proj.weight", j))
            self._rec(p + "dn2", dn2)
            dh1 = gr + rmsnorm_backward(h1, self._w("post_attention_layernorm.weight", j), dn2, eps)
            dy = self.emit(p + "dy", dh1 @ self._w("self_attn.o_proj.weight", j))      # [N, H*D]
            self._rec(p + "dy", dy)
            dyh = dy.view(B, T, H, D).permute(0, 2, 1, 3)                               # [B, H, T, D]
            self._rec(p + "dy^T", dy.view(B, T, H * D).transpose(1, 2))
            self._rec(p + "q^T", q.reshape(B, T, H * D).transpose(1, 2))
            self._rec(p + "v^T", v.reshape(B, T, K * D).transpose(1, 2))
            dp = self.emit(p + "dp", dyh @ vh.transpose(-1, -2))                      # [B, H, T, T] unmasked
            self._rec(p + "dp", dp.permute(0, 2, 1, 3))
            self._rec(p + "dp^T", dp.permute(0, 3, 1, 2))
            self._rec(p + "s^T", s.permute(0, 3, 1, 2))
            yh = y.view(B, T, H, D).permute(0, 2, 1, 3)
            delta = self.emit(p + "delta", (dyh * yh).sum(-1))                          # [B, H, T]
            self._rec(p + "delta", delta)                   # [B, H, T] -> rows b*K + g (head-major)
            self._rec(p + "lse_b", lse)
            ds = P * (dp - delta[..., None])
            dq = self.emit(p + "dq", (ds @ kh * inv).permute(0, 2, 1, 3))             # [B, T, H, D]
            dk = self.emit(p + "dk", (ds.transpose(-1, -2) @ qh * inv).view(B, K, rep, T, D).sum(2)
                           .permute(0, 2, 1, 3))                                         # [B, T, K, D]
            dv = self.emit(p + "dv", (P.transpose(-1, -2) @ dyh).view(B, K, rep, T, D).sum(2).permute(0, 2, 1, 3))
            self._rec(p + "dq", dq)
            self._rec(p + "dk", dk)
            self._rec(p + "dv", dv)
            dn1 = (unrope(dq, cos, sin).reshape(N, H * D) @ self._w("self_attn.q_proj.weight", j)
                   + unrope(dk, cos, sin).reshape(N, K * D) @ self._w("self_attn.k_proj.weight", j)
                   + dv.reshape(N, K * D) @ self._w("self_attn.v_proj.weight", j))
            dn1 = self.emit(p + "dn1", dn1)
            self._rec(p + "dn1", dn1)
            gr = self.emit(f"g.{j}", dh1 + rmsnorm_backward(hin, self._w("input_layernorm.weight", j), dn1, eps))
            self._rec(f"g.{j}", gr)
        if not m.head:
            if m.compressed:
                dzin = gr[:, :m.r]
                if m.dec_proj:
                    dzin = torch.cat((dzin, gr @ self._w("bottleneck_in.proj.weight")), dim=-1)
                    dzin = self.emit("in.dz", dzin)
                    self._rec("in.dz", dzin)
            else:
                dzin = gr
            res.grad_in = dzin.view(B, T, m.b).to("cpu", torch.float32)
        return res


@contextlib.contextmanager
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
