"""Prometheus metrics of a neuron (``GET /metrics``), shared by miners and validators.

One :class:`NeuronMetrics` per process. It is fed three ways, so the services need only small hooks:

* **served requests** (:meth:`NeuronMetrics.instrument`): an aiohttp middleware counts every
  request an app answers, by route and outcome, with its body bytes in and out and its time;
* **sent requests** (:meth:`NeuronMetrics.observe_hop`, passed to
  :class:`~iota_subnet.transport.NeuronClient` as ``on_request``): every hop this neuron sends,
  by route and outcome, with its latency and bytes;
* **state** (:meth:`NeuronMetrics.watch`): at scrape time a status function (the neuron's
  ``status()`` dict, the same one ``status.json`` holds) is mapped to gauges and counters by
  :func:`validator_families` or :func:`miner_families`;

plus two event hooks for merges (:meth:`NeuronMetrics.observe_merge`). The status's ``tasks`` (the
neuron's :class:`~iota_subnet.utils.supervise.Supervisor`) become ``iota_task_restarts_total``,
``iota_task_failures_total`` and ``iota_task_consecutive_failures`` by task, for both roles;
:func:`health_handler` serves ``GET /health`` from the same supervisor. Every name, unit and
label is listed in the README (section *Metrics*). Nothing secret is exported: hotkeys and uids
are public on chain; no keys, paths or endpoints.
"""
from __future__ import annotations

import json
import math
import time
from typing import Any, Awaitable, Callable, Iterable, Iterator, Mapping, Optional

from aiohttp import web
from loguru import logger
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

