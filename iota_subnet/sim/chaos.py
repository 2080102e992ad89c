"""Fault injection for a local network: ``iota-subnet localnet --chaos SPEC``.

SPEC is a comma-separated list of ``KIND=RATE/min``, ``seed=N`` and optionally ``min_live=N`` (the
fewest live replicas an event may leave a stage with; default 1), e.g.
``kill=2/min,pause=1/min,join=0.5/min,seed=7,min_live=2``. Each kind is a Poisson process with that rate
(events per minute of wall time); the schedule is drawn once from the seed, so a run is repeatable.

======================= =======================================================================
``kill``                SIGKILL a miner; the supervisor restarts it after ``restart_s`` (it resumes
                        from its checkpoint or syncs from its peers)
``pause``               SIGSTOP a miner for ``pause_s``, then SIGCONT (a stalled GPU)
``leave``               a miner quits for good (SIGTERM, never restarted)
``join``                a new miner registers mid-run on the stage with the fewest running replicas
``partition``           a miner's links drop for ``partition_s`` (every send fails; see
                        :mod:`iota_subnet.transport.shaping`)
``slow``                a miner slows by ``slow_factor`` for ``slow_s``: its uplink (when shaped,
                        ``--link``) and its compute (every forward, backward and step)
``validator-kill``      SIGKILL a validator; restarted after ``restart_s`` (it resumes from its state)
======================= =======================================================================

Targets are drawn uniformly among the miners (validators) the kind applies to; an event that would
leave a stage with fewer than ``min_live`` live replicas is skipped (and logged as skipped). Every
injection and every recovery is a line of ``OUT/chaos.jsonl``:
``{"t": seconds since start, "event": "inject" | "recover" | "skip", "kind", "target", ...}``.
"""
from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from iota_subnet.config import ConfigError

CHAOS_KINDS = ("kill", "pause", "leave", "join", "partition", "slow", "validator-kill")
#: the kinds that hit a live miner of a stage above ``min_live`` live replicas (the others add a miner or hit a validator)
MINER_FAULTS = ("kill", "pause", "leave", "partition", "slow")
_RATE = re.compile(r"^\s*([a-z-]+)\s*=\s*([0-9]*\.?[0-9]+)\s*/\s*(min|m|s|sec)\s*$")


@dataclass(frozen=True)
class ChaosSpec:
    """Rates (events per minute) per kind, the seed and the fault durations (seconds)."""

    rates: dict = field(default_factory=dict)
    seed: int = 0
    restart_s: tuple[float, float] = (1.0, 5.0)
    pause_s: tuple[float, float] = (2.0, 10.0)
    partition_s: tuple[float, float] = (3.0, 12.0)
    slow_s: tuple[float, float] = (5.0, 15.0)
    slow_factor: tuple[float, float] = (2.0, 5.0)
    min_live: int = 1

    @staticmethod
    def parse(text: str, *, min_live: int = 1) -> "ChaosSpec":
        """Parse ``kind=R/min,...,seed=N[,min_live=N]`` (``min_live`` in the text overrides the
        argument; a rate of 0 leaves that kind out); raises :class:`ConfigError` naming the bad part,
        a key given twice, or a spec whose rates are all 0."""
        rates: dict[str, float] = {}
        seed = 0
        seen: set[str] = set()
        for part in (p for p in text.split(",") if p.strip()):
            key = part.split("=", 1)[0].strip()
            if "=" in part and key in seen:
                raise ConfigError(f"--chaos: {key} is given twice ({text.strip()!r}); give each kind once")
            seen.add(key)
            if part.strip().startswith("min_live="):
                try:
                    min_live = int(part.strip()[9:])
                except ValueError:
                    min_live = -1
                if min_live < 1:
                    raise ConfigError(f"--chaos: min_live must be an integer >= 1, got {part.strip()!r}")
                continue
            if part.strip().startswith("seed="):
                try:
                    seed = int(part.strip()[5:])
                except ValueError:
                    raise ConfigError(f"--chaos: seed must be an integer, got {part.strip()!r}") from None
                continue
            m = _RATE.match(part)
            if m is None:
                raise ConfigError(f"--chaos: cannot read {part.strip()!r}; write KIND=RATE/min, e.g. kill=2/min "
                                  f"(kinds: {', '.join(CHAOS_KINDS)})")
            kind, rate, unit = m.group(1), float(m.group(2)), m.group(3)
            if kind not in CHAOS_KINDS:
                raise ConfigError(f"--chaos: unknown kind {kind!r}; one of {', '.join(CHAOS_KINDS)}")
            rates[kind] = rate * (60.0 if unit in ("s", "sec") else 1.0)
        if not any(r > 0 for r in rates.values()):
            raise ConfigError("--chaos: no fault kinds given" + (" (every rate is 0)" if rates else "")
                              + "; e.g. --chaos kill=2/min,pause=1/min,seed=7")
        return ChaosSpec(rates=rates, seed=seed, min_live=min_live)

    def schedule(self, duration_s: float) -> list[tuple[float, str]]:
        """``(seconds from start, kind)`` for every event in ``[0, duration_s)``, sorted, from the seed."""
        rng = random.Random(self.seed)
        out: list[tuple[float, str]] = []
        for kind in CHAOS_KINDS:                # fixed order: the same seed gives the same schedule
            rate = self.rates.get(kind, 0.0) / 60.0
            if rate <= 0:
                continue
            t = rng.expovariate(rate)
            while t < duration_s:
                out.append((t, kind))
                t += rng.expovariate(rate)
        return sorted(out)


