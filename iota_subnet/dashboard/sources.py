"""What the dashboard shows, built from a small explicit snapshot interface of a neuron.

A validator's page (:class:`ValidatorSource`) reads only:

* ``status()``: the validator's status dict (the one ``status.json`` holds; its fields are listed in
  :mod:`iota_subnet.validator.service`), including the explained scores (``scores``, the rows of
  ``iota-subnet scores``);
* ``metrics.jsonl``: one row per completed lane step (``step, lane, tokens, loss, ...``), tailed;
* the chain, through :class:`~iota_subnet.chain.Chain` reads (block, hyperparameters, metagraph)
  every ``chain_every_s``;
* optionally the miners' ``/health`` (inner step, merges, cache), through a signed client, every
  ``health_every_s``.

A miner's page (:class:`MinerSource`) reads only the miner's ``status()``.

:meth:`snapshot` returns one JSON-ready dict (``GET /api/snapshot``)::

    {"role", "generated_at", "identity": {...}, "totals": {...},
     "series": {name: {"x": label, "y": label, "lines": {series name: [[x, y], ...]}}},
     "pipeline": {"stages": S, "cells": [...]}, "merges": {...}, "scores": {...}, "chain": {...}}

Every plot is one entry of ``series``. Nothing secret is in it: hotkeys, uids and axons are public
on chain; no wallet paths, keys or local file paths.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Optional

from loguru import logger

from iota_subnet.chain import metagraph_json
from iota_subnet.protocol import Health, ProtocolError
from iota_subnet.transport import TransportError

from .history import JsonlTail, Series, per_lane_loss

StatusFn = Callable[[], Mapping[str, Any]]
HealthFn = Callable[[list[dict]], Awaitable[dict[int, dict]]]


class RateMeter:
    """Rate of a cumulative counter over the last ``window_s`` seconds (tokens/s from token totals)."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self._pts: deque[tuple[float, float]] = deque()

    def add(self, t: float, total: float) -> Optional[float]:
        """Record ``total`` at time ``t``; return the rate over the window (None until two points)."""
        if self._pts and total < self._pts[-1][1]:
            self._pts.clear()          # the counter restarted (a resumed process)
        self._pts.append((t, total))
        while len(self._pts) > 2 and t - self._pts[1][0] >= self.window_s:
            self._pts.popleft()
        t0, v0 = self._pts[0]
        return (total - v0) / (t - t0) if t > t0 else None


def _short(hk: Any) -> str:
    return str(hk or "")[:10]


def _path(rec: Optional[dict]) -> Optional[dict]:
    """The path this validator's latest call to a miner took (status.json ``paths``, its ``out``
    record): ``{"kind": "direct" | "relayed", "via": relay ip:port or None}``; None before any call."""
    out = (rec or {}).get("out") or {}
    return {"kind": out.get("kind"), "via": out.get("via")} if out.get("kind") else None


def _finite(v: Any) -> Optional[float]:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f and f not in (float("inf"), float("-inf")) else None


@dataclass(frozen=True)
class ValidatorSourceOptions:
    """How often a :class:`ValidatorSource` reads the chain (``chain_every_s``, seconds) and the
    miners' health (``health_every_s``, seconds), and how many points each plotted series keeps at
    most (``max_points``)."""

    chain_every_s: float = 12.0
    health_every_s: float = 5.0
    max_points: int = 1000


