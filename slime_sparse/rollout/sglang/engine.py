"""SGLang rollout engine: the RolloutEngine protocol over the HTTP API of (patched) SGLang servers.

generate: one /generate request per prompt, sent concurrently (SGLang batches them) and spread over the engine's
entry points (its router, or else its servers in turn), each seeded with derive_seed(seed, index_offset + i) as in
the embedded engine. A request may opt out of the servers' compression (dense evaluation: `with_kv`).
Weight updates: pause generation, load the new weights into every server, flush the KV cache (stale under new
weights; this also resets the plugin's query rings), continue. Three ways to load them:
- DistributedWeightSync: this process owns the weights and broadcasts them to the servers, which are members of
  one torch.distributed group with it (slime_sparse.utils.weight_sync, in SGLang's flattened-bucket format);
- load_from_distributed: the receiving half alone, inside `paused_update`, when the broadcast comes from another
  process (learner rank 0 under Ray: slime_sparse.rollout.sglang.worker);
- TensorWeightSync: the tensors themselves in HTTP requests (update_weights_from_tensor).
"""
from __future__ import annotations

import base64
import pickle
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol

import torch

from sglang_patches.settings import check_sglang_kv_config  # pure settings: no SGLang import
from slime_sparse.kv import KVCompressConfig
from slime_sparse.utils.weight_sync import FlatPlan, flat_plan, new_group, open_store, require_newer, send_weights
from slime_sparse.rollout.base import KVView
from slime_sparse.rollout.sampling import SamplingParams, derive_seed
from slime_sparse.types import GenerationOutput

from .client import SGLangClient, dense_request_params, parse_generate_response, sampling_payload
from .config import SGLangEngineConfig
from .launch import ServerGroup


def in_parallel(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run `calls` at once (one thread each) and return their results in order; the first failure is raised once
    every call has returned (a server call that fails fast must not leave the others unawaited)."""
    if not calls:
        return []
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]
    return [f.result() for f in futures]


def tensor_layout(state_dict: Mapping[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(name, tuple(t.shape), t.dtype) for name, t in state_dict.items()]


def dtype_name(dtype: torch.dtype) -> str:
    """How SGLang names a dtype over HTTP: it rebuilds it with getattr(torch, name)."""
    return str(dtype).removeprefix("torch.")


def load_from_distributed(clients: list[SGLangClient], plan: FlatPlan, group_name: str, version: str) -> None:
    """Receiving half of a broadcast: bucket after bucket, every server is asked at once to receive the bucket
    (update_weights_from_distributed, flattened-bucket format); the calls return when rank 0 of `group_name` has
    broadcast it and the servers have loaded it. Names, dtypes and shapes are the plan's, in its order: exactly the
    buffer weight_sync.send_weights packs from the same plan."""
    for bucket in plan.buckets:
        names = [s.name for s in bucket.slots]
        dtypes = [dtype_name(s.dtype) for s in bucket.slots]
        shapes = [list(s.shape) for s in bucket.slots]
        in_parallel([
            lambda c=c: c.update_weights_from_distributed(names, dtypes, shapes, group_name, version) for c in clients
        ])


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """update_weights_from_tensor's payload for one TP-1 server: base64 of a pickle of [(name, tensor)], which is
    what SGLang's MultiprocessingSerializer.deserialize reads (its SafeUnpickler admits torch's tensor rebuild
    functions). The tensors travel by value: MultiprocessingSerializer's own pickler would send CPU storages as
    shared-memory handles that only a process of the sender's multiprocessing family may open."""
    # a copy of each tensor: a view would carry its whole underlying storage
    host = [(name, t.detach().to("cpu", copy=True).contiguous()) for name, t in named]
    return base64.b64encode(pickle.dumps(host, protocol=pickle.HIGHEST_PROTOCOL)).decode()


class WeightSync(Protocol):
    """How new weights reach every server (called while generation is paused); `version` as SGLang records it."""

    def push(self, clients: list[SGLangClient], state_dict: Mapping[str, torch.Tensor], version: str) -> None: ...


