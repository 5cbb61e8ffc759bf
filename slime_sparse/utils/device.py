"""Which device a process computes on, which torch.distributed backend goes with it, and how much memory it has free.

One rule for every process group of a run (learner ranks, Megatron's groups, weight sync to engines):
NCCL between GPUs, gloo between CPU processes.
"""
from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """--device: "auto" is the GPU when there is one, else the CPU; "cuda" must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device=cuda but CUDA is not available")
    return torch.device(name)


def dist_backend(device: torch.device | str) -> str:
    """The torch.distributed backend of processes computing on `device`: NCCL on GPUs, gloo on CPUs."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_memory_bytes(device: torch.device | str) -> int:
    """Memory free for new allocations on `device` now: on CUDA the driver's free memory after torch gives back what it
    caches unused (torch.cuda.mem_get_info); on CPU the kernel's MemAvailable (/proc/meminfo: free memory plus the page
    cache it can drop)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        raise ValueError(f"free memory of a {device.type} device is not known (CUDA and CPU are)")
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise ValueError("the CPU's available memory is unknown here (no MemAvailable in /proc/meminfo)")


def check_memory_size(kv_cache_gib: float | None, mem_fraction: float | None) -> None:
    """The rollout engine's memory is sized by at most one of --rollout-kv-cache-gib and --rollout-mem-fraction."""
    if kv_cache_gib is not None and not kv_cache_gib > 0:
        raise ValueError(f"--rollout-kv-cache-gib={kv_cache_gib} is invalid: must be > 0 (GiB)")
    if mem_fraction is not None and not 0 < mem_fraction < 1:
        raise ValueError(f"--rollout-mem-fraction={mem_fraction} is invalid: must lie in (0, 1)")
    if kv_cache_gib is not None and mem_fraction is not None:
        raise ValueError("--rollout-kv-cache-gib and --rollout-mem-fraction both size the rollout engine's memory: "
                         "give one")
