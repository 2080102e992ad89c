#!/usr/bin/env python
"""Churn benchmark: does a run with injected crashes, pauses, departures, joins, partitions, slow links
and validator restarts train like an undisturbed one?

Runs ``iota-subnet localnet`` (``tiny``, 3 stages x 3 replicas, merging every ``--merge-every`` inner
steps, one validator, the same steps and so the same tokens) ``--undisturbed`` times without faults
and once per chaos seed with ``--chaos`` (``min_live=2``: no event leaves a stage below 2 live
replicas), then prints (``--json``: one JSON object):

* ``events``: injected events of the disturbed run with the fewest; ``events_by_kind``: per run;
* ``val_loss_undisturbed`` / ``val_loss_disturbed``: means of the validators' final evaluation loss;
* ``relative_gap``: (disturbed - undisturbed) / undisturbed of the means; ``per_seed_gap``: each
  disturbed run against the undisturbed mean;
* ``microbatches_lost``, ``samples_repeated``, ``samples_skipped``: per disturbed run (from the
  validators' micro-batch log, see ``LocalNet._sample_accounting``); ``samples_unconfirmed``: of the
  samples counted trained, those counted on a head's word after a validator restart (no receipts);
* ``plot``: a PNG with every run's training loss curve.

Issue 13's acceptance: >= 40 events of >= 4 kinds per disturbed run, ``relative_gap <= 0.02``, every
``per_seed_gap <= 0.03`` (the issue puts run-to-run noise of ``tiny`` at about 0.7%; two runs here
differed by 0.39%). About an hour on a workstation with the defaults; on an idle 2-core machine an
undisturbed run takes about 22 minutes and a chaos run about 30 (2026-12-03; more on a loaded one).

Resumable: each finished run leaves ``OUT/NAME/bench_run.json``; the same command again reuses the
finished runs whose parameters and code (``code_version``) match and redoes only the others (a run
killed half-way is started over: its folder is cleared). ``--max-runs N`` stops after N new runs, so the five runs can be
spread over several sittings; the figures are printed over the runs finished so far, with
``runs_left`` saying what is missing (``--fresh``: ignore earlier results). ``--keep DIR`` also
keeps each result as ``DIR/NAME.json`` (the repository keeps them in ``docs/bench_churn``, so that
runs made in different sittings add up). A short check of the
script itself:

    python scripts/bench_churn.py --json                                     # the benchmark
    python scripts/bench_churn.py --steps 20 --undisturbed 1 --seeds 1 \\
        --chaos kill=6/min,pause=4/min,slow=4/min,partition=4/min,validator-kill=2/min --json   # smoke
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from iota_subnet.network.cli import parse_sets  # noqa: E402
from iota_subnet.config import ConfigError  # noqa: E402
from iota_subnet.sim.chaos import checked_chaos  # noqa: E402
from iota_subnet.network.localnet import LocalNet  # noqa: E402
from iota_subnet.utils.atomic import atomic_write_json  # noqa: E402

RESULT = "bench_run.json"
ROOT = Path(__file__).resolve().parents[1]
CODE_PATHS = ("iota_subnet", "neurons", "configs")     # what the runs execute (docs and tests do not count)

#: 2.5 events per minute in all. Seeds 1, 2, 3 schedule 68, 60 and 57 events in the first 25 minutes of a
#: disturbed run (about 29 minutes on 2 cores), each of 6-7 kinds: above the acceptance's 40 of 4 kinds with
#: margin. Each miner of 9 is hit about every 4 minutes, about every 2.5 merge epochs. At 2 a minute seed 3
#: scheduled only 36 (a measured seed-1 run had 47); until 2026-12-03 the default was 4 a minute (~155 events,
#: 4x the bound). docs/BENCHMARKS.md has runs at both; ``--chaos`` sets any rates.
DEFAULT_CHAOS = ("kill=0.6/min,pause=0.5/min,partition=0.5/min,slow=0.5/min,validator-kill=0.2/min,join=0.12/min,"
                 "leave=0.06/min")
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "wiki.valid.raw.txt"


def read_curve(out: Path) -> list[tuple[int, float]]:
    rows = []
    p = out / "metrics.jsonl"
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("loss") is not None:
                rows.append((int(r["step"]), float(r["loss"])))
    return rows


def code_version() -> str:
    """The git tree ids of the code the runs execute (``CODE_PATHS``), joined: runs made at two commits that
    differ only in docs, tests or scripts share it, so that they add up; with uncommitted changes to that
    code it ends in ``+dirty-<hash of the changes>``; ``unknown`` outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    try:
        ids = [git("rev-parse", f"HEAD:{p}").strip()[:12] for p in CODE_PATHS]
        dirty = git("status", "--porcelain", "--untracked-files=all", "--", *CODE_PATHS)
        diff = git("diff", "HEAD", "--", *CODE_PATHS) if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    # uncommitted changes: named by a hash of the diff and of the untracked files' names
    return "-".join(ids) + (f"+dirty-{hashlib.sha256((diff + dirty).encode()).hexdigest()[:8]}" if dirty else "")


