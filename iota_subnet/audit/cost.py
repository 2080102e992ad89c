"""What a hop audit costs, computed from the layout alone (no weights, no trace): bytes of every
message, FLOPs of the miner's recomputation, bytes it hashes. Used by ``scripts/bench_audit.py`` for
shapes too large to run here (``8b``), and checked against measured audits of ``tiny``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from iota_subnet.protocol import (AuditOpening, AuditOpenRequest, AuditProjection, AuditProjectRequest,
                                  AuditTraceCommit, AuditTraceRequest, encode)

from .challenge import SamplingParams, draw_sample, openings
from .codec import _klass, proof_length
from .commit import entry_names, entry_shapes
from .layout import TraceLayout
from .merkle import DIGEST_BYTES

HTTP_HEADER_BYTES = 1024


@dataclass
class AuditBytes:
    """Body bytes of each message of one audit (``r1_req`` ... ``r3_resp``) and the opened rows by
    kind (``rows``: row values, ``proofs``: proof hashes)."""

    messages: dict[str, int]
    rows: int
    proofs: int

    def total(self, header_bytes: int = HTTP_HEADER_BYTES) -> int:
        return sum(self.messages.values()) + header_bytes * len(self.messages)


def _zeros(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)


def audit_bytes(layout: TraceLayout, sampling: SamplingParams = SamplingParams(), *, seed: int = 0,
                weights_dtype: torch.dtype = torch.float32, with_forward_output: bool = True,
                wire_commit: str = "root") -> AuditBytes:
    """Exact encoded sizes of the six messages of one audit of ``layout`` with one random sample
    (messages built with zero tensors of the right shapes and encoded). ``wire_commit="sha256"``:
    wire tensors opened whole (see :class:`~.auditor.HopAuditor`)."""
    m = layout.dims
    rng = random.Random(seed)
    sample = draw_sample(layout, sampling, rng)
    r2 = layout.for_blocks(sample.blocks)           # round 2 projects the checked blocks only
    tok = {n: 0 for n in sample.token_rows(m.T)} if m.head else None
    req = openings(layout, sample, tok)
    if not with_forward_output:
        req.pop("wire.z", None)
    whole = sorted(k for k in req if k in layout.wire) if wire_commit == "sha256" else []
    for k in whole:
        req[k] = list(range(layout.wire[k].rows))
    hdr = dict(run_id="run", stage=1, microbatch_id="x" * 32, audit_id="y" * 32)
    sizes = {}
    sizes["r1_req"] = len(encode(AuditTraceRequest(**hdr, direction=layout.direction, weights_root="0" * 64)))
    n_w = len(entry_names(layout.params))
    sizes["r1_resp"] = len(encode(AuditTraceCommit(**hdr, roots=_zeros(len(layout.trace) * DIGEST_BYTES, torch.uint8)
                                                   .view(-1, DIGEST_BYTES),
                                                   weight_roots=_zeros(n_w * DIGEST_BYTES, torch.uint8)
                                                   .view(-1, DIGEST_BYTES))))
    sizes["r2_req"] = len(encode(AuditProjectRequest(**hdr, seed="0" * 64, blocks=list(sample.blocks))))
    sizes["r2_resp"] = len(encode(AuditProjection(**hdr, vectors=_zeros(r2.vector_numel(), torch.float32),
                                                  roots=_zeros(len(r2.committed) * DIGEST_BYTES, torch.uint8)
                                                  .view(-1, DIGEST_BYTES))))
    sizes["r3_req"] = len(encode(AuditOpenRequest(**hdr, rows=req, whole=whole)))
    n = {"values": 0, "weights": 0, "wire": 0}
    hashes = 0
    for name, idx in req.items():
        e = layout.entry(name)
        n[_klass(layout, name)] += len(idx) * e.width
        if name not in whole:
            hashes += sum(proof_length(i, e.rows) for i in idx)
    dts = {"values": torch.float32, "weights": weights_dtype, "wire": layout.wire_torch_dtype}
    kw = {k: (_zeros(v, dts[k]) if v else None) for k, v in n.items()}
    sizes["r3_resp"] = len(encode(AuditOpening(**hdr, proofs=_zeros(hashes * DIGEST_BYTES, torch.uint8)
                                               .view(-1, DIGEST_BYTES), **kw)))
    row_bytes = sum(v * torch.tensor([], dtype=dts[k]).element_size() for k, v in n.items())
    return AuditBytes(sizes, row_bytes, hashes * DIGEST_BYTES)


def trace_flops(layout: TraceLayout) -> int:
    """FLOPs of the miner's recomputation (multiply-adds x 2): the stage's linear layers on N tokens,
    the explicit attention (scores and values over all T x T positions), and for a backward audit the
    input gradients (no weight gradients) and the attention backward."""
    m = layout.dims
    N, T, L = m.N, m.T, len(m.layers)
    linear = L * (m.d * m.HD * 2 + m.d * m.KD * 2 + 3 * m.d * m.F)
    if m.dec_proj:
        linear += m.d * (m.b - m.r)
    if m.enc_proj:
        linear += m.d * (m.b - m.r)
    if m.tail:
        linear += m.d * m.V
    attn = L * 2 * 2 * m.B * m.H * T * T * m.D
    f = 2 * N * linear + attn
    if layout.backward:
        f += 2 * N * linear + 2 * attn                          # input gradients; dP, dS, dq, dk, dv
    return int(f)


def committed_bytes(layout: TraceLayout) -> int:
    """Bytes the miner hashes for one audit: the trace (round 1) and the projection tensors (round 2)."""
    return layout.trace_bytes() + sum(e.rows * e.width * 4 for e in layout.committed.values())


def weights_hash_bytes(layout: TraceLayout, bytes_per_value: int = 4) -> int:
    """Bytes hashed to commit one weights version (rows of every parameter, and columns of every matrix
    but the embedding): :func:`~.commit.weights_commitment`."""
    total = 0
    for shape in entry_shapes(layout.params):
        k = 1
        for s in shape:
            k *= s
        total += k * bytes_per_value
    return total
