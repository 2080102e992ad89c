"""Validator side of a hop audit: one :class:`HopAuditor` per audit session.

The validator chooses a hop only after its receipts are in (blind), then runs three rounds:

1. ask the miner for the hop's trace roots (:class:`~iota_subnet.protocol.AuditTraceRequest`);
   :meth:`HopAuditor.on_commit` checks the weights entries combine to the root the receipt named,
   and returns a fresh random seed; it also draws the blocks the audit checks (:attr:`blocks`,
   :func:`~.challenge.draw_blocks`: the trace is committed, so naming them now gives nothing away);
2. send the seed and the blocks; the miner projects those blocks only (:attr:`round2`, the layout
   its answer follows); :meth:`HopAuditor.on_projection` takes the projection vectors and roots and
   draws the sample (:func:`~.challenge.draw_sample`), returning the rows to open;
3. :meth:`HopAuditor.check` verifies every opened row against its root (Merkle proof), then every
   link (:class:`~.check.LinkChecker`).

A stage without a trace (:attr:`~.layout.TraceLayout.replay`: a ``transformers`` family stage) skips
round 2: :meth:`HopAuditor.on_projection` is called with no vectors and asks for the weights and wire
tensors, which :meth:`HopAuditor.check` replays (:mod:`.replay`). Round 3 is then sent in
:attr:`HopAuditor.parts` (:func:`~.replay.split_openings`: each within the miner's opening cap),
every part's rows verified against their roots as it arrives (:meth:`HopAuditor.accept`); a sampled
audit has one part, the whole request.

A refused, malformed, timed-out or inconsistent answer at any round is a failed audit: the caller
turns exceptions of the transport into ``Verdict(ok=False)`` (:meth:`HopAuditor.failed`).
"""
from __future__ import annotations

import hashlib
import random
from typing import Optional

import torch

from iota_subnet.protocol.wire import needs_scales

from .challenge import Sample, SamplingParams, draw_blocks, draw_sample, openings
from .check import LinkChecker, Tolerances, Verdict
from .commit import weights_entries_root, entry_names
from .layout import TraceLayout
from .merkle import DIGEST_BYTES, leaf_hash, verify_proof
from .project import randoms
from .replay import OPEN_PART_BYTES, ReplayChecker, replay_openings, split_openings
from .prover import Opened


class AuditFailure(ValueError):
    """The miner's answer to a round cannot be accepted (the audit fails)."""


