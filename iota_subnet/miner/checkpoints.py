"""A miner's checkpoints and where its weights come from at start.

:class:`Checkpoints` writes the stage's weights and optimizer state to ``<out>/stage<k>.safetensors``
every ``checkpoint_every`` inner steps (snapshotted on the compute thread, serialised and written on
a thread of its own while training goes on) and resumes from them: its own latest checkpoint, else
(without merging) the ``/state`` of a replica of the same stage, else the run's seeded initialisation.
A merging replica without a checkpoint resumes from its merge-state file or a state sync instead
(:mod:`iota_subnet.miner.merging`).

Host memory: with the update store on (update audits), a checkpoint is written from the store's
copies of the state after the last inner step (:meth:`UpdateStore.state_after
<iota_subnet.miner.update_store.UpdateStore.state_after>`: on disk once spilled, pinned while they are
read), so it copies only the buffers and AdamW's ``step`` counts, not ``12 P`` bytes of weights and
moments. The writer waits up to :data:`SEAL_TIMEOUT_S` for those copies to be sealed (hashed and on
disk); it falls back to a :class:`~iota_subnet.train.snapshot.StateSnapshot` when they are not sealed
in time, or when the store holds no copies of the current state (the weights were replaced by a merge
or a state sync since the last step; the store is off), and logs which it wrote from.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

from loguru import logger

from iota_subnet.miner.chain_view import ChainView
from iota_subnet.miner.compute_thread import ComputeThread
from iota_subnet.miner.step_state import StepState
from iota_subnet.miner.update_store import UpdateStore
from iota_subnet.protocol import ProtocolError, StateRequest, StateResponse
from iota_subnet.train.checkpoint import CheckpointError
from iota_subnet.transport import NeuronClient, TransportError

#: Seconds the checkpoint writer waits for the update store's copies of a step to be sealed before it
#: takes a snapshot instead (hashing one step's copies takes about one inner step).
SEAL_TIMEOUT_S = 300.0

class Checkpoints:
    """Checkpoints of the stage ``view.stage`` under ``out``, one every ``every`` inner steps.
    ``resumed``: the weights came from this miner's own checkpoint at start (else its merge-state
    file, a peer, or the seed); ``last_step``: the inner step of the last checkpoint taken.
    ``updates``: returns the stage's update store, or None (not built yet, or audits off): checkpoints
    are written from its copies when it has those of the current state (see the module docstring);
    ``last_source``: ``"update store"`` or ``"snapshot"``, what the last checkpoint was written from."""

    def __init__(self, out: Path, every: int, *, compute: ComputeThread, view: ChainView, wallet: Any,
                 updates: Optional[Callable[[], Optional[UpdateStore]]] = None):
        self.out, self.every = Path(out), every
        self.compute, self.view, self.wallet = compute, view, wallet
        self.updates = updates if updates is not None else (lambda: None)
        self.seal_timeout_s = SEAL_TIMEOUT_S
        self.last_source = ""
        #: checkpoints are serialised and written here, off the compute thread (see save())
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._write: Optional[asyncio.Future] = None
        self.last_step = 0
        self.resumed = False

    @property
    def path(self) -> Path:
        """``<out>/stage<k>.safetensors``."""
        return self.out / f"stage{self.view.stage}.safetensors"

    def due(self, worker: Any) -> bool:
        """``every`` inner steps or more since the last checkpoint."""
        return worker.inner_step - self.last_step >= self.every

    async def save(self, worker: Any, wait: bool = False, also: Optional[Callable[[], None]] = None) -> None:
        """Take ``worker``'s weights + optimizer state on the compute thread (:meth:`take`: the update
        store's copies, else a host snapshot), then serialise and write them on the checkpoint-writer
        thread while training goes on. A checkpoint due while the previous one is still being written
        is skipped (the next one is taken later). ``also``: run on a worker thread once the write is
        under way (the merge state). ``wait``: return only when written (shutdown)."""
        loop = asyncio.get_running_loop()
        if self._write is not None and not self._write.done():
            if not wait:
                return
            await self._write
        step = worker.inner_step
        t0 = time.monotonic()
        snap = await self.compute.run_unslowed(self.take, worker)
        paused = time.monotonic() - t0
        self._write = asyncio.ensure_future(self._write_out(worker, snap))
        self.last_step = step
        if also is not None:
            await loop.run_in_executor(None, also)
        if wait:
            await self._write
        logger.debug(f"checkpoint at inner step {step} -> {self.path} (compute paused {paused:.3f}s "
                     f"for the {'update store copies' if isinstance(snap, StepState) else 'host snapshot'})")

    async def written(self) -> None:
        """Return once the checkpoint being written (if any) is on disk; raises what its write raised."""
        if self._write is not None:
            await self._write

    def take(self, worker: Any) -> Any:
        """On the compute thread: the update store's :class:`StepState` of ``worker``'s current state
        (the state after inner step ``inner_step - 1``), else ``worker.snapshot()`` (a
        :class:`~iota_subnet.train.snapshot.StateSnapshot`, ``12 P`` bytes of host copies)."""
        store = self.updates()
        if store is None or not worker.has_weights:
            return worker.snapshot()
        with worker.lock:
            held = store.state_after(worker.inner_step - 1, worker.meta())
        if held is None:
            logger.info(f"checkpoint at inner step {worker.inner_step}: the update store holds no copies of this "
                        "state (weights replaced since the last step, or no step yet); taking a host snapshot")
            return worker.snapshot()
        return held

    async def _write_out(self, worker: Any, snap: Any) -> None:
        """Write ``snap`` (a :class:`StepState` once sealed, else a snapshot taken now) to :attr:`path`."""
        loop = asyncio.get_running_loop()
        if isinstance(snap, StepState):
            try:
                if await loop.run_in_executor(self.pool, snap.wait, self.seal_timeout_s):
                    await loop.run_in_executor(self.pool, worker.write_snapshot, snap, self.path)
                    self.last_source = "update store"
                    return
            finally:
                snap.release()
            logger.warning(f"checkpoint: the update store's copies of inner step {snap.step} were not sealed "
                           f"within {self.seal_timeout_s:.0f} s; taking a host snapshot instead")
            snap = await self.compute.run_unslowed(worker.snapshot)
        await loop.run_in_executor(self.pool, worker.write_snapshot, snap, self.path)
        self.last_source = "snapshot"

    async def resume(self, worker: Any, merging: bool) -> None:
        """Load ``worker``'s latest own checkpoint, else (without ``merging``) a replica of the same
        stage's state, else leave the run's seeded initialisation. A merging replica with weights
        takes its merge-state file, else the catch-up's state sync, instead of a peer's state. The
        next checkpoint is due ``every`` inner steps after the step resumed at."""
        await self._load(worker, merging)
        self.last_step = worker.inner_step

    async def _load(self, worker: Any, merging: bool) -> None:
        try:
            if await self.compute.run_unslowed(worker.load, self.path):
                self.resumed = True
                return
        except CheckpointError as e:
            logger.warning(f"ignoring checkpoint: {e}")
        if merging and worker.has_weights:
            return
        stage = self.view.stage
        got = await self.peer_state(timeout_s=30, retries=1)
        if got is not None:
            uid, resp = got
            try:
                worker.module.load_state_dict(resp.tensors, strict=True)
                worker.inner_step = int(resp.state_meta.get("step", 0))
                logger.info(f"stage {stage}: weights synced from uid {uid} at inner step {worker.inner_step}")
                return
            except RuntimeError as e:
                logger.warning(f"state from uid {uid} does not fit this stage: {e}")
        logger.info(f"stage {stage}: no usable peer state; starting from the run's seeded initialisation")

    async def peer_state(self, timeout_s: float, retries: int) -> Optional[tuple[int, StateResponse]]:
        """(uid, /state answer) of the first replica of this stage that answers, or None."""
        v = self.view
        peers = [hk for hk, s in v.stages.items() if s == v.stage and hk != v.hotkey]
        async with NeuronClient(self.wallet, alternates=v.relays_of) as client:
            for hk in peers:
                n = v.neurons.get(hk)
                if n is None or not n.axon or n.axon.startswith("0.0.0.0:0"):
                    continue
                try:
                    resp = await client.call(n.axon, hk, "/state", StateRequest(run_id=v.run_id, stage=v.stage),
                                             StateResponse, timeout_s=timeout_s, retries=retries)
                    return n.uid, resp
                except (TransportError, ProtocolError) as e:
                    logger.warning(f"state from {hk[:10]} failed: {e}")
        return None

    def close(self) -> None:
        """Stop the writer thread after the writes under way (none started after)."""
        self.pool.shutdown(wait=True)
