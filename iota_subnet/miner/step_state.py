"""A checkpoint written from the update store's copies of the state after an inner step.

The update store (:mod:`iota_subnet.miner.update_store`) copies, at every inner step, the weights,
``exp_avg`` and ``exp_avg_sq`` after the step to host memory and (spilling) to disk. A checkpoint
taken at the inner step right after it needs exactly those tensors, so instead of a fresh ``12 P``
host copy (:class:`~iota_subnet.train.snapshot.StateSnapshot`) a :class:`StepState` offers the same
``module`` / ``optimizer`` / ``meta`` views that :func:`iota_subnet.train.checkpoint.save_checkpoint`
reads, over the store's copies; it copies only what the store does not hold: the state_dict entries
that are not parameters (buffers) and the optimizer's scalar entries (AdamW's ``step``), a few bytes
per parameter tensor. The checkpoint file is the one a snapshot gives (same names, same tensors).

Lifetime: the store pins the copies (:meth:`~iota_subnet.miner.update_store.UpdateStore.hold`) until
:meth:`StepState.release`, so a later step's spill cleanup never drops them while they are read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from iota_subnet.train.snapshot import HostModule, HostOptimizer

#: optimizer state keys the update store copies ("m", "v" kinds); every other entry is copied here
MOMENT_KINDS = {"exp_avg": "m", "exp_avg_sq": "v"}


@dataclass
class StateLayout:
    """What a checkpoint of the live module and optimizer holds, by name, taken on the compute thread.

    ``state_names``: ``module.state_dict()`` keys in order; ``param_of``: state_dict key of a
    parameter -> the update store's name of its copy (tied names share one); ``buffers``: host copies
    of the other state_dict entries; ``param_names``: ``module.named_parameters()`` names in order;
    ``opt``: (parameter name, its optimizer state in key order with the moments as None and every
    other entry copied) in the optimizer's state order."""

    state_names: list[str]
    param_of: dict[str, str]
    buffers: dict[str, torch.Tensor]
    param_names: list[str]
    opt: list[tuple[str, dict[str, Any]]]

    @classmethod
    def of(cls, module: torch.nn.Module, optimizer: torch.optim.Optimizer, store_names: list[str]) -> "StateLayout":
        """The layout of ``module`` / ``optimizer``; ``store_names``: the names the store copies."""
        params = dict(module.named_parameters(remove_duplicate=False))
        canonical: dict[int, str] = {}
        for n in store_names:
            canonical.setdefault(id(params[n]), n)
        state = module.state_dict(keep_vars=True)
        param_of = {n: canonical[id(params[n])] for n in state if n in params}
        buffers = {n: t.detach().to("cpu", copy=True) for n, t in state.items() if n not in param_of}
        names = {id(p): n for n, p in module.named_parameters()}
        opt = []
        for p, st in optimizer.state.items():
            if id(p) not in names:
                continue
            opt.append((names[id(p)], {k: None if k in MOMENT_KINDS else
                                       (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v)
                                       for k, v in st.items()}))
        return cls(list(state), param_of, buffers, [n for n, _ in module.named_parameters()], opt)

    @property
    def nbytes(self) -> int:
        """Host bytes this layout copied (buffers and scalar optimizer entries)."""
        ts = list(self.buffers.values()) + [v for _, st in self.opt for v in st.values() if torch.is_tensor(v)]
        return sum(t.numel() * t.element_size() for t in ts)


class StepState:
    """The state after one inner step, as a checkpoint source: ``module`` / ``optimizer`` / ``meta``
    like :class:`~iota_subnet.train.snapshot.StateSnapshot` (``save_checkpoint(path, s.module,
    s.optimizer, s.meta)``), over the update store's copies.

    Built by :meth:`~iota_subnet.miner.update_store.UpdateStore.state_after`. ``copies()`` returns
    the host tensors of the kinds ``"w"``, ``"m"``, ``"v"`` (name -> tensor), read once ``ready``;
    ``ready(timeout_s)`` is True once the step's copies are sealed (hashed and, spilling, on disk);
    ``release()`` unpins them. Call :meth:`wait` (any thread) before reading ``module`` / ``optimizer``,
    and :meth:`release` when done. ``nbytes``: host bytes of its own (not the store's)."""

    def __init__(self, step: int, layout: StateLayout, meta: dict, *, copies: Callable[[], dict[str, dict]],
                 ready: Callable[[Optional[float]], bool], release: Callable[[], None]):
        self.step = int(step)
        self.layout = layout
        self.meta = dict(meta)
        self._copies, self._ready, self._release = copies, ready, release
        self.module: Optional[HostModule] = None
        self.optimizer: Optional[HostOptimizer] = None
        self.released = False

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        """Wait up to ``timeout_s`` seconds for the copies to be sealed, then build the views over them;
        False (views not built) when they are not sealed in time or could not be committed."""
        if self.released or not self._ready(timeout_s):
            return False
        c = self._copies()
        lay = self.layout
        params = {n: c["w"][lay.param_of[n]] for n in lay.param_names}
        state = {n: c["w"][lay.param_of[n]] if n in lay.param_of else lay.buffers[n] for n in lay.state_names}
        opt: dict[torch.Tensor, dict[str, Any]] = {}
        for name, st in lay.opt:
            opt[params[name]] = {k: c[MOMENT_KINDS[k]][lay.param_of[name]] if k in MOMENT_KINDS else v
                                 for k, v in st.items()}
        self.module = HostModule(state, params)
        self.optimizer = HostOptimizer(opt)
        return True

    def release(self) -> None:
        """Unpin the store's copies (idempotent); the views must not be read after."""
        if not self.released:
            self.released = True
            self.module = self.optimizer = None
            self._release()
