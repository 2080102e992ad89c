"""Copies between host memory and a compute device, off the compute stream.

:class:`DeviceIO` is how a stage's inputs reach its device and its outputs come back to the host
(for the wire codec): on CUDA through page-locked (pinned) host buffers with ``non_blocking``
copies issued on a separate CUDA stream, so a transfer runs concurrently with the kernels already
queued on the compute stream, and the host waits only for the copy it needs (an event), never for
the whole device. Anywhere else (CPU, or any other device type) a copy is a plain ``.to()``.

Pinned buffers come from torch's caching host allocator: after the first micro-batches of a shape
they are reused, and a buffer is not handed out again before the copy that used it has finished.
"""
from __future__ import annotations

from typing import Optional

import torch


class DeviceIO:
    """Host <-> ``device`` copies (see the module docstring). ``cuda`` is True when the side stream,
    pinned buffers and non-blocking copies are in use."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.stream: Optional["torch.cuda.Stream"] = torch.cuda.Stream(self.device) if self.cuda else None

    def to_device(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (host, any dtype/shape) on the device, ready for use on the current (compute) stream."""
        if x.device == self.device or (x.device.type == self.device.type and self.device.index is None):
            return x
        if not self.cuda:
            return x.to(self.device)
        src = x if x.is_pinned() else x.pin_memory()
        with torch.cuda.stream(self.stream):
            y = src.to(self.device, non_blocking=True)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self.stream)          # compute kernels that read y start after the copy
        y.record_stream(compute)                  # y's memory is not reused before compute is done with it
        return y

    def to_host(self, y: torch.Tensor) -> torch.Tensor:
        """A host copy of device tensor ``y`` (pinned on CUDA); waits only for this copy."""
        if y.device.type == "cpu":
            return y
        if not self.cuda:
            return y.to("cpu")
        out = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))   # after the kernels that produce y
        with torch.cuda.stream(self.stream):
            out.copy_(y, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        y.record_stream(self.stream)
        done.synchronize()
        return out

    def synchronize(self) -> None:
        """Wait for every copy issued on the side stream (no-op off CUDA)."""
        if self.stream is not None:
            self.stream.synchronize()
