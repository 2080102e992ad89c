"""Issue 12 at the validator (and miner) boundary with the chain: weights recorded only when the
chain shows them (item 8), owners re-read before every set_weights (item 12), the weights version
key checked at start (item 4), fingerprints (item 9), a corrupt state file (item 14), runs by id
and epoch with a clean hand-over (item 2). A real ValidatorService.start() on the devnet; no
miners are needed for these."""
from __future__ import annotations

from dataclasses import replace
import asyncio
import json
import time

import bittensor as bt
import bittensor_core
import pytest
from bittensor.sp_core import Keypair
from bittensor.balance import Balance
from bittensor.result import ExtrinsicResult
from loguru import logger

from iota_subnet.devnet import (DevnetState, DevnetSubstrate, RevealedWeights, add_stake, create_devnet, seed_neurons,
                                set_hyperparameter)
from iota_subnet.chain.sdk import SdkChain
from iota_subnet.config import load_config
from iota_subnet.miner.options import DataOptions, MinerOptions
from iota_subnet.miner.service import MinerService
from iota_subnet.protocol.commitment import MINER, VALIDATOR, Fingerprints, RunCommitment, RunMismatchError
from iota_subnet.utils.sqlite_file import CorruptStateError
from iota_subnet.validator.service import ValidatorError, ValidatorOptions, ValidatorService
from iota_subnet.wallets import create_wallet
from support.common import OVR, PatternData
from support.miners import LOCAL

pytestmark = pytest.mark.timeout(180)
NETUID = 9
FP_A = Fingerprints("aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb")
FP_B = Fingerprints("cccccccccccccccc", "dddddddddddddddd")


class SwallowingSubstrate(DevnetSubstrate):
    """A chain node that answers "success" for the next ``swallow`` weight sets without including them."""

    swallow = 0

    async def submit(self, call, keypair, **kw):
        call = await self.compose(call)
        if call.function == "set_mechanism_weights" and self.swallow > 0:
            self.swallow -= 1
            st = self.state
            block = st.block()
            return ExtrinsicResult(success=True, message="Success", block_hash=st.block_hash(block),
                                   extrinsic_id=f"{block}-0001", fee=Balance.from_rao(0), events=[])
        return await super().submit(call, keypair, **kw)


class Net:
    def __init__(self, tmp_path, home, decryptor=None, **devnet):
        self.tmp = tmp_path
        devnet.setdefault("tempo", 10_000)
        self.db = create_devnet(tmp_path / "chain.db", NETUID, block_time=0.1, weights_rate_limit=1,
                                immunity_period=0, **devnet)
        self.w = {n: create_wallet(n, "default", home / "wallets") for n in ("vali", "m1", "m2", "h2")}
        self.cfg = load_config("configs/tiny.yaml", OVR)
        self.sub = SwallowingSubstrate(self.db, decryptor=decryptor)
        self.chain = SdkChain(lambda: bt.Client("local", substrate=self.sub), "devnet")

    async def setup(self):
        await self.chain.connect()
        for n in ("vali", "m1", "m2"):
            await self.chain.register(self.w[n], NETUID)
        v = self.w["vali"]
        add_stake(self.db, v.hotkey.ss58_address, v.coldkey.ss58_address, 100.0, netuid=NETUID)
        return self

    def validator(self, out="vali", **kw) -> ValidatorService:
        fps = kw.pop("fingerprints", None)
        kw.setdefault("sync_interval_s", 0.5)
        opts = ValidatorOptions.from_flat(network="devnet", chain_db=str(self.db), netuid=NETUID, steps=3,
                                          out=str(self.tmp / out), run_id="run1", **kw)
        svc = ValidatorService(opts, wallet=self.w["vali"], chain=self.chain, cfg=self.cfg,
                               dataset=PatternData(256, 16))
        svc.fingerprints = fps             # of the injected dataset
        return svc

    def hk(self, name):
        return self.w[name].hotkey.ss58_address


def run(coro):
    return asyncio.run(coro)


def _credit(svc, uid, hotkey, stage, tokens=1000):
    rec = svc.ledger.record(uid, hotkey, stage)
    rec.completed += 10
    svc.ledger.credit(uid, hotkey, stage, tokens)


