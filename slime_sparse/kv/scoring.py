"""Token scores of the KV-compression methods: pure torch, one sequence, one layer, all heads at once.

Conventions shared by every function here:
- keys / values: [Hkv, n, d] post-RoPE (every function also takes leading batch dims, [..., Hkv, n, d]), one row per cache slot, slots in chronological order (the cache keeps
  kept tokens sorted, so slot order is token order even after earlier compressions).
- queries: [Hq, w, d] post-RoPE queries of the last w tokens; the last one sits at slot n - 1, so query i sits at
  slot n - w + i and attends causally to slots <= n - w + i. Query head h belongs to KV head h // (Hq // Hkv),
  the layout of Qwen2/Llama (and of transformers' repeat_kv).
- scores: [Hkv, n] float32, higher = keep. Slots that selection always keeps (the first `cfg.sinks`, the last
  `cfg.protected_window`: the window unless the preset protects none) are not scored by the methods (SnapKV and R-KV
  never look at the window's own keys) and carry +inf.
- Everything is computed in float32 whatever the input dtype, so bf16 and fp32 inputs rank tokens alike.

Where each method reduces GQA groups (read from the reference code, matched on purpose):
- rkv: on the attention *logits*, before the softmax, as R-KV's `compute_attention_scores` does (R-KV and the
  Sparse-RL authors' SGLang use `max`);
- snapkv / h2o: on the per-query-head scores after the window sum (and pooling), as kvpress's SnapKVPress does.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import GQA_REDUCTIONS, POOLINGS, KVCompressConfig

PROTECTED_SCORE = float("inf")  # score of the slots selection always keeps (sinks, observation window)
COSINE_EPS = 1e-8  # R-KV's epsilon in k / (||k|| + eps)


# --------------------------------------------------------------------------------------------------------------
# Small helpers (every one broadcasts over leading batch dimensions)
# --------------------------------------------------------------------------------------------------------------
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
    """Scaled dot products Q K^T / sqrt(d) per query head: [..., Hq, w, n] float32 (no mask)."""
    *lead, n_kv_heads, n, head_dim = keys.shape
    n_q_heads, w = queries.shape[-3:-1]
    q = queries.float().unflatten(-3, (n_kv_heads, n_q_heads // n_kv_heads))  # [..., Hkv, g, w, d]
    logits = torch.einsum("...kgwd,...knd->...kgwn", q, keys.float()) / math.sqrt(head_dim)
    return logits.flatten(-4, -3)


def causal_window_attention(keys: Tensor, queries: Tensor) -> Tensor:
    """Softmax attention of the last w queries over all n slots, causal inside the window: [..., Hq, w, n] float32."""
    logits = attention_logits(keys, queries)
    w, n = logits.shape[-2:]
    query_pos = torch.arange(n - w, n, device=logits.device)
    future = torch.arange(n, device=logits.device)[None, :] > query_pos[:, None]  # [w, n]
    return logits.masked_fill(future, float("-inf")).softmax(dim=-1)


def rkv_redundancy(keys: Tensor, sim_threshold: float) -> Tensor:
    """R-KV's redundancy of every slot: [..., Hkv, n] float32, a softmax over slots (each head's row sums to 1).

    Per KV head, S = cosine similarity of keys with the diagonal zeroed. In each row i, the entry of the *newest*
    near-duplicate j* = max{j : S[i, j] > sim_threshold} is zeroed, so the newest copy of a repeated pattern is
    not charged for its similarity to the older copies (it survives, the older ones go). Redundancy of slot j is
    the mean of column j (divided by n, the diagonal included), then softmax over j.
    Faithful to R-KV's `cal_similarity`, including its fallback: a row with no near-duplicate marks index 0, so
    that row's similarity to slot 0 is zeroed too (slot 0 looks slightly less redundant).
    """
    k = keys.float()
    k_unit = k / (k.norm(dim=-1, keepdim=True) + COSINE_EPS)
    sim = k_unit @ k_unit.transpose(-1, -2)  # [..., Hkv, n, n]
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    sim.scatter_(-1, newest_duplicate(sim, sim_threshold).unsqueeze(-1), 0.0)
    return sim.mean(dim=-2).softmax(dim=-1)


def newest_duplicate(sim: Tensor, threshold: float) -> Tensor:
    """[..., n] long: per row i of sim [..., n, n], the largest j with sim[i, j] > threshold, else 0 (R-KV's fallback).

    Slot numbers are multiplied into the mask as int32 rather than selected from int64 (torch.where): the same
    indices for half the memory traffic of this pass over n x n entries, the costliest part of a compression after
    the similarity matmul itself.
    """
    slot = torch.arange(sim.shape[-1], device=sim.device, dtype=torch.int32)
    return ((sim > threshold).to(torch.int32) * slot).amax(dim=-1).long()


def _scored_length(cfg: KVCompressConfig, n: int) -> int:
    """Slots [0, m) are scored; the last cfg.protected_window slots are always kept and never scored."""
    return max(n - cfg.protected_window, 0)


def _with_protected(cfg: KVCompressConfig, scored: Tensor, n: int) -> Tensor:
    """Place scores [..., Hkv, m] of slots [0, m) into a [..., Hkv, n] tensor whose sinks and window hold +inf."""
    out = torch.full((*scored.shape[:-1], n), PROTECTED_SCORE, dtype=torch.float32, device=scored.device)
    m = scored.shape[-1]
    out[..., :m] = scored
    out[..., : min(cfg.sinks, n)] = PROTECTED_SCORE
    return out


# --------------------------------------------------------------------------------------------------------------
# Methods: keys [..., Hkv, n, d], queries [..., Hq, w, d] -> scores [..., Hkv, n]
# --------------------------------------------------------------------------------------------------------------
def snapkv_scores(cfg: KVCompressConfig, keys: Tensor, queries: Tensor) -> Tensor:
    """SnapKV (Li et al., arXiv 2404.14469): window-summed causal softmax attention, pooled over the scored slots,
    then GQA-reduced. PyramidKV (arXiv 2406.02069) scores the same way under per-layer budgets (budgets.py)."""
    n_kv_heads, n = keys.shape[-3:-1]
    m = _scored_length(cfg, n)
    mass = causal_window_attention(keys, queries).sum(dim=-2)[..., :m]  # [..., Hq, m]
    pooled = pool1d(mass, cfg.kernel_size, cfg.pooling)
    return _with_protected(cfg, gqa_reduce(pooled, n_kv_heads, cfg.gqa_reduce, dim=-2), n)


def rkv_importance(cfg: KVCompressConfig, keys: Tensor, queries: Tensor) -> Tensor:
    """R-KV importance of slots [0, m): [..., Hkv, m].

    Logits are GQA-reduced first; the softmax runs over the scored slots only (the window's keys are left out of
    the normalisation, as in R-KV); mean over the window queries, then pooling (R-KV: max, kernel 7).
    """
    n_kv_heads, n = keys.shape[-3:-1]
    m = _scored_length(cfg, n)
    logits = gqa_reduce(attention_logits(keys, queries), n_kv_heads, cfg.gqa_reduce, dim=-3)[..., :m]
    # No causal mask needed: every query sits in the window, after all scored slots.
    attention = logits.softmax(dim=-1).mean(dim=-2)
    return pool1d(attention, cfg.kernel_size, cfg.pooling)


def rkv_scores(cfg: KVCompressConfig, keys: Tensor, queries: Tensor) -> Tensor:
    """R-KV (Cai et al., arXiv 2505.24133): mix_lambda * importance - (1 - mix_lambda) * redundancy, over the
    scored slots."""
    n = keys.shape[-2]
    m = _scored_length(cfg, n)
    importance = rkv_importance(cfg, keys, queries)
    # Redundancy is computed over all n keys (window included) and softmax-normalised over all n, then sliced.
    redundancy = rkv_redundancy(keys, cfg.sim_threshold)[..., :m]
    return _with_protected(cfg, cfg.mix_lambda * importance - (1.0 - cfg.mix_lambda) * redundancy, n)


def h2o_scores(cfg: KVCompressConfig, keys: Tensor, queries: Tensor, attn_mass: Tensor | None) -> Tensor:
    """H2O heavy hitters (Zhang et al., arXiv 2306.14048): the accumulated attention mass if the engine tracks it,
    else the window-summed causal attention of the observed queries (GQA-reduced with cfg.gqa_reduce). No pooling."""
    n_kv_heads, n = keys.shape[-3:-1]
    m = _scored_length(cfg, n)
    if attn_mass is not None:
        mass = attn_mass.float()
    else:
        mass = gqa_reduce(causal_window_attention(keys, queries).sum(dim=-2), n_kv_heads, cfg.gqa_reduce, dim=-2)
    return _with_protected(cfg, mass[..., :m], n)


def streaming_scores(cfg: KVCompressConfig, keys: Tensor) -> Tensor:
    """StreamingLLM (Xiao et al., arXiv 2309.17453): the score is the slot index itself (newer = higher;
    equivalently minus the token's age), so selection keeps the sinks plus the budget - sinks most recent tokens."""
    n = keys.shape[-2]
    m = _scored_length(cfg, n)
    recency = torch.arange(m, dtype=torch.float32, device=keys.device)
    return _with_protected(cfg, recency.expand(*keys.shape[:-2], m), n)


def keydiff_scores(cfg: KVCompressConfig, keys: Tensor) -> Tensor:
    """KeyDiff (Park et al., arXiv 2504.15364): minus the cosine similarity of each key to the anchor, the mean of
    the layer's unit-norm keys (every slot, window included, as kvpress's KeyDiffPress): keys least like the
    average are kept.

    Why this second decode-time method: it reads keys only, so it needs no observation queries (no query ring in
    SGLang, no capture in the attention), works whatever attention kernel computes the logits, and costs one pass
    over the keys instead of R-KV's n x n similarity; its paper evaluates it under exactly our setting, a fixed
    budget refilled block by block, and it is a kvpress press, so kvpress in its own environment is its oracle.
    """
    n = keys.shape[-2]
    m = _scored_length(cfg, n)
    unit = F.normalize(keys.float(), p=2, dim=-1, eps=COSINE_EPS)
    anchor = unit.mean(dim=-2, keepdim=True)  # [..., Hkv, 1, d]
    score = -F.cosine_similarity(keys.float(), anchor, dim=-1, eps=COSINE_EPS)  # [..., Hkv, n]
    return _with_protected(cfg, score[..., :m], n)


# --------------------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------------------
def _check_inputs(
    cfg: KVCompressConfig, keys: Tensor, queries: Tensor, values: Tensor | None, attn_mass: Tensor | None
) -> None:
    if keys.dim() < 3:
        raise ValueError(f"keys must be [..., Hkv, n, d], got shape {tuple(keys.shape)}")
    if queries.dim() != keys.dim() or queries.shape[:-3] != keys.shape[:-3]:
        raise ValueError(f"queries must be [..., Hq, w, d] with the keys' leading dims {tuple(keys.shape[:-3])}, "
                         f"got shape {tuple(queries.shape)}")
    n_kv_heads, n, head_dim = keys.shape[-3:]
    n_q_heads, w, q_dim = queries.shape[-3:]
    if q_dim != head_dim:
        raise ValueError(f"queries head dim {q_dim} != keys head dim {head_dim}")
    if n_kv_heads < 1 or n_q_heads % n_kv_heads != 0:
        raise ValueError(f"queries have {n_q_heads} heads, not a multiple of keys' {n_kv_heads} KV heads")
    if w > cfg.window:
        raise ValueError(f"queries hold {w} tokens, more than --kv-window={cfg.window}")
    if w > n:
        raise ValueError(f"queries hold {w} tokens but the cache only {n}")
    needs_queries = cfg.traits.needs_queries or (cfg.traits.tracks_mass and attn_mass is None)
    if needs_queries and w == 0:
        raise ValueError(f"--kv-method={cfg.method} needs at least one observed query, got w=0")
    if values is not None and values.shape[:-1] != keys.shape[:-1]:
        raise ValueError(f"values shape {tuple(values.shape)} does not match keys shape {tuple(keys.shape)}")
    if attn_mass is not None and attn_mass.shape != keys.shape[:-1]:
        raise ValueError(f"attn_mass must be [..., Hkv, n] = {tuple(keys.shape[:-1])}, got {tuple(attn_mass.shape)}")


def score_layer(
    cfg: KVCompressConfig,
    keys: Tensor,
    queries: Tensor,
    values: Tensor | None = None,
    attn_mass: Tensor | None = None,
) -> Tensor:
    """Scores of every cache slot of one layer of one sequence: [Hkv, n] float32, higher = keep.

    keys [Hkv, n, d] and queries [Hq, w, d] (w <= cfg.window, the last query at slot n - 1) are post-RoPE.
    values are accepted for interface stability; no method here uses them. attn_mass [Hkv, n] (H2O only) is the
    attention mass accumulated by the engine, already summed over each group's query heads.
    Sinks and window slots carry +inf (see module docstring); `select_kept` protects them in any case.

    Leading batch dimensions broadcast (keys [..., Hkv, n, d], queries [..., Hq, w, d], attn_mass [..., Hkv, n]
    -> [..., Hkv, n]), e.g. rows x layers of one engine step, provided every entry holds the same n slots and w
    queries: a batch entry's scores equal that entry scored alone.
    """
    cfg.validate()
    if not cfg.enabled:
        raise ValueError("--kv-method=none: KV compression is disabled, there is nothing to score")
    _check_inputs(cfg, keys, queries, values, attn_mass)
    methods: dict[str, Callable[[], Tensor]] = {
        "snapkv": lambda: snapkv_scores(cfg, keys, queries),
        "pyramidkv": lambda: snapkv_scores(cfg, keys, queries),
        "rkv": lambda: rkv_scores(cfg, keys, queries),
        "h2o": lambda: h2o_scores(cfg, keys, queries, attn_mass),
        "streaming": lambda: streaming_scores(cfg, keys),
        "keydiff": lambda: keydiff_scores(cfg, keys),
    }
    return methods[cfg.method]()
