"""RayLearnerGroup: the Learner protocol over N data-parallel learner ranks, each a Ray actor.

Every rank holds a full replica (an EmbeddedLearner) and joins one torch.distributed group (NCCL on
GPU, gloo on CPU). The driver splits each optimizer step's batch across the ranks, balanced by token
count; each rank runs its shard with the step's *global* normalisers (num_seqs / num_tokens), and the
learner sums the gradients over ranks before clipping and the optimizer step, so the update equals the
single-process update on the whole batch and the replicas stay identical.

Failure policy: a rank that dies ends the run (LearnerFailure). Checkpoints are written atomically by
rank 0, so the last one is intact and rerunning the same command resumes from it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from datetime import timedelta
from typing import Any, Iterator

import ray
import torch
import torch.distributed as dist

from slime_sparse.backends.base import TrainBatch
from slime_sparse.backends.batching import balance_by_tokens

from .placement import RayCluster
from .utils import ActorDied, get_each, with_absolute_paths
from .weight_sync import Bucket, new_group, plan_buckets, send_weights

logger = logging.getLogger(__name__)

# Metrics every rank computes after the gradient all-reduce: identical across ranks, reported once.
REPLICATED_METRICS = ("train/grad_norm", "train/lr")
# Metrics that hold for the step only if they hold on every rank.
MIN_METRICS = ("loss/all_rejected",)


class LearnerFailure(RuntimeError):
    """A learner rank died: the run stops; rerun the same command to resume from the last checkpoint."""


def merge_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from its ranks' metrics.

    The learner normalises every loss term by the step's global counts, so the ranks' values add up to the
    full-batch value (as its micro-batches' do); grad norm and lr are taken after the all-reduce, equal on
    every rank; "all rejected" is true only if it is on every rank. A key missing on a rank (an empty
    shard logs no loss terms) contributes nothing.
    """
    merged: dict[str, float] = {}
    for key in sorted({k for m in per_rank for k in m}):
        values = [m[key] for m in per_rank if key in m]
        if key in REPLICATED_METRICS:
            merged[key] = values[0]
        elif key in MIN_METRICS:
            merged[key] = min(values)
        else:
            merged[key] = sum(values)
    return merged


def with_global_normalisers(batch: TrainBatch) -> TrainBatch:
    """`batch` with num_seqs / num_tokens set from its loss masks when the caller left them out
    (the same counts the single-process learner derives), so that every shard normalises alike."""
    if batch.num_seqs is not None and batch.num_tokens is not None:
        return batch
    kept = [float(m.sum()) for m in batch.loss_masks]
    return dataclasses.replace(batch, num_seqs=float(sum(k > 0 for k in kept)), num_tokens=float(sum(kept)))


