"""A thin Ray actor around SGLangRolloutEngine: the servers live on the actor's node and GPUs.

Ray is imported only here, when an actor class is built. The actor exposes the RolloutEngine methods, so the
training loop calls `ray.get(actor.generate.remote(...))` exactly where it would call the engine.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout.sampling import SamplingParams
from slime_sparse.types import GenerationOutput

from .config import SGLangEngineConfig
from .engine import DistributedWeightSync, SGLangRolloutEngine


class SGLangEngineActor:
    """Body of the actor: launches the servers of `cfg` on the GPUs Ray gave this actor."""

    def __init__(self, cfg: SGLangEngineConfig, kv: KVCompressConfig | None, log_dir: str):
        import ray

        gpu_ids = [int(g) for g in ray.get_gpu_ids()]
        if gpu_ids and cfg.gpu_ids is None:
            # Ray already set CUDA_VISIBLE_DEVICES for this actor; servers index into it
            cfg.gpu_ids = list(range(cfg.num_servers))
        self.weight_sync = DistributedWeightSync()
        self.engine = SGLangRolloutEngine.launch(cfg, kv, Path(log_dir), weight_sync=self.weight_sync)

    def init_weight_group(self, master_address: str, master_port: int, backend: str = "nccl") -> None:
        self.weight_sync.init(self.engine.clients, master_address, master_port, backend)

    def weight_version(self) -> int:
        return self.engine.weight_version

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None
    ) -> list[GenerationOutput]:
        return self.engine.generate(prompts, params, seed)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.engine.update_weights(state_dict)

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def shutdown(self) -> None:
        self.engine.close()


def make_engine_actor_class(num_gpus: int, **ray_options: Any):
    """`ray.remote(num_gpus=...)(SGLangEngineActor)`: one actor per group of servers."""
    import ray

    return ray.remote(num_gpus=num_gpus, **ray_options)(SGLangEngineActor)
