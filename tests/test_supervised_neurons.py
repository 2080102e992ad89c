"""Every long-lived task of a miner and a validator (and their dashboards) runs under the neuron's one
supervisor: with each registered task made to raise once (a fault-injecting supervisor given to the
services, :mod:`support.faults`), every task restarts once, the run completes its steps and every
miner gets weight; status.json and the metrics count each restart. A task that fails on every start
makes ``GET /health`` (and the miner's signed ``/health``, the dashboard's ``/healthz``) unhealthy
within 5 failures."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from iota_subnet.miner.health import miner_health
from iota_subnet.protocol import Outcome, ProtocolError
from iota_subnet.validator.service import ValidatorService
from support.dataplane_net import NETUID, P2PNet, run
from support.faults import FaultySupervisor, task_counters

pytestmark = pytest.mark.timeout(240)

#: long-lived tasks every miner registers (the data plane's loops and the chain round of run()); miner 0 adds
#: its dashboard
MINER_LOOPS = {"dataplane", "receipts", "sender0", "sender1", "chain"}
#: its one-shot tasks: the catch-up at start and the replica merge at each merge boundary
MINER_ONE_SHOTS = {"catch-up", "merge"}
VALIDATOR_TASKS = {"status", "metagraph", "weights", "clasp", "audits", "train", "dashboard"}


def _per_miner(supervisor):
    """``start(per_miner=...)`` arguments: a supervisor of its own for each miner (``supervisor(stage)``),
    the dashboard on stage 0's miners."""
    return lambda s, r: {"supervisor": supervisor(s), **({"dashboard_port": 0} if s == 0 else {})}


async def _get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.text()


def test_every_task_raising_once_restarts_and_the_run_pays_every_miner(tmp_home, tmp_path, wikitext_path, cache_dir):
    async def main():
        # a merge after inner step 2 (each replica of this net merges alone)
        net = P2PNet(tmp_path, wikitext_path, cache_dir, replicas=1,
                     overrides={"merge": {"every_steps": 2, "join_timeout_s": 2.0}})
        sups = {}

        def miner_sup(stage):
            sups[stage] = FaultySupervisor(f"miner {stage}", base_backoff_s=0.05, fail_times=1)
            return sups[stage]

        await net.start(per_miner=_per_miner(miner_sup))
        stop = asyncio.Event()
        serving = [asyncio.create_task(m.run(stop)) for m in net.miners.values()]
        try:
            vsup = FaultySupervisor("validator", base_backoff_s=0.05, fail_times=1)
            svc = ValidatorService(net.options(steps=3, clasp_interval_s=3.0, dashboard_port=0), wallet=net.vals[0],
                                   chain=net.chain, cfg=net.cfg, dataset=net.ds, supervisor=vsup)
            t0 = time.monotonic()
            assert await svc.run() == 0
            wall = time.monotonic() - t0
            st = net.status()
            assert st["done"] and st["steps_done"] == {"0": 3}, st
            # every registered task failed once and restarted once (status.json and the metrics agree)
            assert set(vsup.calls) == VALIDATOR_TASKS
            assert set(st["tasks"]) == VALIDATOR_TASKS
            assert all(t["restarts"] == 1 and t["failures"] == 1 for t in st["tasks"].values()), st["tasks"]
            assert all(t["last_error"].startswith("RuntimeError: injected fault 1 in ") for t in st["tasks"].values())
            assert task_counters(svc.prom.render().decode()) == {n: 1.0 for n in VALIDATOR_TASKS}
            # every miner paid
            row = dict(dict(await net.chain.weights(NETUID))[0])
            miner_uids = {m.uid for m in net.miners.values()}
            assert set(row) == miner_uids and all(row[u] > 0 for u in miner_uids), row
            assert all(m.worker.inner_step == 3 for m in net.miners.values())
            # the miners: every task restarted once, in status.json and the metrics
            await asyncio.sleep(1.5)          # a chain round writes status.json
            for (s, _), m in net.miners.items():
                want = MINER_LOOPS | MINER_ONE_SHOTS | ({"dashboard"} if s == 0 else set())
                assert set(sups[s].calls) == want
                mst = json.loads((m.out / "status.json").read_text())
                assert set(mst["tasks"]) == want
                assert all(t["restarts"] == 1 and t["state"] == ("done" if n in MINER_ONE_SHOTS else "running")
                           for n, t in mst["tasks"].items()), mst["tasks"]
                assert mst["merge"]["last"]["epoch"] == 0, mst["merge"]     # the merge ran (alone: no peers)
                assert task_counters(m.metrics.render().decode()) == {n: 1.0 for n in want}
                assert m.sup.healthy
            print(f"validator run: {wall:.1f} s")
        finally:
            stop.set()
            await asyncio.gather(*serving, return_exceptions=True)
            await net.close()

    run(main(), timeout=200)


def test_a_task_failing_on_every_start_makes_health_unhealthy_within_five_failures(tmp_home, tmp_path,
                                                                                   wikitext_path, cache_dir):
    async def main():
        net = P2PNet(tmp_path, wikitext_path, cache_dir, replicas=1)

        def miner_sup(stage):
            return FaultySupervisor(f"miner {stage}", base_backoff_s=0.01, max_backoff_s=0.05, fail_times=10 ** 9,
                                    only={"receipts"} if stage == 0 else ())

        await net.start(per_miner=_per_miner(miner_sup))
        vsup = FaultySupervisor("validator", base_backoff_s=0.01, max_backoff_s=0.05, fail_times=10 ** 9,
                                only={"weights"})
        svc = ValidatorService(net.options(steps=None, wait_miners_s=60), wallet=net.vals[0], chain=net.chain,
                               cfg=net.cfg, dataset=net.ds, supervisor=vsup)
        serving = asyncio.create_task(svc.run())
        try:
            m0 = net.miners[(0, 0)]
            await _unhealthy(f"http://127.0.0.1:{m0.port}/health", m0.sup, "receipts")
            with pytest.raises(ProtocolError) as e:
                miner_health(m0)                         # the signed /health refuses too
            assert e.value.outcome == Outcome.NOT_READY and "'receipts' failed" in str(e.value)
            for _ in range(200):
                if svc.endpoints.server is not None and svc.endpoints.server.port:
                    break
                await asyncio.sleep(0.05)
            await _unhealthy(f"http://127.0.0.1:{svc.endpoints.server.port}/health", vsup, "weights")
            # the other miners stay healthy
            for key in ((1, 0), (2, 0)):
                code, _ = await _get(f"http://127.0.0.1:{net.miners[key].port}/health")
                assert code == 200
        finally:
            svc.request_stop()
            await asyncio.gather(serving, return_exceptions=True)
            await net.close()

    run(main(), timeout=120)


async def _unhealthy(url: str, sup: FaultySupervisor, task: str) -> None:
    """Poll ``url`` until it answers 503; then the task has failed 5 times or more, never fewer."""
    for _ in range(400):
        code, text = await _get(url)
        failures = sup.status()[task]["failures"]
        if code == 503:
            body = json.loads(text)
            assert body["status"] == "unhealthy" and body["failing"] == [task], body
            assert body["tasks"][task]["consecutive_failures"] >= 5
            assert failures >= 5
            return
        assert code == 200 and failures <= 5, (code, failures)
        await asyncio.sleep(0.01)
    pytest.fail(f"{url} never answered 503; {task}: {sup.status().get(task)}")
