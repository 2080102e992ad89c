"""Explained scores: per miner its work, audits, CLASP attribution, quality, score, weight and why.

Built by the validator at every weights round (:func:`build`), stored in its state file (``meta``
key ``scores``), served as JSON (``GET /scores`` on ``--port``), written into ``status.json``
(``scores``) and shown by ``iota-subnet scores --validator-state PATH`` (:func:`load`, :func:`format_table`).

One row (``miners[]``): ``uid, hotkey, stage, work`` (verified work units: tokens x stage compute
share), ``tokens, completed, failures`` (hops that failed), ``clasp`` (``n_in, excess`` nats, ``rel_excess, z, flagged`` or null), ``audits`` (``passed, failed,
refused, timed_out, excused, flagged, audits, by_kind`` or null: :mod:`.audit_policy`), ``quality``
(0..1), ``rate`` (verified work per tempo), ``freshness`` (0..1), ``stale`` (its score is not
current and costs weight), ``score``, ``weight`` (the latest weight this validator computed for the
uid), ``why`` (sentences).
"""
from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any, Mapping, Optional


def build(ledger: Any, attribution: Mapping, board: Any, current: Mapping[int, str],
          block: Optional[int] = None, audits: Any = None) -> dict:
    rows = []
    for key, rec in sorted(ledger.records.items()):
        if current and current.get(rec.uid) != rec.hotkey:
            continue
        a = attribution.get(key)
        e = board.entries.get(key) if board is not None else None
        why = list(e.why) if e is not None else []
        au = audits.stats.get(key) if audits is not None else None
        if au is not None and au.flagged:
            why = [f"flagged by audits: {r}" for r in au.reasons] + [w for w in why if not w.startswith("audit:")]
        elif au is not None and au.audits:
            unanswered = au.refused + au.timed_out
            why.append(f"audits: {au.passed} passed, {au.excused} excused (honest faults)"
                       + (f", {unanswered} unanswered (refused or timed out; {audits.unanswered_threshold} of its last "
                             f"{audits.window} would flag it)"
                          if unanswered else "") + f" of {au.audits}")
        rows.append({
            "uid": rec.uid, "hotkey": rec.hotkey, "stage": rec.stage, "work": rec.work, "tokens": rec.tokens,
            "completed": rec.completed, "failures": rec.failures,
            "clasp": None if a is None else {k: getattr(a, k) for k in ("n_in", "excess", "rel_excess", "z", "flagged")},
            "audits": audits.summary(key) if audits is not None else None,
            "quality": e.quality if e is not None else None, "score": e.score if e is not None else None,
            "rate": e.rate if e is not None else None, "freshness": e.freshness if e is not None else None,
            "stale": bool(e.stale) if e is not None else False,
            "weight": e.weight if e is not None else 0.0, "why": why,
        })
    return {"block": block, "updated_at": time.time(), "miners": rows}


def load(path: str | Path) -> dict:
    """The explained scores stored in a validator's state (``validator.sqlite`` or its folder).

    Raises FileNotFoundError when there is no state file, ValueError when it holds no scores yet."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "validator.sqlite"
    if not p.exists():
        raise FileNotFoundError(f"no validator state at {p}")
    conn = sqlite3.connect(f"file:{p}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT value FROM meta WHERE key='scores'").fetchone()
    except sqlite3.DatabaseError as e:   # not a database, or not a validator's
        raise ValueError(f"{p} is not a validator state file ({e}); pass the validator's --out folder") from None
    finally:
        conn.close()
    if row is None:
        raise ValueError(f"{p} holds no scores yet (the validator writes them when it first sets weights)")
    return json.loads(row[0])


def format_table(d: Mapping) -> str:
    lines = [f"scores at block {d.get('block')} ({len(d.get('miners', []))} miners)",
             f"{'uid':>4} {'stage':>5} {'work total':>10} {'checks ok/fail/skip':>19} {'CLASP excess (z)':>17} "
             f"{'quality':>7} {'weight':>7}  why  (~: stale score, losing weight)"]
    for m in d.get("miners", []):
        cl = m.get("clasp")
        cls = f"{cl['excess']:+.3f} ({cl['z']:+.1f})" + ("!" if cl.get("flagged") else "") if cl else "-"
        a = m.get("audits") or {}
        chk = (f"{a.get('passed', 0)}/{a.get('failed', 0) + a.get('refused', 0) + a.get('timed_out', 0)}/"
               f"{a.get('excused', 0)}")
        q = m.get("quality")
        lines.append(f"{m['uid']:>4} {m['stage']:>5} {m['work']:>10.1f} {chk:>19} {cls:>17} "
                     f"{(f'{q:.2f}' if q is not None else '-'):>7} {m.get('weight', 0.0):>7.4f}"
                     f"{'~' if m.get('stale') else ' '} "
                     + ("; ".join(m.get("why") or []))[:300])
    return "\n".join(lines)