def test_weights_are_recorded_only_once_the_chain_shows_them(tmp_path, tmp_home):
    net = Net(tmp_path, tmp_home)

    async def main():
        await net.setup()
        svc = net.validator()
        try:
            await svc.start()
            _credit(svc, 1, net.hk("m1"), 1)
            _credit(svc, 2, net.hk("m2"), 2)
            # past the registrations' block: a swallowed set in the very block of the validator's last
            # update (its registration) cannot be told from a landed one by last_update (a fast machine
            # did everything above within one 0.1 s block, and the test failed)
            while await net.chain.block() <= await net.chain.last_update(net.hk("vali"), NETUID):
                await asyncio.sleep(0.05)
            net.sub.swallow = 1                     # "success", but not included
            assert await svc.maybe_set_weights() is False
            assert svc.weights.weights_blocks == [] and svc.state.weights_blocks() == []
            assert dict(await net.chain.weights(NETUID)).get(0) is None
            assert await svc.maybe_set_weights() is True          # retried: now it lands
            row = dict(dict(await net.chain.weights(NETUID))[0])
            assert set(row) == {1, 2}
            last = await net.chain.last_update(net.hk("vali"), NETUID)
            assert svc.weights.weights_blocks == [last] and svc.state.weights_blocks() == [last]
        finally:
            await svc.close()
            await net.chain.close()
    run(main())


def test_owners_are_reread_before_setting_weights(tmp_path, tmp_home):
    """uid 1 was scored while m1 held it; h2 takes uid 1 before the next metagraph sync: the weights
    set right after give uid 1 nothing (the old code paid h2 m1's share)."""
    net = Net(tmp_path, tmp_home)

    async def main():
        await net.setup()
        svc = net.validator(sync_interval_s=3600)
        try:
            await svc.start()
            assert svc.current[1] == net.hk("m1")
            _credit(svc, 1, net.hk("m1"), 1)
            _credit(svc, 2, net.hk("m2"), 2)
            st = DevnetState(net.db)                      # m1 deregistered, h2 registered on uid 1
            try:
                with st.tx() as c:
                    c.execute("UPDATE neurons SET hotkey=?, registered_at=? WHERE netuid=? AND uid=1",
                              (net.hk("h2"), st.block(), NETUID))
            finally:
                st.close()
            assert svc.current[1] == net.hk("m1")         # the validator's view is stale
            assert await svc.maybe_set_weights() is True
            row = dict(dict(await net.chain.weights(NETUID))[0])
            assert 1 not in row and row[2] == pytest.approx(1.0)
            assert svc.weights.last_weights == {2: pytest.approx(1.0)}
        finally:
            await svc.close()
            await net.chain.close()
    run(main())


def test_stale_weights_decay_to_the_burn_uid_the_validator_holds(tmp_path, tmp_home):
    """The validator registered first, so it holds the burn uid 0. Stale scores still lose weight to
    uid 0 (the old code left the burn out when the validator held it: the chain renormalised the
    weights row and the stale weights went out at full strength)."""
    net = Net(tmp_path, tmp_home)

    async def main():
        await net.setup()
        svc = net.validator(stale_grace=0, burn_uid=0)
        try:
            await svc.start()
            assert svc.uid == 0
            _credit(svc, 1, net.hk("m1"), 1)
            _credit(svc, 2, net.hk("m2"), 2)
            fresh = svc.update_scores()
            assert 0 not in fresh and sum(fresh.values()) == pytest.approx(1.0)
            stale = svc.update_scores()                 # a tempo with no verified work: freshness 1/2
            assert stale[0] == pytest.approx(0.5)
            assert stale[1] + stale[2] == pytest.approx(0.5)
            while await net.chain.block() <= await net.chain.last_update(net.hk("vali"), NETUID):
                await asyncio.sleep(0.05)
            assert await svc.maybe_set_weights() is True   # a third tempo: freshness 1/4
            row = dict(dict(await net.chain.weights(NETUID))[0])
            assert row[0] / sum(row.values()) == pytest.approx(0.75, abs=1e-3)
            assert svc.weights.last_weights[0] == pytest.approx(0.75)
        finally:
            await svc.close()
            await net.chain.close()
    run(main())


