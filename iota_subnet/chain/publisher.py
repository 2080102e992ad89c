"""Keeping a neuron's endpoint and commitment on chain, within the chain's rate limits.

The live chain rate-limits both: ``serve_axon`` at most once per ``serving_rate_limit`` blocks
(50 on finney), and commitments by space (each ``set_commitment`` uses at least 100 of the 3100
bytes a hotkey may commit per epoch). A neuron that publishes both on every start crashes when it
is restarted inside the limit, and its supervisor restarts it into the same wall.

:class:`ChainPublisher` holds what the neuron *wants* published and writes only what differs from
what the chain holds (a restart with the same endpoint and commitment writes nothing). A
rate-limited write is not an error: it is retried after the chain's stated wait, or with an
exponential backoff (``min_backoff_s`` doubling up to ``max_backoff_s``), from :meth:`sync`, which
the neuron calls from its loop. Other chain errors propagate.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional

from loguru import logger

from .interface import Chain, ChainTimeout, RateLimitedError


class ChainPublisher:
    """``chain``: a :class:`Chain`; ``wallet``: the neuron's wallet; ``clock``: monotonic seconds."""

    def __init__(self, chain: Chain, wallet: Any, netuid: int, *, min_backoff_s: float = 5.0,
                 max_backoff_s: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.chain, self.wallet, self.netuid = chain, wallet, netuid
        self.hotkey: str = wallet.hotkey.ss58_address
        self.min_backoff_s, self.max_backoff_s = float(min_backoff_s), float(max_backoff_s)
        self.clock = clock
        self.want: dict[str, Optional[str]] = {"axon": None, "commitment": None}
        self.confirmed: dict[str, Optional[str]] = {"axon": None, "commitment": None}
        self._retry_at: dict[str, float] = {"axon": 0.0, "commitment": 0.0}
        self._backoff: dict[str, float] = {"axon": 0.0, "commitment": 0.0}
        #: writes made (what -> count): a restart with nothing changed makes none
        self.writes: dict[str, int] = {"axon": 0, "commitment": 0}
        self.last_error: dict[str, str] = {}
        self._syncing = asyncio.Lock()   # one sync at a time: two would both write what is missing

    def set_axon(self, ip: str, port: int) -> None:
        self._want("axon", f"{ip}:{int(port)}")

    def set_commitment(self, text: str) -> None:
        self._want("commitment", text)

    def _want(self, what: str, value: str) -> None:
        if self.want[what] != value:
            self.want[what] = value
            self._retry_at[what] = 0.0
            self._backoff[what] = 0.0

    async def served_port(self, ip: str) -> int:
        """The port this hotkey serves on chain at ``ip`` (0: none). A neuron that listens on it again
        after a restart has nothing to re-publish, so the serving rate limit cannot hold it back."""
        served = await self.chain.axon(self.hotkey, self.netuid)
        if served:
            host, _, port = served.rpartition(":")
            if host == ip and port.isdigit():
                return int(port)
        return 0

    @property
    def pending(self) -> list[str]:
        """What is wanted but not yet confirmed on chain."""
        return [w for w, v in self.want.items() if v is not None and self.confirmed[w] != v]

    def status(self) -> dict:
        return {"pending": self.pending, "writes": dict(self.writes), "last_error": dict(self.last_error),
                "retry_in_s": {w: round(max(0.0, self._retry_at[w] - self.clock()), 1) for w in self.pending}}

    async def _on_chain(self, what: str) -> Optional[str]:
        if what == "axon":
            return await self.chain.axon(self.hotkey, self.netuid)
        rec = (await self.chain.commitment_records(self.netuid)).get(self.hotkey)
        return None if rec is None else rec.text

    async def _write(self, what: str, value: str) -> None:
        if what == "axon":
            ip, _, port = value.rpartition(":")
            await self.chain.serve(self.wallet, self.netuid, ip, int(port))
        else:
            await self.chain.publish(self.wallet, self.netuid, value)

    async def sync(self) -> bool:
        """Bring the chain in line with what is wanted, as far as the rate limits allow now.
        Returns True when nothing is pending. Raises chain errors other than rate limits and
        time-outs (a time-out is retried like a rate limit)."""
        async with self._syncing:
            return await self._sync()

    async def _sync(self) -> bool:
        for what in self.pending:
            value = self.want[what]
            if self.clock() < self._retry_at[what]:
                continue
            try:
                if await self._on_chain(what) != value:
                    await self._write(what, value)
                    self.writes[what] += 1
                    logger.info("published {} on netuid {}: {}", what, self.netuid, value)
                self.confirmed[what] = value
                self.last_error.pop(what, None)
            except (RateLimitedError, ChainTimeout) as e:
                await self._back_off(what, e)
        return not self.pending

    async def _back_off(self, what: str, error: Exception) -> None:
        wait = None
        blocks = getattr(error, "retry_after_blocks", None)
        if blocks:
            try:
                wait = blocks * await self.chain.block_time() + 1.0
            except Exception:  # noqa: BLE001 - fall back to the backoff
                wait = None
        if wait is None:
            self._backoff[what] = min(self.max_backoff_s, max(self.min_backoff_s, 2 * self._backoff[what]))
            wait = self._backoff[what]
        self._retry_at[what] = self.clock() + wait
        self.last_error[what] = str(error)
        logger.info("{} not published yet ({}); retrying in {:.0f} s", what, error, wait)
