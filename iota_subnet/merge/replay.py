"""Catch-up by replay: a replica behind its stage by a few merges applies the merges it missed
instead of fetching the whole merged state again.

A snapshot (:mod:`.sync`: anchor and momentum, ``8 P`` bytes) is the only way in for a replica with
no state of the stage, but a replica that holds the state of merge epoch ``e`` (its own, or an
older snapshot it has just synced while its donors merged on) needs only what each later merge
applied: the mean pseudo-gradient in the gather's encoding (``P`` bytes at int8, about the gather's
share of a merge, see :func:`.deadlines.scatter_bytes`). The outer step
(:func:`.outer.outer_step`, DiLoCo arXiv 2311.08105 Algorithm 1) is elementwise float32 in a fixed
order, so replaying the same means from the same state gives the donors' state bit for bit. At
``8b`` on 100 Mbit/s (largest stage: snapshot ``12.9 GB``, ``~1,030 s``; int8 mean ``1.6 GB``,
``~130 s``) a joiner that synced a snapshot three merges old catches up in ``~390 s`` more, and
keeps up as long as one merge's mean crosses its downlink in less than the merge interval.

Donor side (:class:`ReplayLog`): keeps the last ``keep`` applied merges (:class:`AppliedMerge`, the
wire chunks by reference: ``keep x`` the gather's bytes of host memory) and serves them
(``/state/replay``): a describe lists them (``prev_epoch``, ``epoch``, chunk layout, bytes), a chunk
request returns one chunk as the merge carried it. At most ``max_concurrent`` chunk transfers at
once (``BUSY`` beyond); an epoch it no longer keeps is ``LATE``.

Replica side (:func:`replay_to_newest`): describe the kept merges at every peer, follow the chain
from its own epoch (the kept merge whose ``prev_epoch`` is its epoch, then that one's successor ...)
to the newest, fetch every chunk with up to ``window`` requests in flight spread over the donors
that keep the chain (a donor that fails is dropped, its chunks asked of the others), apply the
merges in order into new tensors (never in place: donors' snapshots hold the old ones by
reference), then CHECK: sha256 over ``concat(anchor, momentum)`` must equal a donor's snapshot
manifest of the same epoch (:class:`.sync.SnapshotDonor`); while the donors merged again meanwhile
it replays on. Nothing is trusted before that check: a lying donor costs the replay, never the
state. Raises :class:`ReplayError` when no kept chain starts at its epoch, a chunk cannot be had,
or the result does not match.
"""
from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from loguru import logger

from iota_subnet.protocol import (Outcome, ProtocolError, StateChunk, StateChunkRequest, StateReplay,
                                  StateReplayRequest)
from iota_subnet.protocol.codec import host_bytes

from .outer import dequantize, outer_step


class ReplayError(RuntimeError):
    """Replay could not bring the state to the stage's newest merged epoch; nothing was applied."""


@dataclass
class AppliedMerge:
    """What merge ``epoch`` applied on top of the state of ``prev_epoch``: the mean pseudo-gradient,
    ``chunks`` of ``(offset, quant, values, scales)`` covering ``[0, P)`` in order, each decoded by
    :func:`.outer.dequantize` (``block``: the int8 block)."""

    prev_epoch: int
    epoch: int
    block: int
    chunks: list[tuple[int, str, torch.Tensor, Optional[torch.Tensor]]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() + (0 if s is None else s.numel() * s.element_size())
                   for _, _, v, s in self.chunks)

    def layout(self) -> list[list[int]]:
        """``[offset, wire values]`` per chunk (what two donors' copies of the merge are compared by)."""
        return [[int(o), int(v.numel())] for o, _, v, _ in self.chunks]