class DistributedWeightSync:
    """This process broadcasts its weights to the servers (SGLang's update_weights_from_distributed).

    `init`, once: host the group's rendezvous store, ask every server to join a group of 1 + num_servers ranks
    (/init_weights_update_group) and join it as rank 0 (weight_sync.new_group, on the store keys SGLang uses).
    `push`: the state dict in buckets of at most `bucket_bytes` (weight_sync.flat_plan), broadcast by this process
    (weight_sync.send_weights, in a thread) while load_from_distributed has every server receive them.
    """

    def __init__(self, group_name: str | None = None, bucket_bytes: int = 512 << 20, timeout_s: float = 600.0):
        # a server refuses a group name it already has: attached servers outlive a trainer that restarts
        self.group_name = group_name or f"slime_sparse_weights-{uuid.uuid4().hex[:12]}"
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s  # bounds every collective: a server that never calls in becomes an error
        self._store = None
        self._group = None
        self._backend = ""

    def init(self, clients: list[SGLangClient], master_address: str, backend: str = "nccl") -> None:
        world = 1 + len(clients)
        self._store = open_store(master_address, world, self.timeout_s)
        port = self._store.port
        with ThreadPoolExecutor(max_workers=len(clients)) as pool:  # each call returns once the group is formed
            joins = [pool.submit(c.init_weights_update_group, master_address, port, 1 + i, world, self.group_name,
                                 backend) for i, c in enumerate(clients)]
            self._group = new_group(self._store, 0, world, backend, self.timeout_s, prefix=self.group_name)
        for join in joins:
            join.result()
        self._backend = backend

    def push(self, clients: list[SGLangClient], state_dict: Mapping[str, torch.Tensor], version: str) -> None:
        if self._group is None:
            raise RuntimeError("DistributedWeightSync.init must run before the first weight update")
        plan = flat_plan(tensor_layout(state_dict), self.bucket_bytes)
        with ThreadPoolExecutor(max_workers=1) as pool:
            sent = pool.submit(send_weights, self._group, state_dict, plan, int(version), self._backend)
            load_from_distributed(clients, plan, self.group_name, version)
        sent.result()


class TensorWeightSync:
    """The tensors inside the HTTP requests (update_weights_from_tensor), one request per bucket of at most
    `bucket_bytes`. Needs no process group: a restarted Ray engine, tensor-mode syncs, smoke tests."""

    def __init__(self, bucket_bytes: int = 512 << 20):
        self.bucket_bytes = bucket_bytes

    def push(self, clients: list[SGLangClient], state_dict: Mapping[str, torch.Tensor], version: str) -> None:
        for bucket in flat_plan(tensor_layout(state_dict), self.bucket_bytes).buckets:
            payload = serialize_named_tensors([(s.name, state_dict[s.name]) for s in bucket.slots])
            in_parallel([lambda c=c: c.update_weights_from_tensor([payload], version) for c in clients])


