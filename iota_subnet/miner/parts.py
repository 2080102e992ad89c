"""The parts a :class:`~iota_subnet.miner.service.MinerService` is built from, and their production defaults.

A miner's entry point may supply other parts (a :class:`MinerParts` passed to the service): each
field is a factory the service calls at start, and each default builds the production part. A
replacement takes the same arguments and returns an object with the same public interface, e.g. a
subclass of the production part (the entry points' emulated accelerators and the simulation's
cheaters are built that way).

``make_worker(service, stage) -> (worker, bound)``: the stage's compute (a
:class:`~iota_subnet.miner.stage_worker.StageWorker` or any object with its interface; one with
``has_weights`` False holds no weights: it is neither checkpointed with weights nor audited; one
whose ``merge_module`` is None is not merged) and how many micro-batches it can keep waiting for
their backward (None: no bound). Called from the running event loop once the service has its stage
and uid.

``make_merge_engine(me, cfg, params, transport, run_id=, stage=, options=)``: a
:class:`~iota_subnet.merge.engine.MergeEngine` (same arguments; ``params``: the
:class:`~iota_subnet.merge.params.ModuleParams` of the worker's ``merge_module``; ``options``: its
:class:`~iota_subnet.merge.engine.MergeEngineOptions`).

``make_hop_audit_routes(store, cfg, run_id=, stage=, device=)``: a
:class:`~iota_subnet.miner.hop_audit_routes.HopAuditRoutes` (same arguments; mounted on the server).

``make_update_audit_route(store, run_id, stage)``: the ``/audit/update`` handler, by default an
:class:`~iota_subnet.miner.update_store.UpdateAuditRoute`.

``make_dataplane_transport(wallet, endpoint_of, refresh, hop_timeout_s, alternates=)``: how the data
plane's hops, receipts and refusal reports travel, a
:class:`~iota_subnet.miner.dataplane.transport.HttpDataPlaneTransport` (same arguments).

``make_snapshot_donor(engine, run_id, stage, chunk_numel, max_concurrent)``: the donor that serves
the stage's merged state to joining replicas (``/state/chunk``), by default a
:class:`~iota_subnet.merge.sync.SnapshotDonor` (:func:`snapshot_donor`; ``engine``: the built merge
engine, whose ``cfg.sync_chunk_numel`` gives ``chunk_numel``; the simulation's virtual donor reads its
scale and uplink there).

``status``: fields added to the service's status (``status.json``), e.g. what the parts emulate.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from loguru import logger

from iota_subnet.config import RunConfig
from iota_subnet.merge import MergeEngine
from iota_subnet.merge.sync import SnapshotDonor
from iota_subnet.miner.activation_cache import ActivationCache
from iota_subnet.miner.dataplane.transport import HttpDataPlaneTransport
from iota_subnet.miner.hop_audit_routes import HopAuditRoutes
from iota_subnet.miner.stage_worker import StageWorker
from iota_subnet.miner.update_store import UpdateAuditRoute
from iota_subnet.plan import require_fit



def make_worker(cfg: RunConfig, stage: int, *, device: str, total_steps: Optional[int], audit_window: int = 0,
                worker_cls: type = StageWorker, **worker_kw: Any) -> tuple[StageWorker, Optional[int]]:
    """The stage's compute, a :class:`StageWorker`, and how many micro-batches it can keep waiting for
    their backward (the memory plan's bound on a GPU; None on the CPU). ``audit_window``: inner steps
    kept for update audits. ``worker_cls``: :class:`StageWorker` or a subclass, given ``worker_kw``
    besides. Raises :class:`~iota_subnet.config.ConfigError` (with the plan) when the stage does not
    fit the GPU."""
    bound, cache = None, None
    if torch.device(device).type == "cuda":     # refuse a stage that does not fit, with the plan
        props = torch.cuda.get_device_properties(torch.device(device))
        p = require_fit(cfg, stage, props.total_memory, device_name=props.name)
        bound = p.microbatches_in_flight_max
        cache = plan_cache(cfg, p)
        logger.info(f"stage {stage} fits {props.name}: {p.total_bytes / 2**30:.1f} of "
                    f"{props.total_memory / 2**30:.1f} GiB planned, up to {bound} micro-batches in flight")
    return worker_cls(cfg, stage, device=device, seed=cfg.train.seed, total_steps=total_steps, cache=cache,
                      audit_window=audit_window, **worker_kw), bound


def plan_cache(cfg: RunConfig, p: Any) -> ActivationCache:
    """The activation cache a GPU stage gets from its memory plan: the planned bound on what cached
    forwards may hold (measured by the cache itself) and on their number, instead of the config's
    CPU-sized defaults (512 MiB would hold two ``8b`` micro-batches of the 30+ a pipeline needs)."""
    t = cfg.train
    return ActivationCache(ttl_s=t.activation_cache_ttl_s,
                           max_bytes=max(p.activation_cache_bound_bytes, t.activation_cache_mib << 20),
                           max_entries=max(1, p.microbatches_in_flight_max))


def service_worker(svc: Any, stage: int) -> tuple[StageWorker, Optional[int]]:
    """The default ``make_worker``: :func:`make_worker` with the service's device, schedule and audit window."""
    return make_worker(svc.cfg, stage, device=svc.device, total_steps=svc.total_steps, audit_window=svc.audit_window,
                       audit_spill=svc.audit_spill())


def snapshot_donor(engine: Any, run_id: str, stage: int, chunk_numel: int, max_concurrent: int) -> SnapshotDonor:
    """The default ``make_snapshot_donor``: a :class:`SnapshotDonor` (``engine`` is not needed)."""
    del engine
    return SnapshotDonor(run_id, stage, chunk_numel, max_concurrent)


@dataclass
class MinerParts:
    """Factories of a miner's parts (see the module docstring); every default is the production part."""

    make_worker: Callable[[Any, int], tuple[Any, Optional[int]]] = service_worker
    make_merge_engine: Callable[..., MergeEngine] = MergeEngine
    make_hop_audit_routes: Callable[..., HopAuditRoutes] = HopAuditRoutes
    make_update_audit_route: Callable[[Any, str, int], Callable] = UpdateAuditRoute
    make_dataplane_transport: Callable[..., Any] = HttpDataPlaneTransport
    make_snapshot_donor: Callable[..., SnapshotDonor] = snapshot_donor
    status: dict[str, Any] = field(default_factory=dict)
