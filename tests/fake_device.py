"""A stand-in GPU for machines without one: tensors "on the device" are CPU tensors wrapped in
:class:`OnDevice`, whose device reads ``meta``, and :class:`FakeDevice` (a torch dispatch mode)
runs every op on the wrapped CPU tensors while refusing what a real GPU refuses.

What it catches is what tests on CPU tensors cannot: an op that mixes a device tensor with a host
tensor of more than zero dimensions (torch raises "Expected all tensors to be on the same device"
on a GPU; 0-dim host tensors are allowed there too), host code reading a device tensor's memory
(``.numpy()`` of an ``OnDevice`` fails), and how often a step copies to the host or reads a scalar
(``host_reads``). Factory calls with ``device="meta"`` and ``.to("meta")`` make device tensors;
``.to("cpu")`` / ``.cpu()`` copies back. Values are the CPU's, so a run on the stand-in must give
bitwise the losses of the same code on CPU tensors.

:func:`fake_gpu` patches tessera so that a run asking for the device gets the stand-in:
``training_device`` returns it, and the portable ``torch`` backend (the one backend that runs on
CUDA tensors and on the CPU) accepts it as it accepts ``cuda``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

FAKE = torch.device("meta")
_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)


class OnDevice(torch.Tensor):
    """A CPU tensor (``elem``) that plays a tensor on the stand-in device."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> OnDevice:
        strided = elem.layout == torch.strided
        extra: dict[str, Any] = {"strides": elem.stride(), "storage_offset": elem.storage_offset()} if strided else {}
        r = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, elem.size(), dtype=elem.dtype, device=FAKE, requires_grad=elem.requires_grad, layout=elem.layout,
            **extra,
        )  # fmt: skip
        r.elem = elem
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(None, func, args, kwargs)


def _is_fake(device: Any) -> bool:
    return device is not None and torch.device(device).type == FAKE.type


def _run(mode: FakeDevice | None, func, args, kwargs):
    kwargs = dict(kwargs or {})
    to_fake = _is_fake(kwargs.get("device"))
    if to_fake:
        kwargs["device"] = torch.device("cpu")
    on_device, host = [], []

    def see(t: Any) -> None:
        if isinstance(t, OnDevice):
            on_device.append(t)
        elif isinstance(t, torch.Tensor) and t.dim() > 0:
            host.append(tuple(t.shape))

    tree_map(see, (args, kwargs))
    if on_device and host and func not in _COPIES:
        raise RuntimeError(f"host tensors {host} mixed with device tensors in {func}")
    if on_device and func is torch.ops.aten._local_scalar_dense.default and mode is not None:
        mode.host_reads += 1
    if on_device and mode is not None and _sizes_from_values(func, args, kwargs):
        mode.syncs += 1
    if func is torch.ops.aten.copy_.default and isinstance(args[1], OnDevice) and not isinstance(args[0], OnDevice):
        if mode is not None:
            mode.host_reads += 1  # into a host tensor
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if func is torch.ops.aten.copy_.default:
        return args[0]  # in place on the destination's own storage, whichever side it is
    if func is torch.ops.aten._to_copy.default and on_device and not to_fake:
        if mode is not None and kwargs.get("device") is not None:
            mode.host_reads += 1
        if kwargs.get("device") is not None:
            return out  # to the host
    if to_fake or on_device:
        return tree_map(_wrap, out)
    return out


_DATA_SIZED = (
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_consecutive.default,
)


def _sizes_from_values(func, args, kwargs) -> bool:
    """Whether ``func`` makes a tensor whose size depends on the values (a GPU then waits for them)."""
    if func in _DATA_SIZED:
        return True
    if func is torch.ops.aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func is torch.ops.aten.index.Tensor:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
    return False


def _unwrap(t: Any) -> Any:
    return t.elem if isinstance(t, OnDevice) else t


def _wrap(t: Any) -> Any:
    return OnDevice(t) if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) else t


class FakeDevice(TorchDispatchMode):
    """The dispatch mode that makes ``device="meta"`` the stand-in device; ``host_reads`` counts
    copies from it to the host and scalars read from it, ``syncs`` the ops whose output size
    depends on device values (boolean indexing, ``nonzero``, ``unique``), which wait for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.host_reads = 0
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(self, func, args, kwargs)


@contextmanager
def fake_gpu() -> Iterator[FakeDevice]:
    """tessera's runs on the stand-in device while the block runs (patches undone after it)."""
    import tessera.train.loop as loop
    from tessera.backends.torch_native import TorchBackend

    supports = TorchBackend.supports

    def also_fake(self, x: torch.Tensor) -> bool:
        return supports(self, x) or (x.device.type == FAKE.type and x.dtype in self.dtypes)

    patches = [
        (loop, "training_device", lambda setting, distributed: FAKE),
        (TorchBackend, "auto_devices", ("cuda", FAKE.type)),
        (TorchBackend, "supports", also_fake),
    ]
    saved = [(obj, name, obj.__dict__[name]) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        with FakeDevice() as mode:
            yield mode
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
