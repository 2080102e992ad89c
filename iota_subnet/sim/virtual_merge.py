"""Merges of emulated stages (``--emulate-gpu``) at the stage's real sizes: VIRTUAL payloads.

An emulated stage of ``8b`` stands for 0.9-1.6 G parameters: a merge moves 1.6 GB (int8) per replica
on the link. Holding, quantizing and hashing that on a host that runs many emulated miners is not
possible, so an emulated stage merges a small real *proxy*: :class:`ProxyStage`, one flat float32
parameter of ``ceil(P / k)`` values (:class:`VirtualPayload`; ``P`` the stage's true parameter count,
``k`` a power of two, the smallest that keeps the proxy at most ``max_proxy`` values, 2^20 by
default). The real merge engine runs on the proxy: real plans, shards, reducers, chunks, signed
claims, verification and outer step. What is virtual, and where:

* **message count**: ``merge.chunk_numel`` and ``merge.sync_chunk_numel`` are divided by ``k``
  (:meth:`VirtualPayload.merge_config`), so a shard travels as as many messages as in the real
  merge, each ``1/k`` of the real message's tensor bytes;
* **link bytes, sender side** (:class:`VirtualTransport`, wrapping the engine's peer transport):
  before each request it charges the sender's uplink shaper
  (:class:`~iota_subnet.transport.shaping.UplinkShaper`, the client's, by default the process's)
  the ``(k - 1) x`` tensor bytes the message does not hold, reporting them to the engine's
  ``on_progress`` as the bucket releases them (as the HTTP client reports a body's pieces), then
  sends the real message; a reply's missing ``(k - 1) x`` tensor bytes pass the caller's downlink
  shaper when one is configured;
* **link bytes, responder side** (:meth:`VirtualMergeEngine.handle`, the engine's public route
  handler): a request's missing tensor bytes pass this replica's downlink shaper (when configured),
  and a reply's (a served mean chunk, a contribution) its uplink, before the reply leaves;
* **deadlines** follow the virtual bytes (:meth:`VirtualMergeEngine.phase_bytes`: ``k x`` the
  proxy's scatter bytes);
* **progress**: the caller of a request whose *reply* carries tensors (``/merge/result``,
  ``/merge/contribution``), and a reducer waiting for a contribution, see the responder's / sender's
  virtual bytes only when the whole message arrives (no real byte crosses while they are charged).
  So the watch is per message, not per piece: with shaped links, ``merge.progress_timeout_s`` is
  raised to at least :data:`RATE_SLACK` x the time :data:`LINK_STREAMS` real messages sharing a link
  take, plus its delay (:meth:`VirtualPayload.merge_config`), at the slower of this replica's shaped
  links and the declared uplink ``merge.assumed_uplink_bps`` (a peer's link is not known here: the
  declared rate is what the engine assumes wherever it sees no byte inside a message). A stopped peer
  costs that long, not the progress timeout; a peer slower than the declared uplink, or a stage of
  many more replicas on a slow link, may see a live peer cut there where the real path (bytes
  reported piece by piece) would not;
* **CPU** of encoding, reducing, decoding and hashing the virtual bytes: MODELLED as a delay of
  ``bytes / host_bytes_per_s x time_scale`` (:data:`HOST_BYTES_PER_S`, 2 GB/s of payload bytes per
  step; the event loop is not blocked: only the latency is modelled, not the host's CPU occupancy);
  the proxy's own (1/k) work is real.

State sync (:mod:`iota_subnet.merge.sync`) of an emulated stage is virtual on both sides: it moves the
proxy's anchor and momentum in chunks of ``sync_chunk_numel / k`` values (as many messages as the real
sync) through :class:`VirtualTransport`, so the puller's downlink and modelled CPU are charged the
real bytes, and the donor (:class:`~iota_subnet.sim.virtual_sync.VirtualSnapshotDonor`, the emulated
miner's ``MinerParts.make_snapshot_donor``) charges its uplink each reply's missing bytes and models
the hashing of the virtual snapshot and the encoding of each chunk (:mod:`iota_subnet.sim.virtual_sync`).
Update audits stay off for emulated stages (nothing to
audit: the proxy is not the stage's weights); merge claims are signed over the proxy's values.

Checked against the real path on ``tiny`` (tests/test_virtual_merge.py): bytes the shapers count in a
virtual merge are within 2 % of a real merge's.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from iota_subnet.config import ConfigError, MergeConfig
from iota_subnet.merge import MergeEngine, MergeEngineOptions
from iota_subnet.merge.deadlines import RATE_SLACK, bytes_per_value
from iota_subnet.merge.plan import MergePlan
from iota_subnet.protocol import Message, payload_nbytes
from iota_subnet.transport.shaping import process_downlink, process_shaper

#: Modelled host rate (bytes/s) of one pass over payload bytes (quantize + encode, decode + reduce, hash).
HOST_BYTES_PER_S = 2e9
#: The largest proxy (values) by default: 4 MiB of float32 per tensor the engine keeps.
MAX_PROXY = 1 << 20
#: Messages assumed to share a link at once when the per-message progress watch is sized: a sender's
#: streams to the reducers, or the gatherers a reducer serves (about 2 (N - 1) for N replicas; 8 covers
#: the streams that reach one peer from a replica of a stage of up to 9 replicas).
LINK_STREAMS = 8


@dataclass(frozen=True)
class VirtualPayload:
    """A stage of ``true_numel`` parameters merged as a proxy of ``ceil(true_numel / scale)`` values,
    every proxy value standing for ``scale`` values on the link (see the module docstring).
    ``time_scale``: the emulation's wall-clock slow-down (CPU delays are multiplied by it);
    ``host_bytes_per_s``: the modelled host rate of a pass over payload bytes."""

    true_numel: int
    scale: int = 1
    time_scale: float = 1.0
    host_bytes_per_s: float = HOST_BYTES_PER_S

    def __post_init__(self):
        if self.true_numel < 1 or self.scale < 1:
            raise ValueError(f"a virtual payload needs true_numel >= 1 and scale >= 1, got {self.true_numel}, "
                             f"{self.scale}")
        if not (self.time_scale > 0 and self.host_bytes_per_s > 0):
            raise ValueError("time_scale and host_bytes_per_s must be > 0")

    @classmethod
    def for_stage(cls, true_numel: int, cfg: MergeConfig, *, max_proxy: int = MAX_PROXY,
                  time_scale: float = 1.0) -> "VirtualPayload":
        """The smallest power-of-two scale that keeps the proxy at most ``max_proxy`` values while the
        scaled merge config stays valid (``chunk_numel / k`` a multiple of the int8 / top-k block)."""
        k = 1
        while math.ceil(true_numel / k) > max_proxy and _valid(cfg, 2 * k):
            k *= 2
        return cls(int(true_numel), k, time_scale)

    @property
    def proxy_numel(self) -> int:
        return math.ceil(self.true_numel / self.scale)

    @property
    def virtual_numel(self) -> int:
        """Values the link is charged for: ``proxy_numel x scale`` (at most ``scale - 1`` above the truth)."""
        return self.proxy_numel * self.scale

    def merge_config(self, cfg: MergeConfig, link_bytes_per_s: Optional[float] = None,
                     link_delay_s: float = 0.0, streams: int = LINK_STREAMS) -> MergeConfig:
        """``cfg`` for the proxy: chunks ``1/scale`` as large (as many messages as the real merge); the
        progress timeout at least :data:`RATE_SLACK` x the time ``streams`` real messages sharing a
        link take at ``link_bytes_per_s`` (the slowest link a message's virtual bytes may cross; None:
        nothing shaped, no change), plus ``link_delay_s``. Raises :class:`ConfigError` when ``chunk_numel / scale`` is not a valid chunk."""
        if not _valid(cfg, self.scale):
            raise ConfigError(f"merge.chunk_numel={cfg.chunk_numel} cannot be divided by the virtual scale {self.scale}")
        pt = float(cfg.progress_timeout_s)
        if link_bytes_per_s:
            msg = cfg.chunk_numel * max(bytes_per_value(cfg.scatter_quant, cfg.int8_block),
                                        bytes_per_value(cfg.gather_quant, cfg.int8_block))
            pt = max(pt, RATE_SLACK * (max(1, int(streams)) * msg / float(link_bytes_per_s) + float(link_delay_s)))
        return dataclasses.replace(cfg, chunk_numel=cfg.chunk_numel // self.scale, progress_timeout_s=pt,
                                   sync_chunk_numel=max(1, cfg.sync_chunk_numel // self.scale))

    def extra_bytes(self, msg: Optional[Message]) -> int:
        """Tensor bytes ``msg`` stands for on the link beyond those it holds: ``(scale - 1) x`` its own."""
        return 0 if msg is None else (self.scale - 1) * payload_nbytes(msg)

    def cpu_s(self, nbytes: int) -> float:
        """Modelled wall seconds of one host pass over ``nbytes`` virtual payload bytes."""
        return float(nbytes) / self.host_bytes_per_s * self.time_scale


def _valid(cfg: MergeConfig, k: int) -> bool:
    c = cfg.chunk_numel // k
    if cfg.chunk_numel % k or c < 1:
        return False
    try:
        dataclasses.replace(cfg, chunk_numel=c).validate()
    except ConfigError:
        return False
    return True


class ProxyStage(torch.nn.Module):
    """The real weights an emulated stage merges: one flat float32 parameter of
    ``payload.proxy_numel`` values (``flat``, [proxy_numel]), the same on every replica of the stage
    at the start (drawn from ``seed``). :meth:`drift` moves it as an inner step would, so the
    pseudo-gradients a merge reduces are not zero."""

    def __init__(self, payload: VirtualPayload, seed: int = 0):
        super().__init__()
        self.payload = payload
        g = torch.Generator().manual_seed(int(seed))
        self.flat = torch.nn.Parameter(torch.randn(payload.proxy_numel, generator=g) * 0.02)
        self.drift_seed = int(seed)

    @torch.no_grad()
    def drift(self, step: int, tag: int = 0, size: float = 1e-3) -> None:
        """Add ``size`` x a normal draw seeded by (``seed``, ``step``, ``tag``) (``tag``: tells replicas apart)."""
        g = torch.Generator().manual_seed((self.drift_seed * 1_000_003 + int(step) * 7919 + int(tag)) % (1 << 62))
        self.flat.add_(torch.randn(self.flat.shape, generator=g) * size)


class VirtualTransport:
    """A :class:`~iota_subnet.merge.engine.PeerTransport` that sends ``inner``'s real (proxy) messages
    and charges the links the bytes they stand for (see the module docstring). ``uplink``: the
    sender's :class:`~iota_subnet.transport.shaping.UplinkShaper` (None: unshaped); ``downlink``: its
    :class:`~iota_subnet.transport.shaping.DownlinkShaper` (None: none). ``sent`` / ``received`` in a
    call's answer include the virtual bytes."""

    def __init__(self, inner: Any, payload: VirtualPayload, *, uplink: Any = None, downlink: Any = None):
        self.inner, self.payload, self.uplink, self.downlink = inner, payload, uplink, downlink
        self.virtual_sent = 0                # virtual bytes charged to the uplink / downlink
        self.virtual_received = 0
        self.charges = 0                     # uplink charges made (one per request holding tensors)

    @property
    def on_progress(self) -> Optional[Callable[[str, int], None]]:
        return getattr(self.inner, "on_progress", None)

    @on_progress.setter
    def on_progress(self, fn: Optional[Callable[[str, int], None]]) -> None:
        self.inner.on_progress = fn

    async def call(self, peer: str, route: str, msg: Message, response_type: type) -> tuple[Any, int, int]:
        extra = self.payload.extra_bytes(msg)
        if extra:
            await asyncio.sleep(self.payload.cpu_s(extra))          # quantize + encode (modelled)
            if self.uplink is not None:
                cb = self.on_progress
                await self.uplink.transmit(extra, None if cb is None else (lambda n: cb(peer, n)))
                self.charges += 1
            self.virtual_sent += extra
        reply, sent, received = await self.inner.call(peer, route, msg, response_type)
        rextra = self.payload.extra_bytes(reply)
        if rextra:
            if self.downlink is not None:
                await self.downlink.receive(rextra)
            await asyncio.sleep(self.payload.cpu_s(rextra))         # decode + hash (modelled)
            self.virtual_received += rextra
        return reply, sent + extra, received + rextra


