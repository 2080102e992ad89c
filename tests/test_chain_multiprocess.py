"""Several OS processes share one devnet SQLite file: they see each other's writes and every
epoch boundary runs exactly once."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import bittensor as bt
from bittensor import calls

from iota_subnet.devnet import DevnetSubstrate, create_devnet, epoch_log

NETUID = 9
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent(
    """
    import asyncio, sys, time
    import bittensor as bt
    from bittensor import calls
    from iota_subnet.devnet import DevnetSubstrate

    db, wallet_root, name, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])

    async def main():
        w = bt.Wallet(name=name, hotkey="default", path=wallet_root)
        w.create_new_coldkey(use_password=False, suppress=True, overwrite=True)
        w.create_new_hotkey(suppress=True, overwrite=True)
        async with bt.Client("local", substrate=DevnetSubstrate(db)) as client:
            r = await client.submit_call(calls.SubtensorModule.burned_register(netuid=9, hotkey=w.hotkey.ss58_address), w)
            assert r.success, r.message
            print("HOTKEY", w.hotkey.ss58_address, flush=True)
            end = time.time() + seconds
            while time.time() < end:  # every read may be the one that runs a due epoch
                await client.block()
                await client.query(("SubtensorModule", "LastEpochBlock"), [9])
                await asyncio.sleep(0.005)

    asyncio.run(main())
    """
)


def test_two_processes_share_state_and_epoch_runs_once(tmp_path, tmp_home):
    db = create_devnet(tmp_path / "shared.db", NETUID, tempo=2, block_time=0.05, immunity_period=0)
    env = dict(os.environ, HOME=str(tmp_home), PYTHONPATH=REPO)
    seconds = 2.5
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(db), str(tmp_path / "wallets"), f"child{i}", str(seconds)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for i in range(2)
    ]

    async def parent():
        async with bt.Client("local", substrate=DevnetSubstrate(db)) as client:
            w = bt.Wallet(name="parent", hotkey="default", path=str(tmp_path / "wallets"))
            w.create_new_coldkey(use_password=False, suppress=True, overwrite=True)
            w.create_new_hotkey(suppress=True, overwrite=True)
            r = await client.submit_call(calls.SubtensorModule.burned_register(netuid=NETUID, hotkey=w.hotkey.ss58_address), w)
            assert r.success
            end = time.time() + seconds
            while time.time() < end:
                await client.block()
                await asyncio.sleep(0.005)
            return client

    asyncio.run(parent())
    hotkeys = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        hotkeys += [line.split()[1] for line in out.splitlines() if line.startswith("HOTKEY")]
    assert len(hotkeys) == 2

    async def check():
        async with bt.Client("local", substrate=DevnetSubstrate(db)) as client:
            uids = [await client.neurons.uid(hk, NETUID) for hk in hotkeys]
            assert sorted(uids) != [None, None] and all(u is not None for u in uids)
            m = await client.subnets.metagraph(NETUID)
            assert len(m.neurons) == 3
            index = await client.query(("SubtensorModule", "SubnetEpochIndex"), [NETUID])
            return index

    index = asyncio.run(check())
    log = epoch_log(db, NETUID)
    blocks = [e["block"] for e in log]
    assert len(blocks) >= 5  # ~2.5 s / (3 blocks * 0.05 s)
    assert len(blocks) == len(set(blocks)), f"an epoch ran twice: {blocks}"
    assert blocks == sorted(blocks)
    assert all((b + NETUID + 1) % 3 == 0 for b in blocks)
    assert index == len(log)
