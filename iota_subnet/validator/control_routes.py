"""The control plane's inbound routes (:mod:`.control`): miners' receipt batches (``/receipts``) and
their evidence of hops they refused (``/refusals``, :mod:`.blame`). The same handlers are mounted on
the validator's signed HTTP server (:mod:`.endpoints`) and served in process
(:class:`~.control_transport.InProcessControlTransport`)."""
from __future__ import annotations

from typing import Any, Callable, Optional

from iota_subnet.protocol import Outcome, ProtocolError, ReceiptBatch
from iota_subnet.protocol.messages import MAX_UPDATES_PER_BATCH
from iota_subnet.protocol.refusal import MAX_REPORT_BODY_BYTES, RefusalAck, RefusalReport
from iota_subnet.transport.server import Route


def control_routes(run_id: str, driver: Callable[[], Any],
                   on_updates: Optional[Callable[[str, list], None]] = None) -> list[Route]:
    """``/receipts`` and ``/refusals`` of the validator driving ``run_id``. ``driver()``: its
    :class:`~.control.ControlPlane` now (None before it drives lanes: ``NOT_READY``);
    ``on_updates(hotkey, updates)``: the update commitments a receipt batch carries (at most
    :data:`~iota_subnet.protocol.messages.MAX_UPDATES_PER_BATCH`), for the audits. A batch of another
    run is ``FORBIDDEN``; a report while not driving this run ``NOT_READY``."""

    async def receipts(msg: ReceiptBatch, ctx):
        if msg.run_id != run_id:
            raise ProtocolError(Outcome.FORBIDDEN, f"this validator drives run {run_id!r}")
        d = driver()
        if d is None:
            raise ProtocolError(Outcome.NOT_READY, "not driving lanes yet")
        if on_updates is not None and msg.updates:
            on_updates(ctx.caller_hotkey, msg.updates[:MAX_UPDATES_PER_BATCH])
        return d.on_receipts(msg, ctx.caller_hotkey)

    async def refusals(msg: RefusalReport, ctx):
        blame = getattr(driver(), "blame", None)
        if msg.run_id != run_id or blame is None:
            raise ProtocolError(Outcome.NOT_READY, "not driving lanes of this run")
        return RefusalAck(run_id=run_id, verdict=blame.on_report(msg, ctx.caller_hotkey))

    def refused_receipts(*args):
        blame = getattr(driver(), "blame", None)
        if blame is not None:
            blame.on_refused_receipts(*args)

    return [Route("/receipts", receipts, ReceiptBatch, None, on_refused=refused_receipts),
            Route("/refusals", refusals, RefusalReport, None, max_body_bytes=MAX_REPORT_BODY_BYTES)]


__all__ = ["control_routes"]