def run_params(a: argparse.Namespace, chaos: str | None) -> dict:
    """What makes two runs the same run (a finished run is reused only when these match, the code included:
    the acceptance compares runs of one code version)."""
    return {"code": code_version(), "config": a.config, "data": a.data, "stages": a.stages, "replicas": a.replicas,
            "validators": a.validators, "steps": a.steps, "merge_every": a.merge_every, "chaos": chaos,
            "chaos_duration_s": a.chaos_duration, "hop_timeout_s": a.hop_timeout, "stall_s": a.stall,
            "block_time": a.block_time, "tempo": a.tempo, "set": sorted(a.set)}


def finished_run(name: str, a: argparse.Namespace, chaos: str | None) -> dict | None:
    """The result of an earlier run ``name`` with the same parameters (from ``OUT/NAME/bench_run.json``,
    else ``KEEP/NAME.json``), or None."""
    paths = [Path(a.out) / name / RESULT] + ([Path(a.keep) / f"{name}.json"] if a.keep else [])
    for p in paths:
        try:
            r = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        # a run stopped before its final evaluation (timed out, or the bench was killed: no val loss) is redone
        if (isinstance(r, dict) and r.get("params") == run_params(a, chaos) and not r.get("timed_out")
                and r.get("val_loss") is not None and not r.get("code_changed_during_run")):
            return r
    return None


