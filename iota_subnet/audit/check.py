"""Validator side of a hop audit: every link of the stage, checked on the sampled token rows.

Input: the rows the miner opened (already verified against their Merkle roots by
:class:`~.auditor.HopAuditor`), the projection vectors it sent, the random vectors
(:func:`.project.randoms`) and the sample (:mod:`.challenge`). All arithmetic is float64 on the host.

Links checked for each sampled token n = (b, t): the stage's boundary links (input, output; backward:
the gradient received and the one sent) always, and those of the sampled blocks (``Sample.blocks``,
see :mod:`.challenge`) block by block (names as in :mod:`.layout`); the per-head attention links
(lse, scores, values; dP rows, delta, dq, columns, dk, dv) on the heads of the sampled kv-head
groups (``Sample.groups``):

forward
    input       head: ``h.0[n] == E[token]`` (embedding row); else ``h.0[n] == pad(z_id) + W_dec z_enc``
                (z = the opened row of the received wire tensor; ``dec.w`` Freivalds)
    qkv         ``r_q.rope^-1(q) + r_k.rope^-1(k) + r_v.v == w_qkv . rmsnorm(h)``
    lse         ``lse[n] == logsumexp_{s <= t} s[n]`` (exact, per head)
    scores      ``rho . s[n] == q[n] . kappa_b / sqrt(D)`` per head (kappa = K_b^T rho)
    values      ``r_c . y[n] == sum_{s <= t} exp(s[n]_s - lse) c_b[s]`` per head (c = V_b r_c)
    o, gu, down ``r_o.(h1 - h) == w_o.y``; ``r_g.g + r_u.u == w_gu.rmsnorm(h1)``;
                ``r_d.(h' - h1) == w_d.(silu(g) u)``
    output      encoder: ``z[:r] == h_L[:r]``, ``r.z[r:] == w_enc.rmsnorm(h_L)``; the wire row the hop
                sent equals the trace output within the run's tolerance plus the wire rounding;
                tail: ``rho_lm . logits == w_lm . rmsnorm(h_L)``, the token's loss from its logits row
                and the mean of all per-token losses equal to the loss the hop reported
backward (the forward links above are checked too)
    output grad tail: ``r.dn == (W_lm r) . (softmax(logits) - onehot) / (N mps)`` (``lm.o`` sent in full,
                its entries checked on LM-head rows); encoder backward; ``g.L`` from them
    da, dn2, dy ``r.da == o_d . g'``, ``r.dn2 == o_g.dg + o_u.du``, ``r.dy == o_o . dh1`` (``dh1`` =
                ``g' + rmsnorm_bwd(h1, dn2)``)
    dP rows     ``rho2 . dp[n] == dy[n] . nu_b`` (nu = V_b^T rho2); ``delta == dy . y``; lse_b == lse
    dq          ``r.dq == sum_s P (dp - delta) ck_b[s] / sqrt(D)``
    columns     ``sigma . s^T[n] == phi_b . k[n] / sqrt(D)``, ``sigma2 . dp^T[n] == psi_b . v[n]``
    dk, dv      ``r.dk == sum_{h in group} sum_{t' >= t} P (dp - delta) e_b[t'] / sqrt(D)``,
                ``r.dv == sum_h sum_{t'} P f_b[t']`` (P from the score column and ``lse_b``)
    dn1, g      ``r.dn1 == o_q.rope^-1(dq) + o_k.rope^-1(dk) + o_v.dv``; ``g.j == dh1 + rmsnorm_bwd(h, dn1)``
    input grad  decoder backward and the wire row sent
shared vectors, per sampled batch row: ``kappa``, ``nu``, ``phi``, ``psi`` on opened activation
    columns; ``c``, ``ck``, ``e``, ``f`` at the spot positions; every weight projection vector
    on opened weight columns (``w_*``) or rows (``o_*``).

Error measure: a scalar identity ``sum(a_i) == sum(b_i)`` fails when
``|sum a - sum b| > tol * (||a||_2 + ||b||_2)`` (the norm of its terms: the size fp32 rounding
scales with); a vector identity when ``||x - y|| > tol * (||y|| + eps)``, with ``tol`` =
:attr:`Tolerances.link` (the trace is an fp32 recomputation: honest error ~5e-7, measured by
``tests/test_audit.py`` and ``scripts/bench_audit.py``). The rows the hop sent are compared value by
value with the trace's (:meth:`LinkChecker.wire_close`): each may differ by half an ulp of the wire
dtype (the rounding); what exceeds it, in L2 norm relative to the row's, must stay within
:attr:`Tolerances.output` (the run's precision: an fp32 hop's rows are exactly the rounded trace's,
a bf16-autocast hop's exceed by ~1e-3 on ``tiny``). The sent input gradient's rows are measured
against the larger of their own norm and the median norm of ``Sample.scale_rows`` rows of the same
tensor (:meth:`LinkChecker.grad_scale`: near-zero rows carry an absolute, not relative, fp32 error).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch

from iota_subnet.protocol.wire import SCALE_MAX, needs_scales, rounding_bound

from .challenge import ACT_PROJ, Sample, weight_vectors
from .commit import split_wire_rows
from .layout import TraceLayout
from .project import Randoms

TINY = 1e-30

#: Explicit mantissa bits of each float wire dtype: half an ulp of x = m 2^E (m in [0.5, 1)) is 2^(E - bits - 2).
MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def half_ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of ``dtype`` at each value of ``x`` (float64): the largest error of rounding
    to nearest (normal numbers)."""
    _, e = torch.frexp(x.abs().to(torch.float64))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), (e - MANTISSA_BITS.get(dtype, 7) - 2))


