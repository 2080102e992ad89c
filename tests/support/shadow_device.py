"""A stand-in accelerator for CPU-only machines: tensors that live on a second device and hold real data.

Why not ``FakeTensorMode`` with a fake CUDA device: fake tensors carry no data, so hashing, the
wire codec, equality checks and a merge's arithmetic cannot run on them; and on a CPU-only build of
torch, autograd on a tensor that reports ``device='cuda'`` aborts the process ("PyTorch is not
linked with support for cuda devices", measured with torch 2.13.0+cpu). The ``meta`` device alone
carries no data either.

So :class:`ShadowDevice` wraps real CPU tensors in a tensor subclass that *reports* the ``meta``
device (the one non-CPU device type whose device guard every build of torch has, so autograd,
optimizers and ``nn.Module.to`` work) and enforces the rules an accelerator enforces:

* an operator whose tensor arguments live on different devices raises ``RuntimeError("Expected all
  tensors to be on the same device ...")`` (0-dim CPU tensors are allowed, as on CUDA);
* only explicit copies cross devices (``.to(device)``, ``.cpu()``, ``copy_``);
* ``.numpy()`` on a device tensor raises (as ``can't convert cuda:0 device type tensor to numpy``).

Inside ``with ShadowDevice() as dev:`` code under test runs with ``device=dev.device`` (``meta``):
factory functions and ``.to("meta")`` produce shadow tensors with real values, ``.cpu()`` gives
plain CPU tensors back. Use it only in tests.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

DEVICE = torch.device("meta")
#: Operators allowed to take tensors of two devices (explicit copies).
_CROSS_DEVICE_OPS = {"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize"}


class DeviceMixError(RuntimeError):
    """An operator got tensors on two devices (what CUDA raises as 'Expected all tensors to be on the same device')."""


#: Operators that mixed devices (for assertions), most recent last.
MIXES: list[str] = []


def _dispatch(func, args, kwargs):
    """Run ``func`` on the CPU data of shadow tensors, enforcing the device rules (see the module docstring)."""
    kwargs = kwargs or {}
    devices: set[str] = set()

    def look(t: Any) -> Any:
        if isinstance(t, ShadowTensor):
            devices.add("shadow")
        elif isinstance(t, torch.Tensor) and t.dim() > 0:
            devices.add(t.device.type)
        return t
    tree_map(look, (args, kwargs))
    name = func.overloadpacket.__name__
    if name not in _CROSS_DEVICE_OPS and len(devices) > 1:
        MIXES.append(str(func))
        raise DeviceMixError(f"Expected all tensors to be on the same device, but found at least two devices, "
                             f"{DEVICE} (shadow accelerator) and {sorted(devices - {'shadow'})}! ({func})")
    a, k = tree_map(lambda t: t.elem if isinstance(t, ShadowTensor) else t, (args, kwargs))
    on_device = "shadow" in devices
    if k.get("device") is not None:
        on_device = torch.device(k["device"]).type == DEVICE.type
        k["device"] = torch.device("cpu")
    k.pop("pin_memory", None)
    out = func(*a, **k)
    if out is None:
        return None
    if "out" in kwargs:
        return kwargs["out"]
    schema = func._schema
    if schema.returns and all(r.alias_info is not None and r.alias_info.is_write for r in schema.returns):
        # in-place op: return the argument it wrote (the wrapper, whose data was mutated in place)
        written = [arg for arg, sa in zip(args, schema.arguments) if sa.alias_info is not None and sa.alias_info.is_write]
        return written[0] if len(schema.returns) == 1 and written else tuple(written)
    if on_device:
        return tree_map(lambda t: ShadowTensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, ShadowTensor)
                        else t, out)
    return out


class ShadowTensor(torch.Tensor):
    """A tensor on the shadow device: reports ``meta``, holds ``elem`` (a CPU tensor) as its data."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                device=DEVICE, requires_grad=elem.requires_grad)
        r.elem = elem
        return r

    def __repr__(self) -> str:
        return f"ShadowTensor({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs)


class ShadowDevice(TorchDispatchMode):
    """``with ShadowDevice() as dev:`` runs code with ``dev.device`` as an accelerator that holds data.

    The mode (needed for factory functions and ``.to(dev.device)`` of host tensors) is per thread:
    code that computes on other threads must run them through :meth:`executor`. Operators on shadow
    tensors follow the device rules on any thread."""

    device = DEVICE

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs)

    def executor(self, workers: int = 2) -> ThreadPoolExecutor:
        """A thread pool whose threads run under this mode (give it to ``loop.set_default_executor``)."""
        return ThreadPoolExecutor(max_workers=workers, initializer=self._enter_on_thread)

    def _enter_on_thread(self) -> None:
        ShadowDevice().__enter__()


def on_shadow(t: Any) -> bool:
    """Whether ``t`` is a shadow-device tensor."""
    return isinstance(t, ShadowTensor)
