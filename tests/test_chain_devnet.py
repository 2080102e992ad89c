"""The SQLite devnet driven through the unmodified bittensor v11 SDK (``bt.Client(substrate=...)``)."""
from __future__ import annotations

import asyncio
import time

import bittensor as bt
import pytest
from bittensor import calls
from bittensor.result import ChainError as SdkChainError
from bittensor.result import ErrorCode

from iota_subnet.chain import NotRegisteredError, metagraph_json, open_chain
from iota_subnet.devnet import (DevnetSubstrate, add_stake, create_devnet, epoch_log, fund, metagraph_rows,
                                open_devnet, set_hyperparameter)
from iota_subnet.chain.interface import ChainError

NETUID = 9
BLOCK_TIME = 0.1
TEMPO = 4


def make_wallets(root, n):
    out = []
    for i in range(n):
        w = bt.Wallet(name=f"w{i}", hotkey="default", path=str(root))
        w.create_new_coldkey(use_password=False, suppress=True, overwrite=True)
        w.create_new_hotkey(suppress=True, overwrite=True)
        out.append(w)
    return out


@pytest.fixture()
def wallets(tmp_home):
    return make_wallets(tmp_home / "wallets", 5)


@pytest.fixture()
def db(tmp_path):
    return create_devnet(tmp_path / "chain.db", NETUID, tempo=TEMPO, block_time=BLOCK_TIME, weights_rate_limit=1,
                         immunity_period=0, weights_version=3)


def run(coro):
    return asyncio.run(coro)


async def register_all(client, wallets):
    for w in wallets:
        r = await client.submit_call(calls.SubtensorModule.burned_register(netuid=NETUID, hotkey=w.hotkey.ss58_address), w)
        assert r.success, r.message


def test_sdk_flow_register_serve_stake_weights_epoch(db, wallets):
    async def main():
        async with bt.Client("local", substrate=DevnetSubstrate(db)) as client:
            vali, miners, outsider = wallets[0], wallets[1:4], wallets[4]
            await register_all(client, wallets[:4])
            uids = [await client.neurons.uid(w.hotkey.ss58_address, NETUID) for w in wallets[:4]]
            assert uids == [0, 1, 2, 3]
            assert await client.neurons.uid(outsider.hotkey.ss58_address, NETUID) is None
            # registering twice is refused by the chain
            again = await client.submit_call(calls.SubtensorModule.burned_register(netuid=NETUID, hotkey=vali.hotkey.ss58_address), vali)
            assert not again.success and again.error.name == "HotKeyAlreadyRegisteredInSubNet"

            # serve axon via the SDK intent
            r = await client.execute(bt.ServeAxon(NETUID, "10.1.2.3", 8091), miners[0])
            assert r.success, r.message

            # stake through the SDK raw call; the permit arrives with the next epoch
            r = await client.submit_call(calls.SubtensorModule.add_stake(hotkey=vali.hotkey.ss58_address, netuid=NETUID,
                                                                         amount_staked=100 * 10**9), vali)
            assert r.success, r.message
            with pytest.raises(SdkChainError) as no_reg:
                await client.execute(bt.SetWeights(NETUID, [1], [1.0]), outsider)
            assert no_reg.value.code == ErrorCode.NOT_REGISTERED
            await client.wait_for_block(await client.block() + 1, timeout=60)  # rate limit counts from registration
            no_permit = await client.execute(bt.SetWeights(NETUID, [1, 2], [1.0, 1.0], version_key=3), vali)
            assert not no_permit.success and no_permit.error.name == "NeuronNoValidatorPermit"
            await client.wait_for_epoch(NETUID, timeout=60)
            m = await client.subnets.metagraph(NETUID)
            assert [n.validator_permit for n in m.neurons] == [True, False, False, False]

            # version key: older refused, current accepted
            bad = await client.execute(bt.SetWeights(NETUID, [1, 2, 3], [0.2, 0.3, 0.5], version_key=2), vali)
            assert not bad.success and bad.error.name == "IncorrectWeightVersionKey"
            plan = await client.plan(bt.SetWeights(NETUID, [1, 2, 3], [0.2, 0.3, 0.5], version_key=3), vali)
            assert plan.ok
            ok = await client.execute(bt.SetWeights(NETUID, [1, 2, 3], [0.2, 0.3, 0.5], version_key=3), vali)
            assert ok.success, ok.message
            rows = await client.weights.weights(NETUID)
            assert list(rows) == [0]
            assert rows[0][1] == pytest.approx(0.2, abs=1e-4) and rows[0][3] == pytest.approx(0.5, abs=1e-4)
            full = await client.neurons.all(NETUID, lite=False)
            assert dict(full[0].raw["weights"])[3] == 65535

            # rate limit (raised to 1000 blocks): the SDK preflight refuses before signing
            set_hyperparameter(db, NETUID, weights_rate_limit=1000)
            with pytest.raises(SdkChainError) as too_fast:
                await client.execute(bt.SetWeights(NETUID, [1, 2, 3], [1, 1, 1], version_key=3), vali)
            assert too_fast.value.code == ErrorCode.RATE_LIMITED

            # after the next tempo boundary: incentive for weighted miners, dividends for the validator
            await client.wait_for_epoch(NETUID, timeout=60)
            m = await client.subnets.metagraph(NETUID)
            inc = [n.incentive for n in m.neurons]
            assert inc[0] == 0 and all(x > 0 for x in inc[1:])
            assert inc[3] > inc[2] > inc[1]
            assert sum(inc) == pytest.approx(1.0, abs=1e-3)
            assert m.neurons[0].dividends > 0.99
            assert m.neurons[0].emission.rao > 0 and m.neurons[3].emission.rao > 0
            assert m.neurons[1].axon == "10.1.2.3:8091"
            bonds = await client.weights.bonds(NETUID)
            assert bonds[0][3] > 0
            hp = await client.read("subnet_hyperparameters", netuid=NETUID)
            assert hp["tempo"] == TEMPO and hp["weights_version"] == 3 and hp["commit_reveal_weights_enabled"] is False
            blocks = {e["block"] for e in epoch_log(db, NETUID)}
            assert len(blocks) == len(epoch_log(db, NETUID))

    run(main())


