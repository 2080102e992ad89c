"""MODELLED costs of an emulated stage's update store and checkpoint writes (``--emulate-gpu``): EMULATION.

An :class:`~iota_subnet.sim.emulated.EmulatedStageWorker` holds no weights, so it cannot copy, hash or
write the bytes a real miner's :class:`~iota_subnet.miner.update_store.UpdateStore` and
:class:`~iota_subnet.miner.checkpoints.Checkpoints` handle. These classes hold **virtual payloads**:
byte counts of the emulated stage's real sizes (its ``P`` parameters of the real shapes, from the
``meta`` module) and the time moving them would take at stated rates. Nothing here is allocated,
hashed or written: every ``*_bytes`` figure is MODELLED, not held. All times are **emulated
seconds** (the worker multiplies by its time scale before sleeping); all sizes are bytes.

Rates (:mod:`iota_subnet.host_plan`, the ones ``scripts/bench_costs.py`` uses): device -> host
:data:`~iota_subnet.host_plan.PCIE_D2H_BYTES_PER_S` (25 GB/s), disk
:data:`~iota_subnet.host_plan.DISK_WRITE_BYTES_PER_S` (2 GB/s sustained), sha256
:data:`~iota_subnet.host_plan.SHA256_BYTES_PER_S` (1.5 GB/s per core).

**Update store** (:class:`UpdateStoreModel`; on when the miner's ``--audit-window`` K > 0, as the real
store). What the real store does per inner step (see :mod:`iota_subnet.miner.update_store`):

* ``begin`` waits (compute thread) until the previous step's copies are hashed and spilled
  (``UpdateStore.settle``): modelled as the time left on the previous step's background work;
* it copies the gradient (and the state before the step when it is not the last step's state) and,
  after the optimizer step, the state after it: ``16 P`` bytes (``20 P`` after a weights replacement,
  ``28 P`` at the first step; :func:`~iota_subnet.host_plan.update_store_bytes`). The real copies are
  ``non_blocking`` into pinned memory but issued on the compute stream itself (no side stream), so
  the stream runs them between the step's kernels: NOT overlapped with compute. Modelled: the full
  ``bytes / PCIe`` on the compute thread;
* in the background (``hash_workers`` = 2 threads, overlapped with the next step's compute): Merkle
  trees of every copy (weights copies twice: rows and columns) at sha256 per core x workers, then the
  copies to disk (spill) at the disk rate.

A step jumped over (``skip_to``) is committed as the real worker does (the zero gradient, ``4 P``, and
the state when it is not the last step's copy: ``16 P`` at the first step, ``8 P`` after a weights
replacement).

Host bytes held: the step's copies until spilled, plus the trees of every kept copy
(:data:`~iota_subnet.host_plan.TREE_BYTES_PER_ROW` per committed row or column); with K steps kept
and the weights just replaced this is the plan's :attr:`~iota_subnet.host_plan.HostPlan.update_store_bytes`.
Disk: ``(16 n + 12) P`` for the ``n`` <= K steps kept.

**Checkpoints** (:class:`CheckpointModel`): the real file holds the weights and both AdamW moments
(``12 P``, fp32) plus the buffers and AdamW's ``step`` counts (4 bytes per parameter tensor); the merge
state (``8 P``: anchor and momentum; ``bench_costs.py``'s ``24 P`` counts both files) is written by
merging and is not modelled here. On the compute thread the real miner takes, with the update store
on, the store's copies (no bytes moved: modelled 0 s), else a host snapshot (``12 P`` device -> host:
modelled at the PCIe rate); on its writer thread it waits for the store's copies to be sealed
(modelled: the time left on the background work), hashes the file (sha256, one core) and writes it
(disk rate): modelled as a sleep on that thread. Not modelled: disk contention between the spill and
the checkpoint, pinned-memory allocation, page-cache effects.
"""
from __future__ import annotations

from dataclasses import dataclass