def run_one(name: str, a: argparse.Namespace, chaos: str | None) -> dict:
    out = Path(a.out) / name
    if out.exists():                    # a run killed half-way (or with other parameters): start it over
        shutil.rmtree(out)
    ovr = parse_sets(a.set)
    ovr.setdefault("merge", {})["every_steps"] = a.merge_every
    t0 = time.monotonic()
    params = run_params(a, chaos)       # the code on disk when the run starts (neurons restarted later import it again)
    net = LocalNet(stages=a.stages, replicas=a.replicas, validators=a.validators, config=a.config,
                   data=a.data, steps=a.steps, out=out, block_time=a.block_time, tempo=a.tempo, progress=False,
                   overrides=ovr, chaos=chaos, chaos_duration_s=a.chaos_duration,
                   timeout_s=a.timeout, extra_miner_args=["--hop-timeout", str(a.hop_timeout)],
                   extra_validator_args=["--hop-timeout", str(a.hop_timeout), "--stall", str(a.stall)])
    try:
        summary = net.run()
    except TimeoutError as e:          # a run that did not finish is a result too (no loss to compare)
        print(f"{name}: {e}", file=sys.stderr)
        summary = {"timed_out": True}
    chaos_summary = summary.get("chaos") or {}
    changed = run_params(a, chaos) != params
    if changed:                         # a commit or an edit during the run: neurons may have run either code
        print(f"{name}: the code changed during the run ({params['code']} -> {code_version()}); "
              f"the result is kept but not reused", file=sys.stderr)
    result = {"name": name, "params": params, "chaos": chaos, "timed_out": bool(summary.get("timed_out")),
              "code_changed_during_run": changed,
            "val_loss": summary.get("val_loss"), "final_loss": summary.get("final_loss"),
            "wall_s": round(time.monotonic() - t0, 1), "events": chaos_summary.get("events", 0),
            "events_by_kind": chaos_summary.get("events_by_kind", {}),
            "skipped_by_kind": chaos_summary.get("skipped_by_kind", {}),
            "unrecovered": chaos_summary.get("unrecovered", []),
            "microbatches_lost": chaos_summary.get("microbatches_lost"),
            "samples_repeated": chaos_summary.get("samples_repeated"),
            "samples_skipped": chaos_summary.get("samples_skipped"),
            "samples_unconfirmed": chaos_summary.get("samples_unconfirmed"),
            "merges_applied": (summary.get("merge") or {}).get("merges_applied"),
            "mismatch_reports": (summary.get("merge") or {}).get("mismatch_reports"),
            # hop and update audits under churn: an honest miner that was only killed, paused or cut off
            # must not be flagged (issue 10, item 2)
            "audits": {k: (summary.get("audits") or {}).get(k) for k in ("audits", "audits_failed", "flagged")},
            "curve": read_curve(out)}
    atomic_write_json(out / RESULT, result)
    if a.keep and not result["timed_out"] and result["val_loss"] is not None:
        Path(a.keep).mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(a.keep) / f"{name}.json", result)
    return result


