"""The Megatron learner's optimizer step: two regimes, one chosen per process when the learner is built.

- `MegatronDistributedOptimizer` (GPU): megatron-core's DistributedDataParallel and (distributed) Adam. The
  schedule's finalize hook reduces the gradients (DP summed, not averaged: our loss is normalised by the step's
  global counts; tied embeddings across stages) and Megatron clips them.
- `TorchAdamW` (CPU, gloo; Megatron's DDP buffers and optimizer are CUDA-only): the gradients are summed over the
  DP group (and the tied embedding over the first and last stages) by hand, clipped with a TP/PP-aware global norm
  (`clip_grad_norm_tp`), and a torch AdamW with Megatron's weight-decay rule steps the model.

Both offer the same calls: `wrap(model)` once, then per step `zero_grad()`, `step() -> grad norm`; `save` and
`load` of their state into a training checkpoint's optimizer directory (collective on GPU, one file per rank on CPU).
`optimizer` is the inner optimizer whose param groups Megatron's lr scheduler sets (the learner owns the scheduler).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from slime_sparse.backends.optimizer import OptimConfig, adamw

from .checkpoint import rank_file
from .config import MegatronConfig


def _groups():
    from megatron.core import parallel_state as ps

    return ps


def clip_grad_norm_tp(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global gradient L2 norm over the model-parallel group (TP-sharded parameters counted on every rank,
    TP-replicated ones and the last stage's copy of a tied embedding once), then scale gradients so the norm
    is at most `max_norm` (0 = no clipping)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    grads = [p.grad for p in params
             if p.grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
    sq = torch.zeros((), dtype=torch.float64)
    for g in grads:
        sq += g.detach().double().pow(2).sum().cpu()
    group = _groups().get_model_parallel_group()  # TP x PP
    if dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    norm = math.sqrt(float(sq))
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


class TorchAdamW:
    """CPU regime: gradients reduced by hand, TP/PP-aware clipping, torch AdamW."""

    name = "torch-adamw"  # recorded in a checkpoint's layout: the per-rank optimizer files it wrote
    reduces_in_schedule = False  # every rank joins the gradient all-reduces here, whatever its micro-batches

    def __init__(self, optim: OptimConfig, tied_embeddings: bool) -> None:
        self.optim = optim
        self.tied_embeddings = tied_embeddings  # the first and last pipeline stages each hold a copy
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.AdamW | None = None

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        self.model = model
        self.optimizer = adamw(model.named_parameters(), lr=self.optim.lr, betas=self.optim.betas,
                               weight_decay=self.optim.weight_decay)
        return model

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:  # every rank joins every all-reduce, whatever its micro-batches touched
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ps = _groups()
        if ps.get_data_parallel_world_size() > 1:  # loss normalised globally: summing shard grads = full grad
            for p in params:
                dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
        tied = self.model.shared_embedding_or_output_weight() if self.tied_embeddings else None
        if tied is not None and ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
            # the first and last stages each hold a copy of the tied embedding: both apply the summed gradient
            dist.all_reduce(tied.grad, group=ps.get_embedding_group())
        grad_norm = clip_grad_norm_tp(params, self.optim.clip_grad)
        self.optimizer.step()
        return grad_norm

    def save(self, directory: str) -> None:
        torch.save(self.optimizer.state_dict(), rank_file(directory))

    def load(self, directory: str) -> None:
        self.optimizer.load_state_dict(torch.load(rank_file(directory), map_location="cpu", weights_only=True))


class MegatronDistributedOptimizer:
    """GPU regime: megatron-core's DistributedDataParallel and (distributed) Adam."""

    name = "megatron"
    reduces_in_schedule = True  # DDP joins the gradient all-reduce only from inside the forward/backward schedule

    def __init__(self, optim: OptimConfig, megatron: MegatronConfig) -> None:
        self.optim = optim
        self.megatron = megatron
        self.model = None  # Megatron's DDP around the GPTModel
        self.optimizer = None

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = model.config
        # Megatron's finalize would divide by the schedule's token count: keep its grad sync, drop the scaling.
        config.finalize_model_grads_func = lambda models, num_tokens=None, **kw: finalize_model_grads(models, num_tokens=None, **kw)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.megatron.use_distributed_optimizer,
            average_in_collective=False,
        )
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=self.optim.lr,
            min_lr=self.optim.min_lr,
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
        return self.model

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> float:
        # the schedule's finalize_model_grads already reduced the gradients (DP, tied embeddings)
        _, grad_norm, _ = self.optimizer.step()
        return float(grad_norm if grad_norm is not None else float("nan"))

    def save(self, directory: str) -> None:
        """Collective: a distributed checkpoint of the (distributed) optimizer's state."""
        from megatron.core import dist_checkpointing

        dist_checkpointing.save(self.optimizer.sharded_state_dict(self.model.module.sharded_state_dict()), directory)

    def load(self, directory: str) -> None:
        from megatron.core import dist_checkpointing

        sharded = self.optimizer.sharded_state_dict(self.model.module.sharded_state_dict(), is_loading=True)
        self.optimizer.load_state_dict(dist_checkpointing.load(sharded, directory))


def build_optimizer(optim: OptimConfig, megatron: MegatronConfig, *,
                    tied_embeddings: bool) -> TorchAdamW | MegatronDistributedOptimizer:
    """The regime of this process: Megatron's on a GPU, the torch one on CPU."""
    if torch.cuda.is_available():
        return MegatronDistributedOptimizer(optim, megatron)
    return TorchAdamW(optim, tied_embeddings)
