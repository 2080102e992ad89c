"""State sync for a joining or restarting replica: the stage's merged weights and outer momentum.

Donor side (:class:`SnapshotDonor`): after every applied merge the replica keeps an immutable
snapshot ``concat(anchor, momentum)`` (float32 [2P], host memory, held by reference: the engine
replaces its anchor and momentum by new tensors, never in place) with a manifest (``snapshot_id``,
``merged_epoch``, ``step``, ``total_numel``, ``chunk_numel``, per-chunk sha256 and the whole
sha256), computed off the event loop the first time a joiner asks (publishing costs nothing, which
matters at scale: hashing 2P values of an ``8b`` head stage takes seconds). All replicas of a stage hold the same snapshot after a merge, so a joiner can fetch
different chunks from different donors and check every chunk against one manifest. A running
merge never blocks it (the snapshot is swapped by reference when a merge is applied). A donor
serves at most ``max_concurrent`` chunk requests at once; more get ``BUSY`` (503).

A snapshot a joiner is fetching outlives the merge that replaces it: when a new snapshot is
published while chunks of the current one were served in the last ``retain_s`` seconds, the donor
keeps the old one (by reference: its ``8 P`` bytes stay in host memory) and goes on serving its
chunks for as long as they keep being asked for (each served chunk renews the lease); at most one
such snapshot is kept (the one asked for last), and it is dropped at the first request or publish
after ``retain_s`` seconds without a chunk. Without it a sync that takes longer than the stage's
merge interval never finishes: at ``8b`` (a ``12.9 GB`` snapshot at 100 Mbit/s: ``~1,030 s``) with
merges every ``~300 s``, every replacement sent the joiner back to the start. The joiner then holds
an older merged epoch than its peers and pulls again when a merge finds it late.

Joiner side (:func:`sync_state`): describe the snapshot at every peer, pick the newest one
(highest ``merged_epoch``) and its donors, fetch chunks from all of them at once with up to
``window`` requests in flight (spread over the donors, each asked for at most the
``max_concurrent`` its description states: with one request per donor at a time the link idles one
round trip per chunk), verify each chunk's hash, store it atomically under ``work_dir`` (so an
interrupted sync resumes), replace a donor that fails or lies by the others, back off (exponential,
with jitter) from a donor that refuses for now and ask the others for the chunks it keeps refusing,
follow a donor to its newer snapshot, and only when every chunk is there and the whole hash matches
hand ``(anchor, momentum, manifest)`` to the caller, which applies them in one step. Raises
:class:`SyncError` (nothing applied; ``missing`` names the chunks no donor delivered) when it
cannot finish.
"""
from __future__ import annotations

import asyncio
import hashlib
import math
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from loguru import logger

from iota_subnet.utils.progress import Progress

from iota_subnet.protocol import (Outcome, ProtocolError, StateChunk, StateChunkRequest, StateReplay,
                                  StateReplayRequest, tensor_sha256)
from iota_subnet.protocol.codec import host_bytes
from iota_subnet.utils.atomic import atomic_write_bytes

from .replay import AppliedMerge, ReplayLog

#: merges a donor keeps for replicas that replay them (host memory: that many x the gather's bytes)
REPLAY_KEEP = 4


class SyncError(RuntimeError):
    """State sync could not finish; nothing was applied (verified chunks stay on disk for a resume).
    ``missing``: indices of the chunks no donor delivered (empty when the sync failed otherwise)."""

    def __init__(self, message: str, missing: Optional[list[int]] = None):
        super().__init__(message)
        self.missing = list(missing or [])