class ValidatorSource:
    """Snapshot source of a validator's dashboard (see the module docstring).

    ``status``: the validator's ``status()``; ``metrics_path``: its ``metrics.jsonl``; ``chain``
    and ``netuid``: chain reads (None: no chain section); ``health``: an async function
    ``replicas -> {uid: health stats}`` (see :func:`health_poller`), None: no health polling;
    ``options``: :class:`ValidatorSourceOptions` (kept as attributes of the same names).
    """

    role = "validator"

    def __init__(self, *, status: StatusFn, metrics_path: str | Path, chain: Any = None, netuid: int = 0,
                 network: str = "", health: Optional[HealthFn] = None,
                 options: ValidatorSourceOptions = ValidatorSourceOptions()):
        self.status, self.chain, self.netuid, self.network = status, chain, int(netuid), network
        self.health = health
        self.chain_every_s, self.health_every_s = options.chain_every_s, options.health_every_s
        self.max_points = options.max_points
        self.tail = JsonlTail(metrics_path)
        self.train_loss: dict[str, Series] = {}
        self.probe_loss = Series(self.max_points)
        self.final_loss = Series(8)
        self.tokens_per_s = Series(self.max_points)
        self.work: dict[str, Series] = {}
        self.weights: dict[str, Series] = {}
        self.rate = RateMeter()
        self.last_status: dict = {}
        self.chain_state: dict = {}
        self.health_state: dict[int, dict] = {}
        self._last_probe_round: Optional[int] = None
        self._last_weights_block: Optional[int] = None
        self._next_chain = 0.0
        self._next_health = 0.0
        self.t0 = time.monotonic()

    # ------------------------------------------------------------------ sampling
    async def sample(self) -> None:
        """One sampling round (the server calls it every second): status, metrics rows, and the
        chain and health reads when they are due. Never raises."""
        now = time.monotonic()
        try:
            self._sample_status(now)
        except Exception as e:  # noqa: BLE001 - a bad round must not stop the dashboard
            logger.debug("dashboard: status sample failed: {}: {}", type(e).__name__, e)
        try:
            rows = self.tail.read()
            if self.tail.reset:
                self.train_loss = {}
            per_lane_loss(rows, self.train_loss, self.max_points)
        except Exception as e:  # noqa: BLE001
            logger.debug("dashboard: metrics.jsonl read failed: {}: {}", type(e).__name__, e)
        if self.chain is not None and now >= self._next_chain:
            self._next_chain = now + self.chain_every_s
            try:
                self.chain_state = await self._read_chain()
            except Exception as e:  # noqa: BLE001 - an unreachable chain shows as such
                self.chain_state = {**self.chain_state, "error": f"{type(e).__name__}: {e}"[:200]}
        if self.health is not None and now >= self._next_health:
            self._next_health = now + self.health_every_s
            try:
                self.health_state = await self.health(list(self.last_status.get("replicas") or []))
            except Exception as e:  # noqa: BLE001
                logger.debug("dashboard: health poll failed: {}: {}", type(e).__name__, e)

    def _sample_status(self, now: float) -> None:
        st = dict(self.status() or {})
        self.last_status = st
        el = _finite(st.get("elapsed_s"))
        x = el if el is not None else now - self.t0
        tokens = _finite(st.get("tokens")) or 0.0
        self.tokens_per_s.add(x, self.rate.add(now, tokens))
        for uid, m in (st.get("miners") or {}).items():
            if isinstance(m, Mapping):
                self.work.setdefault(str(uid), Series(self.max_points)).add(x, _finite(m.get("work")))
        probe = st.get("probe_loss") or {}
        if probe.get("round") is not None and probe.get("round") != self._last_probe_round:
            self._last_probe_round = probe["round"]
            self.probe_loss.add(tokens, _finite(probe.get("loss")))
        if st.get("val_loss") is not None and not len(self.final_loss):
            self.final_loss.add(tokens, _finite(st.get("val_loss")))
        blocks = st.get("weights_set_blocks") or []
        if blocks and blocks[-1] != self._last_weights_block:
            self._last_weights_block = blocks[-1]
            for uid, w in (st.get("last_weights") or {}).items():
                self.weights.setdefault(str(uid), Series(self.max_points)).add(float(blocks[-1]), _finite(w))

    async def _read_chain(self) -> dict:
        c = self.chain
        t0 = time.perf_counter()
        block = await c.block()
        latency = time.perf_counter() - t0
        hp = await c.hyperparameters(self.netuid)
        rows = await metagraph_json(c, self.netuid)
        return {"block": int(block), "latency_ms": round(latency * 1e3, 1), "tempo": hp.get("tempo"),
                "weights_rate_limit": hp.get("weights_rate_limit"), "read_at": time.time(),
                "metagraph": [{"uid": r["uid"], "hotkey": _short(r["hotkey"]), "stake": r["stake"],
                               "validator_permit": r["validator_permit"], "incentive": r["incentive"],
                               "dividends": r["dividends"], "emission": r["emission"], "active": r["active"]}
                              for r in rows]}

    # ------------------------------------------------------------------ snapshot
    def snapshot(self) -> dict:
        st = self.last_status
        scores = list(st.get("scores") or [])
        by_uid_score = {int(r["uid"]): r for r in scores if r.get("uid") is not None}
        ledger = st.get("miners") or {}
        weights = st.get("last_weights") or {}
        cells = []
        relayed = st.get("relayed") or {}           # miner hotkey -> the relays it is reached through
        paths = st.get("paths") or {}               # peer hotkey -> how this validator's calls reached it
        for r in st.get("replicas") or []:
            uid = int(r["uid"])
            h = self.health_state.get(uid) or {}
            led = ledger.get(str(uid)) or {}
            sc = by_uid_score.get(uid) or {}
            flagged = bool(r.get("barred") or (sc.get("clasp") or {}).get("flagged")
                           or (sc.get("audits") or {}).get("flagged"))
            if flagged:
                state = "flagged"
            elif not r.get("available"):
                state = "cooldown"
            elif h.get("error"):
                state = "unreachable"
            elif h and not h.get("ready", True):
                state = "syncing"
            else:
                state = "ok"
            cells.append({"uid": uid, "hotkey": _short(r.get("hotkey")), "stage": r.get("stage"),
                          "lane": r.get("lane"), "state": state, "available": bool(r.get("available")),
                          "throughput": _finite(r.get("throughput")), "successes": r.get("successes"),
                          "failures": r.get("failures"), "inner_step": h.get("inner_step"),
                          "work": _finite(led.get("work")), "tokens": led.get("tokens"),
                          "weight": _finite(weights.get(str(uid))), "quality": sc.get("quality"),
                          "health_error": h.get("error"), "relays": list(relayed.get(r.get("hotkey")) or []),
                          "path": _path(paths.get(r.get("hotkey")))})
        merges = []
        for c in cells:
            h = self.health_state.get(c["uid"]) or {}
            merges.append({"uid": c["uid"], "stage": c["stage"], "merges": h.get("merges"),
                           "merged_epoch": h.get("merged_epoch"), "merges_abandoned": h.get("merges_abandoned"),
                           "merge_last_wall_s": h.get("merge_last_wall_s"),
                           "in_sync": h.get("ready") if "merges" in h else None})
        blocks = list(st.get("weights_set_blocks") or [])
        tempo = self.chain_state.get("tempo")
        rl = self.chain_state.get("weights_rate_limit") or 0
        chain = {**{k: v for k, v in self.chain_state.items() if k != "metagraph"},
                 "network": self.network, "netuid": st.get("netuid", self.netuid),
                 "weights_set_blocks": blocks[-20:], "weights_set": len(blocks),
                 "next_weights_block": (blocks[-1] + max(int(tempo or 0), int(rl or 0), 1)) if blocks and tempo else None,
                 "last_weights": weights, "metagraph": self.chain_state.get("metagraph", [])}
        val_lines = {"held-out (CLASP probes)": self.probe_loss.to_json()}
        if len(self.final_loss):
            val_lines["final evaluation"] = self.final_loss.to_json()
        return {
            "role": self.role, "generated_at": time.time(),
            "identity": {"hotkey": st.get("hotkey"), "uid": st.get("uid"), "run_id": st.get("run_id"),
                         "netuid": st.get("netuid"), "validator_index": st.get("validator_index"),
                         "n_validators": st.get("n_validators")},
            "totals": {k: st.get(k) for k in ("tokens", "tokens_per_s", "loss", "val_loss", "reroutes", "failures",
                                              "microbatches_ok", "microbatches_failed", "live_miners", "lanes",
                                              "steps_done", "total_steps", "done", "elapsed_s", "wire_bytes",
                                              "verification_bytes")},
            "series": {
                "loss": {"title": "Loss against tokens", "x": "tokens", "y": "loss (nats/token)",
                         "lines": {**{f"train, lane {k}": s.to_json() for k, s in sorted(self.train_loss.items())},
                                   **val_lines},
                         "points_only": list(val_lines)},
                "tokens_per_s": {"title": "Throughput", "x": "seconds", "y": "tokens/s",
                                 "lines": {"tokens/s": self.tokens_per_s.to_json()}},
                "work": {"title": "Verified work per miner", "x": "seconds", "y": "work units",
                         "lines": {f"uid {k}": s.to_json() for k, s in sorted(self.work.items(), key=lambda kv: int(kv[0]))}},
            },
            "pipeline": {"stages": len(st.get("stage_replicas") or []) or (max((c["stage"] for c in cells), default=-1) + 1),
                         "lanes": st.get("lanes"), "cells": cells},
            "merges": {"replicas": merges},
            # the miners this validator relays for (its --relay-host): requests and bytes since start
            "relays": st.get("relay"),
            "scores": {"miners": scores},
            "chain": chain,
        }


