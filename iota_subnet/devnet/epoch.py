"""The subnet epoch on the devnet: Yuma consensus (:mod:`.yuma`) run at subtensor's tempo
boundaries, ``(block + netuid + 1) % (tempo + 1) == 0``.

Whichever process first touches the chain after a boundary runs the epoch inside a write
transaction guarded by ``last_epoch_block``, so each boundary runs exactly once across
processes; missed boundaries are folded into one run whose emission covers every block since
the previous run. Emission (alpha rao) is staked to the earning hotkey under its coldkey.
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
from typing import TYPE_CHECKING

import numpy as np
from loguru import logger

from . import yuma
from .schema import DEFAULT_HYPERPARAMS, U16_MAX, DevnetError
from .weights import reveal_due_commits

if TYPE_CHECKING:  # pragma: no cover
    from .state import DevnetState


def tick(st: DevnetState) -> None:
    """Run every epoch that is due, then reveal the weight commits that are due (cheap when
    nothing is due; called before each access to the state)."""
    block = st.block()
    if block == st._last_tick_block:
        return
    st._last_tick_block = block
    for r in st._q("SELECT netuid, tempo, last_epoch_block FROM subnets"):
        netuid, tempo, last = int(r["netuid"]), int(r["tempo"]), int(r["last_epoch_block"])
        if tempo <= 0:
            continue
        due = st.last_epoch_at_or_before(block, netuid, tempo)
        if due > last:
            run_epoch(st, netuid, due)
    reveal_due_commits(st)


def run_epoch(st: DevnetState, netuid: int, epoch_block: int) -> bool:
    """Run netuid's epoch due at ``epoch_block`` in one write transaction, unless another process
    already ran it (``last_epoch_block`` guards it). Returns whether this call ran it."""
    with st.tx() as c:
        row = c.execute("SELECT * FROM subnets WHERE netuid=?", (netuid,)).fetchone()
        if row is None or int(row["last_epoch_block"]) >= epoch_block:
            return False  # another process ran it
        params = dict(DEFAULT_HYPERPARAMS)
        params.update(json.loads(row["params"]))
        elapsed = epoch_block - int(row["last_epoch_block"])
        epoch_in_tx(c, netuid, epoch_block, params, elapsed)
        c.execute(
            "UPDATE subnets SET last_epoch_block=?, epoch_index=epoch_index+1 WHERE netuid=?",
            (epoch_block, netuid),
        )
        c.execute("INSERT INTO epochs (netuid, block, ran_at, pid) VALUES (?,?,?,?)", (netuid, epoch_block, time.time(), os.getpid()))
    logger.debug("devnet: epoch of netuid {} at block {} (pid {})", netuid, epoch_block, os.getpid())
    return True


def epoch_in_tx(c: sqlite3.Connection, netuid: int, block: int, params: dict, elapsed: int) -> None:
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


def refresh_permits(st: DevnetState, netuid: int) -> None:
    """Recompute validator permits now (top-k by stake), outside the epoch (admin setup)."""
    with st.tx() as c:
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
