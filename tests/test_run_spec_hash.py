"""Issue 30, item 6: a run anyone can launch, addressed by its spec hash.

A validator serves its run's canonical config (``GET /run/spec``) and advertises its sha256 in its
commitment (``h``); a neuron given the hash fetches the spec, refuses content that does not hash to it
(a clear error naming both hashes; exit code 2 from the CLI), and joins the advertisers' run. Two runs
launched on one devnet train side by side, and the miners given run A's hash join A only. A miner started
with a config whose hash differs from the one its run's validators advertise refuses (both hashes named,
exit code 2); validators set aside peers and miners of their run advertising another hash; a second
validator joins a run with ``--spec-hash``.
"""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace as NS

import pytest
import yaml
from aiohttp import web

from iota_subnet.config import load_config
from iota_subnet.config_hash import canonical_yaml, config_hash
from iota_subnet.devnet import add_stake, create_devnet, open_devnet
from iota_subnet.entry import miner as miner_entry
from iota_subnet.entry import validator as validator_entry
from iota_subnet.entry.chain import adopt_spec_hash
from iota_subnet.miner.chain_view import ChainView
from iota_subnet.miner.options import DataOptions, MinerOptions
from iota_subnet.miner.service import MinerService
from iota_subnet.protocol.commitment import (MAX_COMMITMENT_BYTES, MINER, VALIDATOR, Fingerprints, RunCommitment,
                                             RunMismatchError)
from iota_subnet.protocol.run_spec import SPEC_ROUTE, SpecHashMismatchError, check_spec_hash, spec_digest, verify_spec
from iota_subnet.errors import UserError
from iota_subnet.run_fetch import RunNotFoundError, fetch_run_spec
from iota_subnet.validator.metagraph_view import MetagraphView
from iota_subnet.validator.options import ChainOptions, RunOptions
from iota_subnet.validator.peers import coordinating_validators
from iota_subnet.validator.routing import Router
from iota_subnet.validator.routing import discover
from iota_subnet.validator.service import ValidatorOptions, ValidatorService
from iota_subnet.wallets import create_wallet
from support.common import PatternData
from support.miners import LOCAL
from support.sites import serve_get

pytestmark = pytest.mark.timeout(300)
NETUID = 9
OVR = {"data": {"seq_len": 32}, "train": {"batch_size": 4, "micro_batch_size": 2, "warmup_steps": 2,
                                          "total_steps": 3}}


# ---- (a) units: the hash, the refusal, the commitment -------------------------------------------------
def test_the_canonical_spec_is_a_fixed_point_and_its_digest_is_the_config_hash(tmp_path):
    cfg = load_config("configs/tiny.yaml", OVR)
    text = canonical_yaml(cfg)
    assert spec_digest(text.encode()) == config_hash(cfg)
    (tmp_path / "spec.yaml").write_text(text)
    back = load_config(tmp_path / "spec.yaml")          # what a neuron given the hash loads
    assert canonical_yaml(back) == text and config_hash(back) == config_hash(cfg)
    other = load_config("configs/tiny.yaml", {**OVR, "train": {**OVR["train"], "lr": 1e-3}})
    assert config_hash(other) != config_hash(cfg)


def test_content_that_does_not_match_its_hash_is_refused_naming_both():
    text = b"model: tiny\n"
    h = spec_digest(text)
    assert verify_spec(text, h, "here") == "model: tiny\n"
    with pytest.raises(SpecHashMismatchError) as e:
        verify_spec(b"model: small\n", h, "validator uid 3 (1.2.3.4:5)")
    msg = str(e.value)
    assert h in msg and spec_digest(b"model: small\n") in msg and "uid 3" in msg
    with pytest.raises(UserError, match="64 hex"):
        check_spec_hash(h[:16])                          # a prefix is not a hash
    assert check_spec_hash(" " + h.upper() + " ") == h


