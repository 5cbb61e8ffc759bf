"""KV-cache compression shared by every engine: per-layer token scores, the choice of kept slots, and when.

Pure torch, no engine imports. An engine asks `schedule.should_compress` after each step and, when it says so,
calls `compress_indices` (or `score_layer` + `select_kept`) on the cache of one sequence and keeps the returned slots,
B_l of them in layer l (`budgets.layer_budgets`: uniform, PyramidKV's pyramid, or an explicit list). Knob values
come from a named reference (`presets.py`, `--kv-preset`).
It records what it kept in an `EvictionRecord` (record.py), from which a learner rebuilds the sampler's attention mask.
"""
from .budgets import budget_range, layer_budgets, pyramid
from .config import (GQA_REDUCTIONS, GRANULARITIES, METHODS, POOLINGS, SCHEDULES, TRAITS, KVCompressConfig,
                     MethodTraits)
from .presets import PRESETS, KVPreset
from .record import EvictionRecord, visible_from_kept, visible_positions
from .schedule import peak_slots, row_capacity, should_compress, slots_after_compression, trigger
from .scoring import (
    PROTECTED_SCORE,
    attention_logits,
    causal_window_attention,
    gqa_reduce,
    h2o_scores,
    keydiff_scores,
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
    "KVPreset",
    "PRESETS",
    "SCHEDULES",
    "budget_range",
    "keydiff_scores",
    "layer_budgets",
    "pyramid",
    "slots_after_compression",
    "trigger",
    "GRANULARITIES",
    "METHODS",
    "POOLINGS",
    "PROTECTED_SCORE",
    "EvictionRecord",
    "KVCompressConfig",
    "MethodTraits",
    "TRAITS",
    "attention_logits",
    "causal_window_attention",
    "compress_indices",
    "gqa_reduce",
    "h2o_scores",
    "peak_slots",
    "pool1d",
    "reduce_heads",
    "rkv_importance",
    "rkv_redundancy",
    "rkv_scores",
    "row_capacity",
    "score_layer",
    "select_kept",
    "should_compress",
    "snapkv_scores",
    "streaming_scores",
    "visible_from_kept",
    "visible_positions",
]
