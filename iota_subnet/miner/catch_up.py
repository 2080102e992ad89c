"""A starting replica's catch-up with its stage before it trains (merging on).

A replica that starts (joins, or restarts after a crash) asks its stage's other replicas for their
merged epoch (``/merge/join``) and, when one of them holds a later merged state than its own,
pulls it (state sync, :mod:`iota_subnet.merge.sync`) before it accepts training. It never trusts a
silence:

* peers that refuse it (they do not see its stage commitment on chain yet: ``FORBIDDEN`` /
  ``UNREGISTERED_HOTKEY``) or do not answer are asked again, with exponential backoff, until one
  answers;
* a replica with a merged state of its own (its merge-state file) does not wait on peers that are
  stopped or gone: after one round without an answer it goes on from that state (a later merge
  finds it late if the others merged meanwhile, and it pulls then);
* a replica with no state at all waits up to ``max_wait_s`` for an answer. After that it goes on
  from the run's seeded initialisation (a stage whose other replicas are all gone has nothing to
  catch up with); its merges never mix those weights with a peer's newer merged state: the merge
  engine treats it as late (:meth:`~iota_subnet.merge.engine.MergeEngine._join`).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from loguru import logger

from iota_subnet.protocol import MergeJoin


@dataclass
class CatchUp:
    """Outcome: ``how`` is ``synced`` | ``current`` | ``alone`` (no peers) | ``own-state`` |
    ``seeded`` (no answer within ``max_wait_s``, no state of its own); ``rounds`` of asks;
    ``errors``: the last error per peer that did not answer."""

    how: str = ""
    newest: int = -1
    rounds: int = 0
    wall_s: float = 0.0
    errors: dict[str, str] = field(default_factory=dict)


async def stage_merged_epoch(engine, peers: list[str], timeout_s: float) -> tuple[list[int], dict[str, str]]:
    """The merged epochs the ``peers`` that answered report, and the error of each that did not."""
    async def ask(p: str):
        try:
            return p, await asyncio.wait_for(engine._call(p, "/merge/join", MergeJoin(
                run_id=engine.run_id, stage=engine.stage, epoch=-1), MergeJoin), timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - silence, refusal or unreachable: asked again
            return p, e
    epochs, errors = [], {}
    for p, r in await asyncio.gather(*(ask(p) for p in peers)):
        if isinstance(r, MergeJoin):
            epochs.append(int(r.merged_epoch))
        else:
            errors[p] = f"{type(r).__name__}: {r}"[:200]
    return epochs, errors


async def catch_up(engine, peers: Callable[[], list[str]], pull: Callable[[int], Awaitable[bool]], *,
                   own_state: bool, ask_timeout_s: float = 5.0, max_wait_s: float = 120.0,
                   backoff_s: float = 0.5, max_backoff_s: float = 10.0) -> CatchUp:
    """Bring ``engine`` (a :class:`~iota_subnet.merge.engine.MergeEngine`) up to its stage's newest
    merged state. ``peers()``: the stage's other replicas now; ``pull(min_epoch)``: state sync,
    True when applied; ``own_state``: this replica resumed from its own checkpoint or merge-state
    file. See the module docstring for the rules."""
    t0 = time.monotonic()
    out = CatchUp()
    delay = backoff_s
    while True:
        ps = peers()
        if not ps:
            out.how = "alone"
            break
        out.rounds += 1
        epochs, out.errors = await stage_merged_epoch(engine, ps, ask_timeout_s)
        if epochs:
            out.newest = max(epochs)
            if out.newest <= engine.merged_epoch:
                out.how = "current"
                break
            if await pull(out.newest):
                out.how = "synced"
                break
            logger.warning(f"catch-up: state sync of merged epoch {out.newest} failed; retrying in {delay:.1f} s")
        elif own_state:
            out.how = "own-state"
            logger.warning(f"catch-up: no replica of the stage answers ({out.errors}); going on from this "
                           f"replica's own state (merged epoch {engine.merged_epoch})")
            break
        elif time.monotonic() - t0 >= max_wait_s:
            out.how = "seeded"
            logger.warning(f"catch-up: no replica of the stage answered in {max_wait_s:.0f} s ({out.errors}); "
                           f"starting from the run's seeded initialisation")
            break
        else:
            logger.info(f"catch-up: waiting for the stage's replicas to answer ({len(out.errors)} silent or "
                        f"refusing: {list(out.errors.values())[:2]}); asking again in {delay:.1f} s")
        await asyncio.sleep(delay)
        delay = min(max_backoff_s, 2 * delay)
    out.wall_s = round(time.monotonic() - t0, 3)
    return out
