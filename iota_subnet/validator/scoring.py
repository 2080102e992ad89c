"""Scoring: per-miner accounting of verified work and the weights it earns.

Accounting is keyed by ``(uid, hotkey)``: when a uid is re-registered to another hotkey, the new
hotkey starts from nothing and the old hotkey's record earns the uid nothing.

Verified work: a hop counts for a miner once its forward *and* its backward for that micro-batch
have come back well formed (the last stage does both in its ``/forward``). It is counted in
tokens and in ``work = tokens x stage compute share`` (FLOPs per token of the stage over the
whole model's).

Weights: each stage has a budget proportional to its compute (FLOPs per token of the stage,
:meth:`PipelineStage.flops_per_token`); inside a stage the budget is split in proportion to
``tokens x reliability`` with ``reliability = completed / (completed + failures)``. Budgets of
stages with no scored miner are dropped and the rest renormalised so the weights sum to 1.
Anything non-finite or negative scores 0.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping, Optional

from iota_subnet import plan
from iota_subnet.config import RunConfig

Key = tuple[int, str]


def stage_flops(cfg: RunConfig) -> list[int]:
    """Training FLOPs per token of every stage (forward + backward), counted from the shapes alone
    (:func:`iota_subnet.plan.stage_flops`: building an 8b stage on CPU to count them takes ~32 GB)."""
    return [plan.stage_flops(cfg.model, cfg.pipeline, cfg.data.seq_len, s).train(False)
            for s in range(cfg.pipeline.stages)]


def stage_compute_shares(cfg_or_flops: RunConfig | Iterable[float]) -> list[float]:
    """Each stage's fraction of the model's compute per token (sums to 1)."""
    flops = stage_flops(cfg_or_flops) if isinstance(cfg_or_flops, RunConfig) else [float(f) for f in cfg_or_flops]
    flops = [f if math.isfinite(f) and f > 0 else 0.0 for f in flops]
    total = sum(flops)
    if total <= 0:
        return [1.0 / len(flops)] * len(flops) if flops else []
    return [f / total for f in flops]


def _finite(x: float) -> float:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return 0.0
    return x if math.isfinite(x) and x > 0 else 0.0


@dataclass
class MinerRecord:
    uid: int
    hotkey: str
    stage: int
    forwards: int = 0  # forwards that came back well formed
    backwards: int = 0  # backwards that came back well formed (the last stage: with its forward)
    completed: int = 0  # micro-batches with both (verified work)
    tokens: int = 0  # tokens of verified work
    work: float = 0.0  # tokens x stage compute share
    failures: int = 0  # hops that failed (timeout, refusal, malformed / non-finite reply)
    reroutes: int = 0  # hops it served in place of another replica
    last_seen: float = 0.0

    @property
    def key(self) -> Key:
        return (self.uid, self.hotkey)

    @property
    def reliability(self) -> float:
        n = self.completed + self.failures
        return self.completed / n if n else 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Ledger:
    """All miners' records, plus the stage compute shares used to weight work."""

    shares: list[float]
    records: dict[Key, MinerRecord] = field(default_factory=dict)

    def record(self, uid: int, hotkey: str, stage: int) -> MinerRecord:
        key = (int(uid), str(hotkey))
        rec = self.records.get(key)
        if rec is None:
            rec = self.records[key] = MinerRecord(int(uid), str(hotkey), int(stage))
        rec.stage = int(stage)
        rec.last_seen = time.time()
        return rec

    def forward_ok(self, uid: int, hotkey: str, stage: int) -> None:
        self.record(uid, hotkey, stage).forwards += 1

    def credit(self, uid: int, hotkey: str, stage: int, tokens: int) -> None:
        """Forward and backward of one micro-batch verified: ``tokens`` of work at ``stage``."""
        rec = self.record(uid, hotkey, stage)
        rec.backwards += 1
        rec.completed += 1
        rec.tokens += int(tokens)
        share = self.shares[stage] if 0 <= stage < len(self.shares) else 0.0
        rec.work += float(tokens) * share

    def fail(self, uid: int, hotkey: str, stage: int) -> None:
        self.record(uid, hotkey, stage).failures += 1

    def reroute(self, uid: int, hotkey: str, stage: int) -> None:
        self.record(uid, hotkey, stage).reroutes += 1

    def totals(self) -> dict:
        return {"tokens": sum(r.tokens for r in self.records.values()),
                "failures": sum(r.failures for r in self.records.values()),
                "reroutes": sum(r.reroutes for r in self.records.values())}

    def weights(self, current: Mapping[int, str], exclude_uids: Iterable[int] = ()) -> dict[int, float]:
        """uid -> weight (sums to 1, or empty when nobody scored).

        ``current``: uid -> hotkey from the metagraph now; records of another hotkey for a uid
        (re-registered) and of uids no longer present score nothing.
        """
        return compute_weights(self.records.values(), self.shares, current, exclude_uids)


