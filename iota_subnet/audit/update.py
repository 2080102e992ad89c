"""Update audits: check a miner's inner optimizer step on a few committed rows.

AdamW is elementwise (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization",
Algorithm 2), so any row of a parameter can be checked alone: given the row's weights ``w0``,
moments ``m0, v0`` before the step, the accumulated gradient ``g`` (before clipping), the clip factor
``c``, the learning rate and AdamW's step count ``t``, the validator recomputes ``w1, m1, v1`` and
compares them with the rows the miner committed to (:class:`~iota_subnet.protocol.UpdateCommit`).

Reference (:func:`adamw_reference`): the exact float32 operation sequence of ``torch.optim.AdamW``
(torch 2.x, ``Adam`` with ``decoupled_weight_decay=True``, single-tensor path)::

    g  = g * c                                   # clip_grad_norm_: grads.mul_(clamp(max_norm / (norm + 1e-6), max=1))
    w  = w0 * (1 - lr * wd)                      # decoupled weight decay (wd = 0 for 1-D parameters here)
    m  = m0.lerp(g, 1 - beta1)
    v  = v0 * beta2 + (1 - beta2) * g * g        # mul_ then addcmul_
    w1 = w - (lr / (1 - beta1**t)) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

Error measure (:func:`row_units`): ``max |got - ref| / (max |ref| x 2^-24)`` over a row, i.e. the
worst deviation in units of half a float32 ulp of the row's largest value. Measured on CPU (torch
2.13, 30 steps, 512 x 256 and 1-D parameters, ``scripts/bench_update_audit.py``): the single-tensor
and foreach implementations match the reference bit for bit (0 units), the fused kernel deviates by
1.4 units. :data:`UPDATE_TOL_UNITS` = 64 leaves a 45x margin for other kernels (GPU FMA contraction).
What it must catch: ``noisy-update`` (noise instead of the update) is off by ~10^6 units; skipping the
weight decay of a weight matrix (lr 3e-3, wd 0.1, |w| ~ 0.02) by ~2,000 units.

Roots: ``m``, ``v`` and ``g`` combine per-parameter row roots; the weights (``w0``, ``w1``) also
commit every matrix but the token embedding by columns, exactly as the weights version root that
hop receipts name (:func:`iota_subnet.audit.commit.weights_commitment`), so a step's ``w0`` must be
the root of the version its hops used and its ``w1`` the next version's.

Limits (stated, not hidden): the gradient is checked for consistency (the committed norm bounds the
opened rows' norm; the clip factor follows from the norm), not against the hops that produced it:
the hop audits check those. A miner that inflates its committed norm scales its own step down (it
saves no work); sampled rows cannot prove the total norm.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import torch

from iota_subnet.protocol.audit import (UPDATE_KINDS, UpdateAuditResponse, UpdateCommit, opening_key,
                                        proof_from_tensor)
from iota_subnet.protocol.outcome import ProtocolError

from .layout import has_columns
from .merkle import combine_roots, leaf_hash, verify_proof

#: Tolerance of a recomputed AdamW row, in row-scaled float32 units (see the module docstring).
UPDATE_TOL_UNITS = 64.0
#: torch's clip_grad_norm_ adds this to the norm before dividing.
CLIP_EPS = 1e-6
#: AdamW's epsilon (``iota_subnet.train.optim.make_optimizer``).
ADAM_EPS = 1e-8


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of a stage as the audit sees it: name, shape, rows (first dim; 1-D: one row),
    and its AdamW weight decay."""

    name: str
    shape: tuple[int, ...]
    weight_decay: float

    @property
    def n_rows(self) -> int:
        return int(self.shape[0]) if len(self.shape) >= 2 else 1

    @property
    def row_numel(self) -> int:
        n = math.prod(self.shape) if self.shape else 1
        return n // self.n_rows if self.n_rows else 0


