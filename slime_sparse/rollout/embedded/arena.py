"""Where a runner's KV cache lives, and how `--offload-rollout` gives its memory back between rollouts without
capturing the decode graphs again.

The cache's large tensors (keys, values, positions, the query ring, attention mass) come from an arena:
- `StorageArena`: torch's allocator. `release()` shrinks each tensor's storage to 0 bytes (the memory goes back at once,
  to torch's cache and, after `empty_cache`, to the device); `resume()` allocates it again. The tensors keep their
  shapes but not their addresses: right for eager steps (CPU, `--disable-cuda-graph`), wrong for captured graphs.
- `FixedAddressArena`: one block of CUDA virtual memory per tensor (`utils.cuda_vmm`, torch_memory_saver's mechanism):
  `release()` unmaps and frees the physical memory, `resume()` maps new physical memory at the same addresses, so the
  CUDA graphs that read the cache replay unchanged.
Either way `resume()` zeroes the tensors: the cache's slots past a row's fill must hold finite values (they are masked,
and a masked NaN still poisons a softmax), and new memory holds whatever was there.

What stays resident through a release: the model's weights (the weight update writes them in place), the decode state
(a few integers per row), the CUDA graphs and their memory pool (the decode step's and the compaction's working sets,
bounded by their own accounting), and the fills. What goes back: the KV cache, all but a granule's rounding per tensor.
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor

from slime_sparse.utils.cuda_vmm import FixedAddressBlock, cuda_driver

logger = logging.getLogger(__name__)


class StorageArena:
    """Cache tensors from torch's allocator, given back by shrinking their storages."""

    keeps_addresses = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tensors: list[Tensor] = []
        self.released = False

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        t = torch.zeros(shape, dtype=dtype, device=self.device)
        self.tensors.append(t)
        return t

    @property
    def nbytes(self) -> int:
        """Bytes of the arena's tensors (whether resident or not)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def resident_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors)

    def release(self) -> None:
        if self.released:
            return
        for t in self.tensors:
            t.untyped_storage().resize_(0)
        self.released = True

    def resume(self) -> None:
        if not self.released:
            return
        for t in self.tensors:
            t.untyped_storage().resize_(t.numel() * t.element_size())
        _zero(self.tensors)
        self.released = False


class FixedAddressArena:
    """Cache tensors in CUDA virtual memory whose addresses outlive a release (`utils.cuda_vmm.FixedAddressBlock`)."""

    keeps_addresses = True

    def __init__(self, device: torch.device, driver=None) -> None:
        self.device = device
        self.index = device.index if device.index is not None else \
            (torch.cuda.current_device() if device.type == "cuda" else 0)
        self.driver = driver or cuda_driver()
        self.blocks: list[FixedAddressBlock] = []
        self.tensors: list[Tensor] = []
        self.released = False

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        block = FixedAddressBlock(nbytes, self.index, self.driver)
        t = block.tensor(tuple(shape), dtype).zero_()
        self.blocks.append(block)
        self.tensors.append(t)
        return t

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    @property
    def resident_bytes(self) -> int:
        return sum(b.size for b in self.blocks if b.mapped)

    def release(self) -> None:
        if self.released:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no queued kernel may still read the memory being unmapped
        for block in self.blocks:
            block.unmap()
        self.released = True

    def resume(self) -> None:
        if not self.released:
            return
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what the learner freed but torch still caches goes back to the device first
        try:
            for block in self.blocks:
                block.map()
        except Exception as exc:
            for block in self.blocks:  # all or nothing: a half-mapped cache is no use
                block.unmap()
            free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
            raise RuntimeError(
                f"the rollout engine could not take back its KV cache ({self.nbytes / 2**30:.2f} GiB; "
                f"{free / 2**30:.2f} GiB free on the device): what the learner holds between steps leaves too little. "
                "Lower --rollout-kv-cache-gib or --rollout-mem-fraction") from exc
        _zero(self.tensors)
        self.released = False


@torch.inference_mode()
def _zero(tensors: list[Tensor]) -> None:
    """New memory holds anything: zeros, as the cache was built (its tensors were made under inference mode)."""
    for t in tensors:
        t.zero_()


def new_arena(device: torch.device, releasable: bool, mode: str) -> StorageArena | FixedAddressArena:
    """The arena of a runner whose steps run in `mode`: fixed addresses when its memory is given back between rollouts
    (`releasable`, --offload-rollout) while CUDA graphs hold the cache's addresses; torch's allocator otherwise, also
    where CUDA's virtual memory calls are not to be had (then a release drops the runner, graphs and all)."""
    if not (releasable and mode == "cuda_graph"):
        return StorageArena(device)
    try:
        driver = cuda_driver()
        driver.granularity(device.index if device.index is not None else torch.cuda.current_device())
    except Exception as exc:  # no libcuda, a driver without the calls, a CPU build of torch: a probe, nothing more
        logger.warning("CUDA virtual memory is unavailable (%s): --offload-rollout will capture the decode graphs "
                       "again after each release", exc)
        return StorageArena(device)
    return FixedAddressArena(device, driver)
