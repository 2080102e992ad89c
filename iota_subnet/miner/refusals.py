"""A hop receiver's reports of provably bad hops, so that the sender answers for them.

When this miner's ``/hop`` route refuses a signed hop for a reason its bytes prove
(:data:`~iota_subnet.protocol.refusal.PROVABLE`), the transport hands the refusal here with the
body exactly as signed; :class:`RefusalReporter` sends it, with the sender's btauth/1 headers, to
the validator that signed the hop's ticket (``/refusals``, a
:class:`~iota_subnet.protocol.refusal.RefusalReport`). The validator re-decides the fault on the
body and charges the sender; without the report the sender's validator saw only a micro-batch that
failed at this miner. One report per (sender, micro-batch, direction); at most
:data:`MAX_REPORTS_IN_FLIGHT` posted at once, the rest dropped (the sender keeps failing, and the
next refusal is reported).
"""
from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from typing import Any, Awaitable, Callable

import torch
from loguru import logger

from iota_subnet.protocol import ProtocolError
from iota_subnet.protocol.refusal import PROVABLE, RefusalAck, RefusalReport, auth_headers, hop_header

#: Reports posted concurrently at most (each carries one hop body).
MAX_REPORTS_IN_FLIGHT = 8
#: (sender, micro-batch, direction) keys remembered so that each refusal is reported once.
REMEMBER = 4096


class RefusalReporter:
    """``post(validator, report) -> RefusalAck``: delivers (and signs) a report, the data-plane
    transport's ``post_refusal`` (:mod:`iota_subnet.miner.dataplane.transport`)."""

    def __init__(self, *, run_id: str, post: Callable[[str, RefusalReport], Awaitable[RefusalAck]]):
        self.run_id, self.post = run_id, post
        self.counts: Counter[str] = Counter()
        self._seen: "OrderedDict[tuple[str, str, str], None]" = OrderedDict()
        self._tasks: set[asyncio.Task] = set()

    def on_refused(self, sender: str, headers: Any, path: str, body: bytes, err: ProtocolError) -> None:
        """Transport hook (:data:`~iota_subnet.transport.server.RefusalHook`) of the ``/hop`` route."""
        if err.outcome not in PROVABLE:
            return
        meta = hop_header(body)
        validator = meta["ticket"].get("validator") if meta is not None else None
        if not isinstance(validator, str) or not validator:
            self.counts["unreadable"] += 1
            return
        mb, direction = str(meta.get("microbatch_id", ""))[:160], str(meta.get("direction", ""))[:16]
        key = (sender, mb, direction)
        if key in self._seen:
            return
        self._seen[key] = None
        while len(self._seen) > REMEMBER:
            self._seen.popitem(last=False)
        if len(self._tasks) >= MAX_REPORTS_IN_FLIGHT:
            self.counts["dropped"] += 1
            return
        report = RefusalReport(run_id=self.run_id, microbatch_id=mb, sender=sender, auth=auth_headers(headers),
                               path=path, outcome=err.outcome.value, reason=err.message[:200],
                               body=torch.frombuffer(bytearray(body), dtype=torch.uint8))
        logger.warning(f"refused a {direction} hop of {mb} from {sender[:10]} ({err.outcome.value}): reporting "
                       f"it to validator {validator[:10]}")
        task = asyncio.get_running_loop().create_task(self._post(validator, report))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, validator: str, report: RefusalReport) -> None:
        try:
            ack = await self.post(validator, report)
            self.counts[f"verdict_{ack.verdict or 'none'}"] += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - best effort: the sender's next refusal is reported again
            self.counts["undelivered"] += 1
            logger.debug(f"refusal report to {validator[:10]} not delivered: {type(e).__name__}: {e}")

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
