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

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping

from iota_subnet import plan
from iota_subnet.config import RunConfig

Key = tuple[int, str]


def stage_flops(cfg: RunConfig) -> list[int]:
    """Training FLOPs per token of every stage (forward + backward), counted from the shapes alone
    (:func:`iota_subnet.plan.stage_flops`: building an 8b stage on CPU to count them took ~32 GB)."""
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
# Scores smoothed over tempos, with quality factors (spot checks, CLASP)
# ---------------------------------------------------------------------------------------------

@dataclass
class ScoreEntry:
    """One miner's smoothed score and the reasons behind its latest update."""

    uid: int
    hotkey: str
    stage: int
    score: float = 0.0         # smoothed work rate x quality (work units per tempo)
    last_work: float = 0.0     # ledger work at the previous update
    new_work: float = 0.0      # verified work since the previous update
    quality: float = 1.0       # the latest quality factor, in [0, 1]
    weight: float = 0.0        # the latest weight this validator computed
    updates: int = 0
    why: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Scoreboard:
    """Scores smoothed over tempos (an exponential moving average of verified work per tempo).

    At every update (one per tempo, before weights are set), for each miner record:

    * ``new_work`` = verified work (tokens x stage compute share, :class:`Ledger`) since the last update;
    * ``quality`` = product of the factors given (spot checks: 0 when flagged; CLASP: ``clasp_penalty``
      when flagged), clipped to [0, 1], so a penalty never raises a score;
    * ``score = quality x ((1 - alpha) x score + alpha x new_work)``: a miner with no new verified
      work (not evaluated this tempo) decays by ``1 - alpha`` per tempo instead of keeping a stale
      score; a flagged miner's score is 0 at once; anything non-finite becomes 0.

    Weights (:func:`balanced_weights`): each stage's budget is proportional to its compute share;
    inside a stage the budget is split in proportion to the scores.
    """

    alpha: float = 0.5
    entries: dict[Key, ScoreEntry] = field(default_factory=dict)

    def update(self, ledger: Ledger, quality: Mapping[Key, tuple[float, list[str]]] | None = None) -> None:
        quality = quality or {}
        a = min(1.0, max(0.0, float(self.alpha)))
        for key, rec in ledger.records.items():
            e = self.entries.get(key)
            if e is None:
                e = self.entries[key] = ScoreEntry(rec.uid, rec.hotkey, rec.stage)
            e.stage = rec.stage
            work = _finite(rec.work)
            e.new_work = _finite(work - e.last_work)
            e.last_work = work
            q, why = quality.get(key, (1.0, []))
            q = _finite(q)
            q = min(1.0, q)
            e.quality = q
            e.score = _finite(q * ((1 - a) * _finite(e.score) + a * e.new_work))
            e.updates += 1
            e.why = list(why) if why else ([f"verified work {e.new_work:.1f} units this tempo"] if e.new_work > 0
                                            else ["no verified work this tempo: score decays"])

    def weights(self, shares: list[float], current: Mapping[int, str], exclude_uids: Iterable[int] = ()) -> dict[int, float]:
        w = balanced_weights({k: e.score for k, e in self.entries.items()},
                             {k: e.stage for k, e in self.entries.items()}, shares, current, exclude_uids)
        for k, e in self.entries.items():
            e.weight = w.get(e.uid, 0.0) if current.get(e.uid) == e.hotkey else 0.0
        return w

    def to_dict(self) -> dict:
        return {"alpha": self.alpha, "entries": [e.to_dict() for e in self.entries.values()]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Scoreboard":
        sb = cls(alpha=float(d.get("alpha", 0.5)))
        for row in d.get("entries", []):
            e = ScoreEntry(**row)
            sb.entries[(e.uid, e.hotkey)] = e
        return sb


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