def test_the_spec_hash_and_the_rest_of_a_commitment_fit_the_chain():
    """The bytes stated in iota_subnet/protocol/commitment.py's docstring."""
    h, fps = "a" * 64, Fingerprints("0123456789abcdef", "fedcba9876543210")
    relays = ("255.255.255.255:65535",) * 4
    m = RunCommitment("r" * 16, MINER, 3, stage=2, fingerprints=fps, relays=relays, spec_hash=h)
    v = RunCommitment("r" * 16, VALIDATOR, 3, fingerprints=fps, heartbeat=999_999, relay_host=True,
                      merge_weights={u: 0.5 for u in range(250, 258)}, spec_hash=h)
    sizes = {c.role: len(c.encode().encode()) for c in (m, v)}
    assert sizes == {MINER: 270, VALIDATOR: 267}, sizes
    assert max(sizes.values()) <= 0.15 * MAX_COMMITMENT_BYTES
    assert len(m.encode()) - len(RunCommitment("r" * 16, MINER, 3, stage=2, fingerprints=fps,
                                               relays=relays).encode()) == 71        # ,"h":"<64 hex>"
    for c in (m, v):
        assert RunCommitment.decode(c.encode()) == c
    raw = json.loads(m.encode())
    assert RunCommitment.decode(json.dumps({**raw, "h": "abc"})) is None          # not a hash: not ours
    with pytest.raises(ValueError, match="spec_hash"):
        RunCommitment("x", MINER, stage=0, spec_hash="ABC").encode()


# ---- a devnet with spec servers of our own (no training) -----------------------------------------------
async def _serve_text(text: bytes) -> tuple[web.AppRunner, int]:
    async def get(_request):
        return web.Response(body=text, content_type="text/yaml")
    return await serve_get(SPEC_ROUTE, get)


async def _fake_validator(db, chain, home, name: str, text: bytes, commitment: RunCommitment):
    """A permit holder advertising ``commitment`` whose /run/spec serves ``text``."""
    w = create_wallet(name, "default", home / "wallets")
    await chain.register(w, NETUID)
    add_stake(db, w.hotkey.ss58_address, w.coldkey.ss58_address, 1000.0, netuid=NETUID)
    runner, port = await _serve_text(text)
    await chain.serve(w, NETUID, "127.0.0.1", port)
    await chain.publish(w, NETUID, commitment.encode())
    return runner


def test_a_tampered_spec_is_refused_and_an_honest_validator_is_used(tmp_path, tmp_home, capfd):
    cfg = load_config("configs/tiny.yaml", OVR)
    good = canonical_yaml(cfg).encode()
    h = spec_digest(good)
    tampered = good.replace(b"lr: 0.003", b"lr: 0.3")
    assert tampered != good
    db = create_devnet(tmp_path / "chain.db", NETUID, tempo=20, block_time=0.1, immunity_period=0)
    advert = RunCommitment("runa", VALIDATOR, 0, spec_hash=h)

    async def main():
        chain = await open_devnet(db)
        runners = []
        try:
            runners.append(await _fake_validator(db, chain, tmp_home, "liar", tampered, advert))
            with pytest.raises(SpecHashMismatchError) as e:
                await fetch_run_spec(chain, NETUID, h, tmp_path / "cache")
            assert h in str(e.value) and spec_digest(tampered) in str(e.value)
            assert not (tmp_path / "cache" / "runs" / f"{h}.yaml").exists()       # nothing cached
            with pytest.raises(RunNotFoundError, match="no validator"):
                await fetch_run_spec(chain, NETUID, "b" * 64, tmp_path / "cache")
            runners.append(await _fake_validator(db, chain, tmp_home, "honest", good, advert))
            run = await fetch_run_spec(chain, NETUID, h, tmp_path / "cache")       # the liar first, then honest
            assert (run.run_id, run.run_epoch, len(run.validators)) == ("runa", 0, 2)
            assert run.path.read_bytes() == good and config_hash(load_config(run.path)) == h
        finally:
            for r in runners:
                await r.cleanup()
            await chain.close()
        return runners

    asyncio.run(main())
    # the command line: the same refusal, one line, exit code 2 (only the liar left serving)
    db2 = create_devnet(tmp_path / "chain2.db", NETUID, tempo=20, block_time=0.1, immunity_period=0)

    async def liar_only():
        chain = await open_devnet(db2)
        r = await _fake_validator(db2, chain, tmp_home, "liar", tampered, advert)
        await chain.close()
        return r

    loop = asyncio.new_event_loop()
    runner = loop.run_until_complete(liar_only())
    import threading
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        create_wallet("m", "default", tmp_home / "wallets")
        rc = miner_entry.main(["--network", "devnet", "--chain-db", str(db2), "--netuid", str(NETUID),
                               "--wallet-name", "m", "--wallet-path", str(tmp_home / "wallets"),
                               "--spec-hash", h, "--cache-dir", str(tmp_path / "cache2"), "--out", str(tmp_path / "m")])
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
    assert rc == 2
    err = capfd.readouterr().err
    assert "does not match its hash" in err and h in err and spec_digest(tampered) in err


