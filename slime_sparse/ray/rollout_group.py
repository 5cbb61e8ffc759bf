"""RayRolloutGroup: the RolloutEngine protocol over several engine actors.

- Engines: `--rollout-engine embedded` runs EngineWorker (the embedded engine in the actor, one device);
  `--rollout-engine sglang` runs slime_sparse.rollout.sglang.worker.SGLangEngineWorker (the actor launches
  --rollout-num-gpus-per-engine SGLang servers on the GPUs of its bundles, or attaches to running ones).
  Both answer the same calls.
- generate(): the prompts are cut into contiguous, equal-count shards, one per engine, and the results
  gathered back in input order. Each shard carries its global index offset, so sample i is drawn from
  the generator of (seed, i) whichever engine runs it: the outputs do not depend on the number of
  engines, and a re-sent shard reproduces exactly what the lost one would have returned.
- Faults: an engine actor that dies while serving a shard is replaced by a new actor in the same bundle,
  given the current weights, and sent that shard again (at most --rollout-max-restarts per call).
- Weights: `sync_from(learner_group)` moves the learner's weights to every engine without passing
  through the driver: broadcast from learner rank 0 over a torch.distributed group (utils/weight_sync.py) whose
  other members are the engine actors, or the SGLang servers themselves; or in "tensor" mode (colocated
  default) through the object store. `update_weights(state_dict)` pushes a driver-side state dict. Every
  sync carries a version that both ends check.
- Colocated mode: engines release their memory after each generate() (the learner trains next) and
  resume it before the next one.
"""
from __future__ import annotations

import logging
import uuid
from typing import Mapping

import ray
import torch
from ray.exceptions import RayActorError

from slime_sparse.factory import EngineSpec, build_engine
from slime_sparse.rollout.base import KVView
from slime_sparse.rollout.partial import PartialSpec
from slime_sparse.rollout.sampling import SamplingParams
from slime_sparse.types import GenerationOutput
from slime_sparse.utils.device import dist_backend

from .layout import split_contiguous
from .placement import RayCluster
from .utils import get, get_each
from slime_sparse.utils.weight_sync import Bucket, FlatPlan, flat_plan, layout_of, new_group, receive_weights, require_newer

logger = logging.getLogger(__name__)


def resolve_update_mode(mode: str, *, colocate: bool, use_gpu: bool) -> str:
    """--update-weight-mode: "auto" is tensor handoff when colocated, a broadcast otherwise. NCCL cannot
    broadcast between two processes on one GPU, so colocated GPU runs must use tensor mode."""
    if mode == "auto":
        return "tensor" if colocate else "broadcast"
    if mode == "broadcast" and colocate and use_gpu:
        raise ValueError("--update-weight-mode broadcast cannot be used with --colocate on GPUs "
                         "(NCCL needs one GPU per rank): use tensor or auto")
    return mode


def worker_class(engine: str) -> type:
    """The actor body of `--rollout-engine engine`."""
    if engine == "sglang":
        from slime_sparse.rollout.sglang.worker import SGLangEngineWorker

        return SGLangEngineWorker
    return EngineWorker


def bundle_gpu_ids(cluster: RayCluster, bundles: list[int], timeout_s: float) -> list[tuple[str, list[int]]]:
    """(node id, GPU ids) of each of `bundles`, as Ray reports them to a tiny task placed in the bundle."""
    probe = ray.remote(num_cpus=0, num_gpus=0.01)(_node_and_gpus)  # a sliver: the bundle may be shared (colocated)
    refs = [probe.options(scheduling_strategy=cluster.strategy(b)).remote() for b in bundles]
    return get(refs, f"GPU ids of bundles {bundles}", timeout_s)


def _node_and_gpus() -> tuple[str, list[int]]:
    return ray.get_runtime_context().get_node_id(), [int(g) for g in ray.get_gpu_ids()]


def engine_gpu_ids(per_bundle: list[tuple[str, list[int]]], engine: int) -> list[int]:
    """The GPUs of one engine's bundles; the engine's actor launches a server on each, so they must share a node."""
    nodes = {node for node, _ in per_bundle}
    if len(nodes) > 1:
        raise ValueError(f"engine {engine}'s {len(per_bundle)} bundles span nodes {sorted(nodes)}: "
                         "--rollout-num-gpus-per-engine must divide the GPUs of a node")
    return [gpu for _, gpus in per_bundle for gpu in gpus]


