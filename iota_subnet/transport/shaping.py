"""Link emulation: a neuron's uplink as a token bucket plus a one-way delay per message, and
optionally its downlink as a second token bucket.

``--link RATE:DELAY`` (``100mbit:50ms``, ``1gbit:10ms``, ``loopback``) makes one machine behave like
neurons on the internet: everything a neuron sends -- the requests of its :class:`NeuronClient`
(s) and the responses of its :class:`NeuronServer`, HTTP head and body -- passes one
:class:`UplinkShaper` per neuron (process), so concurrent transfers share its rate, as on a real
uplink. A message of ``n`` bytes leaves after the bucket has released its bytes (``n / rate`` once
the burst is spent) and arrives ``delay`` later; delays of concurrent messages overlap (propagation,
not occupancy). Bytes are released in chunks of about 5 ms of link time, taken in turn, so a small
message is not stuck behind a large one (concurrent flows share the rate roughly fairly, as TCP
flows do); each message keeps its next chunk booked while it waits, so a late wake-up of its task
does not idle the link (as a socket buffer keeps a real link busy).

Wire bytes counted per message: the body, an HTTP/1.1 head (:func:`request_head_bytes`,
:func:`response_head_bytes`: the headers we send plus aiohttp's defaults), and per TCP segment the
TCP/IP/Ethernet headers (:data:`SEGMENT_OVERHEAD` bytes per :data:`MSS` of payload), which is what
``tc tbf`` on a veth counts (``scripts/bench_link.py`` compares the two).

Asymmetric links: ``--link UP/DOWN:DELAY`` (``20mbit/100mbit:100ms``) adds a downlink of rate DOWN
(:class:`DownlinkShaper`): every message the neuron receives -- response bodies read by its clients,
request bodies read by its server, HTTP head included -- is charged to it once fully read, so
concurrent downloads share DOWN, as on a real access link. The downlink adds no delay (the sender's
uplink carries the one-way delay) and is store-and-forward: a message crossing a shaped uplink and a
shaped downlink pays both transfer times (pessimistic for one message; with several messages in
flight, as state sync keeps, both links are busy at once and the throughput is the lower rate). A
single RATE (no ``/``) shapes the uplink only, as always.

``time_scale`` (``--time-scale``, with ``--emulate-gpu``) slows links like emulated compute: the rate
is divided by it and the delay multiplied, so emulated time = wall time / time_scale throughout.

The token bucket is the GCRA form (virtual scheduling, ITU-T I.371): no task and no event loop of
its own, thread-safe, usable from any event loop of the process.

Fault injection (``--link-control FILE``, written by ``localnet --chaos``): the shaper re-reads the
JSON file at most every :data:`CONTROL_POLL_S` seconds while it sends. ``{"down": true}``: the link is
partitioned, every send fails with :class:`LinkDown` (an ``OSError``: clients retry, then raise
``TransportError``; a server drops the connection instead of answering); ``{"slow": f}``: the rate is
divided by f and the delay multiplied by f, and the neuron's compute takes f times as long
(:func:`compute_slowdown`, read by the miner's compute thread: on an unshaped loopback link that is
the only effect); ``{}`` (or no file) heals.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable, Mapping, Optional

from loguru import logger

from iota_subnet.config import ConfigError

#: TCP payload per segment on a 1500-byte MTU with TCP timestamps (1500 - 20 IP - 20 TCP - 12 options).
MSS = 1448
#: Bytes per segment besides the payload: IP 20 + TCP 20 + options 12 + Ethernet 14.
SEGMENT_OVERHEAD = 66
#: Seconds between reads of the ``--link-control`` file.
CONTROL_POLL_S = 0.25
#: The link profiles of the WAN bench (``scripts/bench_wan.py``).
LINK_PROFILES = ("loopback", "1gbit:10ms", "100mbit:50ms", "20mbit:100ms")

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUM = r"(\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"


@dataclass(frozen=True)
class LinkSpec:
    """An uplink: ``rate_bps`` bits per second (None: unlimited) and a one-way ``delay_s`` per message;
    ``down_rate_bps``: the downlink's bits per second (None: the downlink is not shaped)."""

    rate_bps: Optional[float]
    delay_s: float = 0.0
    down_rate_bps: Optional[float] = None

    @property
    def loopback(self) -> bool:
        return self.rate_bps is None and self.delay_s == 0 and self.down_rate_bps is None

    @property
    def bytes_per_s(self) -> Optional[float]:
        return None if self.rate_bps is None else self.rate_bps / 8.0

    def scaled(self, time_scale: float) -> "LinkSpec":
        """The link ``time_scale`` times slower (rate / s, delay x s)."""
        if not time_scale > 0:
            raise ConfigError(f"--time-scale {time_scale!r} must be > 0")
        rate = None if self.rate_bps is None else self.rate_bps / time_scale
        down = None if self.down_rate_bps is None else self.down_rate_bps / time_scale
        return LinkSpec(rate, self.delay_s * time_scale, down)

    def transfer_s(self, nbytes: int, burst_bytes: int = 0) -> float:
        """Seconds for one message of ``nbytes`` (wire bytes) on an idle link, delay included."""
        if self.rate_bps is None:
            return self.delay_s
        return max(0, nbytes - burst_bytes) / self.bytes_per_s + self.delay_s

    def __str__(self) -> str:
        if self.loopback:
            return "loopback"
        rate = "unlimited" if self.rate_bps is None else _fmt_rate(self.rate_bps)
        if self.down_rate_bps is not None:
            rate += "/" + _fmt_rate(self.down_rate_bps)
        return f"{rate}:{self.delay_s * 1e3:g}ms"