@dataclass(frozen=True)
class Tolerances:
    """``link``: links inside the fp32 trace; ``output``: the rows the hop sent against the trace's
    (what exceeds the wire rounding, L2 relative to the row; see :meth:`LinkChecker.wire_close`) and
    the reported loss (relative). The run config decides the precision (:meth:`for_precision`);
    another policy may set its own figures."""

    link: float = 1e-4
    output: float = 1e-4

    @classmethod
    def for_precision(cls, precision: str) -> "Tolerances":
        """``fp32`` (CPU, or GPU with TF32 off): output 1e-4 (honest: ~1e-6); ``bf16`` (autocast):
        output 2e-2 (honest on ``tiny``: see ``scripts/bench_audit.py``)."""
        if precision == "fp32":
            return cls(1e-4, 1e-4)
        if precision == "bf16":
            return cls(1e-4, 2e-2)
        raise ValueError(f"unknown precision {precision!r}; one of fp32, bf16")


@dataclass
class Verdict:
    """Outcome of one audit. ``errors``: the largest error seen per link (for measuring honest error);
    ``failures``: one line per failed check (the first 64), e.g.
    ``"L1.values (token 517, head 3): err 4.1e-01 > 1e-04"``; ``failed_links``: link -> failed checks
    (complete; links named without their block, e.g. ``values``)."""

    ok: bool = True
    failures: list[str] = field(default_factory=list)
    errors: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    checks: int = 0
    failed_links: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def fail(self, line: str, link: str = "audit") -> None:
        self.ok = False
        self.failed_links[link] += 1
        if len(self.failures) < 64:
            self.failures.append(line)

    @property
    def reason(self) -> str:
        return self.failures[0] if self.failures else ""


