"""Lane steps: what the control plane reports per micro-batch and lane step, and which rows and
steps a validator drives.

Data addressing
    Lane ``r``, lane step ``k``, micro-batch ``m`` reads ``micro_batch_size`` rows of seed
    ``train.seed`` starting at ``((k * n_lanes + r) * batch_size + m * micro_batch_size)``; with one
    lane this is exactly the co-located trainer's addressing.

Several validators
    ``V`` validators (those with a validator permit, ordered by hotkey; this one has index ``v``)
    split every lane's steps: validator ``v`` drives the lane steps ``k`` with ``k % V == v``. They
    address the same rows for the same ``(lane, k)``, so the union of their work is one consistent
    stream per lane.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class MicrobatchResult:
    """One micro-batch of a lane step as the validator saw it (a row of the state's micro-batch log).
    ``tokens``: rows x sequence length; ``loss``: the tail's (nats/token); ``phase``: where it ended;
    ``pathway``: per stage ``{stage, uid, hotkey}``; ``failures``: ``{error, ...}`` per failure;
    ``latency_s``: seconds from issue to the last receipt; ``head_step``: the head miner's inner step
    in its receipt."""

    lane: int
    step: int
    idx: int
    microbatch_id: str
    train: bool
    tokens: int
    ok: bool = False
    loss: Optional[float] = None
    phase: str = "forward"
    pathway: list[dict] = field(default_factory=list)
    reroutes: int = 0
    failures: list[dict] = field(default_factory=list)
    latency_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    attempts: int = 1
    head_step: Optional[int] = None

    def row(self) -> dict:
        return asdict(self)


@dataclass
class LaneStepResult:
    """All micro-batches of one lane step; ``elapsed_s``: wall seconds the step took."""

    lane: int
    step: int
    microbatches: list[MicrobatchResult]
    elapsed_s: float

    @property
    def ok_count(self) -> int:
        return sum(1 for m in self.microbatches if m.ok)

    @property
    def tokens(self) -> int:
        return sum(m.tokens for m in self.microbatches if m.ok)

    @property
    def loss(self) -> Optional[float]:
        ls = [m.loss for m in self.microbatches if m.ok and m.loss is not None]
        return sum(ls) / len(ls) if ls else None

    @property
    def reroutes(self) -> int:
        return sum(m.reroutes for m in self.microbatches)

    @property
    def failures(self) -> int:
        return sum(len(m.failures) for m in self.microbatches)


def sample_start(lane: int, step: int, m: int, n_lanes: int, batch_size: int, micro_batch_size: int) -> int:
    """First row of micro-batch ``m`` of lane step ``step`` of lane ``lane`` (see the module docstring)."""
    return (step * n_lanes + lane) * batch_size + m * micro_batch_size


#: ``total`` lane steps of an open-ended run (``train.total_steps: null``): never reached.
OPEN_ENDED_STEPS = 1 << 62


def steps_of(validator_index: int, n_validators: int, start: int, total: int) -> range:
    """The lane steps in ``[start, total)`` this validator drives (``k % V == v``), as a range
    (``total`` may be :data:`OPEN_ENDED_STEPS`)."""
    v, V = int(validator_index), max(1, int(n_validators))
    start = max(0, int(start))
    first = start + (v % V - start % V) % V
    return range(first, max(first, int(total)), V)
