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

Repair plans: when members die after the join of attempt ``k`` (mid-scatter, or as a reducer), the
next attempt over the survivors keeps attempt ``k``'s layout (``base = (attempt, participants)`` of
the attempt whose layout it keeps): the same shard boundaries and reducers, each dead reducer
replaced by a survivor (deterministic, the least loaded first, ties broken by a hash), and the
weights of the survivors alone (the weighted mean renormalises). Its ``plan_id`` binds ``base``, so
it never equals a fresh plan's, and a validator rebuilds it from the records a reducer keeps.

Weights: a participant's weight in the mean is its validators' merge weight times the work it did
in the merge window (tokens trained since the last merge). A participant with weight 0 (it did no
work) still reduces and gathers, so it ends with the merged weights, but does not dilute the mean;
the weights must sum to more than 0.
"""
from __future__ import annotations

import base64
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
    #: a repair plan's layout: (attempt, sorted participants) of the attempt whose shards it keeps; None: fresh
    base: Optional[tuple[int, tuple[str, ...]]] = None

    @classmethod
    def make(cls, epoch: int, attempt: int, seed: bytes, participants: Sequence[str], total_numel: int,
             weights: Optional[Mapping[str, float]] = None, chunk_numel: Optional[int] = None,
             base: Optional[tuple[int, Sequence[str]]] = None) -> "MergePlan":
        """Raises ValueError for no participants, duplicates, a non-positive size or chunk size, a
        negative weight or weights summing to 0, or (``base``: a repair plan, see the module
        docstring) participants that are not in ``base``'s."""
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
        layout, base_attempt = parts, attempt
        if base is not None:
            base_attempt, layout = int(base[0]), tuple(sorted(base[1]))
            if not set(parts) <= set(layout) or len(set(layout)) != len(layout):
                raise ValueError("a repair plan's participants must be among its base's")
        n = len(layout)
        n_shards = max(1, min(n, total_numel))
        base, extra = divmod(total_numel, n_shards)
        bounds, off = [], 0
        for s in range(n_shards):
            size = base + (1 if s < extra else 0)
            bounds.append((off, size))
            off += size
        digest = hashlib.sha256(seed + f"|{base_attempt}|".encode() + "|".join(layout).encode()).digest()
        # Deterministic permutation: sort participants by a per-participant hash of the digest.
        perm = sorted(layout, key=lambda hk: hashlib.sha256(digest + hk.encode()).digest())
        if n == 1:
            reducers = [(perm[0], perm[0])]
        else:
            reducers = [(perm[s % n], perm[(s + 1) % n]) for s in range(n_shards)]
        ident = [epoch, attempt, seed.hex(), parts, total_numel, tuple(sorted(w.items())), cn]
        if base is not None:
            reducers = _replace_dead(reducers, parts, digest + f"|repair|{attempt}|".encode())
            ident.append([base_attempt, layout])
        wt = tuple(sorted(w.items()))
        # 128 bits as unpadded url-safe base64 (22 characters): it travels in most merge messages
        pid = base64.urlsafe_b64encode(hashlib.sha256(json.dumps(ident).encode()).digest()[:16]).rstrip(b"=").decode()
        return cls(epoch, attempt, parts, total_numel, tuple(bounds), tuple(reducers), wt, pid, cn,
                   None if base is None else (base_attempt, layout))

    @property
    def layout(self) -> tuple[str, ...]:
        """The participants whose count and permutation set the shards and reducers (a repair plan's
        base participants, else the participants)."""
        return self.participants if self.base is None else self.base[1]

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
        among the sorted participants is even, else the second. A reducer is the first of one shard
        and the second of the next, so it serves half of each of its shards' gatherers (within one)
        and no replica sends more than about 3P (:meth:`expected_bytes`; a draw per gatherer put
        some reducers at 3.25P with 32 replicas); and every gatherer asks every reducer something
        before it fetches any mean (the header of one of its two shards, whose mean it then fetches
        from it), so a dead reducer is found before any mean is fetched (:mod:`.allreduce`)."""
        a, b = self.reducers[shard]
        return a if self._rank[hotkey] % 2 == 0 else b

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


def _replace_dead(reducers: list[tuple[str, str]], alive: Sequence[str], salt: bytes) -> list[tuple[str, str]]:
    """``reducers`` with every reducer not in ``alive`` replaced by a live one that is not the
    shard's other reducer: the least loaded (shards it reduces already) first, ties broken by
    ``sha256(salt | shard | hotkey)``."""
    live = set(alive)
    load = {hk: 0 for hk in alive}
    for pair in reducers:
        for r in set(pair):
            if r in live:
                load[r] += 1
    out = []
    for s, pair in enumerate(reducers):
        new = list(pair)
        for i in range(2):
            if new[i] in live:
                continue
            other = new[1 - i] if new[1 - i] in live else None
            cands = [hk for hk in alive if hk != other] or list(alive)
            pick = min(cands, key=lambda hk: (load[hk], hashlib.sha256(salt + f"{s}|".encode() + hk.encode()).digest()))
            load[pick] += 1
            new[i] = pick
        out.append((new[0], new[1]))
    return out
