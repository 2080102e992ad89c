"""The devnet's state: one SQLite file, read and written synchronously by every process that
opens it.

Block height follows the wall clock: ``block = floor((now - genesis_time) / block_time)`` (a
halted devnet keeps its last block). State has no history: a read pinned to an older block hash
sees the current state. This module is the storage only: before each access
:func:`.epoch.tick` runs the epochs that are due and reveals due weight commits (:mod:`.weights`);
extrinsics are applied by :func:`.calls.apply`, the MEV shield's crypto is in :mod:`.shield`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Optional

from .schema import DEFAULT_HYPERPARAMS, SCHEMA, SCHEMA_VERSION, DevnetError
from .tlock import Decryptor, drand_decryptor


class DevnetState:
    """Synchronous access to a devnet file, shared by every process that opens it (WAL mode, a
    busy timeout; every write a ``BEGIN IMMEDIATE`` transaction). Raises :class:`DevnetError`
    when the file does not exist (unless ``create``) or is not an initialised devnet."""

    def __init__(self, path: str | os.PathLike, *, busy_timeout_s: float = 30.0, create: bool = False,
                 decryptor: Optional[Decryptor] = None):
        self.path = Path(path)
        if not create and not self.path.exists():
            raise DevnetError(
                f"devnet chain database {self.path} does not exist; create it with "
                "`iota_subnet.devnet.create_devnet(...)` (or the CLI's devnet setup)"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self.conn = sqlite3.connect(
            str(self.path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        self.conn.row_factory = sqlite3.Row
        self.conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("PRAGMA foreign_keys=OFF")
        # executescript commits implicitly; it runs outside an explicit transaction
        with self._lock:
            self.conn.executescript(SCHEMA)
        self._genesis: Optional[float] = None
        self._block_time: Optional[float] = None
        self._last_tick_block = -1
        self.decryptor: Decryptor = decryptor or drand_decryptor
        self.shielding = 0  # > 0 while a MEV-shielded inner extrinsic is applied
        self._load_meta()

    # -- plumbing ------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(Exception):
                self.conn.close()

    @contextlib.contextmanager
    def tx(self):
        """A write transaction (``BEGIN IMMEDIATE``: takes the file's write lock up front)."""
        with self._lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            else:
                self.conn.execute("COMMIT")

    def _q(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self.conn.execute(sql, args).fetchall()

    def _q1(self, sql: str, args: tuple = ()) -> Optional[sqlite3.Row]:
        with self._lock:
            return self.conn.execute(sql, args).fetchone()

    def _load_meta(self) -> None:
        rows = {r["key"]: r["value"] for r in self._q("SELECT key, value FROM meta")}
        if "genesis_time" in rows:
            self._genesis = float(rows["genesis_time"])
            self._block_time = float(rows["block_time"])
        self._halted_at = float(rows["halted_at"]) if rows.get("halted_at") else None

    def init_meta(self, block_time: float, genesis_time: Optional[float] = None) -> None:
        with self.tx() as c:
            row = c.execute("SELECT value FROM meta WHERE key='genesis_time'").fetchone()
            if row is None:
                c.execute("INSERT INTO meta VALUES ('genesis_time', ?)", (repr(genesis_time or time.time()),))
                c.execute("INSERT INTO meta VALUES ('block_time', ?)", (repr(float(block_time)),))
                c.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                c.execute("INSERT INTO meta VALUES ('auto_fund_rao', '0')")
        self._load_meta()

    def set_meta(self, key: str, value: str) -> None:
        with self.tx() as c:
            c.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def meta(self, key: str, default: Optional[str] = None) -> Optional[str]:
        row = self._q1("SELECT value FROM meta WHERE key=?", (key,))
        return row["value"] if row else default

    # -- time ----------------------------------------------------------------------------------

    @property
    def genesis(self) -> float:
        if self._genesis is None:
            self._load_meta()
            if self._genesis is None:
                raise DevnetError(f"{self.path} is not an initialised devnet (no genesis)")
        return self._genesis

    @property
    def block_time(self) -> float:
        self.genesis  # noqa: B018 (loads meta)
        return float(self._block_time)  # type: ignore[arg-type]

    def block(self, now: Optional[float] = None) -> int:
        now = time.time() if now is None else now
        genesis = self.genesis   # loads meta (halted_at too)
        halted = getattr(self, "_halted_at", None)
        if halted is not None:
            now = min(now, halted)   # a halted devnet keeps its last block: reads change nothing
        return max(0, int(math.floor((now - genesis) / self.block_time)))

    def block_timestamp_ms(self, block: int) -> int:
        return int((self.genesis + block * self.block_time) * 1000)

    def block_hash(self, block: int) -> str:
        seed = hashlib.sha256(f"{self.genesis!r}:{block}".encode()).hexdigest()
        return "0x" + f"{block:016x}" + seed[16:]

    @staticmethod
    def block_of_hash(block_hash: Optional[str]) -> Optional[int]:
        if not block_hash or not isinstance(block_hash, str) or len(block_hash) != 66:
            return None
        try:
            return int(block_hash[2:18], 16)
        except ValueError:
            return None

    # -- subnets -------------------------------------------------------------------------------

    def subnet(self, netuid: int) -> Optional[dict]:
        row = self._q1("SELECT * FROM subnets WHERE netuid=?", (int(netuid),))
        if row is None:
            return None
        out = dict(row)
        params = dict(DEFAULT_HYPERPARAMS)
        params.update(json.loads(out.pop("params")))
        params["tempo"] = out["tempo"]
        out["params"] = params
        return out

    def netuids(self) -> list[int]:
        return [int(r["netuid"]) for r in self._q("SELECT netuid FROM subnets ORDER BY netuid")]

    def create_subnet(self, netuid: int, *, owner_hotkey: str, owner_coldkey: str, name: str,
                      symbol: str, params: dict) -> None:
        unknown = set(params) - set(DEFAULT_HYPERPARAMS)
        if unknown:
            raise DevnetError(f"unknown hyperparameters {sorted(unknown)}; known: {sorted(DEFAULT_HYPERPARAMS)}")
        merged = dict(DEFAULT_HYPERPARAMS)
        merged.update(params)
        block = self.block()
        with self.tx() as c:
            if c.execute("SELECT 1 FROM subnets WHERE netuid=?", (netuid,)).fetchone():
                raise DevnetError(f"subnet {netuid} already exists in {self.path}")
            tempo = int(merged.pop("tempo"))
            c.execute(
                "INSERT INTO subnets (netuid, params, tempo, last_epoch_block, epoch_index, registered_at,"
                " owner_hotkey, owner_coldkey, name, symbol) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (netuid, json.dumps(merged), tempo, block, 0, block, owner_hotkey, owner_coldkey, name, symbol),
            )

    def set_params(self, netuid: int, **params: Any) -> None:
        unknown = set(params) - set(DEFAULT_HYPERPARAMS)
        if unknown:
            raise DevnetError(f"unknown hyperparameters {sorted(unknown)}")
        with self.tx() as c:
            row = c.execute("SELECT params, tempo FROM subnets WHERE netuid=?", (netuid,)).fetchone()
            if row is None:
                raise DevnetError(f"subnet {netuid} does not exist")
            current = json.loads(row["params"])
            tempo = int(params.pop("tempo", row["tempo"]))
            current.update(params)
            c.execute("UPDATE subnets SET params=?, tempo=? WHERE netuid=?", (json.dumps(current), tempo, netuid))

    # -- neurons -------------------------------------------------------------------------------

    def neurons(self, netuid: int) -> list[dict]:
        return [dict(r) for r in self._q("SELECT * FROM neurons WHERE netuid=? ORDER BY uid", (int(netuid),))]

    def uid_of(self, netuid: int, hotkey: str) -> Optional[int]:
        row = self._q1("SELECT uid FROM neurons WHERE netuid=? AND hotkey=?", (int(netuid), str(hotkey)))
        return None if row is None else int(row["uid"])

    def stake_of(self, netuid: int) -> dict[str, dict[str, int]]:
        """hotkey -> {coldkey: alpha rao} on a subnet."""
        out: dict[str, dict[str, int]] = {}
        for r in self._q("SELECT hotkey, coldkey, amount FROM stakes WHERE netuid=? AND amount>0", (int(netuid),)):
            out.setdefault(r["hotkey"], {})[r["coldkey"]] = int(r["amount"])
        return out

    def weights_rows(self, netuid: int, table: str = "weights") -> dict[int, list]:
        assert table in ("weights", "bonds")
        return {int(r["uid"]): json.loads(r["row"]) for r in
                self._q(f"SELECT uid, row FROM {table} WHERE netuid=? ORDER BY uid", (int(netuid),))}

    def axons(self, netuid: int) -> dict[str, dict]:
        return {r["hotkey"]: {**dict(r), "ip": int(r["ip"])} for r in
                self._q("SELECT * FROM axons WHERE netuid=?", (int(netuid),))}

    def commitments(self, netuid: int) -> dict[str, dict]:
        return {r["hotkey"]: {"block": int(r["block"]), "deposit": int(r["deposit"]),
                              "info": {"fields": json.loads(r["fields"])}}
                for r in self._q("SELECT * FROM commitments WHERE netuid=? ORDER BY block DESC", (int(netuid),))}

    def balance(self, coldkey: str) -> int:
        row = self._q1("SELECT free FROM balances WHERE coldkey=?", (str(coldkey),))
        return int(row["free"]) if row else 0

    # -- epochs --------------------------------------------------------------------------------

    @staticmethod
    def last_epoch_at_or_before(block: int, netuid: int, tempo: int) -> int:
        """Latest block ``b <= block`` with ``(b + netuid + 1) % (tempo + 1) == 0`` (subtensor's
        epoch schedule)."""
        period = tempo + 1
        return block - ((block + netuid + 1) % period)
