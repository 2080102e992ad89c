"""Miner side of hop audits: what a miner keeps of its hops for the audit
window, and the weights versions those hops used.

Weights versions
    A version is ``(inner step, merges)`` (:class:`~iota_subnet.miner.stage_worker.StageWorker`). The
    first time the compute thread runs a hop with a version this store has not seen,
    :meth:`HopStore.observe` copies the weights to host memory (:func:`~iota_subnet.audit.commit.host_snapshot`,
    under the worker's lock, on the compute thread: a memcpy, the only part on the critical path) and
    hashes them on a background thread (:func:`~iota_subnet.audit.commit.weights_commitment`: rows and
    columns of every matrix), unless the update store already commits those very weights (the state
    after the last inner step, untouched since: ``shared``), whose commitment it then reuses (no copy,
    no second hashing). Receipts name the version's root (``wroot``), filled in when the receipt
    batch is sent (:meth:`HopStore.root`), so hashing never delays a hop.

What is kept (the audit window)
    The last ``keep_versions`` = K versions (host copy + Merkle trees) and every hop that used one of
    them (at most ``max_hops``): its :class:`~iota_subnet.audit.prover.HopInputs` (the wire tensors
    received and sent, or the token ids; the targets at the tail; the gradient received), which are
    the tensors the data plane already holds (no copy). A hop whose version left the window is
    answered ``LATE`` (410).

Memory (K versions): ``K x 4 x P`` bytes of fp32 weights for a stage of P parameters (none of its own
for the versions it takes from the update store: that store's copies), plus the trees
(~64 bytes a row or column; < 1 % of the weights at these shapes), plus the hops: up to 4 wire
tensors of ``B x T x b`` values each (tiny, bf16: 64 kB each). K = 4: ``tiny`` stage 1 (2.4 M
parameters) ~40 MB of weights + ~1 MB of hops; ``1b`` middle stage (~244 M parameters) ~3.9 GB;
``8b`` head or tail stage (~1.4 B) ~22 GB of host RAM (K = 2: ~11 GB). Hashing costs one pass over
every byte twice (rows and columns) per version: ``tiny`` ~0.1 s of one core, ``8b`` ~7-11 GB per
version (``docs/hop-audit.md``).
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from iota_subnet.audit.commit import WeightsCommitment, WireTensor, host_snapshot, weights_commitment
from iota_subnet.audit.prover import HopInputs
from iota_subnet.protocol.wire import from_wire
from iota_subnet.utils.spill import SpillDir

Version = tuple[int, int]

#: Default number of weights versions kept (``--audit-window``).
DEFAULT_KEEP_VERSIONS = 4


def wire_pair(data: torch.Tensor, scales: Optional[torch.Tensor]) -> WireTensor:
    """A wire tensor as :class:`HopInputs` keeps it: the tensor, or ``(data, scales)`` for int8 / fp8."""
    return data if scales is None else (data, scales)


def wire_values(data: torch.Tensor, scales: Optional[torch.Tensor]) -> torch.Tensor:
    """What the stage computed with: bf16 / fp32 wire tensors as they are, int8 / fp8 decoded to float
    (:func:`~iota_subnet.protocol.wire.from_wire`)."""
    if scales is None:
        return data
    return from_wire(data, scales)


@dataclass
class HopRecord:
    """One micro-batch as this stage served it. ``version``: the forward's weights; ``bversion``: the
    backward's (None until the backward ran, or for the tail whose backward is its forward's)."""

    microbatch_id: str
    wire_format: str
    x: torch.Tensor
    version: Version
    targets: Optional[torch.Tensor] = None
    grad: Optional[torch.Tensor] = None
    wire: dict[str, WireTensor] = field(default_factory=dict)
    bversion: Optional[Version] = None
    at: float = 0.0

    def inputs(self, direction: str) -> HopInputs:
        """The :class:`HopInputs` of an audit of this hop in ``direction``."""
        wire = dict(self.wire)
        if direction == "forward":
            wire = {k: v for k, v in wire.items() if k in ("wire.x", "wire.z")}
        return HopInputs(self.x, targets=self.targets, grad=self.grad if direction == "backward" else None, wire=wire)

    def version_for(self, direction: str) -> Version:
        return self.bversion if direction == "backward" and self.bversion is not None else self.version


class _Version:
    def __init__(self, future: Future, own: bool = True):
        self.future = future
        self.own = own              # False: the copy belongs to ``shared``'s owner (not counted in nbytes)
        self.at = time.time()
        self.spilled = ""           # spill file of an own copy once on disk


class HopStore:
    """Hops and weights versions of one stage for the audit window (see the module docstring).

    ``keep_versions``: K; ``max_hops``: hops kept at most (oldest dropped first); ``hash_threads``:
    background hashing threads (hashlib releases the GIL on large rows). ``shared(version)``: a
    future of that version's :class:`~iota_subnet.audit.commit.WeightsCommitment` already being
    built elsewhere, or None (:meth:`iota_subnet.miner.update_store.UpdateStore.weights_version`:
    the weights after an inner step are committed once, for both kinds of audit). ``spill``: own
    copies go to disk once hashed (:mod:`iota_subnet.utils.spill`; host memory then holds at most
    the copy being hashed).
    """

    def __init__(self, keep_versions: int = DEFAULT_KEEP_VERSIONS, *, max_hops: int = 1024, hash_threads: int = 1,
                 shared: Optional[Callable[[Version], Optional[Future]]] = None, spill: Optional[SpillDir] = None):
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        self.keep_versions = int(keep_versions)
        self.max_hops = max(1, int(max_hops))
        self.pool = ThreadPoolExecutor(max_workers=max(1, int(hash_threads)), thread_name_prefix="hop-audit-hash")
        self._lock = threading.Lock()
        self._versions: "OrderedDict[Version, _Version]" = OrderedDict()
        self._hops: "OrderedDict[str, HopRecord]" = OrderedDict()
        self.shared = shared
        self.spill = spill
        self.snapshots = 0
        self.shared_versions = 0    # versions whose commitment came from ``shared`` (no copy, no hashing)
        self.snapshot_s = 0.0       # compute-thread seconds spent copying weights (the critical path)

    # ---- compute thread ------------------------------------------------------------------------
    def observe(self, worker: Any) -> Version:
        """Call on the compute thread, under ``worker.lock``, before a hop computes: the weights
        version it will use, snapshotted and queued for hashing the first time it is seen."""
        v = (int(worker.inner_step), int(worker.merges))
        with self._lock:
            if v in self._versions:
                return v
        fut = self.shared(v) if self.shared is not None else None
        own = fut is None
        if not own:
            self.shared_versions += 1
        else:
            t0 = time.perf_counter()
            snap = host_snapshot(worker.module.state_dict())
            self.snapshot_s += time.perf_counter() - t0
            self.snapshots += 1
            fut = None
        entry = _Version(fut, own)
        if own:
            entry.future = self.pool.submit(self._commit, snap, entry)
        with self._lock:
            self._versions[v] = entry
            while len(self._versions) > self.keep_versions:
                gone = self._versions.popitem(last=False)[1]
                if gone.own and self.spill is not None:
                    gone.future.add_done_callback(lambda _f, g=gone: self.spill.drop(g.spilled))
            kept = set(self._versions)
            for mb in [mb for mb, h in self._hops.items()
                       if h.version not in kept and (h.bversion is None or h.bversion not in kept)]:
                del self._hops[mb]
        return v

    def _commit(self, snap: dict[str, torch.Tensor], entry: _Version) -> WeightsCommitment:
        """Hash an own snapshot, then (with ``spill``) move it to disk (it stays in memory if that fails)."""
        wc = weights_commitment(snap)
        if self.spill is not None:
            try:
                entry.spilled, wc.tensors = self.spill.put(wc.tensors, tag="hop")
            except OSError:
                pass
        return wc

    # ---- event loop ------------------------------------------------------------------------------
    def record_forward(self, microbatch_id: str, *, wire_format: str, x: torch.Tensor, version: Version,
                       targets: Optional[torch.Tensor] = None, wire: Optional[dict[str, WireTensor]] = None) -> None:
        """The forward of ``microbatch_id``: ``x`` the token ids [B, T] (head) or the activations
        received [B, T, b] (:func:`wire_values`), ``wire`` its wire tensors (``wire.x`` received,
        ``wire.z`` sent; the tail: ``wire.dx``, the gradient it sent)."""
        rec = HopRecord(microbatch_id, wire_format, x, tuple(version), targets=targets, wire=dict(wire or {}),
                        at=time.time())
        with self._lock:
            if rec.version not in self._versions:
                return
            self._hops[microbatch_id] = rec
            self._hops.move_to_end(microbatch_id)
            while len(self._hops) > self.max_hops:
                self._hops.popitem(last=False)

    def record_backward(self, microbatch_id: str, *, grad: torch.Tensor, version: Version,
                        wire: dict[str, WireTensor]) -> None:
        """The backward of a recorded forward: ``grad`` the gradient received [B, T, b]
        (:func:`wire_values`), ``wire`` ``wire.dz`` (received) and ``wire.dx`` (sent)."""
        with self._lock:
            rec = self._hops.get(microbatch_id)
            if rec is None:
                return
            rec.grad = grad
            rec.wire.update(wire)
            rec.bversion = tuple(version)

    # ---- any thread ------------------------------------------------------------------------------
    def hop(self, microbatch_id: str) -> Optional[HopRecord]:
        with self._lock:
            return self._hops.get(microbatch_id)

    def commitment(self, version: Version, timeout_s: Optional[float] = None) -> Optional[WeightsCommitment]:
        """The commitment of ``version`` (waiting up to ``timeout_s`` for its hashing), or None when
        it is not (or no longer) kept. Raises the hashing's exception."""
        with self._lock:
            v = self._versions.get(tuple(version))
        if v is None:
            return None
        return v.future.result(timeout=timeout_s)

    async def root(self, version: Version) -> str:
        """The hex root of ``version`` for a receipt, ``""`` when it is not kept (awaits the hashing)."""
        with self._lock:
            v = self._versions.get(tuple(version))
        if v is None:
            return ""
        wc = await asyncio.wrap_future(v.future)
        return wc.root.hex()

    def versions(self) -> list[Version]:
        with self._lock:
            return list(self._versions)

    @property
    def nbytes(self) -> int:
        """Host bytes of the weights copies this store made (trees, hop tensors and shared copies not
        counted)."""
        with self._lock:
            futs = [v.future for v in self._versions.values() if v.own and not v.spilled]
        total = 0
        for f in futs:
            if f.done() and f.exception() is None:
                total += sum(t.numel() * t.element_size() for t in f.result().tensors.values())
        return total

    def status(self) -> dict:
        with self._lock:
            return {"versions": [list(v) for v in self._versions], "hops": len(self._hops),
                    "snapshots": self.snapshots, "shared_versions": self.shared_versions,
                    "snapshot_s": round(self.snapshot_s, 3)}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