class LearnerWorker:
    """One data-parallel rank (a Ray actor): an in-process learner joined to the others by torch.distributed.

    Rank 0 also writes checkpoints and is the source of weight syncs to the rollout engines.
    """

    def __init__(self, cfg, rank: int, world_size: int, timeout_s: float) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.learner = None
        self._dp_store: dist.TCPStore | None = None
        # weight-sync groups this rank is the source of, by name (one per rollout group): store, group, backend
        self._sync: dict[str, tuple[dist.TCPStore, dist.ProcessGroup | None, str]] = {}

    # ---- start-up ------------------------------------------------------------------------------------
    def open_store(self) -> tuple[str, int]:
        """Rank 0: host the rendezvous store of the data-parallel group (port chosen by the OS)."""
        host = ray.util.get_node_ip_address()
        self._dp_store = dist.TCPStore(host, 0, self.world_size, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=self.timeout_s))
        return host, self._dp_store.port

    def setup(self, host: str, port: int) -> str:
        """Join the data-parallel group (blocks until every rank has called) and build the learner."""
        from slime_sparse.backends.embedded.learner import resolve_device
        from slime_sparse.components import build_learner

        device = resolve_device(self.cfg.train.device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = self._dp_store or dist.TCPStore(host, port, self.world_size, is_master=False,
                                                timeout=timedelta(seconds=self.timeout_s))
        if device.type == "cuda":
            torch.cuda.set_device(0)  # Ray shows each actor only the GPU of its bundle
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=self.timeout_s))
        torch.manual_seed(self.cfg.train.seed)  # identical replicas, whatever the model builder draws
        self.learner = build_learner(self.cfg)
        return str(device)

    # ---- Learner protocol (this rank's shard) ---------------------------------------------------------
    def compute_logprobs(self, tokens: list[list[int]], response_lens: list[int], ref: bool) -> list[torch.Tensor]:
        return self.learner.compute_logprobs(tokens, response_lens, ref=ref)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self.learner.train_step(batch)

    def get_step(self) -> int:
        return self.learner.step

    def set_step(self, step: int) -> None:
        self.learner.step = step

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Host copies of the weights under HF names (goes through the object store)."""
        return {name: t.detach().cpu() for name, t in self.learner.named_weights()}

    # ---- checkpoints (rank 0 writes, every rank reads) -------------------------------------------------
    def save_checkpoint(self, path: str, *, step: int, data_state: dict, extra: dict, tokenizer: Any,
                        keep_last: int | None) -> str:
        return self.learner.save_checkpoint(path, step=step, data_state=data_state, extra=extra, tokenizer=tokenizer,
                                            keep_last=keep_last)

    def load_checkpoint(self, path: str) -> dict:
        return self.learner.load_checkpoint(path)

    # ---- weight sync source (rank 0) -----------------------------------------------------------------
    def weight_plan(self, bucket_bytes: int) -> list[Bucket]:
        layout = [(name, tuple(t.shape), t.dtype) for name, t in self.learner.named_weights()]
        return plan_buckets(layout, bucket_bytes)

    def open_sync_store(self, name: str, world_size: int) -> tuple[str, int]:
        """Host the rendezvous store of weight-sync group `name` ((this rank + engines) = `world_size`)."""
        host = ray.util.get_node_ip_address()
        store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=self.timeout_s))
        self._sync[name] = (store, None, "")
        return host, store.port

    def join_sync_group(self, name: str, world_size: int, backend: str) -> None:
        store = self._sync[name][0]
        self._sync[name] = (store, new_group(store, 0, world_size, backend, self.timeout_s, prefix=name), backend)

    def drop_sync_group(self, name: str) -> None:
        """Forget a group whose membership changed (an engine was replaced)."""
        self._sync.pop(name, None)

    def send_weights(self, name: str, plan: list[Bucket], version: int) -> int:
        _, group, backend = self._sync.get(name, (None, None, ""))
        if group is None:
            raise RuntimeError(f"send_weights: no weight-sync group {name!r} (join_sync_group first)")
        with torch.no_grad():
            return send_weights(group, dict(self.learner.named_weights()), plan, version, backend)


class RayLearnerGroup:
    """Learner protocol (compute_logprobs, train_step, named_weights, checkpoints) over Ray learner ranks."""

    def __init__(self, cfg, cluster: RayCluster, *, timeout_s: float | None = None) -> None:
        if cfg.train.train_backend != "embedded":
            raise ValueError(f"--use-ray supports --train-backend embedded only, got {cfg.train.train_backend!r}")
        self.cfg = cfg = with_absolute_paths(cfg)
        self.cluster = cluster
        self.timeout_s = cluster.timeout_s if timeout_s is None else timeout_s
        world = cluster.layout.learner_ranks
        actor_cls = ray.remote(LearnerWorker)
        self.workers = [
            actor_cls.options(**cluster.actor_options(bundle)).remote(cfg, rank, world, self.timeout_s)
            for rank, bundle in enumerate(cluster.layout.learner_bundles())
        ]
        try:
            host, port = self._call([self.workers[0].open_store.remote()], "learner rendezvous")[0]
            devices = self._call([w.setup.remote(host, port) for w in self.workers], "learner start-up")
        except BaseException:
            self.close()
            raise
        logger.info("learner group: %d data-parallel ranks on %s", world, devices)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def source_actor(self):
        """Rank 0's actor: writes checkpoints and sends weights to the engines."""
        return self.workers[0]

    # ---- Learner protocol ------------------------------------------------------------------------------
    def compute_logprobs(self, tokens: list[list[int]], response_lens: list[int], *,
                         ref: bool = False) -> list[torch.Tensor]:
        """Dense log-probs, each rank computing a token-balanced share; results in input order."""
        parts = [p for p in balance_by_tokens([len(t) for t in tokens], self.world_size) if p]
        refs = [w.compute_logprobs.remote([tokens[i] for i in p], [response_lens[i] for i in p], ref)
                for w, p in zip(self.workers, parts)]
        out: list[torch.Tensor] = [torch.empty(0)] * len(tokens)
        for part, logps in zip(parts, self._call(refs, "compute_logprobs")):
            for i, logp in zip(part, logps):
                out[i] = logp
        return out

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step: shards balanced by tokens, every rank called (an empty shard still joins
        the gradient all-reduce)."""
        batch = with_global_normalisers(batch)
        parts = balance_by_tokens([len(t) for t in batch.tokens], self.world_size)
        refs = [w.train_step.remote(batch.select(p)) for w, p in zip(self.workers, parts)]
        return merge_rank_metrics(self._call(refs, "train_step"))

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
        """Rank 0 writes the checkpoint (utils.checkpoint layout, atomic); replicas are identical."""
        ref = self.workers[0].save_checkpoint.remote(os.path.abspath(path), step=step, data_state=data_state,
                                                     extra=extra or {}, tokenizer=tokenizer, keep_last=keep_last)
        return self._call([ref], "save_checkpoint")[0]

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