def plot(runs: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in runs:
        if not r["curve"]:
            continue
        steps, losses = zip(*r["curve"])
        ax.plot(steps, losses, label=f"{r['name']} ({r['events']} events)" if r["chaos"] else r["name"],
                linestyle="-" if r["chaos"] else "--", linewidth=1.2)
    ax.set_xlabel("lane step")
    ax.set_ylabel("training loss (mean over lanes)")
    ax.set_title(f"{title}: undisturbed (dashed) vs chaos (solid)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--data", default=str(DEFAULT_DATA) if DEFAULT_DATA.exists() else None)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--validators", type=int, default=1)
    ap.add_argument("--steps", type=int, default=150, help="inner steps per lane (the same tokens in every run)")
    ap.add_argument("--merge-every", type=int, default=5, help="merge.every_steps")
    ap.add_argument("--undisturbed", type=int, default=2, help="runs without faults")
    ap.add_argument("--seeds", default="1,2,3", help="one disturbed run per chaos seed")
    ap.add_argument("--chaos", default=DEFAULT_CHAOS, help="rates per kind (seed and min_live=2 are added)")
    ap.add_argument("--chaos-duration", type=float, default=3600.0)
    ap.add_argument("--hop-timeout", type=float, default=10.0,
                    help="miners' and validators' --hop-timeout (default 10 s: a stopped miner is given up sooner)")
    ap.add_argument("--stall", type=float, default=10.0, help="validators' --stall (seconds without progress)")
    ap.add_argument("--block-time", type=float, default=0.5)
    ap.add_argument("--tempo", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=3 * 3600.0, help="per run, seconds")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--out", default="runs/bench_churn")
    ap.add_argument("--plot", default=None, help="PNG path (default OUT/loss_curves.png)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--max-runs", type=int, default=None, help="start at most this many new runs, then report")
    ap.add_argument("--fresh", action="store_true", help="redo every run (ignore OUT/NAME/bench_run.json)")
    ap.add_argument("--keep", default=None, metavar="DIR",
                    help="also keep each finished run's result (figures and loss curve, a few kB) as DIR/NAME.json "
                         "and reuse it from there: a folder to commit, so that runs add up across machines")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seeds: a comma-separated list of integers, e.g. 1,2,3; got {a.seeds!r}")
    plan = [(f"undisturbed{i}", None) for i in range(a.undisturbed)]
    plan += [(f"chaos-seed{s}", f"{a.chaos},seed={s},min_live=2") for s in seeds]
    for _, chaos in plan:               # a bad spec is told now, not after the undisturbed runs
        if chaos is not None:
            try:
                checked_chaos(chaos, a.replicas, a.chaos_duration)
            except ConfigError as e:
                ap.error(str(e))
    runs, left, started = [], [], 0
    for name, chaos in plan:
        done = None if a.fresh else finished_run(name, a, chaos)
        if done is not None:
            print(f"{name}: reusing its finished run (val loss {done['val_loss']})", file=sys.stderr)
            runs.append(done)
        elif a.max_runs is not None and started >= a.max_runs:
            left.append(name)
        else:
            print(f"{name}: running ({started + 1} new this time, {len(plan)} planned)", file=sys.stderr)
            runs.append(run_one(name, a, chaos))
            started += 1
    png = Path(a.plot) if a.plot else Path(a.out) / "loss_curves.png"
    try:
        if not any(r["curve"] for r in runs):
            raise LookupError("no finished run yet")
        plot(runs, png, f"{Path(a.config).stem}, {a.stages}x{a.replicas}, merge every {a.merge_every}")
    except ImportError:                 # the figures are still printed; the curves are in each run's metrics.jsonl
        print("no plot: matplotlib is not installed (pip install -e \".[bench]\")", file=sys.stderr)
        png = None
    except LookupError as e:
        print(f"no plot: {e}", file=sys.stderr)
        png = None
    und = [r for r in runs if not r["chaos"]]
    dis = [r for r in runs if r["chaos"]]
    vu, vd = mean([r["val_loss"] for r in und]), mean([r["val_loss"] for r in dis])
    res = {
        "code": code_version(), "config": a.config, "stages": a.stages, "replicas": a.replicas, "steps": a.steps, "merge_every": a.merge_every,
        "chaos": a.chaos, "seeds": seeds, "hop_timeout_s": a.hop_timeout, "stall_s": a.stall,
        "events": min((r["events"] for r in dis), default=0),
        "events_by_kind": {r["name"]: r["events_by_kind"] for r in dis},
        "val_loss_undisturbed": vu, "val_loss_disturbed": vd,
        "relative_gap": (vd - vu) / vu if vu and vd is not None else None,
        "per_seed_gap": {r["name"]: ((r["val_loss"] - vu) / vu if vu and r["val_loss"] is not None else None)
                         for r in dis},
        "val_loss_per_run": {r["name"]: r["val_loss"] for r in runs},
        "microbatches_lost": {r["name"]: r["microbatches_lost"] for r in dis},
        "samples_repeated": {r["name"]: r["samples_repeated"] for r in dis},
        "samples_skipped": {r["name"]: r["samples_skipped"] for r in dis},
        "samples_unconfirmed": {r["name"]: r.get("samples_unconfirmed") for r in dis},
        "skipped_by_kind": {r["name"]: r["skipped_by_kind"] for r in dis},
        "unrecovered": {r["name"]: r["unrecovered"] for r in dis},
        "merges_applied": {r["name"]: r["merges_applied"] for r in runs},
        "mismatch_reports": {r["name"]: r["mismatch_reports"] for r in runs},
        "wall_s": {r["name"]: r["wall_s"] for r in runs},
        "timed_out": [r["name"] for r in runs if r["timed_out"]],
        "audits": {r["name"]: r["audits"] for r in runs},
        "plot": str(png) if png else None,
        "runs_left": left,
    }
    if left:
        print(f"{len(left)} of {len(plan)} runs left ({', '.join(left)}): the same command again goes on",
              file=sys.stderr)
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
