"""Host <-> device copies that never wait for the device (what the engine's steps and compactions may do between
queued kernels)."""
from __future__ import annotations

import torch
from torch import Tensor


def to_device(values: list[int], device: torch.device) -> Tensor:
    """Ints as an int64 tensor on `device`, copied without waiting for the device (pinned memory on CUDA: a copy from
    pageable memory would first wait for every queued kernel)."""
    index = torch.tensor(values, dtype=torch.int64)
    return index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index.to(device)


def to_host(t: Tensor) -> Tensor:
    """A host copy of `t` that does not wait for the device (pinned memory; valid once the stream gets there)."""
    if t.device.type != "cuda":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)
