"""Counting and auditing the tensor operations of a block of code: what a GPU's time and a CUDA graph depend on.

A decode step or a compaction on a GPU costs about one kernel launch per eager operation, and can be captured in a
CUDA graph only if it never waits for the device (a host sync) and never feeds host data into the device work (a
Python scalar or list turned into a tensor, a host-to-device copy): during a capture these either fail or are baked
in as constants. Both are visible on any machine from the operations PyTorch dispatches, which is what this module
reads (a `TorchDispatchMode`):

- `OpCounter` counts dispatched operations and host syncs (the benchmark's "eager ops per step" column);
- `CaptureGuard` records every violation of capture safety (run the code on the "meta" device, where no data exists:
  any host data then shows up as a CPU tensor next to meta ones, and any read of device data fails outright).
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# operations whose result the host must wait for (a device value read on the host, or a data-dependent shape)
HOST_SYNC_OPS = frozenset({"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.is_nonzero",
                           "aten.masked_select", "aten.unique", "aten._unique2", "aten.unique_consecutive",
                           "aten.repeat_interleave", "aten.equal", "aten.allclose"})
# operations that turn host data (a Python scalar or list) into a tensor: inside a device step, a copy to the device
HOST_DATA_OPS = frozenset({"aten.lift_fresh", "aten.lift_fresh_copy", "aten.scalar_tensor"})


def _name(func) -> str:
    return str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)


def runs_kernel(func, args, out) -> bool:
    """Whether an operation does work on the device: not a view, or an operation that may alias its input and did
    not (`to` another dtype, `reshape` or `contiguous` of a strided tensor: under inference mode these arrive
    whole, their copy inside them)."""
    if not getattr(func, "is_view", False):
        return True
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return isinstance(out, torch.Tensor) and first is not None and \
        out.untyped_storage()._cdata != first.untyped_storage()._cdata


class OpCounter(TorchDispatchMode):
    """Counts the operations dispatched inside the block that run a kernel (`total`, `by_name`: views, which only
    change metadata, are left out; `runs_kernel`) and the host syncs among them."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self.syncs = 0

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _name(func)
        out = func(*args, **(kwargs or {}))
        if runs_kernel(func, args, out):
            self.by_name[name] += 1
        self.syncs += name in HOST_SYNC_OPS
        return out


class CaptureGuard(TorchDispatchMode):
    """Records what would break a CUDA graph capture of the block, run on `device` (meta in the tests): host syncs,
    host data lifted into tensors, and tensors on another device (a CPU index or value next to device tensors: a
    host-to-device copy). `violations` lists them (op, why); `check()` raises with the list."""

    def __init__(self, device: str | torch.device = "meta") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.violations: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _name(func)
        if name in HOST_SYNC_OPS:
            self.violations.append((name, "host sync"))
        if name in HOST_DATA_OPS:
            self.violations.append((name, "host data lifted into a tensor"))
        tensors = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
        foreign = sorted({str(t.device) for t in tensors if t.device.type != self.device.type})
        if foreign:
            self.violations.append((name, f"tensor on {', '.join(foreign)} next to {self.device.type} tensors"))
        return func(*args, **(kwargs or {}))

    def check(self) -> None:
        if self.violations:
            raise AssertionError("not capture-safe: " + "; ".join(f"{op} ({why})" for op, why in self.violations[:10]))