def test_chain_interface_and_commitments(db, wallets):
    async def main():
        chain = await open_devnet(db)
        try:
            reg = await chain.register(wallets[0], NETUID)
            assert reg.uid == 0 and reg.cost_tao == pytest.approx(1.0) and not reg.already
            assert (await chain.register(wallets[0], NETUID)).already
            await chain.register(wallets[1], NETUID)
            assert await chain.is_registered(wallets[1].hotkey.ss58_address, NETUID)
            text = "stage=2;layers=8-15;" + "h" * 300  # > 128 bytes: several Raw fields
            await chain.publish(wallets[1], NETUID, text)
            await chain.publish(wallets[0], NETUID, "validator")
            assert await chain.commitments(NETUID) == {wallets[1].hotkey.ss58_address: text,
                                                       wallets[0].hotkey.ss58_address: "validator"}
            with pytest.raises(NotRegisteredError, match="not registered on netuid 9"):
                await chain.publish(wallets[2], NETUID, "x")
            with pytest.raises(NotRegisteredError, match="iota-subnet register"):
                await chain.serve(wallets[2], NETUID, "127.0.0.1", 1)
            await chain.serve(wallets[1], NETUID, "127.0.0.1", 9100)
            await chain.add_stake(wallets[0], NETUID, 10)
            await chain.client.wait_for_block(await chain.block() + 1, timeout=60)  # rate limit counts from registration
            with pytest.raises(ChainError, match="validator permit"):   # uid 1 has no stake: never a permit
                await chain.set_weights(wallets[1], NETUID, [0], [1.0], version_key=3)
            m = await chain.metagraph(NETUID)
            assert m.neurons[1].commitment.value == text
            assert await chain.tempo(NETUID) == TEMPO
            assert (await chain.hyperparameters(NETUID))["max_uids"] == 256
            rows = await metagraph_json(chain, NETUID)
            assert rows[1]["axon"] == "127.0.0.1:9100" and rows[0]["stake"] == pytest.approx(10.0)
            assert set(rows[0]) >= {"uid", "hotkey", "coldkey", "stake", "validator_permit", "incentive",
                                    "dividends", "emission", "axon", "last_update"}
        finally:
            await chain.close()
        assert (await metagraph_rows(db, NETUID))[1]["commitment"] == text

    run(main())


