"""Validator side of the hop audit of a stage without a trace (a ``transformers`` family stage,
:attr:`~.layout.TraceLayout.replay`): the validator replays the hop.

The rounds are those of every hop audit (:class:`~.auditor.HopAuditor`) less the projections:
round 1 binds the weights (the entry roots must combine to the root the hop's receipt named),
round 3 opens, against those roots and the receipts' wire roots, every row of every parameter (the
head's token embedding: the micro-batch's token rows only) and every row of the hop's wire tensors
(:func:`replay_openings`). :class:`ReplayChecker` then rebuilds the stage
(:class:`~iota_subnet.model.hf_pipeline.HFPipelineStage`) with those weights on the host in fp32,
runs its forward on the opened input (head: the token ids of the micro-batch's sample address) and,
for a backward audit, its backward from the opened gradient received (tail: from the loss over the
targets, divided by ``micro_per_step``), and compares:

``output``   every row of ``wire.z`` (the output sent) with the replayed output
``loss``     the tail's reported loss with the replayed one (relative)
``grad_in``  every row of ``wire.dx`` (the gradient sent upstream) with the replayed input gradient

A row passes when what exceeds the wire rounding (half an ulp of the wire dtype per value; int8:
half a step; fp8: the row's scale times half an e4m3 ulp) is, in L2 norm relative to the larger of the replayed row's norm and (gradients) the
median row norm of the replayed tensor, within :attr:`~.check.Tolerances.output` (the run's compute
precision: fp32 1e-4, bf16 autocast 2e-2). Every row is checked: a forward or backward falsified on
any token fails.

Cost: the stage's weights cross the wire with their proofs (a ~4 MB LM head of 8192 x 128 fp32
plus ~3.4 MB of proofs; Qwen2.5-0.5B's tail: a 545 MB LM head of 151,936 x 896 plus ~87 MB of
proofs), and the validator runs one fp32 forward (+ backward) of one micro-batch.

Round 3 in parts: a stage's rows are opened in several requests (:func:`split_openings`), each
opening at most :data:`OPEN_PART_BYTES` of row values (half the miner's
:attr:`~.prover.HopProver.max_open_bytes`, 64 MiB) and :data:`OPEN_PART_ROWS` rows (half the rows a
miner's route accepts, :func:`~.codec.read_open_request`); a tensor's rows are split into
contiguous blocks, every row still opened with its Merkle proof against its committed entry root,
so a stage of any size that fits the hosts is replayed (a miner cannot swap weights between parts:
each row is bound to the root of round 1). A wire tensor sent whole (flat sha256) is never split.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from iota_subnet.protocol.wire import SCALE_MAX, rounding_bound

from .check import Tolerances, Verdict, half_ulp
from .commit import split_wire_rows
from .layout import EMBED, TraceLayout


#: the most row-value bytes (rows x width x 4) one open request of a replay asks for
OPEN_PART_BYTES = 32 << 20
#: the most rows one open request of a replay asks for
OPEN_PART_ROWS = 1 << 15


def split_openings(layout: TraceLayout, request: dict[str, list[int]], whole: tuple[str, ...] | list[str] = (), *,
                   max_bytes: int = OPEN_PART_BYTES, max_rows: int = OPEN_PART_ROWS) -> list[dict[str, list[int]]]:
    """``request`` (layout name -> row indices) split into parts of at most ``max_bytes`` of row values
    (``rows x width x 4``, the miner's count, :meth:`~.prover.HopProver.check_request`) and ``max_rows``
    rows each, in name order, a tensor's rows in request order (contiguous blocks). The tensors of
    ``whole`` are kept in one part. Raises ValueError when one row (or one whole tensor) alone
    exceeds the limits."""
    if max_bytes <= 0 or max_rows <= 0:
        raise ValueError(f"max_bytes and max_rows must be positive, got {max_bytes}, {max_rows}")
    parts: list[dict[str, list[int]]] = [{}]
    used = [0, 0]                                 # bytes, rows of the last part

    def room(nbytes: int, nrows: int) -> bool:
        return used[0] + nbytes <= max_bytes and used[1] + nrows <= max_rows

    def put(name: str, idx: list[int], row_bytes: int) -> None:
        if not room(len(idx) * row_bytes, len(idx)):
            parts.append({})
            used[:] = [0, 0]
        parts[-1].setdefault(name, []).extend(idx)
        used[0] += len(idx) * row_bytes
        used[1] += len(idx)

    for name in sorted(request):
        idx = list(request[name])
        row_bytes = layout.entry(name).width * 4
        if row_bytes > max_bytes or (name in whole and (len(idx) * row_bytes > max_bytes or len(idx) > max_rows)):
            raise ValueError(f"{name}: {'the whole tensor' if name in whole else 'one row'} exceeds an open request "
                             f"of {max_bytes} bytes / {max_rows} rows")
        if name in whole:
            put(name, idx, row_bytes)
            continue
        k = 0
        while k < len(idx):
            n = min(len(idx) - k, (max_bytes - used[0]) // row_bytes, max_rows - used[1])
            if n <= 0:
                parts.append({})
                used[:] = [0, 0]
                continue
            put(name, idx[k:k + n], row_bytes)
            k += n
    return [p for p in parts if p]


def replay_openings(layout: TraceLayout, tokens: Optional[torch.Tensor] = None,
                    wire: tuple[str, ...] = ("wire.x", "wire.z", "wire.dz", "wire.dx")) -> dict[str, list[int]]:
    """Every row the replay needs: layout name -> sorted row indices. ``tokens`` [B, T]: the head's
    micro-batch (its embedding rows); ``wire``: the wire tensors whose roots the receipts named."""
    out: dict[str, list[int]] = {}
    for name, shape in layout.params:
        rows = shape[0] if len(shape) >= 2 else 1
        if name == EMBED and layout.dims.head:
            if tokens is None:
                raise ValueError("replaying the head needs the micro-batch's token ids")
            out["w:" + name] = sorted({int(t) for t in tokens.reshape(-1).tolist()})
        else:
            out["w:" + name] = list(range(rows))
    for name, e in layout.wire.items():
        if name in wire:
            out[name] = list(range(e.rows))
    return dict(sorted(out.items()))


class ReplayChecker:
    """Replays one hop from its opened rows (proofs already verified) and compares; see the module
    docstring. ``opened``: layout name -> {row: tensor}; ``tokens`` / ``targets`` [B, T] int64 (head /
    tail); ``loss``: the loss the tail reported."""

    def __init__(self, layout: TraceLayout, *, opened: dict[str, dict[int, torch.Tensor]], tol: Tolerances,
                 tokens: Optional[torch.Tensor] = None, targets: Optional[torch.Tensor] = None,
                 loss: Optional[float] = None):
        self.lay, self.m, self.O, self.tol = layout, layout.dims, opened, tol
        self.tokens, self.targets, self.loss = tokens, targets, loss
        self.v = Verdict()

    # ---- pieces --------------------------------------------------------------------------------
    def _record(self, link: str, err: float, tol: float, where: str) -> None:
        self.v.checks += 1
        if not math.isfinite(err):
            err = math.inf
        self.v.errors[link] = max(self.v.errors[link], err)
        if not err <= tol:
            self.v.fail(f"{link} ({where}): err {err:.2e} > {tol:.0e}", link)

    def wire_tensor(self, name: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The opened wire tensor as float64 values [N, b], and for int8 / fp8 the per-row scales [N]."""
        rows = self.O[name]
        raw = torch.stack([rows[i] for i in range(self.lay.wire[name].rows)])
        return split_wire_rows(raw, self.lay.wire_format)

    def compare(self, link: str, name: str, ref: torch.Tensor, floor: float = 0.0) -> None:
        """Every row of wire tensor ``name`` against the replayed ``ref`` [N, b] (see the module docstring)."""
        sent, steps = self.wire_tensor(name)
        ref = ref.to(torch.float64)
        if steps is None:
            slack = half_ulp(torch.maximum(sent.abs(), ref.abs()), self.lay.wire_torch_dtype)
        else:
            want = ref.abs().amax(dim=1) / SCALE_MAX[self.lay.wire_format]
            for n in range(ref.shape[0]):
                self._record(link, abs(float(steps[n]) - float(want[n])) / (float(want[n]) + 1e-30), self.tol.output,
                             f"token {n}, scale")
            slack = rounding_bound(torch.maximum(sent.abs(), ref.abs()), steps.abs(), self.lay.wire_format)
        excess = ((sent - ref).abs() - slack).clamp_min(0.0).norm(dim=1)
        scale = ref.norm(dim=1).clamp_min(floor) + 1e-30
        err = excess / scale
        worst = int(err.argmax())
        self.v.checks += ref.shape[0] - 1
        self._record(link, float(err[worst]), self.tol.output, f"token {worst} of {ref.shape[0]}")

    def stage(self) -> torch.nn.Module:
        """The stage with the opened weights (fp32, host)."""
        from iota_subnet.model.hf_pipeline import HFPipelineStage
        lay = self.lay
        m = HFPipelineStage(lay.model, lay.pcfg, lay.stage, init=False)
        state = {}
        for name, shape in lay.params:
            rows = self.O["w:" + name]
            if name == EMBED and lay.dims.head:
                t = torch.zeros(shape, dtype=torch.float32)
                for i, r in rows.items():
                    t[i] = r.to(torch.float32)
            else:
                t = torch.stack([rows[i] for i in range(len(rows))]).to(torch.float32).reshape(shape)
            state[name] = t
        m.load_state_dict(state, strict=True)
        return m.float().eval()

    # ---- run -----------------------------------------------------------------------------------
    def run(self) -> Verdict:
        from iota_subnet.model.lm_loss import masked_lm_loss
        lay, m = self.lay, self.m
        model = self.stage()
        B, T, N = m.B, m.T, m.N
        if m.head:
            x = self.tokens.reshape(B, T).to(torch.int64)
        else:
            x = self.wire_tensor("wire.x")[0].to(torch.float32).reshape(B, T, m.b)
            x.requires_grad_(lay.backward)
        with torch.set_grad_enabled(lay.backward):
            out = model(x)
            if m.tail:
                loss = masked_lm_loss(out, self.targets.reshape(B, T).to(torch.int64))
                ref_loss = float(loss.detach())
                got = float("nan") if self.loss is None else float(self.loss)
                self._record("loss", abs(got - ref_loss) / (abs(ref_loss) + 1e-12), self.tol.output, "micro-batch")
            elif "wire.z" in self.O:
                self.compare("output", "wire.z", out.detach().reshape(N, -1))
            if lay.backward and not m.head:
                if m.tail:
                    g = torch.autograd.grad(loss / lay.micro_per_step, x)[0]
                else:
                    dz = self.wire_tensor("wire.dz")[0].to(torch.float32).reshape(out.shape)
                    g = torch.autograd.grad(out, x, grad_outputs=dz)[0]
                g = g.detach().reshape(N, -1)
                self.compare("grad_in", "wire.dx", g, floor=float(g.to(torch.float64).norm(dim=1).median()))
        return self.v