def _fmt_rate(bps: float) -> str:
    for unit, f in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= f:
            return f"{bps / f:g}{unit}"
    return f"{bps:g}bit"


def _parse_rate(text: str, rate_s: str, hint: str) -> float:
    m = re.fullmatch(rf"({_NUM})\s*([a-z]+)", rate_s.strip())
    if not m or m.group(3) not in _RATE_UNITS:
        raise ConfigError(f"--link {text!r}: bad rate {rate_s!r}; {hint}")
    return float(m.group(1)) * _RATE_UNITS[m.group(3)]


def parse_link(text: Optional[str]) -> LinkSpec:
    """``loopback`` (or empty / None) | ``RATE[:DELAY]`` | ``UP/DOWN[:DELAY]`` with RATE, UP and DOWN
    a number and ``bit``, ``kbit``, ``mbit``, ``gbit`` (tc's units: bits per second) and DELAY a
    number and ``us``, ``ms``, ``s`` (default 0). ``100mbit:50ms`` -> uplink 100e6 bit/s, 0.05 s,
    downlink not shaped; ``20mbit/100mbit:100ms`` -> uplink 20e6 bit/s, downlink 100e6 bit/s, 0.1 s.

    Raises :class:`ConfigError` with the accepted form.
    """
    hint = ("use RATE:DELAY such as 100mbit:50ms or 1gbit:10ms, or UP/DOWN:DELAY such as 20mbit/100mbit:100ms "
            "(units bit/kbit/mbit/gbit and us/ms/s), or loopback")
    if text is None or not str(text).strip() or str(text).strip().lower() == "loopback":
        return LinkSpec(None, 0.0)
    s = str(text).strip().lower()
    rate_s, _, delay_s = s.partition(":")
    up_s, slash, down_s = rate_s.partition("/")
    rate = _parse_rate(text, up_s, hint)
    down = _parse_rate(text, down_s, hint) if slash else None
    if down is not None and not (down > 0 and math.isfinite(down)):
        raise ConfigError(f"--link {text!r}: the downlink rate must be > 0; {hint}")
    delay = 0.0
    if delay_s.strip():
        d = re.fullmatch(rf"({_NUM})\s*([a-z]+)", delay_s.strip())
        if not d or d.group(3) not in _TIME_UNITS:
            raise ConfigError(f"--link {text!r}: bad delay {delay_s!r}; {hint}")
        delay = float(d.group(1)) * _TIME_UNITS[d.group(3)]
    if not (rate > 0 and math.isfinite(rate)) or not (delay >= 0 and math.isfinite(delay)):
        raise ConfigError(f"--link {text!r}: the rate must be > 0 and the delay >= 0; {hint}")
    return LinkSpec(rate, delay, down)


def segment_overhead(payload_bytes: int) -> int:
    """TCP/IP/Ethernet header bytes of ``payload_bytes`` sent in MSS-sized segments."""
    return math.ceil(max(0, payload_bytes) / MSS) * SEGMENT_OVERHEAD


def _header_bytes(headers: Mapping[str, str]) -> int:
    return sum(len(k) + len(str(v)) + 4 for k, v in headers.items())     # "k: v\r\n"


#: aiohttp's own request headers besides ours: Host (~20), Accept, Accept-Encoding, User-Agent, Content-Length.
_CLIENT_DEFAULT_HEAD = len("Host: 127.0.0.1:65535\r\nAccept: */*\r\nAccept-Encoding: gzip, deflate\r\n"
                           "User-Agent: Python/3.11 aiohttp/3.13.0\r\nContent-Length: 1234567\r\n\r\n")
