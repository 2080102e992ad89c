"""The merge plan: the flat parameter vector cut into shards, two distinct reducers per shard.

Every participant computes the same plan from ``(epoch seed, attempt, sorted participants,
total_numel, weights)``, with no coordinator (as in IOTA's butterfly all-reduce, arXiv 2507.17766,
and hivemind's ``averaging/partition.py``).

Layout, for N >= 2 participants: N shards of (almost) equal size; a permutation ``perm`` of the
participants is drawn from ``sha256(seed | attempt | participants)``; shard ``s`` is reduced by
``perm[s]`` and ``perm[(s + 1) % N]``. Each replica reduces exactly two shards (2P/N values), so
the bytes a replica sends and receives per merge stay below 3P whatever N is (P = parameters of
the stage, see :meth:`MergePlan.expected_bytes`). With one participant there is nothing to reduce.

Chunks: every shard travels as consecutive chunks of at most ``chunk_numel`` values
(:meth:`MergePlan.chunks`), one message each, so no message body holds a whole shard (a shard
of an ``8b`` head stage at N = 2 is 700M values, 2.8 GB in fp32).

Weights: a participant's weight in the mean is its validators' merge weight times the work it did
in the merge window (tokens trained since the last merge). A participant with weight 0 (it did no
work) still reduces and gathers, so it ends with the merged weights, but does not dilute the mean;
the weights must sum to more than 0.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Optional, Sequence


def epoch_seed(run_id: str, stage: int, epoch: int) -> bytes:
    """The seed of merge epoch ``epoch`` of ``stage`` (32 bytes)."""
    return hashlib.sha256(f"iota-merge|{run_id}|{stage}|{epoch}".encode()).digest()


@dataclass(frozen=True)
class MergePlan:
    """``bounds[s] = (offset, numel)``; ``reducers[s] = (a, b)`` (hotkeys, a != b when N >= 2);
    ``weights[hotkey]`` the participant's weight in the mean (>= 0, sum > 0); ``chunk_numel``: values
    per message (see :meth:`chunks`)."""

    epoch: int
    attempt: int
    participants: tuple[str, ...]
    total_numel: int
    bounds: tuple[tuple[int, int], ...]
    reducers: tuple[tuple[str, str], ...]
    weights: tuple[tuple[str, float], ...]
    plan_id: str
    chunk_numel: int = 1 << 62

    @classmethod
    def make(cls, epoch: int, attempt: int, seed: bytes, participants: Sequence[str], total_numel: int,
             weights: Optional[Mapping[str, float]] = None, chunk_numel: Optional[int] = None) -> "MergePlan":
        """Raises ValueError for no participants, duplicates, a non-positive size or chunk size, a
        negative weight or weights summing to 0."""
        parts = tuple(sorted(participants))
        if not parts:
            raise ValueError("a merge plan needs at least one participant")
        if len(set(parts)) != len(parts):
            raise ValueError("duplicate participants")
        if total_numel <= 0:
            raise ValueError(f"total_numel must be positive, got {total_numel}")
        w = {hk: float((weights or {}).get(hk, 1.0)) for hk in parts}
        if any(not (v >= 0 and v < float("inf")) for v in w.values()) or not sum(w.values()) > 0:
            raise ValueError(f"merge weights must be finite, >= 0 and not all 0: {w}")
        cn = int(chunk_numel) if chunk_numel is not None else 1 << 62
        if cn <= 0:
            raise ValueError(f"chunk_numel must be positive, got {chunk_numel}")
        n = len(parts)
        n_shards = max(1, min(n, total_numel))
        base, extra = divmod(total_numel, n_shards)
        bounds, off = [], 0
        for s in range(n_shards):
            size = base + (1 if s < extra else 0)
            bounds.append((off, size))
            off += size
        digest = hashlib.sha256(seed + f"|{attempt}|".encode() + "|".join(parts).encode()).digest()
        # Deterministic permutation: sort participants by a per-participant hash of the digest.
        perm = sorted(parts, key=lambda hk: hashlib.sha256(digest + hk.encode()).digest())
        if n == 1:
            reducers = [(perm[0], perm[0])]
        else:
            reducers = [(perm[s % n], perm[(s + 1) % n]) for s in range(n_shards)]
        wt = tuple(sorted(w.items()))
        pid = hashlib.sha256(json.dumps([epoch, attempt, seed.hex(), parts, total_numel, wt, cn]).encode()).hexdigest()[:32]
        return cls(epoch, attempt, parts, total_numel, tuple(bounds), tuple(reducers), wt, pid, cn)

    @property
    def num_shards(self) -> int:
        return len(self.bounds)

    def weight(self, hotkey: str) -> float:
        return dict(self.weights)[hotkey]

    def chunks(self, shard: int) -> list[tuple[int, int]]:
        """``(offset, numel)`` of the chunks of ``shard`` in order: ``chunk_numel`` values each (a
        multiple of the int8 block, so chunked quantization equals quantizing the whole shard from its
        start) from the shard's start, the last one shorter."""
        off, n = self.bounds[shard]
        return [(off + o, min(self.chunk_numel, n - o)) for o in range(0, n, self.chunk_numel)] or [(off, 0)]

    def shards_of(self, hotkey: str) -> list[int]:
        """Shards ``hotkey`` reduces."""
        return [s for s, pair in enumerate(self.reducers) if hotkey in pair]

    @cached_property
    def _rank(self) -> dict[str, int]:
        return {hk: i for i, hk in enumerate(self.participants)}

    def primary_for(self, hotkey: str, shard: int) -> str:
        """Which reducer of ``shard`` a non-reducer fetches the mean from: the first when its rank
        among the sorted participants plus ``shard`` is even, else the second, so each reducer serves
        half of the shard's gatherers (within one), and no replica sends more than about 3P
        (:meth:`expected_bytes`; a draw per gatherer put some reducers at 3.25P with 32 replicas)."""
        a, b = self.reducers[shard]
        return a if (self._rank[hotkey] + shard) % 2 == 0 else b

    def expected_bytes(self, bytes_per_value: float = 4.0) -> dict[str, float]:
        """Payload bytes per replica per merge (tensor data only), averaged over replicas.

        scatter: each replica sends its slice of every shard to both reducers (minus itself);
        gather: it fetches each shard it did not reduce once. Sent = received on average.
        """
        n, p = len(self.participants), self.total_numel * bytes_per_value
        if n < 2:
            return {"sent": 0.0, "received": 0.0}
        scatter = (2 * n - 2) / n * p
        gather = (n - 2) / n * p
        return {"sent": scatter + gather, "received": scatter + gather}
