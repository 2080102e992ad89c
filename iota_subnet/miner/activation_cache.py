"""Bounded cache of the autograd state a miner keeps between a micro-batch's forward and backward.

What an entry holds is its forward's autograd graph: every tensor autograd saved for the backward
(attention inputs, MLP activations, norms ... about 300x the stage's input and output activations
for ``tiny``), plus the input and output. So the cache is bounded by **measured** memory
(:class:`SavedTensorMeter`):

* on CUDA, the growth of ``torch.cuda.memory_allocated`` over the forward (all the forward left
  allocated: saved tensors and outputs);
* elsewhere, the bytes of the distinct storages autograd saved for the backward
  (``torch.autograd.graph.saved_tensors_hooks``), the stage's parameters excluded, together with the
  input and output storages.

Limits: ``max_bytes`` (oldest entries evicted first; a single entry above the bound is not kept),
``max_entries``, and ``ttl_s``: entries older than that are dropped by a sweeper thread every
``sweep_s`` seconds even when no new forward arrives (backwards that never come must not pin memory
until the next put). Every eviction is counted by reason so the miner can report it (health
endpoint, Prometheus).
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch


@dataclass
class CacheEntry:
    inputs: Optional[torch.Tensor]        # stage input (requires grad), None for the head stage
    outputs: torch.Tensor                 # stage output, still attached to the autograd graph
    nbytes: int                           # memory the entry keeps alive (measured, see SavedTensorMeter)
    created: float
    meta: dict = field(default_factory=dict)


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of the memory ``t`` keeps alive: its storage when it has one, else the tensor
    itself (tensor subclasses without storage)."""
    try:
        st = t.untyped_storage()
        if st.data_ptr():
            return st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        pass
    return -id(t), t.numel() * t.element_size()


@dataclass
class Measurement:
    """Bytes a forward left held (see :class:`SavedTensorMeter`); ``saved`` counts saved tensors seen;
    ``storages``: storage identity -> bytes of what was counted (saved-tensor method only)."""

    bytes: int = 0
    saved: int = 0
    method: str = ""
    storages: dict[int, int] = field(default_factory=dict)


class SavedTensorMeter:
    """Measures the memory the autograd graph of one forward of ``module`` keeps (see the module docstring).

    ``with meter.measure(inputs=..) as m: out = module(x)`` then ``meter.finish(m, out)``; ``m.bytes``."""

    def __init__(self, module: torch.nn.Module, device: str | torch.device):
        self.module = module
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()

    @contextlib.contextmanager
    def measure(self, inputs: Optional[torch.Tensor] = None) -> Iterator[Measurement]:
        m = Measurement(method="cuda_allocated" if self.cuda else "saved_tensors")
        if self.cuda:
            before = torch.cuda.memory_allocated(self.device)
            yield m
            m.bytes = max(0, torch.cuda.memory_allocated(self.device) - before)
            if inputs is not None:       # the input arrived before the forward: the entry keeps it too
                m.bytes += _storage_key(inputs)[1]
            return
        params = {_storage_key(p)[0] for p in self.module.parameters()}
        if inputs is not None:
            k, n = _storage_key(inputs)
            m.storages[k] = n

        def pack(t: torch.Tensor) -> torch.Tensor:
            m.saved += 1
            k, n = _storage_key(t)
            if k not in params:
                m.storages[k] = n
            # Not ``t`` itself: a tensor an op saves as its own output (attention, exp, rsqrt) would
            # then hold its grad_fn, which holds it through this Python reference: a cycle through
            # C++ that the garbage collector cannot see, so every forward whose backward never came
            # (evicted, dropped, superseded) leaked its whole graph (miners of a 3 x 3 localnet
            # grew to 5 GB). A detached alias shares the storage and version counter, not the graph.
            return t.detach()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield m
        m.bytes = sum(m.storages.values())

    def finish(self, m: Measurement, outputs: torch.Tensor) -> int:
        """Add the output's storage (saved-tensor method; on CUDA it is in the allocator delta
        already). Returns ``m.bytes``."""
        if m.method == "saved_tensors":
            k, n = _storage_key(outputs)
            if k not in m.storages:
                m.storages[k] = n
                m.bytes += n
        return m.bytes


