"""The neuron processes of a local network: start, stop, supervise, and the faults chaos injects.

Every neuron (:class:`Child`) is an OS process in a process group of its own, its output in
``OUT/logs/<name>.log``; a miner that dies is restarted after ``restart_delay_s`` (it resumes from
its checkpoint), a validator that dies ends the run. :class:`NeuronProcesses` is a part of
:class:`~iota_subnet.network.localnet.LocalNet` (it reads ``children``, ``restart_dead``,
``restart_delay_s``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

from loguru import logger

from iota_subnet.utils.atomic import atomic_write_text


@dataclasses.dataclass
class Child:
    name: str
    kind: str                      # "miner" | "validator"
    argv: list[str]
    log: Path
    out: Path
    stage: Optional[int] = None
    proc: Optional[subprocess.Popen] = None
    restarts: int = 0
    died_at: Optional[float] = None
    started_at: Optional[float] = None      # monotonic time of the latest start
    hold_until: Optional[float] = None      # a chaos kill: restart no earlier than this
    left: bool = False                      # a chaos leave: never restarted
    started_wall: float = 0.0               # unix time of the latest start

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self) -> dict:
        """Its ``status.json``, or {} while it has not written one since its latest start (a resumed
        run's folder still holds the previous process's: its ports and dashboard address are stale)."""
        p = self.out / "status.json"
        try:
            if p.stat().st_mtime < self.started_wall - 1.0:
                return {}
            return json.loads(p.read_text())
        except (OSError, ValueError):
            return {}


class NeuronProcesses:
    """Process management of :class:`~iota_subnet.network.localnet.LocalNet` (see the module docstring)."""

    # ---- processes -----------------------------------------------------------------------------
    def _env(self) -> dict:
        env = dict(os.environ)
        env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "IOTA_DIE_WITH_PARENT": "1",
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
        return env

    def start(self, child: Child) -> None:
        child.out.mkdir(parents=True, exist_ok=True)
        logf = open(child.log, "ab")
        # a process group of its own: a terminal's SIGHUP (closed) or SIGINT (Ctrl-C) reaches only this
        # process, which stops every neuron in order and writes the summary (in the terminal's group, a
        # closed terminal's SIGHUP would kill every neuron at once, with no checkpoint). Same session:
        # if this process dies, a neuron paused by chaos (SIGSTOP) gets SIGHUP and SIGCONT from the
        # kernel (its group is orphaned) and then its IOTA_DIE_WITH_PARENT SIGTERM; in a session of its
        # own it would stay stopped
        child.proc = subprocess.Popen(child.argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=self._env(), process_group=0)
        logf.close()
        child.died_at = None
        child.started_at = time.monotonic()
        child.started_wall = time.time()

    # ---- fault injection (used by .chaos) ------------------------------------------------------
    def kill(self, child: Child) -> None:
        if child.alive():
            child.proc.send_signal(signal.SIGKILL)

    def pause(self, child: Child) -> None:
        if child.alive():
            child.proc.send_signal(signal.SIGSTOP)

    def resume(self, child: Child) -> None:
        if child.alive():
            child.proc.send_signal(signal.SIGCONT)

    def retire(self, child: Child) -> None:
        child.left = True
        if child.alive():
            child.proc.send_signal(signal.SIGTERM)

    def schedule_restart(self, child: Child, at: float) -> None:
        child.hold_until = at

    def set_link(self, child: Child, state: dict) -> None:
        """Partition (``{"down": true}``) or slow (``{"slow": factor}``) a neuron's links; ``{}`` heals.
        The neuron reads the file (``--link-control``) a few times a second."""
        atomic_write_text(child.out / "link-control.json", json.dumps(state))

    def stop_all(self, grace_s: float = 15.0) -> None:
        for c in self.children:
            if c.alive():
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in self.children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning(f"{c.name} did not stop in {grace_s:.0f}s: killing it")
                c.proc.kill()
                c.proc.wait()

    def miner(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    # ---- monitoring ----------------------------------------------------------------------------
    def validator_status(self) -> list[dict]:
        return [c.status() for c in self.children if c.kind == "validator"]

    def _supervise(self) -> None:
        now = time.monotonic()
        for c in self.children:
            if c.alive() or c.proc is None:
                continue
            if c.left:
                continue
            if c.died_at is None:
                c.died_at = now
                logger.warning(f"{c.name} exited with code {c.proc.returncode}; see {c.log}")
                if c.kind == "validator" and c.hold_until is None:
                    raise RuntimeError(f"{c.name} died (exit code {c.proc.returncode}); see {c.log}")
            elif c.hold_until is not None:
                if now >= c.hold_until:
                    c.hold_until = None
                    c.restarts += 1
                    logger.info(f"restarting {c.name} (restart #{c.restarts})")
                    self.start(c)
            elif self.restart_dead and c.kind == "miner" and now - c.died_at >= self.restart_delay_s:
                c.restarts += 1
                logger.info(f"restarting {c.name} (restart #{c.restarts})")
                self.start(c)
