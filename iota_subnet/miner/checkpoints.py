"""A miner's checkpoints and where its weights come from at start.

:class:`Checkpoints` writes the stage's weights and optimizer state to ``<out>/stage<k>.safetensors``
every ``checkpoint_every`` inner steps (snapshotted on the compute thread, serialised and written on
a thread of its own while training goes on) and resumes from them: its own latest checkpoint, else
(without merging) the ``/state`` of a replica of the same stage, else the run's seeded initialisation.
A merging replica without a checkpoint resumes from its merge-state file or a state sync instead
(:mod:`iota_subnet.miner.merging`).
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
from iota_subnet.protocol import ProtocolError, StateRequest, StateResponse
from iota_subnet.train.checkpoint import CheckpointError
from iota_subnet.transport import NeuronClient, TransportError


class Checkpoints:
    """Checkpoints of the stage ``view.stage`` under ``out``, one every ``every`` inner steps.
    ``resumed``: the weights came from this miner's own checkpoint at start (else its merge-state
    file, a peer, or the seed); ``last_step``: the inner step of the last checkpoint taken."""

    def __init__(self, out: Path, every: int, *, compute: ComputeThread, view: ChainView, wallet: Any):
        self.out, self.every = Path(out), every
        self.compute, self.view, self.wallet = compute, view, wallet
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
        """Snapshot ``worker``'s weights + optimizer state on the compute thread (host copies only),
        then serialise and write them on the checkpoint-writer thread while training goes on. A
        checkpoint due while the previous one is still being written is skipped (the next one is
        taken later). ``also``: run on a worker thread once the write is under way (the merge state).
        ``wait``: return only when written (shutdown)."""
        loop = asyncio.get_running_loop()
        if self._write is not None and not self._write.done():
            if not wait:
                return
            await self._write
        step = worker.inner_step
        t0 = time.monotonic()
        snap = await self.compute.run_unslowed(worker.snapshot)
        paused = time.monotonic() - t0
        self._write = loop.run_in_executor(self.pool, worker.write_snapshot, snap, self.path)
        self.last_step = step
        if also is not None:
            await loop.run_in_executor(None, also)
        if wait:
            await self._write
        logger.debug(f"checkpoint at inner step {step} -> {self.path} (compute paused {paused:.3f}s "
                     f"for the host snapshot)")

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
        async with NeuronClient(self.wallet) as client:
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
