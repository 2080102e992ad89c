"""``iota-subnet localnet --join-at STEP[:STAGE]``: one fresh miner joins mid-run.

When the validators' lane step (the slowest lane's inner steps done, as the progress line shows)
reaches ``STEP``, one new miner registers on ``STAGE`` (default 0) and starts, by the same path as a
chaos ``join`` (:meth:`~iota_subnet.network.localnet.LocalNet.add_miner`: the localnet's miner
arguments, so an emulated joiner (``--emulate-gpu``) has its peers' emulation and virtual merge
scale). It catches up from its stage's replicas (state sync, :mod:`iota_subnet.merge.sync`).

The summary's ``joiner`` (:meth:`JoinAt.report`): when it joined (lane step, wall and emulated
seconds since the run's neurons started: emulated = wall / ``time_scale``), and from its
``status.json`` (``merge.sync``, ``merge.in_sync``): whether it is in sync and when it synced (wall and
emulated seconds since the neurons started), its state sync's seconds
(the pull: wall and emulated), the seconds from its start to in sync (its process start-up included,
which is host time and not slowed by ``time_scale``), and the bytes fetched (an emulated stage's
virtual bytes: the proxy's bytes x its scale, ``merge.virtual.scale``).
"""
from __future__ import annotations

import json
import time
from typing import Any, Optional

from iota_subnet.config import ConfigError


def parse_join_at(text: Optional[str], *, stages: int, steps: int) -> Optional[tuple[int, int]]:
    """``STEP[:STAGE]`` -> ``(step, stage)`` (None for None). Raises :class:`ConfigError` naming the fix
    for a malformed value, a step outside ``1 .. steps - 1`` (a joiner at step 0 is an ordinary miner,
    one at ``steps`` never trains) or a stage outside ``0 .. stages - 1``."""
    if text is None:
        return None
    step_s, _, stage_s = str(text).strip().partition(":")
    try:
        step, stage = int(step_s), int(stage_s) if stage_s else 0
    except ValueError:
        raise ConfigError(f"--join-at {text!r}: expected STEP[:STAGE] with whole numbers, e.g. --join-at 3 or "
                          f"--join-at 3:1") from None
    if not 1 <= step < steps:
        raise ConfigError(f"--join-at {text!r}: STEP must be between 1 and --steps - 1 ({steps - 1}), so the "
                          f"joiner arrives mid-run; got {step}")
    if not 0 <= stage < stages:
        raise ConfigError(f"--join-at {text!r}: STAGE must be between 0 and {stages - 1} (--stages {stages}); "
                          f"got {stage}")
    return step, stage


class JoinAt:
    """The ``--join-at`` event of a localnet (see the module docstring): ``step``, ``stage``; once
    joined, ``child`` (the joiner's :class:`~iota_subnet.network.processes.Child`) and ``joined``
    (lane step, unix time, wall seconds since the run's neurons started)."""

    def __init__(self, step: int, stage: int, time_scale: float = 1.0):
        self.step, self.stage, self.time_scale = int(step), int(stage), float(time_scale)
        self.child: Any = None
        self.joined: dict[str, float] = {}

    def tick(self, net: Any, lane_step: int, started: float) -> None:
        """Called once per supervision round with the lane step and the monotonic time the neurons
        were started: add the joiner (``net.add_miner``) the first time ``lane_step >= step``."""
        if self.child is not None or lane_step < self.step:
            return
        self.child = net.add_miner(self.stage)
        wall = time.monotonic() - started
        self.joined = {"lane_step": int(lane_step), "unix": time.time(), "wall_s": round(wall, 3),
                       "emulated_s": round(wall / self.time_scale, 3)}

    def report(self) -> dict:
        """The summary's ``joiner`` (see the module docstring); ``joined`` False when the run ended first."""
        out: dict[str, Any] = {"at_step": self.step, "stage": self.stage, "joined": self.child is not None}
        if self.child is None:
            return out
        try:
            ms = json.loads((self.child.out / "status.json").read_text())
        except (OSError, ValueError):
            ms = {}
        merge = ms.get("merge") or {}
        sync = merge.get("sync") or {}
        scale = int((merge.get("virtual") or {}).get("scale", 1))
        synced = sync.get("state") == "synced"
        out.update({"name": self.child.name, "uid": ms.get("uid"), "joined_at_step": self.joined["lane_step"],
                    "joined_wall_s": self.joined["wall_s"], "joined_emulated_s": self.joined["emulated_s"],
                    "in_sync": bool(merge.get("in_sync")), "synced": synced, "sync_state": sync.get("state"),
                    "inner_step": ms.get("inner_step"), "merges_applied": merge.get("merges"),
                    "virtual_scale": scale})
        if synced:
            wall = float(sync.get("wall_s", 0.0))
            to_sync = float(sync.get("synced_at", self.joined["unix"])) - self.joined["unix"]
            at = self.joined["wall_s"] + to_sync            # since the neurons started, as joined_wall_s
            out.update({"synced_at_wall_s": round(at, 3), "synced_at_emulated_s": round(at / self.time_scale, 3),
                        "sync_wall_s": wall, "sync_emulated_s": round(wall / self.time_scale, 3),
                        "join_to_sync_wall_s": round(to_sync, 3),
                        "join_to_sync_emulated_s": round(to_sync / self.time_scale, 3),
                        "sync_bytes": int(sync.get("bytes", 0)) * scale, "sync_chunks": sync.get("chunks"),
                        "sync_donors": sync.get("donors"), "sync_merged_epoch": sync.get("merged_epoch"),
                        # merges applied while it fetched the snapshot (or missed since its own state),
                        # replayed from the donors' kept means (iota_subnet.merge.replay)
                        "sync_snapshot_epoch": sync.get("snapshot_epoch"),
                        "replayed_merges": int(sync.get("replayed_merges", 0)),
                        "replay_bytes": int(sync.get("replay_bytes", 0)) * scale})
        return out