from iota_subnet.host_plan import (DISK_WRITE_BYTES_PER_S, PCIE_D2H_BYTES_PER_S, SHA256_BYTES_PER_S,
                                   TREE_BYTES_PER_ROW, committed_rows, update_store_bytes)

#: Hashing threads of the real update store (:class:`~iota_subnet.miner.update_store.UpdateStore` ``hash_workers``).
STORE_HASH_WORKERS = 2


@dataclass(frozen=True)
class IoRates:
    """Rates of the modelled copies, in bytes per second (defaults: :mod:`iota_subnet.host_plan`'s)."""

    pcie_bytes_per_s: float = PCIE_D2H_BYTES_PER_S
    disk_bytes_per_s: float = DISK_WRITE_BYTES_PER_S
    sha256_bytes_per_s: float = SHA256_BYTES_PER_S

    def __post_init__(self):
        for k in ("pcie_bytes_per_s", "disk_bytes_per_s", "sha256_bytes_per_s"):
            if not getattr(self, k) > 0:
                raise ValueError(f"{k} must be > 0, got {getattr(self, k)!r}")

    def to_json(self) -> dict:
        return {"pcie_bytes_per_s": self.pcie_bytes_per_s, "disk_bytes_per_s": self.disk_bytes_per_s,
                "sha256_bytes_per_s": self.sha256_bytes_per_s}


