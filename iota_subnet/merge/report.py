"""The outcome of one merge epoch on one replica (what the engine returns and the miner reports)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MergeReport:
    """Outcome of one merge epoch on one replica. ``status``: ``merged`` | ``alone`` (no peer ready,
    or no participant did any work) | ``late`` (a peer merged this epoch already: pull its weights) |
    ``abandoned``. Bytes are encoded message bodies this replica sent / received for the merge (as
    client and as server). ``weights``: each participant's weight in the mean (merge weight x work)."""

    epoch: int
    status: str = "abandoned"
    attempts: int = 0
    participants: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    mismatches: list[dict] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    wall_s: float = 0.0
    reason: str = ""
    weights_sha256: str = ""
    weights: dict[str, float] = field(default_factory=dict)
    work: float = 0.0

    @property
    def applied(self) -> bool:
        return self.status == "merged"
