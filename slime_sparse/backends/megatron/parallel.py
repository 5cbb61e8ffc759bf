"""Process groups for the Megatron backend, and a small multi-process launcher for CPU runs and tests.

On GPU the usual launcher (torchrun, or Ray actors that set RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)
starts one process per GPU and `init_parallel` uses NCCL. On CPU, `spawn` starts `world_size` local
processes that talk over gloo on 127.0.0.1 — that is how the tests and the converters run without GPUs.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from slime_sparse.utils.device import dist_backend


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel layout; data parallelism is whatever is left of the world size."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1

    def validate(self, world_size: int) -> None:
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if tp < 1:
            raise ValueError(f"--tensor-model-parallel-size must be >= 1, got {tp}")
        if pp < 1:
            raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {pp}")
        if world_size % (tp * pp):
            raise ValueError(f"world size {world_size} is not a multiple of TP x PP = {tp} x {pp}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(parallel: ParallelConfig, *, timeout_s: float = 600.0, seed: int = 0) -> bool:
    """Initialise torch.distributed (if not done yet) and Megatron's groups; True when this call initialised
    torch.distributed (its caller then owns the process group: destroy_parallel when done).

    Not initialised yet: a world of one when the environment names no other rank (WORLD_SIZE unset or 1: no
    rendezvous, no port), else the environment's (torchrun-style launchers). Backend: NCCL when CUDA is
    available, gloo otherwise (with the CPU shim applied). The TP RNG tracker is seeded as Megatron does
    (`model_parallel_cuda_manual_seed`)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from .cpu_shim import apply_cpu_shim

    on_gpu = torch.cuda.is_available()
    backend = dist_backend("cuda" if on_gpu else "cpu")
    created = not dist.is_initialized()
    if created and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    elif created:
        if on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    parallel.validate(dist.get_world_size())
    if not on_gpu:
        apply_cpu_shim()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        )
    else:  # a second learner in this process must not silently run under another layout
        have = ParallelConfig(ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != parallel:
            raise ValueError(f"Megatron's groups are already initialised with {have}, asked for {parallel}")
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return created


def destroy_parallel() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _spawn_entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, result_dir: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # world_size processes share the machine's cores
    try:
        result = fn(rank, world_size, *args)
        if result_dir is not None:
            torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():
            destroy_parallel()


def spawn(
    fn: Callable[..., Any], world_size: int, *args: Any, result_dir: str | None = None, timeout_s: float | None = None
) -> list[Any] | None:
    """Run `fn(rank, world_size, *args)` in `world_size` local processes (gloo on 127.0.0.1, a free port).

    `fn` must be importable (module level). With `result_dir`, each rank's return value is saved there
    with torch.save and the list of them (rank order) is returned. An exception on any rank propagates;
    past `timeout_s` every process is terminated and TimeoutError raised (a hung collective would
    otherwise block forever).
    """
    import time

    import torch.multiprocessing as mp

    ctx = mp.spawn(_spawn_entry, args=(world_size, free_port(), fn, args, result_dir), nprocs=world_size, join=False)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if deadline is not None and time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.terminate()
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish on {world_size} ranks within {timeout_s} s")
    if result_dir is None:
        return None
    return [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
