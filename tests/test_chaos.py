"""Chaos harness: the spec, its seeded schedule, and the injector's rules (targets, min live replicas,
recovery) against a network of real short-lived processes (``sleep``), not a localnet."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from iota_subnet.config import ConfigError
from iota_subnet.sim.chaos import CHAOS_KINDS, ChaosInjector, ChaosLog, ChaosSpec, checked_chaos


def test_spec_parses_rates_and_refuses_what_it_cannot_read():
    s = ChaosSpec.parse("kill=2/min, pause=0.5/min,join=1/min,seed=7")
    assert s.rates == {"kill": 2.0, "pause": 0.5, "join": 1.0} and s.seed == 7
    assert ChaosSpec.parse("slow=1/s").rates == {"slow": 60.0}
    assert ChaosSpec.parse("kill=1/min,min_live=2").min_live == 2 and ChaosSpec.parse("kill=1/min").min_live == 1
    assert ChaosSpec.parse("kill=0/min,pause=1/min").rates == {"kill": 0.0, "pause": 1.0}    # 0 leaves a kind out
    for bad, msg in (("kill=2", "KIND=RATE/min"), ("explode=1/min", "unknown kind"), ("seed=x,kill=1/min", "seed"),
                     ("seed=3", "no fault kinds"), ("kill=1/min,min_live=0", "min_live"),
                     ("kill=0/min,pause=0/s", "every rate is 0"), ("kill=1/min,pause=1/min,kill=3/min", "kill is given twice"),
                     ("seed=1,kill=1/min,seed=2", "seed is given twice"), ("min_live=2,kill=1/min,min_live=3", "twice")):
        with pytest.raises(ConfigError, match=msg):
            ChaosSpec.parse(bad)


def test_schedule_is_seeded_and_follows_the_rates():
    spec = ChaosSpec.parse("kill=2/min,pause=1/min,validator-kill=0.5/min,seed=3")
    a, b = spec.schedule(3600), spec.schedule(3600)
    assert a == b and a == sorted(a)
    assert ChaosSpec.parse("kill=2/min,pause=1/min,validator-kill=0.5/min,seed=4").schedule(3600) != a
    counts = {k: sum(1 for _, kk in a if kk == k) for k in ("kill", "pause", "validator-kill")}
    # Poisson counts over an hour: 120, 60, 30 expected; 4 standard deviations of slack
    assert abs(counts["kill"] - 120) < 4 * 120 ** 0.5 and abs(counts["pause"] - 60) < 4 * 60 ** 0.5
    assert abs(counts["validator-kill"] - 30) < 4 * 30 ** 0.5
    assert set(CHAOS_KINDS) >= {k for _, k in a}


@dataclass
class Proc:
    """A real child process standing in for a neuron (so signals really happen)."""
    name: str
    kind: str
    stage: Optional[int]
    out: Path
    proc: Optional[subprocess.Popen] = None
    started_at: Optional[float] = None
    left: bool = False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class SleepNet:
    def __init__(self, tmp: Path, stages: int, replicas: int):
        self.stages = stages
        self.children = []
        for s in range(stages):
            for r in range(replicas):
                self.children.append(self._start(Proc(f"m{s}{r}", "miner", s, tmp / f"m{s}{r}")))
        self.children.append(self._start(Proc("v0", "validator", None, tmp / "v0")))
        self.restarts: list[tuple[str, float]] = []
        self.links: dict[str, dict] = {}

    def _start(self, c):
        c.out.mkdir(parents=True, exist_ok=True)
        c.proc = subprocess.Popen(["sleep", "120"])
        c.started_at = time.monotonic()
        return c

    def kill(self, c):
        c.proc.kill()
        c.proc.wait()

    def pause(self, c):
        c.proc.send_signal(19)

    def resume(self, c):
        c.proc.send_signal(18)

    def retire(self, c):
        c.left = True
        c.proc.terminate()
        c.proc.wait()

    def schedule_restart(self, c, at):
        self.restarts.append((c.name, at))
        self._start(c)          # immediately, for the test

    def add_miner(self, stage):
        c = self._start(Proc(f"j{len(self.children)}", "miner", stage, self.children[0].out.parent / f"j{stage}"))
        self.children.append(c)
        return c

    def set_link(self, c, state):
        self.links[c.name] = state

    def close(self):
        for c in self.children:
            if c.alive():
                c.proc.send_signal(18)
                c.proc.kill()
                c.proc.wait()


def served(c, n):
    (c.out / "status.json").write_text(json.dumps({"dataplane": {"counts": {"receipts_ok": n}}}))


def test_injector_keeps_min_live_replicas_logs_and_detects_recovery(tmp_path):
    net = SleepNet(tmp_path, stages=2, replicas=2)
    t = [0.0]
    spec = ChaosSpec(rates={"kill": 60.0}, seed=1, min_live=1, restart_s=(0.0, 0.0))
    log = ChaosLog(tmp_path / "chaos.jsonl", clock=lambda: t[0])
    inj = ChaosInjector(net, spec, log, duration_s=10.0, clock=lambda: t[0])
    inj.pending = [(0.5, "kill"), (0.6, "kill"), (0.7, "kill"), (0.8, "leave")]
    try:
        t[0] = 1.0
        inj.tick()
        # two stages of two: at most one kill per stage may leave a live replica; the third kill and the
        # leave find every stage at the minimum and are skipped
        killed = [f.target for f in log.faults if f.kind == "kill"]
        assert len(killed) == 2 and len({n[1] for n in killed}) == 2, killed
        assert log.skipped == {"kill": 1, "leave": 1}
        # recovery: restarted (started after the kill) and serving again
        for c in net.children:
            if c.name in killed:
                served(c, 3)
        t[0] = 2.0
        inj.tick()
        summ = log.summary()
        assert summ["events_by_kind"] == {"kill": 2} and summ["recover_s"]["kill"]["n"] == 2 and not summ["unrecovered"]
        rows = [json.loads(l) for l in (tmp_path / "chaos.jsonl").read_text().splitlines()]
        assert [r["event"] for r in rows].count("recover") == 2 and [r["event"] for r in rows].count("skip") == 2
    finally:
        log.close()
        net.close()


def test_pause_and_partition_are_undone_then_recover(tmp_path):
    net = SleepNet(tmp_path, stages=1, replicas=3)
    t = [0.0]
    spec = ChaosSpec(rates={"pause": 1.0}, seed=2, min_live=1, pause_s=(5.0, 5.0), partition_s=(5.0, 5.0))
    log = ChaosLog(tmp_path / "chaos.jsonl", clock=lambda: t[0])
    inj = ChaosInjector(net, spec, log, duration_s=10.0, clock=lambda: t[0])
    inj.pending = [(0.0, "pause"), (0.0, "partition")]
    try:
        inj.tick()
        paused = next(c for c in net.children if c.name == log.faults[0].target)
        parted = next(c for c in net.children if c.name == log.faults[1].target)
        time.sleep(0.2)
        assert open(f"/proc/{paused.proc.pid}/stat").read().split()[2] == "T"      # really stopped
        assert net.links[parted.name] == {"down": True}
        served(paused, 5)
        t[0] = 3.0
        inj.tick()
        assert all(f.recovered_at is None for f in log.faults)        # still paused / partitioned
        t[0] = 6.0
        inj.tick()                                                    # undone now
        assert net.links[parted.name] == {}
        time.sleep(0.2)
        assert open(f"/proc/{paused.proc.pid}/stat").read().split()[2] != "T"
        served(paused, 6)
        served(parted, 1)
        t[0] = 7.0
        inj.tick()
        assert all(f.recovered_at is not None for f in log.faults)
    finally:
        log.close()
        net.close()


def test_joins_refill_the_emptiest_stage_and_spread_over_ties(tmp_path):
    """Joins used to go to stage 0 whenever stages tied (and to any stage with a faulted member), so a
    long run piled its joiners onto one stage."""
    net = SleepNet(tmp_path, stages=3, replicas=2)
    t = [0.0]
    log = ChaosLog(tmp_path / "chaos.jsonl", clock=lambda: t[0])
    inj = ChaosInjector(net, ChaosSpec(rates={"join": 1.0}, seed=3), log, duration_s=10.0, clock=lambda: t[0])
    try:
        net.retire(next(c for c in net.children if c.name == "m21"))
        inj.pending = [(0.0, "join")] * 4
        inj.tick()
        stages = [f.detail["stage"] for f in log.faults]
        assert stages[0] == 2                                  # the stage a leave emptied
        assert sorted(stages[1:]) == [0, 1, 2]                 # then one each: ties spread, not all on stage 0
    finally:
        log.close()
        net.close()


@pytest.mark.parametrize("argv, msg", [
    (["--replicas", "1", "--chaos", "kill=20/min,pause=20/min,seed=1"], "kill, pause would never run"),
    (["--replicas", "3", "--chaos", "kill=2/min,seed=1,min_live=5"], "use --replicas 6 or more"),
    (["--replicas", "3", "--chaos", ""], "empty spec"),
    (["--replicas", "3", "--chaos", "kill=2/min", "--chaos-duration", "0"], "--chaos-duration must be > 0"),
])
def test_localnet_refuses_chaos_that_could_never_run(tmp_path, argv, msg):
    """A spec none of whose faults could hit a miner would run undisturbed while the run says it is
    disturbed (a reviewer got exit 0 and 0 events): exit code 2, one line saying how to fix it, and
    nothing started."""
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "iota_subnet.cli", "localnet", "--stages", "2", "--config",
                        "configs/tiny.yaml", "--steps", "2", "--out", str(out), *argv],
                       capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert msg in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not out.exists()


def test_chaos_check_lets_joins_lift_a_stage_over_min_live():
    assert checked_chaos("kill=2/min,join=1/min,seed=1,min_live=2", 2, None).min_live == 2
    assert checked_chaos("validator-kill=1/min,seed=1", 1, None).rates == {"validator-kill": 1.0}
    with pytest.raises(ConfigError, match="would never run"):
        checked_chaos("kill=2/min,slow=1/min,seed=1,min_live=2", 2, None)
