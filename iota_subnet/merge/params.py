"""A replica's parameters as one flat float32 host vector (what the merge reduces and writes back).

:class:`ModuleParams` is the only place where values cross between the module's device and the
host: the merge engine (:mod:`.engine`) reads the pseudo-gradient's source and writes the merged
weights through it, under the stage worker's lock.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch


def flat_numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class ModuleParams:
    """Flat float32 host copy of a module's parameters (in ``module.parameters()`` order), read and
    written under ``lock`` (the stage worker's lock); ``on_write()`` runs under the lock after
    every write (the stage worker's :meth:`~iota_subnet.miner.stage_worker.StageWorker.weights_replaced`).

    The module may live on any device; values cross to and from the host one parameter at a time
    (no device-side concatenation of the whole stage)."""

    def __init__(self, module: torch.nn.Module, lock: Any = None, on_write: Optional[Callable[[], Any]] = None):
        self.module = module
        self.lock = lock or threading.RLock()
        self.numel = flat_numel(module)
        self.on_write = on_write

    def read(self) -> torch.Tensor:
        """Host float32 [P] copy of the parameters."""
        with self.lock, torch.no_grad():
            out = torch.empty(self.numel, dtype=torch.float32)
            off = 0
            for p in self.module.parameters():
                n = p.numel()
                out[off:off + n].view(p.shape).copy_(p.detach())
                off += n
            return out

    def write(self, flat: torch.Tensor, carry_from: Optional[torch.Tensor] = None) -> None:
        """Set the parameters to ``flat`` (host or device, [P]). With ``carry_from`` (the values
        read when the merge started, [P]), add the progress made since then instead:
        ``p = flat + (p - carry_from)`` (an overlapped merge keeps the steps taken meanwhile)."""
        if flat.numel() != self.numel or (carry_from is not None and carry_from.numel() != self.numel):
            raise ValueError(f"flat vector of {flat.numel()} values for {self.numel} parameters")
        with self.lock, torch.no_grad():
            off = 0
            for p in self.module.parameters():
                n = p.numel()
                src = flat[off:off + n].view(p.shape)
                if carry_from is None:
                    p.copy_(src)
                else:       # flat + (p - start): exactly flat where nothing moved
                    start = carry_from[off:off + n].view(p.shape).to(p.device, p.dtype)
                    p.copy_(src.to(p.device, p.dtype) + (p - start))
                off += n
            if self.on_write is not None:
                self.on_write()
