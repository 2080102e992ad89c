"""Routing: which miner serves which hop of which micro-batch. Pure logic, no network.

Discovery
    A miner announces its stage with a chain commitment ``{"v": 1, "run": <run id>, "stage": k}``.
    :func:`discover` joins the metagraph (uid, hotkey, axon) with the commitments and keeps the
    miners of our run with a served axon; anything else (another run, bad JSON, stage out of
    range, no axon) is ignored.

Lanes
    Replica ``r`` of every stage (ordered by uid) forms lane ``r``: a fixed chain of replicas that
    carries one micro-batch stream. Replicas of a stage are not merged (yet), so they diverge; a
    fixed lane keeps each replica's optimizer on one consistent stream. Until the validator drives
    its first step (:meth:`Router.freeze`) the slots follow the uid order, so that validators that
    discovered the miners in different orders (one saw a stage's second miner first) agree on the
    lanes: they share the lanes, and a replica that two validators put in different lanes would be
    handed the other lane at every step. From then on membership is sticky:
    once assigned, a replica keeps its slot while it stays registered with the same hotkey; a
    freed slot goes to the lowest unassigned uid, else to the replica of the stage's highest slot. ``n_lanes`` is the smallest replica count over
    the stages (extra replicas are spares that only take rerouted hops). A member unavailable for
    ``vacate_after_s`` (120 s) although still registered swaps slots with an available spare
    (:meth:`Router.reassign_vacant`): a lane is not left to alternates, which do not train. The
    validator keeps the assignment in its state (:meth:`Router.slot_table`), so a swap outlives a
    restart of the validator. A miner flagged as a cheater is barred (:meth:`Router.bar`): no hop
    goes to it again, and a spare takes its lane at once.

Rerouting (SWARM parallelism, Ryabinin et al. 2023, arXiv 2301.11913)
    When a hop fails (timeout, refusal, bad reply), the hop is re-sent to another replica of the
    same stage drawn with probability proportional to an exponential moving average of its
    measured throughput (tokens/s), excluding replicas in a failure cooldown and those already
    tried for this hop. A failing replica enters a cooldown that doubles with each consecutive
    failure (capped); when the cooldown has run out it is *due for a probe* and comes back into
    its lane only after a successful ``/health`` (:meth:`Router.mark_healthy`).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from iota_subnet.chain.interface import served_endpoint
from iota_subnet.protocol.commitment import MINER, RunCommitment


Key = tuple[int, str]  # (uid, hotkey)


@dataclass(frozen=True)
class Replica:
    """One miner serving one stage of our run."""

    uid: int
    hotkey: str
    endpoint: str  # "ip:port"
    stage: int

    @property
    def key(self) -> Key:
        return (self.uid, self.hotkey)

    def short(self) -> str:
        return f"uid{self.uid}/{self.hotkey[:6]}@s{self.stage}"


def parse_commitment(raw: Optional[str], run_id: str, n_stages: int, run_epoch: int = 0,
                     spec_hash: str = "") -> Optional[int]:
    """The stage a miner's commitment announces for run (``run_id``, ``run_epoch``), or None
    (absent, malformed, a validator's, other run or epoch, bad stage, or a spec hash ``h`` other than
    ``spec_hash``: another config under this run's name; a commitment without ``h``, from an older
    miner, or an empty ``spec_hash`` is not checked)."""
    c = RunCommitment.decode(raw)
    if c is None or c.role != MINER or not c.same_run(str(run_id), run_epoch) or not 0 <= c.stage < n_stages:
        return None
    if spec_hash and c.spec_hash and c.spec_hash != spec_hash:
        return None
    return c.stage


def discover(neurons: Iterable[Any], commitments: Mapping[str, str], run_id: str,
             n_stages: int, run_epoch: int = 0, spec_hash: str = "") -> dict[int, list[Replica]]:
    """Stage -> replicas (sorted by uid) of run (``run_id``, ``run_epoch``); with ``spec_hash``, miners
    advertising another spec hash are left out (:func:`parse_commitment`).

    ``neurons``: metagraph neurons (``uid``, ``hotkey``, ``axon``); ``commitments``: hotkey -> text.
    """
    out: dict[int, list[Replica]] = {s: [] for s in range(n_stages)}
    for n in neurons:
        stage = parse_commitment(commitments.get(n.hotkey), run_id, n_stages, run_epoch, spec_hash)
        if stage is None:
            continue
        ep = served_endpoint(getattr(n, "axon", None))
        if ep is None:
            continue
        out[stage].append(Replica(int(n.uid), str(n.hotkey), ep, stage))
    for s in out:
        out[s].sort(key=lambda r: r.uid)
    return out


@dataclass
class ReplicaHealth:
    """What the router has measured about one replica."""

    throughput: Optional[float] = None  # EMA of tokens/s over successful hops
    successes: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    cooldown_until: float = 0.0
    needs_probe: bool = False  # failed; back only after a good /health
    last_error: str = ""
    down_since: Optional[float] = None  # clock time it became unavailable (None: available)


@dataclass
class Router:
    """Lanes, SWARM-style rerouting and failure cooldowns over the discovered replicas.

    ``clock``: monotonic seconds (injectable for tests); ``rng``: a ``random.Random``.
    """

    n_stages: int
    ema_alpha: float = 0.3
    cooldown_base_s: float = 2.0
    cooldown_max_s: float = 60.0
    #: a lane member unavailable this long gives its lane to an available spare (:meth:`reassign_vacant`)
    vacate_after_s: float = 120.0
    default_throughput: Optional[float] = None  # prior for replicas never measured (None: mean of measured, else 1)
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.replicas: dict[int, list[Replica]] = {s: [] for s in range(self.n_stages)}
        self.health: dict[Key, ReplicaHealth] = {}
        self._slots: dict[int, list[Optional[Key]]] = {s: [] for s in range(self.n_stages)}
        #: miners flagged as cheaters (:meth:`bar`): never available again
        self.barred: set[Key] = set()
        #: slots are sticky (:meth:`freeze`, or a loaded :meth:`slot_table`); before, they follow the uid order
        self.frozen = False

    # ---------------------------------------------------------------- topology
    def update(self, replicas: Mapping[int, Sequence[Replica]]) -> None:
        """Replace the topology (after a metagraph sync). Measurements of miners still present are kept."""
        before = {r.key: r.endpoint for rs in self.replicas.values() for r in rs}
        self.replicas = {s: sorted(replicas.get(s, []), key=lambda r: r.uid) for s in range(self.n_stages)}
        present = {r.key for rs in self.replicas.values() for r in rs}
        self.health = {k: h for k, h in self.health.items() if k in present}
        for rs in self.replicas.values():
            for r in rs:
                h = self.health.get(r.key)
                if h is not None and h.needs_probe and before.get(r.key) not in (None, r.endpoint):
                    h.cooldown_until = 0.0          # a failed replica served a new endpoint (it restarted): probe now
        for s in range(self.n_stages):
            keys = [r.key for r in self.replicas[s]]
            if not self.frozen:
                self._slots[s] = list(keys)
                continue
            slots = [k if k in keys else None for k in self._slots.get(s, [])]
            free = [k for k in keys if k not in slots]
            for i, k in enumerate(slots):
                if k is None and free:
                    slots[i] = free.pop(0)
            slots.extend(free)
            # a hole left by a departed replica is filled by the highest slot (a spare first)
            for i in range(len(slots)):
                while slots and slots[-1] is None:
                    slots.pop()
                if i < len(slots) and slots[i] is None:
                    slots[i] = slots.pop()
            while slots and slots[-1] is None:
                slots.pop()
            self._slots[s] = slots

    def freeze(self) -> None:
        """Make the lane assignment sticky from now on (the validator drives its first step)."""
        self.frozen = True

    def bar(self, keys: Iterable[Key]) -> list[Key]:
        """Take miners flagged as cheaters out of routing for good: no hop, reroute, alternate or
        audit goes to them (:meth:`is_available` is False, no probe brings them back), and
        :meth:`reassign_vacant` gives each one's lane to an available spare of its stage at once.
        With no spare, that lane's hops of the stage go to alternates (the stage's other replicas,
        which compute them but do not train on them). A barred miner keeps its slot: another
        validator that has not flagged it (each flags on its own) still sees the same lanes, and no
        miner is moved into two lanes. A flagged miner loses its lane, so that the lane's other stages
        do not train on what it sends and merge that into their stages. Tickets already issued (the
        validator's lookahead, 8 steps) still name it. Flags stay with the hotkey (a re-registered
        uid is a new key). Returns the keys barred by this call."""
        new = sorted(set(keys) - self.barred)
        self.barred.update(new)
        return new

    def reassign_vacant(self, lanes: int) -> list[tuple[int, int, Key, Key]]:
        """Give the lane of a member unavailable for ``vacate_after_s``, or barred (at once), to an
        available spare of its stage (slot ``>= lanes``: the validator drives lanes ``0 .. lanes - 1``);
        the two swap slots.
        Without this a lane whose member left for good (its registration and axon stay on chain) would
        be served by alternates, which do not train, for the rest of the run, while the miners that
        joined sit in lanes nobody drives and never merge. Returns
        ``(stage, lane, old key, new key)`` per swap."""
        now = self.clock()
        out = []
        for s in range(self.n_stages):
            slots = self._slots.get(s, [])
            for i in range(min(lanes, len(slots))):
                h = self.health.get(slots[i]) if slots[i] is not None else None
                down = slots[i] in self.barred or (h is not None and h.down_since is not None
                                                    and now - h.down_since >= self.vacate_after_s)
                if not down:
                    continue
                spare = next((j for j in range(lanes, len(slots)) if slots[j] is not None
                              and slots[j] not in self.barred
                              and not (self.health.get(slots[j]) or ReplicaHealth()).needs_probe), None)
                if spare is not None:
                    out.append((s, i, slots[i], slots[spare]))
                    slots[i], slots[spare] = slots[spare], slots[i]
        return out

    def slot_table(self) -> dict[str, list[Optional[list]]]:
        """The lane assignment, JSON-ready: ``{stage: [[uid, hotkey] or None per slot]}``. A
        restarted validator loads it back (:meth:`load_slot_table`) so that the swaps of
        :meth:`reassign_vacant` outlive the process."""
        return {str(s): [list(k) if k is not None else None for k in slots] for s, slots in self._slots.items()}

    def load_slot_table(self, table: Mapping[str, Sequence[Optional[Sequence]]]) -> None:
        """Restore a :meth:`slot_table` before the first :meth:`update`: members still registered
        keep their slots; departed ones leave holes that :meth:`update` fills as usual. Without it a
        restarted validator would hand each vacated lane back to its departed member, which takes
        another ``vacate_after_s`` of non-training alternates to undo.

        Raises ``ValueError`` on a malformed table (the caller starts from the uid order)."""
        slots: dict[int, list[Optional[Key]]] = {s: [] for s in range(self.n_stages)}
        for s_raw, keys in table.items():
            s = int(s_raw)
            if not 0 <= s < self.n_stages:
                continue
            out: list[Optional[Key]] = []
            for k in keys:
                if k is None:
                    out.append(None)
                elif isinstance(k, (list, tuple)) and len(k) == 2:
                    out.append((int(k[0]), str(k[1])))
                else:
                    raise ValueError(f"lane slot {k!r} of stage {s} is not [uid, hotkey] or null")
            slots[s] = out
        self._slots = slots
        self.frozen = True

    @property
    def n_lanes(self) -> int:
        """Complete lanes available now: the smallest replica count over the stages."""
        if self.n_stages == 0:
            return 0
        return min(len(self.replicas[s]) for s in range(self.n_stages))

    def stage_counts(self) -> list[int]:
        return [len(self.replicas[s]) for s in range(self.n_stages)]

    def live_replicas(self) -> list[Replica]:
        return [r for s in range(self.n_stages) for r in self.replicas[s]]

    def get(self, key: Key) -> Optional[Replica]:
        for rs in self.replicas.values():
            for r in rs:
                if r.key == key:
                    return r
        return None

    def lane_member(self, lane: int, stage: int) -> Optional[Replica]:
        """The replica holding slot ``lane`` of ``stage`` (whether healthy or not), or None."""
        slots = self._slots.get(stage, [])
        if 0 <= lane < len(slots) and slots[lane] is not None:
            return self.get(slots[lane])
        return None

    def lanes(self) -> list[list[Optional[Replica]]]:
        """``[lane][stage]`` membership for the complete lanes (for status output)."""
        return [[self.lane_member(l, s) for s in range(self.n_stages)] for l in range(self.n_lanes)]

    # ---------------------------------------------------------------- health
    def _h(self, key: Key) -> ReplicaHealth:
        h = self.health.get(key)
        if h is None:
            h = self.health[key] = ReplicaHealth()
        return h

    def is_available(self, r: Replica) -> bool:
        """Not barred (:meth:`bar`), not cooling down and not waiting for a good /health probe."""
        if r.key in self.barred:
            return False
        h = self.health.get(r.key)
        return h is None or not h.needs_probe

    def cooldown_s(self, consecutive_failures: int) -> float:
        return min(self.cooldown_max_s, self.cooldown_base_s * 2 ** max(0, consecutive_failures - 1))

    def record_failure(self, r: Replica, error: str = "") -> float:
        """A hop to ``r`` failed: start (or extend) its cooldown. Returns the cooldown in seconds."""
        h = self._h(r.key)
        h.failures += 1
        h.last_error = error
        now = self.clock()
        if h.needs_probe and now < h.cooldown_until:
            # already cooling down: the in-flight hops that fail with it are one outage, not many
            # (a burst of them must not push the first probe to the cap)
            return h.cooldown_until - now
        h.consecutive_failures += 1
        h.needs_probe = True
        if h.down_since is None:
            h.down_since = now
        cd = self.cooldown_s(h.consecutive_failures)
        h.cooldown_until = now + cd
        return cd

    def record_success(self, r: Replica, tokens: int, seconds: float) -> None:
        """A hop to ``r`` succeeded: update its throughput EMA (tokens/s)."""
        h = self._h(r.key)
        h.successes += 1
        h.consecutive_failures = 0
        tput = float(tokens) / max(float(seconds), 1e-6)
        h.throughput = tput if h.throughput is None else (1 - self.ema_alpha) * h.throughput + self.ema_alpha * tput

    def probe_due(self) -> list[Replica]:
        """Failed replicas whose cooldown has run out: probe them with /health."""
        now = self.clock()
        return [r for r in self.live_replicas() if r.key not in self.barred
                and (h := self.health.get(r.key)) is not None and h.needs_probe and now >= h.cooldown_until]

    def next_probe_in(self) -> Optional[float]:
        """Seconds until the next failed replica is due for a probe (0 if one is due), None if none failed."""
        now = self.clock()
        waits = [max(0.0, h.cooldown_until - now) for r in self.live_replicas()
                 if r.key not in self.barred and (h := self.health.get(r.key)) is not None and h.needs_probe]
        return min(waits) if waits else None

    def mark_healthy(self, r: Replica) -> None:
        """A /health probe succeeded: the replica is back (in its lane and as a reroute target)."""
        h = self._h(r.key)
        h.needs_probe = False
        h.cooldown_until = 0.0
        h.down_since = None

    def probe_failed(self, r: Replica, error: str = "") -> float:
        """A /health probe failed: a longer cooldown."""
        return self.record_failure(r, error or "health probe failed")

    # ---------------------------------------------------------------- choice
    def throughput(self, r: Replica) -> float:
        h = self.health.get(r.key)
        if h is not None and h.throughput is not None:
            return h.throughput
        if self.default_throughput is not None:
            return self.default_throughput
        known = [h.throughput for h in self.health.values() if h.throughput is not None]
        return sum(known) / len(known) if known else 1.0

    def choose(self, stage: int, exclude: Iterable[Key] = ()) -> Optional[Replica]:
        """A replica of ``stage`` drawn with probability proportional to its throughput EMA
        (SWARM's stochastic wiring), among available replicas not in ``exclude``; None if none."""
        ex = set(exclude)
        cands = [r for r in self.replicas.get(stage, []) if r.key not in ex and self.is_available(r)]
        if not cands:
            return None
        weights = [max(self.throughput(r), 1e-9) for r in cands]
        return self.rng.choices(cands, weights=weights, k=1)[0]

    def snapshot(self) -> list[dict]:
        """JSON-ready view of every replica (status output)."""
        out = []
        for r in self.live_replicas():
            h = self.health.get(r.key) or ReplicaHealth()
            lane = next((i for i, k in enumerate(self._slots.get(r.stage, [])) if k == r.key), None)
            out.append({"uid": r.uid, "hotkey": r.hotkey, "stage": r.stage, "endpoint": r.endpoint,
                        "lane": lane if lane is not None and lane < self.n_lanes else None,
                        "available": self.is_available(r), "barred": r.key in self.barred,
                        "throughput": h.throughput,
                        "successes": h.successes, "failures": h.failures})
        return out