class VirtualMergeEngine(MergeEngine):
    """A :class:`~iota_subnet.merge.engine.MergeEngine` over a :class:`ProxyStage` whose payloads stand
    for the stage's real bytes (see the module docstring). Same arguments as the engine; ``params``
    must read a :class:`ProxyStage` (its ``payload`` gives the scale). ``cfg`` is the run's merge
    config; the engine keeps the proxy's (:meth:`VirtualPayload.merge_config`). The uplink and
    downlink charged are the transport client's shapers when it has them (``transport.client``), else
    the process's (:func:`~iota_subnet.transport.shaping.process_shaper`,
    :func:`~iota_subnet.transport.shaping.process_downlink`). Raises ValueError for other params."""

    def __init__(self, me: str, cfg: MergeConfig, params: Any, transport: Any = None, *, run_id: str = "",
                 stage: int = 0, options: MergeEngineOptions = MergeEngineOptions()):
        payload = getattr(params.module, "payload", None)
        if not isinstance(payload, VirtualPayload):
            raise ValueError("a virtual merge needs the params of a ProxyStage (its payload gives the scale)")
        client = getattr(transport, "client", None)
        self.payload = payload
        self.charges = 0                     # uplink charges made for replies holding tensors
        self.uplink = getattr(client, "shaper", None) or process_shaper()
        self.downlink = getattr(client, "downlink", None) or process_downlink()
        # the slowest link a message's virtual bytes may cross: this replica's shaped links, or a peer's
        # at the declared uplink (merge.assumed_uplink_bps, the rate assumed where no byte inside a
        # message is seen); nothing shaped here: nothing virtual is charged, messages take no longer
        shaped = [s for s in (self.uplink, self.downlink) if s is not None]
        rates = [s.link.bytes_per_s for s in shaped if s.link.bytes_per_s] + [cfg.assumed_uplink_bps / 8]
        delay = self.uplink.link.delay_s if self.uplink is not None else 0.0
        vt = None if transport is None else VirtualTransport(transport, payload, uplink=self.uplink,
                                                              downlink=self.downlink)
        super().__init__(me, payload.merge_config(cfg, min(rates) if shaped else None, delay), params, vt,
                         run_id=run_id, stage=stage, options=options)

    def status(self) -> dict:
        """The engine's status plus ``virtual``: the true and proxy sizes, the scale and the virtual
        bytes charged (as sender and as responder)."""
        d = super().status()
        p, t = self.payload, self.transport
        d["virtual"] = {"true_numel": p.true_numel, "proxy_numel": p.proxy_numel, "scale": p.scale,
                        "charges": self.charges + (t.charges if t is not None else 0),
                        "virtual_sent": t.virtual_sent if t is not None else 0,
                        "virtual_received": t.virtual_received if t is not None else 0}
        return d

    def phase_bytes(self, plan: MergePlan) -> float:
        """The virtual scatter's bytes: ``scale x`` the proxy's."""
        return super().phase_bytes(plan) * self.payload.scale

    async def handle(self, route: str, msg: Message, caller: str) -> Message:
        """The engine's route handler, with the virtual bytes of the request (downlink, then the
        modelled decode / reduce) and of the reply (modelled encode / hash, then the uplink) charged."""
        extra_in = self.payload.extra_bytes(msg)
        if extra_in:
            if self.downlink is not None:
                await self.downlink.receive(extra_in)
            await asyncio.sleep(self.payload.cpu_s(extra_in))
        reply = await super().handle(route, msg, caller)
        extra = self.payload.extra_bytes(reply)
        if extra:
            await asyncio.sleep(self.payload.cpu_s(extra))
            if self.uplink is not None:
                await self.uplink.transmit(extra)
                self.charges += 1
        if extra or extra_in:
            self._count(extra, extra_in)
        return reply
