"""What the embedded engine holds on its device during a rollout, byte by byte: the one count that both its admission
(`EmbeddedEngine.max_rows` under --rollout-kv-cache-gib) and the planner (planner/step_memory.py, tools/plan_memory.py)
use.

    engine_bytes = rows x row_bytes                      the cache and decode state of every row (`row_bytes`)
                 + working sets                          the largest of what one phase allocates on top:
                     a decode step      (`decode_step_bytes`)  hidden states, the LM head's logits, the sampler
                     a prefill forward  (`prefill_bytes`)      activations of every admitted row's prompt chunk
                     a compaction       (`compaction_bytes`)   chunks bounded by COMPACTION_WORKSPACE_BYTES

Eagerly the phases take turns in one allocator: their largest counts. Under CUDA graphs three sets of cached blocks
add up, since torch's caching allocator never lends one's to another: the graphs' private pool (decode steps and
decode-time compactions), the eager run of each key before its capture (on a side stream: blocks are cached per
stream), and the eager work of the default stream (prefill, a prompt's compactions). This holds while the captures'
warm-ups share one side stream; step.py's `CapturedGraphs` takes a new one per capture, which PyTorch hands out from a
pool of 32, so the warm-ups' cached blocks can exceed one working set (to be fixed there).

Every term is a formula over tensor shapes, read from the code that allocates them (named beside each); the tests
measure the allocations of the real code (`utils.mem_audit.LiveBytes`, torch's allocator on CUDA) against them
(tests/rollout/embedded/test_engine_memory.py). Kernels' internal scratch that torch's CPU allocator does not report (a matmul's or
SDPA's own buffers) is not counted.
"""
from __future__ import annotations

from dataclasses import dataclass

from slime_sparse.utils.model_shape import ModelShape

from .config import KVCompressConfig
from .methods.base import ScoreShape
from .schedule import row_capacity, trigger
from .selection import shares_selection

