"""The Megatron learner: megatron-core GPTModel (TP x DP), dense recompute of pi_old / pi_ref, Sparse-RL loss.

Every rank of the learner group builds one `MegatronLearner` after `init_parallel` and calls the same
methods in the same order (they contain collectives). The batch a rank receives is its data-parallel
shard, identical on all TP ranks of one DP group, with the step's *global* normalisers
(`num_seqs` / `num_tokens`), exactly as for the embedded learner; the loss is
`slime_sparse.algo.policy_loss`, the one implementation every backend shares.

Two execution paths, same math:
- GPU: Megatron's DistributedDataParallel, distributed optimizer (Adam) and forward/backward schedule;
  `calculate_per_token_loss` keeps the schedule from rescaling our globally-normalised loss, and DP
  gradients are summed (not averaged) for the same reason.
- CPU (gloo, tests): the model runs under the CPU shim; a torch AdamW steps it, gradients are summed over
  the DP group by hand and clipped with a TP-aware global norm.
Pipeline parallelism is supported by the model build, checkpoints and weight export, but not yet by the
learner (ValueError): its log-prob recompute would need the last stage's results broadcast.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from slime_sparse.algo import LossConfig, policy_loss
from slime_sparse.backends.base import TrainBatch
from slime_sparse.backends.batching import pack_by_tokens
from slime_sparse.backends.logprobs import pad_right

from . import checkpoint as ckpt
from .hf_io import HFWeights, bucketed, export_hf_weights, load_hf_weights
from .logprobs import response_logprobs
from .model_config import ModelSpec, build_gpt_model, read_hf_config


@dataclass(frozen=True)
class MegatronConfig:
    """Megatron-specific knobs (flags `--tensor-model-parallel-size`, ... as in Megatron-LM / slime)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    use_te: bool | None = None  # None: Transformer Engine spec iff TE imports on a GPU
    load: str = ""  # Megatron checkpoint to start from (else the HF checkpoint)
    vocab_divisible_by: int = 128
    recompute_activations: bool = False
    use_distributed_optimizer: bool = True  # GPU only

    def validate(self) -> None:
        if self.tensor_model_parallel_size < 1:
            raise ValueError(f"--tensor-model-parallel-size must be >= 1, got {self.tensor_model_parallel_size}")
        if self.pipeline_model_parallel_size != 1:
            raise ValueError(
                f"--pipeline-model-parallel-size={self.pipeline_model_parallel_size}: the Megatron learner runs PP=1 "
                "for now (checkpoints and converters support PP; use TP x DP for training)"
            )
        if self.vocab_divisible_by < 1:
            raise ValueError(f"--make-vocab-size-divisible-by must be >= 1, got {self.vocab_divisible_by}")
        if self.load and not os.path.isdir(self.load):
            raise ValueError(f"--load={self.load!r} is not a directory")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_iters: int = 0
    clip_grad: float = 1.0  # 0 disables clipping (the norm is still reported)


def lr_at(step: int, optim: OptimConfig) -> float:
    """Constant learning rate after a linear warmup (the embedded learner's schedule)."""
    scale = min(1.0, (step + 1) / optim.warmup_iters) if optim.warmup_iters > 0 else 1.0
    return optim.lr * scale


def _groups():
    from megatron.core import parallel_state as ps

    return ps


