"""Receipts to the validators: what a stage received, sent and computed for each micro-batch, in batches.

A part of :class:`~iota_subnet.miner.dataplane.plane.DataPlane`. Receipts are batched per
validator and posted every ``receipt_interval_s`` (at once for a failure, or at 256 in a batch);
before posting, the weights version each hop used is named by its root (``wroot``, ``bwroot``).
Undelivered batches are kept for the next flush (bounded).
"""
from __future__ import annotations

import asyncio
from typing import Optional

from loguru import logger

from iota_subnet.protocol import Ticket


class ReceiptBatching:
    """Receipt batching of :class:`~iota_subnet.miner.dataplane.plane.DataPlane` (see the module docstring)."""

    def _receipt(self, t: Ticket, *, status: str = "ok", fin: str = "", fout: str = "", bin: str = "",
                 bout: str = "", loss: Optional[float] = None, compute_s: float = 0.0,
                 weights: tuple[int, int] = (-1, -1), bweights: tuple[int, int] = (-1, -1), accumulated: bool = False,
                 prev: Optional[list] = None, next_: str = "", error: str = "",
                 unreachable: Optional[list[str]] = None) -> None:
        r = {"id": t.microbatch_id, "lane": t.lane, "step": t.step, "index": t.index, "attempt": t.attempt,
             "stage": self.stage, "status": status, "fin": fin, "fout": fout, "bin": bin, "bout": bout,
             "loss": loss, "compute_s": round(compute_s, 6), "ws": weights[0], "wm": weights[1],
             "bws": bweights[0], "bwm": bweights[1], "boot": round(self.boot, 3),
             "accumulated": bool(accumulated), "prev": prev[0] if prev else "", "next": next_,
             "inner_step": int(self.worker.inner_step), "t": round(self.clock(), 3), "error": error[:300],
             "unreachable": list(unreachable or [])[:8]}
        self._receipts[t.validator].append(r)
        self.counts[f"receipts_{status}"] += 1
        if status != "ok" or len(self._receipts[t.validator]) >= 256:
            self._spawn(self.flush_receipts(t.validator))

    async def _flush_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.receipt_interval_s)
            self._expire()
            await self.flush_receipts()

    async def _name_versions(self, batch: list[dict]) -> None:
        """Fill in the weights version roots (``wroot``, ``bwroot``) of receipts about to be sent
        (waiting for their hashing, off the compute thread). A version no longer kept stays ``""``."""
        if self.hops is None:
            return
        roots: dict[tuple[int, int], str] = {}
        for r in batch:
            for ks, km, field_ in (("ws", "wm", "wroot"), ("bws", "bwm", "bwroot")):
                v = (int(r[ks]), int(r[km]))
                if r.get(field_) or v[0] < 0 or r["status"] != "ok":
                    continue
                if v not in roots:
                    try:
                        roots[v] = await self.hops.root(v)
                    except Exception as e:  # noqa: BLE001 - a failed hash leaves the hop unauditable
                        logger.warning(f"stage {self.stage}: weights version {v} could not be committed: {e}")
                        roots[v] = ""
                r[field_] = roots[v]

    async def flush_receipts(self, validator: Optional[str] = None) -> None:
        for v in [validator] if validator else list(self._receipts):
            batch = self._receipts.pop(v, [])
            if not batch:
                continue
            try:
                await self._name_versions(batch)
                await self.post_receipts(v, batch)
                self.counts["receipt_batches"] += 1
            except asyncio.CancelledError:
                self._receipts[v][:0] = batch
                raise
            except Exception as e:  # noqa: BLE001 - keep them for the next flush (bounded)
                self._receipts[v][:0] = batch[-4096:]
                logger.debug(f"receipts to {v[:10]} not delivered: {type(e).__name__}: {e}")