class UpdateStoreModel:
    """The MODELLED update store of a stage of ``params`` (P) parameters of ``shapes``, keeping
    ``keep_steps`` (K >= 1) inner steps (see the module docstring). Call :meth:`settle` then
    :meth:`copy` before the optimizer step and :meth:`finish` after it, with ``now`` in emulated
    seconds; each returns the emulated seconds the compute thread spends. Raises ValueError for
    K < 1."""

    def __init__(self, params: int, shapes: list[tuple[int, ...]], keep_steps: int, rates: IoRates = IoRates()):
        if keep_steps < 1:
            raise ValueError(f"keep_steps must be >= 1, got {keep_steps}")
        self.P, self.K, self.rates = int(params), int(keep_steps), rates
        self.rows, self.cols = committed_rows(shapes)
        self.steps = 0
        #: bytes "copied" device -> host: by the last step and in all
        self.last_d2h_bytes = 0
        self.d2h_bytes = 0
        #: emulated seconds on the compute thread: device -> host copies, waits for the previous step's hashing/spill
        self.d2h_s = 0.0
        self.wait_s = 0.0
        #: the last step's copies + trees of every kept copy (bytes held until its copies are spilled), and the max
        self.last_host_bytes = 0
        self.max_host_bytes = 0
        self._pending_bytes = 0              # copies of the step between copy() and finish()
        self._weights_copies = 0
        #: emulated time at which the last step's copies are hashed and on disk (background work done)
        self.sealed_at = 0.0
        #: emulated seconds of background work (hashing + spill) per step, the last one's
        self.last_background_s = 0.0

    @property
    def plan_host_bytes(self) -> int:
        """The host plan's bound (:attr:`~iota_subnet.host_plan.HostPlan.update_store_bytes`):
        ``20 P`` (the copies after a weights replacement) + the trees of K kept steps."""
        return update_store_bytes(self.P, self.K)["host_replaced"] + self.trees_bytes(self.K)

    def trees_bytes(self, kept: int) -> int:
        """Merkle trees of ``kept`` steps' distinct copies (as :func:`~iota_subnet.host_plan.host_plan`)."""
        copies = 3 * (kept + 1) + kept
        return TREE_BYTES_PER_ROW * (copies * self.rows + 2 * (kept + 1) * self.cols)

    def settle(self, now: float) -> float:
        """Emulated seconds ``begin`` waits for the previous step's copies to be hashed and spilled."""
        wait = max(0.0, self.sealed_at - now)
        self.wait_s += wait
        return wait

    def copy(self, replaced: bool, skipped: bool = False) -> float:
        """Count one step's copies (``replaced``: the weights were replaced since the last step;
        ``skipped``: the commitment of a step jumped over, ``StageWorker.skip_to``: the zero gradient,
        and the state once when it is not the last step's, ``16 P`` / ``8 P`` / ``4 P``); returns the
        emulated seconds of the device -> host copy (on the compute stream)."""
        b = update_store_bytes(self.P, self.K)
        first = self.steps == 0
        if skipped:
            nbytes = 4 * self.P + (12 * self.P if first else (4 * self.P if replaced else 0))
            self._weights_copies = 1 if (first or replaced) else 0
        else:
            nbytes = b["host_first"] if first else (b["host_replaced"] if replaced else b["host"])
            self._weights_copies = 2 if (first or replaced) else 1
        self._pending_bytes = nbytes
        self.last_d2h_bytes = nbytes
        self.d2h_bytes += nbytes
        s = nbytes / self.rates.pcie_bytes_per_s
        self.d2h_s += s
        return s

    def finish(self, now: float) -> None:
        """The optimizer step is over at emulated time ``now``: the copies are hashed, then spilled, in
        the background (sets :attr:`sealed_at`)."""
        self.steps += 1
        hashed = self._pending_bytes + 4 * self.P * self._weights_copies       # weights: rows and columns
        r = self.rates
        self.last_background_s = (hashed / (r.sha256_bytes_per_s * STORE_HASH_WORKERS)
                                  + self._pending_bytes / r.disk_bytes_per_s)
        self.sealed_at = now + self.last_background_s
        self.last_host_bytes = self._pending_bytes + self.trees_bytes(min(self.steps, self.K))
        self.max_host_bytes = max(self.max_host_bytes, self.last_host_bytes)
        self._pending_bytes = 0

    def host_bytes(self, now: float) -> int:
        """Host bytes held at emulated time ``now``: the last step's copies until spilled, plus trees."""
        trees = self.trees_bytes(min(self.steps, self.K)) if self.steps else 0
        return trees + (self.last_host_bytes - trees if now < self.sealed_at else 0)

    @property
    def disk_bytes(self) -> int:
        """Spilled copies of the kept steps: ``(16 n + 12) P`` for n kept steps (0 before the first)."""
        n = min(self.steps, self.K)
        return (16 * n + 12) * self.P if n else 0

    def status(self, now: float) -> dict:
        return {"modelled": True, "keep_steps": self.K, "params": self.P, "steps": self.steps,
                "d2h_bytes": self.d2h_bytes, "last_d2h_bytes": self.last_d2h_bytes,
                "d2h_s": round(self.d2h_s, 6), "settle_wait_s": round(self.wait_s, 6),
                "background_s_last": round(self.last_background_s, 6),
                "host_bytes": self.host_bytes(now), "last_step_host_bytes": self.last_host_bytes,
                "max_host_bytes": self.max_host_bytes, "disk_bytes": self.disk_bytes}