#: Latency buckets (seconds) of hops and served requests: 1 ms .. 2 min.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
#: Merge duration buckets (seconds).
MERGE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class NeuronMetrics:
    """The metrics registry of one neuron. ``role``: ``"miner"`` or ``"validator"``."""

    def __init__(self, role: str):
        if role not in ("miner", "validator"):
            raise ValueError(f"role must be miner or validator, got {role!r}")
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        self.served = Counter("iota_http_served_requests", "requests this neuron answered, by route and outcome",
                              ["route", "outcome"], registry=r)
        self.served_in = Counter("iota_http_served_received_bytes", "request body bytes received, by route",
                                 ["route"], registry=r)
        self.served_out = Counter("iota_http_served_sent_bytes", "response body bytes sent, by route",
                                  ["route"], registry=r)
        self.served_seconds = Histogram("iota_http_served_seconds", "time to answer a request, by route",
                                        ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.hops = Counter("iota_hop_requests", "requests this neuron sent to other neurons, by route and outcome",
                            ["route", "outcome"], registry=r)
        self.hop_seconds = Histogram("iota_hop_latency_seconds", "round-trip time of a sent request "
                                     "(one attempt, signing to decoded reply), by route", ["route"],
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.hop_sent = Counter("iota_hop_sent_bytes", "request body bytes sent to other neurons, by route",
                                ["route"], registry=r)
        self.hop_received = Counter("iota_hop_received_bytes", "reply body bytes received from other neurons, "
                                    "by route", ["route"], registry=r)
        self.merge_seconds = Histogram("iota_merge_duration_seconds", "wall time of a replica merge attempt "
                                       "(join to applied), by outcome", ["outcome"], buckets=MERGE_BUCKETS,
                                       registry=r)
        self.merge_bytes = Counter("iota_merge_bytes", "merge payload bytes, by direction (sent | received)",
                                   ["direction"], registry=r)
        self.up = Gauge("iota_neuron_up", "1 while the neuron serves; labels name it", ["role"], registry=r)
        self.up.labels(role).set(1)
        self.started_at = time.time()
        self._watched: list[_StatusCollector] = []

    # ------------------------------------------------------------------ feeds
    def observe_hop(self, route: str, sent: int, received: int, seconds: float, outcome: str) -> None:
        """One sent request attempt (the ``on_request`` hook of ``NeuronClient``)."""
        self.hops.labels(route, outcome).inc()
        self.hop_seconds.labels(route).observe(max(0.0, float(seconds)))
        self.hop_sent.labels(route).inc(max(0, int(sent)))
        self.hop_received.labels(route).inc(max(0, int(received)))

    def observe_merge(self, outcome: str, seconds: float, bytes_sent: int = 0, bytes_received: int = 0) -> None:
        """One finished merge attempt: ``outcome`` (merged, abandoned, late, ...), its wall time and bytes."""
        self.merge_seconds.labels(outcome).observe(max(0.0, float(seconds)))
        self.merge_bytes.labels("sent").inc(max(0, int(bytes_sent)))
        self.merge_bytes.labels("received").inc(max(0, int(bytes_received)))

    def watch(self, status: Callable[[], Mapping[str, Any]]) -> None:
        """Export ``status()`` (read at every scrape) through this role's mapping."""
        role = validator_families if self.role == "validator" else miner_families

        def families(st: Mapping[str, Any]) -> Iterator[Metric]:
            yield from role(st)
            yield from task_families(st)
        c = _StatusCollector(status, families)
        self.registry.register(c)
        self._watched.append(c)

    def instrument(self, app: web.Application) -> None:
        """Count every request ``app`` answers (call before the app starts: middlewares freeze then)."""
        app.middlewares.insert(0, self._middleware)

    # ------------------------------------------------------------------ serving
    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    async def handler(self, request: web.Request) -> web.Response:
        """``GET /metrics``."""
        return web.Response(body=self.render(), headers={"Content-Type": CONTENT_TYPE})

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        t0 = time.perf_counter()
        route = _route_label(request)
        outcome = "INTERNAL"
        resp = None
        try:
            resp = await handler(request)
            outcome = _outcome_of(resp)
            return resp
        except web.HTTPException as e:
            outcome = f"HTTP_{e.status}"
            raise
        finally:
            self.served.labels(route, outcome).inc()
            self.served_in.labels(route).inc(request.content_length or 0)
            body = getattr(resp, "body", None)
            if isinstance(body, (bytes, bytearray)):
                self.served_out.labels(route).inc(len(body))
            self.served_seconds.labels(route).observe(time.perf_counter() - t0)


def _route_label(request: web.Request) -> str:
    """The request's route; unknown paths collapse to ``other`` (label cardinality stays bounded)."""
    info = request.match_info
    route = getattr(info, "route", None)
    resource = getattr(route, "resource", None)
    canonical = getattr(resource, "canonical", None) if resource is not None else None
    if canonical:
        return str(canonical)
    return "other"


def _outcome_of(resp: web.StreamResponse) -> str:
    """``OK`` for 2xx; the refusal's outcome name when the body says it; else ``HTTP_<status>``."""
    if 200 <= resp.status < 300:
        return "OK"
    body = getattr(resp, "body", None)
    if isinstance(body, (bytes, bytearray)) and len(body) < 4096:
        try:
            o = json.loads(body.decode("utf-8")).get("outcome")
            if isinstance(o, str) and o.isupper() and len(o) < 40:
                return o
        except (ValueError, UnicodeDecodeError, AttributeError):
            pass
    return f"HTTP_{resp.status}"


class _StatusCollector:
    """A prometheus_client collector that maps a status dict to metric families at scrape time."""

    def __init__(self, status: Callable[[], Mapping[str, Any]],
                 families: Callable[[Mapping[str, Any]], Iterable[Metric]]):
        self.status, self.families = status, families

    def describe(self) -> list:
        return []          # no fixed description: do not call status() at registration

    def collect(self) -> Iterator[Metric]:
        try:
            st = self.status() or {}
        except Exception as e:  # noqa: BLE001 - a scrape must never take the neuron down
            logger.warning("metrics: status() failed: {}: {}", type(e).__name__, e)
            return iter(())
        return iter(list(self.families(st)))


# ---------------------------------------------------------------------- status -> families
def _num(v: Any) -> Optional[float]:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _gauge(name: str, doc: str, value: Any, labels: Optional[dict] = None) -> Optional[GaugeMetricFamily]:
    v = _num(value)
    if v is None:
        return None
    if not labels:
        return GaugeMetricFamily(name, doc, value=v)
    g = GaugeMetricFamily(name, doc, labels=list(labels))
    g.add_metric([str(x) for x in labels.values()], v)
    return g


def _counter(name: str, doc: str, value: Any) -> Optional[CounterMetricFamily]:
    v = _num(value)
    return CounterMetricFamily(name, doc, value=max(0.0, v)) if v is not None else None


def task_families(st: Mapping[str, Any]) -> Iterator[Metric]:
    """The supervised tasks of a status (``st["tasks"]``: name -> :meth:`Supervisor.status` record) as
    counters of restarts and failures and a gauge of consecutive failures, labelled by task."""
    tasks = st.get("tasks")
    if not isinstance(tasks, Mapping):
        return
    for key, name, doc, cls in (
            ("restarts", "iota_task_restarts", "restarts of a supervised long-lived task after an exception",
             CounterMetricFamily),
            ("failures", "iota_task_failures", "exceptions that ended a run of a supervised task", CounterMetricFamily),
            ("consecutive_failures", "iota_task_consecutive_failures", "failures of a supervised task since its "
             "last stable run (the neuron is unhealthy from the supervisor's threshold on)", GaugeMetricFamily)):
        fam = cls(name, doc, labels=["task"])
        for task, rec in sorted(tasks.items()):
            v = _num((rec or {}).get(key))
            if v is not None:
                fam.add_metric([str(task)], v)
        yield fam


def health_handler(supervisor: Any) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``GET /health`` of a neuron from its :class:`~iota_subnet.utils.supervise.Supervisor`: 200
    ``{"status": "ok", "tasks": ...}``, or 503 ``{"status": "unhealthy", "failing": [names], "tasks": ...}``
    while a task has failed the supervisor's ``unhealthy_after`` times in a row."""
    async def health(_request: web.Request) -> web.Response:
        failing = supervisor.failing()
        body = {"status": "unhealthy" if failing else "ok", "failing": failing, "tasks": supervisor.status()}
        return web.json_response(body, status=503 if failing else 200)
    return health


def validator_families(st: Mapping[str, Any]) -> Iterator[Metric]:
    """A validator's ``status()`` as metric families (names and units in the README)."""
    yield from filter(None, [
        _counter("iota_validator_tokens", "tokens trained through this validator's lane steps", st.get("tokens")),
        _gauge("iota_validator_tokens_per_second", "trained tokens per second since the validator started",
               st.get("tokens_per_s")),
        _gauge("iota_validator_loss", "training loss (nats/token), mean of each lane's latest step", st.get("loss")),
        _gauge("iota_validator_validation_loss", "held-out loss (nats/token) of the final evaluation",
               st.get("val_loss")),
        _gauge("iota_validator_probe_loss", "held-out loss (nats/token) of the latest CLASP probe round",
               (st.get("probe_loss") or {}).get("loss")),
        _counter("iota_validator_reroutes", "hops re-sent to another replica", st.get("reroutes")),
        _counter("iota_validator_hop_failures", "hops that failed (timeout, refusal, bad reply)", st.get("failures")),
        _gauge("iota_validator_live_miners", "miners of the run available for routing", st.get("live_miners")),
        _gauge("iota_validator_lanes", "lanes driven", st.get("lanes")),
        _counter("iota_validator_training_wire_bytes", "bytes of training requests (tickets, health probes) sent plus received",
                 st.get("wire_bytes")),
        _counter("iota_validator_verification_wire_bytes", "bytes of verification requests (audits, merge evidence)",
                 st.get("verification_bytes")),
        _counter("iota_validator_weights_set", "weight vectors accepted by the chain",
                 len(st.get("weights_set_blocks") or [])),
        _gauge("iota_validator_weights_last_block", "block of the latest accepted weights",
               (st.get("weights_set_blocks") or [None])[-1]),
        _gauge("iota_validator_done", "1 once the steps and the evaluation are done", 1 if st.get("done") else 0),
    ])
    mb = CounterMetricFamily("iota_validator_microbatches", "micro-batches driven, by outcome (ok | failed)",
                             labels=["outcome"])
    mb.add_metric(["ok"], max(0.0, _num(st.get("microbatches_ok")) or 0.0))
    mb.add_metric(["failed"], max(0.0, _num(st.get("microbatches_failed")) or 0.0))
    yield mb
    lane_loss = GaugeMetricFamily("iota_validator_lane_loss", "latest step's training loss (nats/token), by lane",
                                  labels=["lane"])
    for lane, v in (st.get("losses") or {}).items():
        if _num(v) is not None:
            lane_loss.add_metric([str(lane)], _num(v))
    yield lane_loss
    steps = CounterMetricFamily("iota_validator_lane_steps", "lane steps completed by this validator, by lane",
                                labels=["lane"])
    for lane, v in (st.get("steps_done") or {}).items():
        steps.add_metric([str(lane)], max(0.0, _num(v) or 0.0))
    yield steps
    work = GaugeMetricFamily("iota_miner_verified_work", "verified work units credited to a miner "
                             "(tokens x stage compute share)", labels=["uid", "stage"])
    for uid, m in (st.get("miners") or {}).items():
        if isinstance(m, Mapping) and _num(m.get("work")) is not None:
            work.add_metric([str(uid), str(m.get("stage"))], _num(m["work"]))
    yield work
    weight = GaugeMetricFamily("iota_miner_weight", "latest weight this validator set for a miner (0..1)",
                               labels=["uid"])
    for uid, w in (st.get("last_weights") or {}).items():
        if _num(w) is not None:
            weight.add_metric([str(uid)], _num(w))
    yield weight
    # CLASP outcomes, summed over miners, from the explained scores
    audits: dict[tuple[str, str], float] = {}
    flagged: dict[str, float] = {"clasp": 0.0}
    for row in st.get("scores") or []:
        cl = row.get("clasp") or {}
        if cl:
            audits[("clasp", "probed")] = audits.get(("clasp", "probed"), 0.0) + (_num(cl.get("n_in")) or 0)
            if cl.get("flagged"):
                flagged["clasp"] += 1
    a = CounterMetricFamily("iota_audit_checks", "verification checks, by kind (clasp: probe pathways "
                            "through the miner) and outcome", labels=["kind", "outcome"])
    for (kind, outcome), v in sorted(audits.items()):
        a.add_metric([kind, outcome], v)
    yield a
    f = GaugeMetricFamily("iota_audit_flagged_miners", "miners currently flagged, by check", labels=["check"])
    for check, v in flagged.items():
        f.add_metric([check], v)
    yield f


def miner_families(st: Mapping[str, Any]) -> Iterator[Metric]:
    """A miner's ``status()`` as metric families (names and units in the README)."""
    labels = {"stage": st.get("stage")}
    yield from filter(None, [
        _gauge("iota_miner_inner_step", "inner optimizer steps taken", st.get("inner_step"), labels),
        _counter("iota_miner_tokens", "tokens processed (forward and backward)", st.get("tokens")),
        _counter("iota_miner_forwards", "forward passes computed", st.get("forwards")),
        _counter("iota_miner_backwards", "backward passes computed", st.get("backwards")),
        _gauge("iota_miner_uptime_seconds", "seconds since the miner process started", st.get("uptime_s")),
    ])
    cache = st.get("cache") or {}
    for fam in filter(None, [
            _gauge("iota_miner_activation_cache_bytes", "bytes held for pending backwards", cache.get("bytes")),
            _gauge("iota_miner_activation_cache_entries", "micro-batches held for pending backwards",
                   cache.get("entries"))]):
        yield fam
    ev = CounterMetricFamily("iota_miner_activation_evictions", "activation cache evictions, by reason (ttl | bytes)",
                             labels=["reason"])
    for reason, n in (cache.get("evictions") or {}).items():
        if _num(n) is not None:
            ev.add_metric([str(reason)], _num(n))
    yield ev
    m = st.get("merge")
    if isinstance(m, Mapping):
        yield from filter(None, [
            _counter("iota_miner_merges_applied", "replica merges applied", m.get("merges")),
            _counter("iota_miner_merges_abandoned", "replica merges abandoned", m.get("abandoned")),
            _gauge("iota_miner_merged_epoch", "latest merge epoch applied (-1: none)", m.get("merged_epoch")),
            _counter("iota_miner_merge_mismatch_reports", "merge results proven wrong by this replica as a third party",
                     m.get("mismatch_reports")),
            _gauge("iota_miner_in_sync", "1 when the replica holds the stage's latest merged weights",
                   1 if m.get("in_sync") else 0),
        ])