# ---- (b) two runs on one devnet, miners joining by hash ------------------------------------------------
async def _two_runs(tmp, home) -> dict:
    db = create_devnet(tmp / "chain.db", NETUID, tempo=20, block_time=0.1, weights_rate_limit=1,
                       immunity_period=0, max_uids=32)
    cfgs = {"runa": load_config("configs/tiny.yaml", OVR),
            "runb": load_config("configs/tiny.yaml", {**OVR, "train": {**OVR["train"], "lr": 1e-3}})}
    names = ["va", "vb"] + [f"{r}{s}" for r in ("a", "b") for s in range(3)]
    wallets = {n: create_wallet(n, "default", home / "wallets") for n in names}
    chain = await open_devnet(db)
    vals, miners, tasks, stop = {}, [], [], asyncio.Event()
    try:
        for w in wallets.values():
            await chain.register(w, NETUID)
        for run, v in (("runa", "va"), ("runb", "vb")):
            w = wallets[v]
            add_stake(db, w.hotkey.ss58_address, w.coldkey.ss58_address, 10_000.0, netuid=NETUID)
            data = PatternData(cfgs[run].model.vocab_size, cfgs[run].data.seq_len)
            opts = ValidatorOptions.from_flat(network="devnet", chain_db=str(db), netuid=NETUID, steps=3,
                                              out=str(tmp / v), run_id=run, sync_interval_s=1.0, status_interval_s=0.5,
                                              weights_check_s=1.0, exit_when_done=True, wait_miners_s=90,
                                              clasp_interval_s=0.0, wait_peers_s=2.0, external_ip="127.0.0.1",
                                              host="127.0.0.1")
            vals[run] = ValidatorService(opts, wallet=w, chain=chain, cfg=cfgs[run], dataset=data)
            tasks.append(asyncio.create_task(asyncio.wait_for(vals[run].run(), 240)))
        hashes = {run: config_hash(cfg) for run, cfg in cfgs.items()}
        for _ in range(200):                       # both validators serve and advertise their spec
            commits = [RunCommitment.decode(r) for r in (await chain.commitments(NETUID)).values()]
            if {c.spec_hash for c in commits if c is not None} >= set(hashes.values()):
                break
            await asyncio.sleep(0.1)
        adopted = {}
        for run in ("runa", "runb"):               # each run's miners are given only its hash
            adopted[run] = await fetch_run_spec(chain, NETUID, hashes[run], tmp / f"cache-{run}")
            got = adopted[run]
            cfg = load_config(got.path)
            for s in range(3):
                m = MinerService(cfg, wallets[f"{run[-1]}{s}"], chain, MinerOptions(
                    netuid=NETUID, run_id=got.run_id, run_epoch=got.run_epoch, stage=s, out_dir=tmp / f"m{run}{s}",
                    serve=LOCAL, metagraph_refresh_s=1.0, data=DataOptions(dataset=PatternData(
                        cfg.model.vocab_size, cfg.data.seq_len))))
                await m.start()
                miners.append(m)
        loops = [asyncio.create_task(m.run(stop)) for m in miners]
        try:
            rcs = await asyncio.gather(*tasks)
        finally:
            stop.set()
            await asyncio.gather(*loops, return_exceptions=True)
        commits = {hk: RunCommitment.decode(raw) for hk, raw in (await chain.commitments(NETUID)).items()}
        status = {run: json.loads((tmp / v / "status.json").read_text()) for run, v in (("runa", "va"), ("runb", "vb"))}
    finally:
        for m in miners:
            if m.server is not None:
                await m.stop()
        await chain.close()
    return {"rcs": rcs, "hashes": hashes, "adopted": adopted, "commits": commits, "status": status,
            "wallets": {n: w.hotkey.ss58_address for n, w in wallets.items()}}


