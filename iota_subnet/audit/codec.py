"""Hop-audit rounds <-> wire messages (:mod:`iota_subnet.protocol.messages` ``Audit*``), with the
tensor contract of every reply computed from the layout and the request, so a malformed answer is a
typed :class:`~iota_subnet.protocol.ProtocolError` (``decode`` checks names, dtypes and exact shapes
before a tensor is loaded) and never reaches the checks.

Packing (round 3): the requested rows are concatenated per dtype class, in canonical order (tensor
names sorted, row indices as requested): ``values`` (float32: trace and projection rows), ``weights``
(the weights' dtype), ``wire`` (the wire dtype); ``proofs`` holds every proof's sibling hashes in
the same order, each proof's length being a function of (row, leaves) (:func:`proof_length`).
"""
from __future__ import annotations

import torch

from iota_subnet.protocol import (AuditOpening, AuditOpenRequest, AuditProjection, AuditProjectRequest,
                                  AuditTraceCommit, AuditTraceRequest, Outcome, ProtocolError, TensorContract,
                                  TensorSpec)

from .commit import entry_names
from .layout import TraceLayout
from .merkle import DIGEST_BYTES
from .prover import Opened

U8 = (torch.uint8,)


def proof_length(index: int, n_leaves: int) -> int:
    """Number of sibling hashes in the proof of leaf ``index`` of an ``n_leaves`` tree (:mod:`.merkle`)."""
    k, i, width = 0, int(index), int(n_leaves)
    while width > 1:
        if (i ^ 1) < width:
            k += 1
        i //= 2
        width = (width + 1) // 2
    return k


def _digests(rows: list[bytes]) -> torch.Tensor:
    if not rows:
        return torch.zeros(0, DIGEST_BYTES, dtype=torch.uint8)
    return torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8).reshape(-1, DIGEST_BYTES).clone()


def _unpack_digests(t: torch.Tensor) -> list[bytes]:
    raw = t.contiguous().numpy().tobytes()
    return [raw[i:i + DIGEST_BYTES] for i in range(0, len(raw), DIGEST_BYTES)]


def _roots_spec(n: int) -> TensorSpec:
    return TensorSpec(dtypes=U8, shape=(n, DIGEST_BYTES), finite=False)


def _flat_spec(n: int, dtype: torch.dtype, required: bool = True) -> TensorSpec:
    return TensorSpec(dtypes=(dtype,), shape=(n,), required=required)


# ---- round 1 -------------------------------------------------------------------------------------
def commit_message(req: AuditTraceRequest, trace_roots: list[bytes], weight_roots: list[bytes]) -> AuditTraceCommit:
    return AuditTraceCommit(run_id=req.run_id, stage=req.stage, microbatch_id=req.microbatch_id,
                            inner_step=req.inner_step, audit_id=req.audit_id, direction=req.direction,
                            roots=_digests(trace_roots), weight_roots=_digests(weight_roots))


def commit_contract(layout: TraceLayout) -> TensorContract:
    return TensorContract({"roots": _roots_spec(len(layout.trace)),
                           "weight_roots": _roots_spec(len(entry_names(layout.params)))})


def read_commit(msg: AuditTraceCommit) -> tuple[list[bytes], list[bytes]]:
    return _unpack_digests(msg.roots), _unpack_digests(msg.weight_roots)


# ---- round 2 -------------------------------------------------------------------------------------
def project_request(audit: AuditTraceRequest, seed: bytes, blocks=None) -> AuditProjectRequest:
    """``blocks``: the blocks (indices inside the stage) to project (None: all)."""
    return AuditProjectRequest(run_id=audit.run_id, stage=audit.stage, microbatch_id=audit.microbatch_id,
                               audit_id=audit.audit_id, seed=bytes(seed).hex(),
                               blocks=[int(j) for j in blocks] if blocks is not None else [])


def read_blocks(msg: AuditProjectRequest, layout: TraceLayout) -> list[int] | None:
    """The blocks a round-2 request asks for (None: all, an empty list); raises MALFORMED for
    indices that are not distinct integers of the stage's blocks."""
    if not msg.blocks:
        return None
    L = len(layout.dims.layers)
    bad = [j for j in msg.blocks if not isinstance(j, int) or isinstance(j, bool) or not 0 <= j < L]
    if bad or len(set(msg.blocks)) != len(msg.blocks):
        raise ProtocolError(Outcome.MALFORMED, f"blocks must be distinct indices in 0..{L - 1}, got {msg.blocks[:8]}")
    return sorted(msg.blocks)


def read_seed(msg: AuditProjectRequest) -> bytes:
    """The 32-byte seed; raises MALFORMED."""
    try:
        seed = bytes.fromhex(msg.seed)
    except ValueError:
        raise ProtocolError(Outcome.MALFORMED, "seed is not hex") from None
    if len(seed) != 32:
        raise ProtocolError(Outcome.MALFORMED, f"seed of {len(seed)} bytes, expected 32")
    return seed


def projection_message(req: AuditProjectRequest, layout: TraceLayout, vectors: dict[str, torch.Tensor],
                       roots: list[bytes]) -> AuditProjection:
    flat = torch.cat([vectors[k].reshape(-1).to(torch.float32) for k in layout.vectors])
    return AuditProjection(run_id=req.run_id, stage=req.stage, microbatch_id=req.microbatch_id, audit_id=req.audit_id,
                           vectors=flat, roots=_digests(roots))


def projection_contract(layout: TraceLayout) -> TensorContract:
    return TensorContract({"vectors": _flat_spec(layout.vector_numel(), torch.float32),
                           "roots": _roots_spec(len(layout.committed))})


