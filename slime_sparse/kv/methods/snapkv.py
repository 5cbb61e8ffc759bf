"""SnapKV: the window's attention mass, pooled."""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..ops import causal_window_attention, gqa_reduce, pool1d, scored_length, with_protected
from .base import (KVMethod, ScoreShape, check_gqa, check_pooling, gqa_knob, kernel_knob, pooling_knob, register,
                   window_logits_bytes)


@register
@dataclass(frozen=True)
class SnapKV(KVMethod):
    """SnapKV (Li et al., arXiv 2404.14469): each slot scores the attention the last `window` queries pay it
    (causal softmax over every slot, summed over the window), pooled over neighbouring slots, then reduced over each
    KV head's query heads (after pooling, as kvpress's SnapKVPress). Meant for prompts: it also cuts a prompt to the
    budget once it is prefilled."""

    name = "snapkv"
    needs_queries = True
    compresses_after_prefill = True

    kernel_size: int = kernel_knob()
    pooling: str = pooling_knob()
    gqa_reduce: str = gqa_knob()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_pooling(self.kernel_size, self.pooling)
        check_gqa(self.gqa_reduce)

    def score(self, keys: Tensor, queries: Tensor, attn_mass: Tensor | None = None) -> Tensor:
        n_kv_heads, n = keys.shape[-3:-1]
        m = scored_length(self.window, n)
        mass = causal_window_attention(keys, queries).sum(dim=-2)[..., :m]  # [..., Hq, m]
        pooled = pool1d(mass, self.kernel_size, self.pooling)
        return with_protected(gqa_reduce(pooled, n_kv_heads, self.gqa_reduce, dim=-2), n, self.sinks)

    def score_bytes(self, s: ScoreShape) -> int:
        return window_logits_bytes(s, self.window)