@pytest.mark.slow
def test_two_runs_launched_by_spec_hash_train_side_by_side_on_one_devnet(tmp_path, tmp_home):
    got = asyncio.run(_two_runs(tmp_path, tmp_home))
    assert got["rcs"] == [0, 0]
    hashes, adopted, commits, hk = got["hashes"], got["adopted"], got["commits"], got["wallets"]
    assert hashes["runa"] != hashes["runb"]
    for run in ("runa", "runb"):
        assert (adopted[run].run_id, adopted[run].run_epoch) == (run, 0)
        assert adopted[run].path.read_bytes() == canonical_yaml(load_config(adopted[run].path)).encode()
        st = got["status"][run]
        assert st["done"] and st["steps_done"] == {"0": 3}, st
        assert st["peers"]["other_runs"] == {f"{'runb' if run == 'runa' else 'runa'}#0": 1}, st["peers"]
        for s in range(3):                           # the miner given this run's hash is in this run only
            c = commits[hk[f"{run[-1]}{s}"]]
            assert (c.run, c.stage, c.spec_hash) == (run, s, hashes[run])


# ---- (c) a config that differs from the hash its run's validators advertise ------------------------------
H1, H2 = "1" * 64, "2" * 64


def _n(uid, hk, permit=True, text=None, block=100):
    return NS(uid=uid, hotkey=hk, validator_permit=permit, last_update=block, axon="127.0.0.1:1",
              commitment=None if text is None else NS(value=text, block=block), total_stake=NS(rao=1))


def test_a_miner_whose_config_hash_differs_from_its_validators_refuses_naming_both():
    view = ChainView(None, netuid=NETUID, run_id="run", run_epoch=0, hotkey="me", refresh_s=60)
    adverts = {"v1": RunCommitment("run", VALIDATOR, 0, spec_hash=H1), "v2": RunCommitment("run", VALIDATOR, 0),
               "v3": RunCommitment("run", VALIDATOR, 1, spec_hash=H2),              # another epoch
               "v4": RunCommitment("other", VALIDATOR, 0, spec_hash=H2),            # another run
               "m": RunCommitment("run", MINER, 0, stage=0, spec_hash=H2)}          # a miner's h is not the run's
    view.neurons = {hk: _n(i, hk, permit=hk != "m") for i, hk in enumerate(adverts)}
    view.neurons["nopermit"] = _n(9, "nopermit", permit=False)
    view.commitments = {hk: c.encode() for hk, c in adverts.items()}
    view.commitments["nopermit"] = RunCommitment("run", VALIDATOR, 0, spec_hash=H2).encode()
    assert view.run_spec_hash() == (H1, [0])
    view.check_spec_hash(H1)                                # the same config: joins
    view.check_spec_hash("")                                # nothing to compare
    with pytest.raises(RunMismatchError) as e:
        view.check_spec_hash(H2)
    msg = str(e.value)
    assert H1 in msg and H2 in msg and f"--spec-hash {H1}" in msg and "uids [0]" in msg
    assert isinstance(e.value, UserError)                   # one line, exit code 2 from the command line
    view.commitments = {"v2": adverts["v2"].encode()}       # older validators publish no h: no refusal
    assert view.run_spec_hash() is None
    view.check_spec_hash(H2)


