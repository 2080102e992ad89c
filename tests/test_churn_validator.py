"""A validator killed mid-run and restarted (same state folder) over real miners on a devnet: it resumes
its lanes without addressing a row twice and without splitting the lane members' inner steps."""
from __future__ import annotations

import asyncio

import pytest

from support.dataplane_net import P2PNet, run
from iota_subnet.validator.state import ValidatorState

pytestmark = pytest.mark.timeout(400)


def test_killed_validator_resumes_without_retraining_rows_or_splitting_steps(tmp_home, tmp_path, wikitext_path,
                                                                               cache_dir):
    """Issue 13: after a validator was killed mid-step and restarted, rows 24-27 and 36-39 were
    addressed twice and the miners ended at inner steps 7, 7, 7, 6, 6, 7 after 6 validator steps."""
    steps = 8

    async def main():
        net = P2PNet(tmp_path, wikitext_path, cache_dir, replicas=2)
        await net.start(hop_timeout_s=5.0)
        try:
            vali = net.validator(steps=steps, stall_s=4.0)
            task = asyncio.create_task(vali.run())
            head = net.miners[(0, 0)]
            while head.worker.inner_step < 3:          # mid-run, tickets for later steps already at the heads
                await asyncio.sleep(0.02)
            task.cancel()                              # killed: no clean hand-over
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.sleep(1.0)                   # the heads go on with the tickets they hold
            vali2 = net.validator(steps=steps, stall_s=4.0)
            assert await asyncio.wait_for(vali2.run(), 300) == 0
            st = net.status()
            assert st["done"] and st["steps_done"] == {"0": steps, "1": steps}, st
            B, T = net.cfg.train.batch_size, net.cfg.data.seq_len
            for (s, r), m in net.miners.items():
                # every lane member did every lane step once: same inner step, each row trained once
                assert m.worker.inner_step == steps, ((s, r), m.worker.inner_step)
                assert m.worker.trained_tokens == steps * B * T, ((s, r), m.worker.trained_tokens)
            vs = ValidatorState(tmp_path / "vali0" / "validator.sqlite")
            try:
                keys = [(row["lane"], row["step"], row["idx"]) for row in vs.microbatch_log() if row["ok"]]
            finally:
                vs.close()
            assert len(keys) == len(set(keys)), "a micro-batch was logged twice"
            micro = B // net.cfg.train.micro_batch
            assert set(keys) == {(l, k, m) for l in (0, 1) for k in range(steps) for m in range(micro)}
        finally:
            await net.close()

    run(main(), timeout=380)
