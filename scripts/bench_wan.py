#!/usr/bin/env python
"""WAN bench (issue 9 item 6): the network over emulated links, real `tiny` training and emulated GPUs.

Each row runs ``iota-subnet localnet`` (every neuron its own process) with ``--link`` and, for the
emulated rows, ``--emulate-gpu``, then reads its ``summary.json``, the miners' ``status.json`` and
``metrics.jsonl``, and prints one JSON object per row (``--json``):

* ``tokens_per_s``: trained tokens per second after the pipeline has filled (lane steps after the
  first, from ``metrics.jsonl``; the summary's whole-run figure is ``tokens_per_s_run``). Emulated rows
  report emulated time (wall-clock rate x ``time_scale``).
* ``ideal_tokens_per_s``: replicas x the token rate of the slowest stage on the row's hardware with no
  network and no bubble (:func:`iota_subnet.plan.ideal_tokens_per_s`: FLOPs at peak x MFU,
  recomputation included, the optimizer step spread over the inner step's tokens). For the real
  `tiny` rows the hardware is this CPU: each stage's forward + backward timed alone on one thread.
* ``stage_utilisation``: the summary's, else the mean over miners of busy compute seconds
  (``busy_s`` in their status) / the validators' training seconds.
* ``validator_bytes_per_token``, ``miner_bytes_per_token``, ``verification_bytes_per_token``,
  ``final_loss`` (train rows), ``val_loss``: from the summary when it has them; None otherwise. A
  summary of the data plane before issue 9 (every tensor relayed by the validator) has only
  ``wire_bytes_per_token``: then that is the validator's figure and miners exchange 0 bytes.
* ``wire_dtype``: of the activations and gradients between miners, as the validators report it
  (the summary's ``wire_dtype``), else the row's, which the localnet is given (``--wire-dtype``; bf16
  unless the bench's ``--wire-dtype`` says otherwise).
* ``host_cpu_busy``: share of this machine's CPU time (all cores, all users: /proc/stat) not idle
  while the row trained; ``own_cpu_busy``: the row's own processes only (rusage of the localnet).
  An emulated row must stay <= 0.5 (else it measures the host, not the design): raise ``--time-scale``.

* ``link``, ``validator_link``, ``home_replicas``, ``relay_rate_bytes_per_s``: every miner's link, the
  validators' (``--validator-link``; the relay's in the ``-home`` rows, where the validator hosts it), the
  home miners per stage and the relay's per-peer cap (``--relay-rate``, emulated bytes per second; None:
  no cap).

* emulated rows, MODELLED (virtual payloads, :mod:`iota_subnet.sim.emulated_costs`; from the miners'
  ``status.json`` ``modelled``): ``update_store_host_bytes_max`` (max over miners of the most host
  bytes the modelled update store held: one step's copies + trees; the first step's ``28 P`` included),
  ``update_store_plan_host_bytes`` (max over miners of the host plan's bound at their audit window),
  ``update_store_d2h_bytes_per_step`` (max over miners of the last step's device -> host bytes),
  ``update_store_settle_wait_s`` (max over miners, emulated seconds the compute thread waited for the
  previous step's hashing and spill), ``checkpoint_writes`` / ``checkpoint_bytes`` (sums over miners),
  ``checkpoint_write_s`` (max over miners, emulated seconds of modelled writes); ``block_time_s``: the
  devnet's seconds per block, ``{"wall", "emulated"}`` (wall = emulated x ``time_scale``).

Every emulated row says ``"mode": "emulated"`` and carries an ``emulation`` note. Usage::

    python scripts/bench_wan.py --list                      # the rows and their ideal figures, no runs
    python scripts/bench_wan.py --json                      # every row (hours on 2 cores)
    python scripts/bench_wan.py --json --rows tiny-train-loopback,8b-a100-r64-100mbit:50ms
    python scripts/bench_wan.py --json --rows tiny-train-loopback --wire-dtype fp8
    python scripts/bench_wan.py --json --rows "1b-4090-r64-20mbit:100ms,1b-4090-r64-20mbit:100ms-home" \
        --validator-link 1gbit:10ms                         # Train at Home: the relay on a data-centre link
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from iota_subnet.config import ConfigError, RunConfig, load_config  # noqa: E402
from iota_subnet.hardware import DEFAULT_MFU, parse_accelerator  # noqa: E402
from iota_subnet.network.cli import parse_sets  # noqa: E402
from iota_subnet.protocol.ticket import WIRE_DTYPES  # noqa: E402
from iota_subnet.transport.shaping import LINK_PROFILES, parse_link  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2" / "wiki.valid.raw.txt"
EMULATION_NOTE = ("EMULATION: no weights, nothing learns; compute sleeps FLOPs / (peak x MFU); tensors on the wire "
                  "have the emulated shapes and dtype; links emulated per neuron uplink")


@dataclass(frozen=True)
class Row:
    """One bench row. ``overrides``: ``--set`` values; ``gpu``: None for real training."""

    name: str
    mode: str                     # "train" | "emulated"
    config: str
    stages: int
    replicas: int
    compression_ratio: int
    wire_dtype: str
    link: str
    steps: int
    gpu: Optional[str] = None
    mfu: float = DEFAULT_MFU
    time_scale: float = 1.0
    rows_per_microbatch: int = 1
    overrides: dict = field(default_factory=dict)
    #: the last N replicas of every stage are home miners, reached only through the validator's relay
    home_replicas: int = 0
    #: the validators' link (so the relay's, with home miners; ``localnet --validator-link``); None: ``link``
    validator_link: Optional[str] = None
    #: per relayed miner, emulated bytes per second (``localnet --relay-rate``); None: no per-peer cap
    relay_rate: Optional[float] = None
    #: ``STEP[:STAGE]``: a fresh miner joins when the lanes reach lane step STEP (``localnet --join-at``)
    join_at: Optional[str] = None

    def run_config(self) -> RunConfig:
        ovr = {k: dict(v) for k, v in self.overrides.items()}
        ovr.setdefault("pipeline", {}).update(stages=self.stages, compression_ratio=self.compression_ratio)
        return load_config(REPO / self.config, ovr)


def _emulated(model: str, gpu: str, stages: int, replicas: int, ratio: int, link: str, *, steps: int = 4,
              time_scale: float = 2.0) -> Row:
    # The named hub tokenizer is not reachable offline and does not matter when nothing learns:
    # emulated rows use a BPE trained on the corpus (ids stay < 128,256).
    return Row(f"{model}-{gpu}-r{ratio}-{link}", "emulated", f"configs/{model}.yaml", stages, replicas, ratio, "bf16",
               link, steps, gpu=gpu, time_scale=time_scale, rows_per_microbatch=1,
               overrides={"data": {"tokenizer": None}, "train": {"total_steps": steps}})


def _with_merges(row: Row, every_steps: int, *, steps: int, time_scale: float) -> Row:
    """``row`` with its replicas merging every ``every_steps`` inner steps while they train
    (``merge.overlap``; the config's merge quantization, int8 for ``8b`` / ``100b``) and a fresh stage-0
    replica joining at lane step 3 (state sync from its peers): emulated stages merge and sync a VIRTUAL
    payload of their real size (:mod:`iota_subnet.sim.virtual_merge`, :mod:`iota_subnet.sim.virtual_sync`)."""
    ovr = {k: dict(v) for k, v in row.overrides.items()}
    ovr.setdefault("merge", {}).update(every_steps=every_steps, overlap=True)
    ovr.setdefault("train", {})["total_steps"] = steps
    return dataclasses.replace(row, name=f"{row.name}-merge{every_steps}", steps=steps, time_scale=time_scale,
                               overrides=ovr, join_at="3:0")


def rows() -> list[Row]:
    """The rows issue 9 asks for, in order, then the whole-system rows (merges inside the window)."""
    out = [Row(f"tiny-train-{link}", "train", "configs/tiny_merge.yaml", 3, 2, 8, "bf16", link, 150,
               rows_per_microbatch=4) for link in ("loopback", "100mbit:50ms")]
    out += [_emulated("8b", "a100", 8, 2, 64, link) for link in LINK_PROFILES]
    out += [_emulated("8b", "a100", 8, 2, 8, link) for link in LINK_PROFILES]
    out.append(_emulated("1b", "4090", 4, 4, 64, "100mbit:50ms"))
    # Train at Home: consumer GPUs on home uplinks, public miners beside the same row with half the
    # replicas of every stage behind NATs (reached through the validator's relay, no per-peer cap)
    home = _emulated("1b", "4090", 4, 2, 64, "20mbit:100ms")
    out += [home, dataclasses.replace(home, name=home.name + "-home", home_replicas=1)]
    # the whole system at size: merges every H = 10 lane steps inside 31 steps (3 merges per stage)
    out.append(_with_merges(_emulated("8b", "a100", 8, 2, 64, "100mbit:50ms"), 10, steps=31, time_scale=6.0))
    # MFU 0.47: with the 100b shape's bubble and hops, the MFU Orion reports (30.8 % at 65 % of ideal)
    out.append(_with_merges(dataclasses.replace(_emulated("100b", "h200", 16, 2, 144, "1gbit:10ms"), mfu=0.47), 10,
                            steps=31, time_scale=6.0))
    return out


# ------------------------------------------------------------------------------------ ideal
def ideal_tokens_per_s(row: Row, cpu_stage_s_per_token: Optional[list[float]] = None) -> Optional[float]:
    """Replicas x the token rate of the slowest stage (see the module docstring). Emulated rows: the
    plan's timings on the emulated GPU. Train rows: ``cpu_stage_s_per_token`` (measured seconds per
    token of each stage on this CPU; None when not measured)."""
    from iota_subnet.plan import ideal_tokens_per_s as ideal, stage_timings
    cfg = row.run_config()
    if row.mode == "emulated":
        acc = parse_accelerator(row.gpu)
        return ideal(stage_timings(cfg, acc, row.mfu), row.replicas, cfg.train.batch_size * cfg.data.seq_len)
    if cpu_stage_s_per_token is None:
        return None
    return row.replicas / max(cpu_stage_s_per_token)


def cpu_stage_seconds_per_token(cfg: RunConfig, reps: int = 3) -> list[float]:
    """Seconds per trained token of each stage alone on one CPU thread (forward + backward + its share
    of the inner step), median of ``reps`` micro-batches after a warm-up."""
    import statistics

    import torch

    from iota_subnet.miner.stage_worker import StageWorker
    from iota_subnet.model import bottleneck_dims
    torch.set_num_threads(1)
    B, T = cfg.train.micro_batch, cfg.data.seq_len
    b, _ = bottleneck_dims(cfg.model, cfg.pipeline)
    out = []
    for s in range(cfg.pipeline.stages):
        w = StageWorker(cfg, s)
        times = []
        for i in range(reps + 1):
            x = torch.randint(0, cfg.model.vocab_size, (B, T)) if s == 0 else torch.randn(B, T, b)
            tgt = torch.randint(0, cfg.model.vocab_size, (B, T)) if s == cfg.pipeline.stages - 1 else None
            t0 = time.perf_counter()
            w.forward(f"m{i}", x, tgt)
            if s != cfg.pipeline.stages - 1:
                w.backward(f"m{i}", torch.randn(B, T, b))
            if i:
                times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        w.step()
        step_s = time.perf_counter() - t0
        out.append(statistics.median(times) / (B * T) + step_s / (cfg.train.batch_size * T))
    return out


# ------------------------------------------------------------------------------------ CPU load
def read_proc_stat(text: Optional[str] = None) -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs from /proc/stat's ``cpu`` line (idle + iowait are not busy)."""
    if text is None:
        text = Path("/proc/stat").read_text()
    fields = next(line for line in text.splitlines() if line.startswith("cpu ")).split()[1:]
    vals = [int(v) for v in fields[:8]]            # user nice system idle iowait irq softirq steal
    idle = vals[3] + vals[4]
    total = sum(vals)
    return total - idle, total