def test_validators_set_aside_peers_and_miners_of_their_run_advertising_another_hash():
    ours = RunCommitment("run", VALIDATOR, 0, spec_hash=H1).encode()
    neurons = [_n(0, "me", text=ours), _n(1, "same", text=ours),
               _n(2, "older", text=RunCommitment("run", VALIDATOR, 0).encode()),
               _n(3, "other-spec", text=RunCommitment("run", VALIDATOR, 0, spec_hash=H2).encode()),
               _n(4, "other-run", text=RunCommitment("x", VALIDATOR, 0, spec_hash=H2).encode())]
    view = coordinating_validators(neurons, run="run", epoch=0, block=100, alive_blocks=50, self_hotkey="me",
                                   spec_hash=H1)
    assert view.coordinating == ["me", "older", "same"] and view.other_spec == {"other-spec": H2}
    assert view.summary()["other_spec"] == {"other-spec": H2}
    legacy = coordinating_validators(neurons, run="run", epoch=0, block=100, alive_blocks=50, self_hotkey="me")
    assert legacy.coordinating == ["me", "older", "other-spec", "same"] and legacy.other_spec == {}
    miners = {"a": RunCommitment("run", MINER, 0, stage=0, spec_hash=H1), "b": RunCommitment("run", MINER, 0, stage=0),
              "c": RunCommitment("run", MINER, 0, stage=1, spec_hash=H2)}
    commits = {hk: c.encode() for hk, c in miners.items()}
    mn = [_n(10 + i, hk, permit=False, text=commits[hk]) for i, hk in enumerate(miners)]
    got = discover(mn, commits, "run", 2, 0, H1)
    assert {s: [r.hotkey for r in rs] for s, rs in got.items()} == {0: ["a", "b"], 1: []}
    assert [r.hotkey for r in discover(mn, commits, "run", 2)[1]] == ["c"]      # no hash of its own: unchecked
    mv, router = MetagraphView(ChainOptions(), RunOptions(run_id="run")), Router(2)   # the validator's sync
    mv.route(NS(neurons=mn), router, 2, H1)
    assert mv.other_spec_miners == {"c": H2} and router.stage_counts() == [2, 0]


def test_the_miner_command_line_refuses_a_config_its_run_advertises_another_hash_for(tmp_path, tmp_home, capfd):
    """``iota-subnet miner --config`` with a config other than the one its run's validators advertise:
    one line naming both hashes and the fix, exit code 2 (before any stage is built)."""
    served = load_config("configs/tiny.yaml", OVR)
    h, mine = config_hash(served), config_hash(load_config("configs/tiny.yaml"))
    assert h != mine
    db = create_devnet(tmp_path / "chain.db", NETUID, tempo=20, block_time=0.1, immunity_period=0)
    w = create_wallet("m", "default", tmp_home / "wallets")

    async def setup():
        chain = await open_devnet(db)
        r = await _fake_validator(db, chain, tmp_home, "v", canonical_yaml(served).encode(),
                                  RunCommitment("runa", VALIDATOR, 0, spec_hash=h))
        await chain.register(w, NETUID)
        await chain.close()
        await r.cleanup()

    asyncio.run(setup())
    rc = miner_entry.main(["--network", "devnet", "--chain-db", str(db), "--netuid", str(NETUID), "--wallet-name", "m",
                           "--wallet-path", str(tmp_home / "wallets"), "--config", "configs/tiny.yaml",
                           "--run-id", "runa", "--out", str(tmp_path / "m"), "--device", "cpu"])
    assert rc == 2
    err = capfd.readouterr().err
    assert h in err and mine in err and f"--spec-hash {h}" in err and "Traceback" not in err