class EngineWorker:
    """One embedded rollout engine in a Ray actor (SGLang engines: rollout/sglang/worker.py, same calls)."""

    # the weight plan it receives: header + aligned buckets (utils/weight_sync.py)
    sync_format = "framed"

    def __init__(self, spec: EngineSpec, index: int, timeout_s: float) -> None:
        self.index = index
        self.timeout_s = timeout_s
        self.engine = build_engine(spec)
        self._sync_group = None
        self._sync_backend = "gloo"

    def ready(self) -> int:
        return self.index

    def num_sync_ranks(self) -> int:
        """Members this engine adds to a weight-sync group: this actor."""
        return 1

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int, index_offset: int,
                 kv=None, partial=None) -> list[GenerationOutput]:
        return self.engine.generate(prompts, params, seed=seed, index_offset=index_offset, kv=kv,
                                    **({} if partial is None else {"partial": partial}))

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Load a full state dict as `version` (must be newer than the one held); returns the version held."""
        require_newer(version, self.engine.weight_version, f"engine {self.index}")
        self.engine.update_weights(state_dict, version=version)
        return self.engine.weight_version

    def weight_version(self) -> int:
        return self.engine.weight_version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.engine.model.state_dict().items()}

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def join_sync_group(self, host: str, port: int, rank: int, world_size: int, backend: str, prefix: str,
                        replaces: str | None = None) -> None:
        """Join the group `prefix` as `rank` (the group it replaces, if any, went with this actor's old object)."""
        from datetime import timedelta

        import torch.distributed as dist

        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=self.timeout_s))
        self._sync_group = new_group(store, rank, world_size, backend, self.timeout_s, prefix=prefix)
        self._sync_backend = backend

    def receive_weights(self, plan: list[Bucket], version: int) -> int:
        if self._sync_group is None:
            raise RuntimeError(f"engine {self.index}: receive_weights before join_sync_group")
        weights = receive_weights(self._sync_group, plan, version, self._sync_backend)
        return self.load_weights(weights, version)