@dataclass(frozen=True)
class AdamHParams:
    """AdamW hyperparameters of the run (from the run config, never from a miner's reply)."""

    beta1: float
    beta2: float
    eps: float
    grad_clip: float

    @classmethod
    def from_train(cls, tcfg) -> "AdamHParams":
        return cls(float(tcfg.beta1), float(tcfg.beta2), ADAM_EPS, float(tcfg.grad_clip))


def param_layout(module: torch.nn.Module, weight_decay: float) -> list[ParamInfo]:
    """The stage's parameters in ``state_dict`` order with their weight decay (matrices decay, 1-D
    parameters do not: :func:`iota_subnet.train.optim.make_optimizer`)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    out = []
    for name in module.state_dict().keys():
        p = params.get(name)
        if p is None:
            continue
        out.append(ParamInfo(name, tuple(int(s) for s in p.shape), float(weight_decay) if p.dim() >= 2 else 0.0))
    return out


def sample_rows(layout: Sequence[ParamInfo], k: int, rng: random.Random) -> list[tuple[str, int]]:
    """``k`` distinct (param, row) pairs, each drawn with probability proportional to its row's
    number of values (so every value of the stage is equally likely to be audited)."""
    sizes = [p.n_rows * p.row_numel for p in layout]
    total = sum(sizes)
    if total <= 0:
        return []
    out: list[tuple[str, int]] = []
    tries = 0
    while len(out) < k and tries < 20 * k:
        tries += 1
        x = rng.randrange(total)
        for p, n in zip(layout, sizes):
            if x < n:
                pick = (p.name, x // max(1, p.row_numel))
                if pick not in out:
                    out.append(pick)
                break
            x -= n
    return out


def clip_coef(grad_norm: float, max_norm: float) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` multiplies gradients by (float32)."""
    c = torch.tensor(float(max_norm), dtype=torch.float32) / (torch.tensor(float(grad_norm), dtype=torch.float32)
                                                              + CLIP_EPS)
    return float(torch.clamp(c, max=1.0))


