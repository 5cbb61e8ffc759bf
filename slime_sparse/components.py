"""Build the pieces of a run from its config: tokenizer, data stream, reward, learner, rollout engine.

The one place that knows which backend classes exist; the loop in `train.py` only calls the
`Components` methods. Heavy backends (Ray, Megatron, SGLang) are imported only when selected.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from slime_sparse.config import RunConfig
from slime_sparse.data.prompt_dataset import PromptDataset, PromptStream
from slime_sparse.reward import get_reward_fn
from slime_sparse.utils.logging import progress_bar


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_model(path: str, *, device: torch.device, bf16: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if bf16 else torch.float32
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)


def build_learner(cfg: RunConfig):
    t = cfg.train
    if t.train_backend == "megatron":
        from slime_sparse.backends.megatron import build_megatron_learner

        return build_megatron_learner(cfg)
    from slime_sparse.backends.embedded.learner import EmbeddedLearner, resolve_device

    model = load_model(t.hf_checkpoint, device=resolve_device(t.device), bf16=t.bf16)
    return EmbeddedLearner(
        model, cfg.loss, lr=t.lr, weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2),
        warmup_iters=t.lr_warmup_iters, clip_grad=t.clip_grad, max_tokens=t.max_tokens_per_gpu,
        temperature=cfg.sampling.temperature if cfg.sampling.temperature > 0 else 1.0,
        need_ref=cfg.loss.use_kl_loss,
    )


def build_engine(cfg: RunConfig, kv=None, model: torch.nn.Module | None = None):
    """The rollout engine for `cfg` (optionally with another KV config, sharing `model`'s weights)."""
    kv = cfg.kv if kv is None else kv
    if cfg.rollout.engine == "sglang":
        return build_sglang_engine(cfg, kv)
    from slime_sparse.backends.embedded.learner import resolve_device
    from slime_sparse.rollout.embedded import EmbeddedEngine

    device = resolve_device(cfg.train.device)
    if model is None:
        model = load_model(cfg.train.hf_checkpoint, device=device, bf16=cfg.train.bf16)
    return EmbeddedEngine(model, kv, max_batch_size=cfg.rollout.max_batch_size, device=device,
                          max_prompt_len=cfg.data.max_prompt_len)


def build_sglang_engine(cfg: RunConfig, kv):
    """Patched SGLang servers (see sglang_patches/README.md), launched on this machine's GPUs or attached with
    --sglang-server-urls, fed by broadcast from this process: they join one process group with it."""
    import dataclasses
    import os
    import socket
    from pathlib import Path

    from slime_sparse.backends.embedded.learner import resolve_device
    from slime_sparse.rollout.sglang import DistributedWeightSync, SGLangRolloutEngine

    sg = dataclasses.replace(cfg.sglang, model_path=cfg.train.hf_checkpoint)
    sync = DistributedWeightSync(bucket_bytes=cfg.cluster.update_weight_buffer_size, timeout_s=sg.request_timeout_s)
    engine = SGLangRolloutEngine.from_config(sg, kv, Path(cfg.log.run_dir) / "sglang_logs", weight_sync=sync)
    try:
        # the servers connect back to this address; NCCL when the learner's weights are on a GPU
        address = os.environ.get("MASTER_ADDR", socket.gethostbyname(socket.gethostname()))
        sync.init(engine.clients, address, "nccl" if resolve_device(cfg.train.device).type == "cuda" else "gloo")
    except BaseException:
        engine.close()
        raise
    return engine


@dataclass
class Components:
    cfg: RunConfig
    tokenizer: Any
    stream: PromptStream
    reward_fn: Callable
    learner: Any
    engine: Any
    eval_records: list = field(default_factory=list)
    ray: Any = None  # slime_sparse.ray.build.RayBackends when --use-ray (learner and engine are its groups)
    _eval_engines: dict = field(default_factory=dict)

    def progress(self, iterable, **kw):
        return progress_bar(iterable, enabled=self.cfg.log.progress, **kw)

    def eval_engine(self, mode: str):
        """Engine for evaluation under `mode` ("dense" or "sparse"), sharing the rollout engine's weights."""
        if mode == "sparse":
            return self.engine
        if mode not in self._eval_engines:
            from slime_sparse.kv.config import KVCompressConfig

            kv = KVCompressConfig(method="none")
            if self.ray is not None or self.cfg.rollout.engine == "sglang":
                # the same engine actors / servers, generating under another KV config (SGLang: per request)
                self._eval_engines[mode] = self.engine.with_kv(kv)
            else:
                self._eval_engines[mode] = build_engine(self.cfg, kv=kv, model=getattr(self.engine, "model", None))
        return self._eval_engines[mode]

    def save_checkpoint(self, save_dir: str, step: int) -> str:
        import os

        path = os.path.join(save_dir, f"rollout_{step:06d}")
        # the learner owns its state (Ray: rank 0 writes it); the loop adds the data position
        self.learner.save_checkpoint(path, step=step, data_state=self.stream.state_dict(), extra={},
                                     tokenizer=self.tokenizer, keep_last=self.cfg.train.keep_last)
        return path

    def load_checkpoint(self, path: str) -> int:
        state = self.learner.load_checkpoint(path)  # Ray: every rank restores itself
        self.stream.load_state_dict(state["data_state"])
        self.sync_weights()
        return int(state["step"])

    def sync_weights(self) -> None:
        """Give the rollout engine the learner's current weights (Ray: learner rank 0 -> engine actors directly)."""
        if self.ray is not None:
            self.engine.sync_from(self.learner)
        else:
            self.engine.update_weights(dict(self.learner.named_weights()))

    def close(self) -> None:
        # engines before the learner: under Ray they drop their weight-sync group with learner rank 0
        for obj in (self.reward_fn, self.engine, *self._eval_engines.values(), self.learner, self.ray):
            close = getattr(obj, "close", None)
            if callable(close):
                close()


def build_components(cfg: RunConfig) -> Components:
    tokenizer = load_tokenizer(cfg.train.hf_checkpoint)
    dataset = PromptDataset(cfg.data, tokenizer)
    stream = PromptStream(dataset, cfg.rollout.rollout_batch_size)
    if stream.num_batches < cfg.train.num_rollout:
        raise ValueError(
            f"--num-rollout={cfg.train.num_rollout} needs {cfg.train.num_rollout} batches of --rollout-batch-size="
            f"{cfg.rollout.rollout_batch_size} prompts, but {len(dataset)} prompts x --num-epoch={cfg.data.num_epochs} "
            f"give only {stream.num_batches}"
        )
    eval_records = []
    if cfg.eval.eval_prompt_data:
        import dataclasses

        eval_data = PromptDataset(dataclasses.replace(cfg.data, prompt_data=cfg.eval.eval_prompt_data, shuffle=False), tokenizer)
        eval_records = [eval_data[i] for i in range(len(eval_data))]
        if cfg.eval.eval_max_prompts:
            eval_records = eval_records[: cfg.eval.eval_max_prompts]
    reward_fn = get_reward_fn(cfg.reward)
    ray_backends = None
    if cfg.cluster.use_ray:  # learner ranks and engines as Ray actors (slime_sparse/ray)
        from slime_sparse.ray.build import build_ray_backends

        try:
            ray_backends = build_ray_backends(cfg)
        except BaseException:
            getattr(reward_fn, "close", lambda: None)()
            raise
        learner, engine = ray_backends.learner, ray_backends.engine
    else:
        learner = build_learner(cfg)
        engine = build_engine(cfg)
    comp = Components(cfg=cfg, tokenizer=tokenizer, stream=stream, reward_fn=reward_fn,
                      learner=learner, engine=engine, eval_records=eval_records, ray=ray_backends)
    try:
        comp.sync_weights()
    except BaseException:
        comp.close()  # actors and reward workers must not outlive a failed start
        raise
    return comp
