"""Extrinsics on the devnet: each signed call is applied at once (its "inclusion" is the current
block) inside one ``BEGIN IMMEDIATE`` transaction and checked the way subtensor checks it;
a refusal raises :class:`~.schema.Refused` carrying the chain's error name, the transaction is
rolled back and the refusal logged in ``extrinsics``.

Registration (``burned_register``, ``register_limit``: refused above the signer's
``limit_price``; pruning when the subnet is full), ``serve_axon`` (``serving_rate_limit``),
commitments (the pallet's per-epoch ``commitment_max_space`` quota), staking, transfers and the
MEV shield's carrier (``MevShield.submit_encrypted``: its inner extrinsic is applied in the same
block). Weight extrinsics live in :mod:`.weights`.
"""
from __future__ import annotations

import ipaddress
import json
import sqlite3
import time
from typing import TYPE_CHECKING, Any

from loguru import logger

from .schema import RAO_PER_TAO, Refused, as_bytes, debit, json_default, registered_uid, subnet_in_tx
from .shield import mev_open
from .weights import h_commit_hash_unsupported, h_commit_timelocked, h_set_weights, h_set_weights_legacy

if TYPE_CHECKING:  # pragma: no cover
    from .state import DevnetState


def h_register_limit(st: DevnetState, c, block, signer, p) -> list[dict]:
    """``register_limit``: ``burned_register`` only while the burn is at most ``limit_price`` (rao)."""
    sub = subnet_in_tx(c, int(p["netuid"]))
    burn, limit = int(sub["params"]["burn"]), int(p["limit_price"])
    if burn > limit:
        raise Refused("RegistrationPriceLimitExceeded",
                      f"the registration burn is {burn / RAO_PER_TAO:.9f} TAO, above the limit of "
                      f"{limit / RAO_PER_TAO:.9f} TAO")
    return h_burned_register(st, c, block, signer, p)


def h_burned_register(st: DevnetState, c, block, signer, p) -> list[dict]:
    netuid, hotkey = int(p["netuid"]), str(p["hotkey"])
    sub = subnet_in_tx(c, netuid)
    hp = sub["params"]
    if hp["registration_requires_shield"] and not st.shielding:
        raise Refused("ShieldRequired", "registration must be submitted through the MEV shield "
                                        "(MevShield.submit_encrypted)")
    if not hp["registration_allowed"]:
        raise Refused("SubNetRegistrationDisabled", f"registration is disabled on netuid {netuid}")
    if c.execute("SELECT 1 FROM neurons WHERE netuid=? AND hotkey=?", (netuid, hotkey)).fetchone():
        raise Refused("HotKeyAlreadyRegisteredInSubNet", f"hotkey {hotkey} is already registered on netuid {netuid}")
    owner = c.execute("SELECT coldkey FROM owners WHERE hotkey=?", (hotkey,)).fetchone()
    if owner is not None and owner["coldkey"] != signer:
        raise Refused("NonAssociatedColdKey", f"hotkey {hotkey} is owned by another coldkey ({owner['coldkey']})")
    regs = c.execute("SELECT COUNT(*) AS k FROM neurons WHERE netuid=? AND registered_at=?", (netuid, block)).fetchone()["k"]
    if regs >= int(hp["max_regs_per_block"]):
        raise Refused("TooManyRegistrationsThisBlock", f"too many registrations in block {block}")
    debit(c, signer, int(hp["burn"]), "NotEnoughBalanceToStake", "registration")
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