class SGLangRolloutEngine:
    """RolloutEngine over SGLang servers. Build with `from_config` (launches them, or attaches to
    --sglang-server-urls), `launch`, or directly on running URLs.

    server_urls: every server (control calls and weight updates go to each); generate_urls: where /generate goes
    (a router, or by default the servers themselves, request i to server i mod n).
    """

    def __init__(self, server_urls: list[str], kv: KVCompressConfig | None, weight_sync: WeightSync | None = None,
                 generate_urls: list[str] | None = None, max_concurrency: int = 256, timeout_s: float = 3600.0,
                 servers: ServerGroup | None = None):
        if kv is not None:
            check_sglang_kv_config(kv)
        if not server_urls:
            raise ValueError("SGLangRolloutEngine needs at least one server URL")
        self.kv = kv
        self.clients = [SGLangClient(u, timeout_s) for u in server_urls]
        self.generate_clients = [SGLangClient(u, timeout_s) for u in (generate_urls or server_urls)]
        self.weight_sync = weight_sync
        self.max_concurrency = max_concurrency
        self._servers = servers
        self._weight_version = 0

    @classmethod
    def launch(cls, cfg: SGLangEngineConfig, kv: KVCompressConfig | None, log_dir: Path,
               weight_sync: WeightSync | None = None) -> "SGLangRolloutEngine":
        group = ServerGroup.launch(cfg, kv, log_dir)
        return cls(group.server_urls, kv, weight_sync, generate_urls=[group.url] if group.router else None,
                   max_concurrency=cfg.max_concurrency, timeout_s=cfg.request_timeout_s, servers=group)

    @classmethod
    def from_config(cls, cfg: SGLangEngineConfig, kv: KVCompressConfig | None, log_dir: Path,
                    weight_sync: WeightSync | None = None) -> "SGLangRolloutEngine":
        """Attach to cfg.server_urls when given (they must run the plugin with the same --kv-* config),
        else launch cfg.num_servers servers."""
        if not cfg.attached:
            return cls.launch(cfg, kv, log_dir, weight_sync)
        cfg.validate()
        return cls(list(cfg.server_urls), kv, weight_sync, max_concurrency=cfg.max_concurrency,
                   timeout_s=cfg.request_timeout_s)

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def compressing(self) -> bool:
        return self.kv is not None and self.kv.enabled

    def request_params(self, kv: KVCompressConfig | None) -> dict | None:
        """custom_params of requests generated under `kv` (None: the servers' own config).

        A server compresses with the config it was started with; a request can only opt out of it (the plugin
        reads DENSE_REQUEST_PARAM): the query rings and the trigger are sized at start-up.
        """
        if kv is None or kv == self.kv or (not kv.enabled and not self.compressing):
            return None
        if not kv.enabled:
            return dense_request_params()
        raise ValueError(
            f"the SGLang engine cannot generate under --kv-method={kv.method} (budget {kv.budget}) per request: its "
            f"servers compress with the --kv-* config they started with ({self.kv}); a request can only run dense"
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None,
                 index_offset: int = 0, *, kv: KVCompressConfig | None = None) -> list[GenerationOutput]:
        """One output per prompt, in order. `index_offset`: where these prompts sit in a larger call split across
        engines (sample i is seeded with derive_seed(seed, index_offset + i)); `kv`: see request_params."""
        custom_params = self.request_params(kv)

        def one(i: int) -> GenerationOutput:
            sample_seed = None if seed is None else derive_seed(seed, index_offset + i)
            client = self.generate_clients[i % len(self.generate_clients)]
            response = client.generate(prompts[i], sampling_payload(params, sample_seed, custom_params))
            return parse_generate_response(prompts[i], response, self.compressing, self._weight_version)

        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, max(1, len(prompts)))) as pool:
            return list(pool.map(one, range(len(prompts))))

    def with_kv(self, kv: KVCompressConfig) -> KVView:
        """These servers seen under another KV config (dense evaluation), sharing their weights and version."""
        self.request_params(kv)  # refuse an unsupported config now, not at the first evaluation
        return KVView(self, kv)

    def sync_from(self, learner) -> None:
        """Load the learner's current weights (a learner in this process: see rollout.base.WeightSource)."""
        self.update_weights(dict(learner.named_weights()))

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Load `state_dict` into every server through self.weight_sync, as `version` (default: the next one)."""
        if self.weight_sync is None:
            raise RuntimeError("SGLangRolloutEngine has no weight_sync: pass DistributedWeightSync or TensorWeightSync")
        version = self._weight_version + 1 if version is None else int(version)
        with self.paused_update(version):
            self.weight_sync.push(self.clients, state_dict, str(version))

    @contextmanager
    def paused_update(self, version: int) -> Iterator[None]:
        """Around loading weights of `version` into every server: pause generation (running requests are retracted
        and re-run after), load (the body), flush the cache, continue. The engine holds `version` afterwards."""
        require_newer(version, self._weight_version, "SGLang engine")
        try:
            in_parallel([lambda c=c: c.pause_generation("retract") for c in self.clients])
            yield
            in_parallel([c.flush_cache for c in self.clients])
        finally:  # whatever failed, no server stays paused
            in_parallel([c.continue_generation for c in self.clients])
        self._weight_version = version

    def release_memory(self) -> None:
        in_parallel([c.release_memory_occupation for c in self.clients])

    def resume_memory(self) -> None:
        in_parallel([c.resume_memory_occupation for c in self.clients])

    def close(self) -> None:
        """Stop the servers this engine launched (attached servers keep running)."""
        if self._servers is not None:
            self._servers.stop()
            self._servers = None
