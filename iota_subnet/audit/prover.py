"""Miner side of a hop audit: recompute the hop's trace, commit, project, open.

One :class:`HopProver` per audit session (three rounds, see :mod:`iota_subnet.audit`):

1. :meth:`HopProver.commit` recomputes the stage's trace (:class:`~.trace.Tracer`) from the hop's
   stored inputs with the stored weights version, and returns the Merkle root of every traced tensor
   plus the weights version's per-entry roots (which combine to the root the receipts named);
2. :meth:`HopProver.project` answers the validator's seed with the projection vectors and the roots
   of the per-position projection tensors (:func:`~.project.projections`);
3. :meth:`HopProver.open` returns the requested rows with their proofs.

A replayed stage (:attr:`~.layout.TraceLayout.replay`) commits no trace and has no round 2: round 3
opens its weights and wire tensors, and the validator replays the hop (:mod:`.replay`).

Costs on the miner (``scripts/bench_audit.py``): one fp32 forward (+ backward) of one micro-batch
with explicit attention, hashing the trace (:meth:`TraceLayout.trace_bytes`, ~0.2 GB for a ``tiny``
backward audit), and host memory for the trace until the session ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .commit import WeightsCommitment, WireTensor, commit_rows, wire_rows
from .layout import LayoutError, TraceLayout
from .merkle import MerkleTree
from .project import projections, randoms
from .trace import Tracer


class OpenRequestError(ValueError):
    """An open request names a tensor that does not exist, a row out of range, or asks for too much."""


@dataclass
class Opened:
    """Rows of one committed tensor: ``rows`` [k, width] in the tensor's dtype, ``proofs`` one list of
    sibling hashes per row (bottom up), ``index`` the row indices in the same order."""

    index: list[int]
    rows: torch.Tensor
    proofs: list[list[bytes]] = field(default_factory=list)


@dataclass
class HopInputs:
    """What a miner keeps of one hop for audits (the audit window).

    ``x``: token ids [B, T] (head) or the activations received [B, T, b] (the wire tensor, or for
    int8 / fp8 its decoded float values); ``targets`` [B, T] (tail); ``grad``: the gradient received
    [B, T, b] (backward, non-tail; same rule); ``wire``: the wire tensors of the hop by layout name
    (``wire.x``, ``wire.z``, ``wire.dz``, ``wire.dx``), exactly as received or sent (int8 / fp8: the pair
    ``(data, scales)``); their roots are in the receipts.
    """

    x: torch.Tensor
    targets: Optional[torch.Tensor] = None
    grad: Optional[torch.Tensor] = None
    wire: dict[str, WireTensor] = field(default_factory=dict)


class HopProver:
    """One audit session on the miner. ``weights``: the :class:`WeightsCommitment` of the version
    the audited hop used (kept by the miner for the audit window; host tensors). ``device``: where the
    trace runs (the miner's GPU; default the host). ``tracer``: the trace class (tests substitute one
    that forges a link). ``max_open_bytes``: the largest opening it serves (8b backward audits open
    ~30 MB)."""

    def __init__(self, layout: TraceLayout, weights: WeightsCommitment, hop: HopInputs, *,
                 tracer: type[Tracer] = Tracer, device: Optional[str | torch.device] = None,
                 max_open_bytes: int = 64 << 20):
        self.layout, self.weights, self.hop = layout, weights, hop
        self.tracer_cls = tracer
        self.device = device
        self.max_open_bytes = int(max_open_bytes)
        self.records: dict[str, torch.Tensor] = {}
        self.trees: dict[str, MerkleTree] = {}
        self.wire: dict[str, torch.Tensor] = {}
        self.committed: dict[str, torch.Tensor] = {}
        self.vectors: dict[str, torch.Tensor] = {}
        self.round2: TraceLayout = layout          # the layout round 2 answered (restricted to the asked blocks)
        self.trace_loss: Optional[float] = None
        self.committed_once = False

    # ---- round 1 -------------------------------------------------------------------------------
    def commit(self) -> tuple[list[bytes], list[bytes]]:
        """Trace roots (layout order of ``layout.trace``) and weight entry roots (commitment order)."""
        if not self.layout.replay:        # a replayed stage commits no trace (the validator replays it)
            tracer = self.tracer_cls(self.layout, self.weights.tensors, self.device)
            res = tracer.run(self.hop.x, targets=self.hop.targets, grad=self.hop.grad)
            self.records = res.records
            self.trace_loss = res.loss
            self.trees = commit_rows(self.records, list(self.layout.trace))
        self.committed_once = True
        for name in self.layout.wire:
            t = self.hop.wire.get(name)
            if t is not None:
                self.wire[name] = wire_rows(t)
                self.trees[name] = MerkleTree.of_rows(self.wire[name])
        return [self.trees[n].root for n in self.layout.trace], [e[2] for e in self.weights.entries]

    # ---- round 2 -------------------------------------------------------------------------------
    def project(self, seed: bytes, blocks=None) -> tuple[dict[str, torch.Tensor], list[bytes]]:
        """Projection vectors and the roots of the committed projections, in the order of the layout
        restricted to ``blocks`` (None: every block; :meth:`~.layout.TraceLayout.for_blocks`, kept as
        :attr:`round2`). Raises :class:`~.layout.LayoutError` for blocks the stage does not have."""
        if self.layout.replay:
            raise LayoutError("a replayed stage has no round 2 (no projections): open its rows after commit()")
        if not self.records:
            raise RuntimeError("project() before commit()")
        lay = self.layout if blocks is None else self.layout.for_blocks(blocks)
        vec, com = projections(lay, self.records, self.weights.tensors, randoms(self.layout, seed))
        self.round2, self.vectors, self.committed = lay, vec, com
        for name, t in com.items():
            self.trees[name] = MerkleTree.of_rows(t)
        return vec, [self.trees[n].root for n in lay.committed]

    # ---- round 3 -------------------------------------------------------------------------------
    def check_request(self, request: dict[str, list[int]]) -> int:
        """Validate an open request; returns the bytes it opens. Raises :class:`OpenRequestError`."""
        total = 0
        for name, idx in request.items():
            try:
                e = self.layout.entry(name)
            except KeyError:
                raise OpenRequestError(f"no committed tensor {name!r}") from None
            if name in self.layout.wire and name not in self.wire:
                raise OpenRequestError(f"this hop has no {name}")
            if name in self.layout.committed and name not in self.committed:
                raise OpenRequestError(f"{name} was not projected in round 2 (its block was not asked for)")
            if not isinstance(idx, list) or not idx or len(set(idx)) != len(idx):
                raise OpenRequestError(f"{name}: row list must be non-empty and unique")
            if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < e.rows for i in idx):
                raise OpenRequestError(f"{name}: row index out of range 0..{e.rows - 1}")
            total += len(idx) * e.width * 4
        if total > self.max_open_bytes:
            raise OpenRequestError(f"open request of {total} bytes > limit {self.max_open_bytes}")
        return total

    def _row(self, name: str, i: int) -> torch.Tensor:
        if name in self.records:
            return self.records[name][i]
        if name in self.committed:
            return self.committed[name][i]
        if name in self.wire:
            return self.wire[name][i]
        return self.weights.open_row(name, i)[0]

    def _proof(self, name: str, i: int) -> list[bytes]:
        if name in self.trees:
            return self.trees[name].proof(i)
        return self.weights.trees[name].proof(i)

    def open(self, request: dict[str, list[int]], whole: tuple[str, ...] | list[str] = ()) -> dict[str, Opened]:
        """The requested rows and proofs (``request``: layout name -> row indices). ``whole``: wire
        tensors committed by a flat sha256 (:func:`~.commit.wire_sha256`), sent without proofs."""
        if not self.vectors and not (self.layout.replay and self.committed_once):
            raise RuntimeError("open() before project()" if not self.layout.replay else "open() before commit()")
        self.check_request(request)
        bad = [w for w in whole if w not in self.layout.wire or w not in request]
        if bad:
            raise OpenRequestError(f"only requested wire tensors can be sent whole, not {bad}")
        out = {}
        for name, idx in request.items():
            rows = torch.stack([self._row(name, i).reshape(-1) for i in idx])
            proofs = [[] for _ in idx] if name in whole else [self._proof(name, i) for i in idx]
            out[name] = Opened(list(idx), rows, proofs)
        return out