def test_open_chain_errors(tmp_path, tmp_home):
    with pytest.raises(ChainError, match="--chain-db"):
        run(open_chain("devnet"))
    with pytest.raises(ChainError, match="does not exist"):
        run(open_devnet(tmp_path / "missing.db"))
    with pytest.raises(ChainError, match="unknown network"):
        run(open_chain("mainnet-ish"))


def test_pruning_when_full(tmp_path, wallets):
    db = create_devnet(tmp_path / "full.db", NETUID, tempo=TEMPO, block_time=BLOCK_TIME, max_uids=3,
                       immunity_period=0, weights_rate_limit=1)

    async def main():
        async with bt.Client("local", substrate=DevnetSubstrate(db)) as client:
            await register_all(client, wallets[:3])
            add_stake(db, wallets[0].hotkey.ss58_address, wallets[0].coldkey.ss58_address, 100, netuid=NETUID)
            await client.wait_for_block(await client.block() + 1, timeout=60)
            r = await client.execute(bt.SetWeights(NETUID, [1, 2], [1.0, 3.0]), wallets[0])
            assert r.success, r.message
            await client.wait_for_epoch(NETUID, timeout=60)
            m = await client.subnets.metagraph(NETUID)
            em = [n.emission.rao for n in m.neurons]
            assert em[1] < em[2] and em[1] < em[0]
            r = await client.submit_call(calls.SubtensorModule.burned_register(netuid=NETUID, hotkey=wallets[3].hotkey.ss58_address), wallets[3])
            assert r.success, r.message
            m = await client.subnets.metagraph(NETUID)
            assert len(m.neurons) == 3
            assert m.neurons[1].hotkey == wallets[3].hotkey.ss58_address  # lowest emission pruned
            assert await client.neurons.uid(wallets[1].hotkey.ss58_address, NETUID) is None
            assert m.neurons[1].emission.rao == 0 and m.neurons[1].block_at_registration >= m.neurons[0].block_at_registration

    run(main())


def test_block_follows_wall_clock_and_balances(db, wallets):
    async def main():
        async with bt.Client("local", substrate=DevnetSubstrate(db)) as client:
            assert await client.block_time() == pytest.approx(BLOCK_TIME)
            t0, b0 = time.time(), await client.block()
            time.sleep(4.5 * BLOCK_TIME)
            b1, t1 = await client.block(), time.time()
            assert b1 - b0 >= 4
            assert abs((b1 - b0) - (t1 - t0) / BLOCK_TIME) <= 1.5
            head = await client.wait_for_block(b1 + 2, timeout=60)
            assert head.number >= b1 + 2
            ts = (await client.timestamp()).timestamp()
            assert abs(ts - time.time()) < 2 * BLOCK_TIME + 0.5

    run(main())


def test_registration_needs_funds_without_faucet(tmp_path, wallets):
    db = create_devnet(tmp_path / "poor.db", NETUID, tempo=TEMPO, block_time=BLOCK_TIME, auto_fund_tao=0, burn_tao=2.0)

    async def main():
        async with bt.Client("local", substrate=DevnetSubstrate(db)) as client:
            call = calls.SubtensorModule.burned_register(netuid=NETUID, hotkey=wallets[0].hotkey.ss58_address)
            r = await client.submit_call(call, wallets[0])
            assert not r.success and r.error.name == "NotEnoughBalanceToStake"
            fund(db, wallets[0].coldkey.ss58_address, 5)
            assert (await client.submit_call(call, wallets[0])).success
            assert (await client.balances.get(wallets[0].coldkey.ss58_address)).rao == 3 * 10**9

    run(main())


def test_halted_devnet_keeps_its_block_and_resumes_where_it_stopped(tmp_path):
    import time as _time

    from iota_subnet.devnet import DevnetState, create_devnet, halt_devnet, resume_devnet
    db = tmp_path / "halt.db"
    create_devnet(db, 9, tempo=5, block_time=0.1)
    _time.sleep(0.35)
    b = halt_devnet(db)
    _time.sleep(0.5)
    st = DevnetState(db)
    try:
        assert st.block() == b                       # the clock stopped: reads run no new epochs
    finally:
        st.close()
    b2 = resume_devnet(db)
    assert b <= b2 <= b + 1                           # continues where it stopped, not 5 blocks later
    _time.sleep(0.3)
    st = DevnetState(db)
    try:
        assert st.block() >= b2 + 2
    finally:
        st.close()
