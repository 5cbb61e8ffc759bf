"""Supervised warm start: teach the tiny model the scratchpad format before RL.

RL from random weights would see reward 0 everywhere; a short supervised run on reference
scratchpads gives a policy that is right part of the time (room to improve under RL). Plain
PyTorch AdamW on the HF model, cross-entropy on response tokens only (prompt and padding ignored).

Optionally part of the sequences are trained under a "prompt + recent window" attention mask
(`window_mask_prob`): every response token then sees only the prompt and its last W tokens, the
view a KV cache that keeps the prompt and a recent window gives. How much of that the model sees
sets how far its attention leans on old scratchpad tokens, hence the sampler/learner mismatch under
a compressed cache. Measured with the default task (countdown scratchpad, R-KV budget 24 + buffer 8):
k3 ~0.05-0.3 nats per token for purely dense warm starts (it varied between runs), ~0.01 with a
quarter of the sequences window-masked (budget 16: ~0.07, the paper's regime), so sparse rollouts
keep a gap to dense ones (what Sparse-RL corrects) without starting RL from nothing.
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
    """steps: optimizer steps. time_budget_s: also end when this many seconds have passed (None = no
    limit); the cosine decay then follows whichever of steps or time runs out first, so a run cut
    short still ends annealed. Such a run depends on the machine's speed: deterministic runs leave it None.
    """

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
    window_mask_prob: float = 0.25  # fraction of sequences trained under a prompt + recent-window mask
    window_range: tuple[int, int] = (16, 48)  # W drawn uniformly from this inclusive range per sequence

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
        if not 0.0 <= self.window_mask_prob <= 1.0:
            raise ValueError(f"window_mask_prob={self.window_mask_prob} must lie in [0, 1]")
        low, high = self.window_range
        if not 1 <= low <= high:
            raise ValueError(f"window_range={self.window_range} must satisfy 1 <= low <= high")


@dataclass
class WarmStartMetrics:
    steps: int  # optimizer steps actually taken
    seconds: float
    stopped_by_time: bool
    first_loss: float
    final_loss: float  # mean of the last few steps' losses
    tokens_seen: int  # response tokens that carried loss
    losses: list[float] = field(default_factory=list)


def lr_at(step: int, config: WarmStartConfig, time_fraction: float = 0.0) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step.

    time_fraction: elapsed / time budget; the decay follows it when it is ahead of the step count.
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, max((step - config.warmup_steps) / span, time_fraction))
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
    prompt_lens = torch.tensor([lab.count(IGNORE_INDEX) for lab in label_seqs])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "prompt_lens": prompt_lens}


def prompt_window_mask(
    attention_mask: torch.Tensor, prompt_lens: torch.Tensor, windows: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive (batch, 1, L, L) mask for right-padded rows.

    Causal everywhere; in a row with windows[b] > 0, each position past the prompt sees only the
    prompt and its last windows[b] positions (itself included); windows[b] == 0 means dense.
    Padding positions see only themselves, so no softmax row is empty.
    """
    width = attention_mask.size(1)
    i = torch.arange(width).view(1, width, 1)  # query position
    j = torch.arange(width).view(1, 1, width)  # key position
    valid = attention_mask.bool()
    w = windows.view(-1, 1, 1)
    in_prompt = (i < prompt_lens.view(-1, 1, 1)) | (j < prompt_lens.view(-1, 1, 1))
    visible = (j <= i) & (in_prompt | (w == 0) | (j > i - w)) & valid[:, None, :] & valid[:, :, None]
    visible |= (i == j) & ~valid[:, :, None]
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[:, None]


def response_loss(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (response) tokens.

    batch["attention_mask"] is the 2D padding mask or a prepared 4D mask (`prompt_window_mask`).
    """
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
    window_rng = random.Random(config.seed + 1)  # separate stream: the batch order does not depend on it
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

    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
    )
    model.train()
    losses: list[float] = []
    tokens = 0
    start = time.perf_counter()
    stopped_by_time = False
    for step in range(config.steps):
        time_fraction = 0.0
        if config.time_budget_s is not None:
            time_fraction = (time.perf_counter() - start) / config.time_budget_s
            if time_fraction >= 1.0:
                stopped_by_time = True
                if log is not None:
                    log(f"warm start stopped by time budget {config.time_budget_s:.0f}s after {step} steps")
                break
        lr = lr_at(step, config, time_fraction)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = collate(tokenizer, next_batch())
        if config.window_mask_prob > 0:
            windows = [
                window_rng.randint(*config.window_range) if window_rng.random() < config.window_mask_prob else 0
                for _ in range(batch["input_ids"].size(0))
            ]
            batch["attention_mask"] = prompt_window_mask(
                batch["attention_mask"], batch["prompt_lens"], torch.tensor(windows)
            )
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = response_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        tokens += int((batch["labels"] != IGNORE_INDEX).sum())
        if log is not None and ((step + 1) % config.log_every == 0 or step == 0 or step + 1 == config.steps):
            elapsed = time.perf_counter() - start
            log(f"warm start step {step + 1}/{config.steps} loss {loss.item():.4f} lr {lr:.2e} {elapsed:.0f}s")
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
