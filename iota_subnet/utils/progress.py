"""Progress of long operations with an estimate of the time left.

On a terminal a ``tqdm`` bar (rate and ETA in its ``[elapsed<remaining]`` field); otherwise (a log
file, a service manager, CI) one plain log line every ``log_every_s`` seconds::

    tokenizing: 3,145,728/10,485,760 chars (30.0%), 1,048,576 chars/s, ETA 7 s

and a closing ``done`` line. The ETA is (total - done) / rate, with the rate measured since the
operation (re)started; with an unknown total there is no ETA, only the count and the rate.

Use::

    with Progress(total=n_chunks, desc="state sync", unit="chunk") as p:
        for ...:
            p.update(1)
"""
from __future__ import annotations

import sys
import time
from typing import IO, Any, Callable, Optional

from loguru import logger


def format_seconds(s: Optional[float]) -> str:
    """``73`` -> ``"1 min 13 s"``; None or negative -> ``"?"``."""
    if s is None or s < 0 or s != s:
        return "?"
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


def _int(x: Optional[float]) -> Optional[float]:
    return int(x) if x is not None and float(x).is_integer() else x


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 or float(x).is_integer() else f"{x:,.2f}"


class Progress:
    """Progress of one operation (see the module docstring).

    ``total``: units of work (None: unknown); ``initial``: units already done (a resumed
    operation; they do not count toward the rate); ``tty``: force the terminal (True) or log-line
    (False) form, default: whether ``stream`` (stderr) is a terminal; ``log``: the plain-line sink
    (default ``loguru.logger.info``); ``min_total``: below this total nothing is shown at all (a
    1 MB checkpoint needs no bar).
    """

    def __init__(self, total: Optional[float], desc: str, unit: str = "it", *, initial: float = 0,
                 tty: Optional[bool] = None, stream: Optional[IO[str]] = None, log_every_s: float = 10.0,
                 log: Optional[Callable[[str], Any]] = None, min_total: float = 0, unit_scale: bool = False):
        self.total = None if total is None else float(total)
        self.desc, self.unit = desc, unit
        self.done = float(initial)
        self._initial = float(initial)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(tty) if tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.log_every_s = float(log_every_s)
        self._log = log if log is not None else logger.info
        self.quiet = self.total is not None and self.total < min_total
        self.t0 = time.monotonic()
        self._last_log = self.t0
        self._closed = False
        self._bar = None
        if not self.quiet and self.tty:
            from tqdm import tqdm
            self._bar = tqdm(total=_int(self.total), initial=_int(initial), desc=desc, unit=unit, file=self.stream,
                             dynamic_ncols=True, unit_scale=unit_scale, leave=True)

    # ------------------------------------------------------------------ measurement
    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.t0

    @property
    def rate(self) -> Optional[float]:
        """Units per second since the start (None before any progress)."""
        el, n = self.elapsed_s, self.done - self._initial
        return n / el if el > 0 and n > 0 else None

    @property
    def eta_s(self) -> Optional[float]:
        """Seconds left at the current rate (None: unknown total or no progress yet)."""
        r = self.rate
        if self.total is None or r is None:
            return None
        return max(0.0, (self.total - self.done) / r)

    def line(self) -> str:
        """The plain form: ``desc: done/total unit (pct%), rate unit/s, ETA ...``."""
        r = self.rate
        rate = f"{_num(r)} {self.unit}/s" if r is not None else f"- {self.unit}/s"
        if self.total:
            pct = 100.0 * self.done / self.total
            return (f"{self.desc}: {_num(self.done)}/{_num(self.total)} {self.unit} ({pct:.1f}%), {rate}, "
                    f"ETA {format_seconds(self.eta_s)}")
        return f"{self.desc}: {_num(self.done)} {self.unit}, {rate}"

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ updates
    def update(self, n: float = 1) -> None:
        self.set(self.done + n)

    def set(self, done: float, postfix: Optional[str] = None) -> None:
        """Set the units done (absolute); ``postfix``: a short status shown after the bar / line."""
        delta = float(done) - self.done
        self.done = float(done)
        if self.quiet or self._closed:
            return
        if self._bar is not None:
            if delta:
                self._bar.update(_int(delta))
            if postfix is not None:
                self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.refresh()
            return
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s:
            self._last_log = now
            self._log(self.line() + (f" ({postfix})" if postfix else ""))

    def close(self, message: Optional[str] = None) -> None:
        """Finish: the bar is closed; the log gets a ``done`` line (elapsed time and rate)."""
        if self._closed:
            return
        self._closed = True
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.close()
            return
        r = self.rate
        self._log(f"{self.desc}: done, {_num(self.done)} {self.unit} in {format_seconds(self.elapsed_s)}"
                  + (f" ({_num(r)} {self.unit}/s)" if r else "") + (f"; {message}" if message else ""))

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
