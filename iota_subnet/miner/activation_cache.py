"""Bounded cache of the autograd state a miner keeps between a micro-batch's forward and backward.

Entries expire after ``ttl_s`` seconds and the cache holds at most ``max_bytes`` (the bytes of the
cached input and output activations); the oldest entries are evicted first. Every eviction is
counted by reason so the miner can report it (health endpoint, Prometheus).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


@dataclass
class CacheEntry:
    inputs: Optional[torch.Tensor]        # stage input (requires grad), None for the head stage
    outputs: torch.Tensor                 # stage output, still attached to the autograd graph
    nbytes: int
    created: float
    meta: dict = field(default_factory=dict)


class ActivationCache:
    """micro-batch id -> CacheEntry, bounded by age (seconds) and size (bytes)."""

    def __init__(self, ttl_s: float = 120.0, max_bytes: int = 512 * 2**20, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.max_bytes, self._clock = float(ttl_s), int(max_bytes), clock
        self._d: "OrderedDict[str, CacheEntry]" = OrderedDict()
        self.bytes = 0
        self.evictions = {"ttl": 0, "bytes": 0, "replaced": 0}

    @staticmethod
    def entry_bytes(*tensors: Optional[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def put(self, key: str, inputs: Optional[torch.Tensor], outputs: torch.Tensor, **meta: Any) -> None:
        self.expire()
        if key in self._d:
            self.evictions["replaced"] += 1
            self._drop(key)
        n = self.entry_bytes(inputs, outputs)
        while self._d and self.bytes + n > self.max_bytes:
            oldest = next(iter(self._d))
            self.evictions["bytes"] += 1
            self._drop(oldest)
        self._d[key] = CacheEntry(inputs, outputs, n, self._clock(), dict(meta))
        self.bytes += n

    def pop(self, key: str) -> Optional[CacheEntry]:
        """The entry for ``key`` (removed), or None if it was never cached or has been evicted."""
        self.expire()
        e = self._d.pop(key, None)
        if e is not None:
            self.bytes -= e.nbytes
        return e

    def expire(self) -> int:
        now, n = self._clock(), 0
        while self._d:
            k, e = next(iter(self._d.items()))
            if now - e.created <= self.ttl_s:
                break
            self._drop(k)
            self.evictions["ttl"] += 1
            n += 1
        return n

    def _drop(self, key: str) -> None:
        e = self._d.pop(key)
        self.bytes -= e.nbytes

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: str) -> bool:
        return key in self._d

    def stats(self) -> dict:
        return {"entries": len(self._d), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "ttl_s": self.ttl_s, "evictions": dict(self.evictions)}