def read_projection(msg: AuditProjection, layout: TraceLayout) -> tuple[dict[str, torch.Tensor], list[bytes]]:
    out, off = {}, 0
    for k, shape in layout.vectors.items():
        n = 1
        for s in shape:
            n *= s
        out[k] = msg.vectors[off:off + n].reshape(shape)
        off += n
    return out, _unpack_digests(msg.roots)


# ---- round 3 -------------------------------------------------------------------------------------
def open_request(audit: AuditTraceRequest, rows: dict[str, list[int]], whole: list[str] | tuple = (), *,
                 more: bool = False) -> AuditOpenRequest:
    """``more``: another part of the opening follows (the miner keeps the session open)."""
    return AuditOpenRequest(run_id=audit.run_id, stage=audit.stage, microbatch_id=audit.microbatch_id,
                            audit_id=audit.audit_id, rows={k: list(map(int, v)) for k, v in sorted(rows.items())},
                            whole=sorted(whole), more=bool(more))


def opening_bytes(layout: TraceLayout, request: dict[str, list[int]], *, weights_dtype: torch.dtype,
                  whole: list[str] | tuple = ()) -> int:
    """Tensor bytes of the :class:`AuditOpening` answering ``request`` (rows and proofs,
    :func:`opening_contract`): what a deadline for it is computed from."""
    contract = opening_contract(layout, request, weights_dtype=weights_dtype, whole=whole)
    total = 0
    for spec in contract.specs.values():
        n = 1
        for d in spec.shape:
            n *= int(d)
        total += n * spec.dtypes[0].itemsize
    return total


def _klass(layout: TraceLayout, name: str) -> str:
    dt = layout.entry(name).dtype
    return {"wire": "wire", "weights": "weights"}.get(dt, "values")


def opening_contract(layout: TraceLayout, request: dict[str, list[int]], *, weights_dtype: torch.dtype,
                     whole: list[str] | tuple = ()) -> TensorContract:
    """Exact shapes of the :class:`AuditOpening` answering ``request`` (``whole``: tensors sent without
    proofs). Raises KeyError for a name the layout does not have."""
    n = {"values": 0, "weights": 0, "wire": 0}
    hashes = 0
    for name in sorted(request):
        e = layout.entry(name)
        n[_klass(layout, name)] += len(request[name]) * e.width
        if name not in whole:
            hashes += sum(proof_length(i, e.rows) for i in request[name])
    dts = {"values": torch.float32, "weights": weights_dtype, "wire": layout.wire_torch_dtype}
    specs = {k: _flat_spec(v, dts[k]) for k, v in n.items() if v}
    specs["proofs"] = _roots_spec(hashes)
    return TensorContract(specs)


def opening_message(req: AuditOpenRequest, layout: TraceLayout, opened: dict[str, Opened]) -> AuditOpening:
    parts: dict[str, list[torch.Tensor]] = {"values": [], "weights": [], "wire": []}
    proofs: list[bytes] = []
    for name in sorted(req.rows):
        o = opened[name]
        parts[_klass(layout, name)].append(o.rows.reshape(-1))
        for p in o.proofs:
            proofs.extend(p)
    kw = {k: (torch.cat(v) if v else None) for k, v in parts.items()}
    return AuditOpening(run_id=req.run_id, stage=req.stage, microbatch_id=req.microbatch_id, audit_id=req.audit_id,
                        proofs=_digests(proofs), **kw)


def read_opening(msg: AuditOpening, layout: TraceLayout, request: dict[str, list[int]],
                 whole: list[str] | tuple = ()) -> dict[str, Opened]:
    """Split a decoded opening (already checked against :func:`opening_contract`) back into rows."""
    off = {"values": 0, "weights": 0, "wire": 0}
    hashes = _unpack_digests(msg.proofs) if msg.proofs is not None else []
    h = 0
    out = {}
    for name in sorted(request):
        e, k = layout.entry(name), _klass(layout, name)
        idx = list(request[name])
        flat = getattr(msg, k)
        n = len(idx) * e.width
        rows = flat[off[k]:off[k] + n].reshape(len(idx), e.width)
        off[k] += n
        pr = []
        for i in idx:
            ln = 0 if name in whole else proof_length(i, e.rows)
            pr.append(hashes[h:h + ln])
            h += ln
        out[name] = Opened(idx, rows, pr)
    return out


def read_open_request(msg: AuditOpenRequest, layout: TraceLayout, *, max_rows: int = 1 << 16) -> dict[str, list[int]]:
    """Miner side: the request's rows, validated against the layout (``msg.whole`` must name requested
    wire tensors); raises MALFORMED / BODY_TOO_LARGE."""
    if any(w not in layout.wire or w not in msg.rows for w in msg.whole):
        raise ProtocolError(Outcome.MALFORMED, "only requested wire tensors can be sent whole")
    total = 0
    for name, idx in msg.rows.items():
        try:
            e = layout.entry(name)
        except KeyError:
            raise ProtocolError(Outcome.MALFORMED, f"no committed tensor {name!r}") from None
        if not idx or len(set(idx)) != len(idx) or any(not 0 <= i < e.rows for i in idx):
            raise ProtocolError(Outcome.MALFORMED, f"{name}: rows must be unique indices in 0..{e.rows - 1}")
        total += len(idx)
    if total > max_rows:
        raise ProtocolError(Outcome.BODY_TOO_LARGE, f"{total} rows requested > limit {max_rows}")
    return {k: list(v) for k, v in sorted(msg.rows.items())}
