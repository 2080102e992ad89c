"""What a miner publishes on chain (a commitment) so validators can route to it.

JSON: ``{"v": 1, "run": <run id>, "stage": <stage index>}``; at most a few dozen bytes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

COMMITMENT_VERSION = 1


@dataclass(frozen=True)
class StageCommitment:
    run: str
    stage: int

    def encode(self) -> str:
        return json.dumps({"v": COMMITMENT_VERSION, "run": self.run, "stage": int(self.stage)}, separators=(",", ":"))

    @staticmethod
    def decode(raw: Optional[str]) -> Optional["StageCommitment"]:
        """The commitment, or None when it is absent or not ours (never raises on bad input)."""
        if not raw:
            return None
        try:
            d = json.loads(raw)
            stage = d.get("stage")
            if d.get("v") != COMMITMENT_VERSION or isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
                return None
            return StageCommitment(str(d.get("run", "")), int(d["stage"]))
        except (ValueError, TypeError, AttributeError):
            return None
