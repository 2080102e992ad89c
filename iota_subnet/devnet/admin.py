"""Admin helpers outside the SDK (local network setup, tests): create a devnet file with a
subnet, fund a coldkey, mint stake, halt / resume the clock, change hyperparameters (sudo on a
real chain), seed neurons, read the epoch log.
"""
from __future__ import annotations

import ipaddress
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from loguru import logger

from .epoch import refresh_permits as recompute_permits
from .schema import DevnetError, to_rao
from .state import DevnetState


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

    ``hyperparams`` are names of :data:`.schema.DEFAULT_HYPERPARAMS` (``max_uids``, ``immunity_period``,
    ``weights_rate_limit``, ``weights_version``, ``burn`` in rao or ``burn_tao``, ``max_validators``,
    ``emission_per_block``, ...). ``auto_fund_tao`` is a faucet: an account seen for the first time
    by a signed call starts with that balance (0 disables it; then use :func:`fund`).
    With ``exist_ok`` an existing subnet is left as it is. ``weights_rate_limit`` and
    ``immunity_period`` default to localnet-friendly values (10 and 100 blocks); the other
    hyperparameters default to chain-like values (:data:`.schema.DEFAULT_HYPERPARAMS`). ``start_block``: the
    height a new devnet starts at (genesis that many blocks in the past), so that state seeded with
    :func:`seed_neurons` can look old.
    """
    hyperparams["weights_rate_limit"] = int(weights_rate_limit)
    hyperparams["immunity_period"] = int(immunity_period)
    if "burn_tao" in hyperparams:
        hyperparams["burn"] = to_rao(hyperparams.pop("burn_tao"))
    st = DevnetState(db, create=True)
    try:
        st.init_meta(block_time, time.time() - int(start_block) * float(block_time) if start_block else None)
        st.set_meta("auto_fund_rao", str(to_rao(auto_fund_tao)))
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
                      " DO UPDATE SET free = free + excluded.free", (coldkey_ss58, to_rao(tao)))
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
                      (hotkey_ss58, coldkey_ss58, netuid, to_rao(tao)))
        if refresh_permits:
            recompute_permits(st, netuid)
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
                    c.execute("INSERT OR REPLACE INTO stakes VALUES (?,?,?,?)", (hk, ck, netuid, to_rao(n["stake"])))
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