class CheckpointModel:
    """The MODELLED checkpoints of a stage of ``params`` (P) parameters in ``n_tensors`` parameter
    tensors with ``buffer_bytes`` of buffers (see the module docstring). ``from_store``: the update
    store is on (the snapshot takes its copies: nothing moved on the compute thread)."""

    def __init__(self, params: int, n_tensors: int, buffer_bytes: int, *, from_store: bool,
                 rates: IoRates = IoRates()):
        self.P, self.from_store, self.rates = int(params), bool(from_store), rates
        #: snapshots taken from the update store's copies (the rest: host snapshots)
        self.from_store_snapshots = 0
        #: bytes of one checkpoint file: weights + exp_avg + exp_avg_sq (fp32), buffers, AdamW step counts
        self.file_bytes = 12 * self.P + int(buffer_bytes) + 4 * int(n_tensors)
        self.snapshots = 0
        self.snapshot_bytes = 0
        self.snapshot_s = 0.0
        self.writes = 0
        self.write_bytes = 0
        self.write_s = 0.0
        self.seal_wait_s = 0.0

    def snapshot(self, held: bool) -> float:
        """One snapshot on the compute thread; returns its emulated seconds: 0 when ``held`` (the update
        store holds copies of the current state: ``UpdateStore.state_after``), else ``12 P`` device -> host
        (a host snapshot: no store, no step yet, or the weights replaced since the last step)."""
        held = held and self.from_store
        self.from_store_snapshots += int(held)
        nbytes = 0 if held else 12 * self.P
        s = nbytes / self.rates.pcie_bytes_per_s
        self.snapshots += 1
        self.snapshot_bytes += nbytes
        self.snapshot_s += s
        return s

    def write(self, seal_wait: float = 0.0) -> float:
        """One file written on the checkpoint-writer thread after waiting ``seal_wait`` emulated seconds
        for the store's copies; returns the emulated seconds in all (wait + sha256 + disk write)."""
        r = self.rates
        s = self.file_bytes / r.sha256_bytes_per_s + self.file_bytes / r.disk_bytes_per_s
        self.writes += 1
        self.write_bytes += self.file_bytes
        self.write_s += s
        self.seal_wait_s += seal_wait
        return seal_wait + s

    def status(self) -> dict:
        return {"modelled": True, "file_bytes": self.file_bytes, "update_store_on": self.from_store,
                "snapshots": self.snapshots, "snapshots_from_update_store": self.from_store_snapshots, "snapshot_bytes": self.snapshot_bytes,
                "snapshot_s": round(self.snapshot_s, 6), "writes": self.writes, "write_bytes": self.write_bytes,
                "write_s": round(self.write_s, 6), "seal_wait_s": round(self.seal_wait_s, 6)}


class ModelledIo:
    """What an emulated stage models beside compute: its :class:`UpdateStoreModel` (None when
    ``audit_window`` is 0, as a real miner has no store then) and its :class:`CheckpointModel`, for the
    ``meta`` ``module`` of ``params`` parameters. Times in emulated seconds (see the module docstring)."""

    def __init__(self, module, params: int, audit_window: int, rates: IoRates = IoRates()):
        shapes = [tuple(int(d) for d in p.shape) for p in module.parameters()]
        buffers = sum(b.numel() * b.element_size() for b in module.buffers())
        self.rates = rates
        self.store = UpdateStoreModel(params, shapes, audit_window, rates) if audit_window > 0 else None
        self.checkpoints = CheckpointModel(params, len(shapes), buffers, from_store=self.store is not None,
                                           rates=rates)

    def before_step(self, now: float, replaced: bool, skipped: bool = False) -> float:
        """Emulated seconds on the compute thread before the optimizer step (``skipped``: the commitment
        of a step jumped over): the wait for the previous step's background work, then the step's
        device -> host copies (0 without a store)."""
        if self.store is None:
            return 0.0
        wait = self.store.settle(now)
        return wait + self.store.copy(replaced, skipped)

    def after_step(self, now: float) -> None:
        """The optimizer step ended at emulated time ``now``: the store's background work starts."""
        if self.store is not None:
            self.store.finish(now)

    def holds_state(self, replaced: bool) -> bool:
        """The store holds copies of the current state (a step was taken and the weights were not
        replaced since): a checkpoint is taken from them."""
        return self.store is not None and self.store.steps > 0 and not replaced

    def seal_wait(self, now: float, held: bool) -> float:
        """Emulated seconds a checkpoint writer waits for the store's copies (0 for a host snapshot)."""
        return max(0.0, self.store.sealed_at - now) if (held and self.store is not None) else 0.0

    def status(self, now: float) -> dict:
        out = {"note": "MODELLED (virtual payloads): byte counts of the emulated stage's real sizes and the "
                       "time moving them takes at the stated rates; nothing is held, hashed or written",
               "rates": self.rates.to_json(), "checkpoints": self.checkpoints.status()}
        if self.store is not None:
            out["update_store"] = {**self.store.status(now), "plan_host_bytes": self.store.plan_host_bytes}
        return out
