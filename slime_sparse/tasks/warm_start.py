"""Supervised warm start: teach the tiny model the scratchpad format before RL.

RL from random weights would see reward 0 everywhere; a short supervised run on reference
scratchpads gives a policy that is right part of the time (room to improve under RL). Plain
PyTorch AdamW on the HF model, cross-entropy on response tokens only (prompt and padding ignored).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

IGNORE_INDEX = -100  # label value that cross-entropy skips


@dataclass(frozen=True)
class WarmStartConfig:
    """steps: optimizer steps. time_budget_s: stop early once exceeded (None = no limit); a run cut
    short by it depends on the machine's speed, so deterministic runs leave it None."""

    steps: int = 600
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.05  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    seed: int = 0
    time_budget_s: float | None = None
    log_every: int = 25

    def validate(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time_budget_s={self.time_budget_s} must be > 0 or None")


@dataclass
class WarmStartMetrics:
    steps: int  # optimizer steps actually taken
    seconds: float
    stopped_by_time: bool
    first_loss: float
    final_loss: float  # mean of the last few steps' losses
    tokens_seen: int  # response tokens that carried loss
    losses: list[float] = field(default_factory=list)


def lr_at(step: int, config: WarmStartConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)


def collate(tokenizer: PreTrainedTokenizerBase, rows: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Right-padded batch of `<s> prompt response </s>` with labels only on `response </s>`."""
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError("tokenizer needs eos and pad tokens")
    seqs, label_seqs = [], []
    for row in rows:
        if "response" not in row:
            raise ValueError(f"row {row.get('prompt')!r} has no 'response' (the supervised target)")
        prompt_ids = tokenizer(row["prompt"], add_special_tokens=True)["input_ids"]
        response_ids = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt_ids + response_ids)
        label_seqs.append([IGNORE_INDEX] * len(prompt_ids) + response_ids)
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, lab) in enumerate(zip(seqs, label_seqs)):
        input_ids[i, : len(s)] = torch.tensor(s)
        labels[i, : len(lab)] = torch.tensor(lab)
        attention_mask[i, : len(s)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def response_loss(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (response) tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # Position t predicts token t+1.
    shift_logits = logits[:, :-1].reshape(-1, logits.size(-1)).float()
    shift_labels = batch["labels"][:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX)


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data: Sequence[dict],
    config: WarmStartConfig = WarmStartConfig(),
    log: Callable[[str], None] | None = print,
) -> WarmStartMetrics:
    """Train `model` in place on rows with "prompt" and "response"; returns what happened.

    Batches are drawn with a seeded RNG (shuffled epochs), so the same seed, data and starting
    weights give the same run on the same machine.
    """
    config.validate()
    if not data:
        raise ValueError("data is empty: warm start needs rows with 'prompt' and 'response'")
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    order: list[int] = []

    def next_batch() -> list[dict]:
        nonlocal order
        picked = []
        while len(picked) < config.batch_size:
            if not order:
                order = list(range(len(data)))
                rng.shuffle(order)
            picked.append(data[order.pop()])
        return picked

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
    )
    model.train()
    losses: list[float] = []
    tokens = 0
    start = time.perf_counter()
    stopped_by_time = False
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        batch = collate(tokenizer, next_batch())
        loss = response_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        tokens += int((batch["labels"] != IGNORE_INDEX).sum())
        elapsed = time.perf_counter() - start
        if log is not None and ((step + 1) % config.log_every == 0 or step == 0 or step + 1 == config.steps):
            log(f"warm start step {step + 1}/{config.steps} loss {loss.item():.4f} lr {lr_at(step, config):.2e} {elapsed:.0f}s")
        if config.time_budget_s is not None and elapsed > config.time_budget_s and step + 1 < config.steps:
            stopped_by_time = True
            if log is not None:
                log(f"warm start stopped by time budget {config.time_budget_s:.0f}s after {step + 1} steps")
            break
    model.eval()
    tail = losses[-10:]
    return WarmStartMetrics(
        steps=len(losses),
        seconds=time.perf_counter() - start,
        stopped_by_time=stopped_by_time,
        first_loss=losses[0],
        final_loss=sum(tail) / len(tail),
        tokens_seen=tokens,
        losses=losses,
    )
