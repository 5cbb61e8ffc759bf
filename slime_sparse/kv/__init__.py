"""KV-cache compression shared by every engine: per-layer token scores and the choice of kept slots.

Pure torch, no engine imports. An engine calls `compress_indices` (or `score_layer` + `select_kept`) on the
cache of one sequence when its trigger fires and keeps the returned slots.
"""
from .config import GQA_REDUCTIONS, GRANULARITIES, METHODS, POOLINGS, KVCompressConfig
from .scoring import (
    PROTECTED_SCORE,
    attention_logits,
    causal_window_attention,
    gqa_reduce,
    h2o_scores,
    pool1d,
    rkv_importance,
    rkv_redundancy,
    rkv_scores,
    score_layer,
    snapkv_scores,
    streaming_scores,
)
from .selection import compress_indices, reduce_heads, select_kept

__all__ = [
    "GQA_REDUCTIONS",
    "GRANULARITIES",
    "METHODS",
    "POOLINGS",
    "PROTECTED_SCORE",
    "KVCompressConfig",
    "attention_logits",
    "causal_window_attention",
    "compress_indices",
    "gqa_reduce",
    "h2o_scores",
    "pool1d",
    "reduce_heads",
    "rkv_importance",
    "rkv_redundancy",
    "rkv_scores",
    "score_layer",
    "select_kept",
    "snapkv_scores",
    "streaming_scores",
]
