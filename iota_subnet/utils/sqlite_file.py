"""Opening a neuron's SQLite state file so that a corrupt one is refused with a clear message.

A file that is not a database, or whose pages fail SQLite's ``quick_check``, raises
:class:`CorruptStateError` naming the file and how to recover; the file itself is never modified,
so nothing is lost. Used by the nonce store (:mod:`iota_subnet.transport.nonce_store`) and the
validator's state (:mod:`iota_subnet.validator.state`).
"""
from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from iota_subnet.errors import UserError


class CorruptStateError(UserError, RuntimeError):
    """A state file cannot be read as SQLite; the message names the file and the recovery."""


def open_sqlite(path: str | os.PathLike, *, what: str, recovery: str, timeout_s: float = 30.0,
                check: bool = True) -> sqlite3.Connection:
    """Connect to ``path`` (created when missing) in WAL mode, after ``PRAGMA quick_check``.

    ``what`` names the file's role (e.g. "the nonce store"), ``recovery`` says how to recover
    (it ends the error message). Raises :class:`CorruptStateError` for a file that is not a
    readable SQLite database; the file is left as it is.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = None
    try:
        conn = sqlite3.connect(str(path), timeout=timeout_s, isolation_level=None, check_same_thread=False)
        if check:
            rows = conn.execute("PRAGMA quick_check").fetchall()
            if [tuple(r) for r in rows] != [("ok",)]:
                raise sqlite3.DatabaseError("; ".join(str(r[0]) for r in rows[:3]))
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn
    except sqlite3.DatabaseError as e:
        if conn is not None:
            conn.close()
        raise CorruptStateError(
            f"{what} {path} is corrupt or not an SQLite database ({e}); it was left untouched. To recover: "
            f"{recovery}") from None
