"""Every chain call has a deadline. A websocket endpoint that accepts the
connection and never answers must not freeze the CLI, a miner or a validator: calls time out with
a clear message, the loop skips the round and reconnects, and SIGTERM stops a neuron that is
still starting."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import bittensor as bt
import pytest
import websockets

from iota_subnet.chain import ChainError, ChainTimeout
from iota_subnet.devnet import DevnetSubstrate, create_devnet
from iota_subnet.chain.sdk import SdkChain
from iota_subnet.config import load_config
from iota_subnet.miner.options import MinerOptions
from iota_subnet.miner.service import MinerService
from iota_subnet.wallets import create_wallet

from support.miners import LOCAL

pytestmark = pytest.mark.timeout(300)
NETUID = 9
REPO = Path(__file__).resolve().parents[1]
OVR = {"model": {"name": "tiny", "dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                 "vocab_size": 256},
       "data": {"seq_len": 16, "vocab_size": 256},
       "pipeline": {"stages": 3, "compression_ratio": 4},
       "train": {"batch_size": 4, "micro_batch_size": 2}}


class SilentEndpoint:
    """A websocket server on 127.0.0.1 that accepts every connection and never answers."""

    def __init__(self):
        self.url = ""
        self.connections = 0
        self._ready = threading.Event()
        self._stop: asyncio.Future | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _handler(self, ws):
        self.connections += 1
        try:
            async for _ in ws:          # read and ignore every request
                pass
        except websockets.ConnectionClosed:
            pass

    async def _serve(self):
        self._stop = asyncio.get_running_loop().create_future()
        self._loop = asyncio.get_running_loop()
        async with websockets.serve(self._handler, "127.0.0.1", 0) as srv:
            self.url = f"ws://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
            self._ready.set()
            await self._stop

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._stop.set_result, None)
        self._thread.join(10)


def _env(home: Path) -> dict:
    env = dict(os.environ, HOME=str(home), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_cli_metagraph_against_a_silent_endpoint_exits_2(tmp_home):
    with SilentEndpoint() as ep:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "iota_subnet.cli", "chain", "metagraph", "--network", ep.url,
                            "--chain-timeout", "3"], capture_output=True, text=True, timeout=240, env=_env(tmp_home))
        took = time.monotonic() - t0
    assert p.returncode == 2, p.stderr
    assert "no answer" in p.stderr and ep.url in p.stderr and "Traceback" not in p.stderr
    assert ep.connections >= 1
    assert took < 120      # import time included; the old code waited for ever


def _start(argv: list[str], home: Path, log: Path) -> subprocess.Popen:
    f = open(log, "wb")
    return subprocess.Popen([sys.executable, "-m", *argv], stdout=f, stderr=subprocess.STDOUT, env=_env(home))


def _wait_for(log: Path, text: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("role", ["miner", "validator"])
def test_sigterm_stops_a_neuron_stuck_on_a_silent_chain(tmp_home, tmp_path, role):
    """The neuron connects to an endpoint that never answers (deadline 600 s, so only the stop
    request can end it); SIGTERM ends it within seconds, cleanly."""
    create_wallet("w", "default", tmp_home / "wallets")
    with SilentEndpoint() as ep:
        log = tmp_path / f"{role}.log"
        common = ["--network", ep.url, "--chain-timeout", "600", "--wallet-name", "w", "--wallet-path",
                  str(tmp_home / "wallets"), "--config", "configs/tiny.yaml", "--out", str(tmp_path / "out")]
        if role == "miner":
            proc = _start(["iota_subnet.entry.miner", *common, "--external-ip", "127.0.0.1", "--allow-private-ip"],
                          tmp_home, log)
        else:
            proc = _start(["iota_subnet.entry.validator", *common, "--external-ip", "127.0.0.1", "--allow-private-ip"],
                          tmp_home, log)
        try:
            deadline = time.monotonic() + 240                   # wait for it to be connecting
            while time.monotonic() < deadline and ep.connections == 0 and proc.poll() is None:
                time.sleep(0.2)
            assert ep.connections >= 1, log.read_text()
            time.sleep(1.0)
            assert proc.poll() is None                          # still waiting on the silent chain
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=60)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text(errors="replace")
    assert rc == 0, text
    assert took < 20, took
    assert "stopped" in text and "Traceback" not in text


def test_a_round_without_answer_is_skipped_and_the_next_reconnects(tmp_home, tmp_path):
    """A running miner whose chain goes silent skips its chain rounds (the miner keeps serving,
    stop still works), reconnects, and resumes once the chain answers again."""
    db = create_devnet(tmp_path / "c.db", NETUID, tempo=100, block_time=0.2)
    cfg = load_config("configs/tiny.yaml", OVR)
    w = create_wallet("m", "default", tmp_home / "wallets")

    async def main(ep_url):
        silent = [False]

        def make():
            return bt.Client(ep_url) if silent[0] else bt.Client("local", substrate=DevnetSubstrate(db))
        chain = SdkChain(make, "devnet", timeout_s=1.0)
        await chain.connect()
        await chain.register(w, NETUID)
        svc = MinerService(cfg, w, chain, MinerOptions(netuid=NETUID, run_id="r", stage=1, out_dir=tmp_path / "m",
                                                       serve=LOCAL, metagraph_refresh_s=0.2))
        await svc.start()
        stop = asyncio.Event()
        task = asyncio.create_task(svc.run(stop))
        try:
            silent[0] = True
            chain._broken = True                               # as after a time-out: reconnect on the next call
            await asyncio.sleep(4.0)                           # rounds time out (1 s) and are skipped
            assert not task.done()
            with pytest.raises(ChainTimeout, match="no answer"):
                await chain.block()
            silent[0] = False                                  # the chain answers again
            b = None
            for _ in range(20):
                try:
                    b = await chain.block()
                    break
                except ChainTimeout:
                    await asyncio.sleep(0.2)
            assert b is not None and b >= 0
            stop.set()
            await asyncio.wait_for(task, 15)
        finally:
            stop.set()
            if not task.done():
                task.cancel()
            await chain.close()

    with SilentEndpoint() as ep:
        asyncio.run(main(ep.url))


def test_a_call_whose_connection_a_reconnect_closed_is_a_lost_connection(tmp_path):
    """A call still running on the devnet when another task reconnects (its time-out marked the chain
    broken) finds its database closed: that is a lost connection (ChainError, the caller's round is
    skipped), not "Cannot operate on a closed database" escaping into an audit or weights loop."""
    db = create_devnet(tmp_path / "c.db", NETUID, tempo=100, block_time=0.2)

    async def main():
        subs: list[DevnetSubstrate] = []

        def make():
            subs.append(DevnetSubstrate(db))
            return bt.Client("local", substrate=subs[-1])
        chain = SdkChain(make, "devnet", timeout_s=5.0)
        await chain.connect()
        await chain.block()
        gate = asyncio.Event()

        async def in_flight(client):
            st = subs[0].state                    # what a query running in a worker thread holds
            await gate.wait()
            return st.conn.execute("SELECT 1").fetchone()
        task = asyncio.create_task(chain._io("metagraph", in_flight))
        await asyncio.sleep(0.05)
        chain._broken = True                      # as after another call's time-out
        assert await chain.block() >= 0           # reconnects: the first connection is closed
        assert len(subs) == 2
        gate.set()
        with pytest.raises(ChainError, match="replaced while this call ran") as ei:
            await task
        assert "closed database" in str(ei.value)
        assert await chain.block() >= 0
        await chain.close()
    asyncio.run(main())