# Temporaries one compaction call may hold at once beside its per-row results (the scores of every (layer, row) and
# the packed keep bits): the compressor scores and compacts in chunks that fit, counted once by admission whatever
# the rows. 17 % of the KV it compacts at batch 256 on Qwen2.5-1.5B with R-KV 512 + 128 in bf16 (4.4 GiB; 0.8 GiB in
# all with the per-row results). Larger chunks mean fewer kernel launches (~15 chunks of ~35 ops there); under CUDA
# graphs the decode step's sampler needs more than this from 160 rows on, so the workspace then costs nothing extra.
COMPACTION_WORKSPACE_BYTES = 768 << 20
INDEX = 8  # int64
KV_PART = "KV cache and row state"  # engine_bytes' part that lives as long as the engine (the rest is working sets)


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
        ranked = max(28 * middle, INDEX * (middle + 2 * best), INDEX * (budget + 2 * width))
        if kv.schedule == "uniform" or shared_layers:
            choose = reduced + sets * ranked
        else:  # per-layer budgets: a layer at a time, each layer's kept slots padded, then stacked
            choose = reduced + sets // layers * ranked + 2 * INDEX * sets * width
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
                     workspace: int, device: str = "cuda") -> int:
    """Peak bytes of a compaction of `rows` rows x `layers` layers holding up to n slots each (the first decode-time
    compaction of a full wave holds the most): the scores of every entry and the packed keep bits (per row) beside
    either the whole call's temporaries, when they fit `workspace`, or the workspace (chunks fill it, and a
    compaction of fewer slots fits more entries in a chunk)."""
    per_chunk, rows_per_chunk = compaction_chunks(kv, shape, layers, rows, n, m, budget, workspace, device)
    entries = layers * rows
    scores = 4 * entries * shape.heads * n
    pairs = 2 * INDEX * entries  # the (layer, row) of every entry
    if per_chunk == entries and rows_per_chunk == rows:
        return max(pairs + score_chunk_bytes(kv, shape, entries, n, m, device),
                   scores + rows * select_row_bytes(kv, shape, layers, n, budget))
    shared_heads, shared_layers = shares_selection(kv)
    nbits = (1 if shared_layers else layers) * (1 if shared_heads else shape.heads) * n
    return pairs + scores + rows * -(-nbits // 8) + workspace


# ---------------------------------------------------------------------------------------------------------------
# The engine: rows, working sets, and what fits
# ---------------------------------------------------------------------------------------------------------------
# Prompt tokens (rows x the widest chunk, padding included) one prefill forward takes at most: the scheduler prefills
# the admitted prompts in groups of rows that fit (SGLang's --chunked-prefill-size), so a prefill's activations are a
# constant, not a multiple of the rows.
# Captured or compiled steps read each layer's slots in multiples of this (the largest fill rounded up): a dense
# cache grows by one slot a step, and a shape of its own per step would mean a graph per step.
SPAN_GRANULARITY = 256


def runner_capacity(kv: KVCompressConfig, longest: int, graphs: bool, max_positions: int | None = None) -> int:
    """Slots per row the engine allocates for sequences of `longest` tokens: `row_capacity`, and with graphs (or a
    compiled step) a row that never compresses rounded up to the span granularity, so that calls of similar lengths
    share one runner (at most the model's positions)."""
    capacity = row_capacity(kv, longest)
    if graphs and (not kv.enabled or capacity < trigger(kv)):
        capacity = -(-capacity // SPAN_GRANULARITY) * SPAN_GRANULARITY
        capacity = capacity if max_positions is None else min(capacity, max_positions)
    return capacity


PREFILL_TOKENS = 8192
FIRST_TOKEN_ROWS = 64  # rows whose first tokens are sampled at once from their prompts' logits


@dataclass(frozen=True)
class Sampler:
    """What the sampler's temporaries depend on (rollout.sampling.SamplingParams, read duck-typed)."""

    greedy: bool = False
    top_k: bool = False
    top_p: bool = False
    scaled: bool = False  # T not 1: a tempered copy of the logits (x / 1 is x: none at T = 1)
    fused: bool = False  # the one-kernel Gumbel sampler (rollout.sampling_kernel, CUDA): no noise tensors

    @classmethod
    def of(cls, params, fused: bool = False) -> "Sampler":
        greedy = params.temperature == 0.0
        return cls(greedy, not greedy and 0 < params.top_k, not greedy and params.top_p < 1.0,
                   not greedy and params.temperature != 1.0, fused)

    def bytes_per_logit(self, *, owns_logits: bool) -> int:
        """Peak bytes per logit of `sampling.sample_tokens` over fp32 logits [n, V]: beside them while the caller holds
        them (a prefill's first tokens), or with them when the caller hands them over (the decode step: the torch path
        drops them once it has its tempered copy; the kernel reads them to the end).
        Greedy: the log-softmax. The torch path: the log-softmax and the noise's int64 state with one shifted copy
        (`gumbel_noise`, in place), or under top-p the noise (fp32) beside `apply_top_p`'s sort (values, int64
        indices), probabilities, cumulative mass, drop masks and output (top-k's output first: 4 more). The kernel:
        only truncation's temporaries (top-k alone: a mask and the output)."""
        if self.greedy:
            return 4 + (4 if owns_logits else 0)
        copy = 4 if self.scaled else 0
        if self.fused:
            truncation = 26 + (4 if self.top_k else 0) if self.top_p else (5 if self.top_k else 0)
            return (4 if owns_logits else 0) + (copy + truncation if truncation else 0)
        peak = max(20, 34 + (4 if self.top_k else 0) if self.top_p else 13)
        return 4 + peak if owns_logits else copy + peak

    def bytes_per_vocab_id(self) -> int:
        """Bytes per vocabulary entry that do not scale with the rows: the torch path's int64 vocabulary ids."""
        return 0 if self.greedy or self.fused else INDEX


def row_bytes(shape: ModelShape, kv: KVCompressConfig, capacity: int, dtype_bytes: int, readback: int = 1) -> int:
    """Device bytes one engine row holds for its whole life: its cache row (keys, values, positions; the query ring of
    methods that score with queries, the attention mass of H2O; fills) and its decode state (cache.py, step.py)."""
    slots = shape.num_kv_heads * capacity
    per_layer = slots * (2 * shape.head_dim * dtype_bytes + 4 + (4 if kv.traits.tracks_mass else 0)) + INDEX
    if kv.traits.needs_queries:
        per_layer += shape.num_heads * kv.window * shape.head_dim * dtype_bytes
    state = 4 * INDEX + readback * (INDEX + 4)  # token, position, key, counter; the readback window
    return shape.num_layers * per_layer + 3 * INDEX + state  # + seen, the row's index, the compactor's row slot


# Split-KV decode attention (rollout/embedded/triton_attention.py): a split per about this many slots, at most this
# many; each writes an fp32 partial output and log-sum-exp per (row, query head) that admission counts.
DECODE_SPLIT_SLOTS = 256
DECODE_MAX_SPLITS = 16
DECODE_ATTENTION = ("sdpa", "triton")


def decode_splits(span: int) -> int:
    """Splits of a span in the Triton decode attention (its `num_splits`)."""
    return max(1, min(DECODE_MAX_SPLITS, -(-span // DECODE_SPLIT_SLOTS)))


def decode_attention_bytes(shape: ModelShape, kv: KVCompressConfig, span: int, dtype_bytes: int,
                           backend: str) -> int:
    """Bytes per row one layer's attention of a decode step allocates, its output included (attention.py): SDPA's
    output; the Triton kernel's fp32 partial outputs and log-sum-exps per split beside it; H2O's explicit fp32
    attention (keys, values and the query upcast, two score-sized tensors at a time, the fp32 output)."""
    d, q, b = shape.head_dim, shape.num_heads, dtype_bytes
    if kv.traits.tracks_mass:
        upcast = 4 * shape.num_kv_heads * span * d + 4 * q * d if b != 4 else 0
        return upcast + 8 * q * span + 4 * q * d
    if backend == "triton":
        return q * decode_splits(span) * (4 * d + 4) + q * d * b
    return q * d * b


def masks_bytes(shape: ModelShape, kv: KVCompressConfig, rows: int, width: int, span: int) -> int:
    """The attention masks a forward keeps (cache.py `attention_mask`): one per step, shared by the layers under one
    budget; one per layer under per-layer budgets."""
    return rows * width * span * (1 if kv.schedule == "uniform" else shape.num_layers)


def body_bytes(shape: ModelShape, kv: KVCompressConfig, rows: int, width: int, span: int, dtype_bytes: int,
               backend: str = "sdpa") -> int:
    """Peak bytes of HF's model body's forward (Qwen2 / Llama decoder layers of transformers: prefill, and decode
    steps without our body) over `rows` rows of `width` tokens reading `span` slots: per token RoPE's cos and sin
    (and their fp32 sources), the step's plan and the embeddings (the body keeps them to the end), beside a layer's
    peak: its input, the residual after attention and the normed input beside the MLP's activation, up projection and
    product, the RMSNorm's fp32 temporaries, or the attention (`attention_bytes`)."""
    h, b, d = shape.hidden_size, dtype_bytes, shape.head_dim
    tokens = rows * width
    stream = h * b + 2 * d * b + (16 * d + 3 * INDEX if width > 1 else 0)  # a decode step: no plan, fp32 sources gone
    layer = max(3 * h * b + 3 * shape.intermediate_size * b, 2 * h * b + 8 * h)
    return tokens * stream + masks_bytes(shape, kv, rows, width, span) \
        + max(tokens * layer, attention_bytes(shape, kv, rows, width, span, dtype_bytes, backend))


def attention_bytes(shape: ModelShape, kv: KVCompressConfig, rows: int, width: int, span: int, dtype_bytes: int,
                    backend: str = "sdpa") -> int:
    """Peak bytes of one layer's attention in HF's body over `rows` rows of `width` new tokens reading `span` slots,
    beside the stream (attention.py): the normed input, q, k and v after RoPE with RoPE's temporaries, then H2O's
    explicit fp32 attention (half keys and values upcast, two score-sized fp32 tensors at a time, three in a prefill),
    a prefill's keys and values repeated to every query head for SDPA and its output made contiguous; a decode step
    reads them in place (`decode_attention_bytes`). The masks, alive all the forward, are `body_bytes`'."""
    d, q, b = shape.head_dim, shape.num_heads, dtype_bytes
    tokens = rows * width
    qkv = tokens * (shape.hidden_size * b + (q + 2 * shape.num_kv_heads) * d * b)
    rope = qkv + tokens * 2 * q * d * b
    if width == 1:
        return max(rope, qkv + rows * decode_attention_bytes(shape, kv, span, b, backend))
    if kv.traits.tracks_mass:
        upcast = (4 * shape.num_kv_heads * span * d if b != 4 else 0) + (4 * q * width * d if b != 4 else 0)
        return max(rope, qkv + rows * (upcast + 10 * q * width * span))  # weighs the probabilities too
    return max(rope, qkv + rows * (2 * q * span * d * b + 2 * q * width * d * b))


def decode_body_bytes(shape: ModelShape, kv: KVCompressConfig, rows: int, span: int, dtype_bytes: int,
                      backend: str = "sdpa") -> int:
    """Peak bytes of our decode body's forward (rollout/embedded/decode_body.py) over `rows` rows reading `span` slots:
    per row the RoPE table's rows and the residual stream, beside the largest of a layer's phases, each half's
    temporaries dying with its call: the attention half (the normed input, then the fused qkv beside RoPE's product
    and rolled copy, the attention's own allocations, o_proj's output, the new residual), the MLP half (the fused
    gate/up beside the normed input, then the activation times up in place beside it, then the down projection),
    and the RMSNorm (one op in fp32, two outputs in a reduced dtype). The masks are counted too."""
    h, d, b, inter = shape.hidden_size, shape.head_dim, dtype_bytes, shape.intermediate_size
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d * b
    qk = (shape.num_heads + shape.num_kv_heads) * d * b
    attend = decode_attention_bytes(shape, kv, span, b, backend)
    out = shape.num_heads * d * b
    attention = max(h * b + qkv, qkv + 2 * qk, qkv + qk + attend, out + h * b, 2 * h * b)
    mlp = max(h * b + 2 * inter * b, 3 * inter * b, inter * b + h * b, 2 * h * b)
    norm = h * b * (1 if b == 4 else 2)
    stream = 2 * d * b + h * b
    return masks_bytes(shape, kv, rows, 1, span) + rows * (stream + max(attention, mlp, norm))


def head_bytes(shape: ModelShape, rows: int, dtype_bytes: int, fp32_head: bool) -> int:
    """The LM head over `rows` final hidden states (utils.lm_head): its output in the model's dtype and the fp32
    logits, or under --enable-fp32-lm-head the head weight and hidden states cast to fp32."""
    v = shape.vocab_size
    if fp32_head:
        return 4 * v * shape.hidden_size + rows * (4 * v + 4 * shape.hidden_size) if dtype_bytes != 4 else rows * 4 * v
    return rows * v * (dtype_bytes + 4 if dtype_bytes != 4 else 4)


def sampler_bytes(shape: ModelShape, rows: int, sampler: Sampler, *, owns_logits: bool) -> int:
    """`Sampler.bytes_per_logit` over `rows` rows of the vocabulary, with the vocabulary's own temporaries."""
    v = shape.vocab_size
    return rows * v * sampler.bytes_per_logit(owns_logits=owns_logits) + v * sampler.bytes_per_vocab_id()


def decode_step_bytes(shape: ModelShape, kv: KVCompressConfig, rows: int, span: int, dtype_bytes: int,
                      sampler: Sampler, fp32_head: bool = False, decode_body: bool = True,
                      attention: str = "sdpa") -> int:
    """Peak bytes one decode step allocates over `rows` rows reading `span` slots (step.py): the body's forward
    (ours, `decode_body_bytes`, or HF's, `body_bytes`), the LM head, or the fp32 logits handed to the sampler."""
    if decode_body:
        body = decode_body_bytes(shape, kv, rows, span, dtype_bytes, attention)
    else:
        body = body_bytes(shape, kv, rows, 1, span, dtype_bytes, attention)
    logits = sampler_bytes(shape, rows, sampler, owns_logits=True)
    return rows * shape.hidden_size * dtype_bytes + max(body, head_bytes(shape, rows, dtype_bytes, fp32_head), logits)


def prefill_bytes(shape: ModelShape, kv: KVCompressConfig, rows: int, prompt: int, capacity: int, dtype_bytes: int,
                  sampler: Sampler, fp32_head: bool = False) -> int:
    """Peak bytes of admitting `rows` rows with prompts of up to `prompt` tokens (scheduler.py `_admit`): a prefill
    forward of at most PREFILL_TOKENS tokens (whole rows of the widest chunk, the row capacity at most), or its logits
    beside the first tokens of FIRST_TOKEN_ROWS rows sampled from them (their logits gathered, the sampler)."""
    width = min(prompt, capacity)
    per_forward = max(1, min(rows, PREFILL_TOKENS // width))
    body = body_bytes(shape, kv, per_forward, width, width, dtype_bytes)
    first_rows = min(rows, FIRST_TOKEN_ROWS)
    first = shape.vocab_size * 4 * (per_forward + first_rows) + sampler_bytes(shape, first_rows, sampler,
                                                                              owns_logits=False)
    return max(body, head_bytes(shape, per_forward, dtype_bytes, fp32_head), first)


@dataclass(frozen=True)
class EngineSpec:
    """What the embedded engine's memory depends on, beside its rows: the model, the KV config, a call's lengths, how
    it samples and steps."""

    shape: ModelShape
    kv: KVCompressConfig
    capacity: int  # slots per row (schedule.row_capacity)
    prompt: int  # the longest prompt of a call
    dtype_bytes: int
    sampler: Sampler = Sampler()
    fp32_head: bool = False
    graphs: bool = False  # decode steps (and their compactions) captured as CUDA graphs: a pool of their own
    readback: int = 1
    device: str = "cuda"
    workspace: int | None = None  # the compaction's (None: COMPACTION_WORKSPACE_BYTES)
    decode_body: bool = True  # decode steps through our body (decode_body.py), else HF's modules
    decode_attention: str = "sdpa"  # one of DECODE_ATTENTION

    def __post_init__(self) -> None:
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention={self.decode_attention!r}: choose one of {DECODE_ATTENTION}")


def engine_bytes(spec: EngineSpec, rows: int) -> dict[str, int]:
    """{part: bytes} the engine holds at its peak with `rows` rows: the rows themselves, then its working sets (see
    the module docstring); the sum is what --rollout-kv-cache-gib must hold."""
    s, kv = spec.shape, spec.kv
    parts = {KV_PART: rows * row_bytes(s, kv, spec.capacity, spec.dtype_bytes, spec.readback)
             + INDEX * spec.capacity + 5 * INDEX * s.num_layers}
    decode = decode_step_bytes(s, kv, rows, spec.capacity, spec.dtype_bytes, spec.sampler, spec.fp32_head,
                               spec.decode_body, spec.decode_attention)
    prefill = prefill_bytes(s, kv, rows, spec.prompt, spec.capacity, spec.dtype_bytes, spec.sampler, spec.fp32_head)
    compaction = 0
    if kv.enabled and spec.capacity >= kv.budget + kv.buffer:  # rows reach the trigger: they compact
        entry = EntryShape(s.num_kv_heads, s.num_heads, s.head_dim, spec.dtype_bytes, kv.window, kv.traits.tracks_mass)
        workspace = spec.workspace if spec.workspace is not None else COMPACTION_WORKSPACE_BYTES
        compaction = compaction_bytes(kv, entry, s.num_layers, rows, spec.capacity, kv.window,
                                      spec.capacity - kv.buffer, workspace, spec.device)
    if spec.graphs:  # three caches of blocks that never serve one another (see the module docstring)
        parts["decode graphs' pool"] = max(decode, compaction)
        parts["graph warm-ups (side stream)"] = max(decode, compaction)
        parts["prefill (eager)"] = max(prefill, compaction)
    else:
        parts["working set (largest phase)"] = max(decode, prefill, compaction)
    return parts


def max_rows(spec: EngineSpec, budget_bytes: int, cap: int | None = None) -> int:
    """The most rows whose `engine_bytes` fit `budget_bytes` (at most `cap`); 0 when not even one does."""
    lo, hi = 0, cap if cap is not None else 1
    if cap is None:  # the bytes grow with the rows: find an upper bound, then bisect
        while sum(engine_bytes(spec, hi).values()) <= budget_bytes:
            lo, hi = hi, 2 * hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(engine_bytes(spec, mid).values()) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo
