"""Embedded learner: a plain PyTorch learner on a Hugging Face causal LM (CPU or one GPU per rank).

Data parallel when torch.distributed is initialised (Ray learner group): every rank runs its shard
with the step's *global* normalisers, so summing gradients across ranks gives the full-batch gradient.
"""
from __future__ import annotations

import copy
from typing import Iterator

import torch
import torch.distributed as dist

from slime_sparse.algo import LossConfig, categorical_kl
from slime_sparse.backends.base import TrainBatch, microbatch_loss
from slime_sparse.backends.metrics import step_metrics
from slime_sparse.backends.batching import MicroBatching
from slime_sparse.backends.logprobs import (
    picked_logprobs,
    recompute_logprobs,
    response_log_softmax,
    response_logprobs,
    response_mask,
)
from slime_sparse.backends.recompute import Recompute, checkpoint_hf_layers
from slime_sparse.kv.record import EvictionRecord
from slime_sparse.backends.optimizer import OptimConfig, adamw, check_resumed_schedule, hf_lr_scheduler
from slime_sparse.utils.checkpoint import load_training_state, read_trainer_state, save_training_state
from slime_sparse.utils.faults import fault_point


class EmbeddedLearner:
    def __init__(
        self,
        model: torch.nn.Module,
        loss_cfg: LossConfig,
        *,
        optim: OptimConfig,
        batching: MicroBatching = MicroBatching(),
        temperature: float = 1.0,
        need_ref: bool = False,
        fp32_lm_head: bool = False,
        recompute: Recompute | None = None,
    ):
        self.model = model
        self.loss_cfg = loss_cfg
        self.optim = optim
        self.batching = batching
        self.temperature = temperature
        self.fp32_lm_head = fp32_lm_head  # --enable-fp32-lm-head: the sampler's head arithmetic (utils.lm_head)
        self.ref_model = None
        if need_ref:  # frozen copy of the starting policy for the KL term
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        checkpoint_hf_layers(model, recompute)  # --recompute-granularity full: backward reruns each layer's forward
        self.optimizer = adamw(model.named_parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
        self.scheduler = hf_lr_scheduler(self.optimizer, optim)  # sets the lr of step 0
        self.step = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- dense recompute -------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, tokens: list[list[int]], response_lens: list[int], *, ref: bool = False,
                         shadow: list[EvictionRecord | None] | None = None) -> list[torch.Tensor]:
        model = self.ref_model if ref else self.model
        return recompute_logprobs(
            model, tokens, response_lens, self.batching,
            lambda m, t, r, s=None: response_logprobs(m, t, r, temperature=self.temperature, shadow=s,
                                                      fp32_lm_head=self.fp32_lm_head)[0], shadow)

    # ---- update ----------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step over `batch` (this rank's shard of the global batch)."""
        cfg = self.loss_cfg
        num_seqs, num_tokens = batch.checked_normalisers(needs_ref=cfg.needs_ref,
                                                         needs_shadow=cfg.trains_shadow)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        reported: list[dict] = []
        lr = self.scheduler.get_last_lr()[0]  # this step's
        for idx in self.batching.split([len(t) for t in batch.tokens]):
            mb = batch.select(idx)
            loss, metrics = self._microbatch_loss(mb, num_seqs, num_tokens)
            loss.backward()
            fault_point("learner.backward")  # chaos tests: a kill mid-step, weights half-way to updated
            reported.append({**metrics, "train/loss": loss.item()})
        if dist.is_available() and dist.is_initialized():
            self._all_reduce_grads()
        clip = self.optim.clip_grad if self.optim.clip_grad > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return {**step_metrics(reported), "train/grad_norm": float(grad_norm), "train/lr": lr}

    def _microbatch_loss(self, mb: TrainBatch, num_seqs: float, num_tokens: float) -> tuple[torch.Tensor, dict]:
        """sparse_rl: one dense forward. shadow: one shadow forward (the PPO term's policy). smd: both, the dense
        one for the distillation KL(pi_dense || stopgrad(pi_shadow)) at every response token."""
        cfg, temp, fp32 = self.loss_cfg, self.temperature, self.fp32_lm_head
        shadow = mb.evictions if cfg.trains_shadow else None
        logp_all, targets = response_log_softmax(self.model, mb.tokens, mb.response_lens, temperature=temp,
                                                 shadow=shadow, fp32_lm_head=fp32)
        logp, entropy = picked_logprobs(logp_all, targets, mb.response_lens, with_entropy=cfg.entropy_coef != 0)
        distill_kl = None
        if cfg.distills:
            dense_all, _ = response_log_softmax(self.model, mb.tokens, mb.response_lens, temperature=temp,
                                                fp32_lm_head=fp32)
            distill_kl = categorical_kl(dense_all, logp_all.detach()) * response_mask(mb.response_lens, logp.device)
        return microbatch_loss(logp, entropy, mb, cfg, num_seqs, num_tokens, distill_kl)

    def _all_reduce_grads(self) -> None:
        # loss was normalised by global counts: summing shard gradients gives the global gradient
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)

    # ---- weights & state -------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.model.state_dict().items()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict)

    def save_checkpoint(self, path: str, *, step: int, data_state: dict, extra: dict | None = None,
                        tokenizer=None, keep_last: int | None = None) -> str:
        """Atomic training checkpoint (HF weights + optimizer + scheduler + RNG + loop state) at `path`."""
        extra = {**(extra or {}), "learner_step": self.step, "lr_schedule": self.optim.schedule}
        return save_training_state(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                   step=step, data_state=data_state, extra=extra, tokenizer=tokenizer,
                                   keep_last=keep_last)

    def load_checkpoint(self, path: str) -> dict:
        """Restore weights, optimizer, the lr scheduler's position, RNG; the schedule must be the checkpoint's."""
        check_resumed_schedule(read_trainer_state(path)["extra"].get("lr_schedule"), self.optim)
        state = load_training_state(path, self.model, self.optimizer, self.scheduler)
        self.step = int(state["extra"]["learner_step"])
        return state
