"""Supervised long-lived tasks: an exception is logged with its traceback, the task restarts after a
backoff, and the neuron's status, ``/health`` and metrics show it.

A neuron registers every loop it runs for its whole life (receipt sender, ticket driver, audit rounds,
merges, publishers, metagraph refresh, the dashboard sampler) with one :class:`Supervisor`::

    sup = Supervisor("miner")
    sup.spawn("receipts", plane.flush_loop)          # a factory: called again on every restart
    ...
    status["tasks"] = sup.status()                    # name -> state, restarts, last error
    healthy = sup.healthy                             # False once a task failed ``unhealthy_after`` times in a row

A factory that returns normally has finished its work and is not restarted; one that raises is
restarted after ``base_backoff_s * 2**(k-1)`` seconds (capped at ``max_backoff_s``) for its ``k``-th
consecutive failure. A run of ``stable_after_s`` seconds without an exception resets the count, so a
task that failed once an hour stays healthy while one that fails on every start turns the neuron
unhealthy after ``unhealthy_after`` failures (and keeps being retried at ``max_backoff_s``).
Cancellation (a neuron stopping) is never counted as a failure.

Tests inject faults by subclassing and overriding :meth:`Supervisor.wrap` (a public seam that
every spawned factory passes through), never by patching the tasks themselves.
"""
from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Optional

from loguru import logger

Factory = Callable[[], Awaitable[Any]]


@dataclass
class TaskRecord:
    """What the supervisor knows of one named task (times are unix seconds)."""

    name: str
    state: str = "starting"              # running | backoff | done | stopped
    restarts: int = 0                    # restarts since the neuron started
    failures: int = 0                    # exceptions since the neuron started
    consecutive: int = 0                 # exceptions since the last stable run
    last_error: Optional[str] = None     # "ExcType: message" of the latest exception
    last_error_at: Optional[float] = None
    started_at: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        return {"state": self.state, "restarts": self.restarts, "failures": self.failures,
                "consecutive_failures": self.consecutive, "last_error": self.last_error,
                "last_error_at": self.last_error_at}


class Supervisor:
    """Runs and restarts a neuron's long-lived tasks (see the module docstring).

    ``owner``: a label for logs (``"miner"``, ``"validator"``); ``base_backoff_s``, ``max_backoff_s``:
    seconds before a restart; ``unhealthy_after``: consecutive failures of one task that make
    :attr:`healthy` False; ``stable_after_s``: seconds of a run without an exception after which the
    consecutive count starts again from 0.
    """

    def __init__(self, owner: str, *, base_backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 unhealthy_after: int = 5, stable_after_s: float = 60.0):
        if base_backoff_s < 0 or max_backoff_s < base_backoff_s:
            raise ValueError(f"backoff must satisfy 0 <= base ({base_backoff_s}) <= max ({max_backoff_s})")
        if unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be >= 1, got {unhealthy_after}")
        self.owner = owner
        self.base_backoff_s, self.max_backoff_s = float(base_backoff_s), float(max_backoff_s)
        self.unhealthy_after = int(unhealthy_after)
        self.stable_after_s = float(stable_after_s)
        self.records: dict[str, TaskRecord] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    # ------------------------------------------------------------------ seam
    def wrap(self, name: str, factory: Factory) -> Factory:
        """The factory actually run for ``name``; the identity here. Subclasses (fault injection in
        tests) return a wrapper, for example one that raises on its first call."""
        return factory

    # ------------------------------------------------------------------ running
    def spawn(self, name: str, factory: Factory) -> asyncio.Task:
        """Start ``factory()`` under supervision as task ``name`` (unique among running tasks).

        Raises ValueError if a task of that name is still running."""
        old = self.tasks.get(name)
        if old is not None and not old.done():
            raise ValueError(f"{self.owner}: a supervised task named {name!r} is already running")
        rec = self.records.get(name) or TaskRecord(name)
        rec.state = "starting"
        self.records[name] = rec
        task = asyncio.create_task(self._supervise(rec, self.wrap(name, factory)), name=f"supervised:{name}")
        self.tasks[name] = task
        return task

    async def _supervise(self, rec: TaskRecord, factory: Factory) -> None:
        while True:
            rec.state, rec.started_at = "running", time.time()
            try:
                await factory()
            except asyncio.CancelledError:
                rec.state = "stopped"
                raise
            except Exception as e:  # noqa: BLE001 - every failure of a supervised task is logged and retried
                now = time.time()
                if now - rec.started_at >= self.stable_after_s:
                    rec.consecutive = 0
                rec.failures += 1
                rec.consecutive += 1
                rec.last_error, rec.last_error_at = f"{type(e).__name__}: {e}", now
                delay = min(self.max_backoff_s, self.base_backoff_s * 2 ** (rec.consecutive - 1))
                logger.opt(exception=e).error(
                    f"{self.owner}: task {rec.name!r} failed ({rec.consecutive} in a row, {rec.failures} in all); "
                    f"restarting in {delay:.1f} s\n{''.join(traceback.format_exception(e)).rstrip()}")
                rec.state = "backoff"
                try:
                    await asyncio.sleep(delay)
                except asyncio.CancelledError:
                    rec.state = "stopped"
                    raise
                rec.restarts += 1
                continue
            rec.state, rec.consecutive = "done", 0
            return

    async def stop(self, timeout_s: float = 5.0, names: Optional[Iterable[str]] = None) -> None:
        """Cancel every task (or those named in ``names``: a part stopping its own loops) and wait up
        to ``timeout_s`` seconds for them to end."""
        wanted = set(self.tasks) if names is None else set(names)
        live = [t for n, t in self.tasks.items() if n in wanted and not t.done()]
        for t in live:
            t.cancel()
        if live:
            await asyncio.wait(live, timeout=timeout_s)

    # ------------------------------------------------------------------ reporting
    @property
    def healthy(self) -> bool:
        """False while some task has failed ``unhealthy_after`` or more times in a row."""
        return not self.failing()

    def failing(self) -> list[str]:
        """Names of the tasks that make the neuron unhealthy."""
        now = time.time()
        return sorted(n for n, r in self.records.items()
                      if r.consecutive >= self.unhealthy_after
                      and not (r.state == "running" and now - r.started_at >= self.stable_after_s))

    def status(self) -> dict[str, dict]:
        """Name -> ``{state, restarts, failures, consecutive_failures, last_error, last_error_at}``."""
        return {n: r.to_json() for n, r in sorted(self.records.items())}
