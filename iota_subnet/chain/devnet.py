"""Devnet: a small Bittensor-like chain whose whole state is ONE SQLite file.

Every process of a local network (miners, validators, CLI) opens the same file through
:class:`DevnetSubstrate`, an implementation of the bittensor v11 SDK's ``Substrate`` protocol
(``bittensor/_substrate.py``), and hands it to ``bt.Client(network, substrate=...)``. The SDK's
own reads (``subnets.metagraph``, ``neurons.all``, ``neurons.uid``, ``weights.weights`` /
``bonds``, hyperparameters, ...) and writes (``execute(SetWeights)``, ``execute(ServeAxon)``,
``submit_call(burned_register / add_stake / set_commitment)``) then run unmodified.

Design
    * No server process. The file is opened in WAL mode with a busy timeout; every write is a
      ``BEGIN IMMEDIATE`` transaction, so concurrent processes serialise on the write lock.
    * Block height follows the wall clock: ``block = floor((now - genesis_time) / block_time)``.
      State has no history: a read pinned to an older block hash sees the current state
      (only ``Timestamp.Now`` honours the pinned block).
    * Extrinsics apply immediately (the "inclusion" is the current block) and are checked the
      way subtensor checks them (registration, version key, rate limits, permits, ...); a
      refused call returns a failed ``ExtrinsicResult`` carrying the chain's error name.
    * Epochs: subtensor runs a subnet's epoch at blocks where
      ``(block + netuid + 1) % (tempo + 1) == 0``. Whichever process first touches the chain
      after such a block runs Yuma (:mod:`iota_subnet.chain.yuma`) inside a write transaction
      guarded by ``last_epoch_block``, so each boundary runs exactly once across processes.
      Missed boundaries (nobody was reading) are folded into one run whose emission covers
      all blocks since the previous run.
    * Stake is alpha on the subnet, 1 TAO = 1 alpha (no AMM). Emission is staked to the
      earning hotkey under its owning coldkey.
    * Signed calls are signed and verified with the caller's keypair (sr25519), so only the
      holder of a key can act for it.

    * Rate limits as on the live chain: ``serving_rate_limit`` blocks between two ``serve_axon``
      of a hotkey (``ServingRateLimitExceeded``), ``weights_rate_limit`` blocks between weight
      sets or commits (``SettingWeightsTooFast`` / ``CommittingWeightsTooFast``), and the
      commitments pallet's space quota: every ``set_commitment`` uses at least 100 bytes of
      ``commitment_max_space`` (``MaxSpace``, 3100) per hotkey and epoch (``SpaceLimitExceeded``).
    * MEV shield: ``NextKey`` holds an ML-KEM-768 public key (``mev_next_key``); a
      ``MevShield.submit_encrypted`` carrier is decrypted (ML-KEM-768 + XChaCha20-Poly1305, the
      SDK's ``encrypt_mlkem768`` format) and its inner extrinsic applied in the same block, so the
      SDK's shielded path (``execute(BurnedRegister)``, ``submit_call(..., shielded=True)``)
      runs unmodified; ``find_extrinsic`` returns the inner receipt. With the hyperparameter
      ``registration_requires_shield`` the devnet refuses registrations submitted in the clear.
      ``register_limit`` refuses (``RegistrationPriceLimitExceeded``) when the burn is above the
      signer's ``limit_price``.
    * Commit-reveal (hyperparameter ``commit_reveal_weights_enabled``): the SDK's ``SetWeights``
      then submits a drand-timelocked commit (``commit_timelocked_mechanism_weights``); it is
      stored, and once the drand round it names has passed (wall clock, quicknet) it is revealed
      through the state's ``decryptor`` (:func:`drand_decryptor` by default, which needs the drand
      HTTP API; tests pass their own) and applied as weights, as subtensor does each block.

Admin helpers outside the SDK: :func:`create_devnet`, :func:`fund`, :func:`add_stake`,
:func:`set_hyperparameter`, :func:`seed_neurons`.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import math
import os
import sqlite3
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

import numpy as np
from loguru import logger

from . import yuma

RAO_PER_TAO = 1_000_000_000
U16_MAX = 65535
SCHEMA_VERSION = 1
GLOBAL_MAX_SUBNET_COUNT = 4096

# Hyperparameters a subnet is created with (names follow subtensor's storage / the
# ``get_subnet_hyperparams`` runtime API). Devnet-specific ones are marked.
DEFAULT_HYPERPARAMS: dict[str, Any] = {
    "tempo": 360,
    "max_uids": 256,  # MaxAllowedUids
    "immunity_period": 4096,
    "weights_rate_limit": 100,  # WeightsSetRateLimit
    "weights_version": 0,  # WeightsVersionKey
    "burn": RAO_PER_TAO,  # registration cost (rao)
    "min_allowed_weights": 1,
    "max_weights_limit": U16_MAX,
    "kappa": 32767,  # u16 fraction (0.5)
    "bonds_moving_avg": 900_000,  # / 1_000_000
    "max_validators": 64,  # MaxAllowedValidators (top-k by stake get a permit)
    "activity_cutoff": 5000,
    "registration_allowed": True,
    "serving_rate_limit": 50,  # ServingRateLimit (blocks between two serve_axon of a hotkey)
    "commit_reveal_weights_enabled": False,
    "commit_reveal_period": 1,  # RevealPeriodEpochs
    "commitment_max_space": 3100,  # Commitments::MaxSpace: bytes per hotkey and epoch (>= 100 per commitment)
    "registration_requires_shield": False,  # devnet: refuse registrations not sent through the MEV shield
    "emission_per_block": RAO_PER_TAO,  # devnet: alpha rao emitted per block
    "miner_share": 0.5,  # devnet: fraction of the emission paid as incentive
    "max_regs_per_block": 64,
}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS subnets (
    netuid INTEGER PRIMARY KEY, params TEXT NOT NULL, tempo INTEGER NOT NULL,
    last_epoch_block INTEGER NOT NULL, epoch_index INTEGER NOT NULL DEFAULT 0,
    registered_at INTEGER NOT NULL, owner_hotkey TEXT NOT NULL, owner_coldkey TEXT NOT NULL,
    name TEXT NOT NULL, symbol TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS neurons (
    netuid INTEGER NOT NULL, uid INTEGER NOT NULL, hotkey TEXT NOT NULL, coldkey TEXT NOT NULL,
    registered_at INTEGER NOT NULL, last_update INTEGER NOT NULL,
    validator_permit INTEGER NOT NULL DEFAULT 0,
    rank REAL NOT NULL DEFAULT 0, trust REAL NOT NULL DEFAULT 0, consensus REAL NOT NULL DEFAULT 0,
    incentive REAL NOT NULL DEFAULT 0, dividends REAL NOT NULL DEFAULT 0,
    validator_trust REAL NOT NULL DEFAULT 0, emission INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (netuid, uid));
CREATE UNIQUE INDEX IF NOT EXISTS neurons_hotkey ON neurons (netuid, hotkey);
CREATE TABLE IF NOT EXISTS weights (netuid INTEGER, uid INTEGER, row TEXT NOT NULL, PRIMARY KEY (netuid, uid));
CREATE TABLE IF NOT EXISTS bonds (netuid INTEGER, uid INTEGER, row TEXT NOT NULL, PRIMARY KEY (netuid, uid));
CREATE TABLE IF NOT EXISTS axons (
    netuid INTEGER, hotkey TEXT, ip TEXT NOT NULL, port INTEGER NOT NULL, ip_type INTEGER NOT NULL,
    protocol INTEGER NOT NULL, version INTEGER NOT NULL, block INTEGER NOT NULL,
    PRIMARY KEY (netuid, hotkey));
CREATE TABLE IF NOT EXISTS commitments (
    netuid INTEGER, hotkey TEXT, block INTEGER NOT NULL, deposit INTEGER NOT NULL, fields TEXT NOT NULL,
    PRIMARY KEY (netuid, hotkey));
CREATE TABLE IF NOT EXISTS balances (coldkey TEXT PRIMARY KEY, free INTEGER NOT NULL, nonce INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS owners (hotkey TEXT PRIMARY KEY, coldkey TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS stakes (
    hotkey TEXT, coldkey TEXT, netuid INTEGER, amount INTEGER NOT NULL,
    PRIMARY KEY (hotkey, coldkey, netuid));
CREATE TABLE IF NOT EXISTS epochs (id INTEGER PRIMARY KEY AUTOINCREMENT, netuid INTEGER, block INTEGER, ran_at REAL, pid INTEGER);
CREATE TABLE IF NOT EXISTS extrinsics (
    id INTEGER PRIMARY KEY AUTOINCREMENT, block INTEGER NOT NULL, signer TEXT NOT NULL,
    module TEXT NOT NULL, function TEXT NOT NULL, success INTEGER NOT NULL, error TEXT, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS shielded_extrinsics (
    hash TEXT PRIMARY KEY, block INTEGER NOT NULL, signer TEXT NOT NULL, module TEXT NOT NULL,
    function TEXT NOT NULL, success INTEGER NOT NULL, error TEXT, message TEXT, events TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS commitment_usage (
    netuid INTEGER, hotkey TEXT, epoch INTEGER NOT NULL, used INTEGER NOT NULL, PRIMARY KEY (netuid, hotkey));
CREATE TABLE IF NOT EXISTS weight_commits (
    id INTEGER PRIMARY KEY AUTOINCREMENT, netuid INTEGER NOT NULL, hotkey TEXT NOT NULL, block INTEGER NOT NULL,
    reveal_round INTEGER NOT NULL, commit_hex TEXT NOT NULL, status TEXT NOT NULL DEFAULT 'pending', error TEXT);
"""


class DevnetError(RuntimeError):
    """A setup / usage error of the devnet itself (not a chain-side refusal)."""


