"""The merge at N replicas in one process: bytes per replica, split into dense tensor bytes and metadata.

:func:`run_scale` builds ``n`` replicas of a one-tensor stage (``numel`` float32 values, the same
seeded init everywhere, each moved by its own random perturbation as local inner steps would),
each a :class:`~iota_subnet.merge.engine.MergeEngine` with signed claims
(:class:`~iota_subnet.merge.claims.MergeClaims`, an sr25519 hotkey per replica), and merges them
once over :class:`~iota_subnet.merge.transport.InProcessTransport`: every message goes through the
wire codec, so the counts are the exact bodies HTTP would carry (HTTP headers excluded). Used by
``tests/test_merge_scale.py`` and ``scripts/bench_merge_scale.py``.

``kill``/``kill_at``: replicas that die after the join, mid-scatter (``"scatter"``: after half of
their contributions went out) or as reducers once their whole scatter is acknowledged
(``"reducer"``: they never serve a result); :func:`death_cost` compares such a run with one where
nobody dies.
"""
from __future__ import annotations

import asyncio
import resource
import time
from typing import Any

import torch

from iota_subnet.config import MergeConfig
from iota_subnet.merge import MergeEngine, MergeEngineOptions, ModuleParams
from iota_subnet.merge.claims import MergeClaims
from iota_subnet.merge.deadlines import bytes_per_value
from iota_subnet.merge.outer import outer_step, weighted_mean
from iota_subnet.merge.transport import InProcessTransport
from iota_subnet.protocol import tensor_sha256


class _Stage(torch.nn.Module):
    def __init__(self, init: torch.Tensor):
        super().__init__()
        self.w = torch.nn.Parameter(init.clone())


def keypairs(n: int) -> list[Any]:
    """``n`` sr25519 hotkeys (derived from ``//replica<i>``)."""
    from bittensor.sp_core import Keypair
    return [Keypair.create_from_uri(f"//replica{i}") for i in range(n)]


