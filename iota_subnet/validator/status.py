"""``status.json`` of the validator: a snapshot of every part (fields listed in
:mod:`iota_subnet.validator.service`), rewritten atomically every ``status_interval_s``."""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from iota_subnet.transport.paths import path_book
from iota_subnet.utils.atomic import atomic_write_json


class StatusFile:
    """The validator's status (:meth:`snapshot`) and ``path``, the ``status.json`` it is written to."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, svc: Any) -> None:
        atomic_write_json(self.path, self.snapshot(svc))

    @staticmethod
    def snapshot(svc: Any) -> dict:
        """The status of validator ``svc`` (JSON-ready)."""
        p, d, r, v = svc.progress, svc.driver, svc.router, svc.verify_client
        tokens = sum(p.lane_tokens.values())
        el = time.time() - p.started
        losses = [l for l in p.lane_loss.values() if l is not None and math.isfinite(l)]
        server, dashboard = svc.endpoints.server, svc.endpoints.dashboard
        return {
            "hotkey": svc.hotkey, "uid": svc.uid, "run_id": svc.opts.run.run_id,
            "run_epoch": svc.opts.run.run_epoch, "netuid": svc.opts.chain.netuid,
            "peers": svc.view.peers.summary(), "validators": list(svc.view.validators),
            # the run's spec hash (served on GET /run/spec); this run's miners advertising another one (not routed)
            "spec_hash": svc.spec_hash, "miners_other_spec": dict(svc.view.other_spec_miners),
            "chain": svc.publisher.status() if svc.publisher else {},
            "fingerprints": vars(svc.fingerprints) if svc.fingerprints else None,
            "lanes": svc.n_lanes,
            "lane_members": [[m.uid if m is not None else None for m in lane] for lane in r.lanes()] if r else [],
            "steps_done": {str(k): n for k, n in sorted(p.steps_done.items())},
            "next_step": {str(k): n for k, n in sorted(p.next_steps.items())},
            "total_steps": svc.opts.run.steps, "validator_index": svc.validator_index,
            # the dtype of the activations and gradients its tickets ask miners to send (--wire-dtype)
            "wire_dtype": svc.opts.tickets.wire_dtype,
            "n_validators": svc.n_validators, "tokens": tokens,
            "tokens_per_s": (tokens - p.tokens_at_start) / el if el > 0 else 0.0,
            "loss": sum(losses) / len(losses) if losses else None,
            "losses": {str(k): l for k, l in sorted(p.lane_loss.items())},
            "reroutes": d.reroutes if d else 0, "failures": d.failures if d else 0,
            # seconds each lane was held at a merge window's last step for the slowest lane (pacing)
            "lane_held_s": {str(k): round(s, 1) for k, s in sorted(d.pacer.held_s.items())} if d else {},
            "microbatches_ok": d.microbatches_ok if d else 0, "microbatches_failed": d.microbatches_failed if d else 0,
            "live_miners": sum(1 for m in r.live_replicas() if r.is_available(m)) if r else 0,
            "stage_replicas": r.stage_counts() if r else [],
            "replicas": r.snapshot() if r else [],
            # miners flagged as cheaters, out of routing for good ([uid, hotkey])
            "barred": sorted(list(k) for k in r.barred) if r else [],
            "blame": d.blame.status() if getattr(d, "blame", None) is not None else {},
            # the miners this validator relays for (relay_host), their requests and bytes
            "relay": svc.endpoints.relay.status() if svc.endpoints.relay is not None else None,
            # miner hotkey -> the relays it is reached through (its commitment)
            "relayed": {hk: list(rl) for hk, rl in svc.view.relays.items()},
            "probe_loss": svc.scores.last_probe, "dashboard": dashboard.url if dashboard else None,
            "val_loss": p.val_loss, "done": p.done, "weights_set_blocks": list(svc.weights.weights_blocks),
            "last_weights": {str(k): w for k, w in svc.weights.last_weights.items()},
            "miners": {str(m.uid): {"hotkey": m.hotkey, "stage": m.stage, "work": m.work, "tokens": m.tokens,
                                    "completed": m.completed, "failures": m.failures, "reroutes": m.reroutes}
                       for m in svc.ledger.records.values() if svc.current.get(m.uid) == m.hotkey}
            if svc.ledger is not None else {},
            "done_block": p.done_block, "train_s": p.train_s,
            "scores": svc.scores.explained.get("miners", []),
            "wire_bytes": (svc.client.bytes_sent + svc.client.bytes_received) if svc.client else 0,
            # every byte this validator sent or received on the training path (tickets, receipts, health
            # probes), HTTP headers included
            "validator_bytes": (svc.client.total_bytes if svc.client else 0)
            + (server.route_bytes.get("/receipts", 0) if server else 0),
            # every byte of verification (audits, merge evidence), HTTP headers included
            "verification_bytes": v.total_bytes if v is not None else 0,
            "verification_bytes_by_path": dict(v.bytes_by_path) if v is not None else {},
            "audits": svc.auditing.status() | {"per_tempo": {str(k): n for k, n in svc.auditing.per_tempo().items()}}
            if svc.auditing is not None else None,
            # per peer hotkey that exchanged traffic with this validator: direct or relayed (and via
            # which relay), calls made ("out") and served ("in") (iota_subnet.transport.paths)
            "paths": path_book().snapshot(svc.hotkey),
            "elapsed_s": round(svc.elapsed_s(), 3), "updated_at": time.time(), "tasks": svc.sup.status(),
        }