def busy_fraction(a: tuple[int, int], b: tuple[int, int]) -> Optional[float]:
    db, dt = b[0] - a[0], b[1] - a[1]
    return db / dt if dt > 0 else None


# ------------------------------------------------------------------------------------ results
def _read_json(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def tokens_per_s_after_fill(metrics: list[dict]) -> Optional[float]:
    """Tokens per second over the lane steps after the first (the pipeline has filled), from the
    localnet's ``metrics.jsonl`` rows (``tokens`` cumulative, ``elapsed_s``)."""
    ms = sorted((m for m in metrics if m.get("tokens") is not None and m.get("elapsed_s") is not None),
                key=lambda m: m["step"])
    if len(ms) < 2:
        return None
    dt = ms[-1]["elapsed_s"] - ms[0]["elapsed_s"]
    return (ms[-1]["tokens"] - ms[0]["tokens"]) / dt if dt > 0 else None


def stage_utilisation(summary: dict, miner_status: list[dict]) -> Optional[float]:
    """The summary's figure, else mean over miners of busy_s / the validators' training seconds."""
    if summary.get("stage_utilisation") is not None:
        return summary["stage_utilisation"]
    train_s = summary.get("train_s")
    busy = [m["busy_s"] for m in miner_status if m.get("busy_s") is not None]
    if not train_s or not busy:
        return None
    return sum(min(1.0, b / train_s) for b in busy) / len(busy)


def modelled_fields(miner_status: list[dict]) -> dict:
    """The emulated miners' MODELLED update store and checkpoint figures (see the module docstring);
    None for a figure no miner reports."""
    stores = [(m.get("modelled") or {}).get("update_store") or {} for m in miner_status]
    ckpts = [(m.get("modelled") or {}).get("checkpoints") or {} for m in miner_status]

    def most(rows: list[dict], key: str):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return max(vals) if vals else None

    def total(rows: list[dict], key: str):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return sum(vals) if vals else None
    return {"update_store_host_bytes_max": most(stores, "max_host_bytes"),
            "update_store_plan_host_bytes": most(stores, "plan_host_bytes"),
            "update_store_d2h_bytes_per_step": most(stores, "last_d2h_bytes"),
            "update_store_settle_wait_s": most(stores, "settle_wait_s"),
            "checkpoint_writes": total(ckpts, "writes"), "checkpoint_bytes": total(ckpts, "write_bytes"),
            "checkpoint_write_s": most(ckpts, "write_s")}


def merge_fields(miner_status: list[dict], time_scale: float = 1.0) -> dict:
    """What the miners' ``status.json`` ``merge`` sections say: ``merges_applied_min`` (per stage, the
    fewest merges any of its replicas applied), ``merges_abandoned`` (sum over miners),
    ``merge_bytes_sent_last_max`` (the most bytes a replica sent in its last merge; virtual bytes for
    emulated stages), ``merge_s_last_max`` (its duration in emulated seconds: wall / ``time_scale``),
    ``merge_virtual_scale`` (the largest proxy scale k; None when no stage merged a virtual payload).
    Every figure None when no miner merges."""
    merging = [m for m in miner_status if isinstance(m.get("merge"), dict)]
    if not merging:
        return {"merges_applied_min": None, "merges_abandoned": None, "merge_bytes_sent_last_max": None,
                "merge_s_last_max": None, "merge_virtual_scale": None}
    per_stage: dict[str, int] = {}
    for m in merging:
        k = str(m.get("stage"))
        per_stage[k] = min(per_stage.get(k, 1 << 30), int(m["merge"].get("merges") or 0))
    lasts = [m["merge"].get("last") or {} for m in merging]
    sent = [x["bytes_sent"] for x in lasts if x.get("bytes_sent") is not None]
    secs = [x["wall_s"] / time_scale for x in lasts if x.get("wall_s") is not None]
    scales = [(m["merge"].get("virtual") or {}).get("scale") for m in merging]
    scales = [k for k in scales if k]
    return {"merges_applied_min": dict(sorted(per_stage.items())),
            "merges_abandoned": sum(int(m["merge"].get("abandoned") or 0) for m in merging),
            "merge_bytes_sent_last_max": max(sent) if sent else None,
            "merge_s_last_max": max(secs) if secs else None,
            "merge_virtual_scale": max(scales) if scales else None}


def joiner_fields(summary: dict) -> dict:
    """The ``--join-at`` joiner's figures from a localnet summary (its ``joiner``,
    :mod:`iota_subnet.network.localnet_join`); {} when the run had no joiner. Seconds are emulated
    (wall / time_scale; ``joiner_joined_s`` / ``joiner_synced_at_s``: since the run's neurons started):
    ``joiner_sync_s`` the state sync itself (describe, fetch, verify, apply),
    ``joiner_join_to_sync_s`` from the joiner's start to in sync (its process start-up included: host
    time, not slowed by the time scale, so an underestimate of a real joiner's); ``joiner_sync_bytes``
    the state's bytes fetched (an emulated stage's virtual bytes: the real stage's anchor and momentum)."""
    j = summary.get("joiner")
    if not j:
        return {}
    return {"joiner_at_step": j.get("at_step"), "joiner_stage": j.get("stage"),
            "joiner_joined_at_step": j.get("joined_at_step"), "joiner_joined_s": j.get("joined_emulated_s"),
            "joiner_synced_at_s": j.get("synced_at_emulated_s"),
            "joiner_in_sync": bool(j.get("synced") and j.get("in_sync")), "joiner_sync_s": j.get("sync_emulated_s"),
            "joiner_join_to_sync_s": j.get("join_to_sync_emulated_s"), "joiner_sync_bytes": j.get("sync_bytes"),
            "joiner_sync_donors": j.get("sync_donors")}


def result_row(row: Row, summary: dict, miner_status: list[dict], metrics: list[dict], *,
               ideal: Optional[float], host_cpu_busy: Optional[float], own_cpu_busy: Optional[float],
               wall_s: Optional[float], error: Optional[str] = None) -> dict:
    """The bench's output object for one row (fields in the module docstring)."""
    scale = row.time_scale if row.mode == "emulated" else 1.0
    tokens = summary.get("tokens") or 0
    fill = tokens_per_s_after_fill(metrics)
    run_rate = summary.get("tokens_per_s")
    vb, mb = summary.get("validator_bytes_per_token"), summary.get("miner_bytes_per_token")
    old_plane = vb is None and mb is None and summary.get("wire_bytes_per_token") is not None
    if old_plane:
        vb, mb = summary["wire_bytes_per_token"], 0.0
    ver = summary.get("verification_bytes_per_token")
    if ver is None and summary.get("verification_bytes") is not None and tokens:
        ver = summary["verification_bytes"] / tokens
    tps = fill * scale if fill is not None else (run_rate * scale if run_rate is not None else None)
    out = {
        "name": row.name, "mode": row.mode, "config": row.config, "stages": row.stages, "replicas": row.replicas,
        "compression_ratio": row.compression_ratio, "wire_dtype": summary.get("wire_dtype") or row.wire_dtype,
        **link_fields(row), "rows_per_microbatch": row.rows_per_microbatch,
        "tokens_per_s": tps, "tokens_per_s_run": run_rate * scale if run_rate is not None else None,
        "stage_utilisation": stage_utilisation(summary, miner_status),
        "ideal_tokens_per_s": ideal,
        "fraction_of_ideal": tps / ideal if (tps is not None and ideal) else None,
        "validator_bytes_per_token": vb, "miner_bytes_per_token": mb, "verification_bytes_per_token": ver,
        "final_loss": summary.get("final_loss") if row.mode == "train" else None,
        "val_loss": summary.get("val_loss") if row.mode == "train" else None,
        "host_cpu_busy": host_cpu_busy, "own_cpu_busy": own_cpu_busy, "tokens": tokens, "wall_s": wall_s,
        "data_plane": ("validator relays every tensor (before issue 9)" if old_plane
                       else summary.get("data_plane") or "miner to miner"),
        **joiner_fields(summary),
    }
    if row.mode == "emulated":
        out.update(gpu=row.gpu, mfu=row.mfu, time_scale=row.time_scale, emulation=EMULATION_NOTE,
                   time_unit="emulated seconds (wall / time_scale)", block_time_s=summary.get("block_time_s"),
                   **modelled_fields(miner_status))
    out.update(merge_fields(miner_status, scale))
    if error:
        out["error"] = error
    return out


# ------------------------------------------------------------------------------------ running
def localnet_argv(row: Row, out: Path, data: str) -> list[str]:
    argv = [sys.executable, "-m", "iota_subnet.cli", "localnet", "--stages", str(row.stages),
            "--replicas", str(row.replicas), "--config", str(REPO / row.config), "--data", data,
            "--steps", str(row.steps), "--out", str(out), "--link", row.link, "--wire-dtype", row.wire_dtype,
            "--no-restart"]
    ovr = {k: dict(v) for k, v in row.overrides.items()}
    ovr.setdefault("pipeline", {})["compression_ratio"] = row.compression_ratio
    for sec, vals in ovr.items():
        for k, v in vals.items():
            argv += ["--set", f"{sec}.{k}={'null' if v is None else json.dumps(v)}"]
    if row.mode == "emulated":
        argv += ["--emulate-gpu", row.gpu, "--mfu", repr(row.mfu), "--time-scale", repr(row.time_scale)]
    if row.home_replicas:
        argv += ["--home-replicas", str(row.home_replicas)]
    if row.validator_link is not None:
        argv += ["--validator-link", row.validator_link]
    if row.relay_rate is not None:
        argv += ["--relay-rate", repr(float(row.relay_rate))]
    if row.join_at:           # STEP[:STAGE]: one miner joins mid-run (localnet --join-at)
        argv += ["--join-at", str(row.join_at)]
    return argv


def link_fields(row: Row) -> dict:
    """What a result (and ``--list``) says about the row's links: every miner's, the validators' (the
    relay's, with home miners), the home miners per stage and the per-peer cap (None: no cap)."""
    return {"link": row.link, "validator_link": row.validator_link or row.link, "home_replicas": row.home_replicas,
            "relay_rate_bytes_per_s": row.relay_rate if row.home_replicas else None}


def training_window(statuses: list[dict]) -> tuple[bool, bool]:
    """(started, done) of the training from the validators' ``status.json``: started once a lane step
    is done, done when every validator says so."""
    started = any(sum((s.get("steps_done") or {}).values()) > 0 for s in statuses)
    return started, bool(statuses) and all(s.get("done") for s in statuses)


def run_row(row: Row, out: Path, data: str, timeout_s: float, cpu_rates: Optional[list[float]] = None) -> dict:
    """Run one row's localnet as a child process and collect its result row."""
    out.mkdir(parents=True, exist_ok=True)
    argv = localnet_argv(row, out, data)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    samples: list[tuple[int, int]] = []
    with open(out / "bench.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
        error = None
        try:
            while proc.poll() is None:
                time.sleep(2.0)
                started, done = training_window([_read_json(q) for q in (out / "validators").glob("*/status.json")])
                if started and not done:          # CPU load while the row trains (setup excluded)
                    samples.append(read_proc_stat())
                if time.monotonic() - t0 > timeout_s:
                    proc.terminate()
                    proc.wait(60)
                    error = f"timed out after {timeout_s:.0f}s"
            if proc.returncode and error is None:
                error = f"localnet exited with code {proc.returncode}; see {out / 'bench.log'}"
        except BaseException:
            proc.terminate()
            proc.wait(60)
            raise
    wall = time.monotonic() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    summary = _read_json(out / "summary.json")
    miners = [_read_json(p) for p in sorted((out / "miners").glob("*/status.json"))]
    metrics = []
    if (out / "metrics.jsonl").exists():
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return result_row(row, summary, miners, metrics,
                      ideal=ideal_tokens_per_s(row, cpu_rates) if not error or row.mode == "emulated" else None,
                      host_cpu_busy=busy_fraction(samples[0], samples[-1]) if len(samples) >= 2 else None,
                      own_cpu_busy=cpu_s / (wall * (os.cpu_count() or 1)), wall_s=round(wall, 1), error=error)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON object per row on stdout")
    p.add_argument("--rows", default=None, help="comma-separated row names (default: all; see --list)")
    p.add_argument("--list", action="store_true", help="print the rows with their ideal figures; run nothing")
    p.add_argument("--out", default="runs/bench_wan")
    p.add_argument("--data", default=str(WIKITEXT))
    p.add_argument("--steps", type=int, default=None, help="override every row's inner steps")
    p.add_argument("--time-scale", type=float, default=None, help="override every emulated row's time scale")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per row")
    p.add_argument("--wire-dtype", choices=WIRE_DTYPES, default=None,
                   help="wire dtype of activations and gradients in every row (default: each row's, bf16)")
    p.add_argument("--validator-link", default=None, metavar="RATE:DELAY",
                   help="the validators' link in every row (so the relay's in the -home rows), e.g. 1gbit:10ms "
                        "(default: the row's --link for every neuron)")
    p.add_argument("--relay-rate", type=float, default=None, metavar="BYTES_PER_S",
                   help="per-peer cap of the relay in the -home rows, emulated bytes per second (default: no cap)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value in every row, e.g. merge.every_steps=5 (repeatable)")
    a = p.parse_args(argv)
    try:
        sets = parse_sets(a.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.validator_link is not None:
        try:
            a.validator_link = str(parse_link(a.validator_link))
        except ConfigError as e:
            print(f"error: --validator-link{str(e)[len('--link'):]}", file=sys.stderr)
            return 2
    if a.relay_rate is not None and not (a.relay_rate > 0 and math.isfinite(a.relay_rate)):
        print(f"error: --relay-rate {a.relay_rate!r} must be > 0 (bytes per second per relayed miner)", file=sys.stderr)
        return 2
    todo = rows()
    if a.rows:
        want = [r.strip() for r in a.rows.split(",") if r.strip()]
        names = {r.name for r in todo}
        unknown = [w for w in want if w not in names]
        if unknown:
            print(f"error: unknown row(s) {unknown}; rows: {sorted(names)}", file=sys.stderr)
            return 2
        todo = [r for r in todo if r.name in want]
    if a.steps:
        todo = [dataclasses.replace(r, steps=a.steps, overrides={**r.overrides, "train": {
            **r.overrides.get("train", {}), "total_steps": a.steps}} if r.mode == "emulated" else r.overrides)
            for r in todo]
    if a.wire_dtype:
        todo = [dataclasses.replace(r, wire_dtype=a.wire_dtype) for r in todo]
    if sets:
        todo = [dataclasses.replace(r, overrides={**r.overrides, **{
            sec: {**r.overrides.get(sec, {}), **vals} for sec, vals in sets.items()}}) for r in todo]
    if a.validator_link is not None:
        todo = [dataclasses.replace(r, validator_link=a.validator_link) for r in todo]
    if a.relay_rate is not None:       # only rows with home miners have a relay to cap
        todo = [dataclasses.replace(r, relay_rate=a.relay_rate) if r.home_replicas else r for r in todo]
    if a.time_scale:
        todo = [dataclasses.replace(r, time_scale=a.time_scale) if r.mode == "emulated" else r for r in todo]
    for r in todo:          # a bad --set (or row) is one line and exit 2, before anything runs
        try:
            r.run_config()
        except ConfigError as e:
            print(f"error: row {r.name}: {e}", file=sys.stderr)
            return 2
    if a.list:
        for r in todo:
            print(json.dumps({"name": r.name, "mode": r.mode, "config": r.config, "stages": r.stages,
                              "replicas": r.replicas, "compression_ratio": r.compression_ratio,
                              "wire_dtype": r.wire_dtype, **link_fields(r),
                              "gpu": r.gpu, "mfu": r.mfu if r.gpu else None, "time_scale": r.time_scale,
                              "ideal_tokens_per_s": ideal_tokens_per_s(r)}))
        return 0
    cpu_rates: dict[str, list[float]] = {}
    for r in todo:
        if r.mode == "train" and r.config not in cpu_rates:
            cpu_rates[r.config] = cpu_stage_seconds_per_token(r.run_config())
        res = run_row(r, Path(a.out) / r.name.replace(":", "_"), a.data, a.timeout, cpu_rates.get(r.config))
        print(json.dumps(res) if a.json else "\n".join(f"{k:>30}: {v}" for k, v in res.items()) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