class LinkChecker:
    """Checks every link of ``layout`` on the opened rows; see the module docstring.

    ``opened``: layout name -> {row index: 1-D tensor} (proofs already verified); ``vectors``: the
    round-2 vectors (name -> tensor); ``tokens``/``targets``: [B, T] int64 (head / tail);
    ``loss``: the loss the tail's hop reported;
    ``output_links``: the wire tensors whose trace counterpart is compared (names ``wire.*``).
    """

    def __init__(self, layout: TraceLayout, *, rnd: Randoms, sample: Sample, vectors: dict[str, torch.Tensor],
                 opened: dict[str, dict[int, torch.Tensor]], tol: Tolerances,
                 tokens: Optional[torch.Tensor] = None, targets: Optional[torch.Tensor] = None,
                 loss: Optional[float] = None, output_links: tuple[str, ...] = ()):
        self.lay, self.m = layout, layout.dims
        self.R, self.S = rnd, sample
        self.vec = {k: v.detach().to(torch.float64).reshape(-1) if v.dim() == 1 else v.detach().to(torch.float64)
                    for k, v in vectors.items()}
        self.O = opened
        self.tol = tol
        self.wire_dtype = layout.wire_torch_dtype
        self.tokens, self.targets, self.loss = tokens, targets, loss
        self.output_links = set(output_links)
        self.v = Verdict()
        cos, sin = layout.rope_tables()
        self.cos, self.sin = cos.double(), sin.double()
        self.grad_floor = self.grad_scale()
        self.blocks = list(sample.blocks)
        self.groups = list(sample.groups)
        if not self.groups or not all(0 <= g < self.m.K for g in self.groups):
            raise ValueError(f"sample.groups must name kv-head groups in 0..{self.m.K - 1}, got {self.groups} "
                             "(draw_sample draws them)")

    # ---- primitives ----------------------------------------------------------------------------
    def row(self, name: str, i: int) -> torch.Tensor:
        return self.O[name][int(i)].to(torch.float64)

    def _record(self, link: str, err: float, tol: float, where: str) -> None:
        self.v.checks += 1
        key = link.split(".", 1)[1] if link.startswith("L") and "." in link else link
        if not math.isfinite(err):
            err = math.inf
        if err > self.v.errors[key]:
            self.v.errors[key] = err
        if not err <= tol:
            self.v.fail(f"{link} ({where}): err {err:.2e} > {tol:.0e}", key)

    def dot(self, link: str, a: torch.Tensor, b: torch.Tensor, where: str, *, b_mag: Optional[torch.Tensor] = None,
            tol: Optional[float] = None) -> None:
        """``sum(a) == sum(b)`` relative to the terms' norms."""
        mag = float(a.norm()) + float((b if b_mag is None else b_mag).norm()) + TINY
        self._record(link, abs(float(a.sum()) - float(b.sum())) / mag, self.tol.link if tol is None else tol, where)

    def vec_close(self, link: str, got: torch.Tensor, ref: torch.Tensor, where: str, tol: Optional[float] = None,
                  scale: Optional[float] = None) -> None:
        s = float(ref.norm()) if scale is None else scale
        self._record(link, float((got - ref).norm()) / (s + 1e-12), self.tol.link if tol is None else tol, where)

    def absdiff(self, link: str, got: torch.Tensor, ref: torch.Tensor, where: str, tol: Optional[float] = None) -> None:
        self._record(link, float((got - ref).abs().max()), self.tol.link if tol is None else tol, where)

    def wire_row(self, name: str, i: int) -> torch.Tensor:
        """An opened wire row as float64 values (int8 / fp8: ``data * scale``)."""
        return self.wire_scaled_row(name, i)[0]

    def wire_scaled_row(self, name: str, i: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """An opened wire row as float64 values ``[b]`` and, for int8 / fp8, its scale (float64 ``[]``)."""
        vals, scales = split_wire_rows(self.O[name][int(i)].reshape(1, -1), self.lay.wire_format)
        return vals[0], (None if scales is None else scales[0])

    def wire_close(self, link: str, name: str, n: int, trace: torch.Tensor, where: str, floor: float = 0.0) -> None:
        """The row the hop sent is the wire rounding of the trace's row: what exceeds the rounding
        (half a wire ulp per value; int8: half a step, the step being max|x| / 127 of the trace's row;
        fp8: the scale ``max|x| / 448`` times half an e4m3 ulp,
        :func:`~iota_subnet.protocol.wire.rounding_bound`), in L2 norm relative to the larger of the
        row's norm and ``floor``, within ``tol.output`` (the run's precision)."""
        sent, step = self.wire_scaled_row(name, n)
        fmt = self.lay.wire_format
        if needs_scales(fmt):
            ref = float(trace.abs().max()) / SCALE_MAX[fmt]
            self._record(link, abs(float(step) - ref) / (ref + 1e-30), self.tol.output, where + ", scale")
            slack = rounding_bound(torch.maximum(sent.abs(), trace.abs()), step.abs(), fmt)
        else:
            slack = half_ulp(torch.maximum(sent.abs(), trace.abs()), self.wire_dtype)
        excess = ((sent - trace).abs() - slack).clamp_min(0.0)
        self._record(link, float(excess.norm()) / (max(float(trace.norm()), floor) + 1e-30), self.tol.output, where)

    def grad_scale(self) -> float:
        """Median L2 norm of the sent gradient's rows opened for scale (``Sample.scale_rows``; 0 when
        none): the ``grad_in`` comparison's floor. Why: a token whose own loss gradient is nearly
        zero (target probability ~1; fp32 computes ``p - 1`` to an absolute, not relative, error)
        has an input-gradient row 100-1000x smaller than the micro-batch's typical row, and an
        honest fp32 hop's rounding relative to that row alone reached 2.6e-3 (1 row in 1,000 above
        2.4e-4), against at most 6.9e-6 relative to the micro-batch's median row (tiny, trained
        weights, 12,288 rows: ``docs/BENCHMARKS.md``, "Honest grad_in error")."""
        rows = self.S.scale_rows
        if not rows or "wire.dx" not in self.O:
            return 0.0
        return float(torch.tensor([float(self.wire_row("wire.dx", n).norm()) for n in rows]).median())

    # ---- model pieces --------------------------------------------------------------------------
    def rmsnorm(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean() + self.m.eps))

    def rmsnorm_bwd(self, x, w, dy):
        rs = torch.rsqrt(x.pow(2).mean() + self.m.eps)
        xhat, dxhat = x * rs, dy * w
        return rs * (dxhat - xhat * (dxhat * xhat).mean())

    def unrope(self, x: torch.Tensor, t: int, heads: int) -> torch.Tensor:
        xh = x.view(heads, self.m.D)
        half = self.m.D // 2
        rot = torch.cat((-xh[:, half:], xh[:, :half]), dim=-1)
        return (xh * self.cos[t] - rot * self.sin[t]).reshape(-1)

    def weight(self, name: str) -> torch.Tensor:
        return self.row("w:" + name, 0)

    def bp(self, j: int, suffix: str) -> str:
        return self.lay.block_param(j, suffix)

    # ---- run -----------------------------------------------------------------------------------
    def run(self) -> Verdict:
        m = self.m
        toks = self.S.token_rows(m.T)
        for n in toks:
            self.token_forward(n)
            if self.lay.backward:
                self.token_backward(n)
        for b in sorted(self.S.tokens):
            self.batch_row(b)
        self.weight_vectors()
        if m.tail:
            self.tail_loss()
        return self.v

    # ---- forward -------------------------------------------------------------------------------
    def token_forward(self, n: int) -> None:
        m, R, T = self.m, self.R, self.m.T
        b, t = divmod(n, T)
        where = f"token {n}"
        H, K, D, rep = m.H, m.K, m.D, m.rep
        h0 = self.row("h.0", n)
        if m.head:
            tok = int(self.tokens.reshape(-1)[n])
            self.vec_close("input", h0, self.row("w:embed_tokens.weight", tok), where)
        else:
            z = self.wire_row("wire.x", n)
            base = torch.nn.functional.pad(z[:m.r], (0, m.d - m.r)) if m.compressed else z
            if m.dec_proj:
                self.dot("input", R["dec.r"] * (h0 - base), self.vec["dec.w"] * z[m.r:], where)
            else:
                self.vec_close("input", h0, base, where)
        sc = 1.0 / math.sqrt(D)
        for j in self.blocks:
            p = f"L{j}."
            h, hn = self.row(f"h.{j}", n), self.row(f"h.{j + 1}", n)
            q, k, v = self.row(p + "q", n), self.row(p + "k", n), self.row(p + "v", n)
            n1 = self.rmsnorm(h, self.weight(self.bp(j, "input_layernorm.weight")))
            lhs = torch.cat((R[p + "r_q"] * self.unrope(q, t, H), R[p + "r_k"] * self.unrope(k, t, K), R[p + "r_v"] * v))
            self.dot(p + "qkv", lhs, self.vec[p + "w_qkv"] * n1, where)
            lse = self.row(p + "lse", n)
            kap = self.row("p:" + p + "kappa", b).view(K, D)
            qh, y = q.view(H, D), self.row(p + "y", n).view(H, D)
            rc = R[p + "r_c"].view(K, D)
            for g in self.groups:                       # the sampled kv-head groups' heads
                s = self.row(p + "s", n * K + g).view(rep, T)
                c = self.row("p:" + p + "c", b * K + g)             # [T]
                self.absdiff(p + "lse", lse[g * rep:(g + 1) * rep], torch.logsumexp(s[:, :t + 1], dim=-1),
                             f"{where}, kv group {g}")
                for i in range(rep):
                    hh = g * rep + i
                    self.dot(p + "scores", R[p + "rho"] * s[i], qh[hh] * kap[g] * sc, f"{where}, head {hh}")
                    P = torch.exp(s[i, :t + 1] - lse[hh])
                    self.dot(p + "values", rc[g] * y[hh], P * c[:t + 1], f"{where}, head {hh}")
            h1 = self.row(p + "h1", n)
            self.dot(p + "o", R[p + "r_o"] * (h1 - h), self.vec[p + "w_o"] * y.reshape(-1), where)
            n2 = self.rmsnorm(h1, self.weight(self.bp(j, "post_attention_layernorm.weight")))
            gg, uu = self.row(p + "g", n), self.row(p + "u", n)
            self.dot(p + "gu", torch.cat((R[p + "r_g"] * gg, R[p + "r_u"] * uu)), self.vec[p + "w_gu"] * n2, where)
            a = torch.nn.functional.silu(gg) * uu
            self.dot(p + "down", R[p + "r_d"] * (hn - h1), self.vec[p + "w_d"] * a, where)
        hL = self.row(f"h.{len(m.layers)}", n)
        if m.tail:
            nf = self.rmsnorm(hL, self.weight("norm.weight"))
            logits = self.row("lm.logits", n)
            self.dot("lm.logits", R["lm.rho"] * logits, self.vec["lm.w"] * nf, where)
            for v in self.S.idx["lm.vocab"]:
                w = self.row("w:lm_head.weight", v)
                self.dot("lm.vocab", logits[v:v + 1], w * nf, f"{where}, vocab row {v}")
            tgt = int(self.targets.reshape(-1)[n])
            ref = torch.logsumexp(logits, dim=0) - logits[tgt]
            self.absdiff("lm.loss", self.row("lm.loss", b)[t:t + 1], ref.reshape(1), where)
            return
        if m.enc_proj:
            z = self.row("out.z", n)
            self.vec_close("encoder", z[:m.r], hL[:m.r], where, scale=float(z.norm()))
            ne = self.rmsnorm(hL, self.weight("bottleneck_out.norm.weight"))
            self.dot("encoder", self.R["enc.r"] * z[m.r:], self.vec["enc.w"] * ne, where)
        else:
            z = hL[:m.r] if m.compressed else hL
        if "wire.z" in self.output_links:
            self.wire_close("output", "wire.z", n, z, where)

    # ---- backward ------------------------------------------------------------------------------
    def token_backward(self, n: int) -> None:
        m, R, T = self.m, self.R, self.m.T
        b, t = divmod(n, T)
        where = f"token {n}"
        H, K, D, rep, L = m.H, m.K, m.D, m.rep, len(m.layers)
        hL = self.row(f"h.{L}", n)
        gL = self.row(f"g.{L}", n)
        if m.tail:
            logits = self.row("lm.logits", n)
            dlog = torch.softmax(logits.double(), dim=0)        # float64, as the trace (1 - p at p ~ 1)
            dlog[int(self.targets.reshape(-1)[n])] -= 1.0
            dlog = (dlog / (m.N * self.lay.micro_per_step)).float()
            dn = self.row("lm.dn", n)
            self.dot("lm.dn", R["lm.r_b"] * dn, self.vec["lm.o"] * dlog, where)
            self.vec_close("grad_out", gL, self.rmsnorm_bwd(hL, self.weight("norm.weight"), dn), where)
        else:
            dz = self.wire_row("wire.dz", n)
            if m.compressed:
                ref = torch.nn.functional.pad(dz[:m.r], (0, m.d - m.r))
                if m.enc_proj:
                    dne = self.row("out.dne", n)
                    self.dot("encoder_bwd", R["enc.r_b"] * dne, self.vec["enc.o"] * dz[m.r:], where)
                    ref = ref + self.rmsnorm_bwd(hL, self.weight("bottleneck_out.norm.weight"), dne)
            else:
                ref = dz
            self.vec_close("grad_out", gL, ref, where)
        sc = 1.0 / math.sqrt(D)
        for j in reversed(self.blocks):
            p = f"L{j}."
            gn, gj = self.row(f"g.{j + 1}", n), self.row(f"g.{j}", n)
            h, h1 = self.row(f"h.{j}", n), self.row(p + "h1", n)
            gg, uu = self.row(p + "g", n), self.row(p + "u", n)
            da, dn2, dy = self.row(p + "da", n), self.row(p + "dn2", n), self.row(p + "dy", n)
            self.dot(p + "da", R[p + "r_da"] * da, self.vec[p + "o_d"] * gn, where)
            sg = torch.sigmoid(gg)
            dgt, dup = da * uu * (sg * (1 + gg * (1 - sg))), da * gg * sg
            self.dot(p + "dn2", R[p + "r_dn2"] * dn2, torch.cat((self.vec[p + "o_g"] * dgt, self.vec[p + "o_u"] * dup)),
                     where)
            dh1 = gn + self.rmsnorm_bwd(h1, self.weight(self.bp(j, "post_attention_layernorm.weight")), dn2)
            self.dot(p + "dy", R[p + "r_dy"] * dy, self.vec[p + "o_o"] * dh1, where)
            # attention backward
            y, q, k, v = (self.row(p + nm, n) for nm in ("y", "q", "k", "v"))
            yh, dyh = y.view(H, D), dy.view(H, D)
            kh, vh = k.view(K, D), v.view(K, D)
            lse = self.row(p + "lse", n)
            nu = self.row("p:" + p + "nu", b).view(K, D)
            phi, psi = self.row("p:" + p + "phi", b).view(H, D), self.row("p:" + p + "psi", b).view(H, D)
            rdq, rdk, rdv = (R[p + nm].view(K, D) for nm in ("r_dq", "r_dk", "r_dv"))
            dq, dk, dv = self.row(p + "dq", n).view(H, D), self.row(p + "dk", n).view(K, D), self.row(p + "dv", n).view(K, D)
            dk_terms = [[] for _ in range(K)]
            dk_mag = [[] for _ in range(K)]
            dv_terms = [[] for _ in range(K)]
            for g in self.groups:                       # the sampled kv-head groups' heads
                s, dp = self.row(p + "s", n * K + g).view(rep, T), self.row(p + "dp", n * K + g).view(rep, T)
                sT, dpT = self.row(p + "s^T", n * K + g).view(rep, T), self.row(p + "dp^T", n * K + g).view(rep, T)
                lse_b = self.row(p + "lse_b", b * K + g).view(rep, T)          # [head, position]
                delta_b = self.row(p + "delta", b * K + g).view(rep, T)
                ck = self.row("p:" + p + "ck", b * K + g)                      # [T]
                e, f = self.row("p:" + p + "e", b * K + g).view(rep, T), self.row("p:" + p + "f", b * K + g).view(rep, T)
                self.absdiff(p + "lse_b", lse_b[:, t], lse[g * rep:(g + 1) * rep], f"{where}, kv group {g}")
                for i in range(rep):
                    hh = g * rep + i
                    wh = f"{where}, head {hh}"
                    self.dot(p + "dp", R[p + "rho2"] * dp[i], dyh[hh] * nu[g], wh)
                    dl = float(dyh[hh] @ yh[hh])
                    self._record(p + "delta", abs(float(delta_b[i, t]) - dl) / (float(dyh[hh].norm() * yh[hh].norm()) + TINY),
                                 self.tol.link, wh)
                    P = torch.exp(s[i, :t + 1] - lse[hh])
                    dsr = P * (dp[i, :t + 1] - delta_b[i, t])
                    self.dot(p + "dq", rdq[g] * dq[hh], dsr * ck[:t + 1] * sc, wh,
                             b_mag=P * (dp[i, :t + 1].abs() + abs(float(delta_b[i, t]))) * ck[:t + 1] * sc)
                    self.dot(p + "s^T", R[p + "sigma"] * sT[i], phi[hh] * kh[g] * sc, wh)
                    self.dot(p + "dp^T", R[p + "sigma2"] * dpT[i], psi[hh] * vh[g], wh)
                    Pc = torch.exp(sT[i, t:] - lse_b[i, t:])                   # P[t', t] for t' >= t
                    dsc = Pc * (dpT[i, t:] - delta_b[i, t:])
                    dk_terms[g].append(dsc * e[i, t:] * sc)
                    dk_mag[g].append(Pc * (dpT[i, t:].abs() + delta_b[i, t:].abs()) * e[i, t:] * sc)
                    dv_terms[g].append(Pc * f[i, t:])
            for g in self.groups:
                wg = f"{where}, kv head {g}"
                self.dot(p + "dk", rdk[g] * dk[g], torch.cat(dk_terms[g]), wg, b_mag=torch.cat(dk_mag[g]))
                self.dot(p + "dv", rdv[g] * dv[g], torch.cat(dv_terms[g]), wg)
            dn1 = self.row(p + "dn1", n)
            rhs = torch.cat((self.vec[p + "o_q"] * self.unrope(dq.reshape(-1), t, H),
                             self.vec[p + "o_k"] * self.unrope(dk.reshape(-1), t, K), self.vec[p + "o_v"] * dv.reshape(-1)))
            self.dot(p + "dn1", R[p + "r_dn1"] * dn1, rhs, where)
            ref = dh1 + self.rmsnorm_bwd(h, self.weight(self.bp(j, "input_layernorm.weight")), dn1)
            self.vec_close(p + "grad", gj, ref, where)
        if m.head:
            return
        g0 = self.row("g.0", n)
        if m.dec_proj:
            dz = self.row("in.dz", n)
            self.vec_close("decoder_bwd", dz[:m.r], g0[:m.r], where, scale=float(dz.norm()))
            self.dot("decoder_bwd", R["dec.r_b"] * dz[m.r:], self.vec["dec.o"] * g0, where)
        else:
            dz = g0[:m.r] if m.compressed else g0
        if "wire.dx" in self.output_links:
            self.wire_close("grad_in", "wire.dx", n, dz, where, floor=self.grad_floor)

    # ---- shared vectors ------------------------------------------------------------------------
    def batch_row(self, b: int) -> None:
        m, R, T = self.m, self.R, self.m.T
        K, H, D, rep = m.K, m.H, m.D, m.rep
        for j in self.blocks:
            p = f"L{j}."
            names = ["kappa"] + (["nu", "phi", "psi"] if self.lay.backward else [])
            weights = {"kappa": "rho", "nu": "rho2", "phi": "sigma", "psi": "sigma2"}
            for nm in names:
                proj = self.row("p:" + p + nm, b)
                for i in self.S.cols[(p + nm, b)]:
                    col = self.row(p + ACT_PROJ[nm], b * proj.numel() + i)
                    got = proj[i:i + 1]
                    self.dot(p + nm, got, R[p + weights[nm]] * col, f"batch row {b}, column {i}")
            for s in self.S.spots[b]:
                v = self.row(p + "v", b * T + s).view(K, D)
                for g in self.groups:
                    c = self.row("p:" + p + "c", b * K + g)            # [T]
                    self.dot(p + "c", c[s:s + 1], R[p + "r_c"].view(K, D)[g] * v[g], f"batch row {b}, spot {s}")
            if not self.lay.backward:
                continue
            rdq, rdk, rdv = (R[p + nm].view(K, D) for nm in ("r_dq", "r_dk", "r_dv"))
            for s in self.S.spots[b]:
                where = f"batch row {b}, spot {s}"
                k = self.row(p + "k", b * T + s).view(K, D)
                q = self.row(p + "q", b * T + s).view(H, D)
                dy = self.row(p + "dy", b * T + s).view(H, D)
                for g in self.groups:
                    ck = self.row("p:" + p + "ck", b * K + g)                                   # [T]
                    e, f = self.row("p:" + p + "e", b * K + g).view(rep, T), self.row("p:" + p + "f", b * K + g).view(rep, T)
                    self.dot(p + "ck", ck[s:s + 1], rdq[g] * k[g], where)
                    for i in range(rep):
                        hh = g * rep + i
                        self.dot(p + "e", e[i, s:s + 1], rdk[g] * q[hh], where)
                        self.dot(p + "f", f[i, s:s + 1], rdv[g] * dy[hh], where)

    def weight_vectors(self) -> None:
        for vname, parts in weight_vectors(self.lay).items():
            if not self.S.idx[vname]:            # a block this audit does not check (not projected)
                continue
            vec = self.vec[vname]
            for i in self.S.idx[vname]:
                terms = torch.cat([self.R[rname] * self.row(wname, i) for wname, rname in parts])
                self.dot(vname.split(".", 1)[1] if vname.startswith("L") else vname, vec[i:i + 1], terms,
                         f"{vname}[{i}]")

    def tail_loss(self) -> None:
        if self.loss is None:
            return
        losses = torch.stack([self.row("lm.loss", b) for b in range(self.m.B)])
        mean = float(losses.mean())
        self._record("loss", abs(mean - float(self.loss)) / (abs(mean) + 1e-12), self.tol.output, "reported loss")