def h_serve_axon(st: DevnetState, c, block, signer, p) -> list[dict]:
    netuid = int(p["netuid"])
    sub = subnet_in_tx(c, netuid, "MechanismDoesNotExist")
    registered_uid(c, netuid, signer, "HotKeyNotRegisteredInNetwork")
    ip_type = int(p["ip_type"])
    if ip_type not in (4, 6):
        raise Refused("InvalidIpType", f"ip_type {ip_type} is not 4 or 6")
    ip = int(p["ip"])
    try:
        (ipaddress.IPv4Address if ip_type == 4 else ipaddress.IPv6Address)(ip)
    except ValueError:
        raise Refused("InvalidIpAddress", f"{ip} is not a valid IPv{ip_type} address") from None
    prev = c.execute("SELECT block FROM axons WHERE netuid=? AND hotkey=?", (netuid, signer)).fetchone()
    limit = int(sub["params"]["serving_rate_limit"])
    if prev is not None and limit and block - int(prev["block"]) < limit:
        raise Refused("ServingRateLimitExceeded", f"axon served {block - prev['block']} blocks ago; the serving rate "
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
            raise Refused("InvalidCommitment", f"cannot read commitment field {entry!r}")
        ((variant, payload),) = entry.items()
        if variant.startswith("Raw"):
            raw = as_bytes(payload)
            if len(raw) > 128:
                raise Refused("InvalidCommitment", "a Raw commitment field holds at most 128 bytes")
            out.append({f"Raw{len(raw)}": "0x" + raw.hex()})
        else:
            out.append({variant: payload if not isinstance(payload, (bytes, bytearray)) else "0x" + bytes(payload).hex()})
    if len(out) > 16:
        raise Refused("TooManyFieldsInCommitmentInfo", "at most 16 commitment fields")
    return out


def h_set_commitment(st: DevnetState, c, block, signer, p) -> list[dict]:
    netuid = int(p["netuid"])
    sub = subnet_in_tx(c, netuid)
    registered_uid(c, netuid, signer, "AccountNotAllowedCommit")
    fields = _normalize_fields(p["info"])
    size = sum(len(as_bytes(next(iter(f.values())))) if isinstance(f, dict) else len(str(f)) for f in fields)
    cost, cap, epoch = max(100, size), int(sub["params"]["commitment_max_space"]), int(sub["epoch_index"])
    row = c.execute("SELECT epoch, used FROM commitment_usage WHERE netuid=? AND hotkey=?", (netuid, signer)).fetchone()
    used = int(row["used"]) if row is not None and int(row["epoch"]) == epoch else 0
    if used + cost > cap:
        raise Refused("SpaceLimitExceeded", f"this commitment uses {cost} bytes; {used} of the {cap} bytes a hotkey "
                                            "may commit per epoch are used: wait for the next epoch")
    c.execute("INSERT OR REPLACE INTO commitment_usage VALUES (?,?,?,?)", (netuid, signer, epoch, used + cost))
    c.execute("INSERT OR REPLACE INTO commitments VALUES (?,?,?,?,?)", (netuid, signer, block, 0, json.dumps(fields)))
    return [{"module_id": "Commitments", "event_id": "Commitment", "attributes": {"netuid": netuid, "who": signer}}]


def h_add_stake(st: DevnetState, c, block, signer, p) -> list[dict]:
    hotkey, netuid, amount = str(p["hotkey"]), int(p["netuid"]), int(p.get("amount_staked", p.get("amount", 0)))
    subnet_in_tx(c, netuid)
    if amount <= 0:
        raise Refused("AmountTooLow", "stake amount must be positive")
    if c.execute("SELECT 1 FROM owners WHERE hotkey=?", (hotkey,)).fetchone() is None:
        raise Refused("HotKeyAccountNotExists", f"hotkey {hotkey} has never been registered")
    debit(c, signer, amount, "NotEnoughBalanceToStake", "staking")
    c.execute("INSERT INTO stakes VALUES (?,?,?,?) ON CONFLICT(hotkey, coldkey, netuid) DO UPDATE SET amount = amount + excluded.amount",
              (hotkey, signer, netuid, amount))
    return [{"module_id": "SubtensorModule", "event_id": "StakeAdded",
             "attributes": {"coldkey": signer, "hotkey": hotkey, "netuid": netuid, "amount": amount}}]


def h_remove_stake(st: DevnetState, c, block, signer, p) -> list[dict]:
    hotkey, netuid, amount = str(p["hotkey"]), int(p["netuid"]), int(p["amount_unstaked"])
    row = c.execute("SELECT amount FROM stakes WHERE hotkey=? AND coldkey=? AND netuid=?", (hotkey, signer, netuid)).fetchone()
    have = int(row["amount"]) if row else 0
    if amount <= 0 or amount > have:
        raise Refused("NotEnoughStakeToWithdraw", f"{signer} has {have} rao staked on {hotkey}, asked {amount}")
    c.execute("UPDATE stakes SET amount = amount - ? WHERE hotkey=? AND coldkey=? AND netuid=?", (amount, hotkey, signer, netuid))
    c.execute("UPDATE balances SET free = free + ? WHERE coldkey=?", (amount, signer))
    return [{"module_id": "SubtensorModule", "event_id": "StakeRemoved", "attributes": {"hotkey": hotkey, "amount": amount}}]


def h_transfer(st: DevnetState, c, block, signer, p) -> list[dict]:
    dest = p["dest"]
    if isinstance(dest, dict):
        dest = dest.get("Id") or next(iter(dest.values()))
    amount = int(p["value"])
    debit(c, signer, amount, "InsufficientBalance", "transfer")
    c.execute("INSERT INTO balances (coldkey, free, nonce) VALUES (?,?,0) ON CONFLICT(coldkey) DO UPDATE SET free = free + excluded.free",
              (str(dest), amount))
    return [{"module_id": "Balances", "event_id": "Transfer", "attributes": {"from": signer, "to": str(dest), "amount": amount}}]



def h_submit_encrypted(st: DevnetState, c, block, signer, p) -> list[dict]:
    """``MevShield.submit_encrypted``: decrypt the carrier and apply its inner extrinsic now (the
    block author's job on chain). The carrier succeeds even when the inner call fails; the inner
    receipt is kept for ``find_extrinsic``."""
    inner = mev_open(st, as_bytes(p["ciphertext"]))
    module, function, params = inner["call"]
    handler = HANDLERS.get((module, function))
    c.execute("SAVEPOINT inner")
    st.shielding += 1
    try:
        if handler is None or module == "MevShield":
            raise Refused("CallNotSupported", f"the devnet does not implement {module}.{function} (shielded)")
        ensure_faucet(c, inner["signer"])
        events = handler(st, c, block, inner["signer"], params)
        c.execute("RELEASE inner")
        ok, error, message = True, None, "Success"
    except Refused as refused:
        c.execute("ROLLBACK TO inner")
        c.execute("RELEASE inner")
        events, ok, error, message = [], False, refused.name, refused.message
    finally:
        st.shielding -= 1
    c.execute("INSERT OR REPLACE INTO shielded_extrinsics VALUES (?,?,?,?,?,?,?,?,?)",
              (inner["hash"], block, inner["signer"], module, function, int(ok), error, message,
               json.dumps(events, default=json_default)))
    return [{"module_id": "MevShield", "event_id": "EncryptedSubmitted", "attributes": {"who": signer}}]


HANDLERS = {
    ("SubtensorModule", "burned_register"): h_burned_register,
    ("SubtensorModule", "register_limit"): h_register_limit,
    ("SubtensorModule", "set_mechanism_weights"): h_set_weights,
    ("SubtensorModule", "set_weights"): h_set_weights_legacy,
    ("SubtensorModule", "commit_timelocked_mechanism_weights"): h_commit_timelocked,
    ("SubtensorModule", "commit_timelocked_weights"): h_commit_timelocked,
    ("SubtensorModule", "commit_mechanism_weights"): h_commit_hash_unsupported,
    ("SubtensorModule", "commit_weights"): h_commit_hash_unsupported,
    ("MevShield", "submit_encrypted"): h_submit_encrypted,
    ("SubtensorModule", "serve_axon"): h_serve_axon,
    ("SubtensorModule", "add_stake"): h_add_stake,
    ("SubtensorModule", "remove_stake"): h_remove_stake,
    ("Commitments", "set_commitment"): h_set_commitment,
    ("Balances", "transfer_keep_alive"): h_transfer,
    ("Balances", "transfer_allow_death"): h_transfer,
}


# -- applying a signed call ---------------------------------------------------------------------


def apply(st: DevnetState, signer: str, module: str, function: str, params: dict) -> tuple[int, int, list[dict]]:
    """Apply a signed call inside one write transaction. Returns (block, index, events);
    raises :class:`Refused` (the transaction is rolled back, the refusal logged)."""
    handler = HANDLERS.get((module, function))
    block = st.block()
    try:
        with st.tx() as c:
            if handler is None:
                raise Refused("CallNotSupported", f"the devnet does not implement {module}.{function}")
            ensure_faucet(c, signer)
            events = handler(st, c, block, signer, params)
            c.execute("UPDATE balances SET nonce = nonce + 1 WHERE coldkey=?", (signer,))
            cur = c.execute(
                "INSERT INTO extrinsics (block, signer, module, function, success, error, at) VALUES (?,?,?,?,1,NULL,?)",
                (block, signer, module, function, time.time()),
            )
            idx = int(cur.lastrowid)
    except Refused as refused:
        with st.tx() as c:
            c.execute(
                "INSERT INTO extrinsics (block, signer, module, function, success, error, at) VALUES (?,?,?,?,0,?,?)",
                (block, signer, module, function, refused.name, time.time()),
            )
        raise
    return block, idx, events


def ensure_faucet(c: sqlite3.Connection, account: str) -> None:
    """The faucet: an account seen for the first time starts with the file's ``auto_fund_rao``."""
    row = c.execute("SELECT 1 FROM balances WHERE coldkey=?", (account,)).fetchone()
    if row is None:
        auto = int(c.execute("SELECT value FROM meta WHERE key='auto_fund_rao'").fetchone()["value"])
        c.execute("INSERT INTO balances (coldkey, free, nonce) VALUES (?,?,0)", (account, auto))