class MinerSource:
    """Snapshot source of a miner's dashboard: its ``status()`` over time."""

    role = "miner"

    def __init__(self, *, status: StatusFn, max_points: int = 1000):
        self.status = status
        self.max_points = max_points
        self.tokens_per_s = Series(max_points)
        self.inner_step = Series(max_points)
        self.cache_bytes = Series(max_points)
        self.rate = RateMeter()
        self.last_status: dict = {}

    async def sample(self) -> None:
        try:
            st = dict(self.status() or {})
        except Exception as e:  # noqa: BLE001
            logger.debug("dashboard: miner status failed: {}: {}", type(e).__name__, e)
            return
        self.last_status = st
        now = time.monotonic()
        x = _finite(st.get("uptime_s")) or 0.0
        self.tokens_per_s.add(x, self.rate.add(now, _finite(st.get("tokens")) or 0.0))
        self.inner_step.add(x, _finite(st.get("inner_step")))
        self.cache_bytes.add(x, _finite((st.get("cache") or {}).get("bytes")))

    def snapshot(self) -> dict:
        st = self.last_status
        merge = st.get("merge") or None
        return {
            "role": self.role, "generated_at": time.time(),
            "identity": {"hotkey": st.get("hotkey"), "uid": st.get("uid"), "stage": st.get("stage")},
            "totals": {k: st.get(k) for k in ("inner_step", "forwards", "backwards", "tokens", "uptime_s")},
            "series": {
                "tokens_per_s": {"title": "Throughput", "x": "seconds", "y": "tokens/s",
                                 "lines": {"tokens/s": self.tokens_per_s.to_json()}},
                "inner_step": {"title": "Inner steps", "x": "seconds", "y": "inner step",
                               "lines": {"inner step": self.inner_step.to_json()}},
                "cache": {"title": "Activation cache", "x": "seconds", "y": "bytes",
                          "lines": {"bytes held": self.cache_bytes.to_json()}},
            },
            "outcomes": st.get("outcomes") or {},
            "merges": {"replicas": [{"uid": st.get("uid"), "stage": st.get("stage"),
                                     "merges": (merge or {}).get("merges"),
                                     "merged_epoch": (merge or {}).get("merged_epoch"),
                                     "merges_abandoned": (merge or {}).get("abandoned"),
                                     "merge_last_wall_s": ((merge or {}).get("last") or {}).get("wall_s"),
                                     "in_sync": (merge or {}).get("in_sync")}] if merge else [],
                       "last": (merge or {}).get("last")},
        }


def health_poller(client: Any, run_id: str, timeout_s: float = 3.0) -> HealthFn:
    """An async ``replicas -> {uid: stats}`` that asks each replica's ``/health`` (signed, through
    ``client``, a :class:`~iota_subnet.transport.NeuronClient`) at once. A replica that does not
    answer gets ``{"error": ...}``."""

    async def one(r: dict) -> tuple[int, dict]:
        uid = int(r["uid"])
        try:
            h = await client.call(r["endpoint"], r["hotkey"], "/health", Health(run_id=run_id, stage=int(r["stage"])),
                                  Health, timeout_s=timeout_s, retries=0)
        except (ProtocolError, TransportError) as e:
            return uid, {"error": f"{type(e).__name__}: {e}"[:160]}
        return uid, {**{k: v for k, v in (h.stats or {}).items()}, "ready": bool(h.ready), "status": h.status,
                     "inner_step": int(h.inner_step)}

    async def poll(replicas: list[dict]) -> dict[int, dict]:
        got = await asyncio.gather(*(one(r) for r in replicas if r.get("endpoint") and r.get("hotkey")))
        return dict(got)

    return poll
