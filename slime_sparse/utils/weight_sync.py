"""Learner -> rollout engine weight sync over a torch.distributed group: bucket plan, packing, both ends.

The wire protocol only (torch.distributed, no Ray): it sits here, beside `device.dist_backend`, so that the Ray
orchestrator (slime_sparse/ray/), the SGLang engine and its Ray worker all import it from below and no rollout
engine imports the orchestrator (tests/test_layering.py).

The sync group holds learner rank 0 (sync rank 0, the source) and every receiving process (ranks 1..N):
embedded engine actors, or the SGLang servers themselves. It is a standalone process group built on its
own TCPStore, not a subgroup of the learners' default group: learner rank 0 belongs to both, and the
receivers to no other. Gloo on CPU, NCCL on GPU. `new_group` builds it on the same store keys as SGLang's
/init_weights_update_group, so our members and SGLang servers form one group.

Two wire formats, chosen by the plan the driver hands to both ends:
- a list of `Bucket`s (embedded engines): the source first broadcasts a header [version, plan
  fingerprint, number of buckets], which each engine checks against the plan and version the driver gave
  it, so a member that fell out of step cannot load a mix of two syncs; then one broadcast per bucket,
  its tensors packed as raw bytes at 16-byte aligned offsets (any dtype, bit-exact);
- a `FlatPlan` (SGLang servers): no header (a server receives only what its
  /update_weights_from_distributed call announces); one broadcast per bucket in SGLang's
  "flattened_bucket" layout, the tensors' bytes back to back. The version travels over HTTP.
Receivers report the version they now hold; the driver checks it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping

import torch
import torch.distributed as dist

ALIGN = 16  # byte alignment of each tensor in a bucket: a uint8 slice can then be viewed as any dtype
BACKENDS = ("gloo", "nccl")
# The device torch's group helper files a backend's store keys under (the first it maps the backend to).
BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


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
    bucket: it is sent as bytes, each tensor at a 16-byte aligned offset.
    """
    return _plan(layout, bucket_bytes, lambda used, dtype: _align(used))


@dataclass(frozen=True)
class FlatPlan:
    """Buckets in SGLang's flattened-bucket layout (sglang/srt/weight_sync/tensor_bucket.py): each bucket is
    its tensors' bytes back to back, in order, with no padding. Sent without a header."""

    buckets: tuple[Bucket, ...]


def flat_plan(layout: list[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> FlatPlan:
    """`layout` in buckets of at most `bucket_bytes` bytes, packed as SGLang's FlattenedTensorBucket packs them.

    SGLang rebuilds each tensor as `flat[start:end].view(dtype)`, which needs `start` to be a multiple of the
    dtype's element size: a tensor that would start misaligned (after an odd number of bf16 values, say)
    opens a new bucket instead.
    """
    def packed_offset(used: int, dtype: torch.dtype) -> int | None:
        return used if used % _element_size(dtype) == 0 else None

    return FlatPlan(tuple(_plan(layout, bucket_bytes, packed_offset)))


def layout_of(plan: list[Bucket] | FlatPlan) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor of a plan, in order (to re-plan it in another format)."""
    buckets = plan.buckets if isinstance(plan, FlatPlan) else plan
    return [(s.name, s.shape, s.dtype) for b in buckets for s in b.slots]


def _plan(layout: list[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int,
          place: Callable[[int, torch.dtype], int | None]) -> list[Bucket]:
    """Buckets in order; `place(used, dtype)` is the offset of the next tensor after `used` bytes, or None
    when it cannot go in the current bucket."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1 (--update-weight-buffer-size)")
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    used = 0
    for name, shape, dtype in layout:
        nbytes = _numel(shape) * _element_size(dtype)
        offset = place(used, dtype)
        if slots and (offset is None or (nbytes and offset + nbytes > bucket_bytes)):
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

    The keys are those SGLang's servers use when they join (sglang.srt.utils.common.init_custom_process_group:
    torch's _new_process_group_helper(group_name=prefix) over PrefixStore(prefix, store), which files the
    backend's keys under "<prefix>/" and then "<device>/"), so SGLang servers and our members form one group.
    The backend is built directly rather than through that helper: the helper registers the name in
    torch's per-process group table, which would forbid two members in one process (tests).
    timeout_s bounds every collective on it, so a dead peer turns into an error instead of a hang.
    """
    if backend not in BACKENDS:
        raise ValueError(f"weight-sync backend {backend!r} is invalid: choose one of {BACKENDS}")
    timeout = timedelta(seconds=timeout_s)
    group_keys = dist.PrefixStore(f"{prefix}/", dist.PrefixStore(prefix, store))
    keys = dist.PrefixStore(f"{BACKEND_DEVICE[backend]}/", group_keys)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(keys, rank, world_size, timeout)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(keys, rank, world_size, options)
    group._set_sequence_number_for_group()  # as the helper does, so both ends number their collectives alike
    return group


def open_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store of a sync group, hosted by the source on a port the OS picks (`.port`).
    Members join it as TCPStore clients, SGLang servers through tcp://host:port."""
    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def comm_device(backend: str) -> torch.device:
    """Where buffers must live for `backend`: gloo sends from host memory, NCCL from the current GPU."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def send_weights(group: dist.ProcessGroup, tensors: Mapping[str, torch.Tensor], plan: list[Bucket] | FlatPlan,
                 version: int, backend: str) -> int:
    """Source side (sync rank 0): the header (framed plan only), then every bucket. Returns the version sent."""
    device = comm_device(backend)
    if isinstance(plan, FlatPlan):
        for bucket in plan.buckets:  # each SGLang server is inside the matching update_weights_from_distributed call
            group.broadcast(pack(bucket, tensors, device), 0).wait()
        return version
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


def require_newer(version: int, held: int, who: str) -> None:
    """Both ends of a sync refuse a version that is not newer than the one held (a replayed or reordered sync)."""
    if version <= held:
        raise ValueError(f"{who}: weight version {version} is not newer than the loaded {held}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
