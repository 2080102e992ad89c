"""Health probes of the control plane (:mod:`.control`): ``/health`` of the failed replicas whose
cooldown ran out (back into routing when ready), and of a lane's head for its inner step."""
from __future__ import annotations

import asyncio
from typing import Optional

from loguru import logger

from iota_subnet.protocol import Health, ProtocolError
from iota_subnet.transport import TransportError

from .control_context import ControlContext
from .routing import Replica


class HealthProbe:
    """Probes miners over ``ctx.transport``; one probe round at a time."""

    def __init__(self, ctx: ControlContext):
        self.ctx = ctx
        self._lock = asyncio.Lock()

    async def probe(self, timeout_s: float = 5.0) -> int:
        """``/health`` of every failed replica whose cooldown has run out. Returns how many came back."""
        c = self.ctx
        async with self._lock:
            due = c.router.probe_due()
            if not due:
                return 0

            async def one(r: Replica) -> bool:
                try:
                    h = await c.transport.health(r.hotkey, Health(run_id=c.opts.run_id, stage=r.stage), timeout_s)
                    if not h.ready:
                        raise ProtocolError("NOT_READY", "syncing")
                except (ProtocolError, TransportError) as e:
                    c.router.probe_failed(r, f"{type(e).__name__}: {e}")
                    c.hindrances.down(r.hotkey)
                    return False
                c.router.mark_healthy(r)
                c.hindrances.up(r.hotkey)
                logger.info("{} is healthy again", r.short())
                return True

            return sum(await asyncio.gather(*(one(r) for r in due)))

    async def wait_and_probe(self, max_wait_s: float) -> None:
        """Sleep until the next probe is due (at most ``max_wait_s`` seconds), then :meth:`probe`."""
        wait = self.ctx.router.next_probe_in()
        await asyncio.sleep(min(max_wait_s, wait if wait is not None else max_wait_s))
        await self.probe()

    async def head_step(self, lane: int) -> Optional[int]:
        """The inner step ``lane``'s head miner reports, or None (no head available, or no answer)."""
        c = self.ctx
        head = c.router.lane_member(lane, 0)
        if head is None or not c.router.is_available(head):
            return None
        try:
            h = await c.transport.health(head.hotkey, Health(run_id=c.opts.run_id, stage=0), 5.0)
            return int(h.inner_step)
        except (ProtocolError, TransportError):
            return None
