"""The validator's persistent state: one SQLite file (WAL) in its output folder.

Tables
    ``meta``          key/value: run id, lane count, validator index, ...
    ``lanes``         per lane: the next lane step to drive, steps done, tokens trained
    ``miners``        the :class:`~iota_subnet.validator.scoring.Ledger` records, keyed by (uid, hotkey)
    ``microbatches``  one row per micro-batch driven: step, lane, index, id, ok, loss, pathway (JSON)
    ``weights``       every weight vector set on chain (block, uids, weights)

A lane step is committed in one transaction (its micro-batch rows, the ledger, the lane's next
step), so a validator killed at any point resumes at the first lane step it had not committed.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from iota_subnet.utils.sqlite_file import open_sqlite

from .scoring import Ledger, MinerRecord

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lanes (lane INTEGER PRIMARY KEY, next_step INTEGER NOT NULL,
    steps_done INTEGER NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0, last_loss REAL);
CREATE TABLE IF NOT EXISTS miners (uid INTEGER NOT NULL, hotkey TEXT NOT NULL, stage INTEGER NOT NULL,
    forwards INTEGER NOT NULL, backwards INTEGER NOT NULL, completed INTEGER NOT NULL, tokens INTEGER NOT NULL,
    work REAL NOT NULL, failures INTEGER NOT NULL, reroutes INTEGER NOT NULL, last_seen REAL NOT NULL,
    PRIMARY KEY (uid, hotkey));
CREATE TABLE IF NOT EXISTS microbatches (id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER NOT NULL,
    lane INTEGER NOT NULL, idx INTEGER NOT NULL, microbatch_id TEXT NOT NULL, ok INTEGER NOT NULL, loss REAL,
    tokens INTEGER NOT NULL, pathway TEXT NOT NULL, reroutes INTEGER NOT NULL, failures TEXT NOT NULL,
    latency_s REAL NOT NULL, bytes_sent INTEGER NOT NULL, bytes_received INTEGER NOT NULL, ts REAL NOT NULL);
CREATE INDEX IF NOT EXISTS microbatches_lane_step ON microbatches (lane, step);
CREATE TABLE IF NOT EXISTS weights (id INTEGER PRIMARY KEY AUTOINCREMENT, block INTEGER NOT NULL, ts REAL NOT NULL,
    uids TEXT NOT NULL, weights TEXT NOT NULL);
"""

_MINER_COLS = ("uid", "hotkey", "stage", "forwards", "backwards", "completed", "tokens", "work", "failures",
               "reroutes", "last_seen")


class StateError(RuntimeError):
    """The state file belongs to another run (or is unreadable); the message says what to do."""