class ActivationCache:
    """micro-batch id -> CacheEntry, bounded by measured bytes, entry count and age (seconds)."""

    def __init__(self, ttl_s: float = 120.0, max_bytes: int = 512 * 2**20, max_entries: int = 64,
                 clock: Callable[[], float] = time.monotonic, sweep_s: Optional[float] = None):
        self.ttl_s, self.max_bytes, self.max_entries = float(ttl_s), int(max_bytes), int(max_entries)
        self._clock = clock
        self._d: "OrderedDict[str, CacheEntry]" = OrderedDict()
        self._lock = threading.RLock()
        self.bytes = 0
        self.peak_bytes = 0
        self.evictions = {"ttl": 0, "bytes": 0, "entries": 0, "too_large": 0, "replaced": 0}
        self.sweep_s = float(sweep_s) if sweep_s is not None else max(0.05, min(self.ttl_s / 4, 5.0))
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=_sweep, args=(weakref.ref(self), self._stop, self.sweep_s),
                                         name="activation-cache-ttl", daemon=True)
        self._sweeper.start()

    @staticmethod
    def entry_bytes(*tensors: Optional[torch.Tensor]) -> int:
        """Bytes of the tensors themselves (a lower bound of what an entry holds; used when not measured)."""
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def put(self, key: str, inputs: Optional[torch.Tensor], outputs: torch.Tensor, *, nbytes: Optional[int] = None,
            **meta: Any) -> bool:
        """Keep a forward until its backward. ``nbytes``: measured memory the entry holds (default:
        its input and output bytes). Returns False when the entry alone exceeds ``max_bytes`` (not kept)."""
        n = int(nbytes) if nbytes is not None else self.entry_bytes(inputs, outputs)
        with self._lock:
            self.expire()
            if key in self._d:
                self.evictions["replaced"] += 1
                self._drop(key)
            if n > self.max_bytes:
                self.evictions["too_large"] += 1
                return False
            while self._d and (self.bytes + n > self.max_bytes or len(self._d) >= self.max_entries):
                oldest = next(iter(self._d))
                self.evictions["bytes" if self.bytes + n > self.max_bytes else "entries"] += 1
                self._drop(oldest)
            self._d[key] = CacheEntry(inputs, outputs, n, self._clock(), dict(meta))
            self.bytes += n
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            return True

    def pop(self, key: str) -> Optional[CacheEntry]:
        """The entry for ``key`` (removed), or None if it was never cached or has been evicted."""
        with self._lock:
            self.expire()
            e = self._d.pop(key, None)
            if e is not None:
                self.bytes -= e.nbytes
            return e

    def get(self, key: str) -> Optional[CacheEntry]:
        with self._lock:
            return self._d.get(key)

    def expire(self) -> int:
        """Drop entries older than ``ttl_s``; returns how many."""
        with self._lock:
            now, n = self._clock(), 0
            while self._d:
                k, e = next(iter(self._d.items()))
                if now - e.created <= self.ttl_s:
                    break
                self._drop(k)
                self.evictions["ttl"] += 1
                n += 1
            return n

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self.bytes = 0

    def close(self) -> None:
        """Stop the sweeper thread."""
        self._stop.set()

    def _drop(self, key: str) -> None:
        e = self._d.pop(key)
        self.bytes -= e.nbytes

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: str) -> bool:
        return key in self._d

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._d), "bytes": self.bytes, "peak_bytes": self.peak_bytes,
                    "max_bytes": self.max_bytes, "max_entries": self.max_entries, "ttl_s": self.ttl_s,
                    "evictions": dict(self.evictions)}


def _sweep(ref: "weakref.ref[ActivationCache]", stop: threading.Event, every_s: float) -> None:
    """Sweeper thread: expire entries every ``every_s`` seconds until the cache is closed or collected."""
    while not stop.wait(every_s):
        cache = ref()
        if cache is None:
            return
        cache.expire()
        del cache