#: aiohttp's own response headers besides ours: Content-Length, Date, Server.
_SERVER_DEFAULT_HEAD = len("Content-Length: 1234567\r\nDate: Sun, 29 Nov 2026 21:35:00 GMT\r\n"
                           "Server: Python/3.11 aiohttp/3.13.0\r\n\r\n")


def request_head_bytes(method: str, path: str, headers: Mapping[str, str]) -> int:
    """Bytes of the HTTP/1.1 request line and headers aiohttp sends with ``headers`` (within ~10 bytes)."""
    return len(f"{method} {path} HTTP/1.1\r\n") + _header_bytes(headers) + _CLIENT_DEFAULT_HEAD


def response_head_bytes(status: int, headers: Mapping[str, str]) -> int:
    """Bytes of the HTTP/1.1 status line and headers of a response with ``headers`` (within ~10 bytes)."""
    return len(f"HTTP/1.1 {status} OK\r\n") + _header_bytes(headers) + _SERVER_DEFAULT_HEAD


class LinkDown(OSError):
    """The emulated link is partitioned (``--link-control`` says ``down``): nothing can be sent."""


class UplinkShaper:
    """One neuron's uplink (see the module docstring).

    ``burst_bytes``: bucket depth (default 32 KiB): this many bytes leave at once after idle time.
    ``control_path``: the ``--link-control`` file (partition / slow-down), or None.
    ``clock`` / ``sleep``: injectable for tests. Counters: ``messages``, ``payload_bytes`` (what the
    callers passed: body + HTTP head), ``wire_bytes`` (plus TCP/IP/Ethernet headers), ``wait_s``
    (seconds callers spent waiting for the bucket, delay excluded), ``refused`` (sends while down).
    """

    def __init__(self, link: LinkSpec, *, burst_bytes: int = 32 << 10, count_segments: bool = True,
                 control_path: Optional[str | Path] = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.link = link
        self.burst_bytes = int(burst_bytes)
        self.count_segments = count_segments
        self.control_path = Path(control_path) if control_path else None
        self._clock, self._sleep = clock, sleep
        rate = link.bytes_per_s
        self._rate = rate
        self._burst_s = self.burst_bytes / rate if rate else 0.0
        #: release chunk: about 5 ms of link time, at least 16 KiB
        self.chunk_bytes = max(16 << 10, int(rate * 0.005)) if rate else 0
        self._tat = 0.0                   # GCRA theoretical arrival time of the next byte
        self._lock = threading.Lock()
        #: fault state from the control file: partitioned, and the slow-down factor (1 = none)
        self.down = False
        self.slow = 1.0
        self._control_read_at = -math.inf
        self.messages = 0
        self.payload_bytes = 0
        self.wire_bytes = 0
        self.wait_s = 0.0
        self.refused = 0

    def _poll_control(self) -> None:
        """Re-read the control file (at most every :data:`CONTROL_POLL_S` s); a bad file heals."""
        if self.control_path is None:
            return
        now = self._clock()
        if now - self._control_read_at < CONTROL_POLL_S:
            return
        self._control_read_at = now
        try:
            state = json.loads(self.control_path.read_text()) if self.control_path.exists() else {}
            down, slow = bool(state.get("down", False)), float(state.get("slow", 1.0))
            if not (slow >= 1.0 and math.isfinite(slow)):
                raise ValueError(f"slow factor {slow!r} must be >= 1")
        except (OSError, ValueError, TypeError, AttributeError) as e:
            logger.warning(f"ignoring link control {self.control_path}: {e}")
            down, slow = False, 1.0
        if (down, slow) != (self.down, self.slow):
            logger.info(f"EMULATED LINK {'partitioned' if down else f'slowed x{slow:g}' if slow > 1 else 'healed'}")
            if slow > 1 and self._rate is None and self.link.delay_s == 0:
                logger.info("the link is unshaped (no --link RATE:DELAY): the slow-down slows the compute only")
        self.down, self.slow = down, slow

    def slow_factor(self) -> float:
        """The control file's slow-down factor now (1.0: none); re-reads the file when due."""
        self._poll_control()
        return self.slow

    def _reserve(self, nbytes: int) -> float:
        """Book ``nbytes`` on the link; seconds until they have left."""
        with self._lock:
            now = self._clock()
            start = max(self._tat, now)
            self._tat = start + nbytes * self.slow / self._rate
            return max(0.0, self._tat - self._burst_s - now)

    def wire_size(self, nbytes: int) -> int:
        return nbytes + (segment_overhead(nbytes) if self.count_segments else 0)

    async def transmit(self, nbytes: int, on_bytes: Optional[Callable[[int], None]] = None) -> None:
        """Wait until a message of ``nbytes`` (HTTP head + body) has crossed this uplink: its bytes
        released by the bucket, then the one-way delay. ``on_bytes(n)``: called as each piece of
        ``n`` wire bytes leaves (progress, as a socket's peer sees bytes arrive). Raises
        :class:`LinkDown` while partitioned."""
        await self.release(nbytes, on_bytes)
        if self.link.delay_s > 0:
            await self._sleep(self.link.delay_s * self.slow)

    async def release(self, nbytes: int, on_bytes: Optional[Callable[[int], None]] = None) -> None:
        """:meth:`transmit` without the one-way delay: wait until the bucket has released ``nbytes``.
        For one frame of a stream whose frames follow one another on the link (a relay's frames,
        :mod:`iota_subnet.transport.relay`): their delays overlap, as a stream's packets' do. Raises
        :class:`LinkDown` while partitioned."""
        self._poll_control()
        if self.down:
            with self._lock:
                self.refused += 1
            raise LinkDown("emulated link partitioned (--link-control)")
        wire = self.wire_size(int(nbytes))
        with self._lock:
            self.messages += 1
            self.payload_bytes += int(nbytes)
            self.wire_bytes += wire
        if self._rate:
            t0 = self._clock()
            left = wire
            pending: Optional[float] = None      # when the previously booked chunk has left
            pending_n = 0
            while left > 0:
                chunk = min(left, self.chunk_bytes)
                left -= chunk
                # book this chunk before waiting for the previous one: one chunk always queued, so
                # a late wake-up of this task does not leave the link idle (a socket buffer's job)
                leaves = self._clock() + self._reserve(chunk)
                if pending is not None:
                    await self._sleep_until(pending)
                    if on_bytes is not None:
                        on_bytes(pending_n)
                pending, pending_n = leaves, chunk
            await self._sleep_until(pending)
            if on_bytes is not None:
                on_bytes(pending_n)
            with self._lock:
                self.wait_s += self._clock() - t0

    async def _sleep_until(self, t: float) -> None:
        dt = t - self._clock()
        if dt > 0:
            await self._sleep(dt)

    def stats(self) -> dict:
        return {"link": str(self.link), "messages": self.messages, "payload_bytes": self.payload_bytes,
                "wire_bytes": self.wire_bytes, "wait_s": round(self.wait_s, 3), "down": self.down,
                "slow": self.slow, "refused_while_down": self.refused}


class DownlinkShaper(UplinkShaper):
    """One neuron's downlink (see the module docstring): a token bucket at ``rate_bps`` that every
    message this neuron receives passes once read in full; no delay. Same options, control file
    (``slow`` divides the rate; ``down`` fails the receive with :class:`LinkDown`) and counters as
    :class:`UplinkShaper`."""

    def __init__(self, rate_bps: float, **kw):
        super().__init__(LinkSpec(float(rate_bps), 0.0), **kw)

    async def receive(self, nbytes: int) -> None:
        """Wait until a message of ``nbytes`` (HTTP head + body) has crossed this downlink.
        Raises :class:`LinkDown` while partitioned."""
        await self.transmit(nbytes)


_process_shaper: Optional[UplinkShaper] = None
_process_downlink: Optional[DownlinkShaper] = None


def configure_process_link(link: Optional[LinkSpec], time_scale: float = 1.0,
                           control_path: Optional[str | Path] = None, **kw) -> Optional[UplinkShaper]:
    """Install the uplink (and, when ``link`` has a downlink rate, the downlink: :func:`process_downlink`)
    every :class:`NeuronClient` and :class:`NeuronServer` of this process uses unless given another
    one (``None`` or loopback without ``control_path``: no shaping). Call once at process start,
    before creating clients and servers. Returns the uplink shaper."""
    global _process_shaper, _process_downlink
    link = link or LinkSpec(None, 0.0)
    scaled = link.scaled(time_scale) if time_scale != 1.0 else link
    if link.loopback and control_path is None:
        _process_shaper = None
    else:
        _process_shaper = UplinkShaper(scaled, control_path=control_path, **kw)
    _process_downlink = (None if scaled.down_rate_bps is None
                         else DownlinkShaper(scaled.down_rate_bps, control_path=control_path, **kw))
    return _process_shaper


def process_shaper() -> Optional[UplinkShaper]:
    """The uplink installed by :func:`configure_process_link`, or None."""
    return _process_shaper


def process_downlink() -> Optional[DownlinkShaper]:
    """The downlink installed by :func:`configure_process_link` (``--link UP/DOWN:DELAY``), or None."""
    return _process_downlink


def compute_slowdown() -> float:
    """How many times longer this process's compute should take now (the ``slow`` of its
    ``--link-control`` file; 1.0 without one). The chaos harness's ``slow`` event: a slower link and
    a slower accelerator."""
    sh = _process_shaper
    return sh.slow_factor() if sh is not None else 1.0
