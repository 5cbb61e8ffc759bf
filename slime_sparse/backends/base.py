"""The contract between the training loop and a learner backend (embedded PyTorch, Megatron).

Learners never see engines: the loop hands them plain ragged per-sample data and gets back log-probs,
metrics and weights. Every backend computes the loss with `slime_sparse.algo.policy_loss`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from slime_sparse.algo import LossConfig, policy_loss
from slime_sparse.backends.logprobs import pad_right
from slime_sparse.kv.record import EvictionRecord


@dataclass
class TrainBatch:
    """Ragged per-sample training data; row i is `tokens[i]` = prompt + response.

    Per-token fields hold one value per *response* token (length `response_lens[i]`).
    `num_seqs` / `num_tokens` are the normalisers of the whole optimizer step (all micro-batches and
    data-parallel ranks), so each micro-batch's loss is scaled to sum to the global aggregate. The training
    loop sets them in one place, `pipeline.split_steps`; `select` carries them into micro-batches and shards.
    """

    tokens: list[list[int]]
    response_lens: list[int]
    advantages: torch.Tensor  # [N] per sequence
    loss_masks: list[torch.Tensor]  # after sparsity correction (rejected tokens/sequences are 0)
    old_logprobs: list[torch.Tensor] | None = None  # pi_old, dense recompute
    ref_logprobs: list[torch.Tensor] | None = None
    weights: list[torch.Tensor] | None = None  # sparsity-correction weights xi (detached)
    evictions: list[EvictionRecord | None] | None = None  # per sample, for the shadow forward (--loss-type shadow/smd)
    num_seqs: float | None = None
    num_tokens: float | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def kept_counts(self) -> tuple[float, float]:
        """(sequences with a kept token, kept tokens) of this batch alone."""
        kept = [float(m.sum()) for m in self.loss_masks]
        return float(sum(k > 0 for k in kept)), float(sum(kept))

    def step_normalisers(self) -> tuple[float, float]:
        """The step's (num_seqs, num_tokens): as set by the loop, else (a batch handed over on its own is one
        whole step) this batch's own kept counts."""
        if self.num_seqs is None or self.num_tokens is None:
            return self.kept_counts()
        return self.num_seqs, self.num_tokens

    def as_step(self) -> "TrainBatch":
        """This batch with its step's normalisers written in, so every part cut from it (`select`) carries them."""
        num_seqs, num_tokens = self.step_normalisers()
        return dataclasses.replace(self, num_seqs=num_seqs, num_tokens=num_tokens)

    def checked_normalisers(self, *, needs_ref: bool, needs_shadow: bool = False) -> tuple[float, float]:
        """What every learner's train_step needs: inputs present, and the step's (num_seqs, num_tokens)."""
        if self.old_logprobs is None:
            raise ValueError("train_step needs old_logprobs (dense recompute) in the batch")
        if needs_ref and self.ref_logprobs is None:
            raise ValueError("--use-kl-loss needs ref_logprobs in the batch")
        if needs_shadow and self.evictions is None:
            raise ValueError("--loss-type shadow/smd needs the samples' eviction records in the batch (evictions)")
        return self.step_normalisers()

    def select(self, idx: list[int]) -> "TrainBatch":
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
        return TrainBatch(
            tokens=pick(self.tokens),
            response_lens=pick(self.response_lens),
            advantages=self.advantages[idx],
            loss_masks=pick(self.loss_masks),
            old_logprobs=pick(self.old_logprobs),
            ref_logprobs=pick(self.ref_logprobs),
            weights=pick(self.weights),
            evictions=pick(self.evictions),
            num_seqs=self.num_seqs,
            num_tokens=self.num_tokens,
        )


def microbatch_loss(logp: torch.Tensor, entropy: torch.Tensor | None, mb: TrainBatch, cfg: LossConfig,
                    num_seqs: float, num_tokens: float, distill_kl: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """`algo.policy_loss` of one micro-batch from its current log-probs [B, R] (and entropies, and SMD's per-token
    distillation KL): the batch's ragged per-token fields padded to [B, R] on the log-probs' device."""
    dev = logp.device
    pad = lambda xs: None if xs is None else pad_right(xs, 0.0, dtype=torch.float32, device=dev)  # noqa: E731
    return policy_loss(logp, pad(mb.old_logprobs), mb.advantages.to(dev), pad(mb.loss_masks), cfg,
                       weights=pad(mb.weights), logp_ref=pad(mb.ref_logprobs), entropy=entropy,
                       distill_kl=distill_kl, num_seqs=num_seqs, num_tokens=num_tokens)


class Learner(Protocol):
    def compute_logprobs(self, tokens: list[list[int]], response_lens: list[int], *, ref: bool = False,
                         shadow: list[EvictionRecord | None] | None = None) -> list[torch.Tensor]:
        """Dense (full-context) log-probs of each response token, from logits / rollout temperature as slime
        does, so that xi = pi_old / pi_sparse compares distributions at the same temperature. With `shadow` (one
        eviction record per sample): the shadow policy's instead, attending as the sampler's cache did."""

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step over `batch` (micro-batched inside); returns metrics (loss, grad_norm, ...)."""

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (gathered) weights under Hugging Face names, for syncing rollout engines."""

    def save_checkpoint(self, path: str, *, step: int, data_state: dict, extra: dict, tokenizer,
                        keep_last: int | None) -> str:
        """Atomic, resumable checkpoint of weights, optimizer, scheduler, RNG and the loop's `data_state`."""

    def load_checkpoint(self, path: str) -> dict:
        """Restore what `save_checkpoint` wrote; returns {"step", "data_state", "extra"}."""
