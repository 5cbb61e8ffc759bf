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

Cost: each batch mixes bare answers (~13 tokens) and worked ones (up to ~95), so one padded forward would spend
half its work on padding; the rows are run in a few micro-batches of similar length instead (`length_groups`),
with the loss summed over all of them and divided by the batch's token count once: the same batch, loss and
gradient, ~40 % less compute. It runs on one thread by default (`threads`): a multi-threaded backward splits its
float sums by the core count, and hundreds of steps at lr 3e-3 amplify the rounding into another model (greedy
accuracy 0.13 on one thread against 0.33 on two, measured), so the assets would depend on the machine's cores.
It is resumable: with `checkpoint` it saves its whole state every `checkpoint_every` steps and a rerun continues
from there to the same weights.
"""
from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from slime_sparse.backends.batching import MICRO_BATCH_COST_TOKENS, length_groups
from slime_sparse.utils.logging import progress_bar
from slime_sparse.utils.threads import torch_threads

IGNORE_INDEX = -100  # label value that cross-entropy skips


@dataclass(frozen=True)
class WarmStartConfig:
    """steps: optimizer steps. time_budget_s: also end when this many seconds have passed (None = no
    limit); the cosine decay then follows whichever of steps or time runs out first, so a run cut
    short still ends annealed. Such a run depends on the machine's speed: deterministic runs leave it None.
    threads: torch's intra-op threads during the warm start (None: leave them as they are); 1 gives the same
    weights on a machine of any core count.
    """

    steps: int = 400  # #45: 600 steps cost the main job its 3 CPU minutes (docs/tiny_recipe_history.md)
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.05  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    seed: int = 0
    time_budget_s: float | None = None
    window_mask_prob: float = 0.25  # fraction of sequences trained under a prompt + recent-window mask
    window_range: tuple[int, int] = (16, 48)  # W drawn uniformly from this inclusive range per sequence
    threads: int | None = 1

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
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads={self.threads} must be >= 1 or None")


@dataclass
class WarmStartMetrics:
    steps: int  # optimizer steps actually taken
    seconds: float  # this call's (a resumed run counts from its resume)
    stopped_by_time: bool
    first_loss: float
    final_loss: float  # mean of the last few steps' losses
    tokens_seen: int  # response tokens that carried loss
    losses: list[float] = field(default_factory=list)
    resumed_from: int = 0  # the step a checkpoint restored (0: a fresh start)


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


Encoded = tuple[list[int], list[int]]  # (prompt ids with <s>, response ids with </s>)


def encode(tokenizer: PreTrainedTokenizerBase, rows: Sequence[dict]) -> list[Encoded]:
    """`<s> prompt` and `response </s>` ids of each row (done once: the tokenizer is slow per call)."""
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError("tokenizer needs eos and pad tokens")
    for row in rows:
        if "response" not in row:
            raise ValueError(f"row {row.get('prompt')!r} has no 'response' (the supervised target)")
    # one call per list, the same ids (3000 demonstrations: 0.2 s of CPU against 0.7 s row by row)
    prompts = tokenizer([row["prompt"] for row in rows], add_special_tokens=True)["input_ids"]
    responses = tokenizer([row["response"] for row in rows], add_special_tokens=False)["input_ids"]
    return [(p, r + [tokenizer.eos_token_id]) for p, r in zip(prompts, responses)]


def collate_encoded(encoded: Sequence[Encoded], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch of `<s> prompt response </s>` with labels only on `response </s>`."""
    width = max(len(p) + len(r) for p, r in encoded)
    input_ids = torch.full((len(encoded), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(encoded), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for i, (prompt, response) in enumerate(encoded):
        n = len(prompt) + len(response)
        input_ids[i, :n] = torch.tensor(prompt + response)
        labels[i, len(prompt):n] = torch.tensor(response)
        attention_mask[i, :n] = 1
    prompt_lens = torch.tensor([len(p) for p, _ in encoded])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "prompt_lens": prompt_lens}


def collate(tokenizer: PreTrainedTokenizerBase, rows: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Right-padded batch of `<s> prompt response </s>` with labels only on `response </s>`."""
    return collate_encoded(encode(tokenizer, rows), tokenizer.pad_token_id)


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


def response_nll(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """(sum of the next-token cross-entropy over the labelled tokens, their count).

    batch["attention_mask"] is the 2D padding mask or a prepared 4D mask (`prompt_window_mask`).
    """
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # Position t predicts token t+1.
    shift_logits = logits[:, :-1].reshape(-1, logits.size(-1)).float()
    shift_labels = batch["labels"][:, 1:].reshape(-1)
    total = torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total, int((shift_labels != IGNORE_INDEX).sum())


def response_loss(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (response) tokens."""
    total, count = response_nll(model, batch)
    return total / max(count, 1)


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data: Sequence[dict],
    config: WarmStartConfig = WarmStartConfig(),
    log: Callable[[str], None] | None = print,
    *,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 50,
    progress: bool = True,
) -> WarmStartMetrics:
    """Train `model` in place on rows with "prompt" and "response"; returns what happened.

    Batches are drawn with a seeded RNG (shuffled epochs), so the same seed, data and starting
    weights give the same run on the same machine. `checkpoint`: a file this run saves its state to every
    `checkpoint_every` steps and resumes from when it exists (the caller deletes it once the weights are kept);
    a resumed run ends with the weights an uninterrupted one would have. `progress`: a progress bar on stderr.
    """
    config.validate()
    if not data:
        raise ValueError("data is empty: warm start needs rows with 'prompt' and 'response'")
    with torch_threads(config.threads):
        return _train(model, encode(tokenizer, data), tokenizer.pad_token_id, config, log,
                      None if checkpoint is None else Path(checkpoint), checkpoint_every, progress)


def _train(model, data: list[Encoded], pad_id: int, config: WarmStartConfig, log, checkpoint: Path | None,
           checkpoint_every: int, progress: bool) -> WarmStartMetrics:
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    window_rng = random.Random(config.seed + 1)  # separate stream: the batch order does not depend on it
    order: list[int] = []
    device = next(model.parameters()).device
    # foreach: one call per update op over all tensors, the per-tensor loop's arithmetic bit for bit (a CPU step
    # 5.7 ms against 7.9; a 600-step warm start's weights equal the per-tensor loop's, checked)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay, foreach=True
    )
    losses: list[float] = []
    tokens = 0
    first = 0
    if checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        rng.setstate(state["rng"])
        window_rng.setstate(state["window_rng"])
        torch.set_rng_state(state["torch_rng"])
        order, losses, tokens, first = state["order"], state["losses"], state["tokens"], state["step"]
        if log is not None:
            log(f"warm start: resuming at step {first}/{config.steps} from {checkpoint}")

    def next_batch() -> list[int]:
        nonlocal order
        picked = []
        while len(picked) < config.batch_size:
            if not order:
                order = list(range(len(data)))
                rng.shuffle(order)
            picked.append(order.pop())
        return picked

    def save(step: int) -> None:
        tmp = checkpoint.with_name(checkpoint.name + ".tmp")
        torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "rng": rng.getstate(), "window_rng": window_rng.getstate(), "torch_rng": torch.get_rng_state(),
                    "order": list(order), "losses": losses, "tokens": tokens}, tmp)
        os.replace(tmp, checkpoint)  # whole or not at all

    model.train()
    start = time.perf_counter()
    stopped_by_time = False
    bar = progress_bar(total=config.steps, initial=first, desc="warm start", enabled=progress)
    try:
        for step in range(first, config.steps):
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
            rows = [data[i] for i in next_batch()]
            windows = [0] * len(rows)
            if config.window_mask_prob > 0:
                windows = [window_rng.randint(*config.window_range) if window_rng.random() < config.window_mask_prob
                           else 0 for _ in rows]
            optimizer.zero_grad(set_to_none=True)
            count = sum(len(r) for _, r in rows)  # the batch's labelled tokens: every part divides by all of them
            loss_value = 0.0
            for part in length_groups([len(p) + len(r) for p, r in rows], MICRO_BATCH_COST_TOKENS):
                batch = collate_encoded([rows[i] for i in part], pad_id)
                part_windows = torch.tensor([windows[i] for i in part])
                if bool(part_windows.any()):
                    batch["attention_mask"] = prompt_window_mask(batch["attention_mask"], batch["prompt_lens"],
                                                                 part_windows)
                batch = {k: v.to(device) for k, v in batch.items()}
                total, _ = response_nll(model, batch)
                loss = total / count
                loss.backward()
                loss_value += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            losses.append(loss_value)
            tokens += count
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.4f}")
            if checkpoint is not None and (step + 1) % checkpoint_every == 0 and step + 1 < config.steps:
                save(step + 1)
    finally:
        bar.close()
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
        resumed_from=first,
    )
