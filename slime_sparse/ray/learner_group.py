"""RayLearnerGroup: the Learner protocol over N learner ranks, each a Ray actor.

The ranks join one torch.distributed group (NCCL on GPU, gloo on CPU) and hold either
- a full replica each (`--train-backend embedded`): N data-parallel ranks; or
- a Megatron rank (`--train-backend megatron`): TP x PP (--tensor-model-parallel-size x
  --pipeline-model-parallel-size) ranks share one replica, DP = N / (TP x PP) replicas. The ranks of one
  replica get the same data shard and return the same results, and the weight export and checkpoints
  are collectives every rank of a replica takes part in.
The driver splits each optimizer step's batch into DP shards, balanced by token count; each rank runs
its shard with the step's *global* normalisers (num_seqs / num_tokens), and the learner sums the
gradients over the data-parallel ranks before clipping and the optimizer step, so the update equals the
single-process update on the whole batch and the replicas stay identical. The ranks' metrics combine by
the rules of `backends.metrics` (one replica's ranks speak once).

Failure policy: a rank that dies ends the run (LearnerFailure). Checkpoints are committed atomically by
rank 0, so the last one is intact and rerunning the same command resumes from it.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import ray
import torch
import torch.distributed as dist

from slime_sparse.backends.base import TrainBatch
from slime_sparse.backends.batching import balance_by_tokens
from slime_sparse.backends.metrics import merge_parts
from slime_sparse.factory import LearnerSpec, build_learner
from slime_sparse.utils.device import dist_backend, resolve_device
from slime_sparse.utils.seed import set_seed

from .placement import RayCluster
from .utils import ActorDied, get_each
from slime_sparse.utils.weight_sync import Bucket, FlatPlan, new_group, open_store, plan_buckets, send_weights

logger = logging.getLogger(__name__)

class LearnerFailure(RuntimeError):
    """A learner rank died: the run stops; rerun the same command to resume from the last checkpoint."""


@dataclass(frozen=True)
class RankInfo:
    """What the driver needs to know about a learner rank once it has started."""

    device: str
    dp_rank: int  # the data shard it trains on (shared by the tensor-parallel ranks of one replica)
    dp_size: int
    collective: bool  # weight export and checkpoints need every rank of the replica (Megatron)


class LearnerWorker:
    """One learner rank (a Ray actor): an in-process learner joined to the others by torch.distributed.

    Rank 0 also commits checkpoints and is the source of weight syncs to the rollout engines.
    """

    def __init__(self, spec: LearnerSpec, rank: int, world_size: int, timeout_s: float) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.learner = None
        self._dp_store: dist.TCPStore | None = None
        # rank 0 with a collective weight export: the other ranks of its replica, asked to join every export
        self._export_peers: list = []
        # weight-sync groups this rank is the source of, by name (one per rollout group): store, group, backend
        self._sync: dict[str, tuple[dist.TCPStore, dist.ProcessGroup | None, str]] = {}

    # ---- start-up ------------------------------------------------------------------------------------
    def open_store(self) -> tuple[str, int]:
        """Rank 0: host the rendezvous store of the data-parallel group (port chosen by the OS)."""
        host = ray.util.get_node_ip_address()
        self._dp_store = open_store(host, self.world_size, self.timeout_s)
        return host, self._dp_store.port

    def setup(self, host: str, port: int) -> RankInfo:
        """Join the learners' process group (blocks until every rank has called) and build the learner."""
        from slime_sparse.backends.megatron.learner import MegatronLearner  # megatron-core is imported only if built

        device = resolve_device(self.spec.train.device)
        store = self._dp_store or dist.TCPStore(host, port, self.world_size, is_master=False,
                                                timeout=timedelta(seconds=self.timeout_s))
        if device.type == "cuda":
            torch.cuda.set_device(0)  # Ray shows each actor only the GPU of its bundle
        dist.init_process_group(dist_backend(device), store=store, rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=self.timeout_s))
        # identical replicas, whatever the model builder draws; python and numpy too, so that the RNG state a
        # checkpoint stores is the run's, not the actor process's (the chaos test compares it bit for bit)
        set_seed(self.spec.train.seed)
        self.learner = build_learner(self.spec)  # Megatron: its groups (TP x DP) over this process group
        if isinstance(self.learner, MegatronLearner):
            return RankInfo(str(device), self.learner.data_parallel_rank, self.learner.data_parallel_size, True)
        return RankInfo(str(device), self.rank, self.world_size, False)

    def set_export_peers(self, peers: list) -> None:
        """Rank 0: the actors that must run each weight export with it (the rest of its replica)."""
        self._export_peers = list(peers)

    def join_weight_export(self) -> None:
        """A peer's side of rank 0's collective weight export: iterate it, keep nothing."""
        for _ in self.learner.named_weights():
            pass

    # ---- Learner protocol (this rank's shard) ---------------------------------------------------------
    def compute_logprobs(self, tokens: list[list[int]], response_lens: list[int], ref: bool,
                         shadow: list | None = None) -> list[torch.Tensor]:
        return self.learner.compute_logprobs(tokens, response_lens, ref=ref, shadow=shadow)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self.learner.train_step(batch)

    def get_step(self) -> int:
        return self.learner.step

    def set_step(self, step: int) -> None:
        self.learner.step = step

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Host copies of the weights under HF names (goes through the object store)."""
        return {name: t.detach().cpu() for name, t in self._exported_weights().items()}

    def _exported_weights(self) -> dict[str, torch.Tensor]:
        """The full weights under HF names, on the source rank. A collective export (Megatron: TP shards
        all-gathered) needs the other ranks of the replica too: they are asked to join it first, and this
        rank waits for them (bounded) once the export is done."""
        joined = [peer.join_weight_export.remote() for peer in self._export_peers]
        weights = dict(self.learner.named_weights())
        get_each(joined, "weight export on the other ranks of the replica", self.timeout_s)
        return weights

    # ---- checkpoints (rank 0 commits; every rank writes its part if the learner's save is collective) -----
    def save_checkpoint(self, path: str, *, step: int, data_state: dict, extra: dict, tokenizer: Any,
                        keep_last: int | None) -> str:
        return self.learner.save_checkpoint(path, step=step, data_state=data_state, extra=extra, tokenizer=tokenizer,
                                            keep_last=keep_last)

    def load_checkpoint(self, path: str) -> dict:
        return self.learner.load_checkpoint(path)

    # ---- weight sync source (rank 0) -----------------------------------------------------------------
    def weight_plan(self, bucket_bytes: int) -> list[Bucket]:
        layout = [(name, tuple(t.shape), t.dtype) for name, t in self._exported_weights().items()]
        return plan_buckets(layout, bucket_bytes)

    def open_sync_store(self, name: str, world_size: int) -> tuple[str, int]:
        """Host the rendezvous store of weight-sync group `name` ((this rank + engines) = `world_size`)."""
        host = ray.util.get_node_ip_address()
        store = open_store(host, world_size, self.timeout_s)
        self._sync[name] = (store, None, "")
        return host, store.port

    def join_sync_group(self, name: str, world_size: int, backend: str) -> None:
        store = self._sync[name][0]
        self._sync[name] = (store, new_group(store, 0, world_size, backend, self.timeout_s, prefix=name), backend)

    def drop_sync_group(self, name: str) -> None:
        """Forget a group whose membership changed (an engine was replaced)."""
        self._sync.pop(name, None)

    def send_weights(self, name: str, plan: list[Bucket] | FlatPlan, version: int) -> int:
        _, group, backend = self._sync.get(name, (None, None, ""))
        if group is None:
            raise RuntimeError(f"send_weights: no weight-sync group {name!r} (join_sync_group first)")
        with torch.no_grad():
            return send_weights(group, self._exported_weights(), plan, version, backend)


def check_megatron_layout(megatron, world: int) -> None:
    """The learner ranks must split into whole tensor x pipeline parallel replicas."""
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(f"--actor-num-nodes x --actor-num-gpus-per-node = {world} learner ranks must be a multiple of "
                         f"--tensor-model-parallel-size x --pipeline-model-parallel-size = {tp} x {pp}")


class RayLearnerGroup:
    """Learner protocol (compute_logprobs, train_step, named_weights, checkpoints) over Ray learner ranks."""

    def __init__(self, spec: LearnerSpec, cluster: RayCluster, *, timeout_s: float | None = None) -> None:
        world = cluster.layout.learner_ranks
        if spec.train.train_backend == "megatron":
            check_megatron_layout(spec.megatron, world)
        self.cluster = cluster
        self.timeout_s = cluster.timeout_s if timeout_s is None else timeout_s
        actor_cls = ray.remote(LearnerWorker)
        self.workers = [
            actor_cls.options(**cluster.actor_options(bundle)).remote(spec, rank, world, self.timeout_s)
            for rank, bundle in enumerate(cluster.layout.learner_bundles())
        ]
        try:
            host, port = self._call([self.workers[0].open_store.remote()], "learner rendezvous")[0]
            self.ranks: list[RankInfo] = self._call([w.setup.remote(host, port) for w in self.workers],
                                                    "learner start-up")
            self.dp_size = self.ranks[0].dp_size
            self.collective = self.ranks[0].collective
            # one rank per data shard speaks for its replica (its TP peers compute the same values)
            self._leaders = [next(i for i, r in enumerate(self.ranks) if r.dp_rank == d) for d in range(self.dp_size)]
            if self.collective:
                peers = [w for w, r in zip(self.workers[1:], self.ranks[1:]) if r.dp_rank == self.ranks[0].dp_rank]
                self._call([self.workers[0].set_export_peers.remote(peers)], "weight export peers")
        except BaseException:
            self.close()
            raise
        logger.info("learner group: %d ranks (%d data-parallel) on %s", world, self.dp_size,
                    sorted({r.device for r in self.ranks}))

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def source_actor(self):
        """Rank 0's actor: commits checkpoints and sends weights to the engines."""
        return self.workers[0]

    # ---- Learner protocol ------------------------------------------------------------------------------
    def compute_logprobs(self, tokens: list[list[int]], response_lens: list[int], *,
                         ref: bool = False, shadow: list | None = None) -> list[torch.Tensor]:
        """Dense (or, with `shadow` records, shadow) log-probs, each replica computing a token-balanced share;
        results in input order."""
        parts = balance_by_tokens([len(t) for t in tokens], self.dp_size)
        # every rank of a replica runs its share (TP collectives inside); an empty share has nothing to do
        calls = [(i, parts[r.dp_rank]) for i, r in enumerate(self.ranks) if parts[r.dp_rank]]
        refs = [self.workers[i].compute_logprobs.remote(
                    [tokens[j] for j in part], [response_lens[j] for j in part], ref,
                    None if shadow is None else [shadow[j] for j in part]) for i, part in calls]
        out: list[torch.Tensor] = [torch.empty(0)] * len(tokens)
        for (i, part), logps in zip(calls, self._call(refs, "compute_logprobs")):
            if i in self._leaders:
                for j, logp in zip(part, logps):
                    out[j] = logp
        return out

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step: data shards balanced by tokens, every rank called (an empty shard still joins
        the gradient all-reduce); the ranks of one replica get the same shard."""
        batch = batch.as_step()  # every shard normalises by the whole step
        parts = balance_by_tokens([len(t) for t in batch.tokens], self.dp_size)
        shards = [ray.put(batch.select(p)) for p in parts]  # stored once, fetched by each rank of the replica
        refs = [w.train_step.remote(shards[r.dp_rank]) for w, r in zip(self.workers, self.ranks)]
        per_rank = self._call(refs, "train_step")
        return merge_parts([per_rank[i] for i in self._leaders])

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0's weights, copied to this process (use weights_ref() to pass them on without that copy)."""
        yield from self._call([self.weights_ref()], "named_weights")[0].items()

    def weights_ref(self) -> ray.ObjectRef:
        """Object-store reference to rank 0's weights (host copies), for actors to fetch directly."""
        return self.source_actor.state_dict.remote()

    @property
    def step(self) -> int:
        return self._call([self.workers[0].get_step.remote()], "learner step")[0]

    @step.setter
    def step(self, value: int) -> None:
        self._call([w.set_step.remote(int(value)) for w in self.workers], "set learner step")

    # ---- checkpoints -------------------------------------------------------------------------------
    def save_checkpoint(self, path: str, *, step: int, data_state: dict, extra: dict | None = None,
                        tokenizer: Any = None, keep_last: int | None = None) -> str:
        """Atomic checkpoint in the utils.checkpoint layout: rank 0 writes it (replicas are identical), or,
        for a collective learner (Megatron), every rank writes its part and rank 0 commits."""
        workers = self.workers if self.collective else self.workers[:1]
        refs = [w.save_checkpoint.remote(os.path.abspath(path), step=step, data_state=data_state, extra=extra or {},
                                         tokenizer=tokenizer if rank == 0 else None, keep_last=keep_last)
                for rank, w in enumerate(workers)]
        return self._call(refs, "save_checkpoint")[0]

    def load_checkpoint(self, path: str) -> dict:
        """Every rank restores weights, optimizer and scheduler from `path` (a file system all nodes see)."""
        path = os.path.abspath(path)
        return self._call([w.load_checkpoint.remote(path) for w in self.workers], "load_checkpoint")[0]

    # ---- plumbing ------------------------------------------------------------------------------------
    def _call(self, refs: list, what: str) -> list:
        try:
            return get_each(refs, f"learner {what}", self.timeout_s)
        except ActorDied as exc:
            raise LearnerFailure(
                f"learner rank {exc.index} died during {what}; the run stops here. The last checkpoint is "
                f"intact: rerun the same command to resume from it"
            ) from exc

    def close(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []

