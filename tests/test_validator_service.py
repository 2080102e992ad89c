"""The validator process on a SQLite devnet with real (in-test) miners: registration and permit
checks, lanes from commitments, status.json / metrics.jsonl, weights on chain, resume."""
from __future__ import annotations

import asyncio
import json

import pytest

from iota_subnet.devnet import add_stake, create_devnet, open_devnet
from iota_subnet.validator.service import ValidatorError, ValidatorOptions, ValidatorService
from iota_subnet.validator.state import ValidatorState
from support.common import OVR, PatternData, make_wallet  # noqa
from test_validator_driver import start_miners  # noqa: F401 (relay helpers; go with the relay path)

from iota_subnet.config import load_config

pytestmark = pytest.mark.timeout(150)
NETUID = 9


def test_validator_service_end_to_end_and_resume(tmp_home, tmp_path):
    cfg = load_config("configs/tiny.yaml", OVR)
    root = tmp_home / "wallets"
    wallets = {"vali": make_wallet(root, "vali"), "nopermit": make_wallet(root, "nopermit"),
               "stranger": make_wallet(root, "stranger"), **{f"m{i}": make_wallet(root, f"m{i}") for i in range(6)}}
    db = create_devnet(tmp_path / "chain.db", NETUID, tempo=4, block_time=0.1, weights_rate_limit=1,
                       immunity_period=0)
    out = tmp_path / "vali"

    def opts(steps, **kw):
        return ValidatorOptions(network="devnet", chain_db=str(db), netuid=NETUID, steps=steps, out=str(out),
                                run_id="run1", sync_interval_s=0.5, status_interval_s=0.2, weights_check_s=0.3,
                                hop_timeout_s=10, exit_when_done=True, wait_miners_s=30, data_plane="relay", **kw)

    async def main():
        chain = await open_devnet(db)
        vali = wallets["vali"]
        miners = await start_miners(cfg, wallets, 2, allowed={vali.hotkey.ss58_address})
        try:
            for name in ("vali", "nopermit", *[f"m{i}" for i in range(6)]):
                await chain.register(wallets[name], NETUID)
            add_stake(db, vali.hotkey.ss58_address, vali.coldkeypub.ss58_address, 100.0, netuid=NETUID)
            for i, m in enumerate(miners):
                w = wallets[f"m{i}"]
                await chain.serve(w, NETUID, "127.0.0.1", m.server.port)
                await chain.publish(w, NETUID, json.dumps({"v": 1, "run": "run1", "stage": m.stage}))
            # clear errors: not registered, no permit
            with pytest.raises(ValidatorError, match="not registered"):
                await ValidatorService(opts(1), wallet=wallets["stranger"], chain=chain, cfg=cfg,
                                       dataset=PatternData(256, 16)).start()
            with pytest.raises(ValidatorError, match="validator permit"):
                await ValidatorService(opts(1), wallet=wallets["nopermit"], chain=chain, cfg=cfg,
                                       dataset=PatternData(256, 16)).start()

            svc = ValidatorService(opts(3), wallet=vali, chain=chain, cfg=cfg, dataset=PatternData(256, 16))
            assert await asyncio.wait_for(svc.run(), 90) == 0
            st = json.loads((out / "status.json").read_text())
            assert st["done"] and st["lanes"] == 2 and st["steps_done"] == {"0": 3, "1": 3}
            assert st["val_loss"] is not None and st["weights_set_blocks"] and st["tokens"] == 2 * 3 * 4 * 16
            assert st["uid"] == 0 and st["live_miners"] == 6 and st["n_validators"] == 1
            rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
            assert sorted((r["lane"], r["step"]) for r in rows) == [(l, k) for l in range(2) for k in range(3)]
            assert all(r["loss"] > 0 and r["lr"] > 0 for r in rows)
            weights = dict(await chain.weights(NETUID))
            assert set(u for u, _ in weights[0]) == {2, 3, 4, 5, 6, 7}   # the six miners, not the validator
            assert all(m.worker.inner_step == 3 for m in miners)

            # resume: the same folder, more steps -> continues at step 3 of each lane
            svc2 = ValidatorService(opts(5), wallet=vali, chain=chain, cfg=cfg, dataset=PatternData(256, 16))
            assert await asyncio.wait_for(svc2.run(), 90) == 0
            st = json.loads((out / "status.json").read_text())
            assert st["steps_done"] == {"0": 5, "1": 5} and st["done"]
            rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
            assert sorted((r["lane"], r["step"]) for r in rows) == [(l, k) for l in range(2) for k in range(5)]
            assert all(m.worker.inner_step == 5 for m in miners)
            state = ValidatorState(out / "validator.sqlite")
            assert state.next_steps() == {0: 5, 1: 5}
            assert len(state.microbatch_log()) == 2 * 5 * 2
            assert all(rec.completed == 10 for rec in state.load_ledger([1 / 3] * 3).records.values())
            state.close()
        finally:
            for m in miners:
                await m.server.stop()
            await chain.close()

    asyncio.run(main())
