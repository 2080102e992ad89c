"""Neurons tune glibc malloc at start (iota_subnet.utils.malloc): large host tensors freed between
small live allocations go back to the kernel instead of staying in the heap (a CPU miner's RSS
doubled from this; docs/BENCHMARKS.md "Miner memory")."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import gc, sys, torch
from iota_subnet.neuron_common import setup_process
if sys.argv[1] == "neuron":
    import argparse
    args = argparse.Namespace(network="devnet", chain_db=None, log_level="WARNING", threads=1, link=None,
                              time_scale=1.0, link_control=None)
    setup_process(args, "probe")              # what the miner's and validator's main() run first
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) >> 10
n = (17 << 20) // 4
x = torch.empty(n); x.fill_(1); del x           # a freed large block raises glibc's dynamic mmap threshold
base = rss()
keep, big = [], []
for i in range(30):                             # 30 x 17 MB, each followed by a small live tensor
    t = torch.empty(n); t.fill_(1); big.append(t)
    keep.append(torch.ones(64))
del big; gc.collect()
print(rss() - base)
"""


def _held_mb(mode: str, **env) -> int:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    e.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **env)
    out = subprocess.run([sys.executable, "-c", PROBE, mode],
                         capture_output=True, text=True, env=e, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.path.exists("/etc/alpine-release"),
                    reason="glibc malloc only")
def test_neuron_processes_return_freed_large_tensors_to_the_kernel():
    plain = _held_mb("plain")
    neuron = _held_mb("neuron")
    assert plain > 300, f"glibc kept only {plain} MB: this probe no longer shows the fragmentation"
    assert neuron < 100, f"a neuron process still holds {neuron} MB of freed tensors"


def test_the_operators_malloc_environment_wins():
    from iota_subnet.utils import malloc
    code = "from iota_subnet.utils.malloc import tune_malloc; print(sorted(tune_malloc()))"
    e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    e.update(PYTHONPATH=str(REPO), MALLOC_ARENA_MAX="4")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=60)
    assert out.returncode == 0, out.stderr
    if sys.platform.startswith("linux"):
        assert out.stdout.strip() == "['mmap_threshold']"
    assert malloc.MMAP_THRESHOLD_BYTES >= 1 << 20