def test_validator_stops_when_the_subnet_requires_a_newer_weights_version(tmp_path, tmp_home):
    net = Net(tmp_path, tmp_home, weights_version=101)

    async def main():
        await net.setup()
        try:
            with pytest.raises(ValidatorError, match=r"sends weights version key 100.*requires weights_version 101.*"
                                                     r"Update"):
                await net.validator().start()
            svc = net.validator(version_key=101)          # a release that matches starts
            await svc.start()
            await svc.close()
        finally:
            await net.chain.close()
    run(main())


class HeldDecryptor:
    """Opens the SDK's timelocked commits (drand is out of reach here) by recording what it sealed;
    while ``hold`` is set a commit stays sealed (its round not yet published, as far as the devnet sees)."""

    def __init__(self, monkeypatch):
        self.sealed: dict[bytes, RevealedWeights] = {}
        self.hold = False
        real = bittensor_core.get_encrypted_commit_v2

        def recording(**kw):
            commit, rnd = real(**kw)
            self.sealed[bytes(commit)] = RevealedWeights(list(kw["uids"]), list(kw["weights"]),
                                                         int(kw["version_key"]), bytes(kw["hotkey"]))
            return commit, rnd
        monkeypatch.setattr(bittensor_core, "get_encrypted_commit_v2", recording)

    def __call__(self, commit: bytes, reveal_round: int):
        return None if self.hold else self.sealed.get(bytes(commit))


def _commits(db) -> list[dict]:
    st = DevnetState(db)
    try:
        return [dict(r) for r in st._q("SELECT block, status, error FROM weight_commits ORDER BY id")]
    finally:
        st.close()


VERSION_RAISED = r"sends weights version key 100.*requires weights_version 101.*Update"


def test_a_weights_version_raised_mid_run_is_noticed_and_a_refused_reveal_is_never_set(tmp_path, tmp_home,
                                                                                       monkeypatch):
    """Commit-reveal on: committed weights count as set once the chain reveals them. The subnet's
    weights_version rises while a commit waits for its reveal: the chain refuses that reveal
    (IncorrectWeightVersionKey); it is not recorded as set, no weights are committed after the rise,
    and maybe_set_weights raises the start-up check's error (the old code recorded every commit as set
    at once and kept committing, each reveal refused, nothing logged)."""
    dec = HeldDecryptor(monkeypatch)
    net = Net(tmp_path, tmp_home, decryptor=dec, tempo=5, commit_reveal_weights_enabled=True, weights_version=100)

    async def main():
        await net.setup()
        svc = net.validator(version_key=100)
        try:
            await svc.start()
            _credit(svc, 1, net.hk("m1"), 1)
            _credit(svc, 2, net.hk("m2"), 1)                   # one stage: weights split by verified work
            while await net.chain.block() <= await net.chain.last_update(net.hk("vali"), NETUID):
                await asyncio.sleep(0.05)
            deadline = time.monotonic() + 60
            while not await svc.maybe_set_weights():          # committed, then recorded once revealed
                assert time.monotonic() < deadline, "a revealed commit was never recorded"
                await asyncio.sleep(0.1)
            revealed = {c["block"] for c in _commits(net.db) if c["status"] == "revealed"}
            assert svc.weights.weights_blocks and set(svc.weights.weights_blocks) <= revealed
            row = dict(dict(await net.chain.weights(NETUID))[0])
            assert set(row) == {1, 2}
            _credit(svc, 1, net.hk("m1"), 1, tokens=5000)      # the next weights differ from those set
            dec.hold = True                                    # the next commit's round is not published yet
            n = len(svc.weights.reveals.commits)
            while len(svc.weights.reveals.commits) == n:
                assert time.monotonic() < deadline, "no second commit"
                await svc.maybe_set_weights()
                await asyncio.sleep(0.1)
            set_hyperparameter(net.db, NETUID, weights_version=101)
            raised_at = len(_commits(net.db))
            dec.hold = False                                   # its round comes: the chain refuses the reveal
            warned: list[str] = []
            sink = logger.add(lambda m: warned.append(str(m)), level="WARNING")
            try:
                with pytest.raises(ValidatorError, match=VERSION_RAISED):
                    while True:
                        assert time.monotonic() < deadline, "the raised weights version went unnoticed"
                        await svc.maybe_set_weights()
                        await asyncio.sleep(0.1)
            finally:
                logger.remove(sink)
            while any(c["status"] == "pending" for c in _commits(net.db)):    # the devnet's reveals are done
                assert time.monotonic() < deadline
                await net.chain.block()
                await asyncio.sleep(0.1)
            commits = _commits(net.db)
            assert len(commits) == raised_at, "weights were committed after the version rose"
            failed = {c["block"] for c in commits if c["status"] == "failed"}
            assert failed and all("IncorrectWeightVersionKey" in c["error"] for c in commits if c["status"] == "failed")
            assert not failed & set(svc.weights.weights_blocks) and not failed & set(svc.state.weights_blocks())
            assert any("were not revealed" in m for m in warned) or svc.weights.reveals.commits, warned
        finally:
            await svc.close()
            await net.chain.close()
    run(main())


def test_a_running_validator_stops_when_the_weights_version_rises(tmp_path, tmp_home):
    """Through run(): the weights loop notices the raised version before its next set and the
    validator stops with the start-up check's error (the loop used to swallow every error)."""
    net = Net(tmp_path, tmp_home, tempo=5, weights_version=100)

    async def main():
        await net.setup()
        svc = net.validator(version_key=100, weights_check_s=0.1, status_interval_s=0.2)
        try:
            task = asyncio.create_task(svc.run())
            deadline = time.monotonic() + 60
            while not svc.weights.weights_blocks:                      # nothing verified: all on the burn uid
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.1)
            set_hyperparameter(net.db, NETUID, weights_version=101)
            t0 = time.monotonic()
            with pytest.raises(ValidatorError, match=VERSION_RAISED):
                await asyncio.wait_for(task, 30)
            assert time.monotonic() - t0 < 10
        finally:
            await net.chain.close()
    run(main())


def test_fingerprints_are_advertised_and_a_mismatch_refuses_to_join(tmp_path, tmp_home):
    net = Net(tmp_path, tmp_home, max_uids=64)

    async def main():
        await net.setup()
        block = await net.chain.block()
        peer = RunCommitment("run1", VALIDATOR, fingerprints=FP_A).encode()
        seed_neurons(net.db, NETUID, [{"hotkey": net.hk("h2"), "coldkey": net.w["h2"].coldkey.ss58_address,
                                       "stake": 500.0, "validator_permit": True, "commitment": peer,
                                       "commitment_block": block, "last_update": block}])
        try:
            with pytest.raises(ValidatorError) as e:
                await net.validator(fingerprints=FP_B).start()
            msg = str(e.value)
            assert FP_A.tokenizer in msg and FP_B.tokenizer in msg and FP_A.data in msg and FP_B.data in msg
            assert "uids [3]" in msg
            svc = net.validator(fingerprints=FP_A)
            await svc.start()
            assert svc.view.validators == sorted([net.hk("vali"), net.hk("h2")])
            mine = RunCommitment.decode((await net.chain.commitments(NETUID))[net.hk("vali")])
            assert mine.role == VALIDATOR and mine.fingerprints == FP_A and mine.same_run("run1", 0)
            await svc.close()
            # a miner that loads other data refuses to join too
            opts = MinerOptions(netuid=NETUID, run_id="run1", stage=0, out_dir=tmp_path / "m1", serve=LOCAL,
                                fingerprints=FP_B, data=DataOptions(dataset=PatternData(256, 16)))
            miner = MinerService(net.cfg, net.w["m1"], net.chain, opts)
            with pytest.raises(RunMismatchError, match=f"ours tokenizer {FP_B.tokenizer}.*tokenizer {FP_A.tokenizer}"):
                await miner.start()
            miner = MinerService(net.cfg, net.w["m1"], net.chain, replace(opts, fingerprints=FP_A))
            await miner.start()
            got = RunCommitment.decode((await net.chain.commitments(NETUID))[net.hk("m1")])
            assert got.role == MINER and got.stage == 0 and got.fingerprints == FP_A
            await miner.stop()
        finally:
            await net.chain.close()
    run(main())


