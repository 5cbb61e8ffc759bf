"""When a sequence's cache compresses, and how many slots that leaves it needing: the budget rule of every engine.

Selection (scoring.py, selection.py) decides *what* a compression keeps; this module decides *when* it runs and
what that bounds, over plain ints (kvpress's DecodingPress keeps the two apart the same way). The embedded engine,
the SGLang plugin (its compaction trigger and its admission control) and the memory planner all follow it.

The rule, R-KV's schedule applied to every method: a cache compresses once it holds B + buffer slots, back to B,
so between compressions it cycles in [B, B + buffer]. A method that `compresses_after_prefill` (SnapKV and
PyramidKV, their original use) also cuts a prompt longer than B as soon as the prompt is prefilled.
Compression off: nothing is ever dropped, the cache holds the whole sequence.

Per-layer budgets (budgets.py): all layers of a row compress together, layer l back to B_l, when the row's
fullest layer holds max_l B_l + buffer slots. Every layer holds the same tokens until the first compression, and
each gains one slot per token afterwards, so after the first compression they compress every `buffer` tokens,
each layer cycling in [B_l, B_l + buffer], and one start per compression describes them all (record.py).
`cache_len` below is therefore the fullest layer's slot count, i.e. a row of a [rows, layers, heads, slots]
cache; the prompt cut after prefill happens when the prompt exceeds the smallest budget (layers whose budget
holds the whole prompt keep it). With one budget all of this is the uniform rule above.
"""
from __future__ import annotations

from .budgets import budget_range
from .config import KVCompressConfig


def trigger(cfg: KVCompressConfig) -> int:
    """Slots of the fullest layer at which a compression runs: the largest layer budget + buffer."""
    return budget_range(cfg)[1] + cfg.buffer


def should_compress(cache_len: int, cfg: KVCompressConfig, first_decode: bool = False) -> bool:
    """Compress a cache whose fullest layer holds `cache_len` slots now? Asked once a step has written its tokens,
    before the next one.

    first_decode: the next step is the sequence's first decode step (its prompt has just been prefilled).
    """
    if not cfg.enabled:
        return False
    if cache_len >= trigger(cfg):
        return True
    return cfg.traits.compresses_after_prefill and first_decode and cache_len > budget_range(cfg)[0]


def never_compresses(cfg: KVCompressConfig, longest_prompt: int, max_new_tokens: int) -> bool:
    """No sequence of at most `longest_prompt` + `max_new_tokens` tokens ever reaches a compression: the budget is
    so large that a run with compression on is dense under another name."""
    if not cfg.enabled:
        return False
    if cfg.traits.compresses_after_prefill and longest_prompt > budget_range(cfg)[0]:
        return False
    return trigger(cfg) >= longest_prompt + max_new_tokens


def row_capacity(cfg: KVCompressConfig, longest: int) -> int:
    """Slots a cache row (per layer) needs for sequences of at most `longest` tokens, when it compresses before
    overflowing (during a chunked prefill too): the largest layer budget + buffer, or the whole sequence when that
    is shorter or compression off."""
    return min(trigger(cfg), longest) if cfg.enabled else longest


def slots_after_compression(cache_len: int, cfg: KVCompressConfig) -> int:
    """The fullest layer's slots right after a compression of a cache whose fullest layer held `cache_len`: each
    layer keeps min(its slots, its budget)."""
    return min(cache_len, budget_range(cfg)[1])


def peak_slots(cache_len: int, writes: int, cfg: KVCompressConfig, first_decode: bool = False) -> int:
    """Most slots the fullest layer of a cache of `cache_len` slots reaches over `writes` more steps of one slot
    each, the trigger asked before every write (a decode loop: compress if due, then write the newest token).

    first_decode: as in `should_compress`, for the first of those steps. If that step compresses, the cache
    restarts from `slots_after_compression`; either way it then grows by one slot a step until it reaches the
    trigger, where the next step compresses back to the largest budget.
    """
    if cache_len < 0 or writes < 0:
        raise ValueError(f"cache_len={cache_len} and writes={writes} must be >= 0")
    if not cfg.enabled or writes == 0:
        return cache_len + writes
    start = slots_after_compression(cache_len, cfg) if should_compress(cache_len, cfg, first_decode) else cache_len
    return max(cache_len, min(start + writes, trigger(cfg)))
