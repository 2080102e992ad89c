"""A miner's signed ``/health`` answer (:class:`~iota_subnet.protocol.Health`): its stage, progress and
merge figures, or a refusal while one of its supervised tasks keeps failing.

``ready`` is False (``status`` ``"syncing"``) while a replica merge's state sync runs. A miner whose
:class:`~iota_subnet.utils.supervise.Supervisor` is unhealthy (a task failed ``unhealthy_after`` times in
a row) answers ``NOT_READY`` (HTTP 503) naming the failing tasks and their last error, so validators
probing it keep it out of routing until it recovers.
"""
from __future__ import annotations

import time
from typing import Any

from iota_subnet.protocol import Health, Outcome, ProtocolError


def miner_health(svc: Any) -> Health:
    """The ``/health`` reply of ``svc`` (a :class:`~iota_subnet.miner.service.MinerService` that has
    started). Raises :class:`ProtocolError` ``NOT_READY`` while its supervisor is unhealthy."""
    failing = svc.sup.failing()
    if failing:
        tasks = svc.sup.status()
        raise ProtocolError(Outcome.NOT_READY, "unhealthy: " + "; ".join(
            f"task {n!r} failed {tasks[n]['consecutive_failures']} times in a row ({tasks[n]['last_error']})"
            for n in failing))
    w = svc.worker
    ready = svc.merge is None or svc.merge.in_sync
    return Health(run_id=svc.run_id, stage=svc.stage, inner_step=w.inner_step,
                  status="ok" if ready else "syncing", ready=ready,
                  hotkey=svc.hotkey, uptime_s=time.time() - svc.started_at,
                  stats={"stage": svc.stage, "inner_step": w.inner_step, "lane": lane_of(w), "forwards": w.forwards,
                         "backwards": w.backwards, "tokens": w.tokens, "cache_bytes": w.cache.bytes,
                         "evictions_ttl": w.cache.evictions["ttl"], "evictions_bytes": w.cache.evictions["bytes"],
                         **merge_health(svc.merge)})


def lane_of(worker: Any) -> int:
    """The lane ``worker`` last trained in as the lane's own miner of its stage; -1: none yet (a
    replica taking over a lane asks its stage peers for it: :mod:`iota_subnet.miner.lane_handover`)."""
    lane = getattr(worker, "lane", None)
    return -1 if lane is None else int(lane)


def merge_health(merge: Any) -> dict[str, float]:
    """Merge figures for ``/health`` (validators' dashboards show them); empty when merging is off
    (``merge`` None, else a :class:`~iota_subnet.merge.engine.MergeEngine`)."""
    if merge is None:
        return {}
    m = merge.status()
    return {"merges": m["merges"], "merged_epoch": m["merged_epoch"], "merges_abandoned": m["abandoned"],
            "merge_last_wall_s": float((m["last"] or {}).get("wall_s") or 0.0)}
