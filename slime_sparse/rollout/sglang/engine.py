"""SGLang rollout engine: the RolloutEngine protocol over the HTTP API of (patched) SGLang servers.

generate: one /generate request per prompt, sent concurrently (SGLang batches them), each with its own seed
derived from (seed, index) as in the embedded engine. update_weights: pause generation, push the weights through a
WeightSync, flush the KV cache (stale under new weights), continue. KV accounting comes back per request.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Mapping, Protocol

import torch

from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout.sampling import SamplingParams, derive_seed
from slime_sparse.types import GenerationOutput

from .client import SGLangClient, parse_generate_response, sampling_payload
from .config import SGLangEngineConfig
from .launch import ServerGroup


def join_weight_group(master_address: str, master_port: int, world_size: int, group_name: str, backend: str):
    """Join, as rank 0, the process group SGLang's servers create in /init_weights_update_group.

    The servers call sglang.srt.utils.common.init_custom_process_group: a TCP rendezvous at
    tcp://master_address:master_port, a PrefixStore named after the group, then a group that is NOT the default
    one. We perform the same three steps on our side (rank 0 hosts the TCP store).
    """
    from datetime import timedelta

    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(minutes=30)
    store, rank, world = next(rendezvous(f"tcp://{master_address}:{master_port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world)}
    return group


class WeightSync(Protocol):
    """How new weights reach every server (called while generation is paused)."""

    def push(self, clients: list[SGLangClient], state_dict: Mapping[str, torch.Tensor], version: str) -> None: ...


class DistributedWeightSync:
    """torch.distributed broadcast from the trainer (rank 0) to every server (SGLang's update_weights_from_distributed).

    `init` must be called once by the trainer process that owns the weights: it asks every server to join a
    process group of 1 + num_servers ranks (NCCL) and joins it as rank 0 itself. Tensors go in buckets of at most
    `bucket_bytes`; for each bucket every server is told the names/dtypes/shapes over HTTP (in a thread, since the
    call returns only once the broadcast is received) while this process broadcasts them.
    """

    def __init__(self, group_name: str = "slime_sparse_weights", bucket_bytes: int = 512 << 20,
                 broadcast: Callable[[torch.Tensor], None] | None = None):
        self.group_name = group_name
        self.bucket_bytes = bucket_bytes
        self._broadcast = broadcast
        self._group = None

    def init(self, clients: list[SGLangClient], master_address: str, master_port: int, backend: str = "nccl") -> None:
        world = 1 + len(clients)
        errors: list[BaseException] = []

        def ask(i: int, client: SGLangClient) -> None:
            try:
                client.init_weights_update_group(master_address, master_port, 1 + i, world, self.group_name, backend)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=ask, args=(i, c)) for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        self._group = join_weight_group(master_address, master_port, world, self.group_name, backend)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _send(self, tensor: torch.Tensor) -> None:
        if self._broadcast is not None:
            self._broadcast(tensor)
            return
        if self._group is None:
            raise RuntimeError("DistributedWeightSync.init must run before the first weight update")
        torch.distributed.broadcast(tensor, src=0, group=self._group)

    def buckets(self, state_dict: Mapping[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
        out, current, size = [], [], 0
        for name, tensor in state_dict.items():
            nbytes = tensor.numel() * tensor.element_size()
            if current and size + nbytes > self.bucket_bytes:
                out.append(current)
                current, size = [], 0
            current.append((name, tensor))
            size += nbytes
        if current:
            out.append(current)
        return out

    def push(self, clients: list[SGLangClient], state_dict: Mapping[str, torch.Tensor], version: str) -> None:
        for bucket in self.buckets(state_dict):
            names = [n for n, _ in bucket]
            dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
            shapes = [list(t.shape) for _, t in bucket]
            errors: list[BaseException] = []

            def announce(client: SGLangClient) -> None:
                try:
                    client.update_weights_from_distributed(names, dtypes, shapes, self.group_name, version)
                except BaseException as exc:  # re-raised below, after the broadcast completes
                    errors.append(exc)

            threads = [threading.Thread(target=announce, args=(c,)) for c in clients]
            for t in threads:
                t.start()
            for _, tensor in bucket:
                self._send(tensor.contiguous())
            for t in threads:
                t.join()
            if errors:
                raise errors[0]


class TensorWeightSync:
    """Colocated trainer and server on the same GPUs: SGLang's update_weights_from_tensor (CUDA IPC handles)."""

    def push(self, clients: list[SGLangClient], state_dict: Mapping[str, torch.Tensor], version: str) -> None:
        import base64

        from sglang.srt.utils.common import MultiprocessingSerializer

        payload = MultiprocessingSerializer.serialize(list(state_dict.items()), output_str=True)
        if isinstance(payload, bytes):
            payload = base64.b64encode(payload).decode()
        for client in clients:
            client.update_weights_from_tensor([payload], version)


class SGLangRolloutEngine:
    """RolloutEngine over SGLang servers. Build with `launch` (starts servers) or directly on running URLs."""

    def __init__(self, server_urls: list[str], kv: KVCompressConfig | None, weight_sync: WeightSync | None = None,
                 generate_url: str | None = None, max_concurrency: int = 256, timeout_s: float = 3600.0,
                 servers: ServerGroup | None = None):
        if kv is not None:
            kv.validate(prefix="--kv-")
            if kv.enabled and kv.granularity != "model":
                raise ValueError(
                    f"--kv-granularity={kv.granularity!r} is not supported by the SGLang engine: one req_to_token "
                    "row per request is shared by every layer and head, so use --kv-granularity model"
                )
        if not server_urls:
            raise ValueError("SGLangRolloutEngine needs at least one server URL")
        self.kv = kv
        self.clients = [SGLangClient(u, timeout_s) for u in server_urls]
        self.generate_client = SGLangClient(generate_url or server_urls[0], timeout_s)
        self.weight_sync = weight_sync
        self.max_concurrency = max_concurrency
        self._servers = servers
        self._weight_version = 0

    @classmethod
    def launch(cls, cfg: SGLangEngineConfig, kv: KVCompressConfig | None, log_dir: Path,
               weight_sync: WeightSync | None = None) -> "SGLangRolloutEngine":
        group = ServerGroup.launch(cfg, kv, log_dir)
        return cls(group.server_urls, kv, weight_sync, generate_url=group.url, max_concurrency=cfg.max_concurrency,
                   timeout_s=cfg.request_timeout_s, servers=group)

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def compressing(self) -> bool:
        return self.kv is not None and self.kv.enabled

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None
    ) -> list[GenerationOutput]:
        def one(index: int) -> GenerationOutput:
            sample_seed = None if seed is None else derive_seed(seed, index)
            response = self.generate_client.generate(prompts[index], sampling_payload(params, sample_seed))
            return parse_generate_response(prompts[index], response, self.compressing, self._weight_version)

        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, max(1, len(prompts)))) as pool:
            return list(pool.map(one, range(len(prompts))))

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        if self.weight_sync is None:
            raise RuntimeError("SGLangRolloutEngine has no weight_sync: pass DistributedWeightSync or TensorWeightSync")
        version = str(self._weight_version + 1)
        for c in self.clients:
            c.pause_generation("retract")
        try:
            self.weight_sync.push(self.clients, state_dict, version)
            for c in self.clients:
                c.flush_cache()  # cached KV was computed by the old weights; also resets the plugin's rings
        finally:
            for c in self.clients:
                c.continue_generation()
        self._weight_version += 1

    def release_memory(self) -> None:
        for c in self.clients:
            c.release_memory_occupation()

    def resume_memory(self) -> None:
        for c in self.clients:
            c.resume_memory_occupation()

    def close(self) -> None:
        if self._servers is not None:
            self._servers.stop()
            self._servers = None
