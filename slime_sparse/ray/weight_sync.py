"""Learner -> rollout engine weight sync over a torch.distributed group: bucket plan, packing, both ends.

The sync group holds learner rank 0 (sync rank 0, the source) and every engine actor (ranks 1..E).
It is a standalone process group built on its own TCPStore, not a subgroup of the learners' default
group: learner rank 0 belongs to both, and the engines to no other. Gloo on CPU, NCCL on GPU.

One sync, every member in step:
  1. the driver asks learner rank 0 for the bucket plan (names, shapes, dtypes, byte offsets: metadata);
  2. it hands the plan and the new version to the source and to every engine, which all call in at once;
  3. the source broadcasts a header [version, plan fingerprint, number of buckets]: each engine checks it
     against the plan and version the driver gave it, so a member that fell out of step cannot load a
     mix of two syncs;
  4. then one broadcast per bucket: the bucket's tensors packed as raw bytes (any dtype, bit-exact);
  5. engines unpack and load, and report the version they now hold; the driver checks it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

ALIGN = 16  # byte alignment of each tensor in a bucket: a uint8 slice can then be viewed as any dtype
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in its bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the start of the bucket
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    slots: tuple[Slot, ...]
    nbytes: int


def plan_buckets(layout: list[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> list[Bucket]:
    """Group (name, shape, dtype) tensors, in order, into buckets of at most `bucket_bytes` bytes.

    A tensor larger than the limit gets a bucket of its own. Tensors of different dtypes may share a
    bucket: it is sent as bytes.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1 (--update-weight-buffer-size)")
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    used = 0
    for name, shape, dtype in layout:
        nbytes = _numel(shape) * _element_size(dtype)
        offset = _align(used)
        if slots and nbytes and offset + nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(slots), used))
            slots, offset = [], 0
        slots.append(Slot(name, tuple(int(d) for d in shape), dtype, offset, nbytes))
        used = offset + nbytes
    if slots:
        buckets.append(Bucket(tuple(slots), used))
    return buckets


def fingerprint(plan: list[Bucket]) -> int:
    """A 63-bit digest of the plan (names, shapes, dtypes, offsets), sent in the header."""
    text = "|".join(f"{s.name}:{s.shape}:{s.dtype}:{s.offset}" for b in plan for s in b.slots)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def pack(bucket: Bucket, tensors: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bucket's tensors as one uint8 buffer on `device`, each at its slot's offset."""
    buf = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=device)
    for slot in bucket.slots:
        t = tensors[slot.name].detach()
        if tuple(t.shape) != slot.shape or t.dtype != slot.dtype:
            raise ValueError(f"{slot.name}: {tuple(t.shape)} {t.dtype} does not match the plan's "
                             f"{slot.shape} {slot.dtype}")
        buf[slot.offset: slot.offset + slot.nbytes] = t.to(device).contiguous().reshape(-1).view(torch.uint8)
    return buf


def unpack(bucket: Bucket, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of `buf` as the bucket's named tensors (no copy)."""
    return {s.name: buf[s.offset: s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in bucket.slots}


def new_group(store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float, *,
              prefix: str) -> dist.ProcessGroup:
    """A standalone process group over `store` (blocks until all `world_size` members have called it).

    timeout_s bounds every collective on it, so a dead peer turns into an error instead of a hang.
    """
    timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"weight-sync backend {backend!r} is invalid: choose one of {BACKENDS}")


def comm_device(backend: str) -> torch.device:
    """Where buffers must live for `backend`: gloo sends from host memory, NCCL from the current GPU."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def send_weights(group: dist.ProcessGroup, tensors: Mapping[str, torch.Tensor], plan: list[Bucket], version: int,
                 backend: str) -> int:
    """Source side (sync rank 0): header, then every bucket. Returns the version sent."""
    device = comm_device(backend)
    header = torch.tensor([version, fingerprint(plan), len(plan)], dtype=torch.int64, device=device)
    group.broadcast(header, 0).wait()
    for bucket in plan:
        group.broadcast(pack(bucket, tensors, device), 0).wait()
    return version


def receive_weights(group: dist.ProcessGroup, plan: list[Bucket], version: int,
                    backend: str) -> dict[str, torch.Tensor]:
    """Engine side: the header (checked against `plan` and `version`), then every bucket, unpacked.

    On a disagreeing header the buckets the header announces are still drained where the plan knows
    their sizes (the source is not left blocked in a broadcast), and the mismatch is raised afterwards.
    """
    device = comm_device(backend)
    header = torch.zeros(3, dtype=torch.int64, device=device)
    group.broadcast(header, 0).wait()
    got_version, got_fp, got_buckets = (int(x) for x in header.tolist())
    weights: dict[str, torch.Tensor] = {}
    for bucket in plan[:got_buckets]:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        group.broadcast(buf, 0).wait()
        weights.update(unpack(bucket, buf))
    if (got_version, got_fp, got_buckets) != (version, fingerprint(plan), len(plan)):
        raise RuntimeError(
            f"weight sync out of step: the learner sent version {got_version} ({got_buckets} buckets, plan "
            f"{got_fp:x}), this engine expected version {version} ({len(plan)} buckets, plan {fingerprint(plan):x})"
        )
    return weights


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