class MegatronLearner:
    def __init__(
        self,
        hf_config: dict,
        loss_cfg: LossConfig,
        *,
        hf_dir: str | None = None,
        megatron: MegatronConfig = MegatronConfig(),
        optim: OptimConfig = OptimConfig(),
        max_tokens: int = 16384,
        temperature: float = 1.0,
        need_ref: bool = False,
        params_dtype: torch.dtype = torch.float32,
    ):
        megatron.validate()
        if hf_dir is None and not megatron.load:
            raise ValueError("the Megatron learner needs --hf-checkpoint or --load to get its initial weights")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.hf_config = hf_config
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.loss_cfg = loss_cfg
        self.megatron = megatron
        self.optim = optim
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.hf_dir = hf_dir
        self.params_dtype = params_dtype
        self.on_gpu = torch.cuda.is_available()
        self.step = 0

        self.model = self._build_and_load(hf_dir)
        self.ref_model = None
        if need_ref:  # frozen copy of the starting policy for the KL term
            self.ref_model = self._build_and_load(hf_dir).eval().requires_grad_(False)
        if self.on_gpu:
            self._setup_gpu_training()
        else:
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(params, lr=lr_at(0, optim), betas=optim.betas, weight_decay=optim.weight_decay)

    # ---- model -------------------------------------------------------------------------------
    def _build_and_load(self, hf_dir: str | None) -> torch.nn.Module:
        model = build_gpt_model(
            self.spec,
            params_dtype=self.params_dtype,
            use_te=self.megatron.use_te,
            sequence_parallel=self.megatron.sequence_parallel,
            vocab_divisible_by=self.megatron.vocab_divisible_by,
            recompute_activations=self.megatron.recompute_activations,
        )
        if self.megatron.load:
            ckpt.load_model(model, model_dir(self.megatron.load))
        else:
            load_hf_weights(model, self.spec, HFWeights(hf_dir))
        return model

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel (unwrapped from Megatron's DDP on GPU)."""
        return getattr(self.model, "module", self.model)

    def _setup_gpu_training(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = self.model.config
        config.calculate_per_token_loss = True  # our loss is already normalised by the step's global counts
        # Megatron's finalize would divide by the schedule's token count: keep its grad sync, drop the scaling.
        config.finalize_model_grads_func = lambda models, num_tokens=None, **kw: finalize_model_grads(models, num_tokens=None, **kw)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.megatron.use_distributed_optimizer,
            average_in_collective=False,
        )
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=self.model)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=self.optim.lr,
            weight_decay=self.optim.weight_decay,
            adam_beta1=self.optim.betas[0],
            adam_beta2=self.optim.betas[1],
            clip_grad=self.optim.clip_grad if self.optim.clip_grad > 0 else 0.0,
            bf16=config.bf16,
            fp16=config.fp16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=self.megatron.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])

    # ---- dense recompute -------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, tokens: list[list[int]], response_lens: list[int], *, ref: bool = False) -> list[torch.Tensor]:
        model = self.ref_model if ref else self.model
        if model is None:
            raise ValueError("reference log-probs requested but the learner was built without a reference model")
        was_training = model.training
        model.eval()
        out: list[torch.Tensor] = [torch.empty(0)] * len(tokens)
        for idx in pack_by_tokens([len(t) for t in tokens], self.max_tokens):
            logp, _ = response_logprobs(
                model, [tokens[i] for i in idx], [response_lens[i] for i in idx],
                vocab_size=self.spec.vocab_size, temperature=self.temperature,
            )
            for row, i in enumerate(idx):
                out[i] = logp[row, : response_lens[i]].float().cpu()
        model.train(was_training)
        return out

    # ---- update ----------------------------------------------------------------------------
    def _microbatch_loss(self, model: torch.nn.Module, mb: TrainBatch, num_seqs: float, num_tokens: float):
        logp, entropy = response_logprobs(
            model, mb.tokens, mb.response_lens, vocab_size=self.spec.vocab_size, temperature=self.temperature,
            with_entropy=self.loss_cfg.entropy_coef != 0,
        )
        dev = logp.device
        pad = lambda xs: pad_right(xs, 0.0, dtype=torch.float32, device=dev)  # noqa: E731
        return policy_loss(
            logp, pad(mb.old_logprobs), mb.advantages.to(dev), pad(mb.loss_masks), self.loss_cfg,
            weights=None if mb.weights is None else pad(mb.weights),
            logp_ref=None if mb.ref_logprobs is None else pad(mb.ref_logprobs),
            entropy=entropy, num_seqs=num_seqs, num_tokens=num_tokens,
        )

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step over `batch` (this rank's DP shard; the same on every TP rank)."""
        if batch.old_logprobs is None:
            raise ValueError("train_step needs old_logprobs (dense recompute) in the batch")
        if self.loss_cfg.use_kl_loss and batch.ref_logprobs is None:
            raise ValueError("--use-kl-loss needs ref_logprobs in the batch")
        num_seqs, num_tokens = batch.num_seqs, batch.num_tokens
        if num_seqs is None or num_tokens is None:  # single data-parallel rank, whole batch
            kept = [m.sum().item() for m in batch.loss_masks]
            num_seqs, num_tokens = float(sum(k > 0 for k in kept)), float(sum(kept))
        micro = [batch.select(idx) for idx in pack_by_tokens([len(t) for t in batch.tokens], self.max_tokens)]
        lr = lr_at(self.step, self.optim)
        self.model.train()
        if self.on_gpu:
            loss_total, per_mb, grad_norm = self._gpu_step(micro, num_seqs, num_tokens, lr)
        else:
            loss_total, per_mb, grad_norm = self._cpu_step(micro, num_seqs, num_tokens, lr)
        self.step += 1
        totals: dict[str, float] = {}
        all_rejected = 1.0
        for metrics in per_mb:  # normalised by the step's global counts, like the loss: they add up
            all_rejected = min(all_rejected, float(metrics.pop("loss/all_rejected", 0.0)))
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        return {**totals, "loss/all_rejected": all_rejected, "train/loss": loss_total, "train/grad_norm": grad_norm, "train/lr": lr}

    def _cpu_step(self, micro: list[TrainBatch], num_seqs: float, num_tokens: float, lr: float):
        self.optimizer.zero_grad(set_to_none=True)
        loss_total, per_mb = 0.0, []
        for mb in micro:
            loss, metrics = self._microbatch_loss(self.model, mb, num_seqs, num_tokens)
            loss.backward()
            loss_total += loss.item()
            per_mb.append(dict(metrics))
        ps = _groups()
        if ps.get_data_parallel_world_size() > 1:  # loss normalised globally: summing shard grads = full grad
            for p in self.model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
        grad_norm = clip_grad_norm_tp(list(self.model.parameters()), self.optim.clip_grad)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return loss_total, per_mb, grad_norm

    def _gpu_step(self, micro: list[TrainBatch], num_seqs: float, num_tokens: float, lr: float):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        per_mb: list[dict] = []

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            loss, metrics = self._microbatch_loss(model, mb, num_seqs, num_tokens)
            per_mb.append(dict(metrics))

            def loss_func(output):  # (loss, token count, reported) -> no rescaling (calculate_per_token_loss)
                return output, torch.ones((), dtype=torch.int, device=output.device), {"loss": output.detach()}

            return loss, loss_func

        longest = max(len(t) for mb in micro for t in mb.tokens)
        reported = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro), model=[self.model],
            num_microbatches=len(micro), seq_length=longest, micro_batch_size=max(len(mb) for mb in micro),
            forward_only=False,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        _, grad_norm, _ = self.optimizer.step()
        loss_total = float(sum(r["loss"].item() for r in reported))
        return loss_total, per_mb, float(grad_norm if grad_norm is not None else float("nan"))

    # ---- weights & state -------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights under HF names (TP shards gathered). Collective: every rank must consume it."""
        yield from export_hf_weights(self.module, self.spec)

    def weight_buckets(self, bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """`named_weights` grouped into buckets of about `bucket_bytes`, for streaming to rollout engines."""
        yield from bucketed(self.named_weights(), bucket_bytes)

    def save(self, path: str, extra: dict) -> None:
        """Collective. <path>/model: distributed checkpoint (any layout can load it); <path>/optim: optimizer
        state (GPU: distributed checkpoint; CPU: one torch file per rank, same layout to resume);
        <path>/learner.pt: step and `extra`."""
        ckpt.save_model(self.module, os.path.join(path, "model"), hf_config=self.hf_config, hf_dir=self.hf_dir)
        rank = dist.get_rank()
        if self.on_gpu:
            from megatron.core import dist_checkpointing

            optim_dir = os.path.join(path, "optim")
            if rank == 0:
                os.makedirs(optim_dir, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(self.optimizer.sharded_state_dict(self.module.sharded_state_dict()), optim_dir)
        else:
            os.makedirs(os.path.join(path, "optim"), exist_ok=True)
            torch.save(self.optimizer.state_dict(), os.path.join(path, "optim", f"rank{rank:05d}.pt"))
        if rank == 0:
            torch.save({"step": self.step, "extra": extra, "world_size": dist.get_world_size()}, os.path.join(path, "learner.pt"))
        dist.barrier()

    def load(self, path: str) -> dict:
        """Collective: restore model, optimizer and step saved by `save`; returns the saved `extra`."""
        if not _is_learner_ckpt(path):
            raise ValueError(f"{path!r} is not a Megatron learner checkpoint (no learner.pt)")
        state = torch.load(os.path.join(path, "learner.pt"), weights_only=False)
        ckpt.load_model(self.module, os.path.join(path, "model"))
        if self.on_gpu:
            from megatron.core import dist_checkpointing

            sharded = self.optimizer.sharded_state_dict(self.module.sharded_state_dict(), is_loading=True)
            self.optimizer.load_state_dict(dist_checkpointing.load(sharded, os.path.join(path, "optim")))
        else:
            if state["world_size"] != dist.get_world_size():
                raise ValueError(f"CPU optimizer state was saved by {state['world_size']} ranks; resume with the same layout")
            rank_file = os.path.join(path, "optim", f"rank{dist.get_rank():05d}.pt")
            self.optimizer.load_state_dict(torch.load(rank_file, weights_only=False))
        self.step = int(state["step"])
        return state["extra"]


def _is_learner_ckpt(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "learner.pt"))


def model_dir(path: str) -> str:
    """The model checkpoint inside a learner checkpoint, or `path` itself (a converter's output)."""
    return os.path.join(path, "model") if _is_learner_ckpt(path) else path


def clip_grad_norm_tp(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global gradient L2 norm over the model-parallel group (TP-sharded parameters counted on every rank,
    replicated ones once), then scale gradients so the norm is at most `max_norm` (0 = no clipping)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    ps = _groups()
    grads = [p.grad for p in params if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)]
    sq = torch.zeros((), dtype=torch.float64)
    for g in grads:
        sq += g.detach().double().pow(2).sum().cpu()
    group = ps.get_model_parallel_group()  # TP x PP
    if dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    norm = math.sqrt(float(sq))
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def build_megatron_learner(cfg: Any, megatron: MegatronConfig | None = None) -> MegatronLearner:
    """Build the learner from a `RunConfig` (train / loss / sampling sections); `megatron` defaults to
    `cfg.megatron` when the run config has that section, else MegatronConfig(). Initialises the process
    groups if the caller has not (single process: world size 1 over gloo / NCCL)."""
    from .parallel import ParallelConfig, free_port, init_parallel

    megatron = megatron or getattr(cfg, "megatron", None) or MegatronConfig()
    t = cfg.train
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    init_parallel(ParallelConfig(megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size), seed=t.seed)
    hf_dir = t.hf_checkpoint or None
    hf_config = read_hf_config(hf_dir) if hf_dir else ckpt.read_meta(model_dir(megatron.load))["hf_config"]
    temperature = cfg.sampling.temperature if cfg.sampling.temperature > 0 else 1.0
    return MegatronLearner(
        hf_config, cfg.loss, hf_dir=hf_dir, megatron=megatron,
        optim=OptimConfig(lr=t.lr, weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2),
                          warmup_iters=t.lr_warmup_iters, clip_grad=t.clip_grad),
        max_tokens=t.max_tokens_per_gpu, temperature=temperature, need_ref=cfg.loss.use_kl_loss,
        params_dtype=torch.bfloat16 if t.bf16 else torch.float32,
    )
