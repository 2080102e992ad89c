"""Kernel-shaped links for cross-checking the link emulator: a network namespace on a veth pair whose
two ends are shaped by ``tc tbf`` (token bucket filter; this kernel has no netem, so delay stays in
the emulator, :mod:`iota_subnet.transport.shaping`).

``NetnsLink`` needs root, ``ip netns`` and the ``tbf`` qdisc; :func:`netns_available` says whether this
machine has them and why not. Everything it creates carries a unique name (pid + counter) and is
removed on exit, also after an error. Used by ``scripts/bench_link.py`` and ``tests/test_netns.py``.
"""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from typing import Optional

_counter = itertools.count()


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30)


def _must(*argv: str) -> None:
    r = _run(*argv)
    if r.returncode:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {r.stderr.strip() or r.stdout.strip()}")


def netns_available() -> tuple[bool, str]:
    """(available, reason): root, the ``ip`` and ``tc`` tools, and a namespace + veth + tbf that can be made."""
    if os.geteuid() != 0:
        return False, "not root (network namespaces need CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"no `{tool}` command (iproute2)"
    try:
        with NetnsLink(rate_bps=10e6):
            pass
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return False, f"cannot build a shaped veth namespace: {e}"
    return True, "root, ip netns, veth and tc tbf available"