@dataclass
class Fault:
    """One injected fault, open until it recovers."""

    kind: str
    target: str
    injected_at: float
    ends_at: Optional[float] = None          # when the harness undoes it (pause, partition, slow, restart)
    undone_at: Optional[float] = None
    recovered_at: Optional[float] = None
    mark: dict = field(default_factory=dict)  # what recovery is measured against (e.g. work counters)
    detail: dict = field(default_factory=dict)


class ChaosLog:
    """``chaos.jsonl`` plus the summary of what was injected and how long recovery took."""

    def __init__(self, path: Path, clock=time.monotonic):
        self.path, self.clock = Path(path), clock
        self.t0 = clock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")
        self.faults: list[Fault] = []
        self.skipped: dict[str, int] = {}

    def write(self, event: str, kind: str, target: str, **extra) -> None:
        row = {"t": round(self.clock() - self.t0, 3), "event": event, "kind": kind, "target": target, **extra}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def inject(self, fault: Fault) -> None:
        self.faults.append(fault)
        self.write("inject", fault.kind, fault.target, **fault.detail)

    def recover(self, fault: Fault) -> None:
        fault.recovered_at = self.clock()
        self.write("recover", fault.kind, fault.target, after_s=round(fault.recovered_at - fault.injected_at, 3))

    def skip(self, kind: str, why: str) -> None:
        self.skipped[kind] = self.skipped.get(kind, 0) + 1
        self.write("skip", kind, "", why=why)

    def close(self) -> None:
        self._f.close()

    def summary(self) -> dict:
        by_kind: dict[str, int] = {}
        recover: dict[str, list[float]] = {}
        for f in self.faults:
            by_kind[f.kind] = by_kind.get(f.kind, 0) + 1
            if f.recovered_at is not None:
                recover.setdefault(f.kind, []).append(f.recovered_at - f.injected_at)
        unrecovered = [{"kind": f.kind, "target": f.target} for f in self.faults
                       if f.recovered_at is None and f.kind != "leave"]
        return {"events": len(self.faults), "events_by_kind": by_kind, "skipped_by_kind": dict(self.skipped),
                "recover_s": {k: {"mean": sum(v) / len(v), "max": max(v), "n": len(v)} for k, v in recover.items()},
                "unrecovered": unrecovered}


def uniform(rng: random.Random, bounds: tuple[float, float]) -> float:
    lo, hi = bounds
    return lo + (hi - lo) * rng.random() if hi > lo else lo


