"""Preparing a compute device for a run's precision (``train.precision``).

Where a miner's stage worker or the co-located trainer settles on its device, :func:`prepare_device`:

* on CUDA with ``bf16`` (autocast, fp32 master weights): lets the fp32 matmuls and convolutions that
  autocast leaves in fp32 run on TF32 tensor cores (``torch.backends.cuda.matmul.allow_tf32`` and
  ``torch.backends.cudnn.allow_tf32``; 10-bit mantissa, relative error ~1e-3, well inside the bf16
  hop-audit output tolerance of 2e-2, :meth:`iota_subnet.audit.check.Tolerances.for_precision`);
* on CUDA with ``fp32``: turns TF32 off. An fp32 run is verified against IEEE fp32 (hop-audit
  output tolerance 1e-4, :meth:`iota_subnet.audit.check.Tolerances.for_precision`);
  TF32 matmuls reach ~1e-3 over a stage, so an honest miner would fail them. The hop-audit trace
  turns TF32 off for the same reason (:mod:`iota_subnet.audit.trace`);
* warns when an fp32 run of more than :data:`iota_subnet.config.LARGE_MODEL_PARAMS` parameters
  starts on CUDA (twice the activation memory of bf16, and fp32 matmuls without tensor cores), with
  the fix: ``train.precision: bf16``.

Nothing changes on a CPU.
"""
from __future__ import annotations

from typing import Optional

import torch
from loguru import logger

from iota_subnet.config import LARGE_MODEL_PARAMS, RunConfig


def fp32_at_scale_warning(cfg: RunConfig, device: torch.device) -> Optional[str]:
    """The warning for an fp32 run of a large model on CUDA, or None."""
    params = cfg.model.param_count()
    if device.type != "cuda" or cfg.train.precision != "fp32" or params <= LARGE_MODEL_PARAMS:
        return None
    return (f"train.precision is fp32 for a {params / 1e9:.2f}B-parameter model ({cfg.model.name}) on {device}: "
            f"fp32 keeps twice the activations of bf16 and runs its matmuls without tensor cores (or on TF32, "
            f"which fails an fp32 run's verification tolerances). Set train.precision: bf16 in the config "
            f"(or --set train.precision=bf16); every neuron of the run must use the same precision")


def prepare_device(device: torch.device | str, cfg: RunConfig) -> torch.device:
    """``device`` as a :class:`torch.device`, set up for ``cfg``'s ``train.precision`` (see the module
    docstring: on CUDA, TF32 on for bf16 and off for fp32, and the fp32-at-scale warning)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return dev
    tf32 = cfg.train.precision == "bf16"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    msg = fp32_at_scale_warning(cfg, dev)
    if msg:
        logger.warning(msg)
    return dev
