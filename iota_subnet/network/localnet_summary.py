"""A local network's results: ``OUT/metrics.jsonl`` and ``OUT/summary.json`` from its neurons' state.

:class:`RunSummary` is a part of :class:`~iota_subnet.network.localnet.LocalNet`: it reads the
validators' ``metrics.jsonl``, ``status.json`` and ``validator.sqlite``, the miners' ``status.json``
and the chain's metagraph once every neuron has stopped.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Optional

from iota_subnet.train.metrics import write_summary
from iota_subnet.utils.atomic import atomic_write_text


def audit_summary(statuses: list[dict]) -> dict:
    """The validators' audits (p2p): how many, how many failed, hop audits per miner per tempo (min and
    mean over the miners audited and the full tempos seen: the first and last are partial), flagged uids."""
    audits = failed = 0
    cpu = 0.0
    per: list[int] = []
    flagged: set[int] = set()
    for s in statuses:
        a = s.get("audits") or {}
        audits += int(a.get("audits", 0))
        failed += int(a.get("failed", 0))
        cpu += float(a.get("cpu_s", 0.0))
        tempos = sorted(a.get("per_tempo") or {}, key=int)
        miners = {hk for t in tempos for hk in a["per_tempo"][t]}
        for t in tempos[1:-1]:
            per += [int(a["per_tempo"][t].get(hk, 0)) for hk in miners]
        flagged |= {int(m["uid"]) for m in s.get("scores") or [] if (m.get("audits") or {}).get("flagged")}
    return {"audits": audits, "audits_failed": failed, "audits_per_miner_per_tempo_min": min(per) if per else None,
            "audits_per_miner_per_tempo_mean": sum(per) / len(per) if per else None, "flagged": sorted(flagged), "audit_cpu_s": round(cpu, 3)}


def wire_dtype_used(statuses: list[dict], asked: Optional[str]) -> Optional[str]:
    """The wire dtype (activations and gradients between miners) the validators report in their
    ``status.json`` (``wire_dtype``): the one they all report, several comma-joined (sorted) should they
    differ; ``asked`` (the localnet's ``--wire-dtype``, None for the validators' default) when none
    reports one (no status written)."""
    used = sorted({s["wire_dtype"] for s in statuses if s.get("wire_dtype")})
    return ",".join(used) if used else asked


class RunSummary:
    """The summary of :class:`~iota_subnet.network.localnet.LocalNet` (see the module docstring)."""

    def summarize(self, wall_s: float) -> dict:
        st = self.validator_status()
        B, T = self.cfg.train.batch_size, self.cfg.data.seq_len
        rows = []
        for c in self.children:
            if c.kind == "validator" and (c.out / "metrics.jsonl").exists():
                for line in (c.out / "metrics.jsonl").read_text().splitlines():
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        pass
        by_step: dict[int, list[dict]] = {}
        for r in rows:
            if r.get("loss") is not None:
                by_step.setdefault(int(r["step"]), []).append(r)
        n_lanes = max((len(v) for v in by_step.values()), default=0)
        metrics = []
        for k in sorted(by_step):
            rs = by_step[k]
            metrics.append({"step": k, "tokens": (k + 1) * B * T * n_lanes,
                            "loss": sum(r["loss"] for r in rs) / len(rs), "lr": rs[0].get("lr"),
                            "elapsed_s": max(r["elapsed_s"] for r in rs), "lanes": len(rs)})
        atomic_write_text(self.out / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in metrics))
        tokens = sum(s.get("tokens", 0) for s in st)
        train_s = max((s.get("train_s") or 0 for s in st), default=0) or None
        wire = sum(s.get("wire_bytes", 0) for s in st)
        validator_bytes = sum(s.get("validator_bytes", 0) for s in st)
        last = metrics[-10:]
        chain_rows = {r["uid"]: r for r in self.metagraph()}
        miners = []
        work: dict[int, dict] = {}
        for s in st:
            for u, m in (s.get("miners") or {}).items():
                w = work.setdefault(int(u), {"work": 0.0, "hotkey": m.get("hotkey"), "stage": m.get("stage")})
                w["work"] += float(m.get("work", 0))
        miner_bytes, busy, uptime = 0, [], []
        for c in self.children:
            if c.kind != "miner":
                continue
            try:
                ms = json.loads((c.out / "status.json").read_text())
            except (OSError, ValueError):
                ms = {}
            dp = ms.get("dataplane") or {}
            hop = dp.get("hop_client") or {}
            miner_bytes += int(hop.get("bytes_sent", 0)) + int(hop.get("header_bytes_sent", 0)) \
                + int(hop.get("bytes_received", 0)) + int(hop.get("header_bytes_received", 0))
            if ms.get("uptime_s"):
                busy.append(float(dp.get("busy_s", 0.0)))
                uptime.append(float(ms["uptime_s"]))
            uid = ms.get("uid")
            ch = chain_rows.get(uid, {})
            miners.append({"name": c.name, "uid": uid, "hotkey": ms.get("hotkey"), "stage": c.stage,
                           "work": work.get(uid, {}).get("work", 0.0), "inner_step": ms.get("inner_step"),
                           "incentive": ch.get("incentive", 0.0), "emission": ch.get("emission", 0.0),
                           "restarts": c.restarts, "merge": ms.get("merge"),
                           # mean over validators of the latest weight each set for this uid
                           "weight": (sum(float((v.get("last_weights") or {}).get(str(uid), 0.0)) for v in st)
                                      / len(st)) if st else 0.0,
                           "adversary": ms.get("adversary"),
                           # a home miner: the relays it is reached through and the one it last used
                           "relay": ms.get("relay")})
        vals = [{"name": c.name, "uid": s.get("uid"), "hotkey": s.get("hotkey"),
                 "relay": s.get("relay"),
                 "dividends": chain_rows.get(s.get("uid"), {}).get("dividends", 0.0),
                 "weights_set_blocks": s.get("weights_set_blocks", []), "val_loss": s.get("val_loss")}
                for c, s in zip([c for c in self.children if c.kind == "validator"], st)]
        val_losses = [s["val_loss"] for s in st if s.get("val_loss") is not None]
        relays = [{"name": c.name, **c.status()} for c in self.children if c.kind == "relay"]
        summary = {
            "stages": self.stages, "replicas": self.replicas, "validators": self.n_validators, "steps": self.steps,
            "ended": self.ended, "steps_done": self._steps_done(st),
            "tokens": tokens, "tokens_per_s": tokens / train_s if train_s else None,
            "final_loss": sum(m["loss"] for m in last) / len(last) if last else None, "final_loss_window": 10,
            "val_loss": sum(val_losses) / len(val_losses) if val_losses else None,
            "wire_bytes": wire, "wire_bytes_per_token": wire / tokens if tokens else None,
            "validator_bytes": validator_bytes,
            "validator_bytes_per_token": validator_bytes / tokens if tokens else None,
            "miner_bytes": miner_bytes, "miner_bytes_per_token": miner_bytes / tokens if tokens else None,
            # mean over miners of compute-busy seconds / seconds of the run (status uptime)
            "stage_utilisation": (sum(b / max(train_s or u, 1e-9) for b, u in zip(busy, uptime)) / len(busy))
            if busy else None,
            "verification_bytes": sum(s.get("verification_bytes", 0) for s in st),
            "verification_bytes_by_path": dict(sum((Counter(s.get("verification_bytes_by_path") or {}) for s in st),
                                                   Counter())),
            "audits": audit_summary(st),
            "reroutes": sum(s.get("reroutes", 0) for s in st), "failures": sum(s.get("failures", 0) for s in st),
            "compression_ratio": self.cfg.pipeline.compression_ratio, "lanes": n_lanes,
            "wire_dtype": wire_dtype_used(st, self.wire_dtype),
            "miner_restarts": sum(c.restarts for c in self.children), "wall_s": round(wall_s, 1),
            "train_s": train_s,
            "merge": {"every_steps": self.cfg.merge.every_steps, "every_blocks": self.cfg.merge.every_blocks,
                      "merges_applied": sum((m.get("merge") or {}).get("merges", 0) for m in miners),
                      "mismatch_reports": sum((m.get("merge") or {}).get("mismatch_reports", 0) for m in miners)},
            "adversary": self.adversary, "adversary_uids": self.adversary_uids(),
            "link": self.link, "links": self.links, "relay_rate": self.relay_rate, "emulation": self.emulation,
            "block_time_s": {"wall": self.block_time, "emulated": self.block_time_emulated}, "tempo": self.tempo,
            "miners": miners, "validators_detail": vals, "relays": relays, "chain_db": str(self.chain_db),
        }
        if self.join_at is not None:
            summary["joiner"] = self.join_at.report()
        if self.chaos is not None:
            summary["chaos"] = {**self.chaos.log.summary(), **self._sample_accounting()}
        write_summary(self.out / "summary.json", summary)
        return summary

    def _sample_accounting(self) -> dict:
        """From the validators' state: micro-batches lost, and samples (rows of ``(lane, step, index)``)
        trained more than once or never, over the steps driven (each lane's ``steps_done``; the whole
        ``--steps`` when the run finished). ``samples_unconfirmed``: samples counted trained on the
        head's word (its inner step was past them when a restarted validator resumed: trained with that
        validator's earlier tickets, whose receipts were lost), not by receipts."""
        from iota_subnet.validator.state import ValidatorState
        seen: dict[tuple, int] = {}
        lost = unconfirmed = 0
        for c in self.children:
            if c.kind != "validator" or not (c.out / "validator.sqlite").exists():
                continue
            st = ValidatorState(c.out / "validator.sqlite")
            try:
                for row in st.microbatch_log():
                    key = (row["lane"], row["step"], row["idx"])
                    if row["ok"]:
                        seen[key] = seen.get(key, 0) + 1
                        unconfirmed += not row["microbatch_id"]      # no ticket of its own: no receipts
                    else:
                        lost += 1
            finally:
                st.close()
        lanes = {k[0] for k in seen} or set(range(self.replicas))
        micro = self.cfg.train.batch_size // self.cfg.train.micro_batch
        # the steps each lane was driven through (all of them, unless the run was stopped early)
        driven: dict[int, int] = {}
        for st in self.validator_status():
            for lane, n in (st.get("steps_done") or {}).items():
                driven[int(lane)] = driven.get(int(lane), 0) + int(n)
        expected = {(l, k, m) for l in lanes for k in range(min(self.steps, driven.get(l, self.steps)))
                    for m in range(micro)}
        return {"microbatches_lost": lost,
                "samples_repeated": sum(n - 1 for n in seen.values() if n > 1) * self.cfg.train.micro_batch,
                "samples_skipped": len(expected - set(seen)) * self.cfg.train.micro_batch,
                "samples_unconfirmed": unconfirmed * self.cfg.train.micro_batch}
