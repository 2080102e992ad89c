"""Prometheus metrics: a real NeuronServer and NeuronClient on 127.0.0.1 feed one NeuronMetrics;
the exposition parses and carries routes, outcomes, bytes and latencies; status dicts map to the
documented families; every family name the code can emit is documented in the README."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import bittensor as bt
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iota_subnet.protocol import Health, Outcome, ProtocolError
from iota_subnet.telemetry import NeuronMetrics
from iota_subnet.transport import NeuronClient, NeuronServer

pytestmark = pytest.mark.timeout(60)
README = Path(__file__).resolve().parents[1] / "README.md"


def _wallet(path: Path, name: str) -> bt.Wallet:
    w = bt.Wallet(name=name, hotkey="hk", path=str(path))
    w.create_new_coldkey(use_password=False, overwrite=True, suppress=True)
    w.create_new_hotkey(use_password=False, overwrite=True, suppress=True)
    return w


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_served_and_sent_requests_are_counted_by_route_outcome_and_bytes(tmp_home, tmp_path):
    server_w, client_w = _wallet(tmp_home / "w", "server"), _wallet(tmp_home / "w", "client")
    server_m, client_m = NeuronMetrics("miner"), NeuronMetrics("validator")

    async def health(msg, ctx):
        return Health(run_id=msg.run_id, stage=msg.stage, inner_step=7, stats={"x": 1.0})

    def authorizer(hotkey, route):
        if hotkey != client_w.hotkey.ss58_address:
            raise ProtocolError(Outcome.UNREGISTERED_HOTKEY, "not registered")

    async def go():
        server = NeuronServer(server_w, "127.0.0.1", 0, authorizer, tmp_path / "nonces.sqlite")
        server.add_route("/health", health, Health)
        server.add_public_get("/metrics", server_m.handler)
        server_m.instrument(server.app)
        await server.start()
        ep = server.endpoint
        try:
            async with NeuronClient(client_w, on_request=client_m.observe_hop) as c:
                for _ in range(3):
                    h = await c.call(ep, server_w.hotkey.ss58_address, "/health", Health(run_id="r"), Health)
                    assert h.inner_step == 7
            async with NeuronClient(server_w, on_request=client_m.observe_hop) as stranger:   # unregistered caller
                with pytest.raises(ProtocolError):
                    await stranger.call(ep, server_w.hotkey.ss58_address, "/health", Health(run_id="r"), Health,
                                        retries=0)
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://{ep}/health", data=b"x") as r:          # unsigned
                    assert r.status == 401
                async with s.get(f"http://{ep}/metrics") as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                    return await r.text()
        finally:
            await server.stop()

    text = asyncio.run(go())
    got = _samples(text)
    assert got[("iota_http_served_requests_total", (("outcome", "OK"), ("route", "/health")))] == 3
    assert got[("iota_http_served_requests_total", (("outcome", "UNREGISTERED_HOTKEY"), ("route", "/health")))] == 1
    assert got[("iota_http_served_requests_total", (("outcome", "MISSING_SIGNATURE"), ("route", "/health")))] == 1
    assert got[("iota_http_served_received_bytes_total", (("route", "/health"),))] > 0
    assert got[("iota_http_served_sent_bytes_total", (("route", "/health"),))] > 0
    assert got[("iota_http_served_seconds_count", (("route", "/health"),))] == 5
    sent = _samples(client_m.render().decode())
    assert sent[("iota_hop_requests_total", (("outcome", "OK"), ("route", "/health")))] == 3
    assert sent[("iota_hop_requests_total", (("outcome", "UNREGISTERED_HOTKEY"), ("route", "/health")))] == 1
    assert sent[("iota_hop_latency_seconds_count", (("route", "/health"),))] == 4
    assert 0 < sent[("iota_hop_latency_seconds_sum", (("route", "/health"),))] < 10
    assert sent[("iota_hop_sent_bytes_total", (("route", "/health"),))] > 0
    assert sent[("iota_hop_received_bytes_total", (("route", "/health"),))] > 0


def test_transport_errors_are_counted_as_such(tmp_home):
    m = NeuronMetrics("validator")
    w = _wallet(tmp_home / "w", "c")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]          # closed again: nothing listens there

    async def go():
        async with NeuronClient(w, on_request=m.observe_hop) as c:
            with pytest.raises(Exception):
                await c.call(f"127.0.0.1:{port}", w.hotkey.ss58_address, "/hop", Health(), Health, retries=1,
                             backoff_s=0.01, timeout_s=2)
    asyncio.run(go())
    got = _samples(m.render().decode())
    assert got[("iota_hop_requests_total", (("outcome", "TRANSPORT_ERROR"), ("route", "/hop")))] == 2


VALIDATOR_STATUS = {
    "tokens": 4096, "tokens_per_s": 512.5, "loss": 5.25, "losses": {"0": 5.0, "1": 5.5}, "val_loss": None,
    "probe_loss": {"round": 3, "loss": 5.6, "paths": 6}, "reroutes": 2, "failures": 1, "microbatches_ok": 30,
    "microbatches_failed": 1, "live_miners": 6, "lanes": 2, "steps_done": {"0": 8, "1": 8},
    "wire_bytes": 1000, "verification_bytes": 200, "weights_set_blocks": [20, 40], "done": False,
    "miners": {"3": {"stage": 0, "work": 12.5}, "4": {"stage": 1, "work": float("nan")}},
    "last_weights": {"3": 0.75, "4": 0.25},
    "scores": [{"uid": 3, "clasp": {"n_in": 9, "flagged": True}, "why": ["CLASP: pathways through it lose more"]},
               {"uid": 4, "clasp": {"n_in": 5, "flagged": False}, "why": []}],
}


def test_status_maps_to_documented_families():
    m = NeuronMetrics("validator")
    m.watch(lambda: VALIDATOR_STATUS)
    got = _samples(m.render().decode())
    assert got[("iota_validator_tokens_total", ())] == 4096
    assert got[("iota_validator_lane_loss", (("lane", "1"),))] == 5.5
    assert got[("iota_validator_probe_loss", ())] == 5.6
    assert ("iota_validator_validation_loss", ()) not in got            # None is not exported as 0
    assert got[("iota_miner_verified_work", (("stage", "0"), ("uid", "3")))] == 12.5
    assert ("iota_miner_verified_work", (("stage", "1"), ("uid", "4"))) not in got   # NaN skipped
    assert got[("iota_miner_weight", (("uid", "3"),))] == 0.75
    assert got[("iota_audit_checks_total", (("kind", "clasp"), ("outcome", "probed")))] == 14
    assert got[("iota_audit_flagged_miners", (("check", "clasp"),))] == 1
    assert got[("iota_validator_weights_set_total", ())] == 2
    assert got[("iota_validator_microbatches_total", (("outcome", "failed"),))] == 1

    mm = NeuronMetrics("miner")
    mm.watch(lambda: {"stage": 1, "inner_step": 12, "tokens": 999, "forwards": 5, "backwards": 4, "uptime_s": 3.0,
                      "cache": {"bytes": 2048, "entries": 2, "evictions": {"ttl": 1, "bytes": 0}},
                      "merge": {"merges": 2, "abandoned": 1, "merged_epoch": 1, "mismatch_reports": 0,
                                "in_sync": True}})
    mm.observe_merge("merged", 1.5, 100, 200)
    got = _samples(mm.render().decode())
    assert got[("iota_miner_inner_step", (("stage", "1"),))] == 12
    assert got[("iota_miner_activation_cache_bytes", ())] == 2048
    assert got[("iota_miner_activation_evictions_total", (("reason", "ttl"),))] == 1
    assert got[("iota_miner_merges_applied_total", ())] == 2
    assert got[("iota_merge_duration_seconds_count", (("outcome", "merged"),))] == 1
    assert got[("iota_merge_bytes_total", (("direction", "received"),))] == 200


def test_a_failing_status_does_not_break_the_scrape():
    m = NeuronMetrics("miner")

    def broken():
        raise RuntimeError("boom")
    m.watch(broken)
    assert b"iota_neuron_up" in m.render()


def test_every_metric_name_is_documented_in_the_readme():
    import inspect

    import iota_subnet.telemetry as t
    src = inspect.getsource(t)
    names = set(re.findall(r'"(iota_[a-z_]+)"', src))
    assert len(names) > 30
    readme = README.read_text()
    missing = sorted(n for n in names if n not in readme)
    assert not missing, f"undocumented metrics: {missing}"


def test_grafana_example_uses_only_exported_metrics():
    import inspect
    import json as _json

    import iota_subnet.telemetry as t
    from iota_subnet.miner import service
    exported = set(re.findall(r'"(iota_[a-z_]+)"', inspect.getsource(t) + inspect.getsource(service)))
    dash = _json.loads((README.parent / "deploy" / "grafana" / "iota-subnet.json").read_text())
    used = {m for p in dash["panels"] for tgt in p["targets"] for m in re.findall(r"iota_[a-z_]+", tgt["expr"])}
    assert len(dash["panels"]) >= 8 and used
    base = {re.sub(r"_(total|bucket|sum|count)$", "", m) for m in used}
    assert base <= exported, base - exported
