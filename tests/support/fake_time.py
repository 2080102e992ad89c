"""An injected clock and sleep for emulated workers (their ``clock=`` / ``sleep=`` arguments)."""
from __future__ import annotations


class FakeSleep:
    """A sleep that advances its own clock instead of waiting: ``calls`` lists every sleep (seconds),
    ``now`` / :meth:`clock` the seconds slept so far."""

    def __init__(self):
        self.calls: list[float] = []
        self.now = 0.0

    def __call__(self, s: float) -> None:
        self.calls.append(s)
        self.now += s

    def clock(self) -> float:
        return self.now
