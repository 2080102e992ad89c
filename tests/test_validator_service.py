"""The validator process on a SQLite devnet with real miners (MinerServices, miner-to-miner data
plane): registration and permit checks, lanes from commitments, status.json / metrics.jsonl, weights
on chain, resume."""
from __future__ import annotations

import json

import pytest

from iota_subnet.validator.service import ValidatorError, ValidatorService
from iota_subnet.validator.state import ValidatorState
from iota_subnet.wallets import create_wallet
from support.dataplane_net import NETUID, P2PNet, run

pytestmark = pytest.mark.timeout(300)


def test_validator_service_end_to_end_and_resume(tmp_home, tmp_path, wikitext_path, cache_dir):
    async def main():
        net = P2PNet(tmp_path, wikitext_path, cache_dir)
        await net.start()
        try:
            wp = tmp_path / "wallets"
            stranger, nopermit = create_wallet("stranger", "default", wp), create_wallet("nopermit", "default", wp)
            await net.chain.register(nopermit, NETUID)
            # clear errors: not registered, no permit
            for wallet, match in ((stranger, "not registered"), (nopermit, "validator permit")):
                with pytest.raises(ValidatorError, match=match):
                    await ValidatorService(net.options(steps=1), wallet=wallet, chain=net.chain, cfg=net.cfg,
                                           dataset=net.ds).start()
            cfg = net.cfg
            tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
            micro_per_step = cfg.train.batch_size // cfg.train.micro_batch
            out = tmp_path / "vali0"

            assert await net.validator(steps=3).run() == 0
            st = net.status()
            assert st["done"] and st["lanes"] == 2 and st["steps_done"] == {"0": 3, "1": 3}, st
            assert st["val_loss"] is not None and st["weights_set_blocks"] and st["tokens"] == 2 * 3 * tokens_per_step
            assert st["uid"] == 0 and st["live_miners"] == 6 and st["n_validators"] == 1
            assert st["wire_dtype"] == "bf16"              # its tickets' (the default; localnet summaries report it)
            rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
            assert sorted((r["lane"], r["step"]) for r in rows) == [(l, k) for l in range(2) for k in range(3)]
            assert all(r["loss"] > 0 and r["lr"] > 0 for r in rows)
            weights = dict(await net.chain.weights(NETUID))
            miner_uids = {m.uid for m in net.miners.values()}
            assert set(u for u, _ in weights[0]) == miner_uids == {1, 2, 3, 4, 5, 6}   # not the validator
            assert all(m.worker.inner_step == 3 for m in net.miners.values())
            # path records (status.json paths): no relays here, so every pair that talked went directly
            assert {hk for hk, p in st["paths"].items() if "out" in p} >= {m.hotkey for m in net.miners.values()}
            assert {p[d]["kind"] for p in st["paths"].values() for d in p} == {"direct"}
            for m in net.miners.values():
                mine = m.status()["paths"]
                assert mine[st["hotkey"]]["in"]["kind"] == "direct" and mine[st["hotkey"]]["in"]["requests"] > 0

            # resume: the same folder, more steps -> continues at step 3 of each lane
            assert await net.validator(steps=5).run() == 0
            st = net.status()
            assert st["steps_done"] == {"0": 5, "1": 5} and st["done"], st
            rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
            assert sorted((r["lane"], r["step"]) for r in rows) == [(l, k) for l in range(2) for k in range(5)]
            assert all(m.worker.inner_step == 5 for m in net.miners.values())
            state = ValidatorState(out / "validator.sqlite")
            assert state.next_steps() == {0: 5, 1: 5}
            assert len(state.microbatch_log()) == 2 * 5 * micro_per_step
            assert all(rec.completed == 5 * micro_per_step for rec in state.load_ledger([1 / 3] * 3).records.values())
            state.close()
        finally:
            await net.close()

    run(main())
