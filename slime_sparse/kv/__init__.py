"""KV-cache compression shared by every engine: the methods, the choice of kept slots, and when.

Pure torch, no engine imports. The methods are classes in `methods/` (one module each, registered by name: its
knobs, its scores, what it needs from the engine); `ops.py` holds the tensor operations they share. An engine asks
`schedule.should_compress` after each step and, when it says so, scores its layers x rows in one batched call
(`KVCompressConfig.scorer.score`) and keeps `choose_slots`'s slots, B_l of them in layer l (`budgets.layer_budgets`:
uniform, PyramidKV's pyramid, or an explicit list); `compress_indices` is the same per layer of one sequence. Knob
values come from a named reference (`presets.py`, `--kv-preset`). What a compression kept is recorded as keep bits
(`record.py`, built on the device by `keep_bits`), from which a learner rebuilds the sampler's attention mask.
"""
from .budgets import budget_range, layer_budgets, pyramid
from .config import GRANULARITIES, METHODS, SCHEDULES, TRAITS, KVCompressConfig
from .methods import H2O, REGISTRY, RKV, KeyDiff, KVMethod, PyramidKV, SnapKV, StreamingLLM, register, rkv_redundancy
from .ops import (GQA_REDUCTIONS, POOLINGS, PROTECTED_SCORE, attention_logits, causal_window_attention, gqa_reduce,
                  pool1d)
from .presets import PRESETS, KVPreset
from .record import EvictionRecord, visible_from_kept, visible_positions
from .schedule import peak_slots, row_capacity, should_compress, slots_after_compression, trigger
from .scoring import score_layer
from .selection import choose_slots, compress_indices, reduce_heads, select_kept, shares_selection

__all__ = [
    "GQA_REDUCTIONS", "GRANULARITIES", "H2O", "KVCompressConfig", "KVMethod", "KVPreset", "KeyDiff", "METHODS",
    "POOLINGS", "PRESETS", "PROTECTED_SCORE", "PyramidKV", "REGISTRY", "RKV", "SCHEDULES", "SnapKV", "StreamingLLM",
    "TRAITS", "EvictionRecord", "attention_logits", "budget_range", "causal_window_attention", "choose_slots",
    "compress_indices", "gqa_reduce", "layer_budgets", "peak_slots", "pool1d", "pyramid", "reduce_heads", "register",
    "rkv_redundancy", "row_capacity", "score_layer", "select_kept", "shares_selection", "should_compress",
    "slots_after_compression", "trigger", "visible_from_kept", "visible_positions",
]
