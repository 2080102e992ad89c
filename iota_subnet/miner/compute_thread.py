"""The miner's one compute thread: every forward, backward, optimizer step, weights load and state
snapshot of its stage runs there, so the event loop keeps answering (health, refusals) while a
stage computes.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from iota_subnet.transport.shaping import compute_slowdown


class ComputeThread:
    """One dedicated thread (``pool``) for a stage's compute."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")

    async def run(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run ``fn(*args, **kw)`` on the compute thread and return its result. Under a chaos ``slow``
        event (``--link-control``) the thread stays busy ``factor`` times as long, as a slower
        accelerator would."""
        def run():
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            factor = compute_slowdown()
            if factor > 1.0:
                time.sleep((factor - 1.0) * (time.perf_counter() - t0))
            return out
        return await asyncio.get_running_loop().run_in_executor(self.pool, run)

    async def run_unslowed(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the compute thread, never slowed (checkpoint snapshots and loads)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def shutdown(self) -> None:
        """Stop taking work (a running compute finishes on its own)."""
        self.pool.shutdown(wait=False)