def compute_weights(records: Iterable[MinerRecord], shares: list[float], current: Mapping[int, str],
                    exclude_uids: Iterable[int] = ()) -> dict[int, float]:
    """See the module docstring. Pure function of the records."""
    excluded = set(int(u) for u in exclude_uids)
    per_stage: dict[int, dict[int, float]] = {}
    for rec in records:
        if rec.uid in excluded or current.get(rec.uid) != rec.hotkey:
            continue
        if not 0 <= rec.stage < len(shares):
            continue
        score = _finite(rec.tokens) * _finite(rec.reliability)
        if score <= 0:
            continue
        per_stage.setdefault(rec.stage, {})
        per_stage[rec.stage][rec.uid] = per_stage[rec.stage].get(rec.uid, 0.0) + score
    budgets = {s: _finite(shares[s]) for s in per_stage}
    total_budget = sum(budgets.values())
    if total_budget <= 0:
        return {}
    out: dict[int, float] = {}
    for s, scores in per_stage.items():
        tot = sum(scores.values())
        if tot <= 0 or budgets[s] <= 0:
            continue
        for uid, sc in scores.items():
            out[uid] = out.get(uid, 0.0) + budgets[s] / total_budget * sc / tot
    z = sum(out.values())
    if not math.isfinite(z) or z <= 0:
        return {}
    return {u: w / z for u, w in sorted(out.items()) if _finite(w / z) > 0}


# ---------------------------------------------------------------------------------------------
# Scores over tempos: verified work rates, quality factors, staleness
# ---------------------------------------------------------------------------------------------

