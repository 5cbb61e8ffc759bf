"""When a sequence's cache compresses, and how many slots that leaves it needing: the budget rule of every engine.

Selection (scoring.py, selection.py) decides *what* a compression keeps; this module decides *when* it runs and
what that bounds, over plain ints (kvpress's DecodingPress keeps the two apart the same way). The embedded engine,
the SGLang plugin (its compaction trigger and its admission control) and the memory planner all follow it.

The rule, R-KV's schedule applied to every method: a cache compresses once it holds B + buffer slots, back to B,
so between compressions it cycles in [B, B + buffer]. A method that `compresses_after_prefill` (SnapKV and
PyramidKV, their original use) also cuts a prompt longer than B as soon as the prompt is prefilled.
Compression off: nothing is ever dropped, the cache holds the whole sequence.

Per-layer budgets B_l (budgets.py): all layers of a row compress together, each layer l keeping min(its slots,
B_l), when the row's *emptiest* layer holds min_l B_l + buffer slots (the layer of the smallest budget; every layer
holds the same tokens until the first compression, and each gains one slot per token). So compressions come every
`buffer` tokens from the moment the smallest budget is full, one start per compression describes every layer
(record.py), and layer l never holds more than B_l + buffer slots: a paged engine with per-layer pages holds
sum_l (B_l + buffer) at most, the uniform budget's memory under a pyramid of the same mean. A layer whose budget
exceeds what it holds keeps everything at a compression (the first ones, under a steep pyramid). Triggering on the
fullest layer instead would let every layer grow to max_l B_l + buffer before the first cut: up to twice the
uniform peak under PyramidKV. With one budget all of this is the uniform rule above.
"""
from __future__ import annotations

from .budgets import budget_range
from .config import KVCompressConfig


def trigger(cfg: KVCompressConfig) -> int:
    """Slots of the emptiest layer (the smallest budget's) at which a compression runs: min_l B_l + buffer."""
    return budget_range(cfg)[0] + cfg.buffer


def should_compress(cache_len: int, cfg: KVCompressConfig, first_decode: bool = False) -> bool:
    """Compress a cache whose emptiest layer holds `cache_len` slots now? Asked once a step has written its tokens,
    before the next one. (One budget: every layer holds the same; before the first compression too.)

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
    """Slots a cache row needs in its largest layer for sequences of at most `longest` tokens, when it compresses
    before overflowing (during a chunked prefill too): max_l B_l + buffer, or the whole sequence when that is shorter
    or compression off. (Layer l needs only B_l + buffer: `peak_slots(..., budget=B_l)`.)"""
    return min(budget_range(cfg)[1] + cfg.buffer, longest) if cfg.enabled else longest


def slots_after_compression(cache_len: int, budget: int) -> int:
    """A layer of budget `budget` holding `cache_len` slots keeps min(cache_len, budget) of them."""
    return min(cache_len, budget)


def peak_slots(cache_len: int, writes: int, cfg: KVCompressConfig, first_decode: bool = False,
               budget: int | None = None) -> int:
    """Most slots one layer reaches over `writes` more steps of one slot each, the trigger asked before every write
    (a decode loop: compress if due, then write the newest token), from a state where every layer holds `cache_len`
    slots (one budget, or no compression yet). budget: that layer's B_l (default: the smallest, i.e. one budget).

    first_decode: as in `should_compress`, for the first of those steps. The first compression comes at step k0 (0
    if due now, else when the emptiest layer reaches the trigger); from then on one every `buffer` steps, the layer
    keeping min(its slots, B_l) each time, so its slots before compression j are min(P + j x buffer, B_l) after the
    growth of the cycle, P = its slots at the first one.
    """
    if cache_len < 0 or writes < 0:
        raise ValueError(f"cache_len={cache_len} and writes={writes} must be >= 0")
    if not cfg.enabled or writes == 0:
        return cache_len + writes
    budget = budget_range(cfg)[0] if budget is None else budget
    first = 0 if should_compress(cache_len, cfg, first_decode) else trigger(cfg) - cache_len
    if first >= writes:  # no compression within these writes
        return cache_len + writes
    before = cache_len + first  # slots at the first compression, the most held before it
    after = writes - first  # steps from the first compression on, each starting with a write
    cycle = (after - 1) // cfg.buffer  # the last compression reached is the cycle-th after the first
    last = min(before + cycle * cfg.buffer, budget) + after - cycle * cfg.buffer  # the last, maybe partial, cycle
    full = min(before + (cycle - 1) * cfg.buffer, budget) + cfg.buffer if cycle else 0  # the last full one
    return max(before, last, full)
