"""The attention function our engine registers with transformers' AttentionInterface, and decode attention.

Qwen2/Llama attention computes post-RoPE q/k/v, calls `past_key_values.update(k, v, layer)` (our
BudgetKVCache returns the held keys/values of the rows being run) and then calls the function registered
under `config._attn_implementation` with the post-RoPE queries.
Ours differs from plain attention in three ways: its mask comes from the cache (what each row holds, per layer:
the model is handed no mask at all), it hands the queries to the cache (the observation window the compression
methods score with) and, for H2O, it computes the probabilities explicitly so the cache can accumulate each slot's
attention mass. Everything it does is free of host synchronisation, so a decode step through it can be captured
in a CUDA graph. Outside an engine forward it is transformers' sdpa attention.

A decode step (one new token per row, through HF's modules or our decode body's `decode_layer`) attends with one of
DECODE_BACKENDS, the cache's `decode_backend`: "sdpa" under the cache's mask over the padded span, or "triton", a
split-KV kernel that reads each row's length (triton_attention.py). Both are exact against dense attention.
"""
from __future__ import annotations

import inspect
import logging
import os
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import triton_attention
from .cache import BudgetKVCache
from .triton_attention import decode_attention_op

logger = logging.getLogger(__name__)
ATTENTION_NAME = "slime_sparse_budget_kv"
CACHE_KWARG = "budget_kv_cache"  # forward kwarg through which the model hands our cache to this function
# No mask: for an attention function registered only with AttentionInterface (not AttentionMaskInterface),
# transformers builds none (masking_utils' early exit for custom attention); ours reads its mask from the cache.
NO_MASK = None


def cache_keyword(body: nn.Module) -> str:
    """The keyword under which the decoder body takes the cache: `cache` (transformers >= 5.x) or `past_key_values`
    (contract.py checks it)."""
    return "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"


def grouped_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """Eager GQA attention that also returns its probabilities.

    query [n, Hq, C, d], key/value [n, Hkv, S, d], mask [n, 1, C, S] bool (True = may attend).
    Returns (output [n, C, Hq, d] in transformers' layout, probs [n, Hkv, group, C, S] float32).
    Query head h belongs to KV head h // group (transformers' repeat_kv layout).
    """
    n, n_q_heads, width, d = query.shape
    n_kv_heads, span = key.shape[1], key.shape[2]
    group = n_q_heads // n_kv_heads
    # in float32 throughout, as SDPA keeps its scores and accumulators (the learner's attention): in bf16, scores
    # rounded to bf16 before the softmax would add a numeric mismatch of their own
    q = query.reshape(n, n_kv_heads, group * width, d).float()
    scores = (q @ key.float().transpose(-1, -2)).view(n, n_kv_heads, group, width, span) * scaling
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = (probs.view(n, n_kv_heads, group * width, span) @ value.float()).to(value.dtype)
    return out.view(n, n_q_heads, width, d).transpose(1, 2).contiguous(), probs


DECODE_BACKENDS = ("sdpa", "triton")


def decode_attention(query: Tensor, key: Tensor, value: Tensor, cache: BudgetKVCache, layer: int,
                     scale: float) -> Tensor:
    """Attention of one new token per row over what its row holds in `layer` (the cache says what: a length-reading
    Triton kernel with `cache.decode_backend` "triton", else SDPA under the cache's mask).

    query [n, Hq, d], key/value [n, Hkv, S, d]. Returns [n, Hq, d]. SDPA runs GQA without copying keys: the group's
    query heads ride as G query positions of their KV head (all at the same position, so one mask serves them)."""
    n, n_q_heads, d = query.shape
    n_kv_heads = key.shape[1]
    if cache.decode_backend == "triton":
        return decode_attention_op(query, key, value, cache.decode_lengths(layer), scale)
    q = query.view(n, n_kv_heads, n_q_heads // n_kv_heads, d)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=cache.attention_mask(layer), scale=scale)
    return out.view(n, n_q_heads, d)


def pick_decode_attention(requested: str | None, device: torch.device) -> str:
    """The decode attention backend an engine on `device` uses: `requested`, checked, or the default (triton on CUDA
    when the kernel builds and passes its self-check against SDPA there, else sdpa)."""
    if requested is None:
        if device.type != "cuda" or not triton_attention.available():
            return "sdpa"
        reason = triton_attention.self_check(device)
        if reason is not None:
            logger.warning("decode attention: the Triton kernel failed its self-check, using SDPA: %s", reason)
            return "sdpa"
        return "triton"
    if requested not in DECODE_BACKENDS:
        raise ValueError(f"decode_attention={requested!r} is invalid: choose one of {DECODE_BACKENDS}")
    if requested == "triton":
        interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
        if not triton_attention.available() or (device.type != "cuda" and not interpreted):
            raise ValueError("decode_attention='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 on CPU)")
        triton_attention.load()
    return requested


def decode_layer(cache: BudgetKVCache, layer: int, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
    """One layer's attention in a decode step of our body (decode_body.py): write the new key / value, record the
    query (methods that score with them), attend; H2O's explicit path when the cache tracks attention mass.
    query [n, Hq, d] post-RoPE, key / value [n, Hkv, d]. Returns [n, Hq, d]."""
    keys, values = cache.update(key[:, :, None], value[:, :, None], layer)
    cache.record_queries(layer, query[:, :, None])
    if cache.tracks_mass:
        out, probs = grouped_attention(query[:, :, None], keys, values, cache.attention_mask(layer), scale)
        cache.accumulate_mass(layer, probs)
        return out[:, 0]
    return decode_attention(query, keys, values, cache, layer, scale)


def budget_kv_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    cache: BudgetKVCache | None = kwargs.pop(CACHE_KWARG, None)
    if cache is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cache.record_queries(layer, query)
    if cache.tracks_mass:  # the mask comes from the cache (what each row holds); the model's is not used
        out, probs = grouped_attention(query, key, value, cache.attention_mask(layer), scale)
        cache.accumulate_mass(layer, probs)
        return out, None
    if query.shape[2] == 1:
        return decode_attention(query[:, :, 0], key, value, cache, layer, scale)[:, None], None
    return sdpa_attention_forward(module, query, key, value, cache.attention_mask(layer), dropout=0.0, scaling=scale,
                                  **kwargs)


AttentionInterface.register(ATTENTION_NAME, budget_kv_attention)


@contextmanager
def budget_attention_installed(model: nn.Module) -> Iterator[None]:
    """Route the model's attention through `budget_kv_attention` for the duration of the block.

    The previous implementation is restored afterwards, so a model shared with other code (a dense
    evaluation engine, a reference forward in a test) is left as it was found.
    """
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
