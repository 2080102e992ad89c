"""The devnet's vocabulary: the on-disk format (SQLite tables, meta keys, hyperparameters a subnet
is created with), its errors, unit conversions, the composed call, and the rows every extrinsic
handler reads inside its write transaction.

The file format is fixed: a devnet file written by an earlier version must keep loading, so the
tables and hyperparameter names here do not change. Amounts are rao (1 TAO = 1e9 rao; alpha is
counted like TAO); ``u16`` fractions are scaled to 0..65535 as on subtensor.
"""
from __future__ import annotations

import json
import sqlite3
from typing import Any

import numpy as np

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

SCHEMA = """
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


class Refused(Exception):
    """A chain-side refusal of an extrinsic (becomes a failed ExtrinsicResult)."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name
        self.message = message


def to_rao(tao: float) -> int:
    return int(round(float(tao) * RAO_PER_TAO))


def u16(x: float) -> int:
    return int(max(0, min(U16_MAX, round(float(x) * U16_MAX))))


def as_bytes(value: Any) -> bytes:
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
        self.data = json.dumps([module, function, self.params], default=json_default, sort_keys=True).encode()

    def __repr__(self) -> str:
        return f"DevnetCall({self.module}.{self.function}({self.params}))"


def json_default(o: Any) -> Any:
    if isinstance(o, (bytes, bytearray)):
        return "0x" + bytes(o).hex()
    if isinstance(o, DevnetCall):
        return {"module": o.module, "function": o.function, "params": o.params}
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    return str(o)


# -- rows read inside a write transaction (a missing row is a chain-side refusal) ----------------


def subnet_in_tx(c: sqlite3.Connection, netuid: int, error: str = "SubnetNotExists") -> dict:
    row = c.execute("SELECT * FROM subnets WHERE netuid=?", (int(netuid),)).fetchone()
    if row is None:
        raise Refused(error, f"subnet {netuid} does not exist")
    out = dict(row)
    params = dict(DEFAULT_HYPERPARAMS)
    params.update(json.loads(out["params"]))
    params["tempo"] = out["tempo"]
    out["params"] = params
    return out


def debit(c: sqlite3.Connection, coldkey: str, rao: int, error: str, what: str) -> None:
    row = c.execute("SELECT free FROM balances WHERE coldkey=?", (coldkey,)).fetchone()
    free = int(row["free"]) if row else 0
    if free < rao:
        raise Refused(error, f"{what} needs {rao / RAO_PER_TAO:.9f} TAO but coldkey {coldkey} has "
                             f"{free / RAO_PER_TAO:.9f} TAO")
    c.execute("UPDATE balances SET free = free - ? WHERE coldkey=?", (rao, coldkey))


def registered_uid(c, netuid: int, hotkey: str, error: str = "HotKeyNotRegisteredInSubNet") -> dict:
    row = c.execute("SELECT * FROM neurons WHERE netuid=? AND hotkey=?", (netuid, hotkey)).fetchone()
    if row is None:
        raise Refused(error, f"hotkey {hotkey} is not registered on netuid {netuid}")
    return dict(row)
