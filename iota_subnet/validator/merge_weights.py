"""Merge weights: how much each replica counts in its stage's mean pseudo-gradient.

Validators decide them from their scores and publish them as their chain commitment::

    {"v": 1, "kind": "merge_weights", "run": "<run id>", "w": {"<uid>": 0.83, ...}}

Rule (:func:`compute_merge_weights`): within a stage, a replica's weight is its verified work
divided by the stage's mean work over the replicas that did at least ``min_work`` (so equal work
gives 1.0 each); a replica below ``min_work`` gets 0; a replica caught cheating (a wrong forward,
or named ``wrong`` in merge mismatch evidence, see :func:`penalised_from_evidence`) gets 0.

Miners read every validator's commitment (:func:`weights_from_commitments`): the weight of a
participant is the median of the validators' weights for its uid; with no decision published it
is 1.0 (equal weights). All replicas read the same chain state, so they build the same plan; when
they do not (a commitment landed in between), the plan ids differ and the attempt is retried.
"""
from __future__ import annotations

import json
import statistics
from typing import Any, Iterable, Mapping, Optional


def compute_merge_weights(work: Mapping[int, tuple[int, float]], *, cheaters: Iterable[int] = (),
                          min_work: float = 0.0) -> dict[int, float]:
    """``work``: uid -> (stage, verified work). Returns uid -> weight (>= 0, 3 decimals)."""
    bad = set(int(u) for u in cheaters)
    by_stage: dict[int, list[int]] = {}
    for uid, (stage, w) in work.items():
        by_stage.setdefault(int(stage), []).append(int(uid))
    out: dict[int, float] = {}
    for stage, uids in by_stage.items():
        good = [u for u in uids if u not in bad and work[u][1] >= min_work and work[u][1] > 0]
        mean = sum(work[u][1] for u in good) / len(good) if good else 0.0
        for u in uids:
            out[u] = round(work[u][1] / mean, 3) if (u in good and mean > 0) else 0.0
    return out


def encode_commitment(run_id: str, weights: Mapping[int, float]) -> str:
    return json.dumps({"v": 1, "kind": "merge_weights", "run": run_id,
                       "w": {str(int(u)): round(float(w), 3) for u, w in sorted(weights.items())}},
                      separators=(",", ":"))


def decode_commitment(raw: Optional[str], run_id: str) -> Optional[dict[int, float]]:
    """uid -> weight, or None when ``raw`` is not a merge-weights commitment of ``run_id`` (never raises)."""
    if not raw:
        return None
    try:
        d = json.loads(raw)
        if d.get("v") != 1 or d.get("kind") != "merge_weights" or d.get("run") != run_id:
            return None
        out = {}
        for k, v in d.get("w", {}).items():
            f = float(v)
            if not (f >= 0 and f < 1e6):
                return None
            out[int(k)] = f
        return out
    except (ValueError, TypeError, AttributeError):
        return None


def weights_from_commitments(commitments: Mapping[str, str], neurons: Mapping[str, Any], run_id: str, stage: int,
                             participants: Iterable[str]) -> dict[str, float]:
    """Participant hotkey -> weight: median over validators (``validator_permit``) that published one; 1.0 else."""
    decisions = []
    for hk, raw in commitments.items():
        n = neurons.get(hk)
        if n is None or not getattr(n, "validator_permit", False):
            continue
        d = decode_commitment(raw, run_id)
        if d is not None:
            decisions.append(d)
    out = {}
    for p in participants:
        n = neurons.get(p)
        uid = getattr(n, "uid", None)
        vals = [d[int(uid)] for d in decisions if uid is not None and int(uid) in d]
        out[p] = float(statistics.median(vals)) if vals else 1.0
    return out


def penalised_from_evidence(evidence: Iterable[Mapping[str, Any]], *, min_reporters: int = 1) -> set[str]:
    """Hotkeys named ``wrong`` in merge mismatch evidence by at least ``min_reporters`` distinct reporters
    (the evidence a replica's ``status.json`` / merge reports carry: reducers' claimed hashes and the
    third party's recomputed hash)."""
    reporters: dict[str, set[str]] = {}
    for ev in evidence:
        claimed = ev.get("claimed_sha256") or {}
        rec = ev.get("recomputed_sha256")
        for hk in ev.get("wrong") or []:
            if rec and claimed.get(hk) == rec and (ev.get("served_sha256") or {}).get(hk, rec) == rec:
                continue       # the evidence does not support the accusation
            reporters.setdefault(hk, set()).add(str(ev.get("reporter", "")))
    return {hk for hk, rs in reporters.items() if len(rs) >= min_reporters}
