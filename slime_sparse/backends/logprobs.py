"""Per-token log-probs of response tokens from a Hugging Face causal LM (dense, full context)."""
from __future__ import annotations

from typing import Callable

import torch

from slime_sparse.backends.batching import MicroBatching
from slime_sparse.kv.record import EvictionRecord
from slime_sparse.utils.lm_head import hf_head_weight, lm_head_logits, tempered_log_softmax


def pad_right(rows: list[list[int]] | list[torch.Tensor], pad: float | int = 0, dtype=None, device=None) -> torch.Tensor:
    """Stack ragged rows into [B, max_len], padding on the right."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), pad, dtype=dtype if dtype is not None else torch.long, device=device)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=out.dtype, device=device)
    return out


def response_mask(response_lens: list[int], device=None) -> torch.Tensor:
    width = max(response_lens, default=0)
    return (torch.arange(width, device=device)[None, :] < torch.tensor(response_lens, device=device)[:, None]).float()


def response_log_softmax(
    model: torch.nn.Module,
    tokens: list[list[int]],
    response_lens: list[int],
    *,
    temperature: float = 1.0,
    shadow: list[EvictionRecord | None] | None = None,
    fp32_lm_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-softmax [B, R, V] float of the tempered next-token distribution at each response token, the
    response tokens [B, R]); R = max response length, rows right-padded (padding rows hold finite junk).

    Row i is `tokens[i]` = prompt + response, whose last `response_lens[i]` tokens are the response.
    Logits are divided by `temperature` (the sampler's), like slime's learner, so that the ratio
    pi_old / pi_sparse compares the same distribution. `shadow`: one eviction record per row (None = dense
    row): the forward then attends as the sampler's compressed cache did (`shadow_attention`).
    The LM head runs on the response positions only (`utils.lm_head`: the sampler's formula, fp32 with
    `fp32_lm_head`), so no [B, S, V] logits of the prompt are ever made.
    """
    device = next(model.parameters()).device
    input_ids = pad_right(tokens, device=device)
    lengths = [len(t) for t in tokens]
    length_t = torch.tensor(lengths, device=device)
    attn = (torch.arange(input_ids.shape[1], device=device)[None, :] < length_t[:, None]).long()
    if shadow is None:
        hidden = model.base_model(input_ids=input_ids, attention_mask=attn, use_cache=False).last_hidden_state
    else:
        from slime_sparse.backends.shadow_attention import shadow_forward  # transformers only when used

        with shadow_forward(model, shadow, lengths) as kwargs:
            hidden = model.base_model(input_ids=input_ids, attention_mask=attn, use_cache=False,
                                      **kwargs).last_hidden_state
    width = max(response_lens)
    # logits at position p predict token p + 1: the response tokens [L - r, L) are predicted from [L - r - 1, L - 1)
    starts = length_t - torch.tensor(response_lens, device=device) - 1
    offs = torch.arange(width, device=device)
    pos = (starts[:, None] + offs[None, :]).clamp(min=0, max=input_ids.shape[1] - 1)
    tgt_pos = (pos + 1).clamp(max=input_ids.shape[1] - 1)
    picked = torch.gather(hidden, 1, pos[:, :, None].expand(-1, -1, hidden.shape[-1]))
    del hidden  # the last layer's output is not needed past the head's input rows (autograd keeps what it needs)
    targets = torch.gather(input_ids, 1, tgt_pos)
    # one expression: no name holds the fp32 logits while their tempered copy and its log-softmax are made, so the
    # head peaks at two [R, V] fp32 tensors, not three (planner/step_memory.py counts them)
    return tempered_log_softmax(lm_head_logits(picked, hf_head_weight(model), fp32=fp32_lm_head), temperature), targets


def response_logprobs(
    model: torch.nn.Module,
    tokens: list[list[int]],
    response_lens: list[int],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    shadow: list[EvictionRecord | None] | None = None,
    fp32_lm_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, R] (right-padded with 0) of each response token, and their entropy when asked; see
    `response_log_softmax`."""
    logp_all, targets = response_log_softmax(model, tokens, response_lens, temperature=temperature, shadow=shadow,
                                             fp32_lm_head=fp32_lm_head)
    return picked_logprobs(logp_all, targets, response_lens, with_entropy=with_entropy)


def picked_logprobs(logp_all: torch.Tensor, targets: torch.Tensor, response_lens: list[int], *,
                    with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, R] of `targets` under `logp_all` [B, R, V], zero on padding (and the entropy)."""
    mask = response_mask(response_lens, device=logp_all.device)
    logp = torch.gather(logp_all, 2, targets[:, :, None]).squeeze(-1) * mask
    entropy = None
    if with_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return logp, entropy


@torch.no_grad()
def recompute_logprobs(
    model: torch.nn.Module | None,
    tokens: list[list[int]],
    response_lens: list[int],
    batching: MicroBatching,
    forward: Callable[..., torch.Tensor],
    shadow: list[EvictionRecord | None] | None = None,
) -> list[torch.Tensor]:
    """pi_old / pi_ref recompute of the embedded learner: the micro-batches of `batching` through
    `forward(model, tokens, response_lens) -> [B, R]`, one CPU fp32 row each; with `shadow` (one eviction record
    per sample) through `forward(model, tokens, response_lens, records)`.
    (The Megatron learner splits micro-batches the same way but runs them through Megatron's schedule.)"""
    if model is None:
        raise ValueError("reference log-probs requested but the learner was built without a reference model")
    was_training = model.training
    model.eval()
    out: list[torch.Tensor] = [torch.empty(0)] * len(tokens)
    for idx in batching.split([len(t) for t in tokens]):
        rows = ([tokens[i] for i in idx], [response_lens[i] for i in idx])
        logp = forward(model, *rows) if shadow is None else forward(model, *rows, [shadow[i] for i in idx])
        for row, i in enumerate(idx):
            out[i] = logp[row, : response_lens[i]].float().cpu()
    model.train(was_training)
    return out