class SnapshotDonor:
    """Serves ``/state/chunk``. ``publish`` a new snapshot after each merge (and at start)."""

    def __init__(self, run_id: str, stage: int, chunk_numel: int = 1 << 20, max_concurrent: int = 2,
                 retain_s: float = 60.0, replay_keep: int = REPLAY_KEEP):
        self.run_id, self.stage = run_id, stage
        #: the last merges applied, for replicas that replay them (:mod:`.replay`)
        self.replay = ReplayLog(run_id, stage, keep=replay_keep, max_concurrent=max_concurrent)
        self.chunk_numel, self.max_concurrent = int(chunk_numel), int(max_concurrent)
        self.retain_s = float(retain_s)
        self.parts: Optional[tuple[torch.Tensor, torch.Tensor]] = None    # (anchor [P], momentum [P]) on the host
        self.info: dict[str, int] = {}
        self._manifest: Optional[dict[str, Any]] = None
        self._hashing: Optional[asyncio.Future] = None
        self._served_at = -math.inf          # monotonic time the current snapshot last served a chunk
        # a replaced snapshot a joiner is still fetching: (parts, manifest, monotonic time of its last chunk)
        self.retained: Optional[tuple[tuple[torch.Tensor, torch.Tensor], dict[str, Any], float]] = None
        self.served_retained = 0             # chunks served from a replaced snapshot
        self.active = 0
        self.peak_active = 0                 # most transfers in progress at once
        self.served_chunks = 0
        self.refused_busy = 0

    def publish(self, anchor: torch.Tensor, momentum: torch.Tensor, merged_epoch: int, step: int) -> None:
        """Offer ``(anchor, momentum)`` (any device; kept as host float32 views, no copy when they are
        host float32 already). Must not be modified in place afterwards."""
        a = anchor.detach().to("cpu", torch.float32).reshape(-1)
        m = momentum.detach().to("cpu", torch.float32).reshape(-1)
        if a.numel() != m.numel():
            raise ValueError(f"anchor of {a.numel()} values, momentum of {m.numel()}")
        now = time.monotonic()
        self._expire(now)
        if (self.parts is not None and self._manifest is not None and now - self._served_at < self.retain_s
                and (self.retained is None or self._served_at >= self.retained[2])):
            self.retained = (self.parts, self._manifest, self._served_at)     # a joiner is fetching it
        # swapped by reference: readers keep the old one
        self.parts, self.info = (a, m), {"merged_epoch": int(merged_epoch), "step": int(step)}
        self._manifest, self._hashing = None, None
        self._served_at = -math.inf

    def record(self, merge: Optional[AppliedMerge]) -> None:
        """Keep what an applied merge applied for replicas that replay it (:meth:`ReplayLog.record`)."""
        self.replay.record(merge)

    async def handle_replay(self, msg: StateReplayRequest, caller: str = "",
                            on_sent: Optional[list[Callable[[], Any]]] = None) -> StateReplay:
        """``/state/replay``: :meth:`ReplayLog.handle` (``caller`` unused here; a subclass may charge it)."""
        del caller
        return await self.replay.handle(msg, on_sent)

    def _expire(self, now: float) -> None:
        if self.retained is not None and now - self.retained[2] >= self.retain_s:
            self.retained = None

    @property
    def retained_bytes(self) -> int:
        """Host bytes of the replaced snapshot kept for a joiner (``8 P``; 0 when none)."""
        return 0 if self.retained is None else 8 * self.retained[0][0].numel()

    def status(self) -> dict[str, Any]:
        """What the donor serves: current and retained snapshot ids, transfers, chunks served."""
        self._expire(time.monotonic())
        return {"snapshot_id": (self._manifest or {}).get("snapshot_id"), "merged_epoch": self.info.get("merged_epoch"),
                "retained_snapshot_id": None if self.retained is None else self.retained[1]["snapshot_id"],
                "retained_bytes": self.retained_bytes, "active": self.active, "served_chunks": self.served_chunks,
                "served_retained": self.served_retained, "refused_busy": self.refused_busy,
                "replay": self.replay.status()}

    @property
    def flat_numel(self) -> int:
        return 0 if self.parts is None else 2 * self.parts[0].numel()

    def _slice(self, parts: tuple[torch.Tensor, torch.Tensor], offset: int, numel: int) -> torch.Tensor:
        """Values ``[offset, offset + numel)`` of ``concat(anchor, momentum)`` (a copy)."""
        a, m = parts
        p, end = a.numel(), offset + numel
        pieces = [t for t in (a[offset:min(end, p)] if offset < p else None,
                              m[max(0, offset - p):end - p] if end > p else None) if t is not None and t.numel()]
        return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces)

    def _build_manifest(self, parts: tuple[torch.Tensor, torch.Tensor], info: dict) -> dict[str, Any]:
        n = 2 * parts[0].numel()
        whole = hashlib.sha256()
        chunks = []
        for o in range(0, n, self.chunk_numel):
            h = hashlib.sha256()
            for view in host_bytes(self._slice(parts, o, min(self.chunk_numel, n - o))):
                h.update(view)
                whole.update(view)
            chunks.append(h.hexdigest())
        digest = whole.hexdigest()
        return {"snapshot_id": f"{info['merged_epoch']}-{digest[:16]}", "merged_epoch": info["merged_epoch"],
                "step": info["step"], "total_numel": n, "param_numel": parts[0].numel(),
                "chunk_numel": self.chunk_numel, "chunk_sha256": chunks, "sha256": digest}

    async def manifest(self) -> dict[str, Any]:
        """The current snapshot's manifest (hashed once, in a worker thread)."""
        parts, info = self.parts, self.info
        if parts is None:
            raise ProtocolError(Outcome.NOT_READY, "no snapshot yet")
        if self._manifest is None:
            if self._hashing is None:
                self._hashing = asyncio.ensure_future(asyncio.to_thread(self._build_manifest, parts, info))
            fut = self._hashing
            man = await asyncio.shield(fut)
            if self.parts is parts:
                self._manifest = man
            return man
        return self._manifest

    async def handle(self, msg: StateChunkRequest, caller: str = "",
                     on_sent: Optional[list[Callable[[], Any]]] = None) -> StateChunk:
        """Describe the snapshot (no ``snapshot_id``) or serve one chunk of it. ``on_sent``: the
        server's hooks run once the response is sent (:class:`~iota_subnet.transport.server.RequestContext`);
        with it the transfer slot is held until the chunk has left, so ``max_concurrent`` caps the
        sends, not only the copies (six slow joiners of a donor capped at 2 get 2 transfers and 4 BUSY)."""
        now = time.monotonic()
        self._expire(now)
        retained = self.retained
        if msg.snapshot_id and retained is not None and msg.snapshot_id == retained[1]["snapshot_id"]:
            parts, man = retained[0], retained[1]           # replaced, but a joiner is still fetching it
            self.retained = (parts, man, now)
            self.served_retained += 1
        else:
            parts = self.parts
            man = await self.manifest()
            if self.parts is not parts:          # replaced while hashing: describe the new one
                return await self.handle(msg, caller, on_sent)
            if not msg.snapshot_id:             # the description also says how many chunk requests it serves at once
                return StateChunk(run_id=self.run_id, stage=self.stage, snapshot_id=man["snapshot_id"],
                                  manifest={**man, "max_concurrent": self.max_concurrent})
            if msg.snapshot_id != man["snapshot_id"]:
                raise ProtocolError(Outcome.LATE, f"snapshot {msg.snapshot_id} replaced by {man['snapshot_id']}")
            self._served_at = now
        total = man["total_numel"]
        if msg.offset < 0 or msg.numel <= 0 or msg.numel > self.chunk_numel or msg.offset + msg.numel > total:
            raise ProtocolError(Outcome.BAD_SHAPE, f"chunk [{msg.offset}, +{msg.numel}) outside the snapshot of "
                                                   f"{total} values (chunks of at most {self.chunk_numel})")
        if self.active >= self.max_concurrent:
            self.refused_busy += 1
            raise ProtocolError(Outcome.BUSY, f"{self.active} state transfers in progress (cap {self.max_concurrent})")
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        released = False
        handed = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.active -= 1
        try:
            await asyncio.sleep(0)          # let concurrent requests see the cap
            data = self._slice(parts, msg.offset, msg.numel)
            self.served_chunks += 1
            reply = StateChunk(run_id=self.run_id, stage=self.stage, snapshot_id=man["snapshot_id"], offset=msg.offset,
                               data=data)
            if on_sent is not None:
                on_sent.append(release)
                handed = True
            return reply
        finally:
            if not handed:
                release()


