"""Miner side of update audits: commit to every inner optimizer step, keep what audits open.

At every inner step the :class:`~iota_subnet.miner.stage_worker.StageWorker` calls
:meth:`UpdateStore.begin` (before clipping and ``opt.step()``) and :meth:`UpdateStore.finish` (after).
On the compute thread the store only copies tensors (device -> host: a pinned, non-blocking copy
plus a CUDA event on GPU; a clone on CPU); Merkle trees are built on ``hash_workers`` background
threads (hashlib releases the GIL), and the :class:`~iota_subnet.protocol.UpdateCommit` of a step is
ready when they finish (:meth:`take_commitments`, :meth:`commitment`).

What is kept (``keep_steps`` = K most recent steps): copies of weights, ``exp_avg``, ``exp_avg_sq``
before and after each kept step and its accumulated gradient, plus their Merkle trees (about 64
bytes per row). A validator checks a committed step on a few rows it draws after the commitment
(:mod:`iota_subnet.audit.update`), so the miner must be able to open *any* row of all seven kinds of
every kept step: all of it is kept, exactly (fp32; a bf16 copy would not reproduce the committed
rows). The state after step k is the state before step k + 1 (shared, not copied twice) unless the
weights were replaced in between (a merge, a state sync: only the replaced kind is copied again).
Copied per step: the state after it and its gradient, ``16 x P`` bytes for P parameters (fp32;
``+ 4 P`` after weights were replaced; device -> host on GPU): :attr:`UpdateStore.last_copy_bytes`.
Kept: ``(3 (K + 1) + K) x 4 x P`` bytes. Without ``spill`` all of it is host memory (76 bytes per
parameter at K = 4: 123 GB for the ``8b`` head stage, 1.62 B parameters). With ``spill`` (what the
miner runs) each copy is written to disk once hashed and read back through a memory map
(:mod:`iota_subnet.utils.spill`), and :meth:`UpdateStore.begin` waits until the previous step's
copies are on disk: host memory holds one step's copies (``16 P``, ``20 P`` after a weights
replacement, ``28 P`` at the first step) plus trees; the disk holds the kept bytes above.
:attr:`UpdateStore.nbytes` / :attr:`UpdateStore.disk_bytes` report the live figures.

The weights kinds (``w0``, ``w1``) commit matrices by rows and by columns, exactly as the weights
version root of hop receipts (:func:`iota_subnet.audit.commit.weights_commitment`): ``w1`` of step k
is the root receipts name for the weights version ``(k + 1, merges)``, and the hop store takes that
commitment (trees and host copy) instead of hashing the same weights again
(:meth:`UpdateStore.weights_version`). Update audits open rows only.

Checkpoints: the copies of the state after the last step are what a checkpoint taken right after
it holds; :meth:`UpdateStore.state_after` offers them as a checkpoint source
(:class:`~iota_subnet.miner.step_state.StepState`), pinned by :meth:`UpdateStore.hold` while the
checkpoint is written (a later step's cleanup defers removing their spill files), so the miner
takes no ``12 P`` snapshot of its own (:class:`~iota_subnet.miner.checkpoints.Checkpoints`).

Serving (:meth:`UpdateStore.open`, mounted by :class:`UpdateAuditRoute`) reads only stored copies
under the store's own lock: it never takes the worker's lock, never waits for the compute thread or
a running merge. A step outside the window is refused with ``LATE`` (410), one whose trees are
still being built with ``NOT_READY`` (503, retry).
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from iota_subnet.audit.commit import WeightsCommitment, weights_commitment
from iota_subnet.audit.merkle import MerkleTree, as_rows, combine_roots
from iota_subnet.miner.step_state import StateLayout, StepState
from iota_subnet.utils.spill import SpillDir
from iota_subnet.protocol import (UPDATE_KINDS, Outcome, ProtocolError, UpdateAuditRequest, UpdateAuditResponse,
                                  UpdateCommit, opening_key, proof_tensor)

#: Rows one audit request may open (each row is opened for every requested kind).
MAX_ROWS_PER_REQUEST = 64
#: Tensor bytes one audit answer may carry (the validator asks for fewer rows per request beyond it).
MAX_OPEN_BYTES = 64 << 20


class _Copies:
    """One kind of one version (e.g. the weights after step 7): host copies of every parameter's
    tensor, the tensor versions they were taken at, and (built in the background) Merkle trees."""

    def __init__(self, names: Sequence[str], tensors: Sequence[torch.Tensor], versions: Sequence[tuple[int, int]]):
        self.names = list(names)
        self.host: dict[str, torch.Tensor] = {}
        self.events: list[Any] = []
        for n, t in zip(names, tensors):
            self.host[n] = self._copy(t)
        self.versions = list(versions)
        self.trees: dict[str, MerkleTree] = {}
        self.entries: list[tuple[str, tuple, bytes]] = []    # (name, shape, root) in commitment order
        self.root: Optional[bytes] = None
        self.weights: Optional[WeightsCommitment] = None     # weights kinds: rows and columns (build)
        self.future: Optional[Future] = None
        self.spilled = ""                                    # spill file name once on disk
        self.pins = 0                                        # readers holding it (UpdateStore.hold)
        self.discard_due = False                             # no kept step uses it: discard once unpinned

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type == "cuda":
            h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            h.copy_(t, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self.events.append(ev)
            return h
        return t.clone()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())

    def build(self, shapes: dict[str, tuple], columns: bool = False, spill: Optional[SpillDir] = None) -> bytes:
        """Hash (and with ``spill``, then move the copies to disk: :meth:`_spill`); returns the root."""
        root = self._hash(shapes, columns)
        if spill is not None:
            try:
                self._spill(spill)
            except OSError:              # disk full or not writable: the copy stays in host memory
                pass
        return root

    def _spill(self, spill: SpillDir) -> None:
        """Replace the host copies by memory-mapped views of one spill file (same values)."""
        fname, views = spill.put(self.host, tag="update")
        self.host = views
        if self.weights is not None:
            self.weights.tensors = {n: views.get(n, t) for n, t in self.weights.tensors.items()}
        self.spilled = fname

    def _hash(self, shapes: dict[str, tuple], columns: bool = False) -> bytes:
        """Merkle trees and the combined root. ``columns`` (weights): matrices are also committed by
        columns, exactly as the weights version root of hop receipts is
        (:func:`~iota_subnet.audit.commit.weights_commitment`, kept in :attr:`weights`), so the root
        of the weights after step k *is* the root receipts name for version k + 1 and the hop store
        reuses it (:meth:`UpdateStore.weights_version`) instead of hashing the same weights again."""
        for ev in self.events:           # the device -> host copies have landed
            ev.synchronize()
        self.events.clear()
        if columns:
            wc = weights_commitment({n: self.host[n] for n in self.names})
            self.weights = wc
            self.trees = {n: wc.trees["w:" + n] for n in self.names}
            self.entries = list(wc.entries)
            self.root = wc.root
            return self.root
        self.entries = []
        for n in self.names:
            self.trees[n] = MerkleTree.of_rows(self.host[n])
            self.entries.append((n, shapes[n], self.trees[n].root))
        self.root = combine_roots(self.entries)
        return self.root


@dataclass
class _Pending:
    """Between :meth:`UpdateStore.begin` and :meth:`UpdateStore.finish` of one step."""

    step: int
    merges: int
    before: dict[str, _Copies]
    grad: _Copies
    no_grad: list[str]


@dataclass
class _Record:
    step: int
    merges: int
    kinds: dict[str, _Copies]             # UPDATE_KINDS -> copies
    scalars: dict[str, Any]
    commit: Optional[UpdateCommit] = None
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[str] = None


class UpdateStore:
    """Commitments to, and openings of, a stage's last ``keep_steps`` inner optimizer steps.

    ``module`` / ``opt``: the stage and its AdamW (``torch.optim.AdamW``); ``on_commit(commit)``:
    called from a hashing thread when a step's commitment is ready (optional). ``spill``: a
    :class:`~iota_subnet.utils.spill.SpillDir`; given, every copy goes to disk once hashed and at
    most one step's copies are in host memory (:meth:`begin` waits for the previous step's hashing
    and spilling; bound: :func:`iota_subnet.host_plan.update_store_bytes`).
    """

    def __init__(self, module: torch.nn.Module, opt: torch.optim.Optimizer, *, keep_steps: int = 2,
                 hash_workers: int = 2, on_commit: Optional[Callable[[UpdateCommit], Any]] = None,
                 spill: Optional[SpillDir] = None):
        if keep_steps < 1:
            raise ValueError(f"keep_steps must be >= 1, got {keep_steps}")
        self.module, self.opt = module, opt
        self.keep_steps = int(keep_steps)
        self.on_commit = on_commit
        params = dict(module.named_parameters(remove_duplicate=False))
        self.names = [n for n in module.state_dict().keys() if n in params]
        self.params = [params[n] for n in self.names]
        self.shapes = {n: tuple(int(s) for s in p.shape) for n, p in zip(self.names, self.params)}
        #: the weights copies commit exactly what a weights version root covers (the whole state_dict)
        self.covers_state = self.names == list(module.state_dict().keys())
        self.pool = ThreadPoolExecutor(max_workers=max(1, int(hash_workers)), thread_name_prefix="update-audit-hash")
        self._lock = threading.Lock()
        self._records: "OrderedDict[int, _Record]" = OrderedDict()
        self._last: dict[str, _Copies] = {}         # "w", "m", "v" after the last step
        self._untaken: list[UpdateCommit] = []
        self.spill = spill
        self._inflight: Optional[_Record] = None
        self.commits = 0
        self.served = 0
        #: bytes copied from the stage's tensors (device -> host on GPU) by the last step, and in all
        self.last_copy_bytes = 0
        self.copy_bytes = 0
        #: compute-thread seconds :meth:`begin` waited for the previous step's hashing and spilling
        self.wait_s = 0.0

    # ---- compute thread ----------------------------------------------------------------------
    def _state_tensors(self, kind: str) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """The live tensors of ``kind`` ("w", "m", "v") and their identities ``(data_ptr, version)``;
        a moment AdamW has not created yet is zeros with identity ``(0, -1)`` (never reused)."""
        key = {"m": "exp_avg", "v": "exp_avg_sq"}.get(kind)
        ts, ids = [], []
        for p in self.params:
            t = p if key is None else (self.opt.state.get(p) or {}).get(key)
            if t is None:
                ts.append(torch.zeros_like(p))
                ids.append((0, -1))
            else:
                ts.append(t)
                ids.append((t.data_ptr(), int(t._version)))
        return ts, ids

    @staticmethod
    def _same(c: Optional[_Copies], ids: list[tuple[int, int]]) -> bool:
        return c is not None and c.versions == ids and (0, -1) not in ids

    def settle(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until the last step's copies are hashed (and spilled); True when they are."""
        rec = self._inflight
        return True if rec is None else rec.done.wait(timeout_s)

    def begin(self, step: int, merges: int) -> _Pending:
        """Before clipping and ``opt.step()`` (under the worker lock): copy the accumulated gradient
        and, unless unchanged since the last step, the weights and moments. With ``spill``, first
        waits until the previous step's copies are on disk (bounds the host copies to one step's)."""
        if self.spill is not None:
            t0 = time.perf_counter()
            self.settle()
            self.wait_s += time.perf_counter() - t0
        self.last_copy_bytes = 0
        before: dict[str, _Copies] = {}
        for kind in ("w", "m", "v"):
            ts, versions = self._state_tensors(kind)
            last = self._last.get(kind)
            if self._same(last, versions):
                before[kind] = last                 # unchanged since it was copied after the last step
            else:
                before[kind] = self._copies(ts, versions)
        grads, no_grad = [], []
        for n, p in zip(self.names, self.params):
            if p.grad is None:
                no_grad.append(n)
                grads.append(torch.zeros_like(p))
            else:
                grads.append(p.grad)
        return _Pending(int(step), int(merges), before, self._copies(grads, [(0, -1)] * len(grads)), no_grad)

    def _copies(self, tensors: list[torch.Tensor], versions: list[tuple[int, int]]) -> _Copies:
        c = _Copies(self.names, tensors, versions)
        self.last_copy_bytes += c.nbytes
        self.copy_bytes += c.nbytes
        return c

    def finish(self, pending: _Pending, *, lr: float, grad_norm: float, clip_coef: float, skipped: bool) -> None:
        """After ``opt.step()`` (under the worker lock): copy the state after the step and queue the
        hashing that produces the step's commitment."""
        after: dict[str, _Copies] = {}
        for kind in ("w", "m", "v"):
            ts, versions = self._state_tensors(kind)
            prev = pending.before[kind]
            if self._same(prev, versions):
                after[kind] = prev
            else:
                after[kind] = self._copies(ts, versions)
        self._last = after
        steps = [int(st["step"]) for st in (self.opt.state.get(p) for p in self.params) if st and "step" in st]
        adam_step = max(steps) if steps else 0
        kinds = {"w0": pending.before["w"], "w1": after["w"], "m0": pending.before["m"], "m1": after["m"],
                 "v0": pending.before["v"], "v1": after["v"], "g": pending.grad}
        rec = _Record(pending.step, pending.merges, kinds,
                      {"lr": float(lr), "grad_norm": float(grad_norm), "clip_coef": float(clip_coef),
                       "skipped": bool(skipped), "adam_step": adam_step, "no_grad": pending.no_grad,
                       "at": time.time()})
        gone: list[_Copies] = []
        with self._lock:
            old = self._records.pop(rec.step, None)   # a step seen again (restart): the new one counts
            if old is not None:
                gone += old.kinds.values()
            self._records[rec.step] = rec
            while len(self._records) > self.keep_steps:
                gone += self._records.popitem(last=False)[1].kinds.values()
            kept = {id(c) for r in self._records.values() for c in r.kinds.values()}
            kept.update(id(c) for c in self._last.values())
            if self.spill is not None:
                for c in {id(c): c for c in gone if id(c) not in kept}.values():
                    if c.pins:
                        c.discard_due = True        # a reader holds it (hold()): discarded on release
                    else:
                        self._discard(c)
        futures = []
        weights = {id(kinds["w0"]), id(kinds["w1"])}
        for c in dict.fromkeys(kinds.values()):      # each distinct copy once
            if c.future is None:
                c.future = self.pool.submit(c.build, self.shapes, id(c) in weights, self.spill)
            futures.append(c.future)
        self._inflight = rec
        self.pool.submit(self._seal, rec, futures)

    def _discard(self, c: _Copies) -> None:
        """Remove the spill file of a copy no kept step uses (once its hashing is over)."""
        def drop(_f: Future) -> None:
            self.spill.drop(c.spilled)
        if c.future is None:
            return
        c.future.add_done_callback(drop)

    def _seal(self, rec: _Record, futures: list[Future]) -> None:
        try:
            for f in futures:
                f.result()
            s = rec.scalars
            rec.commit = UpdateCommit(step=rec.step, merges=rec.merges, adam_step=s["adam_step"], lr=s["lr"],
                                      grad_norm=s["grad_norm"] if math.isfinite(s["grad_norm"]) else 0.0,
                                      clip_coef=s["clip_coef"], skipped=s["skipped"],
                                      roots={k: rec.kinds[k].root.hex() for k in UPDATE_KINDS},
                                      no_grad=list(s["no_grad"]), at=s["at"])
            with self._lock:
                self._untaken.append(rec.commit)
                del self._untaken[:-64]
                self.commits += 1
            if self.on_commit is not None:
                self.on_commit(rec.commit)
        except Exception as e:  # noqa: BLE001 - a failed hash job leaves this step unauditable, never crashes
            rec.error = f"{type(e).__name__}: {e}"
        finally:
            rec.done.set()

    # ---- any thread ---------------------------------------------------------------------------
    def take_commitments(self) -> list[UpdateCommit]:
        """Commitments that became ready since the last call (oldest first), for the next receipts."""
        with self._lock:
            out, self._untaken = self._untaken, []
        return out

    def commitment(self, step: int, timeout_s: float = 0.0) -> Optional[UpdateCommit]:
        """The commitment of inner step ``step`` (waiting up to ``timeout_s`` for its hashing), or None."""
        with self._lock:
            rec = self._records.get(int(step))
        if rec is None:
            return None
        rec.done.wait(timeout_s)
        return rec.commit

    def steps(self) -> list[int]:
        with self._lock:
            return list(self._records)

    def weights_root(self, step: int) -> Optional[str]:
        """Root of the weights after inner step ``step - 1`` = the weights version ``step`` (hex), if kept."""
        with self._lock:
            rec = self._records.get(int(step) - 1)
        if rec is None or rec.commit is None:
            return None
        return rec.commit.roots["w1"]

    def weights_version(self, version: tuple[int, int]) -> Optional[Future]:
        """For the hop store (call on the compute thread, under the worker's lock): a future of the
        :class:`~iota_subnet.audit.commit.WeightsCommitment` of weights version ``(step, merges)``
        when it is the kept state after inner step ``step - 1`` and the live weights have not been
        touched since that copy (same tensors, same in-place versions); else None (hash a snapshot)."""
        step, merges = int(version[0]), int(version[1])
        with self._lock:
            rec = self._records.get(step - 1)
        if not self.covers_state or rec is None or rec.merges != merges:
            return None
        c = rec.kinds["w1"]
        if c.future is None or not self._same(c, self._state_tensors("w")[1]):
            return None
        out: Future = Future()

        def done(f: Future) -> None:
            if f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(c.weights)
        c.future.add_done_callback(done)
        return out

    @contextlib.contextmanager
    def hold(self, step: int) -> Iterator[dict[str, _Copies]]:
        """Pin the copies of the state after kept inner step ``step`` (``"w"``, ``"m"``, ``"v"``) for
        the block: a later step's cleanup defers removing their spill files until the block ends.
        Raises ValueError when ``step`` is not kept."""
        with self._lock:
            rec = self._records.get(int(step))
            if rec is None:
                raise ValueError(f"inner step {step} is not kept (kept: {list(self._records)})")
            copies = {"w": rec.kinds["w1"], "m": rec.kinds["m1"], "v": rec.kinds["v1"]}
            for c in copies.values():
                c.pins += 1
        try:
            yield copies
        finally:
            with self._lock:
                for c in copies.values():
                    c.pins -= 1
                    if c.pins == 0 and c.discard_due:
                        c.discard_due = False
                        self._discard(c)

    def state_after(self, step: int, meta: dict) -> Optional[StepState]:
        """The state after inner step ``step`` as a checkpoint source (:class:`StepState`: the views
        ``save_checkpoint`` reads, over this store's copies, pinned until ``release()``), or None when
        ``step`` is not the last step committed or the live weights or moments changed since its
        copies (a merge, a state sync, a load). Call under the lock that guards the module and the
        optimizer (the worker's), where the optimizer's scalar entries and the buffers are copied."""
        with self._lock:
            rec = self._records.get(int(step))
            last = next(reversed(self._records), None)
        if rec is None or last != rec.step:
            return None
        if any(rec.kinds[k + "1"] is not self._last.get(k) for k in ("w", "m", "v")):
            return None
        if any(rec.kinds[k + "1"].versions != self._state_tensors(k)[1] for k in ("w", "m", "v")):
            return None
        layout = StateLayout.of(self.module, self.opt, self.names)
        stack = contextlib.ExitStack()
        copies = stack.enter_context(self.hold(rec.step))

        def ready(timeout_s: Optional[float]) -> bool:
            return rec.done.wait(timeout_s) and rec.commit is not None
        return StepState(rec.step, layout, meta, copies=lambda: {k: c.host for k, c in copies.items()},
                         ready=ready, release=stack.close)

    @property
    def nbytes(self) -> int:
        """Host memory bytes held (distinct copies of the kept steps and the latest state that are
        not spilled to disk)."""
        with self._lock:
            copies = {id(c): c for rec in self._records.values() for c in rec.kinds.values()}
        copies.update({id(c): c for c in self._last.values()})
        return sum(c.nbytes for c in copies.values() if not c.spilled)

    @property
    def disk_bytes(self) -> int:
        """Bytes of spill files on disk (0 without ``spill``)."""
        return 0 if self.spill is None else self.spill.disk_bytes

    def open(self, step: int, merges: int, rows: Sequence[Sequence[Any]], kinds: Sequence[str],
             wait_s: float = 5.0) -> UpdateAuditResponse:
        """The requested rows of step ``step`` with their proofs and the per-parameter roots.
        Raises ProtocolError: LATE (not kept), NOT_READY (still hashing), BAD_SHAPE / MALFORMED
        (unknown parameter, row out of range, too many rows or bytes)."""
        with self._lock:
            rec = self._records.get(int(step))
            kept = list(self._records)
        if rec is None or rec.merges != int(merges):
            raise ProtocolError(Outcome.LATE, f"inner step {step} (merges {merges}) is not in this miner's audit "
                                              f"window (kept: {kept})")
        if not rec.done.wait(wait_s):
            raise ProtocolError(Outcome.NOT_READY, f"commitment of inner step {step} is still being hashed")
        if rec.commit is None:
            raise ProtocolError(Outcome.INTERNAL, f"inner step {step} could not be committed: {rec.error}")
        kinds = list(kinds) or list(UPDATE_KINDS)
        if any(k not in UPDATE_KINDS for k in kinds) or len(set(kinds)) != len(kinds):
            raise ProtocolError(Outcome.MALFORMED, f"kinds must be distinct names from {UPDATE_KINDS}")
        if len(rows) > MAX_ROWS_PER_REQUEST:
            raise ProtocolError(Outcome.BAD_SHAPE, f"{len(rows)} rows > {MAX_ROWS_PER_REQUEST} per request; ask in parts")
        picks: list[tuple[str, int]] = []
        nbytes = 0
        for item in rows:
            try:
                name, r = str(item[0]), int(item[1])
            except (TypeError, ValueError, IndexError):
                raise ProtocolError(Outcome.MALFORMED, f"a row is [param name, row index], got {item!r}") from None
            if name not in self.shapes:
                raise ProtocolError(Outcome.BAD_SHAPE, f"no parameter {name!r} in this stage")
            n_rows = self.shapes[name][0] if len(self.shapes[name]) >= 2 else 1
            if not 0 <= r < n_rows:
                raise ProtocolError(Outcome.BAD_SHAPE, f"row {r} of {name} outside 0..{n_rows - 1}")
            picks.append((name, r))
            nbytes += len(kinds) * 4 * (rec.kinds["w1"].host[name].numel() // n_rows)
        if nbytes > MAX_OPEN_BYTES:
            raise ProtocolError(Outcome.BAD_SHAPE, f"{nbytes} bytes of rows > {MAX_OPEN_BYTES} per answer; ask in parts")
        out_rows, out_proofs = {}, {}
        for kind in kinds:
            c = rec.kinds[kind]
            for name, r in picks:
                key = opening_key(kind, name, r)
                out_rows[key] = as_rows(c.host[name])[r].float().contiguous().clone()
                out_proofs[key] = proof_tensor(c.trees[name].proof(r))
        roots = {}
        for kind in UPDATE_KINDS:                    # every entry's root (weights: columns too)
            roots[kind] = proof_tensor([r for _, _, r in rec.kinds[kind].entries])
        self.served += 1
        return UpdateAuditResponse(commit=rec.commit.to_dict(), rows=out_rows, proofs=out_proofs, roots=roots,
                                   inner_step=rec.step)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class UpdateAuditRoute:
    """``/audit/update`` handler (``UpdateAuditRequest -> UpdateAuditResponse``), mounted with
    ``server.add_route("/audit/update", UpdateAuditRoute(store, run_id, stage), UpdateAuditRequest)``;
    authorisation (validators with a permit) is the server's authorizer's job. Never waits for the
    compute thread or a merge: the opening runs on a worker thread over stored copies."""

    def __init__(self, store: UpdateStore, run_id: str, stage: int):
        self.store, self.run_id, self.stage = store, run_id, stage

    async def __call__(self, msg: UpdateAuditRequest, ctx: Any = None) -> UpdateAuditResponse:
        if msg.run_id != self.run_id or msg.stage != self.stage:
            raise ProtocolError(Outcome.FORBIDDEN, f"this miner trains run {self.run_id!r} stage {self.stage}, "
                                                   f"not {msg.run_id!r} stage {msg.stage}")
        resp = await asyncio.to_thread(self.store.open, msg.inner_step, msg.merges, msg.rows, msg.kinds)
        resp.run_id, resp.stage = self.run_id, self.stage
        return resp
