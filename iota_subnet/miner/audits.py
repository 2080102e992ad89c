"""A miner's audit routes and the copies they answer from.

Hop audits (``/audit/trace|project|open``, :mod:`iota_subnet.miner.hop_audit_routes`) over the last
``audit_window`` weights versions and their hops (:class:`~iota_subnet.miner.hop_store.HopStore`),
and update audits (``/audit/update``, :mod:`iota_subnet.miner.update_store`) over the last
``audit_window`` inner steps; validators with a permit only. Copies of audited data go to disk once
hashed (``<out>/audit-spill``). A window of 0 turns audits off (validators then count every audit
of this miner as refused); a stage without weights (emulated) is never audited.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from iota_subnet.config import RunConfig
from iota_subnet.miner.hop_audit_routes import HopAuditRoutes
from iota_subnet.miner.hop_store import HopStore
from iota_subnet.protocol import UpdateAuditRequest
from iota_subnet.transport import NeuronServer
from iota_subnet.utils.spill import SpillDir


class MinerAudits:
    """The audit part of the miner of run ``run_id`` writing under ``out``; ``window``: the audit
    window (0: off); ``parts``: the :class:`~iota_subnet.miner.parts.MinerParts` that make the routes."""

    def __init__(self, cfg: RunConfig, out: Path, window: int, *, run_id: str, parts: Any):
        self.cfg, self.out, self.window, self.run_id, self.parts = cfg, Path(out), int(window), run_id, parts
        self.spill: Optional[SpillDir] = None       # audit copies on disk (:meth:`spill_dir`)
        self.hops: Optional[HopStore] = None
        self.hop_routes: Optional[HopAuditRoutes] = None

    def spill_dir(self) -> Optional[SpillDir]:
        """Where audit copies go once hashed (``<out>/audit-spill``; None when audits are off)."""
        if self.window <= 0:
            return None
        if self.spill is None:
            self.spill = SpillDir(self.out / "audit-spill")
        return self.spill

    def mount(self, server: NeuronServer, worker: Any, stage: int) -> None:
        """Build the hop store and mount the audit routes of ``worker`` (stage ``stage``) on ``server``
        (nothing when audits are off or the worker holds no weights)."""
        if not worker.has_weights or self.window <= 0:
            return
        self.hops = HopStore(self.window, shared=worker.updates.weights_version
                             if worker.updates is not None else None, spill=self.spill_dir())
        self.hop_routes = self.parts.make_hop_audit_routes(self.hops, self.cfg, run_id=self.run_id, stage=stage,
                                                           device=worker.device)
        update_route = (self.parts.make_update_audit_route(worker.updates, self.run_id, stage)
                        if worker.updates is not None else None)
        self.hop_routes.mount(server)
        if update_route is not None:
            server.add_route("/audit/update", update_route, UpdateAuditRequest, None)

    def status(self) -> Optional[dict]:
        """``status.json``'s ``audits``: the window's versions, the hop-audit sessions and the bytes
        the window holds (None when audits are off)."""
        if self.hops is None:
            return None
        return {"window": self.hops.status(), "hop_sessions": self.hop_routes.status(),
                "window_bytes": self.hops.nbytes}

    def close(self) -> None:
        if self.hops is not None:
            self.hops.close()
