"""State sync of an emulated stage (``--emulate-gpu``) at the stage's real sizes: the DONOR side.

An emulated stage merges a small real proxy (:mod:`iota_subnet.sim.virtual_merge`: ``P_true / k``
values); a joiner syncs the proxy's ``concat(anchor, momentum)`` (float32 [2 x proxy_numel]) in chunks
of ``sync_chunk_numel / k`` values, as many messages as the real sync. The joiner's side is virtual
through the engine's :class:`~iota_subnet.sim.virtual_merge.VirtualTransport` (its downlink and
modelled decode + hash are charged ``k x`` each chunk's bytes). :class:`VirtualSnapshotDonor` makes
the donor's side virtual too, over the public interface of
:class:`~iota_subnet.merge.sync.SnapshotDonor`:

* **uplink**: a served chunk (a :class:`~iota_subnet.protocol.StateChunk` holding ``n`` proxy values,
  ``4 n`` bytes; likewise a kept merge's chunk served for a replay, :mod:`iota_subnet.merge.replay`)
  charges the donor's uplink shaper the ``(k - 1) x 4 n`` bytes it does not hold before the reply
  leaves (released by its bucket, without the one-way delay: the real reply's ``4 n`` bytes then
  pass the server's shaper as usual, with the delay, once per message as on the real link).
  The transfer slot (``max_concurrent``) is held while they are charged, as a real send holds it;
* **CPU** (MODELLED, as the merge's: ``bytes / host_bytes_per_s x time_scale``): the copy + encode of
  each chunk's virtual bytes before they leave, and the hashing of the whole virtual snapshot
  (``(k - 1) x 4 x total_numel`` bytes) once per snapshot, the first time it is described (the real
  donor hashes its snapshot lazily, off the event loop, the first time a joiner asks).

What stays real: the manifest (per-chunk and whole sha256 of the proxy's values, as many chunk
hashes as the real stage's manifest), the request / reply headers, the signatures and every check
the joiner makes. The joiner's final whole-snapshot hash is over the proxy (not modelled: one pass,
small against the per-chunk hashing that is).

Checked on ``tiny`` against a real sync over signed HTTP (tests/test_virtual_sync.py): bytes charged
to the donors' uplinks and the joiner's downlink within 2 % of the real sync's.
"""
from __future__ import annotations

import asyncio
import contextvars
from typing import Any, Callable, Optional

from iota_subnet.merge.sync import SnapshotDonor
from iota_subnet.protocol import StateChunk, StateChunkRequest, StateReplay, StateReplayRequest

from .virtual_merge import VirtualPayload

#: set while a :meth:`VirtualSnapshotDonor.handle` runs in this task: the donor's own re-dispatch (a
#: snapshot replaced while hashing: :meth:`SnapshotDonor.handle` calls ``self.handle`` again) must not
#: charge the reply twice
_HANDLING: contextvars.ContextVar[bool] = contextvars.ContextVar("virtual_donor_handling", default=False)


class VirtualSnapshotDonor(SnapshotDonor):
    """A :class:`~iota_subnet.merge.sync.SnapshotDonor` of a proxy snapshot whose chunks stand for
    ``payload.scale`` x their bytes (see the module docstring). ``chunk_numel``: the proxy's chunk
    (the engine's ``sync_chunk_numel``, already ``1/k`` of the run's); ``uplink``: the donor's
    :class:`~iota_subnet.transport.shaping.UplinkShaper` (None: unshaped, only the CPU is modelled).
    ``virtual_sent`` / ``charges``: virtual bytes charged and uplink charges made."""

    def __init__(self, run_id: str, stage: int, payload: VirtualPayload, chunk_numel: int = 1 << 20,
                 max_concurrent: int = 2, *, uplink: Any = None):
        super().__init__(run_id, stage, chunk_numel, max_concurrent)
        self.payload, self.uplink = payload, uplink
        self.virtual_sent = 0
        self.charges = 0
        self.hashing_modelled: dict[str, asyncio.Future] = {}     # snapshot id -> its modelled hashing

    async def manifest(self) -> dict[str, Any]:
        """The manifest (:meth:`SnapshotDonor.manifest`), after the modelled hashing of the snapshot's
        virtual bytes (once per snapshot; concurrent askers wait for the same delay)."""
        man = await super().manifest()
        sid = man["snapshot_id"]
        fut = self.hashing_modelled.get(sid)
        if fut is None:
            extra = (self.payload.scale - 1) * 4 * int(man["total_numel"])
            fut = asyncio.ensure_future(asyncio.sleep(self.payload.cpu_s(extra)))
            self.hashing_modelled = {sid: fut}          # the older snapshots' are not needed again
        await asyncio.shield(fut)
        return man

    async def handle(self, msg: StateChunkRequest, caller: str = "",
                     on_sent: Optional[list[Callable[[], Any]]] = None) -> StateChunk:
        """:meth:`SnapshotDonor.handle`, then a served chunk's virtual bytes: the modelled copy + encode,
        then the uplink (the transfer slot is held meanwhile when ``on_sent`` is given). Raises what the
        donor raises (:class:`~iota_subnet.protocol.ProtocolError`), and the uplink's ``LinkDown``."""
        if _HANDLING.get():
            return await super().handle(msg, caller, on_sent)
        token = _HANDLING.set(True)
        try:
            reply = await super().handle(msg, caller, on_sent)
        finally:
            _HANDLING.reset(token)
        await self._charge(reply)
        return reply

    async def handle_replay(self, msg: StateReplayRequest, caller: str = "",
                            on_sent: Optional[list[Callable[[], Any]]] = None) -> StateReplay:
        """:meth:`SnapshotDonor.handle_replay`, then the served chunk's virtual bytes as for a snapshot
        chunk (a kept merge's mean of the proxy stands for ``scale`` x its bytes)."""
        reply = await super().handle_replay(msg, caller, on_sent)
        await self._charge(reply)
        return reply

    async def _charge(self, reply: Any) -> None:
        extra = self.payload.extra_bytes(reply)
        if extra:
            await asyncio.sleep(self.payload.cpu_s(extra))
            if self.uplink is not None:      # the bytes only: the real reply that follows pays the delay
                await self.uplink.release(extra)
                self.charges += 1
            self.virtual_sent += extra


def make_virtual_snapshot_donor(engine: Any, run_id: str, stage: int, chunk_numel: int,
                                max_concurrent: int) -> VirtualSnapshotDonor:
    """``MinerParts.make_snapshot_donor`` of an emulated miner: a :class:`VirtualSnapshotDonor` at the
    scale of ``engine`` (a :class:`~iota_subnet.sim.virtual_merge.VirtualMergeEngine`: its ``payload``)
    charging the uplink its replies charge (``engine.uplink``). Raises ValueError for another engine."""
    payload = getattr(engine, "payload", None)
    if not isinstance(payload, VirtualPayload):
        raise ValueError("a virtual snapshot donor needs a virtual merge engine (its payload gives the scale)")
    return VirtualSnapshotDonor(run_id, stage, payload, chunk_numel, max_concurrent, uplink=engine.uplink)