class RayRolloutGroup:
    """RolloutEngine over `cluster.layout.num_engines` engine actors (see the module docstring)."""

    def __init__(self, spec: EngineSpec, cluster: RayCluster, *, update_weight_mode: str = "auto",
                 max_restarts: int = 3, timeout_s: float | None = None, actor_cls: type | None = None) -> None:
        """update_weight_mode, max_restarts: --update-weight-mode, --rollout-max-restarts;
        actor_cls: the engine actor's body (default: worker_class(--rollout-engine))."""
        layout = cluster.layout
        if spec.kind == "embedded" and layout.bundles_per_engine != 1:
            raise ValueError("the embedded engine runs on one device: --rollout-num-gpus-per-engine must be 1, "
                             f"got {layout.bundles_per_engine}")
        self.spec = spec
        self.cluster = cluster
        self.timeout_s = cluster.timeout_s if timeout_s is None else timeout_s
        actor_cls = worker_class(spec.kind) if actor_cls is None else actor_cls
        self._sync_format = actor_cls.sync_format
        self._worker_kwargs: list[dict] = [{} for _ in range(layout.num_engines)]  # per engine, fixed over restarts
        if spec.kind == "sglang":
            self._worker_kwargs = self._sglang_worker_kwargs()
        self.max_restarts = max_restarts
        self.mode = resolve_update_mode(update_weight_mode, colocate=layout.colocate, use_gpu=layout.use_gpu)
        self.backend = dist_backend("cuda" if layout.use_gpu else "cpu")
        self.num_restarts = 0  # over the group's life
        self._actor_cls = ray.remote(actor_cls)
        self._version = 0
        self._pushed_ref = None  # weights pushed by update_weights(), kept for restarted engines
        self._source = None  # learner group of the last sync_from(), asked again by restarted engines
        self._source_step = -1  # its optimizer step at that sync: the weights engines must hold
        self._sync_name: str | None = None  # name of the live weight-sync group
        self._sync_members: tuple | None = None  # (source actor, *engines) in it
        self._plan: list[Bucket] | FlatPlan | None = None  # in the format the engines receive
        self.engines = [self._spawn(i) for i in range(cluster.layout.num_engines)]
        try:
            get_each([e.ready.remote() for e in self.engines], "rollout engines start-up", self.timeout_s)
        except BaseException:
            self.close()
            raise
        logger.info("rollout group: %d engines, weight sync by %s", len(self.engines), self.mode)

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    # ---- RolloutEngine protocol ----------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None,
                 index_offset: int = 0, *, kv=None, partial: PartialSpec | None = None) -> list[GenerationOutput]:
        """One output per prompt, in order; `kv` overrides the engines' KV config (evaluation); `index_offset` as in
        `RolloutEngine.generate` (the shards add their own); `partial` (--partial-rollout): shards cut at group
        boundaries, each engine stopping after its share of the groups (rounded up)."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())  # one seed for every shard, like one engine
        if self.cluster.layout.colocate:
            self._on_all("resume_memory")
        outputs: list[GenerationOutput | None] = [None] * len(prompts)
        tasks = {}  # in-flight ref -> (engine index, shard, its partial spec)
        shards = [(shard, None) for shard in split_contiguous(len(prompts), self.num_engines)] if partial is None \
            else partial.check(prompts).shards(self.num_engines)
        for i, (shard, part) in enumerate(shards):
            if shard:
                tasks[self._submit(i, prompts, shard, params, seed, kv, index_offset, part)] = (i, shard, part)
        restarts = 0
        while tasks:
            ready, _ = ray.wait(list(tasks), num_returns=1, timeout=self.timeout_s)
            if not ready:
                late = sorted(i for i, *_ in tasks.values())
                raise TimeoutError(f"rollout: engines {late} produced nothing for {self.timeout_s:.0f} s "
                                   "(--ray-timeout)")
            i, shard, part = tasks.pop(ready[0])
            try:
                outputs[shard.start:shard.stop] = get(ready[0], f"rollout shard of engine {i}", self.timeout_s)
            except RayActorError as exc:
                restarts += 1
                if restarts > self.max_restarts:
                    raise RuntimeError(f"rollout: engine actors died {restarts} times in one generate() call, over "
                                       f"--rollout-max-restarts={self.max_restarts}") from exc
                logger.warning("engine %d died mid-rollout (%s): restarting it and re-sending its %d prompts",
                               i, type(exc).__name__, len(shard))
                self._restart(i)
                tasks[self._submit(i, prompts, shard, params, seed, kv, index_offset, part)] = (i, shard, part)
        if self.cluster.layout.colocate:
            self._on_all("release_memory")
        return outputs  # type: ignore[return-value]

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Push a state dict held by the driver to every engine (through the object store)."""
        version = self._next_version(version)
        ref = ray.put({k: v.detach().cpu() for k, v in state_dict.items()})
        self._check_versions(get_each([e.load_weights.remote(ref, version) for e in self.engines],
                                      "update_weights", self.timeout_s), version)
        self._version, self._pushed_ref, self._source = version, ref, None

    def sync_from(self, learner) -> int:
        """Bring every engine to the learner group's current weights, learner -> engines directly.
        Returns the new weight version."""
        version = self._next_version(None)
        if self.mode == "tensor":
            ref = learner.weights_ref()  # rank 0's host copy; each engine fetches it from the object store
            results = get_each([e.load_weights.remote(ref, version) for e in self.engines], "weight sync (tensor)",
                               self.timeout_s)
        else:
            results = self._broadcast_from(learner.source_actor, version)
        self._check_versions(results, version)
        self._version, self._pushed_ref = version, None
        self._source, self._source_step = learner, learner.step
        return version

    def release_memory(self) -> None:
        self._on_all("release_memory")

    def resume_memory(self) -> None:
        self._on_all("resume_memory")

    def with_kv(self, kv) -> KVView:
        """This group's engines under another KV config (e.g. dense evaluation), sharing their weights."""
        kv.validate()
        return KVView(self, kv)

    def engine_state_dict(self, index: int) -> dict[str, torch.Tensor]:
        """Engine `index`'s weights as it holds them (checks, debugging)."""
        return get(self.engines[index].state_dict.remote(), f"state_dict of engine {index}", self.timeout_s)

    def engine_versions(self) -> list[int]:
        return get_each([e.weight_version.remote() for e in self.engines], "weight versions", self.timeout_s)

    def close(self) -> None:
        """Kill the engine actors (and let the sync source forget their group). Idempotent."""
        if self._sync_members is not None:
            try:
                get(self._sync_members[0].drop_sync_group.remote(self._sync_name), "drop weight-sync group", 10.0)
            except (RayActorError, TimeoutError):
                pass  # the learner is gone or stuck: nothing left to tidy there
            self._sync_members = None
        for e in self.engines:
            ray.kill(e, no_restart=True)
        self.engines = []

    # ---- internals ---------------------------------------------------------------------------------
    def _sglang_worker_kwargs(self) -> list[dict]:
        """Per SGLang engine: where its servers log and, when it launches them, the GPUs of its bundles."""
        from slime_sparse.rollout.sglang.worker import check_ray_layout

        layout = self.cluster.layout
        check_ray_layout(self.spec, num_engines=layout.num_engines, servers_per_engine=layout.bundles_per_engine,
                         colocate=layout.colocate, use_gpu=layout.use_gpu)
        kwargs = [{"servers": layout.bundles_per_engine} for _ in range(layout.num_engines)]
        if not self.spec.sglang.attached:
            for i, bundles in enumerate(layout.engine_bundles()):
                kwargs[i]["gpu_ids"] = engine_gpu_ids(bundle_gpu_ids(self.cluster, bundles, self.timeout_s), i)
        return kwargs

    def _spawn(self, i: int):
        bundle = self.cluster.layout.engine_bundles()[i][0]
        return self._actor_cls.options(**self.cluster.actor_options(bundle)).remote(
            self.spec, i, self.timeout_s, **self._worker_kwargs[i])

    def _submit(self, i: int, prompts, shard: range, params, seed: int, kv, index_offset: int = 0, partial=None):
        return self.engines[i].generate.remote(prompts[shard.start:shard.stop], params, seed,
                                               index_offset + shard.start, kv, *([] if partial is None else [partial]))

    def _restart(self, i: int) -> None:
        """Replace engine i by a fresh actor in its bundle holding the current weights."""
        ray.kill(self.engines[i], no_restart=True)
        engine = self._spawn(i)
        get(engine.ready.remote(), f"restart of engine {i}", self.timeout_s)
        ref = self._current_weights()
        if ref is not None:
            loaded = get(engine.load_weights.remote(ref, self._version), f"weights of restarted engine {i}",
                         self.timeout_s)
            self._check_versions([loaded], self._version)
        self.engines[i] = engine  # the sync group's members no longer match: rebuilt at the next sync
        self.num_restarts += 1

    def _current_weights(self):
        """Object ref of the weights of version self._version, or None at version 0 (the checkpoint's)."""
        if self._pushed_ref is not None:
            return self._pushed_ref
        if self._source is None:
            return None
        if self._source.step != self._source_step:
            raise RuntimeError("cannot restart an engine: the learner has trained since the last weight sync, so "
                               f"the weights of version {self._version} are gone")
        return self._source.weights_ref()

    def _broadcast_from(self, source, version: int) -> list[int]:
        members = (source, *self.engines)
        if self._sync_members != members:
            if self._sync_members is not None and self._sync_members[0] is source:
                get(source.drop_sync_group.remote(self._sync_name), "drop weight-sync group", self.timeout_s)
            self._sync_name = self._join_sync_group(source, replaces=self._sync_name)
            self._sync_members = members
            bucket_bytes = self.spec.weight_bucket_bytes
            self._plan = get(source.weight_plan.remote(bucket_bytes), "weight plan", self.timeout_s)
            if self._sync_format == "flat":  # SGLang servers receive its tensors as flattened buckets, no header
                self._plan = flat_plan(layout_of(self._plan), bucket_bytes)
        refs = [source.send_weights.remote(self._sync_name, self._plan, version)]
        refs += [e.receive_weights.remote(self._plan, version) for e in self.engines]
        return get_each(refs, "weight sync (broadcast)", self.timeout_s)  # [sent, received by each engine]

    def _join_sync_group(self, source, replaces: str | None = None) -> str:
        """Form a new weight-sync group: the source (rank 0) and every engine's members (the actor itself, or each
        of its SGLang servers), ranks numbered engine after engine; returns its name. `replaces`: the group it
        supersedes, which members that outlive their actor (attached SGLang servers) must leave."""
        name = f"weight-sync-{uuid.uuid4().hex[:12]}"
        counts = get_each([e.num_sync_ranks.remote() for e in self.engines], "weight-sync members", self.timeout_s)
        world = 1 + sum(counts)
        first_ranks = [1 + sum(counts[:i]) for i in range(len(counts))]
        host, port = get(source.open_sync_store.remote(name, world), "weight-sync rendezvous", self.timeout_s)
        refs = [source.join_sync_group.remote(name, world, self.backend)]
        refs += [e.join_sync_group.remote(host, port, rank, world, self.backend, name, replaces=replaces)
                 for e, rank in zip(self.engines, first_ranks)]
        get_each(refs, "weight-sync group", self.timeout_s)
        return name

    def _next_version(self, version: int | None) -> int:
        if version is None:
            return self._version + 1
        if version <= self._version:
            raise ValueError(f"weight version {version} is not newer than the engines' {self._version}")
        return int(version)

    @staticmethod
    def _check_versions(got: list[int], version: int) -> None:
        if any(v != version for v in got):
            raise RuntimeError(f"weight sync: expected every end at version {version}, got {got}")

    def _on_all(self, method: str) -> None:
        get_each([getattr(e, method).remote() for e in self.engines], method, self.timeout_s)
