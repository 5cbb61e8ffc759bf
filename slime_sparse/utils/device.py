"""Which device a process computes on, and which torch.distributed backend goes with it.

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