@dataclass
class ScoreEntry:
    """One miner's score and the reasons behind its latest update (see :class:`Scoreboard`)."""

    uid: int
    hotkey: str
    stage: int
    score: float = 0.0         # rate x quality x freshness: what the stage budget is split by
    rate: float = 0.0          # verified work per active tempo over the window (work units)
    last_work: float = 0.0     # ledger work at the previous update
    new_work: float = 0.0      # verified work since the previous update
    quality: float = 1.0       # the latest quality factor, in [0, 1]
    freshness: float = 1.0     # staleness factor, in (0, 1]
    lag: int = 0               # tempos without verified work of its own while this validator verified others'
    idle: int = 0              # tempos since its last verified work
    stale: bool = False        # freshness < 1: its score is not current and costs weight
    weight: float = 0.0        # the latest weight this validator computed
    updates: int = 0
    bins: list = field(default_factory=list)   # [active tempo index, work] inside the window
    blocked: list = field(default_factory=list)  # active tempo indices it was blocked by another's fault
    lagged: list = field(default_factory=list)   # update times (clock s) its lag grew, since its last work
    why: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Scoreboard:
    """Scores from verified work rates, so that equal verified work earns equal weight whatever the
    timing, and stale scores cost weight.

    Clock: one update per weights round (a tempo). An *active* tempo is one in which this validator
    credited any verified work (to anyone); windows count active tempos, so nothing slides while no
    work is verified (after a run ends, between runs).

    At every update, for each ledger record:

    * ``new_work``: verified work (tokens x stage compute share, :class:`Ledger`) since the last update;
    * ``rate`` = its verified work in the last ``window`` active tempos / the number of active tempos
      from its first to its last tempo with work in that window, where a tempo in which it was
      *blocked* (below) counts only ``min(1, its work in that tempo / its rate in the tempos it was
      not blocked in)``: work per tempo while it was working, at the pace it kept when nobody else
      held it back. Two replicas with the same verified work over the same span get the same rate, even
      when their lanes' steps fall on different sides of tempo boundaries or one lane ends a tempo
      before the other (today's exponential average froze a 2.5x gap in ``make localnet``);
      a newcomer is scored on its own span from its first tempo;
    * *blocked* (``blocked``: key -> since when, from the control plane, :mod:`.hindrance`): a miner
      whose attempts were failed or slowed by another miner's fault (a neighbour that does not
      answer, output proven bad) and that was not charged a failure itself since. Every tempo ending
      after that time (this one included, earlier ones too: a fault is often known only after its
      timeouts) counts in its rate span only in proportion to the work it verified in it (above),
      and its ``lag`` does not grow in it (growth already counted there is taken back). So a miner
      slowed by another's fault keeps its share of verified work, and gains nothing from the fault
      (its rate stays its unblocked pace); a miner that is itself unreachable or failing is never
      blocked and goes stale as before. At most :meth:`excuse_cap` tempos (half the window unless
      ``max_excused`` says otherwise) of one miner are excused per window: a fault the routing did
      not get around in that time, or a colluding neighbour that keeps failing, no longer excuses it,
      so a miner cannot keep its rate for long on a few tempos of work by having a sybil stall it;
    * ``quality``: product of the factors given (audits: 0 when flagged; CLASP), in [0, 1];
    * ``freshness`` = ``2^-max(0, lag - grace) x 2^-max(0, quiet - grace) x 2^-max(0, stalled -
      stall_grace)``: ``lag`` counts the tempos in which this validator verified others' work but
      none of the miner's (a miner that stopped, or that no lane reaches), ``quiet`` the tempos in
      which this validator verified no work at all (everyone stale alike: after a run, with no
      lanes); ``grace`` tempos of either are free (lanes finish a little apart). ``stalled`` counts
      the consecutive tempos in which every lane this validator drives was stalled (no lane step
      completed; work may still trickle in from micro-batches of steps that never complete): from
      the second such tempo every score halves per tempo, so stale scores are not renormalised
      into pay. ``stale`` = freshness < 1 (shown in explanations);
    * ``score`` = rate x quality x freshness.

    Weights (:meth:`weights`): each stage's budget is proportional to its compute share (over the
    stages with a scored miner); inside a stage, miner u gets ``budget x rate_u q_u f_u / D`` with
    ``D = sum_v rate_v q_v r_v`` (``r``: the relative freshness ``2^-max(0, lag - grace)``) while
    the stage has a fresh miner, else ``D = sum_v rate_v q_v``. So a caught cheater's share (q = 0)
    and a departed miner's (r < 1) go to the replicas of its stage that work now, while a stage
    nobody serves any more, or a validator that verifies nothing (``quiet``), loses weight: the
    weights then sum to less than 1 and the validator puts the rest on its burn uid
    (:func:`with_burn`; the chain normalises weights, so that is the only way a stale score is not
    republished as current). Anything non-finite scores 0.
    """

    window: int = 16
    grace: int = 2
    entries: dict[Key, ScoreEntry] = field(default_factory=dict)
    tempo: int = 0              # updates so far
    active: int = 0             # updates in which any verified work was credited
    quiet: int = 0              # consecutive updates without any verified work
    stalled: int = 0            # consecutive updates in which every driven lane was stalled
    stall_grace: int = 1        # stalled updates that are free (a lane step may span a tempo boundary)
    #: blocked tempos a miner may be excused in per window (None: half the window); see the class docstring
    max_excused: Optional[int] = None
    history: list = field(default_factory=list)   # [time, active index or None] of the last window updates

    def update(self, ledger: Ledger, quality: Mapping[Key, tuple[float, list[str]]] | None = None,
               unrouted: Iterable[Key] = (), lanes_stalled: bool = False,
               blocked: Mapping[Key, float] | None = None, at: Optional[float] = None,
               paused: bool = False) -> None:
        """One tempo. ``quality``: key -> (factor, reasons); ``unrouted``: miners this validator gave
        no work this tempo by its own choice (e.g. the lane they serve finished its steps): their
        ``lag`` does not grow; ``lanes_stalled``: this validator drives lanes and none of them
        completed a step since the previous update; ``blocked``: key -> clock seconds since which the
        miner was held back by another miner's fault (see the class docstring); ``at``: this update's
        time on the same clock (default ``time.time()``); ``paused``: the lanes wait while their
        replicas merge (:class:`~iota_subnet.validator.pacing.StallWatch`): a tempo without verified
        work then leaves every score as it was (no ``quiet``, ``lag`` or stall grows: a merge on a slow
        link spans many short tempos and is nobody's fault)."""
        quality = quality or {}
        unrouted = set(unrouted)
        blocked = dict(blocked or {})
        at = time.time() if at is None else float(at)
        W, grace = max(1, int(self.window)), max(0, int(self.grace))
        new: dict[Key, float] = {}
        for key, rec in ledger.records.items():
            e = self.entries.get(key)
            if e is None:
                e = self.entries[key] = ScoreEntry(rec.uid, rec.hotkey, rec.stage)
            e.stage = rec.stage
            work = _finite(rec.work)
            new[key] = _finite(work - e.last_work)
            e.last_work = work
        any_work = any(v > 0 for v in new.values())
        self.tempo += 1
        if paused and not any_work:
            return
        if any_work:
            self.active += 1
            self.quiet = 0
        else:
            self.quiet += 1
        self.stalled = self.stalled + 1 if lanes_stalled else 0
        self.history = (self.history + [[at, self.active if any_work else None]])[-W:]
        stall = 2.0 ** -max(0, self.stalled - max(0, int(self.stall_grace)))
        lo = self.active - W + 1
        for key, e in self.entries.items():
            e.new_work = new.get(key, 0.0)
            since = blocked.get(key)
            excused = since is not None and self._excuse(e, float(since))
            if e.new_work > 0:
                e.bins.append([self.active, e.new_work])
                e.idle = e.lag = 0
                e.lagged = []
            else:
                e.idle += 1
                if any_work and key not in unrouted and not excused:
                    e.lag += 1
                    e.lagged = (e.lagged + [at])[-W:]
            e.bins = [b for b in e.bins if b[0] >= lo]
            e.blocked = [a for a in e.blocked if a >= lo]
            span = self._span(e)
            e.rate = _finite(sum(b[1] for b in e.bins) / span) if span else 0.0
            q, why = quality.get(key, (1.0, []))
            e.quality = min(1.0, _finite(q))
            e.freshness = self.relative_freshness(e) * 2.0 ** -max(0, self.quiet - grace) * stall
            e.stale = e.freshness < 1.0
            e.score = _finite(e.rate * e.quality * e.freshness)
            e.updates += 1
            e.why = list(why) if why else []
            if e.blocked:
                e.why.append(f"held back by another miner's fault in {len(e.blocked)} tempo(s): not counted "
                             f"against it")
            if since is not None and not excused:
                e.why.append(f"held back again, but already excused in {len(e.blocked)} tempo(s) of the window "
                             f"(at most {self.excuse_cap()}): counted as a tempo without its work")
            if e.new_work > 0:
                e.why.append(f"verified work {e.new_work:.1f} units this tempo; rate {e.rate:.1f} per tempo over "
                             f"{span} tempo(s)")
            elif e.rate > 0:
                e.why.append(f"no verified work for {e.idle} tempo(s); rate {e.rate:.1f} from earlier tempos")
            if e.stale:
                parts = []
                if e.lag > grace:
                    parts.append(f"{e.lag} tempo(s) without its verified work while others' was verified")
                if self.quiet > grace:
                    parts.append(f"no work verified by this validator for {self.quiet} tempo(s)")
                if stall < 1.0:
                    parts.append(f"every lane stalled for {self.stalled} tempo(s)")
                e.why.append(f"stale ({'; '.join(parts)}): weight x{e.freshness:.3g}, the rest is burned")

    @staticmethod
    def _span(e: ScoreEntry) -> float:
        """The tempos ``e``'s rate is taken over (see the class docstring): each active tempo from its
        first to its last with work counts 1, except one it was blocked in: that counts
        ``min(1, work in it / its rate in the tempos it was not blocked in)`` (1 when there were none)."""
        if not e.bins:
            return 0.0
        first, last = e.bins[0][0], e.bins[-1][0]
        blocked = {a for a in e.blocked if first <= a <= last}
        n_free = last - first + 1 - len(blocked)
        work_free = sum(w for a, w in e.bins if a not in blocked)
        if not blocked or n_free <= 0 or work_free <= 0:
            return float(last - first + 1)
        free_rate = work_free / n_free
        in_blocked = {a: w for a, w in e.bins if a in blocked}
        return n_free + sum(min(1.0, in_blocked.get(a, 0.0) / free_rate) for a in blocked)

    def excuse_cap(self) -> int:
        """Blocked tempos one miner may be excused in per window (:attr:`max_excused`, default half
        the window)."""
        W = max(1, int(self.window))
        return max(0, int(self.max_excused)) if self.max_excused is not None else W // 2

    def _excuse(self, e: ScoreEntry, since: float) -> bool:
        """``e`` was blocked by another miner's fault from ``since`` on: the active tempos ending after
        it leave its rate span (oldest first, while ``e`` has fewer than :meth:`excuse_cap` blocked
        tempos in the window), and the lag it accrued in those tempos is taken back. Returns whether
        this update's tempo is excused (its lag does not grow)."""
        room = self.excuse_cap() - len(e.blocked)
        added: set = set()
        for t, a in self.history:
            if room <= 0:
                break
            if t > since and a is not None and a not in e.blocked:
                e.blocked.append(a)
                added.add(t)
                room -= 1
        undo = [t for t in e.lagged if t in added]
        e.lagged = [t for t in e.lagged if t not in added]
        e.lag = max(0, e.lag - len(undo))
        now = self.history[-1] if self.history else None
        return now is not None and (now[1] is None or now[1] in e.blocked)

    def relative_freshness(self, e: ScoreEntry) -> float:
        """``2^-max(0, lag - grace)``: the part of the freshness that one miner's absence explains."""
        return 2.0 ** -max(0, e.lag - max(0, int(self.grace)))

    def weights(self, shares: list[float], current: Mapping[int, str], exclude_uids: Iterable[int] = ()) -> dict[int, float]:
        """uid -> weight; sums to 1 when no score is stale, to less otherwise (see the class docstring)."""
        excluded = set(int(u) for u in exclude_uids)
        per_stage: dict[int, list[ScoreEntry]] = {}
        for e in self.entries.values():
            if e.uid in excluded or current.get(e.uid) != e.hotkey or not 0 <= e.stage < len(shares):
                continue
            per_stage.setdefault(e.stage, []).append(e)
        denom = {}
        for s, es in per_stage.items():
            fresh = any(e.lag <= self.grace and e.rate * e.quality > 0 for e in es)
            denom[s] = sum(_finite(e.rate * e.quality * (self.relative_freshness(e) if fresh else 1.0)) for e in es)
        budgets = {s: _finite(shares[s]) for s, d in denom.items() if d > 0}
        total = sum(budgets.values())
        out: dict[int, float] = {}
        if total > 0:
            for s, b in budgets.items():
                for e in per_stage[s]:
                    w = _finite(b / total * e.score / denom[s])
                    if w > 0:
                        out[e.uid] = out.get(e.uid, 0.0) + w
        z = sum(out.values())
        if z > 1.0:                      # rounding only
            out = {u: w / z for u, w in out.items()}
        for e in self.entries.values():
            e.weight = out.get(e.uid, 0.0) if current.get(e.uid) == e.hotkey else 0.0
        return dict(sorted(out.items()))

    def stale(self) -> set[Key]:
        return {k for k, e in self.entries.items() if e.stale}

    def to_dict(self) -> dict:
        return {"window": self.window, "grace": self.grace, "tempo": self.tempo, "active": self.active,
                "quiet": self.quiet, "stalled": self.stalled, "history": self.history, "entries": [e.to_dict() for e in self.entries.values()]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Scoreboard":
        """Read a saved board (unknown keys, e.g. of the older exponential-average board, are ignored)."""
        sb = cls(window=int(d.get("window", 16)), grace=int(d.get("grace", 2)), tempo=int(d.get("tempo", 0)),
                 active=int(d.get("active", 0)), quiet=int(d.get("quiet", 0)), stalled=int(d.get("stalled", 0)),
                 history=[list(h) for h in d.get("history", [])])
        known = {f.name for f in dataclasses.fields(ScoreEntry)}
        for row in d.get("entries", []):
            e = ScoreEntry(**{k: v for k, v in row.items() if k in known})
            sb.entries[(e.uid, e.hotkey)] = e
        return sb


def with_burn(weights: Mapping[int, float], burn_uid: Optional[int]) -> dict[int, float]:
    """``weights`` plus ``1 - sum(weights)`` on ``burn_uid`` (the share that stale scores lost; the
    chain normalises weights, so without it the loss would be renormalised away). Nothing is added
    when ``burn_uid`` is None or the rest is below 1e-9; an empty ``weights`` puts everything on it."""
    out = {int(u): float(w) for u, w in weights.items()}
    rest = 1.0 - sum(out.values())
    if burn_uid is not None and rest > 1e-9:
        out[int(burn_uid)] = out.get(int(burn_uid), 0.0) + rest
    return out


def balanced_weights(scores: Mapping[Key, float], stages: Mapping[Key, int], shares: list[float],
                     current: Mapping[int, str], exclude_uids: Iterable[int] = ()) -> dict[int, float]:
    """uid -> weight (sums to 1, or empty): stage budgets proportional to ``shares`` (over the stages
    with a positive score), split inside a stage in proportion to ``scores``. Keys whose hotkey no
    longer holds the uid, excluded uids and non-finite / non-positive scores get nothing."""
    excluded = set(int(u) for u in exclude_uids)
    per_stage: dict[int, dict[int, float]] = {}
    for key, sc in scores.items():
        uid, hk = key
        s = stages.get(key, -1)
        if uid in excluded or current.get(uid) != hk or not 0 <= s < len(shares):
            continue
        sc = _finite(sc)
        if sc <= 0:
            continue
        per_stage.setdefault(s, {})
        per_stage[s][uid] = per_stage[s].get(uid, 0.0) + sc
    budgets = {s: _finite(shares[s]) for s in per_stage}
    total = sum(budgets.values())
    if total <= 0:
        return {}
    out: dict[int, float] = {}
    for s, sc in per_stage.items():
        tot = sum(sc.values())
        for uid, v in sc.items():
            out[uid] = out.get(uid, 0.0) + budgets[s] / total * v / tot
    z = sum(out.values())
    if not math.isfinite(z) or z <= 0:
        return {}
    return {u: w / z for u, w in sorted(out.items()) if _finite(w / z) > 0}
