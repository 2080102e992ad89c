"""Rate limits and idempotent start, the weights version key,
registration only when asked and never above the accepted price, reachable endpoints, and
commit-reveal weights, on the SQLite devnet through the unmodified bittensor SDK."""
from __future__ import annotations

import asyncio
import builtins
import io
import socket
import subprocess
import sys
import time
from contextlib import redirect_stdout

import bittensor_core
import pytest

from iota_subnet.chain import NotRegisteredError, RateLimitedError, RegistrationCostError
from iota_subnet.devnet import (DevnetState, RevealedWeights, add_stake, create_devnet, decode_tlock_payload,
                                drand_decryptor, open_devnet, set_hyperparameter)
from iota_subnet.chain.publisher import ChainPublisher
from iota_subnet.config import ConfigError, load_config
from iota_subnet.miner.options import DataOptions, MinerOptions
from iota_subnet.miner.service import MinerService
from iota_subnet.neuron_common import check_external_ip
from iota_subnet.version import weights_version_key
from iota_subnet.wallets import create_wallet
from support.common import PatternData
from support.miners import LOCAL

pytestmark = pytest.mark.timeout(120)
NETUID = 9
OVR = {"model": {"name": "tiny", "dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                 "vocab_size": 256},
       "data": {"seq_len": 16, "vocab_size": 256},
       "pipeline": {"stages": 3, "compression_ratio": 4},
       "train": {"batch_size": 4, "micro_batch_size": 2}}


def run(coro):
    return asyncio.run(coro)


def _count(db, function: str, success: int = 1) -> int:
    st = DevnetState(db)
    try:
        return st._q1("SELECT COUNT(*) AS k FROM extrinsics WHERE function=? AND success=?", (function, success))["k"]
    finally:
        st.close()


def _balance(db, coldkey: str) -> int:
    st = DevnetState(db)
    try:
        return st.balance(coldkey)
    finally:
        st.close()


# ------------------------------------------------------------------------------ item 3: rate limits

def test_devnet_enforces_serving_and_commitment_space_limits(tmp_home, tmp_path):
    db = create_devnet(tmp_path / "c.db", NETUID, tempo=1000, block_time=0.1, serving_rate_limit=1000,
                       commitment_max_space=250)
    w = create_wallet("m", "default", tmp_home / "wallets")

    async def main():
        chain = await open_devnet(db)
        try:
            await chain.register(w, NETUID)
            await chain.serve(w, NETUID, "10.0.0.1", 9000)
            with pytest.raises(RateLimitedError, match="serving rate limit") as e:
                await chain.serve(w, NETUID, "10.0.0.1", 9001)
            assert e.value.name == "ServingRateLimitExceeded"
            await chain.publish(w, NETUID, "a")           # 100 bytes of the 250
            await chain.publish(w, NETUID, "b")           # 200
            with pytest.raises(RateLimitedError) as e:
                await chain.publish(w, NETUID, "c")
            assert e.value.name == "SpaceLimitExceeded"
            assert await chain.axon(w.hotkey.ss58_address, NETUID) == "10.0.0.1:9000"
            set_hyperparameter(db, NETUID, serving_rate_limit=0, tempo=2)   # new epochs reset the space
            await chain.client.wait_for_epoch(NETUID, timeout=30)
            await chain.publish(w, NETUID, "c")
            await chain.serve(w, NETUID, "10.0.0.1", 9001)
            assert await chain.axon(w.hotkey.ss58_address, NETUID) == "10.0.0.1:9001"
        finally:
            await chain.close()
    run(main())


def test_miner_restart_inside_the_rate_limits_neither_crashes_nor_republishes(tmp_home, tmp_path):
    """A restart with nothing changed writes nothing to the chain; a restart that must publish a
    new endpoint inside the serving rate limit starts anyway and publishes once the limit allows."""
    db = create_devnet(tmp_path / "c.db", NETUID, tempo=1000, block_time=0.2, serving_rate_limit=10_000)
    cfg = load_config("configs/tiny.yaml", OVR)
    w = create_wallet("m", "default", tmp_home / "wallets")

    async def main():
        chain = await open_devnet(db)
        await chain.register(w, NETUID)

        def miner():
            return MinerService(cfg, w, chain, MinerOptions(netuid=NETUID, run_id="r", stage=1, out_dir=tmp_path / "m",
                                                            serve=LOCAL))
        try:
            svc = miner()
            port = await svc.start()
            await svc.stop()
            assert (_count(db, "serve_axon"), _count(db, "set_commitment")) == (1, 1)
            svc = miner()                                    # restart: same port, same commitment
            assert await svc.start() == port
            assert svc.publisher.pending == [] and svc.publisher.writes == {"axon": 0, "commitment": 0}
            await svc.stop()
            assert (_count(db, "serve_axon"), _count(db, "set_commitment")) == (1, 1)
            assert _count(db, "serve_axon", success=0) == 0

            blocker = socket.socket()                        # the old port is taken: a new endpoint
            blocker.bind(("127.0.0.1", port))
            blocker.listen()
            try:
                svc = miner()
                new_port = await svc.start()                 # the old code raised ServingRateLimitExceeded here
                assert new_port != port and svc.publisher.pending == ["axon"]
                assert await chain.axon(w.hotkey.ss58_address, NETUID) == f"127.0.0.1:{port}"
                assert svc.status()["chain"]["pending"] == ["axon"]
                set_hyperparameter(db, NETUID, serving_rate_limit=0)
                svc.publisher._retry_at["axon"] = 0.0       # skip the rest of the backoff
                stop = asyncio.Event()
                task = asyncio.create_task(svc.run(stop))
                for _ in range(50):
                    if await chain.axon(w.hotkey.ss58_address, NETUID) == f"127.0.0.1:{new_port}":
                        break
                    await asyncio.sleep(0.2)
                stop.set()
                await task
                assert await chain.axon(w.hotkey.ss58_address, NETUID) == f"127.0.0.1:{new_port}"
                assert svc.publisher.pending == []
            finally:
                blocker.close()
        finally:
            await chain.close()
    run(main())


def test_publisher_backs_off_on_rate_limits(tmp_home, tmp_path):
    db = create_devnet(tmp_path / "c.db", NETUID, tempo=1000, block_time=0.1, serving_rate_limit=10_000)
    w = create_wallet("m", "default", tmp_home / "wallets")
    now = [1000.0]

    async def main():
        chain = await open_devnet(db)
        try:
            await chain.register(w, NETUID)
            await chain.serve(w, NETUID, "10.0.0.1", 9000)
            pub = ChainPublisher(chain, w, NETUID, min_backoff_s=5, max_backoff_s=20, clock=lambda: now[0])
            pub.set_axon("10.0.0.1", 9000)
            pub.set_commitment("hello")
            assert await pub.sync() and pub.writes == {"axon": 0, "commitment": 1}
            pub.set_axon("10.0.0.2", 9000)
            assert not await pub.sync() and pub.pending == ["axon"]
            refused = _count(db, "serve_axon", success=0)
            assert await pub.sync() is False and _count(db, "serve_axon", success=0) == refused   # waits 5 s
            for step in (5, 10, 20, 20):                         # doubling backoff, capped
                now[0] += step
                await pub.sync()
                assert pub.status()["retry_in_s"]["axon"] == pytest.approx(min(2 * step, 20), abs=0.01)
        finally:
            await chain.close()
    run(main())


# ------------------------------------------------------------------------------ item 4: version key

def test_weights_version_key_follows_the_package_version():
    assert weights_version_key("0.1.0") == 100
    assert weights_version_key("1.2.3") == 10203 and weights_version_key("2.0.0rc1") == 20000
    with pytest.raises(ValueError):
        weights_version_key("1.2")
    from iota_subnet.validator.service import WEIGHTS_VERSION_KEY
    import iota_subnet
    assert WEIGHTS_VERSION_KEY == weights_version_key(iota_subnet.__version__) != 1


# ------------------------------------------------------------------------------ item 5: registration

def _register_cli(argv, answer=None, on_prompt=None):
    from iota_subnet.cli import main
    out = io.StringIO()
    real_input, real_isatty = builtins.input, sys.stdin.isatty

    def fake_input(prompt=""):
        if on_prompt:
            on_prompt()
        return answer
    builtins.input = fake_input
    sys.stdin.isatty = lambda: True
    try:
        with redirect_stdout(out):
            rc = main(argv)
    finally:
        builtins.input, sys.stdin.isatty = real_input, real_isatty
    return rc, out.getvalue()


def test_register_never_burns_more_than_accepted_and_goes_through_the_shield(tmp_home, tmp_path):
    db = create_devnet(tmp_path / "c.db", NETUID, tempo=1000, block_time=0.1, burn_tao=1.0, auto_fund_tao=0,
                       registration_requires_shield=True)
    w = create_wallet("m", "default", tmp_home / "wallets")
    from iota_subnet.devnet import fund
    fund(db, w.coldkey.ss58_address, 100)
    common = ["register", "--wallet-name", "m", "--wallet-hotkey", "default", "--wallet-path",
              str(tmp_home / "wallets"), "--chain-db", str(db), "--netuid", str(NETUID)]
    # quoted 1 TAO; the burn rises to 10 before the extrinsic: nothing is burned
    rc, out = _register_cli(common, answer="y", on_prompt=lambda: set_hyperparameter(db, NETUID, burn=10 * 10**9))
    assert "burns 1.000000000 TAO" in out and rc == 2 and "above the 1.000000000 TAO accepted" in out, out
    assert _balance(db, w.coldkey.ss58_address) == 100 * 10**9

    async def race():      # the burn rises between the last read and inclusion: the chain itself refuses
        chain = await open_devnet(db)
        try:
            async def stale_quote(netuid):
                return 1.0
            chain.registration_cost = stale_quote
            with pytest.raises(RegistrationCostError, match="rose above the price you accepted"):
                await chain.register(w, NETUID, max_cost_tao=1.0)
        finally:
            await chain.close()
    run(race())
    assert _balance(db, w.coldkey.ss58_address) == 100 * 10**9
    rc, out = _register_cli(common + ["--yes", "--max-burn", "5"])
    assert rc == 2 and "above --max-burn" in out and _balance(db, w.coldkey.ss58_address) == 100 * 10**9
    rc, out = _register_cli(common + ["--yes", "--max-burn", "10"])
    assert rc == 0 and "registered: uid 0" in out, out
    assert _balance(db, w.coldkey.ss58_address) == 90 * 10**9
    st = DevnetState(db)
    try:       # through the MEV shield (the devnet refuses registrations in the clear here), with a price limit
        rows = [dict(r) for r in st._q("SELECT function, success FROM shielded_extrinsics")]
        assert {"function": "register_limit", "success": 1} in rows
        assert st._q1("SELECT COUNT(*) AS k FROM extrinsics WHERE function IN ('burned_register', 'register_limit')"
                      )["k"] == 0
    finally:
        st.close()


def test_miner_registers_only_when_asked_within_its_max_burn_and_follows_its_uid(tmp_home, tmp_path):
    db = create_devnet(tmp_path / "c.db", NETUID, tempo=1000, block_time=0.1, burn_tao=2.0, max_uids=3,
                       immunity_period=0, auto_fund_tao=0)
    cfg = load_config("configs/tiny.yaml", OVR)
    wallets = {n: create_wallet(n, "default", tmp_home / "wallets") for n in ("m", "a", "b", "c")}
    w = wallets["m"]
    from iota_subnet.devnet import fund
    for x in wallets.values():
        fund(db, x.coldkey.ss58_address, 100)

    async def main():
        chain = await open_devnet(db)

        def miner(**kw):
            return MinerService(cfg, w, chain, MinerOptions(netuid=NETUID, run_id="r", stage=0, out_dir=tmp_path / "m",
                                                            serve=LOCAL, metagraph_refresh_s=0.1,
                                                            data=DataOptions(dataset=PatternData(256, 16)), **kw))
        try:
            before = _balance(db, w.coldkey.ss58_address)
            with pytest.raises(NotRegisteredError, match="--register --max-burn"):
                await miner().start()
            with pytest.raises(RegistrationCostError, match="burns 2.000000000 TAO now; pass --max-burn"):
                await miner(register=True).start()
            with pytest.raises(RegistrationCostError, match="above --max-burn"):
                await miner(register=True, max_burn_tao=1.5).start()
            assert await chain.uid(w.hotkey.ss58_address, NETUID) is None
            svc = miner(register=True, max_burn_tao=2.5)
            await svc.start()
            assert svc.uid == 0 and before - _balance(db, w.coldkey.ss58_address) == 2 * 10**9
            for n in ("a", "b"):
                await chain.register(wallets[n], NETUID)
            await asyncio.sleep(0.3)                          # c lands in a later block than a and b
            await chain.register(wallets["c"], NETUID)        # full: uid 0 (the miner, oldest) is pruned
            await asyncio.sleep(1.1)                          # forced refreshes: at most one a second
            await svc.refresh(force=True)
            assert svc.uid is None and svc.status()["uid"] is None
            await chain.register(w, NETUID)                   # registered again: a's uid (a, b older than c)
            new_uid = await chain.uid(w.hotkey.ss58_address, NETUID)
            assert new_uid not in (None, 0)
            await asyncio.sleep(1.1)
            await svc.refresh(force=True)
            assert svc.uid == new_uid and svc.status()["uid"] == new_uid
            await svc.stop()
        finally:
            await chain.close()
    run(main())


# ------------------------------------------------------------------------------ item 6: endpoints

def test_external_ip_must_be_reachable_off_the_devnet():
    assert check_external_ip("devnet", None) == "127.0.0.1"
    assert check_external_ip("finney", "8.8.8.8") == "8.8.8.8"
    for ip, kind in (("127.0.0.1", "loopback"), ("10.1.2.3", "private"), ("192.168.0.5", "private"),
                     ("0.0.0.0", "unspecified"), ("169.254.1.1", "link-local")):
        with pytest.raises(ConfigError, match=f"{kind} address.*--external-ip"):
            check_external_ip("finney", ip)
    with pytest.raises(ConfigError, match="required"):
        check_external_ip("test", None)
    with pytest.raises(ConfigError, match="not an IP address"):
        check_external_ip("test", "my.host.example")
    assert check_external_ip("local", "127.0.0.1", allow_private=True) == "127.0.0.1"


def test_doctor_checks_the_external_ip_as_the_neurons_do():
    from iota_subnet.doctor.checks import FAIL, PASS, DoctorOptions, check_external_address
    c = check_external_address(DoctorOptions(network="finney", external_ip="127.0.0.1"))
    assert c.status == FAIL and "loopback address" in c.detail and "--external-ip" in c.fix, c
    assert check_external_address(DoctorOptions(network="finney", external_ip="8.8.8.8")).status == PASS
    assert check_external_address(DoctorOptions(network="devnet")).status == PASS


def test_miner_on_finney_with_a_loopback_address_exits_2_before_touching_the_chain(tmp_home):
    create_wallet("m", "default", tmp_home / "wallets")
    p = subprocess.run([sys.executable, "-m", "iota_subnet.cli", "miner", "--network", "finney", "--wallet-name", "m",
                        "--wallet-path", str(tmp_home / "wallets"), "--external-ip", "127.0.0.1",
                        "--config", "configs/tiny.yaml"], capture_output=True, text=True, timeout=240)
    assert p.returncode == 2, p.stderr
    assert "--external-ip 127.0.0.1 is a loopback address" in p.stderr and "public IP" in p.stderr
    assert "Traceback" not in p.stderr and "reconnect" not in p.stderr and "finney:" not in p.stderr


def test_a_port_in_use_exits_2_naming_the_fix(tmp_home, tmp_path, wikitext_path, monkeypatch):
    """Miner and validator (and the validator's dashboard) on a port another process listens on:
    one line naming the flag to change, exit code 2, no traceback, no hang."""
    monkeypatch.setenv("IOTA_CACHE", str(tmp_path / "cache"))
    db = create_devnet(tmp_path / "c.db", NETUID, tempo=100, block_time=0.2)
    ws = {n: create_wallet(n, "default", tmp_home / "wallets") for n in ("m", "v")}

    async def register():
        chain = await open_devnet(db)
        try:
            for w in ws.values():
                await chain.register(w, NETUID)
        finally:
            await chain.close()
    asyncio.run(register())
    add_stake(db, ws["v"].hotkey.ss58_address, ws["v"].coldkey.ss58_address, 1000.0, netuid=NETUID)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        common = ["--network", "devnet", "--chain-db", str(db), "--netuid", str(NETUID), "--config", "configs/tiny.yaml",
                  "--wallet-path", str(tmp_home / "wallets"), "--host", "127.0.0.1", "--external-ip", "127.0.0.1",
                  "--data", str(wikitext_path), "--steps", "2"]
        for role, args, flag in (("miner", ["--wallet-name", "m", "--stage", "0", "--port", port], "--port"),
                                 ("validator", ["--wallet-name", "v", "--port", port], "--port"),
                                 ("validator", ["--wallet-name", "v", "--port", "0", "--dashboard-port", port],
                                  "--dashboard-port")):
            p = subprocess.run([sys.executable, "-m", "iota_subnet.cli", role, *common, *args,
                                "--out", str(tmp_path / f"{role}{flag}")], capture_output=True, text=True, timeout=240)
            assert p.returncode == 2, (role, flag, p.stderr[-2000:])
            assert f"127.0.0.1:{port}: the port is in use" in p.stderr and f"another {flag}" in p.stderr, p.stderr[-2000:]
            assert "Traceback" not in p.stderr, p.stderr[-2000:]


# ------------------------------------------------------------------------------ item 7: commit-reveal

def test_tlock_payload_decoding():
    hk = bytes(range(32))
    payload = (bytes([32 << 2]) + hk + bytes([2 << 2]) + (1).to_bytes(2, "little") + (3).to_bytes(2, "little")
               + bytes([2 << 2]) + (100).to_bytes(2, "little") + (65535).to_bytes(2, "little")
               + (7).to_bytes(8, "little"))
    assert decode_tlock_payload(payload) == RevealedWeights([1, 3], [100, 65535], 7, hk)
    legacy = bytes([1 << 2]) + (4).to_bytes(2, "little") + bytes([1 << 2]) + (9).to_bytes(2, "little") + bytes(8)
    assert decode_tlock_payload(legacy) == RevealedWeights([4], [9], 0, None)
    with pytest.raises(ValueError):
        decode_tlock_payload(b"\x01\x02")


def test_weights_land_through_the_sdk_commit_reveal_path(tmp_home, tmp_path, monkeypatch):
    """The SDK's SetWeights sees CommitRevealWeightsEnabled and submits a drand-timelocked commit;
    the devnet stores it and reveals it once its drand round is published, through a decryptor this
    test supplies (drand is out of reach here): it recovers what the SDK encrypted."""
    sealed: dict[bytes, RevealedWeights] = {}
    real = bittensor_core.get_encrypted_commit_v2

    def recording(**kw):
        commit, rnd = real(**kw)
        sealed[bytes(commit)] = RevealedWeights(list(kw["uids"]), list(kw["weights"]), int(kw["version_key"]),
                                                bytes(kw["hotkey"]))
        return commit, rnd
    monkeypatch.setattr(bittensor_core, "get_encrypted_commit_v2", recording)
    opened: list[int] = []

    def decryptor(commit: bytes, reveal_round: int):
        opened.append(reveal_round)
        return sealed.get(bytes(commit))

    db = create_devnet(tmp_path / "c.db", NETUID, tempo=5, block_time=0.1, weights_rate_limit=1, immunity_period=0,
                       commit_reveal_weights_enabled=True, weights_version=100)
    ws = {n: create_wallet(n, "default", tmp_home / "wallets") for n in ("v", "m1", "m2")}

    async def main():
        chain = await open_devnet(db, decryptor=decryptor)
        try:
            for w in ws.values():
                await chain.register(w, NETUID)
            add_stake(db, ws["v"].hotkey.ss58_address, ws["v"].coldkey.ss58_address, 100.0, netuid=NETUID)
            await chain.client.wait_for_block(await chain.block() + 2, timeout=30)
            receipt = await chain.set_weights(ws["v"], NETUID, [1, 2], [0.25, 0.75], version_key=100)
            assert receipt.commit_reveal and receipt.reveal_round is not None
            assert await chain.weights_landed(ws["v"].hotkey.ss58_address, NETUID, receipt)
            assert dict(await chain.weights(NETUID)).get(0) is None      # sealed until its round
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and dict(await chain.weights(NETUID)).get(0) is None:
                await asyncio.sleep(0.5)
            row = dict(dict(await chain.weights(NETUID))[0])
            assert row[1] == pytest.approx(0.25, abs=1e-3) and row[2] == pytest.approx(0.75, abs=1e-3)
            assert opened and min(opened) == receipt.reveal_round
            from bittensor.timelock import current_round
            assert current_round() >= receipt.reveal_round            # not revealed before its round
        finally:
            await chain.close()
    run(main())


def test_default_drand_decryptor_without_network_keeps_commits_sealed():
    assert drand_decryptor(b"\x00" * 64, 1) is None
