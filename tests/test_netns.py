"""The link emulator against the kernel: the same signed HTTP transfer through an UplinkShaper and through
a veth pair shaped by ``tc tbf`` in a network namespace. Needs root, ``ip netns`` and tbf; skipped with
the reason otherwise (scripts/bench_link.py gives the figures)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from iota_subnet.sim.netns import netns_available

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def bench_link():
    ok, why = netns_available()
    if not ok:
        print(f"SKIPPED: emulator vs kernel cross-check needs network namespaces: {why}")
        pytest.skip(f"network namespaces with tc tbf not available: {why}")
    spec = importlib.util.spec_from_file_location("bench_link", REPO / "scripts" / "bench_link.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_link"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_emulator_matches_kernel_tbf_throughput(bench_link):
    """2 MB x 2 requests at 20 Mbit/s: the emulator's goodput within 20 % of the kernel's, and both
    below the link rate (headers, segment overheads and the server's work count against it)."""
    k = bench_link.measure("kernel", "20mbit", 2_000_000, 2)
    e = bench_link.measure("emulator", "20mbit", 2_000_000, 2)
    assert 0.8 < e["goodput_bps"] / k["goodput_bps"] < 1.2, (k, e)
    for r in (k, e):
        assert 0.5 < r["goodput_share_of_rate"] < 1.0, r


def test_namespaces_are_removed():
    import subprocess

    from iota_subnet.sim.netns import NetnsLink
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    with NetnsLink(10e6) as ns:
        name = ns.ns
        assert name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
