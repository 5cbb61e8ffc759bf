"""Device memory at a fixed virtual address whose physical memory can be given back and taken again: CUDA's virtual
memory management (the driver's cuMemAddressReserve / cuMemCreate / cuMemMap), through ctypes.

What torch_memory_saver does for SGLang and slime (reserve the addresses once; to pause, unmap and free the physical
memory behind them; to resume, map new physical memory at the same addresses), for one block at a time and without a
compiled extension: libcuda.so is on every CUDA machine. A CUDA graph that read or wrote the block before a pause
reads and writes it after the resume, so nothing is captured again. The contents do not survive a pause.

`FixedAddressBlock(nbytes, device)`: the block, mapped; `unmap()` / `map()`; `tensor(shape, dtype)`: a tensor over
it (torch reads the address through `__cuda_array_interface__` and keeps the block alive while the tensor lives).
The driver is a parameter so that tests can stand in a fake one on a machine without a GPU.
"""
from __future__ import annotations

import ctypes
import sys
import threading

import torch

# enum values of cuda.h (the same since CUDA 10.2)
_ALLOCATION_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_ACCESS_READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_MINIMUM = 0  # CU_MEM_ALLOC_GRANULARITY_MINIMUM
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp (32 bytes)
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CudaDriverError(RuntimeError):
    def __init__(self, call: str, code: int, message: str) -> None:
        super().__init__(f"{call} failed: CUDA driver error {code} ({message})")
        self.call, self.code = call, code

    @property
    def out_of_memory(self) -> bool:
        return self.code == _OUT_OF_MEMORY


class CudaDriver:
    """The seven driver calls a fixed-address block needs. Loaded on first use; calls run on the caller's thread,
    where torch made its context current."""

    def __init__(self) -> None:
        torch.cuda.init()  # torch's context, current on this thread: the driver calls below run in it
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._check("cuInit", self.lib.cuInit(0))

    def _check(self, call: str, code: int) -> None:
        if code != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(code, ctypes.byref(text))
            raise CudaDriverError(call, code, (text.value or b"unknown").decode())

    @staticmethod
    def _prop(device: int) -> _AllocationProp:
        return _AllocationProp(type=_ALLOCATION_PINNED, location=_Location(_LOCATION_DEVICE, device))

    def granularity(self, device: int) -> int:
        size = ctypes.c_size_t()
        prop = self._prop(device)
        self._check("cuMemGetAllocationGranularity", self.lib.cuMemGetAllocationGranularity(
            ctypes.byref(size), ctypes.byref(prop), _GRANULARITY_MINIMUM))
        return size.value

    def reserve(self, size: int, alignment: int) -> int:
        ptr = ctypes.c_uint64()
        self._check("cuMemAddressReserve", self.lib.cuMemAddressReserve(
            ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(alignment), ctypes.c_uint64(0),
            ctypes.c_ulonglong(0)))
        return ptr.value

    def free(self, ptr: int, size: int) -> None:
        self._check("cuMemAddressFree", self.lib.cuMemAddressFree(ctypes.c_uint64(ptr), ctypes.c_size_t(size)))

    def create(self, size: int, device: int) -> int:
        handle = ctypes.c_ulonglong()
        prop = self._prop(device)
        self._check("cuMemCreate", self.lib.cuMemCreate(
            ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0)))
        return handle.value

    def release(self, handle: int) -> None:
        self._check("cuMemRelease", self.lib.cuMemRelease(ctypes.c_ulonglong(handle)))

    def map(self, ptr: int, size: int, handle: int, device: int) -> None:
        self._check("cuMemMap", self.lib.cuMemMap(ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                                  ctypes.c_ulonglong(handle), ctypes.c_ulonglong(0)))
        access = _AccessDesc(location=_Location(_LOCATION_DEVICE, device), flags=_ACCESS_READWRITE)
        self._check("cuMemSetAccess", self.lib.cuMemSetAccess(ctypes.c_uint64(ptr), ctypes.c_size_t(size),
                                                              ctypes.byref(access), ctypes.c_size_t(1)))

    def unmap(self, ptr: int, size: int) -> None:
        self._check("cuMemUnmap", self.lib.cuMemUnmap(ctypes.c_uint64(ptr), ctypes.c_size_t(size)))

    def as_tensor(self, block: "FixedAddressBlock") -> torch.Tensor:
        """A uint8 tensor over the block's bytes, on its device."""
        with torch.cuda.device(block.device):
            return torch.as_tensor(_ArrayInterface(block), device=torch.device("cuda", block.device))


class _ArrayInterface:
    """What torch.as_tensor reads a device address from; torch holds it (and so the block) while the tensor lives."""

    def __init__(self, block: "FixedAddressBlock") -> None:
        self.block = block
        self.__cuda_array_interface__ = {"shape": (block.nbytes,), "typestr": "|u1", "data": (block.ptr, False),
                                         "strides": None, "version": 2}


_DRIVER: CudaDriver | None = None
_LOCK = threading.Lock()
# bytes of physical memory mapped behind fixed-address blocks in this process, now and at the peak since the last reset:
# torch's allocator statistics do not see them (torch.cuda.max_memory_allocated + max_mapped_bytes() = the peak)
_MAPPED = {"now": 0, "peak": 0}


def mapped_bytes() -> int:
    return _MAPPED["now"]


def max_mapped_bytes() -> int:
    return _MAPPED["peak"]


def reset_peak_mapped_bytes() -> None:
    _MAPPED["peak"] = _MAPPED["now"]


def cuda_driver() -> CudaDriver:
    global _DRIVER
    with _LOCK:
        if _DRIVER is None:
            _DRIVER = CudaDriver()
        return _DRIVER


class FixedAddressBlock:
    """`nbytes` of memory on CUDA device `device` (an index) at an address that `unmap()` / `map()` keep: unmap gives
    the physical memory back to the device, map takes new physical memory (contents undefined) at the same address."""

    def __init__(self, nbytes: int, device: int, driver=None) -> None:
        self.driver = driver or cuda_driver()
        self.device = device
        self.nbytes = nbytes
        granularity = self.driver.granularity(device)
        self.size = -(-max(nbytes, 1) // granularity) * granularity  # what is mapped: whole granules
        self.ptr = self.driver.reserve(self.size, granularity)
        self.handle: int | None = None
        try:
            self.map()
        except BaseException:
            self.driver.free(self.ptr, self.size)
            self.ptr = 0
            raise

    @property
    def mapped(self) -> bool:
        return self.handle is not None

    def map(self) -> None:
        if self.handle is not None:
            return
        handle = self.driver.create(self.size, self.device)
        try:
            self.driver.map(self.ptr, self.size, handle, self.device)
        except BaseException:
            self.driver.release(handle)
            raise
        self.handle = handle
        _MAPPED["now"] += self.size
        _MAPPED["peak"] = max(_MAPPED["peak"], _MAPPED["now"])

    def unmap(self) -> None:
        """Give the physical memory back (the caller synchronises first: no kernel may still use the block)."""
        if self.handle is None:
            return
        self.driver.unmap(self.ptr, self.size)
        self.driver.release(self.handle)
        self.handle = None
        _MAPPED["now"] -= self.size

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.driver.as_tensor(self).view(dtype).view(shape)

    def __del__(self) -> None:  # the last tensor over the block is gone (it holds the block): free the addresses
        if not getattr(self, "ptr", 0) or sys.is_finalizing():  # at exit the process gives everything back itself
            return
        try:
            self.unmap()
            self.driver.free(self.ptr, self.size)
        except Exception:  # interpreter shutdown: the driver may be gone already; the process releases it all
            pass

