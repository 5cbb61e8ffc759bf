"""Per-token log-probs (and entropy) of response tokens from vocab-sharded Megatron logits.

The output layer is vocab-parallel: TP rank r holds the logits of vocabulary slice r. Log-probs use
megatron-core's `vocab_parallel_cross_entropy` (max and sum-exp are all-reduced over the TP group, no
rank ever holds the full vocabulary); the entropy is computed the same way. Columns of the padded
vocabulary (ids >= the HF vocab size) are masked out so the softmax is exactly the HF model's.

Layout mirrors `slime_sparse.backends.logprobs`: rows are prompt + response, right-padded; results are
[B, R] (R = longest response), zero past each response.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..logprobs import pad_right, response_mask


def causal_mask(seq_len: int, device: torch.device | str) -> Tensor:
    """Megatron's attention mask convention: True = masked, shape [1, 1, S, S]. Passed explicitly because
    megatron-core's default (mask=None) allocates on "cuda". With right padding a causal mask is all
    that is needed: real tokens never attend to the padding after them."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def forward_logits(model: torch.nn.Module, input_ids: Tensor) -> Tensor:
    """The model's output on right-padded rows (positions 0..S-1): vocab-sharded logits [B, S, V_pad / TP]
    on the last pipeline stage, hidden states for the next stage elsewhere (whose input is the previous
    stage's output, set by Megatron's schedule; `input_ids` then only gives the shapes)."""
    seq = input_ids.shape[1]
    position_ids = torch.arange(seq, device=input_ids.device)[None, :].expand_as(input_ids)
    return model(input_ids, position_ids, causal_mask(seq, input_ids.device))


def _tp_group_and_range(shard_width: int) -> tuple[object, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank() * shard_width


def mask_padded_vocab(logits: Tensor, vocab_size: int) -> Tensor:
    """float32 logits with the columns of padded vocabulary ids set to the most negative float, so they get
    probability 0 (a finite value: -inf would turn 0 * logit into NaN in the entropy)."""
    logits = logits.float()
    _, start = _tp_group_and_range(logits.shape[-1])
    ids = torch.arange(start, start + logits.shape[-1], device=logits.device)
    if int(ids[-1]) < vocab_size:
        return logits
    return logits.masked_fill(ids >= vocab_size, torch.finfo(torch.float32).min)


def vocab_parallel_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) from vocab-sharded (already masked / tempered) float logits [..., V/TP]; targets [...]."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # The kernel works on [S, B, V] in Megatron, but only needs matching leading dims; it modifies its
    # input in place, hence the clone when the caller's tensor is still needed (entropy).
    return -vocab_parallel_cross_entropy(logits, targets)


def vocab_parallel_entropy(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the full (sharded) vocabulary, differentiable. H = lse - E_p[logit]."""
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    group, _ = _tp_group_and_range(logits.shape[-1])
    shift = logits.max(dim=-1, keepdim=True).values.detach()
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    exp = torch.exp(logits - shift)
    # all-reduce forward, identity backward: each rank gets d(replicated loss)/d(its own shard)
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    sum_exp_logit = reduce_from_tensor_model_parallel_region((exp * (logits - shift)).sum(dim=-1))
    return torch.log(sum_exp) - sum_exp_logit / sum_exp


def response_positions(lengths: Tensor, response_lens: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """(positions whose logits predict the response tokens, positions of those tokens), both [B, R].

    Logits at position p predict token p + 1, so response tokens [L - r, L) come from [L - r - 1, L - 1).
    Past a response's end both are clamped into range; callers mask those entries."""
    width = int(response_lens.max())
    offs = torch.arange(width, device=lengths.device)
    pred = (lengths - response_lens - 1)[:, None] + offs[None, :]
    pred = pred.clamp(min=0, max=seq_len - 1)
    return pred, (pred + 1).clamp(max=seq_len - 1)


def logprobs_from_logits(
    logits: Tensor,
    input_ids: Tensor,
    lengths: Tensor,
    response_lens: list[int],
    *,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs [B, R] of each response token (and entropies [B, R] when asked) from the vocab-sharded
    logits [B, S, V/TP] of the right-padded rows `input_ids` [B, S] of `lengths` tokens, logits / temperature.

    Separate from the forward so that a pipeline's last stage can apply it to the logits the schedule
    hands its loss function."""
    if temperature <= 0:
        raise ValueError(f"--rollout-temperature must be > 0, got {temperature}")
    device = logits.device
    pred, tgt = response_positions(lengths, torch.tensor(response_lens, device=device), input_ids.shape[1])
    picked = torch.gather(logits, 1, pred[:, :, None].expand(-1, -1, logits.shape[-1]))
    # mask after dividing: the mask value is the most negative float, which the division would overflow
    scaled = mask_padded_vocab(picked.float() / temperature, vocab_size)
    targets = torch.gather(input_ids, 1, tgt)
    entropy = vocab_parallel_entropy(scaled) if with_entropy else None
    logp = vocab_parallel_logprobs(scaled.clone() if with_entropy else scaled, targets)
    mask = response_mask(response_lens, device=device)
    return logp * mask, (entropy * mask if entropy is not None else None)


def check_rows(tokens: list[list[int]], response_lens: list[int]) -> None:
    if any(r < 1 for r in response_lens) or any(r >= len(t) for r, t in zip(response_lens, tokens)):
        raise ValueError("every response_lens[i] must be >= 1 and < len(tokens[i]) (a prompt token comes first)")


def response_logprobs(
    model: torch.nn.Module,
    tokens: list[list[int]],
    response_lens: list[int],
    *,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs [B, R] of each response token (and entropies [B, R] when asked) of a single-stage model."""
    check_rows(tokens, response_lens)
    device = next(model.parameters()).device
    input_ids = pad_right(tokens, device=device)
    lengths = torch.tensor([len(t) for t in tokens], device=device)
    return logprobs_from_logits(forward_logits(model, input_ids), input_ids, lengths, response_lens,
                                vocab_size=vocab_size, temperature=temperature, with_entropy=with_entropy)
