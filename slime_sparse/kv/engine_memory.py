"""What the embedded engine holds on its device during a rollout, byte by byte: the one count that both its admission
(`EmbeddedEngine.max_rows` under --rollout-kv-cache-gib) and the planner (step_memory.py, tools/plan_memory.py) use.

    engine_bytes = rows x row_bytes                      the cache and decode state of every row (`row_bytes`)
                 + working sets                          the largest of what one phase allocates on top:
                     a decode step      (`decode_step_bytes`)  hidden states, the LM head's logits, the sampler
                     a prefill forward  (`prefill_bytes`)      activations of every admitted row's prompt chunk
                     a compaction       (`compaction_bytes`)   chunks bounded by COMPACTION_WORKSPACE_BYTES

Eagerly the phases take turns in one allocator: their largest counts. Under CUDA graphs the decode steps and the
decode-time compactions live in the graphs' private pool, which eager work (prefill, the compactions of a prompt)
cannot use: the pool's peak and the eager peak add up.

Every term is a formula over tensor shapes, read from the code that allocates them (named beside each); the tests
measure the allocations of the real code (`utils.mem_audit.LiveBytes`, torch's allocator on CUDA) against them
(tests/test_engine_memory.py). Kernels' internal scratch that torch's CPU allocator does not report (a matmul's or
SDPA's own buffers) is not counted.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import KVCompressConfig
from .methods.base import ScoreShape
from .selection import shares_selection

# Temporaries one compaction call may hold at once beside its per-row results (the scores of every (layer, row) and
# the packed keep bits): the compressor scores and compacts in chunks that fit. ~11 % of the KV it compacts at batch
# 256 on Qwen2.5-1.5B with R-KV 512 + 128 in bf16 (4.7 GB), counted once by admission whatever the rows.
COMPACTION_WORKSPACE_BYTES = 512 << 20
INDEX = 8  # int64


@dataclass(frozen=True)
class EntryShape:
    """The per-(layer, row) facts of a cache the compaction's memory depends on."""

    heads: int  # KV heads
    q_heads: int
    head_dim: int
    dtype_bytes: int
    window: int  # the query ring's length (queries recorded per row and layer)
    tracks_mass: bool

    @classmethod
    def of_cache(cls, cache) -> "EntryShape":
        """From a `BudgetKVCache` (duck-typed: kv/ imports no engine)."""
        q_heads = cache.queries.shape[2] if cache.queries is not None else cache.num_kv_heads
        return cls(cache.num_kv_heads, q_heads, cache.key.shape[-1], cache.key.element_size(), cache.window,
                   cache.mass is not None)


def score_chunk_bytes(kv: KVCompressConfig, shape: EntryShape, entries: int, n: int, m: int, device: str) -> int:
    """Peak bytes of scoring `entries` (layer, row) entries holding n slots with m queries (`Compressor._scores`):
    their gathered keys (and queries, mass), then the largest of the queries' gather from the ring and the method's
    own peak (its scores included)."""
    h, d, b = shape.heads, shape.head_dim, shape.dtype_bytes
    uses_queries = kv.traits.needs_queries or (kv.traits.tracks_mass and not shape.tracks_mass)
    keys = entries * h * n * d * b
    queries = entries * shape.q_heads * m * d * b if uses_queries else 0
    ring = entries * (shape.q_heads * shape.window * d * b + INDEX * m) if uses_queries else 0
    mass = 4 * entries * h * n if shape.tracks_mass else 0
    score = kv.scorer.score_bytes(ScoreShape(entries, h, shape.q_heads, d, n, m, b, device))
    return keys + queries + mass + max(score, ring)


def select_row_bytes(kv: KVCompressConfig, shape: EntryShape, layers: int, n: int, budget: int) -> int:
    """Peak bytes per row of choosing and moving the kept slots (`Compressor._select_and_compact`): the selection's
    ranking keys and top-k, then the kept slots beside the flat source and destination indices and the moved copy of
    the largest cache tensor, then the keep bits."""
    shared_heads, shared_layers = shares_selection(kv)
    h = shape.heads
    sets = (1 if shared_layers else layers) * (1 if shared_heads else h)  # score rows selected independently
    width = min(n, budget)
    middle = max(n - kv.sinks - kv.protected_window, 0)
    best = max(budget - kv.sinks - kv.protected_window, 0)
    if n <= budget:
        choose = INDEX * sets * n
    else:  # the heads' mean score (then the layers'), ranking keys and their top-k, the kept slots sorted
        reduced = 4 * layers * n if shared_heads else 0
        choose = reduced + sets * max(28 * middle, INDEX * (middle + 2 * best), INDEX * (budget + 2 * width))
    kept = INDEX * sets * width
    moved = layers * h * width
    compact = kept + INDEX * layers * h + 2 * INDEX * moved + moved * shape.head_dim * shape.dtype_bytes
    bits = kept + 2 * sets * n
    return max(choose, compact, bits)


def compaction_chunks(kv: KVCompressConfig, shape: EntryShape, layers: int, rows: int, n: int, m: int, budget: int,
                      workspace: int, device: str) -> tuple[int, int]:
    """(entries scored at once, rows selected and compacted at once) of one compaction of `rows` rows x `layers`
    layers holding n slots, keeping at most `budget`: as many as fit `workspace`, at least one."""
    entries = layers * rows
    lo, hi = 1, entries  # the largest chunk within the workspace: score_chunk_bytes grows with the entries
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if score_chunk_bytes(kv, shape, mid, n, m, device) <= workspace:
            lo = mid
        else:
            hi = mid - 1
    per_row = select_row_bytes(kv, shape, layers, n, budget)
    return lo, max(1, min(rows, workspace // per_row))


def compaction_bytes(kv: KVCompressConfig, shape: EntryShape, layers: int, rows: int, n: int, m: int, budget: int,
                     workspace: int = COMPACTION_WORKSPACE_BYTES, device: str = "cuda") -> int:
    """Peak bytes of one compaction of `rows` rows x `layers` layers holding n slots each (the first decode-time
    compaction of a full wave, the largest), with `compaction_chunks`' chunks: the scores of every entry and the
    packed keep bits (per row), beside the largest chunk of either phase."""
    per_chunk, rows_per_chunk = compaction_chunks(kv, shape, layers, rows, n, m, budget, workspace, device)
    entries = layers * rows
    scores = 4 * entries * shape.heads * n
    pairs = 2 * INDEX * entries  # the (layer, row) of every entry
    shared_heads, shared_layers = shares_selection(kv)
    nbits = (1 if shared_layers else layers) * (1 if shared_heads else shape.heads) * n
    packed = rows * -(-nbits // 8) if rows_per_chunk < rows else 0
    scoring = pairs + (scores if per_chunk < entries else 0) + score_chunk_bytes(kv, shape, per_chunk, n, m, device)
    selecting = scores + packed + rows_per_chunk * select_row_bytes(kv, shape, layers, n, budget)
    return max(scoring, selecting)
