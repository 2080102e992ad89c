"""Weights on the devnet: ``set_weights`` checked as subtensor's ``do_set_weights`` checks them,
and commit-reveal: drand-timelocked commits (``commit_timelocked_(mechanism_)weights``) stored and
revealed once their drand round is published (:func:`reveal_due_commits`, run before every
access as subtensor does each block).

A revealed payload is subtensor's ``WeightsTlockPayload``, opened by the state's decryptor
(:mod:`.tlock`). Weights are stored as u16 rows scaled so the largest is 65535.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Optional

from .schema import U16_MAX, Refused, as_bytes, registered_uid, subnet_in_tx
from .tlock import RevealedWeights

if TYPE_CHECKING:  # pragma: no cover
    from .state import DevnetState


def reveal_due_commits(st: DevnetState, now: Optional[float] = None) -> int:
    """Reveal every pending weights commit whose drand round has been published (as subtensor
    does each block): decrypt with the state's ``decryptor``, check, write the weights. Returns how
    many were applied; a commit the decryptor cannot open yet stays pending."""
    from bittensor.timelock import current_round

    rnd = current_round(now)
    due = st._q("SELECT * FROM weight_commits WHERE status='pending' AND reveal_round<=? ORDER BY id", (rnd,))
    applied = 0
    for row in due:
        try:
            revealed = st.decryptor(bytes.fromhex(row["commit_hex"]), int(row["reveal_round"]))
        except Exception as e:  # noqa: BLE001 - a payload that never decrypts is a failed reveal
            revealed, error = None, f"{type(e).__name__}: {e}"
        else:
            error = None
        if revealed is None and error is None:
            continue
        block = st.block()
        with st.tx() as c:
            if c.execute("SELECT status FROM weight_commits WHERE id=?", (row["id"],)).fetchone()["status"] != "pending":
                continue   # another process revealed it
            try:
                if error is not None:
                    raise Refused("InvalidRevealCommitHashNotMatch", error)
                reveal_weights(c, block, int(row["netuid"]), str(row["hotkey"]), revealed)
                c.execute("UPDATE weight_commits SET status='revealed' WHERE id=?", (row["id"],))
                applied += 1
            except Refused as refused:
                c.execute("UPDATE weight_commits SET status='failed', error=? WHERE id=?",
                          (f"{refused.name}: {refused.message}", row["id"]))
    return applied


# -- weight extrinsics (run inside the write transaction) ---------------------------------------


def h_set_weights(st: DevnetState, c, block, signer, p) -> list[dict]:
    netuid = int(p["netuid"])
    if int(p.get("mecid", 0) or 0) != 0:
        raise Refused("MechanismDoesNotExist", "the devnet has only mechanism 0")
    sub = subnet_in_tx(c, netuid, "MechanismDoesNotExist")
    hp = sub["params"]
    if hp["commit_reveal_weights_enabled"]:
        raise Refused("CommitRevealEnabled", f"commit-reveal is enabled on netuid {netuid}: commit the weights")
    me = registered_uid(c, netuid, signer)
    _check_rate(hp, me, block, "SettingWeightsTooFast", "weights set")
    _write_weights(c, netuid, hp, me, [int(u) for u in p["dests"]], [int(v) for v in p["weights"]],
                   int(p.get("version_key", 0)), block)
    return [{"module_id": "SubtensorModule", "event_id": "WeightsSet", "attributes": {"netuid": netuid, "uid": me["uid"]}}]


def _check_rate(hp: dict, me: dict, block: int, error: str, what: str) -> None:
    rate = int(hp["weights_rate_limit"])
    if rate and me["last_update"] > 0 and block - int(me["last_update"]) < rate:
        raise Refused(error, f"{what} {block - me['last_update']} blocks after the last; rate limit is {rate} blocks")


def _write_weights(c, netuid: int, hp: dict, me: dict, dests: list[int], values: list[int], version_key: int,
                   block: int, *, touch_last_update: bool = True) -> None:
    """Check a weight vector as subtensor's ``do_set_weights`` does and store it as ``me``'s row."""
    if len(dests) != len(values):
        raise Refused("WeightVecNotEqualSize", "uids and weights differ in length")
    if version_key < int(hp["weights_version"]):
        raise Refused("IncorrectWeightVersionKey",
                      f"version_key {version_key} is older than the subnet's weights_version {hp['weights_version']}")
    self_only = dests == [me["uid"]]
    if not self_only and not me["validator_permit"]:
        raise Refused("NeuronNoValidatorPermit", f"uid {me['uid']} has no validator permit on netuid {netuid}")
    if len(set(dests)) != len(dests):
        raise Refused("DuplicateUids", "duplicate uids in weights")
    n = c.execute("SELECT COUNT(*) AS k FROM neurons WHERE netuid=?", (netuid,)).fetchone()["k"]
    if any(u < 0 or u >= n for u in dests):
        raise Refused("UidVecContainInvalidOne", f"weights name a uid outside 0..{n - 1}")
    if any(v < 0 or v > U16_MAX for v in values):
        raise Refused("InvalidWeight", "weights must be u16")
    if not self_only and len(dests) < int(hp["min_allowed_weights"]):
        raise Refused("WeightVecLengthIsLow", f"at least {hp['min_allowed_weights']} weights required")
    total = sum(values)
    if not self_only and total > 0 and len(values) > 1 and max(values) * U16_MAX > int(hp["max_weights_limit"]) * total:
        raise Refused("MaxWeightExceeded", "a weight exceeds max_weights_limit")
    top = max(values) if values else 0
    row = [[u, int(round(v * U16_MAX / top))] for u, v in zip(dests, values) if v > 0] if top else []
    c.execute("INSERT OR REPLACE INTO weights VALUES (?,?,?)", (netuid, me["uid"], json.dumps(sorted(row))))
    if touch_last_update:
        c.execute("UPDATE neurons SET last_update=? WHERE netuid=? AND uid=?", (block, netuid, me["uid"]))


def h_set_weights_legacy(st, c, block, signer, p) -> list[dict]:
    return h_set_weights(st, c, block, signer, {**p, "mecid": 0})


def h_commit_timelocked(st: DevnetState, c, block, signer, p) -> list[dict]:
    """``commit_timelocked_(mechanism_)weights``: store the drand-timelocked commit; it is revealed
    by :func:`reveal_due_commits` once its round is published."""
    netuid = int(p["netuid"])
    if int(p.get("mecid", 0) or 0) != 0:
        raise Refused("MechanismDoesNotExist", "the devnet has only mechanism 0")
    sub = subnet_in_tx(c, netuid, "MechanismDoesNotExist")
    hp = sub["params"]
    if not hp["commit_reveal_weights_enabled"]:
        raise Refused("CommitRevealDisabled", f"commit-reveal weights are disabled on netuid {netuid}")
    me = registered_uid(c, netuid, signer)
    _check_rate(hp, me, block, "CommittingWeightsTooFast", "weights committed")
    commit = as_bytes(p["commit"])
    if not commit or len(commit) > 5000:
        raise Refused("CommitTooLarge", "a timelocked commit holds 1 to 5000 bytes")
    pending = c.execute("SELECT COUNT(*) AS k FROM weight_commits WHERE netuid=? AND hotkey=? AND status='pending'",
                        (netuid, signer)).fetchone()["k"]
    if pending >= 10:
        raise Refused("TooManyUnrevealedCommits", "10 commits are waiting for their reveal")
    c.execute("INSERT INTO weight_commits (netuid, hotkey, block, reveal_round, commit_hex) VALUES (?,?,?,?,?)",
              (netuid, signer, block, int(p["reveal_round"]), commit.hex()))
    c.execute("UPDATE neurons SET last_update=? WHERE netuid=? AND uid=?", (block, netuid, me["uid"]))
    return [{"module_id": "SubtensorModule", "event_id": "TimelockedWeightsCommitted",
             "attributes": {"netuid": netuid, "who": signer, "reveal_round": int(p["reveal_round"])}}]


def reveal_weights(c, block: int, netuid: int, hotkey: str, w: RevealedWeights) -> None:
    sub = subnet_in_tx(c, netuid)
    me = registered_uid(c, netuid, hotkey)
    if w.hotkey is not None:
        from bittensor.sp_core import ss58_decode
        if bytes(w.hotkey) != bytes(ss58_decode(hotkey)):
            raise Refused("InvalidRevealCommitHashNotMatch", "the payload names another hotkey than the committer")
    _write_weights(c, netuid, sub["params"], me, list(w.uids), list(w.values), int(w.version_key), block,
                   touch_last_update=False)



def h_commit_hash_unsupported(st, c, block, signer, p) -> list[dict]:
    raise Refused("CallNotSupported", "the devnet implements the timelocked commit-reveal (commit_timelocked_*), "
                                      "not the legacy salted-hash commits")