class ValidatorState:
    """SQLite persistence of accounting and lane progress. Thread-safe (one connection, a lock).

    Raises :class:`~iota_subnet.utils.sqlite_file.CorruptStateError` when the file is corrupt."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.RLock()
        self.conn = open_sqlite(
            self.path, what="the validator's state", recovery=(
                f"move it aside (mv {self.path} {self.path}.corrupt) and start again: this validator then starts its "
                "accounting afresh (lane progress, scores, weights history) while the run goes on; or put back a "
                "backup of the file"))
        self.conn.row_factory = sqlite3.Row
        self.conn.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self.conn.close()

    # ---------------------------------------------------------------- meta
    def get_meta(self, key: str, default: Optional[str] = None) -> Optional[str]:
        with self._lock:
            row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row["value"] if row else default

    def set_meta(self, key: str, value: Any) -> None:
        with self._lock:
            self.conn.execute("INSERT OR REPLACE INTO meta VALUES (?,?)", (key, str(value)))

    def bind_run(self, run_id: str, n_lanes: int) -> int:
        """Tie the file to ``run_id``; returns the lane count (the stored one when resuming).

        Raises :class:`StateError` when the file was written for another run id.
        """
        stored = self.get_meta("run_id")
        if stored is not None and stored != run_id:
            raise StateError(f"{self.path} holds the state of run {stored!r}, not {run_id!r}; "
                             "use another --out folder or the same --run-id")
        if stored is None:
            with self._lock:
                self.conn.execute("BEGIN IMMEDIATE")
                try:
                    self.conn.execute("INSERT OR REPLACE INTO meta VALUES ('run_id', ?)", (run_id,))
                    self.conn.execute("INSERT OR REPLACE INTO meta VALUES ('n_lanes', ?)", (str(int(n_lanes)),))
                    self.conn.execute("COMMIT")
                except BaseException:
                    self.conn.execute("ROLLBACK")
                    raise
        return int(self.get_meta("n_lanes", str(n_lanes)))

    # ---------------------------------------------------------------- progress
    def lane_progress(self) -> dict[int, dict]:
        """lane -> {next_step, steps_done, tokens, last_loss}."""
        with self._lock:
            rows = self.conn.execute("SELECT * FROM lanes ORDER BY lane").fetchall()
        return {int(r["lane"]): {"next_step": int(r["next_step"]), "steps_done": int(r["steps_done"]),
                                 "tokens": int(r["tokens"]), "last_loss": r["last_loss"]} for r in rows}

    def next_steps(self) -> dict[int, int]:
        return {lane: p["next_step"] for lane, p in self.lane_progress().items()}

    def commit_lane_step(self, lane: int, step: int, next_step: int, microbatches: Iterable[dict],
                         ledger: Optional[Ledger] = None, loss: Optional[float] = None) -> None:
        """One lane step done: its micro-batch rows, the whole ledger and the lane's next step, atomically.

        ``microbatches``: dicts with ``idx, microbatch_id, ok, loss, tokens, pathway, reroutes,
        failures, latency_s, bytes_sent, bytes_received``.
        """
        now = time.time()
        mbs = list(microbatches)
        tokens = sum(int(m["tokens"]) for m in mbs if m["ok"])
        with self._lock:
            c = self.conn
            c.execute("BEGIN IMMEDIATE")
            try:
                c.executemany(
                    "INSERT INTO microbatches (step, lane, idx, microbatch_id, ok, loss, tokens, pathway, reroutes, "
                    "failures, latency_s, bytes_sent, bytes_received, ts) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    [(int(step), int(lane), int(m["idx"]), str(m["microbatch_id"]), int(bool(m["ok"])), m.get("loss"),
                      int(m["tokens"]), json.dumps(m.get("pathway", [])), int(m.get("reroutes", 0)),
                      json.dumps(m.get("failures", [])), float(m.get("latency_s", 0.0)),
                      int(m.get("bytes_sent", 0)), int(m.get("bytes_received", 0)), now) for m in mbs])
                c.execute("INSERT INTO lanes (lane, next_step, steps_done, tokens, last_loss) VALUES (?,?,1,?,?) "
                          "ON CONFLICT(lane) DO UPDATE SET next_step=excluded.next_step, "
                          "steps_done=steps_done+1, tokens=tokens+excluded.tokens, last_loss=excluded.last_loss",
                          (int(lane), int(next_step), tokens, loss))
                if ledger is not None:
                    self._save_ledger(c, ledger.records.values())
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise

    def microbatch_log(self, lane: Optional[int] = None) -> list[dict]:
        sql, args = "SELECT * FROM microbatches", ()
        if lane is not None:
            sql, args = sql + " WHERE lane=?", (int(lane),)
        with self._lock:
            rows = self.conn.execute(sql + " ORDER BY id", args).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d["pathway"] = json.loads(d["pathway"])
            d["failures"] = json.loads(d["failures"])
            d["ok"] = bool(d["ok"])
            out.append(d)
        return out

    # ---------------------------------------------------------------- ledger
    @staticmethod
    def _save_ledger(c: sqlite3.Connection, records: Iterable[MinerRecord]) -> None:
        c.executemany(f"INSERT OR REPLACE INTO miners ({', '.join(_MINER_COLS)}) VALUES ({', '.join('?' * len(_MINER_COLS))})",
                      [tuple(getattr(r, k) for k in _MINER_COLS) for r in records])

    def save_ledger(self, ledger: Ledger) -> None:
        with self._lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                self._save_ledger(self.conn, ledger.records.values())
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise

    def load_ledger(self, shares: list[float]) -> Ledger:
        with self._lock:
            rows = self.conn.execute("SELECT * FROM miners").fetchall()
        ledger = Ledger(shares)
        for r in rows:
            rec = MinerRecord(**{k: r[k] for k in _MINER_COLS})
            ledger.records[rec.key] = rec
        return ledger

    # ---------------------------------------------------------------- weights
    def log_weights(self, block: int, uids: list[int], weights: list[float]) -> None:
        with self._lock:
            self.conn.execute("INSERT INTO weights (block, ts, uids, weights) VALUES (?,?,?,?)",
                              (int(block), time.time(), json.dumps(list(uids)), json.dumps(list(weights))))

    def weights_blocks(self) -> list[int]:
        with self._lock:
            return [int(r["block"]) for r in self.conn.execute("SELECT block FROM weights ORDER BY id").fetchall()]
