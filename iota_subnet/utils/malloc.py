"""glibc malloc settings for long-running neurons.

A CPU miner frees and re-allocates host tensors of 1-20 MB all the time (the audit stores' copies
of weights and optimizer moments, merge buffers, activations) from several threads. With glibc's
defaults (one arena per thread up to 8 x cores, and an mmap threshold that grows to 32 MB once
large blocks are freed) the freed memory stays in the arenas, fragmented: a ``tiny`` miner of a
3 x 2 local network grows to 2.6 GB RSS in 40 steps, and a 3 x 3 network on 24 GB meets the
kernel's OOM killer (docs/BENCHMARKS.md, "Miner memory"). Two arenas and a fixed 1 MB mmap threshold
(large blocks are mapped and returned to the kernel when freed) halve that.

Settings already in the environment (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``) win: this
changes nothing the operator set. No effect outside glibc (musl, macOS).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

#: mallopt parameters (glibc malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

#: Two arenas: the compute thread and everything else rarely contend (torch's own kernels do not malloc per element).
ARENA_MAX = 2
#: Blocks of at least this many bytes are mmap'ed (and unmapped when freed). Measured on a 3 x 2 ``tiny``
#: localnet, 40 steps (sum of the 6 miners' RSS at the end): glibc defaults 14.5 GB, 16 MB 9.7 GB, 1 MB 7.0 GB.
MMAP_THRESHOLD_BYTES = 1 << 20


def tune_malloc(arena_max: int = ARENA_MAX, mmap_threshold: int = MMAP_THRESHOLD_BYTES) -> dict[str, int]:
    """Apply the settings to this process (before its threads start). Returns what was set
    (name -> value; empty where libc is not glibc or the operator's environment already sets it)."""
    name = ctypes.util.find_library("c")
    if not name:
        return {}
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done: dict[str, int] = {}
    if "MALLOC_ARENA_MAX" not in os.environ and mallopt(M_ARENA_MAX, int(arena_max)) == 1:
        done["arena_max"] = int(arena_max)
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ and mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)) == 1:
        done["mmap_threshold"] = int(mmap_threshold)
    return done