class _Refused(Exception):
    """A chain-side refusal of an extrinsic (becomes a failed ExtrinsicResult)."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name
        self.message = message


def _to_rao(tao: float) -> int:
    return int(round(float(tao) * RAO_PER_TAO))


def _u16(x: float) -> int:
    return int(max(0, min(U16_MAX, round(float(x) * U16_MAX))))


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        if value.startswith("0x"):
            return bytes.fromhex(value[2:])
        return value.encode("utf-8")
    if isinstance(value, (list, tuple)):
        return bytes(int(b) for b in value)
    raise ValueError(f"cannot read bytes from {type(value).__name__}")


class DevnetCall:
    """A composed call: what ``compose`` returns and ``submit`` accepts (a module/function/params
    triple, plus the ``value`` dict and ``data`` bytes the SDK inspects on composed calls)."""

    def __init__(self, module: str, function: str, params: dict[str, Any]):
        self.module = module
        self.function = function
        self.params = dict(params)
        self.value = {
            "call_module": module,
            "call_function": function,
            "call_args": [{"name": k, "value": v} for k, v in self.params.items()],
        }
        self.data = json.dumps([module, function, self.params], default=_json_default, sort_keys=True).encode()

    def __repr__(self) -> str:
        return f"DevnetCall({self.module}.{self.function}({self.params}))"


def _json_default(o: Any) -> Any:
    if isinstance(o, (bytes, bytearray)):
        return "0x" + bytes(o).hex()
    if isinstance(o, DevnetCall):
        return {"module": o.module, "function": o.function, "params": o.params}
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    return str(o)


# ---------------------------------------------------------------------------------------------
# The state: synchronous SQLite access, shared by every process that opens the file.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RevealedWeights:
    """A commit-reveal payload once decrypted (subtensor's ``WeightsTlockPayload``)."""

    uids: list[int]
    values: list[int]
    version_key: int
    hotkey: Optional[bytes] = None  # the committer's public key (v4 payloads)


#: ``decryptor(commit_bytes, reveal_round)``: the revealed weights, or None while not decryptable.
Decryptor = Callable[[bytes, int], Optional[RevealedWeights]]


def _scale_compact(data: bytes, i: int) -> tuple[int, int]:
    mode = data[i] & 3
    if mode == 0:
        return data[i] >> 2, i + 1
    if mode == 1:
        return int.from_bytes(data[i:i + 2], "little") >> 2, i + 2
    if mode == 2:
        return int.from_bytes(data[i:i + 4], "little") >> 2, i + 4
    n = (data[i] >> 2) + 4
    return int.from_bytes(data[i + 1:i + 1 + n], "little"), i + 1 + n


def decode_tlock_payload(data: bytes) -> RevealedWeights:
    """SCALE-decode subtensor's ``WeightsTlockPayload`` (``hotkey: Vec<u8>, uids: Vec<u16>,
    values: Vec<u16>, version_key: u64``; the legacy form has no hotkey). Raises ``ValueError``."""
    def vec_u16(i: int) -> tuple[list[int], int]:
        n, i = _scale_compact(data, i)
        if i + 2 * n > len(data):
            raise ValueError("truncated Vec<u16>")
        return [int.from_bytes(data[i + 2 * k:i + 2 * k + 2], "little") for k in range(n)], i + 2 * n

    for with_hotkey in (True, False):
        try:
            i, hotkey = 0, None
            if with_hotkey:
                n, i = _scale_compact(data, 0)
                if n != 32:
                    continue
                hotkey, i = data[i:i + 32], i + 32
            uids, i = vec_u16(i)
            values, i = vec_u16(i)
            if len(uids) != len(values) or i + 8 != len(data):
                continue
            return RevealedWeights(uids, values, int.from_bytes(data[i:i + 8], "little"), hotkey)
        except (IndexError, ValueError):
            continue
    raise ValueError("not a WeightsTlockPayload")


def drand_decryptor(commit: bytes, reveal_round: int) -> Optional[RevealedWeights]:
    """Decrypt a timelocked weights commit with the drand quicknet signature of its round (fetched
    over HTTP by ``bittensor_core.decrypt``); None while that signature cannot be had."""
    import bittensor_core

    try:
        plain = bittensor_core.decrypt(bytes(commit), no_errors=True)
    except Exception:  # noqa: BLE001 - unreachable beacon or not yet published
        return None
    return None if plain is None else decode_tlock_payload(bytes(plain))


class DevnetState:
    def __init__(self, path: str | os.PathLike, *, busy_timeout_s: float = 30.0, create: bool = False,
                 decryptor: Optional[Decryptor] = None):
        self.path = Path(path)
        if not create and not self.path.exists():
            raise DevnetError(
                f"devnet chain database {self.path} does not exist; create it with "
                "`iota_subnet.chain.devnet.create_devnet(...)` (or the CLI's devnet setup)"
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
            self.conn.executescript(_SCHEMA)
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

    def tick(self) -> None:
        """Run every epoch that is due (cheap when nothing is due; called before each access)."""
        block = self.block()
        if block == self._last_tick_block:
            return
        self._last_tick_block = block
        for r in self._q("SELECT netuid, tempo, last_epoch_block FROM subnets"):
            netuid, tempo, last = int(r["netuid"]), int(r["tempo"]), int(r["last_epoch_block"])
            if tempo <= 0:
                continue
            due = self.last_epoch_at_or_before(block, netuid, tempo)
            if due > last:
                self._run_epoch(netuid, due)
        self.reveal_due_commits()

    def reveal_due_commits(self, now: Optional[float] = None) -> int:
        """Reveal every pending weights commit whose drand round has been published (as subtensor
        does each block): decrypt with :attr:`decryptor`, check, write the weights. Returns how
        many were applied; a commit the decryptor cannot open yet stays pending."""
        from bittensor.timelock import current_round

        rnd = current_round(now)
        due = self._q("SELECT * FROM weight_commits WHERE status='pending' AND reveal_round<=? ORDER BY id", (rnd,))
        applied = 0
        for row in due:
            try:
                revealed = self.decryptor(bytes.fromhex(row["commit_hex"]), int(row["reveal_round"]))
            except Exception as e:  # noqa: BLE001 - a payload that never decrypts is a failed reveal
                revealed, error = None, f"{type(e).__name__}: {e}"
            else:
                error = None
            if revealed is None and error is None:
                continue
            block = self.block()
            with self.tx() as c:
                if c.execute("SELECT status FROM weight_commits WHERE id=?", (row["id"],)).fetchone()["status"] != "pending":
                    continue   # another process revealed it
                try:
                    if error is not None:
                        raise _Refused("InvalidRevealCommitHashNotMatch", error)
                    _reveal_weights(c, block, int(row["netuid"]), str(row["hotkey"]), revealed)
                    c.execute("UPDATE weight_commits SET status='revealed' WHERE id=?", (row["id"],))
                    applied += 1
                except _Refused as refused:
                    c.execute("UPDATE weight_commits SET status='failed', error=? WHERE id=?",
                              (f"{refused.name}: {refused.message}", row["id"]))
        return applied

    def _run_epoch(self, netuid: int, epoch_block: int) -> bool:
        with self.tx() as c:
            row = c.execute("SELECT * FROM subnets WHERE netuid=?", (netuid,)).fetchone()
            if row is None or int(row["last_epoch_block"]) >= epoch_block:
                return False  # another process ran it
            params = dict(DEFAULT_HYPERPARAMS)
            params.update(json.loads(row["params"]))
            elapsed = epoch_block - int(row["last_epoch_block"])
            self._epoch_in_tx(c, netuid, epoch_block, params, elapsed)
            c.execute(
                "UPDATE subnets SET last_epoch_block=?, epoch_index=epoch_index+1 WHERE netuid=?",
                (epoch_block, netuid),
            )
            c.execute("INSERT INTO epochs (netuid, block, ran_at, pid) VALUES (?,?,?,?)", (netuid, epoch_block, time.time(), os.getpid()))
        logger.debug("devnet: epoch of netuid {} at block {} (pid {})", netuid, epoch_block, os.getpid())
        return True

    def _epoch_in_tx(self, c: sqlite3.Connection, netuid: int, block: int, params: dict, elapsed: int) -> None:
        neurons = [dict(r) for r in c.execute("SELECT * FROM neurons WHERE netuid=? ORDER BY uid", (netuid,))]
        n = len(neurons)
        if n == 0:
            return
        hotkeys = [nr["hotkey"] for nr in neurons]
        stake = np.zeros(n)
        for i, hk in enumerate(hotkeys):
            r = c.execute("SELECT COALESCE(SUM(amount),0) AS s FROM stakes WHERE netuid=? AND hotkey=?", (netuid, hk)).fetchone()
            stake[i] = float(r["s"])
        W = np.zeros((n, n))
        for r in c.execute("SELECT uid, row FROM weights WHERE netuid=?", (netuid,)):
            i = int(r["uid"])
            if i < n:
                for j, v in json.loads(r["row"]):
                    if int(j) < n:
                        W[i, int(j)] = float(v)
        B = np.zeros((n, n))
        for r in c.execute("SELECT uid, row FROM bonds WHERE netuid=?", (netuid,)):
            i = int(r["uid"])
            if i < n:
                for j, v in json.loads(r["row"]):
                    if int(j) < n:
                        B[i, int(j)] = float(v)
        last_update = np.array([nr["last_update"] for nr in neurons], dtype=np.int64)
        registered = np.array([nr["registered_at"] for nr in neurons], dtype=np.int64)
        active = (block - last_update) <= int(params["activity_cutoff"])
        # Permits used for this epoch are the ones from the previous epoch (as on chain);
        # the new top-k permits are stored for the next one.
        permit = np.array([bool(nr["validator_permit"]) for nr in neurons])
        emission_total = float(params["emission_per_block"]) * max(1, elapsed)
        res = yuma.yuma_epoch(
            stake, W, bonds_prev=B, validator_permit=permit, active=active,
            last_update=last_update, registered_at=registered,
            kappa=int(params["kappa"]) / U16_MAX,
            bonds_alpha=1.0 - int(params["bonds_moving_avg"]) / 1_000_000,
            emission=emission_total, miner_share=float(params["miner_share"]),
        )
        new_permit = yuma.topk_nonzero(stake, int(params["max_validators"]))
        for i, nr in enumerate(neurons):
            em = int(res.emission[i])
            c.execute(
                "UPDATE neurons SET rank=?, trust=?, consensus=?, incentive=?, dividends=?, validator_trust=?,"
                " emission=?, validator_permit=? WHERE netuid=? AND uid=?",
                (float(res.rank[i]), float(res.trust[i]), float(res.consensus[i]), float(res.incentive[i]),
                 float(res.dividends[i]), float(res.validator_trust[i]), em, int(new_permit[i]), netuid, i),
            )
            if em > 0:
                c.execute(
                    "INSERT INTO stakes VALUES (?,?,?,?) ON CONFLICT(hotkey, coldkey, netuid)"
                    " DO UPDATE SET amount = amount + excluded.amount",
                    (nr["hotkey"], nr["coldkey"], netuid, em),
                )
            row = [[j, float(res.bonds[i, j])] for j in range(n) if res.bonds[i, j] > 0]
            c.execute("INSERT OR REPLACE INTO bonds VALUES (?,?,?)", (netuid, i, json.dumps(row)))

    def refresh_permits(self, netuid: int) -> None:
        """Recompute validator permits now (top-k by stake), outside the epoch (admin setup)."""
        with self.tx() as c:
            sub = c.execute("SELECT params FROM subnets WHERE netuid=?", (netuid,)).fetchone()
            if sub is None:
                raise DevnetError(f"subnet {netuid} does not exist")
            params = dict(DEFAULT_HYPERPARAMS)
            params.update(json.loads(sub["params"]))
            neurons = [dict(r) for r in c.execute("SELECT uid, hotkey FROM neurons WHERE netuid=? ORDER BY uid", (netuid,))]
            stake = np.array([
                float(c.execute("SELECT COALESCE(SUM(amount),0) AS s FROM stakes WHERE netuid=? AND hotkey=?",
                                (netuid, nr["hotkey"])).fetchone()["s"]) for nr in neurons])
            permit = yuma.topk_nonzero(stake, int(params["max_validators"])) if len(neurons) else []
            for nr, p in zip(neurons, permit):
                c.execute("UPDATE neurons SET validator_permit=? WHERE netuid=? AND uid=?", (int(p), netuid, nr["uid"]))

    # -- MEV shield ----------------------------------------------------------------------------

    def mev_public_key(self) -> bytes:
        """The shield's ML-KEM-768 encapsulation key (``MevShield.NextKey``); created on first use."""
        return bytes.fromhex(self._mev_keys()[0])

    def _mev_keys(self) -> tuple[str, str]:
        ek, dk = self.meta("mev_ek"), self.meta("mev_dk")
        if ek is None or dk is None:
            from kyber_py.ml_kem import ML_KEM_768

            new_ek, new_dk = ML_KEM_768.keygen()
            with self.tx() as c:
                c.execute("INSERT OR IGNORE INTO meta VALUES ('mev_ek', ?)", (new_ek.hex(),))
                c.execute("INSERT OR IGNORE INTO meta VALUES ('mev_dk', ?)", (new_dk.hex(),))
            ek, dk = self.meta("mev_ek"), self.meta("mev_dk")
        return ek, dk

    def mev_open(self, blob: bytes) -> dict:
        """Decrypt a shielded carrier (``[key_hash 16][u16 kem_len][kem_ct][nonce 24][aead_ct]``,
        ML-KEM-768 + XChaCha20-Poly1305 with the shared secret as key) and check its inner
        extrinsic's signature. Returns ``{"call": [module, function, params], "signer", "hash"}``;
        raises :class:`_Refused` for anything that does not open."""
        from Crypto.Cipher import ChaCha20_Poly1305
        from kyber_py.ml_kem import ML_KEM_768

        try:
            n = int.from_bytes(blob[16:18], "little")
            kem, nonce, sealed = blob[18:18 + n], blob[18 + n:42 + n], blob[42 + n:]
            secret = ML_KEM_768.decaps(bytes.fromhex(self._mev_keys()[1]), kem)
            inner = ChaCha20_Poly1305.new(key=secret, nonce=nonce).decrypt_and_verify(sealed[:-16], sealed[-16:])
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise _Refused("BadEncryptedPayload", f"the shielded payload does not decrypt: {e}") from None
        return _open_inner_extrinsic(inner)

    # -- extrinsics ----------------------------------------------------------------------------

    def apply(self, signer: str, module: str, function: str, params: dict) -> tuple[int, int, list[dict]]:
        """Apply a signed call inside one write transaction. Returns (block, index, events);
        raises :class:`_Refused` (the transaction is rolled back, the refusal logged)."""
        handler = _HANDLERS.get((module, function))
        block = self.block()
        try:
            with self.tx() as c:
                if handler is None:
                    raise _Refused("CallNotSupported", f"the devnet does not implement {module}.{function}")
                self._ensure_faucet(c, signer)
                events = handler(self, c, block, signer, params)
                c.execute("UPDATE balances SET nonce = nonce + 1 WHERE coldkey=?", (signer,))
                cur = c.execute(
                    "INSERT INTO extrinsics (block, signer, module, function, success, error, at) VALUES (?,?,?,?,1,NULL,?)",
                    (block, signer, module, function, time.time()),
                )
                idx = int(cur.lastrowid)
        except _Refused as refused:
            with self.tx() as c:
                c.execute(
                    "INSERT INTO extrinsics (block, signer, module, function, success, error, at) VALUES (?,?,?,?,0,?,?)",
                    (block, signer, module, function, refused.name, time.time()),
                )
            raise
        return block, idx, events

    def _ensure_faucet(self, c: sqlite3.Connection, account: str) -> None:
        row = c.execute("SELECT 1 FROM balances WHERE coldkey=?", (account,)).fetchone()
        if row is None:
            auto = int(c.execute("SELECT value FROM meta WHERE key='auto_fund_rao'").fetchone()["value"])
            c.execute("INSERT INTO balances (coldkey, free, nonce) VALUES (?,?,0)", (account, auto))


# -- signed inner extrinsics (the MEV shield's payload) -----------------------------------------

_SIG_BYTES = 64


def _seal_inner_extrinsic(call: "DevnetCall", keypair: Any, nonce: int, period: int) -> tuple[bytes, str]:
    payload = json.dumps({"call": [call.module, call.function, call.params], "signer": keypair.ss58_address,
                          "crypto": int(getattr(keypair, "crypto_type", 1)), "nonce": int(nonce),
                          "period": int(period)}, default=_json_default, sort_keys=True).encode()
    sealed = payload + bytes(keypair.sign(payload))
    return sealed, "0x" + hashlib.blake2b(sealed, digest_size=32).hexdigest()


def _open_inner_extrinsic(sealed: bytes) -> dict:
    from bittensor.sp_core import verify

    payload, signature = sealed[:-_SIG_BYTES], sealed[-_SIG_BYTES:]
    try:
        d = json.loads(payload)
        ok = verify(payload, signature, d["signer"], int(d.get("crypto", 1)))
    except (ValueError, KeyError, TypeError) as e:
        raise _Refused("BadEncryptedPayload", f"the shielded extrinsic is malformed: {e}") from None
    if not ok:
        raise _Refused("BadSignature", "the shielded extrinsic's signature does not verify")
    return {"call": d["call"], "signer": d["signer"],
            "hash": "0x" + hashlib.blake2b(sealed, digest_size=32).hexdigest()}


# -- call handlers (run inside the write transaction) ------------------------------------------


def _subnet_in_tx(c: sqlite3.Connection, netuid: int, error: str = "SubnetNotExists") -> dict:
    row = c.execute("SELECT * FROM subnets WHERE netuid=?", (int(netuid),)).fetchone()
    if row is None:
        raise _Refused(error, f"subnet {netuid} does not exist")
    out = dict(row)
    params = dict(DEFAULT_HYPERPARAMS)
    params.update(json.loads(out["params"]))
    params["tempo"] = out["tempo"]
    out["params"] = params
    return out


def _debit(c: sqlite3.Connection, coldkey: str, rao: int, error: str, what: str) -> None:
    row = c.execute("SELECT free FROM balances WHERE coldkey=?", (coldkey,)).fetchone()
    free = int(row["free"]) if row else 0
    if free < rao:
        raise _Refused(error, f"{what} needs {rao / RAO_PER_TAO:.9f} TAO but coldkey {coldkey} has "
                              f"{free / RAO_PER_TAO:.9f} TAO")
    c.execute("UPDATE balances SET free = free - ? WHERE coldkey=?", (rao, coldkey))


def _h_register_limit(st: DevnetState, c, block, signer, p) -> list[dict]:
    """``register_limit``: ``burned_register`` only while the burn is at most ``limit_price`` (rao)."""
    sub = _subnet_in_tx(c, int(p["netuid"]))
    burn, limit = int(sub["params"]["burn"]), int(p["limit_price"])
    if burn > limit:
        raise _Refused("RegistrationPriceLimitExceeded",
                       f"the registration burn is {burn / RAO_PER_TAO:.9f} TAO, above the limit of "
                       f"{limit / RAO_PER_TAO:.9f} TAO")
    return _h_burned_register(st, c, block, signer, p)


def _h_burned_register(st: DevnetState, c, block, signer, p) -> list[dict]:
    netuid, hotkey = int(p["netuid"]), str(p["hotkey"])
    sub = _subnet_in_tx(c, netuid)
    hp = sub["params"]
    if hp["registration_requires_shield"] and not st.shielding:
        raise _Refused("ShieldRequired", "registration must be submitted through the MEV shield "
                                         "(MevShield.submit_encrypted)")
    if not hp["registration_allowed"]:
        raise _Refused("SubNetRegistrationDisabled", f"registration is disabled on netuid {netuid}")
    if c.execute("SELECT 1 FROM neurons WHERE netuid=? AND hotkey=?", (netuid, hotkey)).fetchone():
        raise _Refused("HotKeyAlreadyRegisteredInSubNet", f"hotkey {hotkey} is already registered on netuid {netuid}")
    owner = c.execute("SELECT coldkey FROM owners WHERE hotkey=?", (hotkey,)).fetchone()
    if owner is not None and owner["coldkey"] != signer:
        raise _Refused("NonAssociatedColdKey", f"hotkey {hotkey} is owned by another coldkey ({owner['coldkey']})")
    regs = c.execute("SELECT COUNT(*) AS k FROM neurons WHERE netuid=? AND registered_at=?", (netuid, block)).fetchone()["k"]
    if regs >= int(hp["max_regs_per_block"]):
        raise _Refused("TooManyRegistrationsThisBlock", f"too many registrations in block {block}")
    _debit(c, signer, int(hp["burn"]), "NotEnoughBalanceToStake", "registration")
    if owner is None:
        c.execute("INSERT INTO owners VALUES (?,?)", (hotkey, signer))
    n = c.execute("SELECT COUNT(*) AS k FROM neurons WHERE netuid=?", (netuid,)).fetchone()["k"]
    if n < int(hp["max_uids"]):
        uid = int(n)
        c.execute("INSERT INTO neurons (netuid, uid, hotkey, coldkey, registered_at, last_update) VALUES (?,?,?,?,?,?)",
                  (netuid, uid, hotkey, signer, block, block))
        pruned = None
    else:
        uid, pruned = _prune_target(c, netuid, block, int(hp["immunity_period"]))
        c.execute(
            "UPDATE neurons SET hotkey=?, coldkey=?, registered_at=?, last_update=?, validator_permit=0, rank=0, trust=0,"
            " consensus=0, incentive=0, dividends=0, validator_trust=0, emission=0 WHERE netuid=? AND uid=?",
            (hotkey, signer, block, block, netuid, uid))
        c.execute("DELETE FROM weights WHERE netuid=? AND uid=?", (netuid, uid))
        c.execute("DELETE FROM bonds WHERE netuid=? AND uid=?", (netuid, uid))
        # Bonds held on the replaced uid no longer mean anything.
        for r in c.execute("SELECT uid, row FROM bonds WHERE netuid=?", (netuid,)).fetchall():
            row = [e for e in json.loads(r["row"]) if int(e[0]) != uid]
            c.execute("UPDATE bonds SET row=? WHERE netuid=? AND uid=?", (json.dumps(row), netuid, r["uid"]))
        logger.info("devnet: netuid {} full; uid {} ({}) pruned for {}", netuid, uid, pruned, hotkey)
    return [{"module_id": "SubtensorModule", "event_id": "NeuronRegistered",
             "attributes": {"netuid": netuid, "uid": uid, "hotkey": hotkey, "pruned_hotkey": pruned,
                            "burn": int(hp["burn"])}}]


def _prune_target(c, netuid: int, block: int, immunity: int) -> tuple[int, str]:
    """Lowest-emission non-immune uid (ties: older registration, then lower uid); when all are
    immune, the lowest-emission immune one."""
    rows = [dict(r) for r in c.execute("SELECT uid, hotkey, emission, registered_at FROM neurons WHERE netuid=?", (netuid,))]
    key = lambda r: (r["emission"], r["registered_at"], r["uid"])  # noqa: E731
    candidates = [r for r in rows if block - r["registered_at"] >= immunity] or rows
    best = min(candidates, key=key)
    return int(best["uid"]), str(best["hotkey"])


def _registered_uid(c, netuid: int, hotkey: str, error: str = "HotKeyNotRegisteredInSubNet") -> dict:
    row = c.execute("SELECT * FROM neurons WHERE netuid=? AND hotkey=?", (netuid, hotkey)).fetchone()
    if row is None:
        raise _Refused(error, f"hotkey {hotkey} is not registered on netuid {netuid}")
    return dict(row)


def _h_set_weights(st: DevnetState, c, block, signer, p) -> list[dict]:
    netuid = int(p["netuid"])
    if int(p.get("mecid", 0) or 0) != 0:
        raise _Refused("MechanismDoesNotExist", "the devnet has only mechanism 0")
    sub = _subnet_in_tx(c, netuid, "MechanismDoesNotExist")
    hp = sub["params"]
    if hp["commit_reveal_weights_enabled"]:
        raise _Refused("CommitRevealEnabled", f"commit-reveal is enabled on netuid {netuid}: commit the weights")
    me = _registered_uid(c, netuid, signer)
    _check_rate(hp, me, block, "SettingWeightsTooFast", "weights set")
    _write_weights(c, netuid, hp, me, [int(u) for u in p["dests"]], [int(v) for v in p["weights"]],
                   int(p.get("version_key", 0)), block)
    return [{"module_id": "SubtensorModule", "event_id": "WeightsSet", "attributes": {"netuid": netuid, "uid": me["uid"]}}]


def _check_rate(hp: dict, me: dict, block: int, error: str, what: str) -> None:
    rate = int(hp["weights_rate_limit"])
    if rate and me["last_update"] > 0 and block - int(me["last_update"]) < rate:
        raise _Refused(error, f"{what} {block - me['last_update']} blocks after the last; rate limit is {rate} blocks")


def _write_weights(c, netuid: int, hp: dict, me: dict, dests: list[int], values: list[int], version_key: int,
                   block: int, *, touch_last_update: bool = True) -> None:
    """Check a weight vector as subtensor's ``do_set_weights`` does and store it as ``me``'s row."""
    if len(dests) != len(values):
        raise _Refused("WeightVecNotEqualSize", "uids and weights differ in length")
    if version_key < int(hp["weights_version"]):
        raise _Refused("IncorrectWeightVersionKey",
                       f"version_key {version_key} is older than the subnet's weights_version {hp['weights_version']}")
    self_only = dests == [me["uid"]]
    if not self_only and not me["validator_permit"]:
        raise _Refused("NeuronNoValidatorPermit", f"uid {me['uid']} has no validator permit on netuid {netuid}")
    if len(set(dests)) != len(dests):
        raise _Refused("DuplicateUids", "duplicate uids in weights")
    n = c.execute("SELECT COUNT(*) AS k FROM neurons WHERE netuid=?", (netuid,)).fetchone()["k"]
    if any(u < 0 or u >= n for u in dests):
        raise _Refused("UidVecContainInvalidOne", f"weights name a uid outside 0..{n - 1}")
    if any(v < 0 or v > U16_MAX for v in values):
        raise _Refused("InvalidWeight", "weights must be u16")
    if not self_only and len(dests) < int(hp["min_allowed_weights"]):
        raise _Refused("WeightVecLengthIsLow", f"at least {hp['min_allowed_weights']} weights required")
    total = sum(values)
    if not self_only and total > 0 and len(values) > 1 and max(values) * U16_MAX > int(hp["max_weights_limit"]) * total:
        raise _Refused("MaxWeightExceeded", "a weight exceeds max_weights_limit")
    top = max(values) if values else 0
    row = [[u, int(round(v * U16_MAX / top))] for u, v in zip(dests, values) if v > 0] if top else []
    c.execute("INSERT OR REPLACE INTO weights VALUES (?,?,?)", (netuid, me["uid"], json.dumps(sorted(row))))
    if touch_last_update:
        c.execute("UPDATE neurons SET last_update=? WHERE netuid=? AND uid=?", (block, netuid, me["uid"]))


def _h_set_weights_legacy(st, c, block, signer, p) -> list[dict]:
    return _h_set_weights(st, c, block, signer, {**p, "mecid": 0})


def _h_commit_timelocked(st: DevnetState, c, block, signer, p) -> list[dict]:
    """``commit_timelocked_(mechanism_)weights``: store the drand-timelocked commit; it is revealed
    by :meth:`DevnetState.reveal_due_commits` once its round is published."""
    netuid = int(p["netuid"])
    if int(p.get("mecid", 0) or 0) != 0:
        raise _Refused("MechanismDoesNotExist", "the devnet has only mechanism 0")
    sub = _subnet_in_tx(c, netuid, "MechanismDoesNotExist")
    hp = sub["params"]
    if not hp["commit_reveal_weights_enabled"]:
        raise _Refused("CommitRevealDisabled", f"commit-reveal weights are disabled on netuid {netuid}")
    me = _registered_uid(c, netuid, signer)
    _check_rate(hp, me, block, "CommittingWeightsTooFast", "weights committed")
    commit = _as_bytes(p["commit"])
    if not commit or len(commit) > 5000:
        raise _Refused("CommitTooLarge", "a timelocked commit holds 1 to 5000 bytes")
    pending = c.execute("SELECT COUNT(*) AS k FROM weight_commits WHERE netuid=? AND hotkey=? AND status='pending'",
                        (netuid, signer)).fetchone()["k"]
    if pending >= 10:
        raise _Refused("TooManyUnrevealedCommits", "10 commits are waiting for their reveal")
    c.execute("INSERT INTO weight_commits (netuid, hotkey, block, reveal_round, commit_hex) VALUES (?,?,?,?,?)",
              (netuid, signer, block, int(p["reveal_round"]), commit.hex()))
    c.execute("UPDATE neurons SET last_update=? WHERE netuid=? AND uid=?", (block, netuid, me["uid"]))
    return [{"module_id": "SubtensorModule", "event_id": "TimelockedWeightsCommitted",
             "attributes": {"netuid": netuid, "who": signer, "reveal_round": int(p["reveal_round"])}}]


def _reveal_weights(c, block: int, netuid: int, hotkey: str, w: RevealedWeights) -> None:
    sub = _subnet_in_tx(c, netuid)
    me = _registered_uid(c, netuid, hotkey)
    if w.hotkey is not None:
        from bittensor.sp_core import ss58_decode
        if bytes(w.hotkey) != bytes(ss58_decode(hotkey)):
            raise _Refused("InvalidRevealCommitHashNotMatch", "the payload names another hotkey than the committer")
    _write_weights(c, netuid, sub["params"], me, list(w.uids), list(w.values), int(w.version_key), block,
                   touch_last_update=False)


def _h_serve_axon(st: DevnetState, c, block, signer, p) -> list[dict]:
    netuid = int(p["netuid"])
    sub = _subnet_in_tx(c, netuid, "MechanismDoesNotExist")
    _registered_uid(c, netuid, signer, "HotKeyNotRegisteredInNetwork")
    ip_type = int(p["ip_type"])
    if ip_type not in (4, 6):
        raise _Refused("InvalidIpType", f"ip_type {ip_type} is not 4 or 6")
    ip = int(p["ip"])
    try:
        (ipaddress.IPv4Address if ip_type == 4 else ipaddress.IPv6Address)(ip)
    except ValueError:
        raise _Refused("InvalidIpAddress", f"{ip} is not a valid IPv{ip_type} address") from None
    prev = c.execute("SELECT block FROM axons WHERE netuid=? AND hotkey=?", (netuid, signer)).fetchone()
    limit = int(sub["params"]["serving_rate_limit"])
    if prev is not None and limit and block - int(prev["block"]) < limit:
        raise _Refused("ServingRateLimitExceeded", f"axon served {block - prev['block']} blocks ago; the serving rate "
                                                   f"limit is {limit} blocks")
    c.execute("INSERT OR REPLACE INTO axons VALUES (?,?,?,?,?,?,?,?)",
              (netuid, signer, str(ip), int(p["port"]), ip_type, int(p.get("protocol", 4)), int(p.get("version", 0)), block))
    return [{"module_id": "SubtensorModule", "event_id": "AxonServed", "attributes": {"netuid": netuid, "hotkey": signer}}]


def _normalize_fields(info: Any) -> list[dict]:
    fields = info.get("fields") if isinstance(info, dict) else info
    if fields and isinstance(fields, (list, tuple)) and len(fields) == 1 and isinstance(fields[0], (list, tuple)):
        fields = fields[0]  # tolerate a BoundedVec wrapped once more
    out = []
    for entry in fields or []:
        if isinstance(entry, str):
            out.append(entry)
            continue
        if not isinstance(entry, dict) or len(entry) != 1:
            raise _Refused("InvalidCommitment", f"cannot read commitment field {entry!r}")
        ((variant, payload),) = entry.items()
        if variant.startswith("Raw"):
            raw = _as_bytes(payload)
            if len(raw) > 128:
                raise _Refused("InvalidCommitment", "a Raw commitment field holds at most 128 bytes")
            out.append({f"Raw{len(raw)}": "0x" + raw.hex()})
        else:
            out.append({variant: payload if not isinstance(payload, (bytes, bytearray)) else "0x" + bytes(payload).hex()})
    if len(out) > 16:
        raise _Refused("TooManyFieldsInCommitmentInfo", "at most 16 commitment fields")
    return out


def _h_set_commitment(st: DevnetState, c, block, signer, p) -> list[dict]:
    netuid = int(p["netuid"])
    sub = _subnet_in_tx(c, netuid)
    _registered_uid(c, netuid, signer, "AccountNotAllowedCommit")
    fields = _normalize_fields(p["info"])
    size = sum(len(_as_bytes(next(iter(f.values())))) if isinstance(f, dict) else len(str(f)) for f in fields)
    cost, cap, epoch = max(100, size), int(sub["params"]["commitment_max_space"]), int(sub["epoch_index"])
    row = c.execute("SELECT epoch, used FROM commitment_usage WHERE netuid=? AND hotkey=?", (netuid, signer)).fetchone()
    used = int(row["used"]) if row is not None and int(row["epoch"]) == epoch else 0
    if used + cost > cap:
        raise _Refused("SpaceLimitExceeded", f"this commitment uses {cost} bytes; {used} of the {cap} bytes a hotkey "
                                             "may commit per epoch are used: wait for the next epoch")
    c.execute("INSERT OR REPLACE INTO commitment_usage VALUES (?,?,?,?)", (netuid, signer, epoch, used + cost))
    c.execute("INSERT OR REPLACE INTO commitments VALUES (?,?,?,?,?)", (netuid, signer, block, 0, json.dumps(fields)))
    return [{"module_id": "Commitments", "event_id": "Commitment", "attributes": {"netuid": netuid, "who": signer}}]


def _h_add_stake(st: DevnetState, c, block, signer, p) -> list[dict]:
    hotkey, netuid, amount = str(p["hotkey"]), int(p["netuid"]), int(p.get("amount_staked", p.get("amount", 0)))
    _subnet_in_tx(c, netuid)
    if amount <= 0:
        raise _Refused("AmountTooLow", "stake amount must be positive")
    if c.execute("SELECT 1 FROM owners WHERE hotkey=?", (hotkey,)).fetchone() is None:
        raise _Refused("HotKeyAccountNotExists", f"hotkey {hotkey} has never been registered")
    _debit(c, signer, amount, "NotEnoughBalanceToStake", "staking")
    c.execute("INSERT INTO stakes VALUES (?,?,?,?) ON CONFLICT(hotkey, coldkey, netuid) DO UPDATE SET amount = amount + excluded.amount",
              (hotkey, signer, netuid, amount))
    return [{"module_id": "SubtensorModule", "event_id": "StakeAdded",
             "attributes": {"coldkey": signer, "hotkey": hotkey, "netuid": netuid, "amount": amount}}]


def _h_remove_stake(st: DevnetState, c, block, signer, p) -> list[dict]:
    hotkey, netuid, amount = str(p["hotkey"]), int(p["netuid"]), int(p["amount_unstaked"])
    row = c.execute("SELECT amount FROM stakes WHERE hotkey=? AND coldkey=? AND netuid=?", (hotkey, signer, netuid)).fetchone()
    have = int(row["amount"]) if row else 0
    if amount <= 0 or amount > have:
        raise _Refused("NotEnoughStakeToWithdraw", f"{signer} has {have} rao staked on {hotkey}, asked {amount}")
    c.execute("UPDATE stakes SET amount = amount - ? WHERE hotkey=? AND coldkey=? AND netuid=?", (amount, hotkey, signer, netuid))
    c.execute("UPDATE balances SET free = free + ? WHERE coldkey=?", (amount, signer))
    return [{"module_id": "SubtensorModule", "event_id": "StakeRemoved", "attributes": {"hotkey": hotkey, "amount": amount}}]


def _h_transfer(st: DevnetState, c, block, signer, p) -> list[dict]:
    dest = p["dest"]
    if isinstance(dest, dict):
        dest = dest.get("Id") or next(iter(dest.values()))
    amount = int(p["value"])
    _debit(c, signer, amount, "InsufficientBalance", "transfer")
    c.execute("INSERT INTO balances (coldkey, free, nonce) VALUES (?,?,0) ON CONFLICT(coldkey) DO UPDATE SET free = free + excluded.free",
              (str(dest), amount))
    return [{"module_id": "Balances", "event_id": "Transfer", "attributes": {"from": signer, "to": str(dest), "amount": amount}}]


def _h_commit_hash_unsupported(st, c, block, signer, p) -> list[dict]:
    raise _Refused("CallNotSupported", "the devnet implements the timelocked commit-reveal (commit_timelocked_*), "
                                       "not the legacy salted-hash commits")


def _h_submit_encrypted(st: DevnetState, c, block, signer, p) -> list[dict]:
    """``MevShield.submit_encrypted``: decrypt the carrier and apply its inner extrinsic now (the
    block author's job on chain). The carrier succeeds even when the inner call fails; the inner
    receipt is kept for ``find_extrinsic``."""
    inner = st.mev_open(_as_bytes(p["ciphertext"]))
    module, function, params = inner["call"]
    handler = _HANDLERS.get((module, function))
    c.execute("SAVEPOINT inner")
    st.shielding += 1
    try:
        if handler is None or module == "MevShield":
            raise _Refused("CallNotSupported", f"the devnet does not implement {module}.{function} (shielded)")
        st._ensure_faucet(c, inner["signer"])
        events = handler(st, c, block, inner["signer"], params)
        c.execute("RELEASE inner")
        ok, error, message = True, None, "Success"
    except _Refused as refused:
        c.execute("ROLLBACK TO inner")
        c.execute("RELEASE inner")
        events, ok, error, message = [], False, refused.name, refused.message
    finally:
        st.shielding -= 1
    c.execute("INSERT OR REPLACE INTO shielded_extrinsics VALUES (?,?,?,?,?,?,?,?,?)",
              (inner["hash"], block, inner["signer"], module, function, int(ok), error, message,
               json.dumps(events, default=_json_default)))
    return [{"module_id": "MevShield", "event_id": "EncryptedSubmitted", "attributes": {"who": signer}}]


_HANDLERS = {
    ("SubtensorModule", "burned_register"): _h_burned_register,
    ("SubtensorModule", "register_limit"): _h_register_limit,
    ("SubtensorModule", "set_mechanism_weights"): _h_set_weights,
    ("SubtensorModule", "set_weights"): _h_set_weights_legacy,
    ("SubtensorModule", "commit_timelocked_mechanism_weights"): _h_commit_timelocked,
    ("SubtensorModule", "commit_timelocked_weights"): _h_commit_timelocked,
    ("SubtensorModule", "commit_mechanism_weights"): _h_commit_hash_unsupported,
    ("SubtensorModule", "commit_weights"): _h_commit_hash_unsupported,
    ("MevShield", "submit_encrypted"): _h_submit_encrypted,
    ("SubtensorModule", "serve_axon"): _h_serve_axon,
    ("SubtensorModule", "add_stake"): _h_add_stake,
    ("SubtensorModule", "remove_stake"): _h_remove_stake,
    ("Commitments", "set_commitment"): _h_set_commitment,
    ("Balances", "transfer_keep_alive"): _h_transfer,
    ("Balances", "transfer_allow_death"): _h_transfer,
}


# ---------------------------------------------------------------------------------------------
# Reads: storage items and runtime APIs in the shapes the SDK's decoders expect.
# ---------------------------------------------------------------------------------------------


def _axon_record(ax: Optional[dict]) -> dict:
    if not ax:
        return {"block": 0, "version": 0, "ip": 0, "port": 0, "ip_type": 0, "protocol": 0,
                "placeholder1": 0, "placeholder2": 0}
    return {"block": ax["block"], "version": ax["version"], "ip": ax["ip"], "port": ax["port"],
            "ip_type": ax["ip_type"], "protocol": ax["protocol"], "placeholder1": 0, "placeholder2": 0}


class _View:
    """One consistent read of a subnet (neurons, stake, axons) for the runtime APIs."""

    def __init__(self, st: DevnetState, netuid: int):
        self.st = st
        self.netuid = netuid
        self.sub = st.subnet(netuid)
        self.block = st.block()
        self.neurons = st.neurons(netuid) if self.sub else []
        self.stakes = st.stake_of(netuid) if self.sub else {}
        self.axons = st.axons(netuid) if self.sub else {}
        self._matrices: Optional[tuple[dict, dict]] = None

    def stake(self, hotkey: str) -> int:
        return sum(self.stakes.get(hotkey, {}).values())

    def active(self, nr: dict) -> bool:
        return self.block - int(nr["last_update"]) <= int(self.sub["params"]["activity_cutoff"])

    def neuron_info(self, nr: dict, *, lite: bool) -> dict:
        hk = nr["hotkey"]
        rec = {
            "hotkey": hk, "coldkey": nr["coldkey"], "uid": nr["uid"], "netuid": self.netuid,
            "active": self.active(nr), "axon_info": _axon_record(self.axons.get(hk)),
            "prometheus_info": {"block": 0, "version": 0, "ip": 0, "port": 0, "ip_type": 0},
            "stake": sorted(self.stakes.get(hk, {}).items()),
            "rank": _u16(nr["rank"]), "emission": int(nr["emission"]), "incentive": _u16(nr["incentive"]),
            "consensus": _u16(nr["consensus"]), "trust": _u16(nr["trust"]),
            "validator_trust": _u16(nr["validator_trust"]), "dividends": _u16(nr["dividends"]),
            "last_update": int(nr["last_update"]), "validator_permit": bool(nr["validator_permit"]),
            "pruning_score": _u16(nr["incentive"]),
        }
        if not lite:
            if self._matrices is None:
                self._matrices = (self.st.weights_rows(self.netuid, "weights"), self.st.weights_rows(self.netuid, "bonds"))
            w = self._matrices[0].get(nr["uid"], [])
            b = self._matrices[1].get(nr["uid"], [])
            rec["weights"] = [(int(j), int(v)) for j, v in w]
            rec["bonds"] = [(int(j), _u16(v)) for j, v in b]
        return rec

    def metagraph(self) -> Optional[dict]:
        if self.sub is None:
            return None
        sub, hp = self.sub, self.sub["params"]
        tempo = int(sub["tempo"])
        stakes = [self.stake(nr["hotkey"]) for nr in self.neurons]
        col = lambda key, f=float: [f(nr[key]) for nr in self.neurons]  # noqa: E731
        return {
            "netuid": self.netuid, "name": list(sub["name"].encode()), "symbol": list(sub["symbol"].encode()),
            "identity": None, "network_registered_at": int(sub["registered_at"]),
            "owner_hotkey": sub["owner_hotkey"], "owner_coldkey": sub["owner_coldkey"],
            "block": self.block, "tempo": tempo, "last_step": int(sub["last_epoch_block"]),
            "blocks_since_last_step": self.block - int(sub["last_epoch_block"]),
            "subnet_emission": 0, "alpha_in": RAO_PER_TAO, "alpha_out": 0, "tao_in": RAO_PER_TAO,
            "alpha_out_emission": int(hp["emission_per_block"]), "alpha_in_emission": 0, "tao_in_emission": 0,
            "pending_alpha_emission": 0, "pending_root_emission": 0, "subnet_volume": 0,
            "moving_price": {"bits": 2**32},
            "rho": 10, "kappa": int(hp["kappa"]), "min_allowed_weights": int(hp["min_allowed_weights"]),
            "max_weights_limit": int(hp["max_weights_limit"]), "weights_version": int(hp["weights_version"]),
            "weights_rate_limit": int(hp["weights_rate_limit"]), "activity_cutoff": int(hp["activity_cutoff"]),
            "max_validators": int(hp["max_validators"]), "num_uids": len(self.neurons), "max_uids": int(hp["max_uids"]),
            "burn": int(hp["burn"]), "difficulty": 0, "registration_allowed": bool(hp["registration_allowed"]),
            "pow_registration_allowed": False, "immunity_period": int(hp["immunity_period"]),
            "min_difficulty": 0, "max_difficulty": 0, "min_burn": int(hp["burn"]), "max_burn": int(hp["burn"]),
            "adjustment_alpha": 0, "adjustment_interval": 0, "target_regs_per_interval": 0,
            "max_regs_per_block": int(hp["max_regs_per_block"]), "serving_rate_limit": int(hp["serving_rate_limit"]),
            "commit_reveal_weights_enabled": bool(hp["commit_reveal_weights_enabled"]), "commit_reveal_period": 1,
            "liquid_alpha_enabled": False, "alpha_high": 0, "alpha_low": 0,
            "bonds_moving_avg": int(hp["bonds_moving_avg"]),
            "hotkeys": [nr["hotkey"] for nr in self.neurons], "coldkeys": [nr["coldkey"] for nr in self.neurons],
            "identities": [None] * len(self.neurons),
            "axons": [_axon_record(self.axons.get(nr["hotkey"])) for nr in self.neurons],
            "active": [self.active(nr) for nr in self.neurons],
            "validator_permit": [bool(nr["validator_permit"]) for nr in self.neurons],
            "pruning_score": [_u16(x) for x in col("incentive")],
            "last_update": col("last_update", int), "emission": col("emission", int),
            "dividends": [_u16(x) for x in col("dividends")], "incentives": [_u16(x) for x in col("incentive")],
            "consensus": [_u16(x) for x in col("consensus")], "trust": [_u16(x) for x in col("trust")],
            "rank": [_u16(x) for x in col("rank")], "block_at_registration": col("registered_at", int),
            "alpha_stake": stakes, "tao_stake": [0] * len(self.neurons), "total_stake": stakes,
            "tao_dividends_per_hotkey": [], "alpha_dividends_per_hotkey": [],
        }

    def hyperparams_v3(self) -> Optional[list[dict]]:
        if self.sub is None:
            return None
        hp = self.sub["params"]
        table = [
            ("rho", "u16", 10), ("kappa", "u16", hp["kappa"]), ("immunity_period", "u16", hp["immunity_period"]),
            ("min_allowed_weights", "u16", hp["min_allowed_weights"]), ("max_weights_limit", "u16", hp["max_weights_limit"]),
            ("tempo", "u16", self.sub["tempo"]), ("min_difficulty", "u64", 0), ("max_difficulty", "u64", 0),
            ("weights_version", "u64", hp["weights_version"]), ("weights_rate_limit", "u64", hp["weights_rate_limit"]),
            ("adjustment_interval", "u16", 0), ("activity_cutoff", "u16", hp["activity_cutoff"]),
            ("registration_allowed", "bool", bool(hp["registration_allowed"])), ("target_regs_per_interval", "u16", 0),
            ("min_burn", "u64", hp["burn"]), ("max_burn", "u64", hp["burn"]), ("bonds_moving_avg", "u64", hp["bonds_moving_avg"]),
            ("max_regs_per_block", "u16", hp["max_regs_per_block"]), ("serving_rate_limit", "u64", hp["serving_rate_limit"]),
            ("max_validators", "u16", hp["max_validators"]), ("adjustment_alpha", "u64", 0), ("difficulty", "u64", 0),
            ("commit_reveal_period", "u64", 1),
            ("commit_reveal_weights_enabled", "bool", bool(hp["commit_reveal_weights_enabled"])),
            ("alpha_high", "u16", 0), ("alpha_low", "u16", 0), ("liquid_alpha_enabled", "bool", False),
            ("max_uids", "u16", hp["max_uids"]), ("burn", "u64", hp["burn"]),
        ]
        return [{"name": name, "value": {tag: value}} for name, tag, value in table]


def _vec(st: DevnetState, netuid: int, fn) -> Optional[list]:
    if st.subnet(netuid) is None:
        return None
    return [fn(nr) for nr in st.neurons(netuid)]


def _hp(name: str, cast=int):
    def get(st: DevnetState, p: list, block: int):
        sub = st.subnet(int(p[0]))
        return None if sub is None else cast(sub["params"][name])
    return get


def _account_info(st: DevnetState, coldkey: str) -> dict:
    row = st._q1("SELECT free, nonce FROM balances WHERE coldkey=?", (str(coldkey),))
    free, nonce = (int(row["free"]), int(row["nonce"])) if row else (0, 0)
    return {"nonce": nonce, "consumers": 0, "providers": 1 if row else 0, "sufficients": 0,
            "data": {"free": free, "reserved": 0, "frozen": 0, "flags": 0}}


def _commitment_value(st: DevnetState, p: list, block: int):
    return st.commitments(int(p[0])).get(str(p[1]))


def _axon_value(st: DevnetState, p: list, block: int):
    ax = st.axons(int(p[0])).get(str(p[1]))
    return None if ax is None else _axon_record(ax)


def _weights_value(table: str):
    def get(st: DevnetState, p: list, block: int):
        netuid = int(p[0]) % GLOBAL_MAX_SUBNET_COUNT
        row = st.weights_rows(netuid, table).get(int(p[1]))
        if row is None:
            return []
        return [(int(j), int(v) if table == "weights" else _u16(v)) for j, v in row]
    return get


def _float_vec(key: str):
    return lambda st, p, b: _vec(st, int(p[0]), lambda nr: _u16(nr[key]))


_STORAGE: dict[tuple[str, str], Any] = {
    ("SubtensorModule", "Uids"): lambda st, p, b: st.uid_of(int(p[0]), str(p[1])),
    ("SubtensorModule", "Keys"): lambda st, p, b: next((nr["hotkey"] for nr in st.neurons(int(p[0])) if nr["uid"] == int(p[1])), None),
    ("SubtensorModule", "SubnetworkN"): lambda st, p, b: len(st.neurons(int(p[0]))) if st.subnet(int(p[0])) else 0,
    ("SubtensorModule", "NetworksAdded"): lambda st, p, b: st.subnet(int(p[0])) is not None,
    ("SubtensorModule", "Tempo"): lambda st, p, b: (st.subnet(int(p[0])) or {}).get("tempo"),
    ("SubtensorModule", "Burn"): _hp("burn"),
    ("SubtensorModule", "MinBurn"): _hp("burn"),
    ("SubtensorModule", "MaxBurn"): _hp("burn"),
    ("SubtensorModule", "CollateralLockShare"): lambda st, p, b: 0,
    ("SubtensorModule", "CommitRevealWeightsEnabled"): _hp("commit_reveal_weights_enabled", bool),
    ("SubtensorModule", "WeightsSetRateLimit"): _hp("weights_rate_limit"),
    ("SubtensorModule", "WeightsVersionKey"): _hp("weights_version"),
    ("SubtensorModule", "MinAllowedWeights"): _hp("min_allowed_weights"),
    ("SubtensorModule", "MaxWeightsLimit"): _hp("max_weights_limit"),
    ("SubtensorModule", "ImmunityPeriod"): _hp("immunity_period"),
    ("SubtensorModule", "MaxAllowedUids"): _hp("max_uids"),
    ("SubtensorModule", "MaxAllowedValidators"): _hp("max_validators"),
    ("SubtensorModule", "ActivityCutoff"): _hp("activity_cutoff"),
    ("SubtensorModule", "Kappa"): _hp("kappa"),
    ("SubtensorModule", "BondsMovingAverage"): _hp("bonds_moving_avg"),
    ("SubtensorModule", "NetworkRegistrationAllowed"): _hp("registration_allowed", bool),
    ("SubtensorModule", "ServingRateLimit"): _hp("serving_rate_limit"),
    ("SubtensorModule", "MaxRegistrationsPerBlock"): _hp("max_regs_per_block"),
    ("SubtensorModule", "Difficulty"): lambda st, p, b: 0,
    ("SubtensorModule", "RevealPeriodEpochs"): lambda st, p, b: 1,
    ("SubtensorModule", "SubnetEpochConsensus"): lambda st, p, b: "Yuma",
    ("SubtensorModule", "SubnetEmissionEnabled"): lambda st, p, b: 1,
    ("SubtensorModule", "PendingEpochAt"): lambda st, p, b: 0,
    ("SubtensorModule", "LastEpochBlock"): lambda st, p, b: (st.subnet(int(p[0])) or {}).get("last_epoch_block"),
    ("SubtensorModule", "SubnetEpochIndex"): lambda st, p, b: (st.subnet(int(p[0])) or {}).get("epoch_index"),
    ("SubtensorModule", "BlocksSinceLastStep"): lambda st, p, b: (st.block() - st.subnet(int(p[0]))["last_epoch_block"]) if st.subnet(int(p[0])) else None,
    ("SubtensorModule", "LastMechansimStepBlock"): lambda st, p, b: (st.subnet(int(p[0])) or {}).get("last_epoch_block"),
    ("SubtensorModule", "SubnetOwner"): lambda st, p, b: (st.subnet(int(p[0])) or {}).get("owner_coldkey"),
    ("SubtensorModule", "SubnetOwnerHotkey"): lambda st, p, b: (st.subnet(int(p[0])) or {}).get("owner_hotkey"),
    ("SubtensorModule", "TokenSymbol"): lambda st, p, b: list(((st.subnet(int(p[0])) or {}).get("symbol") or "").encode()),
    ("SubtensorModule", "LastUpdate"): lambda st, p, b: _vec(st, int(p[0]) % GLOBAL_MAX_SUBNET_COUNT, lambda nr: int(nr["last_update"])),
    ("SubtensorModule", "ValidatorPermit"): lambda st, p, b: _vec(st, int(p[0]), lambda nr: bool(nr["validator_permit"])),
    ("SubtensorModule", "Active"): lambda st, p, b: [bool(x) for x in (_View(st, int(p[0])).metagraph() or {}).get("active", [])],
    ("SubtensorModule", "Incentive"): _float_vec("incentive"),
    ("SubtensorModule", "Dividends"): _float_vec("dividends"),
    ("SubtensorModule", "Rank"): _float_vec("rank"),
    ("SubtensorModule", "Trust"): _float_vec("trust"),
    ("SubtensorModule", "Consensus"): _float_vec("consensus"),
    ("SubtensorModule", "ValidatorTrust"): _float_vec("validator_trust"),
    ("SubtensorModule", "Emission"): lambda st, p, b: _vec(st, int(p[0]), lambda nr: int(nr["emission"])),
    ("SubtensorModule", "BlockAtRegistration"): lambda st, p, b: next((int(nr["registered_at"]) for nr in st.neurons(int(p[0])) if nr["uid"] == int(p[1])), None),
    ("SubtensorModule", "Weights"): _weights_value("weights"),
    ("SubtensorModule", "Bonds"): _weights_value("bonds"),
    ("SubtensorModule", "Axons"): _axon_value,
    ("SubtensorModule", "Owner"): lambda st, p, b: (st._q1("SELECT coldkey FROM owners WHERE hotkey=?", (str(p[0]),)) or {"coldkey": None})["coldkey"],
    ("SubtensorModule", "OwnedHotkeys"): lambda st, p, b: [r["hotkey"] for r in st._q("SELECT hotkey FROM owners WHERE coldkey=?", (str(p[0]),))],
    ("SubtensorModule", "IsNetworkMember"): lambda st, p, b: st.uid_of(int(p[1]), str(p[0])) is not None,
    ("SubtensorModule", "TotalHotkeyAlpha"): lambda st, p, b: sum(st.stake_of(int(p[1])).get(str(p[0]), {}).values()),
    ("SubtensorModule", "Alpha"): lambda st, p, b: st.stake_of(int(p[2])).get(str(p[0]), {}).get(str(p[1]), 0),
    ("System", "Account"): lambda st, p, b: _account_info(st, str(p[0])),
    ("System", "Number"): lambda st, p, b: b,
    ("Timestamp", "Now"): lambda st, p, b: st.block_timestamp_ms(b),
    ("Commitments", "CommitmentOf"): _commitment_value,
    ("Commitments", "RevealedCommitments"): lambda st, p, b: None,
    ("MevShield", "NextKey"): lambda st, p, b: "0x" + st.mev_public_key().hex(),
}


def _map_netuids(st: DevnetState, fn) -> list[tuple]:
    return [(netuid, fn(st.subnet(netuid))) for netuid in st.netuids()]


def _pending_commits(st: DevnetState, netuid: int) -> list[tuple[int, list]]:
    """``TimelockedWeightCommits``: the commits not revealed yet, as (epoch, [(hotkey, commit block,
    commit, reveal round)]); the epoch is the commit block // (tempo + 1)."""
    tempo = int((st.subnet(netuid) or {}).get("tempo") or 0)
    out: dict[int, list] = {}
    for r in st._q("SELECT * FROM weight_commits WHERE netuid=? AND status='pending' ORDER BY id", (netuid,)):
        out.setdefault(int(r["block"]) // (tempo + 1), []).append(
            (r["hotkey"], int(r["block"]), "0x" + r["commit_hex"], int(r["reveal_round"])))
    return sorted(out.items())


_STORAGE_MAPS: dict[tuple[str, str], Any] = {
    ("SubtensorModule", "Uids"): lambda st, p: [(nr["hotkey"], nr["uid"]) for nr in st.neurons(int(p[0]))],
    ("SubtensorModule", "Keys"): lambda st, p: [(nr["uid"], nr["hotkey"]) for nr in st.neurons(int(p[0]))],
    ("SubtensorModule", "BlockAtRegistration"): lambda st, p: [(nr["uid"], nr["registered_at"]) for nr in st.neurons(int(p[0]))],
    ("SubtensorModule", "Weights"): lambda st, p: [(uid, [(int(j), int(v)) for j, v in row]) for uid, row in st.weights_rows(int(p[0]) % GLOBAL_MAX_SUBNET_COUNT, "weights").items()],
    ("SubtensorModule", "Bonds"): lambda st, p: [(uid, [(int(j), _u16(v)) for j, v in row]) for uid, row in st.weights_rows(int(p[0]) % GLOBAL_MAX_SUBNET_COUNT, "bonds").items()],
    ("SubtensorModule", "Axons"): lambda st, p: [(hk, _axon_record(ax)) for hk, ax in st.axons(int(p[0])).items()],
    ("SubtensorModule", "NetworksAdded"): lambda st, p: _map_netuids(st, lambda s: True),
    ("SubtensorModule", "Tempo"): lambda st, p: _map_netuids(st, lambda s: s["tempo"]),
    ("SubtensorModule", "Burn"): lambda st, p: _map_netuids(st, lambda s: s["params"]["burn"]),
    ("SubtensorModule", "SubnetworkN"): lambda st, p: [(n, len(st.neurons(n))) for n in st.netuids()],
    ("SubtensorModule", "TokenSymbol"): lambda st, p: _map_netuids(st, lambda s: list(s["symbol"].encode())),
    ("SubtensorModule", "SubnetOwner"): lambda st, p: _map_netuids(st, lambda s: s["owner_coldkey"]),
    ("SubtensorModule", "LastEpochBlock"): lambda st, p: _map_netuids(st, lambda s: s["last_epoch_block"]),
    ("SubtensorModule", "IsNetworkMember"): lambda st, p: [(n, True) for n in st.netuids() if st.uid_of(n, str(p[0])) is not None],
    ("SubtensorModule", "TotalHotkeyAlpha"): lambda st, p: [(n, sum(st.stake_of(n).get(str(p[0]), {}).values())) for n in st.netuids()],
    ("SubtensorModule", "Owner"): lambda st, p: [(r["hotkey"], r["coldkey"]) for r in st._q("SELECT * FROM owners")],
    ("Commitments", "CommitmentOf"): lambda st, p: list(st.commitments(int(p[0])).items()),
    ("Commitments", "RevealedCommitments"): lambda st, p: [],
    ("SubtensorModule", "TimelockedWeightCommits"): lambda st, p: _pending_commits(st, int(p[0]) % GLOBAL_MAX_SUBNET_COUNT),
    ("SubtensorModule", "SubnetEmaTaoFlow"): lambda st, p: [],
}


def _runtime(st: DevnetState, api: str, method: str, params: list) -> Any:
    if api == "NeuronInfoRuntimeApi":
        view = _View(st, int(params[0]))
        if view.sub is None:
            return [] if method.startswith("get_neurons") else None
        lite = method.endswith("_lite")
        if method in ("get_neurons", "get_neurons_lite"):
            return [view.neuron_info(nr, lite=lite) for nr in view.neurons]
        if method in ("get_neuron", "get_neuron_lite"):
            nr = next((nr for nr in view.neurons if nr["uid"] == int(params[1])), None)
            return None if nr is None else view.neuron_info(nr, lite=lite)
    if api == "SubnetInfoRuntimeApi":
        if method == "get_metagraph":
            return _View(st, int(params[0])).metagraph()
        if method == "get_all_metagraphs":
            return [_View(st, n).metagraph() for n in st.netuids()]
        if method in ("get_subnet_hyperparams_v3",):
            return _View(st, int(params[0])).hyperparams_v3()
        if method in ("get_subnet_hyperparams", "get_subnet_hyperparams_v2"):
            entries = _View(st, int(params[0])).hyperparams_v3()
            return None if entries is None else {e["name"]: next(iter(e["value"].values())) for e in entries}
        if method == "get_next_epoch_start_block":
            sub = st.subnet(int(params[0]))
            if sub is None:
                return None
            b = st.block()
            return DevnetState.last_epoch_at_or_before(b, int(params[0]), sub["tempo"]) + sub["tempo"] + 1
    raise _Refused("RuntimeApiNotSupported", f"the devnet does not implement runtime API {api}.{method}")


# ---------------------------------------------------------------------------------------------
# The SDK seam: DevnetSubstrate implements bittensor's ``Substrate`` protocol.
# ---------------------------------------------------------------------------------------------


class DevnetSubstrate:
    """``bittensor._substrate.Substrate`` backed by a devnet SQLite file.

    ``bt.Client("local", substrate=DevnetSubstrate(path))`` gives a normal SDK client. Every
    method runs its SQLite work on a worker thread, so the event loop never blocks on the
    file lock.
    """

    def __init__(self, path: str | os.PathLike, *, busy_timeout_s: float = 30.0, decryptor: Optional[Decryptor] = None):
        self.path = Path(path)
        self._busy_timeout_s = busy_timeout_s
        self._decryptor = decryptor
        self._state: Optional[DevnetState] = None
        self.token_symbols: dict[int, str] = {}
        self._unknown_logged: set = set()

    # lifecycle ---------------------------------------------------------------------------------

    @property
    def state(self) -> DevnetState:
        if self._state is None:
            self._state = DevnetState(self.path, busy_timeout_s=self._busy_timeout_s, decryptor=self._decryptor)
        return self._state

    async def connect(self) -> None:
        await asyncio.to_thread(lambda: self.state)

    async def close(self) -> None:
        if self._state is not None:
            self._state.close()
            self._state = None

    def balance(self, rao: int, netuid: int = 0):
        from bittensor.balance import Balance

        symbol = self.token_symbols.get(netuid) if netuid else None
        return Balance(int(rao), netuid, symbol)

    async def _run(self, fn, *args):
        def call():
            st = self.state
            st.tick()
            return fn(st, *args)

        try:
            return await asyncio.to_thread(call)
        except _Refused as refused:
            from bittensor.result import ChainError

            raise ChainError(refused.message, refused.name) from None

    # chain / blocks ------------------------------------------------------------------------------

    async def block_number(self) -> int:
        return await self._run(lambda st: st.block())

    async def finalized_block_number(self) -> int:
        return await self.block_number()

    async def block_hash(self, block: Optional[int] = None) -> str:
        if block is not None and self._state is not None and self._state._genesis is not None:
            return self._state.block_hash(int(block))   # pure arithmetic: no file access, no thread hop
        return await self._run(lambda st: st.block_hash(st.block() if block is None else int(block)))

    async def block_time(self) -> float:
        return await self._run(lambda st: st.block_time)

    async def spec_version(self) -> int:
        return 1

    async def get_block(self, block_number: Optional[int] = None, block_hash: Optional[str] = None) -> Optional[dict]:
        def get(st: DevnetState):
            b = DevnetState.block_of_hash(block_hash) if block_hash else block_number
            b = st.block() if b is None else int(b)
            if b > st.block():
                return None
            ts = {"call": {"call_module": "Timestamp", "call_function": "set",
                           "call_args": [{"name": "now", "value": st.block_timestamp_ms(b)}]}}
            header = {"number": b, "hash": st.block_hash(b), "parentHash": st.block_hash(max(0, b - 1))}
            return {"header": header, "extrinsics": [ts]}

        return await self._run(get)

    async def blocks(self, *, finalized: bool = False) -> AsyncIterator[dict]:
        st = await asyncio.to_thread(lambda: self.state)
        last = await self.block_number()
        while True:
            now = time.time()
            next_at = st.genesis + (last + 1) * st.block_time
            if next_at > now:
                await asyncio.sleep(next_at - now + 0.001)
            current = await self.block_number()
            for b in range(last + 1, current + 1):
                yield {"header": {"number": b, "hash": st.block_hash(b), "parentHash": st.block_hash(b - 1)}}
            last = max(last, current)

    async def events(self, block_hash: Optional[str] = None) -> list[dict]:
        return []

    # storage -------------------------------------------------------------------------------------

    def _log_unknown(self, what: tuple) -> None:
        if what not in self._unknown_logged:
            self._unknown_logged.add(what)
            logger.debug("devnet: no storage/runtime item {}; answering empty", what)

    async def query(self, module: str, storage_function: str, params: Optional[list] = None,
                    block_hash: Optional[str] = None) -> Any:
        fn = _STORAGE.get((module, storage_function))
        if fn is None:
            self._log_unknown((module, storage_function))
            return None

        def get(st: DevnetState):
            b = DevnetState.block_of_hash(block_hash)
            return fn(st, list(params or []), st.block() if b is None else b)

        return await self._run(get)

    async def map_has_entries(self, module: str, storage_function: str, params: list,
                              block_hash: Optional[str] = None) -> bool:
        return bool(await self.query_map(module, storage_function, params, block_hash))

    async def query_map(self, module: str, storage_function: str, params: Optional[list] = None,
                        block_hash: Optional[str] = None) -> list[tuple[Any, Any]]:
        fn = _STORAGE_MAPS.get((module, storage_function))
        if fn is None:
            self._log_unknown((module, storage_function, "map"))
            return []
        return await self._run(lambda st: fn(st, list(params or [])))

    async def query_batch(self, module: str, storage_function: str, param_sets: list[list],
                          block_hash: Optional[str] = None) -> list[Any]:
        return [await self.query(module, storage_function, ps, block_hash) for ps in param_sets]

    async def runtime_call(self, api: str, method: str, params: list, block_hash: Optional[str] = None) -> Any:
        return await self._run(lambda st: _runtime(st, api, method, list(params or [])))

    async def constant(self, module: str, name: str) -> Any:
        if (module, name) == ("Aura", "SlotDuration"):
            return await self._run(lambda st: int(st.block_time * 1000))
        if (module, name) == ("Balances", "ExistentialDeposit"):
            return 500
        self._log_unknown(("constant", module, name))
        return None

    async def decode_scale(self, type_string: str, data: Any) -> Any:
        from bittensor.result import ChainError

        raise ChainError("the devnet has no SCALE codec (decode_scale is not supported)")

    # calls ----------------------------------------------------------------------------------------

    async def compose(self, call) -> DevnetCall:
        if isinstance(call, DevnetCall):
            return call
        module, function, params = call
        return DevnetCall(module, function, dict(params))

    async def estimate_fee(self, call, keypair):
        from bittensor.balance import Balance

        return Balance.from_rao(0)

    async def estimate_weight(self, call, keypair) -> dict:
        return {"ref_time": 0, "proof_size": 0}

    async def account_next_index(self, address: str) -> int:
        return await self._run(lambda st: _account_info(st, address)["nonce"])

    async def mev_next_key(self) -> Optional[bytes]:
        return await self._run(lambda st: st.mev_public_key())

    async def sign_extrinsic(self, call, keypair, *, nonce: int, period: int) -> tuple[bytes, str]:
        call = await self.compose(call)
        return _seal_inner_extrinsic(call, keypair, nonce, period)

    async def find_extrinsic(self, extrinsic_hash: str, block_hash: str):
        """The receipt of a shielded inner extrinsic applied in the block of ``block_hash``, or None."""
        from bittensor.balance import Balance
        from bittensor.result import ChainError, ExtrinsicResult

        block = DevnetState.block_of_hash(block_hash)
        row = await self._run(lambda st: st._q1("SELECT * FROM shielded_extrinsics WHERE hash=?", (extrinsic_hash,)))
        if row is None or block is None or int(row["block"]) != block:
            return None
        events = [{"extrinsic_idx": 0, "event": ev} for ev in json.loads(row["events"])]
        data = {}
        for ev in json.loads(row["events"]):
            if ev.get("event_id") == "NeuronRegistered":
                data = {"uid": ev["attributes"]["uid"], "burn_rao": ev["attributes"]["burn"]}
        if not row["success"]:
            error = ChainError(row["message"] or row["error"], row["error"])
            return ExtrinsicResult(success=False, message=row["message"] or "", error=error,
                                   block_hash=block_hash, extrinsic_id=f"{block}-shielded", fee=Balance.from_rao(0))
        return ExtrinsicResult(success=True, message="Success", block_hash=block_hash,
                               extrinsic_id=f"{block}-shielded", fee=Balance.from_rao(0), events=events, data=data)

    async def submit(self, call, keypair, *, nonce: Optional[int] = None, period: Optional[int] = None,
                     wait_for_inclusion: bool = True, wait_for_finalization: bool = True):
        from bittensor.balance import Balance
        from bittensor.result import ChainError, ExtrinsicResult

        call = await self.compose(call)
        signer = getattr(keypair, "ss58_address", None)
        try:
            from bittensor.sp_core import verify

            signature = bytes(keypair.sign(call.data))
            crypto = int(getattr(keypair, "crypto_type", 1))
            if not verify(call.data, signature, signer, crypto):
                raise ValueError("signature does not verify")
        except Exception as error:  # noqa: BLE001
            return ExtrinsicResult(success=False, message=f"cannot sign the extrinsic: {error}",
                                   error=ChainError(f"cannot sign the extrinsic: {error}", "BadSignature"))

        def apply(st: DevnetState):
            return st.apply(signer, call.module, call.function, call.params)

        try:
            block, idx, events = await self._run(apply)
        except ChainError as error:
            return ExtrinsicResult(success=False, message=error.message, error=error)
        st = self.state
        records = [{"extrinsic_idx": idx, "event": ev} for ev in events]
        records.append({"extrinsic_idx": idx, "event": {"module_id": "System", "event_id": "ExtrinsicSuccess", "attributes": {}}})
        data = {}
        for ev in events:
            if ev["event_id"] == "NeuronRegistered":
                data = {"uid": ev["attributes"]["uid"], "burn_rao": ev["attributes"]["burn"]}
        return ExtrinsicResult(success=True, message="Success", block_hash=st.block_hash(block),
                               extrinsic_id=f"{block}-{idx:04d}", fee=Balance.from_rao(0), events=records, data=data)

    async def submit_signed(self, extrinsic, keypair, *, wait_for_inclusion: bool = True,
                            wait_for_finalization: bool = True):
        return await self._unsupported("submit_signed")

    async def prepare(self, call, **kwargs):
        return await self._unsupported("prepare (out-of-process signing)")

    async def submit_signature(self, unsigned, signature, **kwargs):
        return await self._unsupported("submit_signature")

    def multisig_account(self, signatories: list[str], threshold: int):
        from bittensor.result import ChainError

        raise ChainError("multisig is not supported on the devnet")

    async def submit_multisig(self, call, keypair, multisig_account, **kwargs):
        return await self._unsupported("multisig")

    async def _unsupported(self, what: str):
        from bittensor.result import ChainError

        raise ChainError(f"{what} is not supported on the devnet")


# ---------------------------------------------------------------------------------------------
# Admin helpers (localnet setup; outside the SDK).
# ---------------------------------------------------------------------------------------------


def create_devnet(
    db: str | os.PathLike,
    netuid: int = 9,
    *,
    tempo: int = 20,
    block_time: float = 12.0,
    owner_hotkey: str = "5C4hrfjw9DjXZTzV3MwzrrAr9P1MJhSrvWGWqi1eSuyUpnhM",
    owner_coldkey: str = "5C4hrfjw9DjXZTzV3MwzrrAr9P1MJhSrvWGWqi1eSuyUpnhM",
    name: str = "iota-devnet",
    symbol: str = "ι",
    auto_fund_tao: float = 1000.0,
    weights_rate_limit: int = 10,
    immunity_period: int = 100,
    exist_ok: bool = False,
    start_block: int = 0,
    **hyperparams: Any,
) -> Path:
    """Create (or extend) a devnet file with one subnet.

    ``hyperparams`` are names of :data:`DEFAULT_HYPERPARAMS` (``max_uids``, ``immunity_period``,
    ``weights_rate_limit``, ``weights_version``, ``burn`` in rao or ``burn_tao``, ``max_validators``,
    ``emission_per_block``, ...). ``auto_fund_tao`` is a faucet: an account seen for the first time
    by a signed call starts with that balance (0 disables it; then use :func:`fund`).
    With ``exist_ok`` an existing subnet is left as it is. ``weights_rate_limit`` and
    ``immunity_period`` default to localnet-friendly values (10 and 100 blocks); the other
    hyperparameters default to chain-like values (:data:`DEFAULT_HYPERPARAMS`). ``start_block``: the
    height a new devnet starts at (genesis that many blocks in the past), so that state seeded with
    :func:`seed_neurons` can look old.
    """
    hyperparams["weights_rate_limit"] = int(weights_rate_limit)
    hyperparams["immunity_period"] = int(immunity_period)
    if "burn_tao" in hyperparams:
        hyperparams["burn"] = _to_rao(hyperparams.pop("burn_tao"))
    st = DevnetState(db, create=True)
    try:
        st.init_meta(block_time, time.time() - int(start_block) * float(block_time) if start_block else None)
        st.set_meta("auto_fund_rao", str(_to_rao(auto_fund_tao)))
        if st.subnet(netuid) is not None:
            if not exist_ok:
                raise DevnetError(f"subnet {netuid} already exists in {db}")
        else:
            st.create_subnet(netuid, owner_hotkey=owner_hotkey, owner_coldkey=owner_coldkey, name=name,
                             symbol=symbol, params={"tempo": tempo, **hyperparams})
        logger.info("devnet {}: netuid {} (tempo {}, block time {} s)", db, netuid, tempo, st.block_time)
    finally:
        st.close()
    return Path(db)


def fund(db: str | os.PathLike, coldkey_ss58: str, tao: float) -> int:
    """Credit ``tao`` to a coldkey's free balance; returns the new balance in rao."""
    st = DevnetState(db)
    try:
        with st.tx() as c:
            c.execute("INSERT INTO balances (coldkey, free, nonce) VALUES (?,?,0) ON CONFLICT(coldkey)"
                      " DO UPDATE SET free = free + excluded.free", (coldkey_ss58, _to_rao(tao)))
        return st.balance(coldkey_ss58)
    finally:
        st.close()


def add_stake(db: str | os.PathLike, hotkey_ss58: str, coldkey_ss58: str, tao: float, *, netuid: int = 9,
              refresh_permits: bool = True) -> int:
    """Stake ``tao`` (minted, not debited) from ``coldkey`` to ``hotkey`` on ``netuid``; with
    ``refresh_permits`` the validator permits are recomputed now instead of at the next epoch.
    Returns the hotkey's total stake on the subnet (rao)."""
    st = DevnetState(db)
    try:
        if st.subnet(netuid) is None:
            raise DevnetError(f"subnet {netuid} does not exist in {db}")
        with st.tx() as c:
            c.execute("INSERT OR IGNORE INTO owners VALUES (?,?)", (hotkey_ss58, coldkey_ss58))
            c.execute("INSERT INTO stakes VALUES (?,?,?,?) ON CONFLICT(hotkey, coldkey, netuid)"
                      " DO UPDATE SET amount = amount + excluded.amount",
                      (hotkey_ss58, coldkey_ss58, netuid, _to_rao(tao)))
        if refresh_permits:
            st.refresh_permits(netuid)
        return sum(st.stake_of(netuid).get(hotkey_ss58, {}).values())
    finally:
        st.close()


def halt_devnet(db: str | os.PathLike) -> int:
    """Stop the devnet's clock (a local network has ended): the block height stays where it is, so
    later reads (``iota-subnet chain metagraph``) show the chain as the run left it and run no
    epochs. Returns the halted block. :func:`resume_devnet` restarts the clock."""
    st = DevnetState(db)
    try:
        block = st.block()
        if st.meta("halted_at") is None:
            st.set_meta("halted_at", repr(time.time()))
        return block
    finally:
        st.close()


def resume_devnet(db: str | os.PathLike) -> int:
    """Restart a halted devnet's clock where it stopped (genesis moved forward by the pause).
    Returns the current block. A devnet that is not halted is left alone."""
    st = DevnetState(db)
    try:
        halted = st.meta("halted_at")
        if halted is not None:
            pause = time.time() - float(halted)
            with st.tx() as c:
                c.execute("UPDATE meta SET value=? WHERE key='genesis_time'", (repr(st.genesis + pause),))
                c.execute("DELETE FROM meta WHERE key='halted_at'")
            st._load_meta()
        return st.block()
    finally:
        st.close()


def set_hyperparameter(db: str | os.PathLike, netuid: int, **params: Any) -> None:
    """Change subnet hyperparameters (sudo on a real chain)."""
    st = DevnetState(db)
    try:
        st.set_params(netuid, **params)
    finally:
        st.close()


def seed_neurons(db: str | os.PathLike, netuid: int, neurons: list[dict]) -> list[int]:
    """Write neurons straight into the devnet's state (admin; a test's "other subnet users").

    Each entry: ``hotkey``, ``coldkey``, and optionally ``stake`` (TAO), ``validator_permit``
    (bool), ``registered_at`` / ``last_update`` (blocks; default: now), ``commitment`` (text) and
    ``commitment_block``, ``axon`` (``"ip:port"``). Returns the uids given, in order."""
    st = DevnetState(db)
    try:
        sub = st.subnet(netuid)
        if sub is None:
            raise DevnetError(f"subnet {netuid} does not exist in {db}")
        block = st.block()
        uids = []
        with st.tx() as c:
            for n in neurons:
                hk, ck = str(n["hotkey"]), str(n["coldkey"])
                uid = int(c.execute("SELECT COUNT(*) AS k FROM neurons WHERE netuid=?", (netuid,)).fetchone()["k"])
                if uid >= int(sub["params"]["max_uids"]):
                    raise DevnetError(f"subnet {netuid} is full ({uid} uids)")
                c.execute("INSERT INTO neurons (netuid, uid, hotkey, coldkey, registered_at, last_update,"
                          " validator_permit) VALUES (?,?,?,?,?,?,?)",
                          (netuid, uid, hk, ck, int(n.get("registered_at", block)), int(n.get("last_update", block)),
                           int(bool(n.get("validator_permit", False)))))
                c.execute("INSERT OR IGNORE INTO owners VALUES (?,?)", (hk, ck))
                if n.get("stake"):
                    c.execute("INSERT OR REPLACE INTO stakes VALUES (?,?,?,?)", (hk, ck, netuid, _to_rao(n["stake"])))
                if n.get("commitment") is not None:
                    raw = str(n["commitment"]).encode()
                    fields = [{f"Raw{len(raw[i:i + 128])}": "0x" + raw[i:i + 128].hex()} for i in range(0, len(raw), 128)]
                    c.execute("INSERT OR REPLACE INTO commitments VALUES (?,?,?,?,?)",
                              (netuid, hk, int(n.get("commitment_block", block)), 0, json.dumps(fields)))
                if n.get("axon"):
                    ip, port = str(n["axon"]).rsplit(":", 1)
                    c.execute("INSERT OR REPLACE INTO axons VALUES (?,?,?,?,?,?,?,?)",
                              (netuid, hk, str(int(ipaddress.ip_address(ip))), int(port), 4, 4, 0, block))
                uids.append(uid)
        return uids
    finally:
        st.close()


def epoch_log(db: str | os.PathLike, netuid: Optional[int] = None) -> list[dict]:
    """Every epoch run recorded in the file: netuid, block, ran_at, pid."""
    st = DevnetState(db)
    try:
        sql, args = "SELECT * FROM epochs", ()
        if netuid is not None:
            sql, args = sql + " WHERE netuid=?", (int(netuid),)
        return [dict(r) for r in st._q(sql + " ORDER BY id", args)]
    finally:
        st.close()
