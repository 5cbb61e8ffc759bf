"""Build a learner and a rollout engine: the one place that knows which backend classes exist.

Each role is built from a spec holding only what it reads (`LearnerSpec`, `EngineSpec`, taken from a RunConfig
once). `components.build_components` builds both in this process; with --use-ray the actors of
`ray/learner_group.py` and `ray/rollout_group.py` receive their spec and build the same objects inside the actor.
Heavy backends (megatron-core, SGLang) are imported only when a spec selects them.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from slime_sparse.algo import LossConfig
from slime_sparse.backends.megatron.config import MegatronConfig
from slime_sparse.backends.batching import MicroBatching
from slime_sparse.backends.optimizer import OptimConfig
from slime_sparse.backends.recompute import Recompute
from slime_sparse.config import RunConfig, TrainConfig
from slime_sparse.kv import KVCompressConfig
from slime_sparse.rollout.sglang.config import SGLangEngineConfig, sglang_lm_head_args
from slime_sparse.utils.device import dist_backend, resolve_device
from slime_sparse.utils.hf import load_model


def _dtype(bf16: bool) -> torch.dtype:
    return torch.bfloat16 if bf16 else torch.float32


def _absolute(path: str) -> str:
    """Actors may run in another working directory: every path a spec carries is absolute ("" stays unset)."""
    return os.path.abspath(path) if path else path


@dataclass(frozen=True)
class LearnerSpec:
    """What a learner is built from, and all that a Ray learner rank receives."""

    train: TrainConfig
    loss: LossConfig
    megatron: MegatronConfig
    temperature: float  # of the sampler's log-probs, at which pi_old is recomputed (1 for greedy rollouts)

    @classmethod
    def from_run(cls, cfg: RunConfig) -> "LearnerSpec":
        return cls(
            train=dataclasses.replace(cfg.train, hf_checkpoint=_absolute(cfg.train.hf_checkpoint)),
            loss=cfg.loss,
            megatron=dataclasses.replace(cfg.megatron, load=_absolute(cfg.megatron.load)),
            temperature=cfg.sampling.temperature if cfg.sampling.temperature > 0 else 1.0,
        )

    @property
    def optim(self) -> OptimConfig:
        train = self.train
        return OptimConfig(lr=train.lr, weight_decay=train.weight_decay, betas=(train.adam_beta1, train.adam_beta2),
                           warmup_iters=train.lr_warmup_iters, clip_grad=train.clip_grad,
                           decay_style=train.lr_decay_style, min_lr=train.min_lr, decay_iters=train.lr_decay_iters)

    @property
    def recompute(self) -> Recompute | None:
        train = self.train
        return Recompute.from_flags(train.recompute_granularity, train.recompute_method, train.recompute_num_layers)

    @property
    def batching(self) -> MicroBatching:
        train = self.train
        return MicroBatching(max_tokens=train.max_tokens_per_gpu if train.dynamic_batching else None,
                             micro_batch_size=train.micro_batch_size or 1)


def build_learner(spec: LearnerSpec):
    """The learner of `spec.train.train_backend` (Megatron: its process groups too, unless a launcher made them)."""
    train = spec.train
    if train.train_backend == "megatron":
        from slime_sparse.backends.megatron.learner import build_megatron_learner

        return build_megatron_learner(
            train.hf_checkpoint or None, spec.loss, spec.megatron, spec.optim, seed=train.seed,
            batching=spec.batching, temperature=spec.temperature,
            params_dtype=_dtype(train.bf16), fp32_lm_head=train.enable_fp32_lm_head, recompute=spec.recompute,
        )
    from slime_sparse.backends.embedded.learner import EmbeddedLearner

    model = load_model(train.hf_checkpoint, resolve_device(train.device), _dtype(train.bf16))
    return EmbeddedLearner(model, spec.loss, optim=spec.optim, batching=spec.batching, temperature=spec.temperature,
                           need_ref=spec.loss.needs_ref, fp32_lm_head=train.enable_fp32_lm_head,
                           recompute=spec.recompute)


@dataclass(frozen=True)
class EngineSpec:
    """What a rollout engine is built from, and all that a Ray engine actor receives."""

    kind: str  # --rollout-engine: embedded | sglang
    kv: KVCompressConfig
    model_dir: str  # --hf-checkpoint
    device: str  # --device
    bf16: bool
    fp32_lm_head: bool  # --enable-fp32-lm-head: the learner's head arithmetic (SGLang servers get the flag)
    max_batch_size: int | None  # sequences decoded at once at most (embedded; None: 64, or what fits in the memory)
    kv_cache_gib: float | None  # KV memory the embedded engine fills with as many rows as fit (at most max_batch_size)
    mem_fraction: float | None  # ... or that memory as a fraction of the device's free memory
    memory_saver: bool  # --offload-rollout: the embedded engine gives its cache back between rollouts, graphs kept
    cuda_graph: bool  # decode steps in CUDA graphs on a CUDA device (embedded)
    max_prompt_len: int | None  # longer prompts are an error (embedded)
    sglang: SGLangEngineConfig  # the servers (sglang), model_path set to model_dir
    weight_bucket_bytes: int  # --update-weight-buffer-size: bytes per weight-sync bucket
    log_dir: str  # where SGLang servers write their logs

    @classmethod
    def from_run(cls, cfg: RunConfig) -> "EngineSpec":
        model_dir = _absolute(cfg.train.hf_checkpoint)
        return cls(
            kind=cfg.rollout.engine, kv=cfg.kv, model_dir=model_dir, device=cfg.train.device, bf16=cfg.train.bf16,
            fp32_lm_head=cfg.train.enable_fp32_lm_head,
            max_batch_size=cfg.rollout.max_batch_size, kv_cache_gib=cfg.rollout.kv_cache_gib,
            mem_fraction=cfg.rollout.mem_fraction, memory_saver=cfg.offloads_rollout,
            cuda_graph=cfg.rollout.cuda_graph,
            max_prompt_len=cfg.data.max_prompt_len,
            sglang=dataclasses.replace(
                cfg.sglang, model_path=model_dir,
                extra_args=cfg.sglang.extra_args + sglang_lm_head_args(cfg.train.enable_fp32_lm_head)),
            weight_bucket_bytes=cfg.cluster.update_weight_buffer_size,
            log_dir=os.path.join(_absolute(cfg.log.run_dir), "sglang_logs"),
        )


def build_engine(spec: EngineSpec):
    """The rollout engine of `spec.kind`, holding the weights of `spec.model_dir`."""
    if spec.kind == "sglang":
        return _sglang_engine(spec)
    from slime_sparse.rollout.embedded import EmbeddedEngine

    device = resolve_device(spec.device)
    model = load_model(spec.model_dir, device, _dtype(spec.bf16))
    return EmbeddedEngine(model, spec.kv, max_batch_size=spec.max_batch_size, device=device,
                          max_prompt_len=spec.max_prompt_len, step_mode=None if spec.cuda_graph else "eager",
                          fp32_lm_head=spec.fp32_lm_head, kv_cache_gib=spec.kv_cache_gib,
                          mem_fraction=spec.mem_fraction, memory_saver=spec.memory_saver)


def _sglang_engine(spec: EngineSpec):
    """Patched SGLang servers (see sglang_patches/README.md), launched on this machine's GPUs or attached with
    --sglang-server-urls, fed by broadcast from this process: they join one process group with it."""
    import socket
    from pathlib import Path

    from slime_sparse.rollout.sglang import DistributedWeightSync, SGLangRolloutEngine

    sync = DistributedWeightSync(bucket_bytes=spec.weight_bucket_bytes, timeout_s=spec.sglang.request_timeout_s)
    engine = SGLangRolloutEngine.from_config(spec.sglang, spec.kv, Path(spec.log_dir), weight_sync=sync)
    try:
        # the servers connect back to this address, over NCCL when the learner's weights are on a GPU
        address = os.environ.get("MASTER_ADDR", socket.gethostbyname(socket.gethostname()))
        sync.init(engine.clients, address, dist_backend(resolve_device(spec.device)))
    except BaseException:
        engine.close()
        raise
    return engine