class _Replaced(Exception):
    """A donor replaced the snapshot being fetched by a later one: describe again and fetch that."""


async def sync_state(peers: list[str], transport: Any, *, run_id: str, stage: int, param_numel: int,
                     work_dir: str | Path, min_epoch: int = -1, busy_retry_s: float = 0.2, max_backoff_s: float = 5.0,
                     chunk_tries: int = 3, max_snapshots: int = 3, max_rounds: int = 200, window: int = 8,
                     seed: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Fetch the newest snapshot from ``peers`` (hotkeys) through ``transport`` (``call(peer, route,
    msg, type)``). Returns ``(anchor [P], momentum [P], manifest)``; raises :class:`SyncError` (its
    ``missing`` lists the chunk indices no donor delivered).

    A donor that refuses a chunk for now (BUSY, NOT_READY, TOO_MANY_REQUESTS) is asked again after an
    exponential backoff with jitter (``busy_retry_s`` doubling up to ``max_backoff_s``); a chunk it has
    refused ``chunk_tries`` times is asked from the other donors only; a donor that fails or lies is
    dropped; at most ``max_rounds`` refusals per donor. A donor that has replaced the snapshot (LATE)
    sends the joiner back to describe the newest one (at most ``max_snapshots`` snapshots).

    ``window``: chunk requests in flight at once over all donors (each donor at most its stated
    ``max_concurrent``; 1 for a donor that states none). To keep the joiner's link busy it should
    cover the bandwidth-delay product: ``window x chunk bytes >= rate x round trip`` (4 MB chunks at
    100 Mbit/s and 100 ms: 2). The manifest's ``sync`` entry counts donors, requests, refusals and bytes."""
    rng = random.Random(seed)
    tried: list[str] = []
    for _ in range(max(1, max_snapshots)):
        try:
            return await _sync_snapshot(peers, transport, run_id=run_id, stage=stage, param_numel=param_numel,
                                        work_dir=work_dir, min_epoch=min_epoch, busy_retry_s=busy_retry_s,
                                        max_backoff_s=max_backoff_s, chunk_tries=chunk_tries, max_rounds=max_rounds,
                                        window=max(1, int(window)), rng=rng, tried=tried)
        except _Replaced as e:
            logger.info(f"state sync: {e}; fetching the newer snapshot")
    raise SyncError(f"the snapshot was replaced {len(tried)} times while syncing ({tried}); try again later")


async def _sync_snapshot(peers: list[str], transport: Any, *, run_id: str, stage: int, param_numel: int,
                         work_dir: str | Path, min_epoch: int, busy_retry_s: float, max_backoff_s: float,
                         chunk_tries: int, max_rounds: int, window: int, rng: random.Random, tried: list[str]
                         ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    async def describe(p: str):
        try:
            r, _, _ = await transport.call(p, "/state/chunk", StateChunkRequest(run_id=run_id, stage=stage), StateChunk)
            return p, r.manifest
        except Exception as e:  # noqa: BLE001 - a peer that cannot describe is not a donor
            logger.debug(f"state sync: {p[:10]} cannot describe its snapshot: {e}")
            return p, None
    manifests = {p: m for p, m in await asyncio.gather(*(describe(p) for p in peers)) if isinstance(m, dict)}
    valid = {p: m for p, m in manifests.items()
             if m.get("param_numel") == param_numel and m.get("total_numel") == 2 * param_numel
             and isinstance(m.get("chunk_sha256"), list) and int(m.get("chunk_numel", 0)) > 0
             and len(m["chunk_sha256"]) == math.ceil(2 * param_numel / int(m["chunk_numel"]))}
    if not valid:
        raise SyncError(f"no peer offers a snapshot for {param_numel} parameters (asked {len(peers)})")
    best = max(valid.values(), key=lambda m: (m["merged_epoch"], sum(1 for v in valid.values()
                                                                       if v["snapshot_id"] == m["snapshot_id"])))
    if best["merged_epoch"] < min_epoch:
        raise SyncError(f"newest snapshot is epoch {best['merged_epoch']} < {min_epoch}")
    sid, cn, hashes = best["snapshot_id"], int(best["chunk_numel"]), list(best["chunk_sha256"])
    tried.append(sid)
    donors = [p for p, m in valid.items() if m["snapshot_id"] == sid]
    total = int(best["total_numel"])
    wd = Path(work_dir) / sid.replace("/", "_")
    wd.mkdir(parents=True, exist_ok=True)
    have: dict[int, torch.Tensor] = {}
    for i, h in enumerate(hashes):                       # resume: keep verified chunks from an earlier try
        f = wd / f"chunk{i:06d}.bin"
        if f.exists():
            t = torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.float32)
            if tensor_sha256(t) == h:
                have[i] = t
    resumed = len(have)
    pending = {i for i in range(len(hashes)) if i not in have}
    refusals: dict[tuple[int, str], int] = {}            # (chunk, donor) -> times refused
    rounds: dict[str, int] = {}
    alive = list(donors)
    # chunk requests a donor serves at once (it says so; one for a donor that does not)
    caps = {p: max(1, int(valid[p].get("max_concurrent", 1) or 1)) for p in donors}
    delay = {p: busy_retry_s for p in donors}           # its next backoff
    resume_at = {p: 0.0 for p in donors}                 # loop time before which it is not asked
    inflight: dict[asyncio.Task, tuple[str, int, int]] = {}     # task -> (donor, chunk, numel)
    busy_with = {p: 0 for p in donors}
    stats = {"donors": list(donors), "dropped": [], "chunks": len(hashes), "resumed": resumed, "busy": 0,
             "requests": 0, "bytes": 0, "window": window}
    prog = Progress(4 * total, f"state sync stage {stage}", "B", initial=4 * sum(t.numel() for t in have.values()),
                    unit_scale=True, min_total=64 << 20)
    loop = asyncio.get_running_loop()

    def drop(p: str, why: str) -> None:
        if p in alive:
            alive.remove(p)
            stats["dropped"].append(p)
            logger.warning(f"state sync: donor {p[:10]} {why}; replaced by the others")

    def next_chunk(p: str) -> Optional[int]:
        return min((i for i in pending if refusals.get((i, p), 0) < chunk_tries), default=None)

    async def fetch(p: str, i: int, n: int) -> torch.Tensor:
        r, _, _ = await transport.call(p, "/state/chunk", StateChunkRequest(
            run_id=run_id, stage=stage, snapshot_id=sid, offset=i * cn, numel=n), StateChunk)

        def check_and_store() -> torch.Tensor:          # off the event loop: hashing 4 MB takes ~10 ms
            d = r.data
            if d is None or d.dtype != torch.float32 or d.numel() != n or tensor_sha256(d) != hashes[i]:
                raise SyncError(f"chunk {i} from {p[:10]} does not match the manifest")
            d = d.detach().to("cpu").contiguous()
            atomic_write_bytes(wd / f"chunk{i:06d}.bin", b"".join(host_bytes(d)))
            return d
        return await asyncio.to_thread(check_and_store)

    def fill() -> None:
        """Ask donors (in turn, each up to its cap, none in backoff) until ``window`` requests are out."""
        while len(inflight) < window:
            now = loop.time()
            ready = [p for p in alive if busy_with[p] < caps[p] and resume_at[p] <= now and next_chunk(p) is not None]
            if not ready:
                return
            p = min(ready, key=lambda q: (busy_with[q], alive.index(q)))
            i = next_chunk(p)
            pending.discard(i)
            n = min(cn, total - i * cn)
            stats["requests"] += 1
            busy_with[p] += 1
            inflight[asyncio.ensure_future(fetch(p, i, n))] = (p, i, n)

    def settle(task: asyncio.Task) -> None:
        p, i, n = inflight.pop(task)
        busy_with[p] -= 1
        e = task.exception()
        if e is None:
            have[i] = task.result()
            stats["bytes"] += 4 * n
            prog.update(4 * n)
            delay[p] = busy_retry_s
            return
        pending.add(i)
        if isinstance(e, ProtocolError):
            if e.outcome == Outcome.LATE:
                raise _Replaced(f"donor {p[:10]} replaced snapshot {sid}: {e}")
            if e.outcome.retryable and rounds.get(p, 0) < max_rounds:
                stats["busy"] += 1
                rounds[p] = rounds.get(p, 0) + 1
                refusals[(i, p)] = refusals.get((i, p), 0) + 1
                # jitter: joiners do not retry in step
                resume_at[p] = max(resume_at[p], loop.time() + delay[p] * (0.5 + rng.random()))
                delay[p] = min(max_backoff_s, 2 * delay[p])
                return
            drop(p, f"refused ({e})")
            return
        # a dead or lying donor is replaced, never fatal
        drop(p, f"failed ({type(e).__name__}: {e})")

    try:
        with prog:
            while True:
                fill()
                if not inflight:
                    waiting = [resume_at[p] for p in alive if next_chunk(p) is not None]
                    if not pending or not waiting:
                        break
                    await asyncio.sleep(max(0.0, min(waiting) - loop.time()))
                    continue
                backoff = [resume_at[p] for p in alive if resume_at[p] > loop.time() and busy_with[p] < caps[p]]
                timeout = max(0.0, min(backoff) - loop.time()) if backoff else None
                done, _ = await asyncio.wait(list(inflight), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    settle(task)
    finally:
        for task in inflight:                 # replaced snapshot or cancelled: no request outlives the sync
            task.cancel()
        if inflight:
            await asyncio.gather(*inflight, return_exceptions=True)
    if len(have) != len(hashes):
        missing = sorted(set(range(len(hashes))) - set(have))
        raise SyncError(f"snapshot {sid}: chunks {missing[:20]}{' ...' if len(missing) > 20 else ''} "
                        f"({len(missing)} of {len(hashes)}) missing: refused {chunk_tries} times by each donor "
                        f"that still serves ({[p[:10] for p in alive]}), dropped donors "
                        f"{[p[:10] for p in stats['dropped']]}; verified chunks kept in {wd} for a resume",
                        missing=missing)
    flat = torch.cat([have.pop(i) for i in range(len(hashes))])        # host float32 [2P]
    if tensor_sha256(flat) != best["sha256"]:
        raise SyncError("assembled snapshot does not match the manifest hash")
    anchor, momentum = flat[:param_numel], flat[param_numel:]
    shutil.rmtree(wd, ignore_errors=True)
    manifest = dict(best, sync=stats)
    return anchor, momentum, manifest