class NetnsLink:
    """A namespace ``ns`` joined to this one by a veth pair, both directions shaped by ``tc tbf`` at
    ``rate_bps`` bits/s with ``burst_bytes`` of bucket. ``host_ip`` is this side, ``ns_ip`` the
    namespace's; run a process inside with :meth:`exec_argv`. Use as a context manager."""

    def __init__(self, rate_bps: Optional[float], burst_bytes: int = 32 << 10, latency_ms: int = 400):
        n = next(_counter)
        tag = f"{os.getpid() % 100000}{n}"
        self.ns = f"iota-{tag}"
        self.host_if, self.ns_if = f"iota{tag}a"[:15], f"iota{tag}b"[:15]
        octet = (os.getpid() * 7 + n) % 250 + 1
        self.host_ip, self.ns_ip = f"10.213.{octet}.1", f"10.213.{octet}.2"
        self.rate_bps, self.burst_bytes, self.latency_ms = rate_bps, burst_bytes, latency_ms
        self._made: list[str] = []

    def _must(self, *argv: str) -> None:
        _must(*argv)

    def exec_argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]

    def __enter__(self) -> "NetnsLink":
        try:
            self._must("ip", "netns", "add", self.ns)
            self._made.append("ns")
            self._must("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            self._made.append("veth")
            self._must("ip", "link", "set", self.ns_if, "netns", self.ns)
            self._must("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            self._must("ip", "link", "set", self.host_if, "up")
            inside = ["ip", "netns", "exec", self.ns]
            self._must(*inside, "ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
            self._must(*inside, "ip", "link", "set", self.ns_if, "up")
            self._must(*inside, "ip", "link", "set", "lo", "up")
            if self.rate_bps:
                tbf = ["root", "tbf", "rate", f"{int(self.rate_bps)}bit", "burst", str(self.burst_bytes),
                       "latency", f"{self.latency_ms}ms"]
                self._must("tc", "qdisc", "add", "dev", self.host_if, *tbf)
                self._must(*inside, "tc", "qdisc", "add", "dev", self.ns_if, *tbf)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if "veth" in self._made:
            _run("ip", "link", "del", self.host_if)       # deletes both ends
        if "ns" in self._made:
            _run("ip", "netns", "del", self.ns)
        self._made.clear()

    def __exit__(self, *exc) -> None:
        self.close()


def nat_available() -> tuple[bool, str]:
    """(available, reason): :func:`netns_available` plus ``iptables`` with a NAT table, and a
    :class:`HomeRouter` that can be made."""
    ok, why = netns_available()
    if not ok:
        return ok, why
    if shutil.which("iptables") is None:
        return False, "no `iptables` command (make setup installs it as root with apt-get)"
    try:
        with HomeRouter():
            pass
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return False, f"cannot build a NAT'd home namespace: {e}"
    return True, "root, ip netns, veth, tc tbf and iptables masquerade available"


class HomeRouter:
    """A home network behind a NAT, for neurons that cannot be dialled: a router namespace joined to
    this one by a :class:`NetnsLink` (its WAN: this side, ``public_ip``, stands for the internet,
    shaped at ``rate_bps`` when given), and a home namespace ``ns`` on the router's LAN
    (``home_ip``, 192.168.x.2/24, default route via the router). The router masquerades what leaves
    its WAN (``random_fully``: ``MASQUERADE --random-fully``, no port preserved); nothing from this
    side can open a connection into the home. Run a process inside with :meth:`exec_argv`.

    ``double_nat``: a second router between the home and that one (carrier-grade NAT, or a home
    router behind the ISP's): home ns -> ``inner`` router ns (masquerades out of its uplink,
    10.214.x.2/30) -> the WAN router ns (masquerades out of its WAN) -> this side. Both masquerade
    the same way (``random_fully``); the WAN router's ``wan.ns_ip`` is still the address this side sees."""

    def __init__(self, rate_bps: Optional[float] = None, random_fully: bool = False, double_nat: bool = False):
        self.wan = NetnsLink(rate_bps)
        n = next(_counter)
        tag = f"{os.getpid() % 100000}{n}"
        self.ns = f"iotah-{tag}"
        self.lan_if, self.home_if = f"iotl{tag}a"[:15], f"iotl{tag}b"[:15]
        octet = (os.getpid() * 11 + n) % 250 + 1
        self.router_lan_ip, self.home_ip = f"192.168.{octet}.1", f"192.168.{octet}.2"
        self.random_fully = random_fully
        #: the inner router (double NAT only): its namespace, its uplink's two ends and addresses
        self.inner: Optional[str] = f"iotar-{tag}" if double_nat else None
        self.up_if, self.inner_up_if = f"iotu{tag}a"[:15], f"iotu{tag}b"[:15]
        up = (os.getpid() * 13 + n) % 250 + 1
        self.outer_lan_ip, self.inner_wan_ip = f"10.214.{up}.1", f"10.214.{up}.2"
        self._made: list[str] = []

    @property
    def public_ip(self) -> str:
        """This side of the router's WAN: where a public neuron for the home listens."""
        return self.wan.host_ip

    def exec_argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]

    def _masquerade(self, router: list[str], out_if: str) -> None:
        masq = ["-j", "MASQUERADE"] + (["--random-fully"] if self.random_fully else [])
        _must(*router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _must(*router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", out_if, *masq)

    def __enter__(self) -> "HomeRouter":
        try:
            self.wan.__enter__()
            outer = ["ip", "netns", "exec", self.wan.ns]
            router, router_ns = outer, self.wan.ns          # the router the home hangs off
            if self.inner is not None:
                _must("ip", "netns", "add", self.inner)
                self._made.append("inner")
                router, router_ns = ["ip", "netns", "exec", self.inner], self.inner
                _must("ip", "link", "add", self.up_if, "netns", self.wan.ns, "type", "veth", "peer", "name",
                      self.inner_up_if, "netns", self.inner)
                _must(*outer, "ip", "addr", "add", f"{self.outer_lan_ip}/30", "dev", self.up_if)
                _must(*outer, "ip", "link", "set", self.up_if, "up")
                _must(*router, "ip", "addr", "add", f"{self.inner_wan_ip}/30", "dev", self.inner_up_if)
                _must(*router, "ip", "link", "set", self.inner_up_if, "up")
                _must(*router, "ip", "link", "set", "lo", "up")
                _must(*router, "ip", "route", "add", "default", "via", self.outer_lan_ip)
                self._masquerade(router, self.inner_up_if)
            _must("ip", "netns", "add", self.ns)
            self._made.append("ns")
            _must("ip", "link", "add", self.lan_if, "netns", router_ns, "type", "veth", "peer", "name",
                  self.home_if, "netns", self.ns)
            _must(*router, "ip", "addr", "add", f"{self.router_lan_ip}/24", "dev", self.lan_if)
            _must(*router, "ip", "link", "set", self.lan_if, "up")
            home = ["ip", "netns", "exec", self.ns]
            _must(*home, "ip", "addr", "add", f"{self.home_ip}/24", "dev", self.home_if)
            _must(*home, "ip", "link", "set", self.home_if, "up")
            _must(*home, "ip", "link", "set", "lo", "up")
            _must(*home, "ip", "route", "add", "default", "via", self.router_lan_ip)
            self._masquerade(outer, self.wan.ns_if)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if "ns" in self._made:
            _run("ip", "netns", "del", self.ns)            # its veth end goes with it
        if "inner" in self._made:
            _run("ip", "netns", "del", self.inner)
        self._made.clear()
        self.wan.close()

    def __exit__(self, *exc) -> None:
        self.close()
