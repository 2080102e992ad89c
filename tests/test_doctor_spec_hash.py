"""``iota-subnet doctor --spec-hash H`` and the default ``--config`` from any folder.

(a) The commands' default ``configs/tiny.yaml`` (miner, validator, doctor, localnet, train) is the
repository's preset when run from another folder; an explicit relative path that exists there is kept.
(b) On a devnet with spec servers of our own (as ``tests/test_run_spec_hash.py``): the doctor fetches the
spec an honest validator serves, checks it against H and runs its checks on that config (``PASS spec``,
``PASS config`` naming the cached file); a malformed hash, a hash nobody advertises and a spec that does
not match its hash are each one line on stderr with exit code 2.
"""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from aiohttp import web

from iota_subnet.cli import _load_extra_commands, build_parser, main as cli_main
from iota_subnet.config import load_config
from iota_subnet.config_hash import canonical_yaml
from iota_subnet.config_presets import PRESETS_DIR, config_path
from iota_subnet.devnet import add_stake, create_devnet, open_devnet
from iota_subnet.protocol.commitment import VALIDATOR, RunCommitment
from iota_subnet.protocol.run_spec import SPEC_ROUTE, spec_digest
from iota_subnet.wallets import create_wallet
from support.sites import serve_get

pytestmark = pytest.mark.timeout(120)
NETUID = 9
TINY = PRESETS_DIR / "tiny.yaml"


# ---- (a) the default config from another folder ---------------------------------------------------------
def test_the_default_config_resolves_from_any_folder_and_explicit_paths_are_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _load_extra_commands()
    p = build_parser()
    for argv in (["doctor"], ["miner"], ["validator"], ["localnet"], ["train-colocated"]):
        assert Path(p.parse_args(argv).config) == TINY, argv
    assert load_config("configs/tiny.yaml").model.name == load_config(TINY).model.name
    assert config_path("tiny") == "tiny" and config_path("configs/nope.yaml") == "configs/nope.yaml"
    own = tmp_path / "configs" / "tiny.yaml"               # an explicit relative path that exists here wins
    own.parent.mkdir()
    own.write_text(TINY.read_text())
    assert p.parse_args(["doctor", "--config", "configs/tiny.yaml"]).config == "configs/tiny.yaml"
    assert p.parse_args(["miner"]).config == "configs/tiny.yaml"


def test_doctor_from_another_folder_finds_the_default_config(tmp_path, tmp_home, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = cli_main(["doctor", "--wallet-name", "none", "--wallet-path", str(tmp_path / "w"), "--network", "devnet",
                   "--chain-db", str(tmp_path / "none.db")])
    out = capsys.readouterr().out
    assert rc == 1 and "PASS  config" in out and "FAIL  wallet" in out, out
    assert "not found" not in out


# ---- (b) doctor --spec-hash on a devnet -----------------------------------------------------------------
async def _fake_validator(db, chain, home: Path, name: str, text: bytes, commitment: RunCommitment):
    """A permit holder advertising ``commitment`` whose /run/spec serves ``text``."""
    async def get(_request):
        return web.Response(body=text, content_type="text/yaml")
    w = create_wallet(name, "default", home / "wallets")
    await chain.register(w, NETUID)
    add_stake(db, w.hotkey.ss58_address, w.coldkey.ss58_address, 1000.0, netuid=NETUID)
    runner, port = await serve_get(SPEC_ROUTE, get)
    await chain.serve(w, NETUID, "127.0.0.1", port)
    await chain.publish(w, NETUID, commitment.encode())
    return runner


class _Served:
    """Spec servers on an event loop of their own thread, while the doctor runs its own loops."""

    def __init__(self, db: Path, home: Path, servers: list[tuple[str, bytes, RunCommitment]]):
        self.loop = asyncio.new_event_loop()
        self.runners = self.loop.run_until_complete(self._start(db, home, servers))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _start(self, db, home, servers):
        chain = await open_devnet(db)
        try:
            return [await _fake_validator(db, chain, home, *s) for s in servers]
        finally:
            await chain.close()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        for r in self.runners:
            asyncio.run_coroutine_threadsafe(r.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _doctor(db: Path, tmp: Path, spec_hash: str) -> int:
    return cli_main(["doctor", "--network", "devnet", "--chain-db", str(db), "--netuid", str(NETUID),
                     "--wallet-name", "none", "--wallet-path", str(tmp / "w"), "--spec-hash", spec_hash,
                     "--cache-dir", str(tmp / "cache"), "--out", str(tmp / "out")])


def test_doctor_checks_the_run_a_spec_hash_names(tmp_path, tmp_home, capsys):
    good = canonical_yaml(load_config(TINY, {"train": {"total_steps": 7}})).encode()
    h = spec_digest(good)
    tampered = good.replace(b"total_steps: 7", b"total_steps: 8")
    assert tampered != good
    advert = RunCommitment("runa", VALIDATOR, 0, spec_hash=h)

    db = create_devnet(tmp_path / "chain.db", NETUID, tempo=20, block_time=0.1, immunity_period=0)
    with _Served(db, tmp_home, [("honest", good, advert)]):
        rc = _doctor(db, tmp_path, h)
        out = capsys.readouterr().out
        cached = tmp_path / "cache" / "runs" / f"{h}.yaml"
        assert rc == 1, out                                  # no wallet "none": FAIL wallet, the rest checked
        lines = out.splitlines()
        assert any(l.startswith("PASS  spec") and h in l and "'runa' epoch 0" in l for l in lines), out
        assert any(l.startswith("PASS  config") and str(cached) in l for l in lines), out
        assert cached.read_bytes() == good
        for bad, why in (("xyz", "not 64 hex digits"), ("b" * 64, "no validator")):
            assert _doctor(db, tmp_path, bad) == 2
            cap = capsys.readouterr()
            assert cap.out == "" and len(cap.err.strip().splitlines()) == 1 and why in cap.err, cap

    db2 = create_devnet(tmp_path / "chain2.db", NETUID, tempo=20, block_time=0.1, immunity_period=0)
    with _Served(db2, tmp_home, [("liar", tampered, advert)]):
        (tmp_path / "cache" / "runs" / f"{h}.yaml").unlink()
        assert _doctor(db2, tmp_path, h) == 2
        cap = capsys.readouterr()
        assert cap.out == "" and len(cap.err.strip().splitlines()) == 1, cap
        assert "does not match its hash" in cap.err and spec_digest(tampered) in cap.err
