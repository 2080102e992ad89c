"""Replay protection that survives a restart: (hotkey, nonce) pairs kept in SQLite.

Implements the ``check_and_store(hotkey_ss58, nonce_ns) -> bool`` interface that
``bittensor.http_auth.verify(..., nonce_store=...)`` expects (same as ``InMemoryNonceStore``),
including the ``retention`` attribute ``verify`` checks against its freshness window.

Each accepted pair is committed before ``check_and_store`` returns (WAL journal, synchronous=NORMAL:
durable across a process crash or ``kill -9``), so a request replayed after the server restarts
is still refused. Entries whose nonce (a wall-clock nanosecond time) is older than
``retention`` = ``max_age + allowed_skew`` (plus a margin) are pruned: ``verify`` already refuses
those as stale before consulting the store.

:class:`MemoryNonceStore` is the same interface in memory (servers without a state folder: tests).
"""
from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Optional

from bittensor import http_auth
from loguru import logger

from iota_subnet.utils.sqlite_file import open_sqlite


class SqliteNonceStore:
    """The persistent store. ``created_ns``: when this file was first created (kept in the file);
    a nonce older than that is refused as a possible replay, so a store recreated after losing
    the old one (deleted, or moved aside because it was corrupt) lets no earlier request through.

    Raises :class:`~iota_subnet.utils.sqlite_file.CorruptStateError` for a corrupt file.
    """

    def __init__(self, path: str | os.PathLike, *, max_age: float = http_auth.DEFAULT_MAX_AGE,
                 allowed_skew: float = http_auth.DEFAULT_ALLOWED_SKEW, margin: float = 5.0,
                 prune_every: int = 256):
        self.path = Path(path)
        self.max_age = float(max_age)
        self.allowed_skew = float(allowed_skew)
        #: seconds an entry is kept; ``verify`` refuses a store whose retention is below its window.
        self.retention = self.max_age + self.allowed_skew + float(margin)
        self._prune_every = max(1, int(prune_every))
        self._inserts = 0
        self._lock = threading.Lock()
        self._db: Optional[sqlite3.Connection] = open_sqlite(
            self.path, what="the nonce store (replay protection)", timeout_s=10.0,
            recovery=f"move it aside (mv {self.path} {self.path}.corrupt) and start again. The new store refuses every "
                     "request signed before it was created, so no earlier request can be replayed.")
        self._db.execute("CREATE TABLE IF NOT EXISTS nonces (hotkey TEXT NOT NULL, nonce INTEGER NOT NULL, "
                         "PRIMARY KEY (hotkey, nonce)) WITHOUT ROWID")
        self._db.execute("CREATE INDEX IF NOT EXISTS nonces_by_time ON nonces (nonce)")
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        self._db.execute("INSERT OR IGNORE INTO meta VALUES ('created_ns', ?)", (str(time.time_ns()),))
        self.created_ns = int(self._db.execute("SELECT value FROM meta WHERE key='created_ns'").fetchone()[0])
        self.prune()

    def seen(self, hotkey_ss58: str, nonce_ns: int) -> bool:
        """True when the pair was accepted before, or the nonce predates this store (read only)."""
        if int(nonce_ns) < self.created_ns:
            return True
        with self._lock:
            return self._conn().execute("SELECT 1 FROM nonces WHERE hotkey=? AND nonce=?",
                                        (str(hotkey_ss58), int(nonce_ns))).fetchone() is not None

    def check_and_store(self, hotkey_ss58: str, nonce_ns: int) -> bool:
        """True (and remembers the pair) if never seen; False for a replay or a nonce older than the store."""
        if int(nonce_ns) < self.created_ns:
            return False
        with self._lock:
            db = self._conn()
            cur = db.execute("INSERT OR IGNORE INTO nonces (hotkey, nonce) VALUES (?, ?)",
                             (str(hotkey_ss58), int(nonce_ns)))
            fresh = cur.rowcount == 1
            self._inserts += 1
            if self._inserts % self._prune_every == 0:
                self._prune_locked()
            return fresh

    def prune(self, now_ns: Optional[int] = None) -> int:
        """Forget entries older than ``retention``; returns how many were removed."""
        with self._lock:
            return self._prune_locked(now_ns)

    def _prune_locked(self, now_ns: Optional[int] = None) -> int:
        now = time.time_ns() if now_ns is None else now_ns
        cutoff = now - int(self.retention * 1e9)
        removed = self._conn().execute("DELETE FROM nonces WHERE nonce < ?", (cutoff,)).rowcount
        if removed:
            logger.debug("nonce store {}: pruned {} entries", self.path.name, removed)
        return removed

    def __len__(self) -> int:
        with self._lock:
            return self._conn().execute("SELECT COUNT(*) FROM nonces").fetchone()[0]

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError(f"nonce store {self.path} is closed")
        return self._db

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


class MemoryNonceStore:
    """In-memory :class:`SqliteNonceStore` (``check_and_store``, ``seen``, ``retention``); lost on restart."""

    def __init__(self, retention: float):
        self.retention = float(retention)
        self.created_ns = time.time_ns()
        self._expiry: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, t in self._expiry.items() if t <= now]:
            del self._expiry[key]

    def seen(self, hotkey_ss58: str, nonce_ns: int) -> bool:
        with self._lock:
            self._expire()
            return (str(hotkey_ss58), int(nonce_ns)) in self._expiry

    def check_and_store(self, hotkey_ss58: str, nonce_ns: int) -> bool:
        key = (str(hotkey_ss58), int(nonce_ns))
        with self._lock:
            self._expire()
            if key in self._expiry:
                return False
            self._expiry[key] = time.monotonic() + self.retention
            return True

    def close(self) -> None:
        self._expiry.clear()