def victims(n: int, kill: int) -> list[int]:
    """Indices of the ``kill`` replicas (of ``n``) that die: spread evenly."""
    return sorted({i * n // kill for i in range(kill)}) if kill > 0 else []


def _dying(net: InProcessTransport, e: MergeEngine, kill_at: str) -> None:
    """Make replica ``e`` die after the join: ``scatter``: once half of its contributions went out;
    ``reducer``: once every contribution of its scatter is acknowledged, before it serves a result."""
    if kill_at == "scatter":
        view, sent = net.view(e.me), [0]
        call = view.call

        async def call_then_die(peer, route, msg, rtype):
            if route == "/merge/contribute":
                sent[0] += 1
                if sent[0] > max(1, len(net.handlers) - 1):     # half of its 2 (N - 1) streams went out
                    net.kill(e.me)
            return await call(peer, route, msg, rtype)
        view.call = call_then_die
    elif kill_at == "reducer":
        async def reduce_then_die(sess, s):
            plan = sess.plan
            streams = [(r, t) for t in range(plan.num_shards) for r in set(plan.reducers[t]) if r != e.me]
            while any(sess.acked.get(k, -1) < len(plan.chunks(k[1])) for k in streams):
                await asyncio.sleep(0.01)
            net.kill(e.me)          # its shards are never served
        e._reduce = reduce_then_die
    else:
        raise ValueError(f"kill_at must be 'scatter' or 'reducer', not {kill_at!r}")


def run_scale(n: int, numel: int = 1 << 18, *, quant: str = "none", run_id: str = "scale", stage: int = 1,
              timeout_s: float = 3600.0, kill: int = 0, kill_at: str = "scatter",
              progress_timeout_s: float | None = None) -> dict[str, Any]:
    """Merge ``n`` replicas of a stage of ``numel`` values once. Returns the per-replica means and
    maxima of the bytes sent and received (``dense``: tensor bytes; ``meta``: the rest), the stage's
    bytes in the payload dtype (``stage_bytes``), ``wall_s`` (the merge only), ``peak_rss_mib``
    (the process's, so far), ``merged`` (every replica applied) and ``identical`` (every replica
    holds the same weights after it); ``per_replica`` (hotkey -> its byte counts);
    ``meta_per_peer_by_type`` / ``messages_per_peer_by_type`` (message type -> metadata bytes and
    bodies, over every replica, divided by ``n`` squared: per replica per peer, each direction).

    ``kill`` replicas (:func:`victims`) die after the join (``kill_at``, see the module docstring;
    ``progress_timeout_s``: how long a reducer waits for a dead contributor's chunks, default
    ``timeout_s``). Then ``merged``/``identical`` speak of the survivors, and the result also says
    ``dead`` (hotkeys), ``attempts`` (the survivors' most), ``contributor_sets`` (the distinct
    contributor lists of the applied plan's shards, over every survivor's signed results: 1 when
    every shard used the same), ``shards`` (shards of the applied plan with a signed result) and
    ``max_ref_err`` (the survivors' largest distance to a single-process reference: the weighted
    mean over the applied plan's contributors of their pseudo-gradients, as sent, then the outer step)."""
    pt = timeout_s if progress_timeout_s is None else progress_timeout_s
    mc = MergeConfig(every_steps=1, quantization=quant, join_timeout_s=timeout_s, phase_timeout_s=timeout_s,
                     progress_timeout_s=pt)
    net = InProcessTransport(timeout_s=timeout_s)
    g = torch.Generator().manual_seed(0)
    init = torch.randn(numel, generator=g)
    engines, mods = [], []
    for i, kp in enumerate(keypairs(n)):
        m = _Stage(init)
        with torch.no_grad():
            m.w.add_(torch.randn(numel, generator=torch.Generator().manual_seed(1 + i)) * 1e-3)
        hk = kp.ss58_address
        e = MergeEngine(hk, mc, ModuleParams(m), net.view(hk), run_id=run_id, stage=stage,
                        options=MergeEngineOptions(observer=MergeClaims(kp, run_id, stage)))
        e.anchor = init.clone()
        net.register(hk, e.handle)
        engines.append(e)
        mods.append(m)
    anchor = init
    dead = victims(n, kill)
    for i in dead:
        _dying(net, engines[i], kill_at)
    live = [i for i in range(n) if i not in dead]
    deltas = {engines[i].me: anchor - mods[i].w.detach().clone() for i in live}

    async def merge_all():
        peers = [e.me for e in engines]
        tasks = [asyncio.ensure_future(e.merge(0, peers)) for e in engines]
        out = await asyncio.gather(*(tasks[i] for i in live))
        for i in dead:                   # a dead replica's own merge: nothing to wait for
            tasks[i].cancel()
        await asyncio.gather(*(tasks[i] for i in dead), return_exceptions=True)
        return out
    t0 = time.perf_counter()
    reps = asyncio.run(merge_all())
    wall = time.perf_counter() - t0
    surv = [engines[i] for i in live]
    counts = [net.counts(e.me) for e in surv]
    n_live = len(surv)
    out: dict[str, Any] = {"replicas": n, "numel": numel, "quant": quant,
                           "stage_bytes": round(numel * bytes_per_value(mc.scatter_quant, mc.int8_block))}
    for k in ("sent_dense", "received_dense", "sent_meta", "received_meta"):
        out[k] = round(sum(c[k] for c in counts) / n_live)
        out["max_" + k] = max(c[k] for c in counts)
    out["dense_x_stage"] = round(max(out["max_sent_dense"], out["max_received_dense"]) / out["stage_bytes"], 4)
    out["meta_per_replica_per_n"] = round(max(out["max_sent_meta"], out["max_received_meta"]) / n_live, 1)
    out["max_message_bytes"] = net.max_body
    # per message type: metadata bytes per replica per peer (each direction: every body is sent once and
    # received once) and bodies per replica per peer
    out["meta_per_peer_by_type"] = {t: round(b / (n * n), 1) for t, b in sorted(net.meta_by_type.items())}
    out["messages_per_peer_by_type"] = {t: round(c / (n * n), 3) for t, c in sorted(net.count_by_type.items())}
    out["wall_s"] = round(wall, 2)
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    out["merged"] = all(r.applied for r in reps)
    out["identical"] = len({tensor_sha256(mods[i].w.detach()) for i in live}) == 1
    out["status"] = sorted({(r.status, r.reason) for r in reps})[:3]
    out["per_replica"] = {e.me: c for e, c in zip(surv, counts)}
    if kill:
        out["dead"] = [engines[i].me for i in dead]
        out["attempts"] = max(r.attempts for r in reps)
        final = {(k[1], k[2]) for e in surv for k in e.observer.means if k[1] == out["attempts"] - 1}
        sets, shards = set(), set()
        for e in surv:
            for k, kept in e.observer.means.items():
                if (k[1], k[2]) in final:
                    sets.add(tuple(kept.records["contributors"]))
                    shards.add((k[2], k[3]))
        out["contributor_sets"], out["shards"] = len(sets), len(shards)
        if len(sets) == 1 and reps[0].applied:
            parts = list(next(iter(sets)))
            w = reps[0].weights
            mean = weighted_mean([(w[p], deltas[p]) for p in parts])
            ref, _ = outer_step(anchor, torch.zeros_like(anchor), mean, lr=mc.outer_lr, mu=mc.outer_momentum,
                                nesterov=mc.nesterov)
            out["max_ref_err"] = max(float((mods[i].w.detach() - ref).abs().max()) for i in live)
    return out


def death_cost(n: int, numel: int = 1 << 18, *, kill: int = 1, kill_at: str = "scatter",
               progress_timeout_s: float = 10.0, **kw: Any) -> dict[str, Any]:
    """:func:`run_scale` with ``kill`` replicas dying (``kill_at``) against the same run where nobody
    dies. ``survivors_extra_dense``: the relative excess of the survivors' dense bytes (tensor bytes
    sent plus received, summed over them) over the same replicas' bytes in the run without deaths;
    ``extra_dense`` / ``mean_extra_dense``: the largest and the mean of that ratio per survivor (the
    largest is a replacement reducer's: reducing a shard costs about P / N times N bytes received);
    ``*_total`` the same for whole bodies (metadata included: a second join, result headers and
    signed claims per peer)."""
    base = run_scale(n, numel, **kw)
    died = run_scale(n, numel, kill=kill, kill_at=kill_at, progress_timeout_s=progress_timeout_s, **kw)
    ex_d, ex_t, tot = [], [], [0, 0, 0, 0]
    for hk, c in died["per_replica"].items():
        b = base["per_replica"][hk]
        tot[0] += c["sent_dense"] + c["received_dense"]
        tot[1] += b["sent_dense"] + b["received_dense"]
        tot[2] += c["sent"] + c["received"]
        tot[3] += b["sent"] + b["received"]
        b = base["per_replica"][hk]
        ex_d.append((c["sent_dense"] + c["received_dense"]) / (b["sent_dense"] + b["received_dense"]) - 1)
        ex_t.append((c["sent"] + c["received"]) / (b["sent"] + b["received"]) - 1)
    return {"base": {k: v for k, v in base.items() if k != "per_replica"},
            "died": {k: v for k, v in died.items() if k != "per_replica"},
            "survivors_extra_dense": round(tot[0] / tot[1] - 1, 4), "survivors_extra_total": round(tot[2] / tot[3] - 1, 4),
            "extra_dense": round(max(ex_d), 4), "mean_extra_dense": round(sum(ex_d) / len(ex_d), 4),
            "extra_total": round(max(ex_t), 4), "mean_extra_total": round(sum(ex_t) / len(ex_t), 4)}