def adamw_reference(w0: torch.Tensor, m0: torch.Tensor, v0: torch.Tensor, g: torch.Tensor, *, lr: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float, step: int, clip: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW step on rows (float32, any shape): returns ``(w1, m1, v1)``. ``step`` is AdamW's
    step count after the update (>= 1). See the module docstring for the formula."""
    if step < 1:
        raise ValueError(f"AdamW step count must be >= 1, got {step}")
    g = g.detach().float() * torch.tensor(float(clip), dtype=torch.float32)
    w, m, v = w0.detach().float().clone(), m0.detach().float().clone(), v0.detach().float().clone()
    if weight_decay != 0:
        w.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    denom = (v.sqrt() / (bias_correction2 ** 0.5)).add_(eps)
    w.addcdiv_(m, denom, value=-(lr / bias_correction1))
    return w, m, v


def row_units(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst deviation of ``got`` from ``ref`` in units of ``max|ref| x 2^-24`` (inf on shape
    mismatch or non-finite values; 0 when both are all zero)."""
    if got is None or tuple(got.shape) != tuple(ref.shape):
        return math.inf
    g, r = got.detach().double(), ref.detach().double()
    if not bool(torch.isfinite(g).all()):
        return math.inf
    diff = float((g - r).abs().max()) if g.numel() else 0.0
    if diff == 0.0:
        return 0.0
    scale = float(r.abs().max()) * 2.0 ** -24
    return diff / scale if scale > 0 else math.inf


@dataclass
class UpdateCheck:
    """Outcome of checking one opened update. ``ok``; ``reason`` (empty when ok); ``units``: the
    worst row error per kind (``w1``, ``m1``, ``v1``); ``rows``: how many rows were checked."""

    ok: bool
    reason: str = ""
    units: dict[str, float] = field(default_factory=dict)
    rows: int = 0

    @property
    def worst(self) -> float:
        return max(self.units.values(), default=0.0)


def _fail(reason: str, **kw) -> UpdateCheck:
    return UpdateCheck(False, reason, **kw)


def check_update_opening(commit: UpdateCommit, rows: Iterable[tuple[str, int]], resp: UpdateAuditResponse,
                         layout: Sequence[ParamInfo], hp: AdamHParams, *, expected_lr: Optional[float] = None,
                         tol_units: float = UPDATE_TOL_UNITS) -> UpdateCheck:
    """Verify an opening of ``commit`` (what the miner committed before the audit was chosen) for
    the requested ``rows``: the per-parameter roots combine to the committed roots, every opened
    row matches its root with its proof, the clip factor follows from the committed norm, the
    norm bounds the opened gradient rows, the learning rate is the schedule's (``expected_lr``),
    and AdamW recomputed on every row matches the committed ``w1, m1, v1`` within ``tol_units``.
    Anything missing or malformed is a failure (an honest miner answers exactly what was asked)."""
    by_name = {p.name: p for p in layout}
    rows = [(str(n), int(r)) for n, r in rows]
    # 1. per-entry roots -> committed roots (weights: rows and columns, as the weights version root)
    param_roots: dict[str, dict[str, bytes]] = {}
    for kind in UPDATE_KINDS:
        entries = commitment_entries(layout, columns=kind in ("w0", "w1"))
        t = resp.roots.get(kind)
        if t is None or t.dtype != torch.uint8 or tuple(t.shape) != (len(entries), 32):
            return _fail(f"roots of {kind}: expected uint8 [{len(entries)}, 32]")
        raw = t.contiguous().numpy().tobytes()
        roots = [raw[i * 32:(i + 1) * 32] for i in range(len(entries))]
        if combine_roots((n, sh, r) for (n, sh), r in zip(entries, roots)).hex() != commit.roots[kind]:
            return _fail(f"per-parameter roots of {kind} do not combine to the committed root")
        param_roots[kind] = {n: r for (n, _), r in zip(entries, roots)}
    # 2. the commitment's own scalars
    if not commit.skipped:
        if commit.adam_step < 1:
            return _fail(f"applied step with AdamW step count {commit.adam_step}")
        # No upper bound: a replica handed a lane at a lower step keeps its own moments and count
        # (:mod:`iota_subnet.miner.lane_handover`), and a count at or above ``step + 1`` buys no rate
        # (:func:`iota_subnet.train.optim.rewarm_factor` is then 1); the recomputation below uses it.
        want_c = clip_coef(commit.grad_norm, hp.grad_clip)
        if abs(commit.clip_coef - want_c) > 1e-6 * max(1.0, abs(want_c)):
            return _fail(f"clip factor {commit.clip_coef:.6g} does not follow from the committed norm "
                         f"{commit.grad_norm:.6g} (expected {want_c:.6g})")
        if expected_lr is not None and abs(commit.lr - expected_lr) > 1e-6 * max(abs(expected_lr), 1e-12):
            return _fail(f"learning rate {commit.lr:.6g} is not the schedule's {expected_lr:.6g} at step {commit.step}")
    # 3. rows: proofs, then the recomputation
    units = {"w1": 0.0, "m1": 0.0, "v1": 0.0}
    gsq = 0.0
    no_grad = set(commit.no_grad)
    for name, r in rows:
        p = by_name.get(name)
        if p is None or not 0 <= r < p.n_rows:
            return _fail(f"requested row {name}[{r}] is not in the stage")
        vals: dict[str, torch.Tensor] = {}
        for kind in UPDATE_KINDS:
            key = opening_key(kind, name, r)
            x = resp.rows.get(key)
            if x is None or x.dtype != torch.float32 or tuple(x.shape) != (p.row_numel,):
                return _fail(f"row {key} missing or not float32 [{p.row_numel}]")
            try:
                proof = proof_from_tensor(resp.proofs.get(key))
            except ProtocolError as e:
                return _fail(f"row {key}: {e}")
            if not verify_proof(param_roots[kind][name], leaf_hash(x), r, p.n_rows, proof):
                return _fail(f"row {key} does not match the committed root")
            vals[kind] = x
        if commit.skipped or name in no_grad:
            for a, b in (("w0", "w1"), ("m0", "m1"), ("v0", "v1")):
                if not torch.equal(vals[a], vals[b]):
                    why = "a skipped step" if commit.skipped else "a parameter without gradient"
                    return _fail(f"{name}[{r}]: {b} differs from {a} on {why}")
            continue
        if not bool(torch.isfinite(vals["g"]).all()):
            return _fail(f"{name}[{r}]: non-finite gradient on an applied step")
        if commit.adam_step == 1 and (bool(vals["m0"].any()) or bool(vals["v0"].any())):
            # a first update starts from empty moments; claiming one on old moments would buy a
            # re-warmed (lower) learning rate the miner is not entitled to
            return _fail(f"{name}[{r}]: AdamW step count 1 (a fresh state) on non-zero moments")
        gsq += float(vals["g"].double().pow(2).sum())
        w1, m1, v1 = adamw_reference(vals["w0"], vals["m0"], vals["v0"], vals["g"], lr=commit.lr, beta1=hp.beta1,
                                     beta2=hp.beta2, eps=hp.eps, weight_decay=p.weight_decay, step=commit.adam_step,
                                     clip=commit.clip_coef)
        for kind, ref in (("w1", w1), ("m1", m1), ("v1", v1)):
            units[kind] = max(units[kind], row_units(vals[kind], ref))
    if not commit.skipped and math.sqrt(gsq) > commit.grad_norm * (1 + 1e-4) + 1e-12:
        return _fail(f"opened gradient rows have norm {math.sqrt(gsq):.6g} > the committed total {commit.grad_norm:.6g}",
                     units=units, rows=len(rows))
    worst = max(units.values(), default=0.0)
    if worst > tol_units:
        kind = max(units, key=units.get)
        return _fail(f"AdamW recomputed on {len(rows)} row(s) differs: {kind} off by {worst:.3g} units "
                     f"(tolerance {tol_units:g})", units=units, rows=len(rows))
    return UpdateCheck(True, "", units=units, rows=len(rows))


def check_chain(prev: UpdateCommit, cur: UpdateCommit) -> Optional[str]:
    """Consecutive commitments of one miner: ``cur`` must start where ``prev`` ended (weights and
    moments), unless the weights were replaced in between (a merge or a state sync: ``merges``
    grew; the moments still carry over). Returns why not, or None."""
    if cur.step != prev.step + 1:
        return None                      # not consecutive: nothing to compare
    if cur.merges == prev.merges and cur.roots["w0"] != prev.roots["w1"]:
        return f"weights before step {cur.step} are not the weights after step {prev.step}"
    if cur.merges == prev.merges and (cur.roots["m0"] != prev.roots["m1"] or cur.roots["v0"] != prev.roots["v1"]):
        return f"optimizer moments before step {cur.step} are not those after step {prev.step}"
    return None


def commitment_entries(layout: Sequence[ParamInfo], *, columns: bool) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every committed entry in order: each parameter's rows, and with
    ``columns`` (the weights kinds) each matrix but the token embedding by columns as well
    (``name^T``, shape ``(in, out)``: :func:`iota_subnet.audit.commit.weights_commitment`)."""
    out = []
    for p in layout:
        out.append((p.name, p.shape))
        if columns and has_columns(p.name, p.shape):
            out.append((p.name + "^T", (p.shape[1], p.shape[0])))
    return out


def layout_of(names_shapes: Mapping[str, Sequence[int]], weight_decay: float) -> list[ParamInfo]:
    """A layout from ``name -> shape`` (in order), for callers without a module."""
    return [ParamInfo(n, tuple(int(s) for s in sh), float(weight_decay) if len(sh) >= 2 else 0.0)
            for n, sh in names_shapes.items()]
