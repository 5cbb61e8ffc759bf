"""The SGLang rollout engine as a Ray actor of RayRolloutGroup (`--rollout-engine sglang --use-ray`).

One actor = one engine = --rollout-num-gpus-per-engine SGLang servers of TP 1 (the budgeted cache requires TP 1),
one per GPU of the engine's placement-group bundles, behind a router when there are several; or, with
--sglang-server-urls, that many servers already running, attached by URL. The actor computes nothing itself: it
launches the servers (they die with it) and speaks HTTP to them. It answers the calls of the embedded engine's
EngineWorker (slime_sparse/ray/rollout_group.py), so the group drives both alike:

    ready, num_sync_ranks, weight_version
    generate(prompts, params, seed, index_offset, kv)   sample i seeded with derive_seed(seed, index_offset + i);
                                                        kv: dense evaluation on compressing servers
    load_weights(state_dict, version)                   tensor hand-off (update_weights_from_tensor)
    join_sync_group(host, port, rank, world, ...)       the SERVERS join learner rank 0's broadcast group, as ranks
                                                        rank .. rank + num_servers - 1
    receive_weights(plan, version)                      pause, per bucket one update_weights_from_distributed per
                                                        server while rank 0 broadcasts, flush, continue
    release_memory / resume_memory                      colocated runs (SGLang's memory saver)
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Mapping

import torch

from slime_sparse.kv import KVCompressConfig
from slime_sparse.utils.weight_sync import FlatPlan, require_newer
from slime_sparse.rollout.sampling import SamplingParams
from slime_sparse.types import GenerationOutput

from .config import SGLangEngineConfig
from .engine import SGLangRolloutEngine, TensorWeightSync, in_parallel, load_from_distributed

logger = logging.getLogger(__name__)


def check_ray_layout(spec, *, num_engines: int, servers_per_engine: int, colocate: bool, use_gpu: bool) -> None:
    """Raise ValueError (naming the flags) unless the engines' `sglang` section (of a factory.EngineSpec) fits the
    Ray layout. (The KV settings were checked for SGLang at start-up: slime_sparse.startup.)"""
    sg: SGLangEngineConfig = spec.sglang
    sg.validate()
    n = servers_per_engine
    if sg.attached:
        if len(sg.server_urls) != num_engines * n:
            raise ValueError(
                f"--sglang-server-urls lists {len(sg.server_urls)} servers; --rollout-num-gpus / "
                f"--rollout-num-gpus-per-engine make {num_engines} engines of {n} servers = {num_engines * n}")
        return
    if sg.num_servers not in (1, n):
        raise ValueError(f"--sglang-num-servers={sg.num_servers}: with --use-ray each engine runs "
                         f"--rollout-num-gpus-per-engine={n} servers (leave --sglang-num-servers unset)")
    if sg.gpu_ids is not None:
        raise ValueError("--sglang-gpu-ids cannot be used with --use-ray: the servers run on the GPUs of their "
                         "engine's placement-group bundles")
    if not use_gpu:
        raise ValueError("--rollout-engine sglang launches its servers on GPUs, but this Ray cluster has none (or "
                         "--device cpu): attach running servers with --sglang-server-urls")
    if colocate and not sg.enable_memory_saver:
        raise ValueError("--colocate with --rollout-engine sglang needs --sglang-enable-memory-saver (the servers "
                         "give their memory to the learner between rollouts)")
    last_port = sg.base_port + num_engines * n - 1
    last_router = sg.router_port + num_engines - 1
    if last_port > 65535 or last_router > 65535:
        raise ValueError(f"--sglang-base-port={sg.base_port} / --sglang-router-port={sg.router_port}: {num_engines} "
                         f"engines of {n} servers need ports up to {max(last_port, last_router)} (> 65535)")


def engine_config(spec, index: int, servers_per_engine: int, gpu_ids: list[int] | None) -> SGLangEngineConfig:
    """The engines' `sglang` section (of a factory.EngineSpec) as engine `index` runs it: its share of
    --sglang-server-urls; or its servers on `gpu_ids`, on ports shifted past those of the engines before it
    (engines may share a node)."""
    sg: SGLangEngineConfig = spec.sglang
    n = servers_per_engine
    if sg.attached:
        return dataclasses.replace(sg, server_urls=tuple(sg.server_urls[index * n:(index + 1) * n]), num_servers=n)
    return dataclasses.replace(
        sg, num_servers=n, gpu_ids=None if gpu_ids is None else tuple(gpu_ids),
        base_port=sg.base_port + index * n, router_port=sg.router_port + index,
    )


class SGLangEngineWorker:
    """One SGLang engine in a Ray actor (see the module docstring), built from a factory.EngineSpec. `servers`: how
    many it runs (--rollout-num-gpus-per-engine); `gpu_ids`: the GPUs of the engine's bundles (RayRolloutGroup asks
    Ray for them), one server each; unused when attaching to --sglang-server-urls."""

    # the weight plan its servers receive: SGLang's flattened buckets, no header (slime_sparse.utils.weight_sync)
    sync_format = "flat"

    def __init__(self, spec, index: int, timeout_s: float, *, servers: int = 1,
                 gpu_ids: list[int] | None = None) -> None:
        self.index = index  # timeout_s (EngineWorker's signature) is unused: HTTP calls have their own bounds
        sg = engine_config(spec, index, servers, gpu_ids)
        self.engine = SGLangRolloutEngine.from_config(
            sg, spec.kv, Path(spec.log_dir) / f"engine-{index}",
            weight_sync=TensorWeightSync(spec.weight_bucket_bytes),
        )
        self._group_name: str | None = None  # the broadcast group the servers are in
        self._attached = sg.attached  # servers that outlive this actor (and keep its groups)
        self._released = False

    def ready(self) -> int:
        return self.index

    def num_sync_ranks(self) -> int:
        """Members this engine adds to a weight-sync group: every server (not this actor)."""
        return len(self.engine.clients)

    def weight_version(self) -> int:
        return self.engine.weight_version

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int, index_offset: int,
                 kv: KVCompressConfig | None = None) -> list[GenerationOutput]:
        return self.engine.generate(prompts, params, seed, index_offset, kv=kv)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Hand the tensors to every server as `version` (must be newer than the one held); returns the version held."""
        require_newer(version, self.engine.weight_version, f"engine {self.index}")
        self.resume_memory()  # weights load into resident memory; the next rollout needs it back anyway
        self.engine.update_weights(state_dict, version)
        return self.engine.weight_version

    def join_sync_group(self, host: str, port: int, rank: int, world_size: int, backend: str, prefix: str,
                        replaces: str | None = None) -> None:
        """Every server joins the group `prefix` of learner rank 0 (SGLang's /init_weights_update_group), server j
        as rank `rank + j`; returns once the whole group is formed. The servers first leave the group being
        replaced: the one they joined through this actor, or, for attached servers of a restarted actor,
        `replaces` (joined through the actor that died)."""
        stale = self._group_name or (replaces if self._attached else None)
        if stale is not None:
            self._leave_group(stale)
        clients = self.engine.clients
        in_parallel([lambda c=c, j=j: c.init_weights_update_group(host, port, rank + j, world_size, prefix, backend)
                     for j, c in enumerate(clients)])
        self._group_name = prefix

    def receive_weights(self, plan: FlatPlan, version: int) -> int:
        """The servers receive rank 0's broadcast of `plan` as `version`, generation paused meanwhile."""
        if self._group_name is None:
            raise RuntimeError(f"engine {self.index}: receive_weights before join_sync_group")
        if not isinstance(plan, FlatPlan):
            raise TypeError(f"engine {self.index}: SGLang servers receive weight_sync.FlatPlan buckets, got "
                            f"{type(plan).__name__}")
        require_newer(version, self.engine.weight_version, f"engine {self.index}")
        self.resume_memory()
        with self.engine.paused_update(version):
            load_from_distributed(self.engine.clients, plan, self._group_name, str(version))
        return self.engine.weight_version

    def release_memory(self) -> None:
        if not self._released:
            self.engine.release_memory()
            self._released = True

    def resume_memory(self) -> None:
        if self._released:
            self.engine.resume_memory()
            self._released = False

    def close(self) -> None:
        self.engine.close()

    def _leave_group(self, name: str) -> None:
        """Ask the servers to drop a group being replaced (a member was restarted): it holds communicators."""
        try:
            in_parallel([lambda c=c: c.destroy_weights_update_group(name) for c in self.engine.clients])
        except Exception as exc:  # noqa: BLE001 - a stale group is only a leak, never a reason to stop
            logger.warning("engine %d: could not destroy weight-sync group %s on its servers: %s", self.index, name,
                           exc)