class HopAuditor:
    """One audit session on the validator.

    ``weights_root``: the root the audited hop's receipt named; ``wire_roots``: the hop's wire
    tensors' commitments from the receipts (layout names ``wire.*``; ``wire.z`` may be left out of a
    backward audit whose forward used other weights, then the forward output is not compared);
    ``wire_commit``: ``"root"`` when the receipts carry :func:`~.commit.wire_root` (token rows are
    opened with proofs), ``"sha256"`` when they carry the flat sha256 of the tensor
    (:func:`~.commit.wire_sha256`, what the data plane sends today): each wire tensor is then opened
    whole (tiny, bf16: 64 kB a tensor instead of ~1 kB); int8 and fp8 wire tensors need ``"root"``
    (the flat hash of the receipts does not cover their scales). ``tokens`` [B, T] (head) / ``targets``
    [B, T] (tail), from the micro-batch's sample address; ``loss``: the loss the tail reported;
    ``rng``: defaults to ``random.SystemRandom`` (the OS CSPRNG: a miner cannot predict the draws);
    ``open_part_bytes``: the most row-value bytes one open request of a replay asks for
    (:data:`~.replay.OPEN_PART_BYTES`; at most the miner's ``max_open_bytes``).
    """

    def __init__(self, layout: TraceLayout, *, weights_root: bytes, wire_roots: dict[str, bytes],
                 tol: Tolerances, wire_commit: str = "root", weights_dtype: torch.dtype = torch.float32,
                 sampling: SamplingParams = SamplingParams(), rng: Optional[random.Random] = None,
                 tokens: Optional[torch.Tensor] = None, targets: Optional[torch.Tensor] = None,
                 loss: Optional[float] = None, open_part_bytes: int = OPEN_PART_BYTES):
        if wire_commit not in ("root", "sha256"):
            raise ValueError(f"wire_commit must be 'root' or 'sha256', got {wire_commit!r}")
        if wire_commit == "sha256" and needs_scales(layout.wire_format):
            raise ValueError(f"{layout.wire_format} (scaled: int8, fp8) wire tensors are audited against wire_root "
                             "commitments (their scales must be bound)")
        self.wire_commit = wire_commit
        self.layout = layout
        self.weights_root = bytes(weights_root)
        self.wire_roots = {k: bytes(v) for k, v in wire_roots.items()}
        unknown = set(self.wire_roots) - set(layout.wire)
        if unknown:
            raise ValueError(f"wire roots {sorted(unknown)} are not tensors of this hop ({sorted(layout.wire)})")
        for need in ("wire.x", "wire.dz", "wire.dx"):
            if need in layout.wire and need not in self.wire_roots:
                raise ValueError(f"the audit of this hop needs the root of {need} (from its receipts)")
        if layout.direction == "forward" and "wire.z" in layout.wire and "wire.z" not in self.wire_roots:
            raise ValueError("a forward audit needs the root of wire.z (the output the hop sent)")
        if layout.dims.head and tokens is None:
            raise ValueError("auditing the head needs the micro-batch's token ids")
        if layout.dims.tail and targets is None:
            raise ValueError("auditing the tail needs the micro-batch's targets")
        self.tol, self.sampling = tol, sampling.validate()
        self.wire_dtype, self.weights_dtype = layout.wire_torch_dtype, weights_dtype
        self.rng = rng or random.SystemRandom()   # the OS CSPRNG: draws a miner cannot predict
        self.tokens, self.targets, self.loss = tokens, targets, loss
        self.trace_roots: dict[str, bytes] = {}
        self.weight_roots: dict[str, bytes] = {}
        self.p_roots: dict[str, bytes] = {}
        self.seed: Optional[bytes] = None
        self.blocks: list[int] = []
        self.round2: TraceLayout = layout       # round 2's layout: restricted to self.blocks by on_commit
        self.vectors: dict[str, torch.Tensor] = {}
        self.sample: Optional[Sample] = None
        self.request: dict[str, list[int]] = {}
        self.whole: list[str] = []
        self.open_part_bytes = int(open_part_bytes)
        #: the open requests of round 3 (one for a sampled audit) and the rows verified so far
        self.parts: list[dict[str, list[int]]] = []
        self.rows: dict[str, dict[int, torch.Tensor]] = {}

    # ---- round 1 -------------------------------------------------------------------------------
    def on_commit(self, trace_roots: list[bytes], weight_roots: list[bytes]) -> bytes:
        """Accept the trace and weight roots; returns the projection seed. Raises :class:`AuditFailure`."""
        lay = self.layout
        if len(trace_roots) != len(lay.trace) or any(len(r) != DIGEST_BYTES for r in trace_roots):
            raise AuditFailure(f"expected {len(lay.trace)} trace roots of {DIGEST_BYTES} bytes")
        names = entry_names(lay.params)
        if len(weight_roots) != len(names) or any(len(r) != DIGEST_BYTES for r in weight_roots):
            raise AuditFailure(f"expected {len(names)} weight roots of {DIGEST_BYTES} bytes")
        if weights_entries_root(lay.params, weight_roots) != self.weights_root:
            raise AuditFailure("the weight roots do not combine to the weights root the hop's receipt named")
        self.trace_roots = dict(zip(lay.trace, map(bytes, trace_roots)))
        self.weight_roots = {"w:" + n: bytes(r) for n, r in zip(names, weight_roots)}
        self.seed = bytes(self.rng.getrandbits(8) for _ in range(32))
        self.blocks = draw_blocks(lay, self.sampling, self.rng)
        self.round2 = lay.for_blocks(self.blocks)
        return self.seed

    # ---- round 2 -------------------------------------------------------------------------------
    def on_projection(self, vectors: dict[str, torch.Tensor], committed_roots: list[bytes]) -> dict[str, list[int]]:
        """Accept the projections; returns the open request (layout name -> row indices)."""
        lay, r2 = self.layout, self.round2
        if self.seed is None:
            raise RuntimeError("on_projection() before on_commit()")
        if lay.replay:
            return self._replay_request()
        if set(vectors) != set(r2.vectors):
            raise AuditFailure("projection vectors differ from the expected set")
        for k, shape in r2.vectors.items():
            t = vectors[k]
            if tuple(t.shape) != tuple(shape) or not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                raise AuditFailure(f"projection {k}: shape {tuple(t.shape)} (expected {shape}) or non-finite")
        if len(committed_roots) != len(r2.committed) or any(len(r) != DIGEST_BYTES for r in committed_roots):
            raise AuditFailure(f"expected {len(r2.committed)} projection roots")
        self.vectors = dict(vectors)
        self.p_roots = dict(zip(r2.committed, map(bytes, committed_roots)))
        self.sample = draw_sample(lay, self.sampling, self.rng, blocks=self.blocks)
        tok = None
        if lay.dims.head:
            flat = self.tokens.reshape(-1)
            tok = {n: int(flat[n]) for n in self.sample.token_rows(lay.dims.T)}
        self.request = openings(lay, self.sample, tok)
        self.request = {k: v for k, v in self.request.items()
                        if not (k == "wire.z" and "wire.z" not in self.wire_roots)}
        if self.wire_commit == "sha256":
            self.whole = sorted(k for k in self.request if k in lay.wire)
            for k in self.whole:
                self.request[k] = list(range(lay.wire[k].rows))
        self.parts = [self.request]
        return self.request

    def _replay_request(self) -> dict[str, list[int]]:
        """A replayed stage (no round 2): every row the replay needs (:func:`~.replay.replay_openings`)."""
        self.request = replay_openings(self.layout, self.tokens, tuple(self.wire_roots))
        if self.wire_commit == "sha256":
            self.whole = sorted(k for k in self.request if k in self.layout.wire)
        try:
            self.parts = split_openings(self.layout, self.request, self.whole, max_bytes=self.open_part_bytes)
        except ValueError as e:
            raise AuditFailure(f"cannot split the replay's opening: {e}") from None
        return self.request

    def whole_of(self, part: dict[str, list[int]]) -> list[str]:
        """The tensors of ``part`` sent whole (flat sha256, no proofs)."""
        return [k for k in self.whole if k in part]

    def root_of(self, name: str) -> bytes:
        for table in (self.trace_roots, self.p_roots, self.wire_roots, self.weight_roots):
            if name in table:
                return table[name]
        raise KeyError(name)

    def dtype_of(self, name: str) -> torch.dtype:
        e = self.layout.entry(name)
        return {"wire": self.wire_dtype, "weights": self.weights_dtype}.get(e.dtype, torch.float32)

    # ---- round 3 -------------------------------------------------------------------------------
    def accept(self, part: dict[str, list[int]], opened: dict[str, Opened]) -> None:
        """Verify the answer ``opened`` to one of :attr:`parts` and keep its rows (:attr:`rows`).
        Raises :class:`AuditFailure`."""
        if part not in self.parts:
            raise AuditFailure("an opening answering no part of the request")
        for name, rows in self.verify_opening(opened, part).items():
            self.rows.setdefault(name, {}).update(rows)

    def check(self, opened: Optional[dict[str, Opened]] = None) -> Verdict:
        """Verify the opening against the roots and check every link; never raises on bad input.
        ``opened``: the answer to the whole request (one part); None: the parts :meth:`accept` took."""
        try:
            if opened is not None:
                self.accept(self.request, opened)
            missing = [k for k, idx in self.request.items() if set(self.rows.get(k, {})) != set(idx)]
            if missing:
                raise AuditFailure(f"rows of {missing[:4]} were not opened")
        except AuditFailure as e:
            return self.failed(f"opening: {e}")
        rows = self.rows
        if self.layout.replay:
            checker = ReplayChecker(self.layout, opened=rows, tol=self.tol, tokens=self.tokens, targets=self.targets,
                                    loss=self.loss)
            try:
                return checker.run()
            except (KeyError, IndexError, RuntimeError, ValueError) as e:
                return self.failed(f"replay: {type(e).__name__}: {e}")
        out_links = tuple(k for k in ("wire.z", "wire.dx") if k in self.request)
        checker = LinkChecker(self.layout, rnd=randoms(self.layout, self.seed), sample=self.sample, vectors=self.vectors,
                              opened=rows, tol=self.tol, tokens=self.tokens,
                              targets=self.targets, loss=self.loss, output_links=out_links)
        try:
            return checker.run()
        except (KeyError, IndexError, RuntimeError, ValueError) as e:      # an opening that lacks what a link needs
            return self.failed(f"check: {type(e).__name__}: {e}")

    def verify_opening(self, opened: dict[str, Opened], request: Optional[dict[str, list[int]]] = None
                       ) -> dict[str, dict[int, torch.Tensor]]:
        """Every row of ``request`` (default: the whole :attr:`request`), opened with a valid proof:
        name -> {row: tensor}. Raises :class:`AuditFailure`."""
        request = self.request if request is None else request
        if set(opened) != set(request):
            raise AuditFailure("the opening does not answer the request")
        out: dict[str, dict[int, torch.Tensor]] = {}
        for name, idx in request.items():
            o = opened[name]
            e = self.layout.entry(name)
            dtype = self.dtype_of(name)
            if list(o.index) != list(idx) or tuple(o.rows.shape) != (len(idx), e.width) or o.rows.dtype != dtype:
                raise AuditFailure(f"{name}: rows {tuple(o.rows.shape)} {o.rows.dtype}, expected "
                                   f"{(len(idx), e.width)} {dtype}")
            if len(o.proofs) != len(idx):
                raise AuditFailure(f"{name}: {len(o.proofs)} proofs for {len(idx)} rows")
            root = self.root_of(name)
            if name in self.whole:                  # flat sha256 of the whole tensor, rows in order
                if hashlib.sha256(o.rows.contiguous().view(torch.uint8).numpy().tobytes()).digest() != root:
                    raise AuditFailure(f"{name} does not match its committed sha256")
                out[name] = {i: o.rows[k] for k, i in enumerate(idx)}
                continue
            rows = {}
            for k, i in enumerate(idx):
                row = o.rows[k]
                if not verify_proof(root, leaf_hash(row), i, e.rows, o.proofs[k]):
                    raise AuditFailure(f"{name} row {i} does not match its committed root")
                if row.is_floating_point() and not bool(torch.isfinite(row).all()):
                    raise AuditFailure(f"{name} row {i} is not finite")
                rows[i] = row
            out[name] = rows
        return out

    @staticmethod
    def failed(reason: str) -> Verdict:
        v = Verdict()
        v.fail(reason)
        return v
