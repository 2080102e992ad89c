"""What a stage keeps of its micro-batches: pending forwards, queued work, the exactly-once step tracker.

Each stage accumulates the gradient of every ``(lane, step, index)`` at most once
(:class:`StepTracker`); a forward whose backward is still expected is :class:`Pending`; the
scheduler's queues hold :class:`_Task` items ordered by priority (1F1B: backward first).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from iota_subnet.protocol import Ticket


class RowSource(Protocol):
    """Token rows by sample address: ``rows(split, seed, start, n)`` -> int64 ``[n, seq_len + 1]``."""

    def __call__(self, split: str, seed: int, start: int, n: int) -> torch.Tensor: ...


@dataclass
class Pending:
    """A forward this stage did and whose backward it still expects."""

    ticket: Ticket
    path: list[str]                 # hotkeys of stages 0 .. this one
    accumulate: bool
    fwd_in: str = ""
    fwd_out: str = ""
    sent_to: str = ""
    unreachable: list[str] = field(default_factory=list)    # next-stage miners tried first, that failed
    started: float = 0.0
    compute_s: float = 0.0
    weights: tuple[int, int] = (0, 0)
    bweights: tuple[int, int] = (-1, -1)        # the backward's weights version when it differs


@dataclass(order=True)
class _Task:
    priority: tuple
    seq: int
    kind: str = field(compare=False)                  # forward | backward | step (head: see _settle_before)
    ticket: Ticket = field(compare=False)
    path: list[str] = field(compare=False)
    data: Optional[torch.Tensor] = field(compare=False, default=None)
    scales: Optional[torch.Tensor] = field(compare=False, default=None)
    in_sha: str = field(compare=False, default="")
    loss: Optional[float] = field(compare=False, default=None)
    received: float = field(compare=False, default=0.0)


class StepTracker:
    """Which indices of a lane step this stage has claimed (forward done, backward pending) and
    accumulated. Keys: ``(lane, step)``; values: ``index -> (microbatch id, attempt)`` / a set."""

    def __init__(self) -> None:
        self.claims: dict[tuple[int, int], dict[int, tuple[str, int]]] = defaultdict(dict)
        self.done: dict[tuple[int, int], set[int]] = defaultdict(set)

    def claim(self, t: Ticket) -> tuple[bool, Optional[str]]:
        """Claim ``t``'s index for accumulation. Returns (claimed, superseded micro-batch id)."""
        ls = (t.lane, t.step)
        if t.index in self.done[ls]:
            return False, None
        prev = self.claims[ls].get(t.index)
        if prev is not None and t.attempt <= prev[1]:
            return False, None
        self.claims[ls][t.index] = (t.microbatch_id, t.attempt)
        return True, prev[0] if prev is not None else None

    def release(self, t: Ticket) -> None:
        ls = (t.lane, t.step)
        if self.claims[ls].get(t.index, ("", -1))[0] == t.microbatch_id:
            del self.claims[ls][t.index]

    def complete(self, t: Ticket) -> bool:
        """The claimed index is accumulated. Returns True when the whole lane step is."""
        ls = (t.lane, t.step)
        self.claims[ls].pop(t.index, None)
        self.done[ls].add(t.index)
        return len(self.done[ls]) >= t.micro_per_step

    def busy(self, lane: int, step: int) -> bool:
        return bool(self.claims.get((lane, step))) or bool(self.done.get((lane, step)))

    def forget(self, lane: int, step: int) -> None:
        self.claims.pop((lane, step), None)
        self.done.pop((lane, step), None)
