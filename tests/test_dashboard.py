"""Dashboard parts alone: bounded series, the metrics.jsonl tail, rates, the validator snapshot
built from a status dict and metrics rows, and the read-only server. The page in a real browser
against a running network is tests/test_ops_localnet.py."""
from __future__ import annotations

import asyncio
import json

import aiohttp

from iota_subnet.dashboard import DashboardServer, MinerSource, ValidatorSource
from iota_subnet.dashboard.history import JsonlTail, Series
from iota_subnet.dashboard.server import finite
from iota_subnet.dashboard.sources import RateMeter


def test_series_stays_bounded_and_keeps_its_shape():
    s = Series(max_points=8)
    for i in range(1000):
        s.add(i, i * 2.0)
    s.add(1000, None)
    s.add(1001, float("nan"))
    assert 4 <= len(s) <= 8
    xs = [p[0] for p in s.to_json()]
    assert xs[0] == 0 and xs == sorted(xs) and xs[-1] == 999         # spans the whole run, latest point included


def test_jsonl_tail_reads_appends_waits_for_torn_lines_and_restarts(tmp_path):
    p = tmp_path / "metrics.jsonl"
    t = JsonlTail(p)
    assert t.read() == []                                             # no file yet
    p.write_text('{"step": 0, "loss": 6.0}\n{"step": 1, "lo')
    assert [r["step"] for r in t.read()] == [0]
    with open(p, "a") as f:
        f.write('ss": 5.9}\n{"step": 2, "loss": 5.8}\n')
    assert [r["step"] for r in t.read()] == [1, 2]
    p.write_text('{"step": 0, "loss": 6.1}\n')                        # a resume rewrote it shorter
    assert [r["loss"] for r in t.read()] == [6.1] and t.reset


def test_rate_meter():
    m = RateMeter(window_s=5)
    assert m.add(0.0, 0) is None
    assert m.add(1.0, 100) == 100
    assert m.add(2.0, 300) == 150
    assert m.add(10.0, 1100) == 100                                   # the window moved on
    assert m.add(11.0, 0) is None                                     # a restarted counter


STATUS = {"hotkey": "5Gvalidator", "uid": 0, "run_id": "r", "netuid": 9, "tokens": 512, "elapsed_s": 3.0,
          "stage_replicas": [1, 1], "lanes": 1,
          "replicas": [{"uid": 1, "hotkey": "5Ha", "stage": 0, "endpoint": "127.0.0.1:1", "lane": 0, "available": True,
                        "throughput": 100.0, "successes": 3, "failures": 0},
                       {"uid": 2, "hotkey": "5Hb", "stage": 1, "endpoint": "127.0.0.1:2", "lane": 0,
                        "available": False, "throughput": 0.0, "successes": 1, "failures": 2}],
          "miners": {"1": {"stage": 0, "work": 10.0}, "2": {"stage": 1, "work": 5.0}},
          "last_weights": {"1": 0.7, "2": 0.3}, "weights_set_blocks": [10],
          "probe_loss": {"round": 0, "loss": 6.2, "paths": 2}, "val_loss": None,
          "scores": [{"uid": 2, "audits": {"flagged": True}, "clasp": None, "why": ["flagged by audits: x"],
                      "weight": 0.0, "quality": 0.0}]}


