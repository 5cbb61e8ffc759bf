"""When a sequence's cache compresses, and how many slots that leaves it needing: the budget rule of every engine.

Selection (scoring.py, selection.py) decides *what* a compression keeps; this module decides *when* it runs and
what that bounds, over plain ints (kvpress's DecodingPress keeps the two apart the same way). The embedded engine,
the SGLang plugin (its compaction trigger and its admission control) and the memory planner all follow it.

The rule, R-KV's schedule applied to every method: a cache compresses once it holds B + buffer slots, back to B,
so between compressions it cycles in [B, B + buffer]. A method that `compresses_after_prefill` (SnapKV and
PyramidKV, their original use) also cuts a prompt longer than B as soon as the prompt is prefilled.
Compression off: nothing is ever dropped, the cache holds the whole sequence.

Per-layer budgets B_l (budgets.py): all layers of a row compress together, each layer l keeping min(its slots,
B_l), when the row's *fullest* layer holds max_l B_l + buffer slots. Every layer holds the same tokens until the
first compression and gains one slot per token, so after it they compress every `buffer` tokens (after a cut right
after prefill, once the fullest layer is back at the trigger), one start per compression describes every layer
(record.py), and a row needs max_l B_l + buffer slots in every layer: the embedded engine's [rows, layers, slots]
cache. Why the fullest layer and not the emptiest (min_l B_l + buffer, which would keep each layer within
B_l + buffer and so a pyramid at a uniform budget's peak memory in a paged engine): the embedded engine allocates
max_l B_l + buffer slots for every layer anyway, so no layer should evict before that memory is needed; only an
engine with per-layer pages would gain from the other rule (none runs per-layer budgets today: SGLang refuses them).
With one budget all of this is the uniform rule above.
"""
from __future__ import annotations

import numpy as np

from .budgets import budget_range
from .config import KVCompressConfig


def trigger(cfg: KVCompressConfig) -> int:
    """Slots of the fullest layer (the largest budget's) at which a compression runs: max_l B_l + buffer."""
    return budget_range(cfg)[1] + cfg.buffer


def should_compress(cache_len: int | np.ndarray, cfg: KVCompressConfig,
                    first_decode: bool = False) -> bool | np.ndarray:
    """Compress a cache whose fullest layer holds `cache_len` slots now? Asked once a step has written its tokens,
    before the next one. The one trigger rule: an array of lengths (an engine's rows) gets an array of answers.

    first_decode: the next step is the sequence's first decode step (its prompt has just been prefilled): a method
    that compresses after prefill cuts a prompt longer than the smallest budget.
    """
    length = np.asarray(cache_len)
    if not cfg.enabled:
        due = np.zeros(length.shape, dtype=bool)
    else:
        due = length >= trigger(cfg)
        if cfg.traits.compresses_after_prefill and first_decode:
            due |= length > budget_range(cfg)[0]
    return due if due.ndim else bool(due)


def never_compresses(cfg: KVCompressConfig, longest_prompt: int, max_new_tokens: int) -> bool:
    """No sequence of at most `longest_prompt` + `max_new_tokens` tokens ever reaches a compression: the budget is
    so large that a run with compression on is dense under another name."""
    if not cfg.enabled:
        return False
    if cfg.traits.compresses_after_prefill and longest_prompt > budget_range(cfg)[0]:
        return False
    return trigger(cfg) >= longest_prompt + max_new_tokens


def row_capacity(cfg: KVCompressConfig, longest: int) -> int:
    """Slots a cache row needs in every layer for sequences of at most `longest` tokens, when it compresses before
    overflowing (during a chunked prefill too): max_l B_l + buffer, or the whole sequence when that is shorter or
    compression off."""
    return min(trigger(cfg), longest) if cfg.enabled else longest


def slots_after_compression(cache_len: int, budget: int) -> int:
    """A layer of budget `budget` holding `cache_len` slots keeps min(cache_len, budget) of them."""
    return min(cache_len, budget)


def peak_slots(cache_len: int, writes: int, cfg: KVCompressConfig, first_decode: bool = False,
               budget: int | None = None) -> int:
    """Most slots one layer reaches over `writes` more steps of one slot each, the trigger asked before every write
    (a decode loop: compress if due, then write the newest token), from a state where every layer holds `cache_len`
    slots (no compression yet, or one budget). budget: that layer's B_l (default: the largest, the fullest layer).

    first_decode: as in `should_compress`, for the first of those steps. The first compression comes at step k0 (0
    if due now, else when the layers reach the trigger) with P slots in every layer; layer l keeps min(P, B_l), the
    fullest min(P, max B); the next compression comes when the fullest is back at the trigger, then every `buffer`
    steps, layer l keeping min(its slots, B_l) each time.
    """
    if cache_len < 0 or writes < 0:
        raise ValueError(f"cache_len={cache_len} and writes={writes} must be >= 0")
    if not cfg.enabled or writes == 0:
        return cache_len + writes
    largest = budget_range(cfg)[1]
    budget = largest if budget is None else budget
    first = 0 if should_compress(cache_len, cfg, first_decode) else trigger(cfg) - cache_len
    if first >= writes:  # no compression within these writes
        return cache_len + writes
    before = cache_len + first  # every layer's slots at the first compression, the most held before it
    left = writes - first  # steps from the first compression on, each starting with a write
    kept = min(before, budget)
    gap = trigger(cfg) - min(before, largest)  # steps to the second compression
    if left <= gap:
        return max(before, kept + left)
    peak = max(before, kept + gap)
    kept, left = min(kept + gap, budget), left - gap
    cycle = (left - 1) // cfg.buffer  # further compressions reached, every `buffer` steps
    last = min(kept + cycle * cfg.buffer, budget) + left - cycle * cfg.buffer  # the last, maybe partial, cycle
    full = min(kept + (cycle - 1) * cfg.buffer, budget) + cfg.buffer if cycle else 0  # the last full one
    return max(peak, last, full)
