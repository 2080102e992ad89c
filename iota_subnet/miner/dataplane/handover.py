"""Taking over a lane: a replica trains a lane's micro-batches only with that lane's weights.

A part of :class:`~iota_subnet.miner.dataplane.plane.DataPlane`. The validator hands a lane to a
replica that did not train it (a spare takes the slot of a departed or barred member, a member
moves to another lane). That replica's weights are not the lane's: its own starting or merged
weights, or another lane's. Before its first training hop of the lane (a ticket that names it the
lane's own miner of its stage, see :meth:`~iota_subnet.protocol.Ticket.is_member`) it takes the
lane's weights through ``take_lane(ticket)`` (the miner's
:func:`~iota_subnet.miner.lane_handover.take_lane`: the state of the replica that trained the lane
last, else the stage's latest merged state). Meanwhile the lane's work here waits: the head keeps
the lane's tickets queued (it admits no member ticket of that lane), later stages keep the lane's
forward hops parked (acknowledged, computed once the weights are in). Nothing is refused, so no
miner is charged for the wait and no micro-batch of the lane goes through an alternate that does
not train on it. Work of other lanes (reroutes) goes on meanwhile.

A replica that never trained in any lane (:attr:`StageWorker.lane` None) takes a lane at step 0
without a sync: nothing was trained yet, its weights are the run's starting (or merged) weights.
"""
from __future__ import annotations

import asyncio
import heapq
from typing import Optional

from loguru import logger

from iota_subnet.protocol import Ticket

from .tracking import _Task


class LaneHandover:
    """The lane-handover rule of :class:`~iota_subnet.miner.dataplane.plane.DataPlane` (module docstring)."""

    take_lane = None          # set by DataPlane.__init__: async (Ticket) -> str, or None (no handover)
    _taking: Optional[asyncio.Task] = None

    def _foreign_lane(self, t: Ticket) -> bool:
        """True when ``t`` would make this replica train in a lane whose weights it does not hold."""
        if self.take_lane is None or not t.train or not t.is_member(self.stage, self.me):
            return False
        held = self.worker.lane
        return t.lane != held and (held is not None or t.step > 0)

    def _lane_ready(self, t: Ticket) -> bool:
        """True when this replica may train on ``t`` now; otherwise the lane's weights are being
        taken (started here if no handover runs) and ``t``'s work must wait."""
        if not self._foreign_lane(t):
            return True
        if self._taking is None or self._taking.done():
            self._taking = asyncio.create_task(self._take(t))
            self._tasks.add(self._taking)
            self._taking.add_done_callback(self._tasks.discard)
        return False

    def _park(self, task: _Task) -> None:
        """A forward of a lane being taken: computed once the lane's weights are in."""
        self._parked.append(task)
        self.counts["parked_for_lane"] += 1

    async def _take(self, t: Ticket) -> None:
        w = self.worker
        logger.info(f"stage {self.stage}: handed lane {t.lane} at step {t.step} (this replica last trained lane "
                    f"{w.lane}); taking the lane's weights before training in it")
        try:
            how = await self.take_lane(t)
            logger.info(f"stage {self.stage}: took lane {t.lane}'s weights ({how}); inner step {w.inner_step}")
            self.counts["lanes_taken"] += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the lane must go on: with this replica's own weights
            logger.exception(f"stage {self.stage}: taking lane {t.lane}'s weights failed ({type(e).__name__}: {e}); "
                             f"training it with this replica's own weights")
            self.counts["lane_take_failures"] += 1
            w.lane = t.lane
        finally:
            parked = list(self._parked)
            self._parked.clear()
            for task in parked:
                heapq.heappush(self._fwd, task)
            self._wake.set()