def test_validator_snapshot_from_status_and_metrics(tmp_path):
    mp = tmp_path / "metrics.jsonl"
    mp.write_text("".join(json.dumps({"step": k, "lane": 0, "tokens": 256 * (k + 1), "loss": 6 - k / 10}) + "\n"
                          for k in range(3)))
    st = dict(STATUS)

    async def health(replicas):
        return {1: {"inner_step": 4, "ready": True, "merges": 2.0, "merged_epoch": 1.0}, 2: {"error": "timed out"}}

    src = ValidatorSource(status=lambda: st, metrics_path=mp, health=health)
    asyncio.run(src.sample())
    st = {**STATUS, "tokens": 1024, "elapsed_s": 4.0, "probe_loss": {"round": 1, "loss": 6.0, "paths": 2}}
    asyncio.run(src.sample())
    snap = src.snapshot()
    assert snap["series"]["loss"]["lines"]["train, lane 0"] == [[256, 6.0], [512, 5.9], [768, 5.8]]
    assert snap["series"]["loss"]["lines"]["held-out (CLASP probes)"] == [[512, 6.2], [1024, 6.0]]
    assert snap["series"]["work"]["lines"]["uid 1"] == [[3.0, 10.0], [4.0, 10.0]]
    cells = {c["uid"]: c for c in snap["pipeline"]["cells"]}
    assert cells[1]["state"] == "ok" and cells[1]["inner_step"] == 4 and cells[1]["weight"] == 0.7
    assert cells[2]["state"] == "flagged"
    # flagged by CLASP, or barred from routing (unavailable), is "flagged" too, not "cooldown"
    for extra in ({"clasp": {"flagged": True}}, {"barred": True}):
        score = {**STATUS["scores"][0], "audits": None, **({"clasp": extra["clasp"]} if "clasp" in extra else {})}
        reps = [STATUS["replicas"][0], {**STATUS["replicas"][1], **({"barred": True} if "barred" in extra else {})}]
        src = ValidatorSource(status=lambda: {**STATUS, "scores": [score], "replicas": reps}, metrics_path=mp,
                              health=health)
        asyncio.run(src.sample())
        assert {c["uid"]: c["state"] for c in src.snapshot()["pipeline"]["cells"]}[2] == "flagged", extra
    assert snap["merges"]["replicas"][0]["merges"] == 2.0
    assert snap["scores"]["miners"][0]["why"] == ["flagged by audits: x"]
    assert snap["pipeline"]["stages"] == 2
    # a miner behind a NAT: its cell names its relays; the relays card what this validator relays
    relay = {"attached": {"5Hb": {"requests": 3}}, "relayed": {"5Hb": {"requests": 3, "bytes": 900}}}
    # and each cell the path this validator's latest call to the miner took (status.json paths)
    paths = {"5Ha": {"out": {"kind": "direct", "via": None, "requests": 2}},
             "5Hb": {"out": {"kind": "relayed", "via": "10.0.0.9:8091", "requests": 3}},
             "5Hc": {"in": {"kind": "direct", "via": None, "requests": 1}}}
    src = ValidatorSource(status=lambda: {**STATUS, "relayed": {"5Hb": ["10.0.0.9:8091"]}, "relay": relay,
                                          "paths": paths}, metrics_path=mp, health=health)
    asyncio.run(src.sample())
    snap = src.snapshot()
    assert {c["uid"]: c["relays"] for c in snap["pipeline"]["cells"]} == {1: [], 2: ["10.0.0.9:8091"]}
    assert {c["uid"]: c["path"] for c in snap["pipeline"]["cells"]} == \
        {1: {"kind": "direct", "via": None}, 2: {"kind": "relayed", "via": "10.0.0.9:8091"}}
    assert snap["relays"] == relay
    assert finite({"a": [float("nan"), 1.0, float("inf")]}) == {"a": [None, 1.0, None]}


def test_server_is_read_only_and_serves_its_assets():
    async def go():
        src = MinerSource(status=lambda: {"uid": 3, "stage": 1, "inner_step": 2, "tokens": 64, "uptime_s": 1.0,
                                          "cache": {"bytes": 10}, "outcomes": {"OK": 5}, "loss": float("nan")})
        srv = DashboardServer(src, "127.0.0.1", 0)
        url = await srv.start()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(url) as r:
                    html = await r.text()
                    assert r.status == 200 and "default-src 'self'" in r.headers["Content-Security-Policy"]
                assert "http://" not in html and "https://" not in html
                for a in ("static/app.js", "static/vendor/uPlot.iife.min.js", "static/style.css"):
                    async with s.get(url + a) as r:
                        assert r.status == 200
                async with s.get(url + "api/snapshot") as r:
                    snap = await r.json()
                    assert snap["role"] == "miner" and snap["identity"]["uid"] == 3
                for m in ("POST", "PUT", "DELETE", "PATCH"):
                    async with s.request(m, url + "api/snapshot") as r:
                        assert r.status == 405
                async with s.get(url + "ops/reach?port=0") as r:
                    assert r.status == 400
        finally:
            await srv.stop()
    asyncio.run(go())
