"""Fault injection into a neuron's supervised tasks, through the public seam
:meth:`iota_subnet.utils.supervise.Supervisor.wrap` (no hook in production code)."""
from __future__ import annotations

import re
from typing import Iterable, Optional

from iota_subnet.utils.supervise import Supervisor


class FaultySupervisor(Supervisor):
    """A :class:`Supervisor` whose spawned factories raise ``RuntimeError`` on their first
    ``fail_times`` calls, then run as given. ``only``: the task names that fail (None: every task).
    :attr:`calls`: name -> how many times its factory was called (every task ever registered)."""

    def __init__(self, *a, fail_times: int = 1, only: Optional[Iterable[str]] = None, **kw):
        super().__init__(*a, **kw)
        self.fail_times = fail_times
        self.only = set(only) if only is not None else None
        self.calls: dict[str, int] = {}

    def wrap(self, name, factory):
        async def faulty():
            self.calls[name] = self.calls.get(name, 0) + 1
            if (self.only is None or name in self.only) and self.calls[name] <= self.fail_times:
                raise RuntimeError(f"injected fault {self.calls[name]} in {name}")
            return await factory()
        return faulty


def task_counters(prom_text: str, metric: str = "iota_task_restarts_total") -> dict[str, float]:
    """``{task: value}`` of a labelled task metric in a Prometheus text exposition."""
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{metric}{{task="([^"]+)"}} (\S+)$', prom_text, flags=re.M)}