def rate_text(rates: dict) -> str:
    return ",".join(f"{k}={v:g}/min" for k, v in rates.items() if v and math.isfinite(v))


def _status(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def served(status: dict) -> int:
    """Hops a miner completed (from its status.json): what recovery is measured with."""
    counts = (status.get("dataplane") or {}).get("counts") or {}
    return int(counts.get("receipts_ok", 0))


def checked_chaos(text: str, replicas: int, duration_s: Optional[float]) -> ChaosSpec:
    """``--chaos`` parsed (:meth:`ChaosSpec.parse`) and checked against the network it will hit: a
    spec none of whose miner faults could ever run (every stage at or below ``min_live`` live
    replicas and no joins to add one) would run undisturbed while saying it is disturbed. Raises
    :class:`ConfigError` saying how to fix it."""
    if not text.strip():
        raise ConfigError("--chaos: empty spec; give e.g. --chaos kill=2/min,pause=1/min,seed=7, or leave --chaos out")
    if duration_s is not None and not duration_s > 0:
        raise ConfigError(f"--chaos-duration must be > 0 seconds, got {duration_s}")
    spec = ChaosSpec.parse(text, min_live=1)
    picked = sorted(k for k, r in spec.rates.items() if r > 0 and k in MINER_FAULTS)
    if picked and spec.rates.get("join", 0) <= 0 and replicas <= spec.min_live:
        raise ConfigError(f"--chaos: {', '.join(picked)} would never run: a miner fault hits only a stage with more "
                          f"than min_live={spec.min_live} live replicas, and each stage has {replicas}; use --replicas "
                          f"{spec.min_live + 1} or more (min_live defaults to 1), or add join=R/min")
    return spec


class ChaosInjector:
    """Runs a :class:`ChaosSpec` against a :class:`~iota_subnet.network.localnet.LocalNet` (called once a
    second from its monitor loop). ``net`` provides ``children`` (name, kind, stage, proc, out, alive()),
    ``kill``/``pause``/``resume``/``retire``/``schedule_restart``, ``add_miner(stage)`` and
    ``set_link(child, state)``."""

    def __init__(self, net, spec: ChaosSpec, log: ChaosLog, duration_s: float, clock=time.monotonic):
        self.net, self.spec, self.log, self.clock = net, spec, log, clock
        self.rng = random.Random(spec.seed + 1)
        self.t0 = clock()
        self.pending = spec.schedule(duration_s)
        self.open: list[Fault] = []

    # ---------------------------------------------------------------- targets
    def _live_miners(self, stage: Optional[int] = None) -> list:
        """Miners running now and not held down by a fault (a fault the harness has undone counts as
        over here even while its recovery, the miner serving again, is still being measured)."""
        return [c for c in self.net.children if c.kind == "miner" and c.alive() and not getattr(c, "left", False)
                and not self._down(c) and (stage is None or c.stage == stage)]

    def _down(self, child) -> bool:
        """A fault on ``child`` the harness has not undone yet (a kill not yet restarted)."""
        return any(f.target == child.name and f.undone_at is None for f in self.open)

    def _stage_live(self, stage: int) -> int:
        return sum(1 for c in self._live_miners(stage))

    def _pick_miner(self, kind: str):
        cands = [c for c in self._live_miners() if self._stage_live(c.stage) > self.spec.min_live]
        if not cands:
            self.log.skip(kind, f"every stage is at {self.spec.min_live} live replica(s) or fewer")
            return None
        return cands[self.rng.randrange(len(cands))]

    # ---------------------------------------------------------------- events
    def tick(self) -> None:
        now = self.clock() - self.t0
        while self.pending and self.pending[0][0] <= now:
            _, kind = self.pending.pop(0)
            self._inject(kind)
        self._undo_due()
        self._check_recovered()

    def _inject(self, kind: str) -> None:
        now = self.clock()
        if kind == "join":
            # the stage with the fewest running replicas (a faulted one still counts: it comes back), ties
            # drawn from the seed: joins refill what leaves emptied instead of piling onto stage 0
            counts = {s: sum(1 for c in self.net.children if c.kind == "miner" and c.stage == s and c.alive()
                             and not getattr(c, "left", False)) for s in range(self.net.stages)}
            fewest = min(counts.values())
            ties = [s for s in sorted(counts) if counts[s] == fewest]
            stage = ties[self.rng.randrange(len(ties))]
            child = self.net.add_miner(stage)
            self._open(Fault(kind, child.name, now, ends_at=now, detail={"stage": stage}), {"served": 0})
            return
        if kind == "validator-kill":
            # a validator back up may be killed again before it has driven a step (its start-up is slow)
            vals = [c for c in self.net.children if c.kind == "validator" and c.alive() and not self._down(c)]
            if not vals:
                self.log.skip(kind, "no live validator")
                return
            c = vals[self.rng.randrange(len(vals))]
            delay = uniform(self.rng, self.spec.restart_s)
            mark = sum((_status(c.out / "status.json").get("steps_done") or {}).values())
            self.net.kill(c)
            self.net.schedule_restart(c, now + delay)
            self._open(Fault(kind, c.name, now, ends_at=now + delay, detail={"restart_after_s": round(delay, 2)}),
                       {"steps": mark})
            return
        c = self._pick_miner(kind)
        if c is None:
            return
        if kind == "kill":
            delay = uniform(self.rng, self.spec.restart_s)
            self.net.kill(c)
            self.net.schedule_restart(c, now + delay)
            self._open(Fault(kind, c.name, now, ends_at=now + delay, detail={"restart_after_s": round(delay, 2)}),
                       {"served": 0})
        elif kind == "pause":
            d = uniform(self.rng, self.spec.pause_s)
            self.net.pause(c)
            self._open(Fault(kind, c.name, now, ends_at=now + d, detail={"pause_s": round(d, 2)}),
                       {"served": served(_status(c.out / "status.json"))})
        elif kind == "leave":
            self.net.retire(c)
            f = Fault(kind, c.name, now, detail={"stage": c.stage})
            self.log.inject(f)
            f.recovered_at = now             # nothing comes back: the network goes on without it
        elif kind in ("partition", "slow"):
            d = uniform(self.rng, self.spec.partition_s if kind == "partition" else self.spec.slow_s)
            state = {"down": True} if kind == "partition" else {"slow": round(uniform(self.rng, self.spec.slow_factor), 2)}
            self.net.set_link(c, state)
            self._open(Fault(kind, c.name, now, ends_at=now + d, detail={"for_s": round(d, 2), **state}),
                       {"served": served(_status(c.out / "status.json"))})

    def _open(self, fault: Fault, mark: dict) -> None:
        fault.mark = mark
        self.open.append(fault)
        self.log.inject(fault)

    def _child(self, name: str):
        return next(c for c in self.net.children if c.name == name)

    def _undo_due(self) -> None:
        now = self.clock()
        for f in self.open:
            if f.ends_at is None or f.undone_at is not None or now < f.ends_at:
                continue
            c = self._child(f.target)
            if f.kind == "pause":
                self.net.resume(c)
            elif f.kind in ("partition", "slow"):
                self.net.set_link(c, {})
                f.mark["served"] = served(_status(c.out / "status.json"))
            f.undone_at = now

    def _check_recovered(self) -> None:
        for f in self.open:
            if f.recovered_at is not None or (f.ends_at is not None and f.undone_at is None):
                continue
            c = self._child(f.target)
            st = _status(c.out / "status.json")
            if f.kind == "validator-kill":
                ok = c.alive() and sum((st.get("steps_done") or {}).values()) > f.mark["steps"]
            else:
                started = (c.started_at or 0) >= f.injected_at if f.kind in ("kill", "join") else True
                ok = c.alive() and started and served(st) > f.mark["served"]
            if ok:
                self.log.recover(f)
        self.open = [f for f in self.open if f.recovered_at is None]
