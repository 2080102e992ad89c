"""The merge at N replicas in one process: bytes per replica, split into dense tensor bytes and metadata.

:func:`run_scale` builds ``n`` replicas of a one-tensor stage (``numel`` float32 values, the same
seeded init everywhere, each moved by its own random perturbation as local inner steps would),
each a :class:`~iota_subnet.merge.engine.MergeEngine` with signed claims
(:class:`~iota_subnet.merge.claims.MergeClaims`, an sr25519 hotkey per replica), and merges them
once over :class:`~iota_subnet.merge.transport.InProcessTransport`: every message goes through the
wire codec, so the counts are the exact bodies HTTP would carry (HTTP headers excluded). Used by
``tests/test_merge_scale.py`` and ``scripts/bench_merge_scale.py``.
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


def run_scale(n: int, numel: int = 1 << 18, *, quant: str = "none", run_id: str = "scale", stage: int = 1,
              timeout_s: float = 3600.0) -> dict[str, Any]:
    """Merge ``n`` replicas of a stage of ``numel`` values once. Returns the per-replica means and
    maxima of the bytes sent and received (``dense``: tensor bytes; ``meta``: the rest), the stage's
    bytes in the payload dtype (``stage_bytes``), ``wall_s`` (the merge only), ``peak_rss_mib``
    (the process's, so far), ``merged`` (every replica applied) and ``identical`` (every replica
    holds the same weights after it)."""
    mc = MergeConfig(every_steps=1, quantization=quant, join_timeout_s=timeout_s, phase_timeout_s=timeout_s,
                     progress_timeout_s=timeout_s)
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
    del init

    async def merge_all():
        peers = [e.me for e in engines]
        return await asyncio.gather(*(e.merge(0, peers) for e in engines))
    t0 = time.perf_counter()
    reps = asyncio.run(merge_all())
    wall = time.perf_counter() - t0
    counts = [net.counts(e.me) for e in engines]
    out: dict[str, Any] = {"replicas": n, "numel": numel, "quant": quant,
                           "stage_bytes": numel * {"none": 4, "bf16": 2, "int8": 1}[quant]}
    for k in ("sent_dense", "received_dense", "sent_meta", "received_meta"):
        out[k] = round(sum(c[k] for c in counts) / n)
        out["max_" + k] = max(c[k] for c in counts)
    out["dense_x_stage"] = round(max(out["max_sent_dense"], out["max_received_dense"]) / out["stage_bytes"], 4)
    out["meta_per_replica_per_n"] = round(max(out["max_sent_meta"], out["max_received_meta"]) / n, 1)
    out["max_message_bytes"] = net.max_body
    out["wall_s"] = round(wall, 2)
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    out["merged"] = all(r.applied for r in reps)
    out["identical"] = len({tensor_sha256(m.w.detach()) for m in mods}) == 1
    out["status"] = sorted({(r.status, r.reason) for r in reps})[:3]
    return out
