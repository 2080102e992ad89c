"""The optional settings of one stage's data plane (:class:`~.plane.DataPlane`) and of the miner's
data-plane node (:class:`~iota_subnet.miner.dataplane_http.DataPlaneNode`), grouped so their
constructors keep only their required collaborators explicit.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

from iota_subnet.protocol import Ticket
from iota_subnet.utils.supervise import Supervisor

from ..hop_store import HopStore
from .tracking import RowSource


@dataclass(frozen=True)
class DataPlaneTunables:
    """How a data plane paces itself (every field optional).

    ``max_in_flight``: forwards the head keeps waiting for their backward (bounds stored activations:
    about ``max_in_flight`` x the stage's activation bytes per micro-batch at the head, fewer further
    down; at least 1). ``hop_timeout_s``: seconds a hop may take over the node's default signed-HTTP
    transport (read by :class:`~iota_subnet.miner.dataplane_http.DataPlaneNode` only).
    ``receipt_interval_s``: seconds between receipt flushes. ``senders``: concurrent outbound
    transfers (at least 1). ``clock``: unix time in seconds. ``boot``: unix time this process started
    (in every receipt: a restart announces itself; None: the time the data plane is built).
    """

    max_in_flight: int = 8
    hop_timeout_s: float = 30.0
    receipt_interval_s: float = 0.5
    senders: int = 2
    clock: Callable[[], float] = time.time
    boot: Optional[float] = None


@dataclass(frozen=True)
class DataPlaneParts:
    """The optional parts of a :class:`~.plane.DataPlane` (every field optional).

    ``rows``: the head's and tail's token source. ``hops``: the audit window
    (:class:`~iota_subnet.miner.hop_store.HopStore`): every training hop is recorded there and receipts
    name the root of the weights version each used (None: no hop audits, ``wroot`` empty).
    ``supervisor``: runs the compute loop (``dataplane``), the receipt flusher (``receipts``) and the
    senders (``sender0``, ...) and restarts one that fails (the miner's own; None: one of its own).
    ``take_lane(ticket)``: awaitable that gives this replica the weights of ``ticket``'s lane before it
    trains in a lane it did not train (:mod:`.handover`; returns how, for the log); None: no handover.
    """

    rows: Optional[RowSource] = None
    hops: Optional[HopStore] = None
    supervisor: Optional[Supervisor] = None
    take_lane: Optional[Callable[[Ticket], Awaitable[str]]] = None