def test_corrupt_validator_state_is_refused_with_a_recovery_path(tmp_path, tmp_home):
    net = Net(tmp_path, tmp_home)
    out = tmp_path / "vali"
    out.mkdir()
    (out / "validator.sqlite").write_bytes(b"\x00garbage" * 500)

    async def main():
        await net.setup()
        try:
            with pytest.raises(CorruptStateError, match="move it aside"):
                await net.validator().start()
        finally:
            await net.chain.close()
    run(main())
    assert (out / "validator.sqlite").read_bytes() == b"\x00garbage" * 500     # nothing lost
    from iota_subnet.errors import known_errors
    assert issubclass(CorruptStateError, known_errors())      # the CLI prints it as one line, exit code 2


def test_a_new_run_epoch_hands_the_state_folder_over(tmp_path, tmp_home):
    net = Net(tmp_path, tmp_home)

    async def main():
        await net.setup()
        try:
            svc = net.validator()
            await svc.start()
            svc.state.set_meta("marker", "epoch0")
            svc.state.bind_run("run1", 2)
            await svc.close()
            svc = net.validator(run_epoch=1)              # the run moves on: epoch 1, same folder
            await svc.start()
            assert svc.state.get_meta("marker") is None
            mine = RunCommitment.decode((await net.chain.commitments(NETUID))[net.hk("vali")])
            assert mine.same_run("run1", 1)
            await svc.close()
        finally:
            await net.chain.close()
    run(main())
    old = list((tmp_path / "vali" / "previous").glob("run1-e0-*"))
    assert len(old) == 1 and (old[0] / "validator.sqlite").exists()
    assert json.loads((tmp_path / "vali" / "run.json").read_text()) == {"run_id": "run1", "run_epoch": 1}


def test_a_restarted_validator_keeps_the_lanes_it_handed_to_spares(tmp_path, tmp_home):
    """Issue 13 (churn benchmark, 2026-12-02): a lane member that left for good (still registered,
    axon still on chain) gives its lane to a spare after ``vacate_after_s``; the swap lived only in the
    validator process's router, so each validator restart handed the lane back to the departed member
    and the lane ran on non-training alternates for another 120 s. The assignment is kept in the
    validator's state and restored at start."""
    net = Net(tmp_path, tmp_home)

    async def main():
        await net.setup()
        rows = [{"hotkey": Keypair.create_from_uri(f"//lane-m{i}").ss58_address,
                 "coldkey": Keypair.create_from_uri(f"//lane-c{i}").ss58_address,
                 "commitment": RunCommitment("run1", MINER, stage=i % 3).encode(),
                 "axon": f"127.0.0.1:{20000 + i}"} for i in range(7)]     # 3 stages x 2 lanes + a spare of stage 0
        uids = seed_neurons(net.db, NETUID, rows)
        try:
            svc = net.validator()
            await svc.start()
            svc.n_lanes = 2
            first = svc.router.lane_member(0, 0)
            assert first.uid == uids[0] and svc.router.lane_member(2, 0).uid == uids[6]
            svc.router.vacate_after_s = 0.0
            svc.router.record_failure(first, "connection refused")       # it left for good
            await svc.sync()
            assert svc.router.lane_member(0, 0).uid == uids[6]           # the spare took the lane
            await svc.close()
            svc = net.validator()                                        # restarted, same state folder
            await svc.start()
            assert svc.router.lane_member(0, 0).uid == uids[6], "the lane went back to the departed member"
            assert svc.router.lane_member(2, 0).uid == uids[0]
            assert [[r.uid for r in lane] for lane in svc.router.lanes()] == [[uids[6], uids[1], uids[2]],
                                                                             [uids[3], uids[4], uids[5]]]
            svc.state.set_meta("lane_slots", "{not json")                 # unreadable: the uid order, no crash
            await svc.close()
            svc = net.validator()
            await svc.start()
            assert svc.router.lane_member(0, 0).uid == uids[0]
            await svc.close()
        finally:
            await net.chain.close()
    run(main())
