"""A miner that cannot be dialled (behind a home router's NAT) is reached through relays.

``--relay`` (:attr:`~iota_subnet.miner.options.ServeOptions.relays`), each one of:

* ``ip:port``: a neuron that hosts a relay (its hotkey is the one serving that axon on the metagraph);
* ``HOTKEY@ip:port``: a relay that is not on the metagraph;
* ``auto``: the run's relay hosts, from their commitments (``rh``; validators first), at most two.

The miner stays attached to every one of them, each over an outbound WebSocket
(:class:`~iota_subnet.transport.relay.RelayTunnel`, one per relay, all in the supervised task
``relay``; a tunnel whose relay dies reattaches with backoff), publishes the first relay's address
as its axon and every relay in its commitment (``rl``), so validators and peers reach it through any
of them with no configuration of theirs (:class:`~iota_subnet.transport.NeuronClient` tries a
neuron's other relays when one does not answer, and avoids it for a while). Nothing it sends or receives can be forged or replayed by a
relay: requests and answers stay signed end to end.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from loguru import logger

from iota_subnet.protocol.commitment import MAX_RELAYS
from iota_subnet.transport.relay import RelayTunnel
from iota_subnet.errors import UserError

from .chain_view import ChainView

#: relays an ``auto`` miner attaches through (the first is its axon)
AUTO_RELAYS = 2


class RelayConfigError(UserError):
    """A ``--relay`` that names no relay this miner can use (message says which and why)."""


class MinerRelays:
    """The miner's relays (module docstring): ``specs`` from ``--relay`` (empty: dialled directly)."""

    def __init__(self, specs: tuple[str, ...], view: ChainView, keypair: Any):
        self.specs = tuple(specs)
        self.view = view
        self.keypair = keypair
        #: (endpoint, relay hotkey) chosen at :meth:`resolve`; the tunnel, built once the server listens
        self.relays: list[tuple[str, str]] = []
        self.tunnels: list[RelayTunnel] = []

    @property
    def enabled(self) -> bool:
        return bool(self.specs)

    async def resolve(self, wait_s: float = 120.0) -> list[tuple[str, str]]:
        """The relays to use, from the specs and the chain view (``auto`` waits up to ``wait_s``,
        re-reading the metagraph, for a relay host to publish itself); raises :class:`RelayConfigError`."""
        hosts = [h for h in self.view.relay_hosts() if h[1] != self.view.hotkey]
        deadline = time.monotonic() + wait_s
        while "auto" in self.specs and not hosts and time.monotonic() < deadline:
            logger.info("--relay auto: waiting for a neuron of run {!r} to host a relay (validators started with "
                        "--relay-host)", self.view.run_id)
            await asyncio.sleep(2.0)
            await self.view.refresh(force=True)
            hosts = [h for h in self.view.relay_hosts() if h[1] != self.view.hotkey]
        out: list[tuple[str, str]] = []
        by_axon = {self.view.endpoint_of(hk): hk for hk in self.view.neurons}
        for spec in self.specs:
            if spec == "auto":
                if not hosts:
                    raise RelayConfigError(f"--relay auto: no neuron of this run hosts a relay after {wait_s:.0f} s "
                                           "(validators started with --relay-host publish one); name a relay as ip:port")
                out += hosts[:AUTO_RELAYS]
            elif "@" in spec:
                hk, _, ep = spec.partition("@")
                out.append((ep, hk))
            elif spec in by_axon:
                out.append((spec, by_axon[spec]))
            else:
                raise RelayConfigError(f"--relay {spec}: no neuron serves that address on the metagraph; give "
                                       "HOTKEY@ip:port for a relay that is not registered")
        uniq = list(dict.fromkeys(out))[:MAX_RELAYS]
        for ep, _ in uniq:
            host, _, port = ep.rpartition(":")
            if not host or not port.isdigit():
                raise RelayConfigError(f"--relay {ep}: not ip:port")
        self.relays = uniq
        return uniq

    def axon(self) -> tuple[str, int]:
        """The address this miner publishes as its axon: its first relay's."""
        host, _, port = self.relays[0][0].rpartition(":")
        return host, int(port)

    def endpoints(self) -> tuple[str, ...]:
        return tuple(ep for ep, _ in self.relays)

    def open(self, local: str, local_token: Optional[str] = None) -> None:
        """Build a tunnel to each relay for this miner's own server at ``local`` (``ip:port``);
        ``local_token``: that server's ``relay_token`` (its relayed requests then carry the address the
        relay saw, for the merge's progress credit)."""
        self.tunnels = [RelayTunnel(self.keypair, [r], local, local_token=local_token) for r in self.relays]
        logger.info("reached through relay(s) {} (axon {}:{}); this miner accepts no inbound connection",
                    ", ".join(f"{ep} ({hk[:10]})" for ep, hk in self.relays), *self.axon())

    async def run(self, stop: asyncio.Event) -> None:
        """Keep every relay attached until ``stop`` (the supervised task ``relay``)."""
        await asyncio.gather(*(t.run(stop) for t in self.tunnels))

    def status(self) -> Optional[dict]:
        """For status.json and the dashboard: per relay, attached now or not and what came through
        it; ``counts`` summed over the relays (None: dialled directly)."""
        if not self.enabled:
            return None
        per = [t.status() for t in self.tunnels]
        counts: dict[str, int] = {}
        for st in per:
            for k, v in st["counts"].items():
                counts[k] = counts.get(k, 0) + v
        return {"counts": counts, "attached": [st["relay"] for st in per if st["relay"]],
                "relays": [{"endpoint": ep, "hotkey": hk, "counts": st["counts"], "last_error": st["last_error"]}
                           for (ep, hk), st in zip(self.relays, per)]}
