"""The tensor operations KV-compression methods are built from: pure torch, batched over leading dimensions.

Shapes: keys [..., Hkv, n, d] post-RoPE, one row per cache slot, slots in chronological order (the caches keep kept
tokens sorted, so slot order is token order even after earlier compressions); queries [..., Hq, w, d], the post-RoPE
queries of the last w tokens, the last one at slot n - 1 (query i sits at slot n - w + i and attends causally to
slots <= n - w + i). Query head h belongs to KV head h // (Hq // Hkv), the layout of Qwen2/Llama and of
transformers' repeat_kv. Everything is computed in float32 whatever the input dtype, so bf16 and fp32 inputs rank
tokens alike.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

GQA_REDUCTIONS = ("mean", "max")
POOLINGS = ("max", "avg")
PROTECTED_SCORE = float("inf")  # score of the slots selection always keeps (sinks, observation window)


def gqa_reduce(x: Tensor, n_kv_heads: int, how: str, dim: int = 0) -> Tensor:
    """Reduce the Hq query heads on `dim` of x over the Hq // n_kv_heads heads of each KV group -> n_kv_heads there.

    Query heads of a group are consecutive (head h belongs to KV head h // group, transformers' repeat_kv layout).
    """
    if how not in GQA_REDUCTIONS:
        raise ValueError(f"gqa_reduce how={how!r} is invalid: choose one of {GQA_REDUCTIONS}")
    dim = dim % x.dim()
    n_q_heads = x.shape[dim]
    if n_kv_heads < 1 or n_q_heads % n_kv_heads != 0:
        raise ValueError(f"gqa_reduce: {n_q_heads} query heads are not a multiple of n_kv_heads={n_kv_heads}")
    grouped = x.unflatten(dim, (n_kv_heads, n_q_heads // n_kv_heads))
    return grouped.mean(dim=dim + 1) if how == "mean" else grouped.amax(dim=dim + 1)


def pool1d(x: Tensor, kernel_size: int, how: str) -> Tensor:
    """Same-length 1d pooling over the last dim (stride 1, padding kernel_size // 2).

    As in SnapKV / R-KV / kvpress (torch's defaults): max pooling ignores the padding, average pooling counts the
    zero padding in its divisor (border tokens are averaged over the full kernel).
    """
    if how not in POOLINGS:
        raise ValueError(f"pool1d how={how!r} is invalid: choose one of {POOLINGS}")
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"pool1d kernel_size={kernel_size} must be an odd integer >= 1")
    length = x.shape[-1]
    if kernel_size == 1 or length == 0:
        return x
    flat = x.reshape(-1, 1, length)
    pool = F.max_pool1d if how == "max" else F.avg_pool1d
    return pool(flat, kernel_size=kernel_size, stride=1, padding=kernel_size // 2).reshape(x.shape)


def attention_logits(keys: Tensor, queries: Tensor) -> Tensor:
    """Scaled dot products Q K^T / sqrt(d) per query head: [..., Hq, w, n] float32 (no mask).

    A KV group's query heads and window positions ride as the rows of one matmul against their KV head's keys
    ([..., Hkv, g * w, d] @ [..., Hkv, d, n]), so the keys are never copied once per query head (a broadcast matmul
    would materialise them g times: 7x the keys at Qwen2.5-7B)."""
    n_kv_heads, n, head_dim = keys.shape[-3:]
    n_q_heads, w = queries.shape[-3:-1]
    lead = queries.shape[:-3]
    q = queries.float().reshape(*lead, n_kv_heads, (n_q_heads // n_kv_heads) * w, head_dim)
    logits = q @ keys.float().transpose(-1, -2) / math.sqrt(head_dim)  # [..., Hkv, g * w, n]
    return logits.reshape(*lead, n_q_heads, w, n)


def causal_window_attention(keys: Tensor, queries: Tensor) -> Tensor:
    """Softmax attention of the last w queries over all n slots, causal inside the window: [..., Hq, w, n] float32."""
    logits = attention_logits(keys, queries)
    w, n = logits.shape[-2:]
    query_pos = torch.arange(n - w, n, device=logits.device)
    future = torch.arange(n, device=logits.device)[None, :] > query_pos[:, None]  # [w, n]
    return logits.masked_fill(future, float("-inf")).softmax(dim=-1)


def scored_length(window: int, n: int) -> int:
    """Slots [0, m) are scored; the last `window` slots are always kept and never scored."""
    return max(n - window, 0)


def with_protected(scored: Tensor, n: int, sinks: int) -> Tensor:
    """Scores [..., Hkv, m] of slots [0, m) placed into [..., Hkv, n] whose first `sinks` and last n - m slots hold
    +inf (selection keeps them whatever their score)."""
    m = scored.shape[-1]
    out = F.pad(scored.float(), (0, n - m), value=PROTECTED_SCORE)
    if sinks:
        out[..., : min(sinks, n)].fill_(PROTECTED_SCORE)  # fill_: a host scalar through setitem lifts a tensor
    return out
