"""Audit deadlines computed from the work an audit asks of the miner.

A fixed round timeout is either too short for a large stage (a hop trace of an ``8b`` head stage
reads ~6.5 GB of weights back from the miner's spill files and runs a forward and backward) or
far too long for a small one. Every round's deadline is::

    deadline = floor_s + flops / flops_per_s + bytes / bytes_per_s

with ``flops`` the miner's compute for the round and ``bytes`` what it reads and sends.
:class:`DeadlineRates` holds the assumed rates; defaults (documented, deliberately low so that an
honest CPU-only miner on a 100 Mbit/s link meets them): ``floor_s`` 30 s (the former constant round
timeout), ``flops_per_s`` 2e11 (fp32 on a few CPU cores), ``bytes_per_s`` 1.25e7 (100 Mbit/s; disk
reads are faster).
"""
from __future__ import annotations

from dataclasses import dataclass

from iota_subnet.config import RunConfig

#: fp32 bytes per value of the rows an update audit opens (7 kinds per row).
UPDATE_KINDS_PER_ROW = 7


@dataclass(frozen=True)
class DeadlineRates:
    """``floor_s`` seconds, ``flops_per_s`` FLOP/s and ``bytes_per_s`` bytes/s assumed of a miner."""

    floor_s: float = 30.0
    flops_per_s: float = 2e11
    bytes_per_s: float = 1.25e7

    def deadline_s(self, flops: float, nbytes: float) -> float:
        """Seconds allowed for ``flops`` FLOPs and ``nbytes`` bytes of work (>= ``floor_s``)."""
        return float(self.floor_s) + max(0.0, float(flops)) / self.flops_per_s + max(0.0, float(nbytes)) / self.bytes_per_s


def hop_round_work(cfg: RunConfig, stage: int, direction: str) -> tuple[float, float]:
    """(FLOPs, bytes) of the heaviest round of a hop audit of ``stage``: the trace of one
    micro-batch (forward; a backward audit also the backward, 2 x forward) over the stage's fp32
    weights, which the miner reads (4 bytes per parameter) from its audit copies."""
    from iota_subnet.plan import meta_stage, stage_flops

    tokens = cfg.train.micro_batch * cfg.data.seq_len
    f = stage_flops(cfg.model, cfg.pipeline, cfg.data.seq_len, stage).forward * tokens
    flops = f * (3 if direction == "backward" else 1)
    return float(flops), float(4 * meta_stage(cfg, stage).param_count())


def hop_open_work(nbytes: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one open request of a hop audit whose answer holds ``nbytes`` bytes of rows
    and proofs (:func:`~iota_subnet.audit.codec.opening_bytes`): the miner reads and sends them (its
    Merkle trees were built when it committed). A replay audit opens a stage's weights in several
    parts (:func:`~iota_subnet.audit.replay.split_openings`), each with its own deadline."""
    return 0.0, float(nbytes)


def update_audit_work(row_values: list[int]) -> tuple[float, float]:
    """(FLOPs, bytes) of an update audit opening rows of ``row_values`` values each: the miner reads
    and sends seven fp32 kinds per row (the hashing was done when it committed)."""
    n = sum(int(v) for v in row_values)
    return float(n), float(UPDATE_KINDS_PER_ROW * 4 * n)