# ---- (d) a second validator adopting a run by its hash; a third with another config under its name ------
async def _adopting_validators(tmp, home) -> dict:
    db = create_devnet(tmp / "chain.db", NETUID, tempo=20, block_time=0.1, weights_rate_limit=1,
                       immunity_period=0)
    cfg = load_config("configs/tiny.yaml", OVR)
    other = load_config("configs/tiny.yaml", {**OVR, "train": {**OVR["train"], "lr": 1e-3}})
    wallets = {n: create_wallet(n, "default", home / "wallets") for n in ("va", "vb", "vc")}
    chain = await open_devnet(db)
    for w in wallets.values():
        await chain.register(w, NETUID)
        add_stake(db, w.hotkey.ss58_address, w.coldkey.ss58_address, 10_000.0, netuid=NETUID)
    data = PatternData(cfg.model.vocab_size, cfg.data.seq_len)
    base = dict(network="devnet", chain_db=str(db), netuid=NETUID, steps=3, sync_interval_s=0.5, status_interval_s=0.3,
                weights_check_s=1.0, wait_miners_s=120, clasp_interval_s=0.0, wait_peers_s=0.5,
                external_ip="127.0.0.1", host="127.0.0.1")
    a = ValidatorService(ValidatorOptions.from_flat(out=str(tmp / "va"), run_id="runa", **base), wallet=wallets["va"],
                         chain=chain, cfg=cfg, dataset=data)
    task = asyncio.create_task(a.run())
    started = []
    try:
        h = config_hash(cfg)
        for _ in range(200):                        # the first validator serves and advertises its spec
            if any(c is not None and c.spec_hash == h for c in map(RunCommitment.decode,
                                                                    (await chain.commitments(NETUID)).values())):
                break
            await asyncio.sleep(0.1)
        # the second one: `iota-subnet validator --spec-hash H` (its parser, adoption and options), in-process
        args = validator_entry.build_parser().parse_args([
            "--network", "devnet", "--chain-db", str(db), "--netuid", str(NETUID), "--wallet-name", "vb",
            "--wallet-path", str(home / "wallets"), "--spec-hash", h, "--cache-dir", str(tmp / "cache"),
            "--out", str(tmp / "vb"), "--sync-interval", "0.5", "--clasp-interval", "0"])
        await adopt_spec_hash(args, chain)
        b = ValidatorService(validator_entry.options_from(args), wallet=wallets["vb"], chain=chain, dataset=data)
        await b.start()
        started.append(b)
        c = ValidatorService(ValidatorOptions.from_flat(out=str(tmp / "vc"), run_id="runa", **base),
                             wallet=wallets["vc"], chain=chain, cfg=other, dataset=data)
        await c.start()                              # the same run id, another config
        started.append(c)
        status = {}
        for _ in range(100):                         # the first validator notices the third's other hash
            await asyncio.sleep(0.2)
            path = tmp / "va" / "status.json"
            status = json.loads(path.read_text()) if path.exists() else {}
            if status.get("peers", {}).get("other_spec") and status["peers"]["coordinating"] == 2:
                break
        got = {"args": args, "h": h, "other": config_hash(other), "b": (b.spec_hash, list(b.view.peers.coordinating),
                                                                       dict(b.view.peers.other_spec)),
               "c": dict(c.view.peers.other_spec), "status": status,
               "hk": {n: w.hotkey.ss58_address for n, w in wallets.items()}}
    finally:
        a.request_stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 60)
        for s in started:
            await s.close()
        await chain.close()
    return got


def test_a_validator_adopts_a_run_by_its_spec_hash_and_peers_with_another_hash_are_set_aside(tmp_path, tmp_home):
    got = asyncio.run(_adopting_validators(tmp_path, tmp_home))
    h, hk, args = got["h"], got["hk"], got["args"]
    assert (args.run_id, args.run_epoch) == ("runa", 0)
    assert args.config == str(tmp_path / "cache" / "runs" / f"{h}.yaml")
    spec, coordinating, other_spec = got["b"]
    assert spec == h and coordinating == sorted([hk["va"], hk["vb"]]) and other_spec == {}
    assert got["c"] == {hk["va"]: h, hk["vb"]: h}                     # the third sees the run's two as other
    st = got["status"]
    assert st["spec_hash"] == h and st["peers"]["other_spec"] == {hk["vc"]: got["other"]}, st.get("peers")
    assert st["peers"]["coordinating"] == 2 and st["miners_other_spec"] == {}
