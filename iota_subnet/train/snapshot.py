"""Checkpoint snapshots: a host copy of a stage's weights and optimizer state, taken quickly on the
compute thread and written to disk on another.

Saving a checkpoint from the live module stops training for the whole serialisation and disk write
(an ``8b`` head stage holds ~22 GB of weights and AdamW state). A :class:`StateSnapshot` only copies
the tensors to host memory (on CUDA: pinned buffers, ``non_blocking`` copies, one synchronisation;
at ~20 GB/s that is about a second for 22 GB), after which training goes on while
:func:`iota_subnet.train.checkpoint.save_checkpoint` serialises and writes the snapshot, which
offers the same ``state_dict()`` / ``named_parameters()`` / ``state`` views a module and an
optimizer do.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

import torch


class HostModule:
    """What ``save_checkpoint`` reads of a module: ``state_dict()`` and ``named_parameters()`` (host tensors)."""

    def __init__(self, state: dict[str, torch.Tensor], params: dict[str, torch.Tensor]):
        self._state, self._params = state, params

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._state)

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._params.items())


class HostOptimizer:
    """What ``save_checkpoint`` reads of an optimizer: ``state`` (host parameter -> {key: host tensor})."""

    def __init__(self, state: dict[torch.Tensor, dict[str, Any]]):
        self.state = state


class StateSnapshot:
    """Host copies of ``module``'s state dict and ``optimizer``'s state, plus ``meta``.

    ``module`` / ``optimizer`` attributes are what ``save_checkpoint(path, snap.module, snap.optimizer,
    snap.meta)`` takes. Tied weights stay tied (one host tensor under both names). ``nbytes``: host
    bytes held."""

    def __init__(self, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], meta: dict):
        live = [t for t in module.state_dict(keep_vars=True).values()]
        if optimizer is not None:
            live += [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        cuda = any(t.is_cuda for t in live) and torch.cuda.is_available()
        copies: dict[int, torch.Tensor] = {}

        def host(t: torch.Tensor) -> torch.Tensor:
            key = id(t)
            if key not in copies:
                t = t.detach()
                if t.device.type == "cpu":
                    copies[key] = t.clone()
                else:
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
                    copies[key] = buf.copy_(t, non_blocking=cuda)
            return copies[key]
        state = {name: host(t) for name, t in module.state_dict(keep_vars=True).items()}
        params = {name: host(p) for name, p in module.named_parameters()}
        opt_state: dict[torch.Tensor, dict[str, Any]] = {}
        if optimizer is not None:
            for p, st in optimizer.state.items():
                opt_state[host(p)] = {k: host(v) if torch.is_tensor(v) else v for k, v in st.items()}
        if cuda:
            torch.cuda.synchronize()
        self.module = HostModule(state, params)
        self.optimizer = HostOptimizer(opt_state) if optimizer is not None else None
        self.meta = dict(meta)
        self.nbytes = sum(t.numel() * t.element_size() for t in copies.values())