def apply_merges(anchor: torch.Tensor, momentum: torch.Tensor, merges: list[AppliedMerge], *, lr: float,
                 mu: float, nesterov: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(anchor, momentum)`` (float32 [P]) after ``merges`` in order, as new tensors. Raises
    ValueError when a chunk does not decode or does not fit ``[0, P)``."""
    for am in merges:
        new_a, new_m = torch.empty_like(anchor), torch.empty_like(momentum)
        covered = 0
        for off, quant, values, scales in am.chunks:
            mean = dequantize(values, scales, quant, am.block)
            n = mean.numel()
            if off != covered or off + n > anchor.numel():
                raise ValueError(f"merge {am.epoch}: chunk at {off} (+{n}) does not continue at {covered}")
            a, m = outer_step(anchor[off:off + n], momentum[off:off + n], mean, lr=lr, mu=mu, nesterov=nesterov)
            new_a[off:off + n], new_m[off:off + n] = a, m
            covered += n
        if covered != anchor.numel():
            raise ValueError(f"merge {am.epoch}: chunks cover {covered} of {anchor.numel()} values")
        anchor, momentum = new_a, new_m
    return anchor, momentum


def state_sha256(anchor: torch.Tensor, momentum: torch.Tensor) -> str:
    """sha256 of ``concat(anchor, momentum)``'s float32 bytes (the snapshot manifest's ``sha256``), no copy."""
    h = hashlib.sha256()
    for t in (anchor, momentum):
        for view in host_bytes(t.detach().to("cpu", torch.float32).contiguous().reshape(-1)):
            h.update(view)
    return h.hexdigest()


class ReplayLog:
    """The last ``keep`` merges this replica applied, served on ``/state/replay`` (module docstring)."""

    def __init__(self, run_id: str, stage: int, keep: int = 4, max_concurrent: int = 2):
        self.run_id, self.stage = run_id, stage
        self.keep, self.max_concurrent = int(keep), int(max_concurrent)
        self.merges: list[AppliedMerge] = []
        self.active = 0
        self.served_chunks = 0

    def record(self, merge: Optional[AppliedMerge]) -> None:
        """Keep ``merge`` (the oldest beyond ``keep`` is dropped)."""
        if merge is None or self.keep <= 0:
            return
        older = [m for m in self.merges if m.epoch < merge.epoch]
        self.merges = older[max(0, len(older) - (self.keep - 1)):]
        self.merges.append(merge)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.merges)

    def status(self) -> dict[str, Any]:
        return {"epochs": [m.epoch for m in self.merges], "bytes": self.nbytes, "served_chunks": self.served_chunks}

    async def handle(self, msg: StateReplayRequest, on_sent: Optional[list[Callable[[], Any]]] = None) -> StateReplay:
        """Describe the kept merges (``msg.epoch`` < 0) or serve one chunk of one. Raises
        :class:`~iota_subnet.protocol.ProtocolError`: ``LATE`` (not kept), ``BAD_SHAPE`` (no such
        chunk), ``BUSY`` (``max_concurrent`` transfers in progress)."""
        if msg.epoch < 0:
            return StateReplay(run_id=self.run_id, stage=self.stage, manifest={
                "merges": [{"prev_epoch": m.prev_epoch, "epoch": m.epoch, "chunks": m.layout(), "bytes": m.nbytes}
                           for m in self.merges], "max_concurrent": self.max_concurrent})
        am = next((m for m in self.merges if m.epoch == msg.epoch), None)
        if am is None:
            raise ProtocolError(Outcome.LATE, f"merge {msg.epoch} is not kept (kept: {[m.epoch for m in self.merges]})")
        if not 0 <= msg.chunk < len(am.chunks):
            raise ProtocolError(Outcome.BAD_SHAPE, f"merge {msg.epoch} has {len(am.chunks)} chunks, not {msg.chunk}")
        if self.active >= self.max_concurrent:
            raise ProtocolError(Outcome.BUSY, f"{self.active} replay transfers in progress (cap {self.max_concurrent})")
        self.active += 1
        released = [False]

        def release() -> None:
            if not released[0]:
                released[0] = True
                self.active -= 1
        off, quant, values, scales = am.chunks[msg.chunk]
        self.served_chunks += 1
        if on_sent is not None:
            on_sent.append(release)
        else:
            release()
        return StateReplay(run_id=self.run_id, stage=self.stage, epoch=am.epoch, chunk=msg.chunk, offset=off,
                           quant=quant, mean=values, mean_scales=scales)


async def _describe(peers: list[str], transport: Any, route: str, msg_type: type, reply_type: type, *, run_id: str,
                    stage: int) -> dict[str, dict]:
    async def one(p: str):
        try:
            r, _, _ = await transport.call(p, route, msg_type(run_id=run_id, stage=stage), reply_type)
            return p, r.manifest
        except Exception as e:  # noqa: BLE001 - a peer that cannot describe is not a donor
            logger.debug(f"replay: {p[:10]} cannot describe {route}: {e}")
            return p, None
    return {p: m for p, m in await asyncio.gather(*(one(p) for p in peers)) if isinstance(m, dict)}


def _chain(kept: list[dict], from_epoch: int) -> list[dict]:
    by_prev = {int(m["prev_epoch"]): m for m in kept if isinstance(m, dict) and "prev_epoch" in m}
    out, e = [], from_epoch
    while e in by_prev and int(by_prev[e]["epoch"]) > e:
        out.append(by_prev[e])
        e = int(by_prev[e]["epoch"])
    return out


async def _fetch_chain(chain: list[dict], caps: dict[str, int], transport: Any, *, run_id: str, stage: int,
                       block: int, window: int, stats: dict) -> list[AppliedMerge]:
    """Every chunk of every merge of ``chain`` from the donors of ``caps`` (each keeps the whole
    chain; ``caps``: the transfers each serves at once, as its describe states), at most ``window``
    requests in flight, each to the least busy donor with a free slot."""
    todo = [(i, c) for i, m in enumerate(chain) for c in range(len(m["chunks"]))]
    got: dict[tuple[int, int], StateReplay] = {}
    alive = list(caps)
    busy = {p: 0 for p in caps}
    tries: dict[tuple[int, int], int] = {}
    sem = asyncio.Semaphore(max(1, window))
    cond = asyncio.Condition()

    async def take() -> str:
        async with cond:
            while alive and not any(busy[p] < caps[p] for p in alive):
                await cond.wait()
            if not alive:
                raise ReplayError("every donor of the kept merges failed")
            p = min((q for q in alive if busy[q] < caps[q]), key=lambda q: busy[q])
            busy[p] += 1
            return p

    async def give(p: str, dead: bool) -> None:
        async with cond:
            busy[p] -= 1
            if dead and p in alive:
                alive.remove(p)
            cond.notify_all()

    async def fetch(i: int, c: int) -> None:
        async with sem:
            while (i, c) not in got:
                if tries.get((i, c), 0) >= 3 * len(caps):
                    raise ReplayError(f"merge {chain[i]['epoch']} chunk {c}: no donor delivered it")
                p = await take()
                tries[(i, c)] = tries.get((i, c), 0) + 1
                dead = False
                try:
                    r, _, _ = await transport.call(p, "/state/replay", StateReplayRequest(
                        run_id=run_id, stage=stage, epoch=int(chain[i]["epoch"]), chunk=c), StateReplay)
                    if r.mean is None or int(r.offset) != int(chain[i]["chunks"][c][0]):
                        raise ReplayError(f"chunk {c} of merge {chain[i]['epoch']} at the wrong offset")
                    got[(i, c)] = r
                    stats["bytes"] += int(r.mean.numel() * r.mean.element_size()) + (
                        0 if r.mean_scales is None else int(r.mean_scales.numel() * r.mean_scales.element_size()))
                    stats["requests"] += 1
                except ProtocolError as e:
                    dead = not e.outcome.retryable
                    if not dead:
                        await asyncio.sleep(0.05 * tries[(i, c)])
                except Exception as e:  # noqa: BLE001 - a dead or lying donor is replaced by the others
                    dead = True
                    logger.warning(f"replay: donor {p[:10]} failed ({type(e).__name__}: {e}); asking the others")
                finally:
                    await give(p, dead)
    await asyncio.gather(*(fetch(i, c) for i, c in todo))
    out = []
    for i, m in enumerate(chain):
        chunks = [got[(i, c)] for c in range(len(m["chunks"]))]
        out.append(AppliedMerge(int(m["prev_epoch"]), int(m["epoch"]), block,
                                [(int(r.offset), r.quant, r.mean, r.mean_scales) for r in chunks]))
    return out


async def replay_to_newest(peers: list[str], transport: Any, *, run_id: str, stage: int, anchor: torch.Tensor,
                           momentum: torch.Tensor, epoch: int, lr: float, mu: float, nesterov: bool, block: int,
                           window: int = 8, max_rounds: int = 12,
                           sha256: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Bring ``(anchor, momentum)`` (float32 [P], the stage's state at merged ``epoch``) to the
    stage's newest merged state by replaying the merges ``peers`` keep, checked against their
    snapshot manifest (module docstring). Returns ``(anchor, momentum, manifest)`` (the donors'
    snapshot manifest of the reached epoch, with ``replay``: merges, bytes, requests, rounds).
    Each round replays the merges kept since its epoch, then checks; a merge applied meanwhile starts
    another round (at most ``max_rounds``: the rounds shrink while one merge's mean crosses the link
    faster than the stage merges). ``sha256``: the hash of ``(anchor, momentum)`` when the caller
    checked it already (a synced snapshot's), so that a state the donors have not moved past is not
    hashed again. Raises :class:`ReplayError` (nothing applied)."""
    stats = {"merges": 0, "bytes": 0, "requests": 0, "rounds": 0, "from_epoch": int(epoch)}
    for _ in range(max(1, max_rounds)):
        stats["rounds"] += 1
        # both descriptions at once: one round trip per round
        described, logs = await asyncio.gather(
            _describe(peers, transport, "/state/chunk", StateChunkRequest, StateChunk, run_id=run_id, stage=stage),
            _describe(peers, transport, "/state/replay", StateReplayRequest, StateReplay, run_id=run_id, stage=stage))
        snaps = {p: m for p, m in described.items()
                 if isinstance(m.get("merged_epoch"), int) and isinstance(m.get("sha256"), str)}
        if not snaps:
            raise ReplayError("no peer describes its merged state")
        newest = max(m["merged_epoch"] for m in snaps.values())
        if epoch >= newest:
            same = [m for m in snaps.values() if m["merged_epoch"] == epoch]
            if not same:
                raise ReplayError(f"no peer holds merged epoch {epoch} to check the replayed state against")
            digest = sha256 if sha256 is not None else await asyncio.to_thread(state_sha256, anchor, momentum)
            match = [m for m in same if m["sha256"] == digest]
            if not match:
                raise ReplayError(f"the replayed state of epoch {epoch} does not match the donors' "
                                  f"({len(same)} described it)")
            return anchor, momentum, dict(match[0], replay=stats)
        chains = {p: _chain(m.get("merges") or [], epoch) for p, m in logs.items()}
        best = max(chains.values(), key=lambda c: (int(c[-1]["epoch"]) if c else -1, len(c)), default=[])
        if not best:
            raise ReplayError(f"no peer keeps the merges after epoch {epoch} (newest {newest})")
        key = [(int(m["epoch"]), m["chunks"]) for m in best]
        caps = {p: max(1, int(logs[p].get("max_concurrent", 1) or 1)) for p, c in chains.items()
                if [(int(m["epoch"]), m["chunks"]) for m in c[:len(key)]] == key}
        merges = await _fetch_chain(best, caps, transport, run_id=run_id, stage=stage, block=block,
                                    window=window, stats=stats)
        try:
            anchor, momentum = await asyncio.to_thread(apply_merges, anchor, momentum, merges, lr=lr, mu=mu,
                                                       nesterov=nesterov)
        except ValueError as e:
            raise ReplayError(f"a replayed merge does not apply: {e}") from e
        stats["merges"] += len(merges)
        epoch, sha256 = merges[-1].epoch, None
    raise ReplayError(f"still behind after {max_rounds} rounds of replay (at epoch {epoch})")
