"""Accelerators the planner and the emulator reason about: peak bf16 FLOP/s, memory, memory bandwidth.

Figures are the vendors' dense (no sparsity) bf16 tensor-core peaks with fp32 accumulation, which
is what ``torch.autocast(dtype=torch.bfloat16)`` matmuls use:

* ``a100``: NVIDIA A100-SXM4-80GB, 312 TFLOP/s, 80 GiB, 2.039 TB/s (A100 datasheet).
* ``h100``: NVIDIA H100-SXM5-80GB, 989 TFLOP/s, 80 GiB, 3.35 TB/s (H100 datasheet).
* ``h200``: NVIDIA H200-SXM-141GB, 989 TFLOP/s (the H100's tensor cores), 141 GB of HBM3e of which
  CUDA reports 143,771 MiB (140.4 GiB; counted as 140 GiB here), 4.8 TB/s (H200 datasheet).
* ``4090``: GeForce RTX 4090, 165.2 TFLOP/s (bf16 with fp32 accumulation; 330 with fp16
  accumulation, which autocast does not use), 24 GiB, 1.008 TB/s (Ada whitepaper, appendix A).

Model FLOP utilisation (MFU): the share of the peak a training step achieves. :data:`DEFAULT_MFU`
= 0.5 is the figure the subnet's scale estimates design against (large dense transformers on
A100/H100 reach 0.4-0.55 with FlashAttention; PaLM reported 0.46, Chowdhery et al. 2022, sec. 4.1).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from iota_subnet.config import ConfigError

GIB = 1 << 30
#: Model FLOP utilisation assumed when none is given.
DEFAULT_MFU = 0.5


@dataclass(frozen=True)
class Accelerator:
    """``peak_flops``: dense bf16 FLOP/s; ``memory_bytes``: device memory; ``memory_bandwidth``:
    bytes/s of device memory (bounds the optimizer step, which is memory-bound)."""

    name: str
    peak_flops: float
    memory_bytes: int
    memory_bandwidth: float

    def to_json(self) -> dict:
        return {"name": self.name, "peak_flops": self.peak_flops, "memory_bytes": self.memory_bytes,
                "memory_bandwidth": self.memory_bandwidth}


GPUS: dict[str, Accelerator] = {
    "a100": Accelerator("A100-SXM4-80GB", 312e12, 80 * GIB, 2.039e12),
    "h100": Accelerator("H100-SXM5-80GB", 989e12, 80 * GIB, 3.35e12),
    "h200": Accelerator("H200-SXM-141GB", 989e12, 140 * GIB, 4.8e12),
    "4090": Accelerator("RTX-4090", 165.2e12, 24 * GIB, 1.008e12),
}


def parse_accelerator(text: str, memory_gib: Optional[float] = None) -> Accelerator:
    """``a100`` | ``h100`` | ``h200`` | ``4090`` | a peak in FLOP/s (``2e14``); ``memory_gib`` overrides the
    memory (required with a bare FLOP/s figure). A bare figure gets the A100's memory bandwidth.

    Raises :class:`ConfigError` naming the accepted values.
    """
    key = str(text).strip().lower()
    if key in GPUS:
        acc = GPUS[key]
    else:
        try:
            peak = float(key)
        except ValueError:
            raise ConfigError(f"--emulate-gpu {text!r}: use one of {', '.join(GPUS)} or a peak in FLOP/s "
                              "such as 2e14") from None
        if not peak > 0 or peak != peak or peak == float("inf"):
            raise ConfigError(f"--emulate-gpu {text!r}: the peak must be a positive number of FLOP/s")
        if memory_gib is None:
            raise ConfigError(f"--emulate-gpu {text!r} names no device memory: add --gpu-mem GiB")
        acc = Accelerator(f"custom-{peak:.3g}", peak, 0, GPUS["a100"].memory_bandwidth)
    if memory_gib is not None:
        if not memory_gib > 0:
            raise ConfigError(f"--gpu-mem {memory_gib!r}: must be a positive number of GiB")
        acc = replace(acc, memory_bytes=int(memory_gib * GIB))
    return acc


def check_mfu(mfu: float) -> float:
    """``mfu`` if it lies in (0, 1]; else :class:`ConfigError`."""
    if not (isinstance(mfu, (int, float)) and 0 < mfu <= 1):
        raise ConfigError(f"--mfu {mfu!r}: model FLOP utilisation must lie in (0, 1], e.g. {DEFAULT_MFU}")
    return float(mfu)
