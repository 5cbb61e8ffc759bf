"""The budgeted KV cache of one SGLang scheduler process: its state and the work each hook does.

One scheduler process owns one ModelRunner (TP 1 is a precondition), so one SparseKVRuntime per process, built by
the ModelRunner.alloc_memory_pool hook. No module global holds it: it hangs on the process's ReqToTokenPool
(RUNTIME_ATTR), the pool the Scheduler, every ScheduleBatch and the ChunkCache share, and each RadixAttention layer
holds its own view of the query rings (RING_ATTR). A process without one (compression off, the tokenizer manager)
runs SGLang unchanged: `runtime_of` finds nothing and every hook passes through.

Per-request state lives on SGLang's Req (EVICTED_ATTR), so it follows the request through batch filtering and
merging. The objects touched are duck-typed (only the attributes listed in sglang_patches.contract are used), which
is what lets the tests drive this with SGLang's own pool classes or with layout-identical stand-ins.

A compaction (prepare_for_decode, before SGLang allocates the next slot) is one call per step for every due request:
the host decides from what it already knows (its lengths, SGLang's seq_lens_cpu), hands the device one table of
request rows, copied without waiting, and learns nothing back but the eviction records, copied to pinned memory
without waiting and encoded when SGLang streams them (evictions.PendingEntry).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from slime_sparse.kv import KVCompressConfig, should_compress

from .compaction import (
    Compaction,
    Compactor,
    append_kept_count,
    shift_positions,
    write_decode_queries,
    write_extend_queries,
)
from .evictions import EVICTIONS_INFO_KEY, RETRACTED, PendingEntry, append_at
from .settings import DENSE_REQUEST_PARAM

RUNTIME_ATTR = "slime_sparse_kv"  # ReqToTokenPool attribute: this process's SparseKVRuntime
RING_ATTR = "slime_sparse_queries"  # RadixAttention attribute: that layer's query ring [rows, window, Hq, d]
EVICTED_ATTR = "slime_sparse_evicted"  # Req attribute: tokens of this request evicted so far (logical - physical)
KEPT_INFO_KEY = "sparse_kv_kept"  # key in Req.customized_info -> meta_info: cache size per output token
# Device memory one compaction call may take (SGLang serves from what --mem-fraction-static leaves: 30 % of the GPU
# by our default). Scoring holds float32 copies of the keys, a query-group-wide broadcast of them in the attention
# logits, and the unit keys of R-KV: about layers x n x d x 4 bytes x (Hq + 2 Hkv) per request, ~330 MB for a 7B
# model at n = 640 (measured: `benchmarks/sglang_compaction_cost.py --device cuda`). More due requests than fit are
# compacted in several calls, in the same step.
COMPACTION_BYTES = 4 << 30


def runtime_of(req_to_token_pool: Any) -> SparseKVRuntime | None:
    return getattr(req_to_token_pool, RUNTIME_ATTR, None)


def evicted_count(req: Any) -> int:
    return getattr(req, EVICTED_ATTR, 0)


def wants_dense(req: Any) -> bool:
    """The request opted out of compression (settings.DENSE_REQUEST_PARAM in its sampling_params.custom_params)."""
    custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return isinstance(custom, dict) and bool(custom.get(DENSE_REQUEST_PARAM, False))


def bucket(count: int) -> int:
    """The padded size of a table of `count` due requests: the next power of two (few shapes: one CUDA graph each,
    should the compaction be captured; eagerly, padding costs at most as much work again)."""
    return 1 << (count - 1).bit_length()


class SparseKVRuntime:
    """The budgeted cache of one scheduler process. req_to_token_pool / kv_pool / allocator are SGLang's
    ReqToTokenPool, MHATokenToKVPool and TokenToKVPoolAllocator (page_size 1) of the process's ModelRunner."""

    def __init__(self, cfg: KVCompressConfig, req_to_token: Tensor, kv_pool: Any, allocator: Any,
                 rings: Tensor) -> None:
        # no reference back to the ReqToTokenPool that owns this object: no cycle, freed with it
        self.cfg, self.req_to_token, self.kv_pool, self.allocator = cfg, req_to_token, kv_pool, allocator
        self.rings = rings  # [layers, req_to_token rows, window, Hq, d]
        self.start_layer = getattr(kv_pool, "start_layer", 0) or 0
        keys = [kv_pool.get_key_buffer(layer) for layer in range(self.start_layer, self.start_layer + kv_pool.layer_num)]
        self.compactor = Compactor(cfg, req_to_token, keys, rings)
        self.device = req_to_token.device
        self.compaction_bytes = COMPACTION_BYTES

    @classmethod
    def allocate(cls, cfg: KVCompressConfig, req_to_token_pool: Any, kv_pool: Any, allocator: Any, num_q_heads: int,
                 dtype: torch.dtype, memory_region: Any = None) -> SparseKVRuntime:
        """Preallocate the query rings (one row per req_to_token row, the padding row included) and hang the runtime
        on req_to_token_pool, its owner.

        memory_region: a context manager (SGLang's memory-saver KV-cache region) so the rings are released and
        resumed with the KV cache when a colocated trainer takes the GPU; None = plain allocation. Nothing needs
        clearing afterwards, ever: a compaction reads only ring slots its request wrote since its (re)prefill.
        """
        req_to_token = req_to_token_pool.req_to_token
        shape = (kv_pool.layer_num, req_to_token.shape[0], cfg.window, num_q_heads, kv_pool.head_dim)
        with memory_region if memory_region is not None else contextlib.nullcontext():
            rings = torch.zeros(shape, dtype=dtype, device=req_to_token.device)
        runtime = cls(cfg, req_to_token, kv_pool, allocator, rings)
        setattr(req_to_token_pool, RUNTIME_ATTR, runtime)
        return runtime

    def attach(self, attention_layers: Iterable[Any] = ()) -> SparseKVRuntime:
        """Hang each layer's ring on the layer (RadixAttention modules, by `layer_id`)."""
        for layer in attention_layers:
            setattr(layer, RING_ATTR, self.rings[layer.layer_id - self.start_layer])
        return self

    # ---------------------------------------------------------------------------------------------------------
    # ScheduleBatch.prepare_for_decode: one compaction for every due request, before the next slot is allocated
    # ---------------------------------------------------------------------------------------------------------
    def compact_batch(self, batch: Any) -> int:
        """Compress every request of a decode batch whose cache reached its trigger (except those that asked to stay
        dense); return how many.

        Due requests hold the trigger's B + buffer slots (SnapKV's cut of a fresh prompt: its prompt length), so they
        form one group per length, one batched call each (one per step once decoding; more only past
        `compaction_bytes`). Each is scored (keys from the
        KV pool, queries from the rings), its kept slots moved to the front of its req_to_token row in place, the
        others freed through the allocator, and seq_lens / seq_lens_cpu / kv_committed_len / kv_allocated_len set to
        the budget; its evicted count grows by what it lost, and the compression is shipped (record).
        """
        groups = self.due(batch)
        for n, index in groups.items():
            rows = self.rows_per_call(n)
            for first in range(0, len(index), rows):
                self._compact(batch, index[first: first + rows], n)
        if groups:
            batch.seq_lens_sum = None  # ForwardBatch.init_new recomputes it from seq_lens_cpu
        return sum(len(index) for index in groups.values())

    def due(self, batch: Any) -> dict[int, list[int]]:
        """{slots held: batch indices} of the requests to compress now, from host state alone."""
        groups: dict[int, list[int]] = {}
        for i, (req, length) in enumerate(zip(batch.reqs, batch.seq_lens_cpu.tolist())):
            if wants_dense(req) or not should_compress(length, self.cfg, first_decode=len(req.output_ids) == 1):
                continue
            if req.kv_committed_len != length or req.kv_allocated_len != length:
                raise RuntimeError(
                    f"slime_sparse KV compaction: request {req.rid} has seq_len {length} but "
                    f"kv_committed_len={req.kv_committed_len}, kv_allocated_len={req.kv_allocated_len}; "
                    "this happens only under an unsupported scheduler mode (overlap, speculative decoding)"
                )
            groups.setdefault(length, []).append(i)
        return groups

    def rows_per_call(self, n: int) -> int:
        """Requests of n slots one call compacts within `compaction_bytes` (a power of two: a bucket)."""
        _, _, _, q_heads, head_dim = self.rings.shape
        per_request = self.kv_pool.layer_num * n * head_dim * 4 * (q_heads + 2 * self.kv_pool.head_num)
        return 1 << (max(1, self.compaction_bytes // per_request).bit_length() - 1)

    def _compact(self, batch: Any, index: list[int], n: int) -> None:
        reqs = [batch.reqs[i] for i in index]
        count = len(index)
        starts = [n + evicted_count(req) for req in reqs]  # each row holds n of its first `start` tokens
        table = [[req.req_pool_idx for req in reqs], starts, index]
        padded = [column + column[:1] * (bucket(count) - count) for column in table]  # repeats: identical writes
        out = self.compact_on_device(to_device(padded, self.device), n, batch.seq_lens)
        self.allocator.free(out.freed[:count].flatten())
        packed, ready = to_host(out.packed[:count])
        budget = self.cfg.budget
        for req, start, bits in zip(reqs, starts, packed):
            append_at(_eviction_history(req), len(req.output_ids), PendingEntry(start, n, bits, ready))
            req.kv_committed_len = req.kv_allocated_len = budget
            setattr(req, EVICTED_ATTR, start - budget)
        batch.seq_lens_cpu[index] = budget

    def compact_on_device(self, table: Tensor, n: int, seq_lens: Tensor) -> Compaction:
        """The device part, fixed shapes: table [3, R] = req_to_token rows, logical lengths, batch indices."""
        out = self.compactor(table[0], table[1], n)
        seq_lens.index_fill_(0, table[2], self.cfg.budget)
        return out

    def record_kept(self, batch: Any) -> None:
        """After SGLang's prepare_for_decode (seq_lens already +1): log the cache size the coming step reads.

        Goes to Req.customized_info, which SGLang streams back per output token as meta_info[KEPT_INFO_KEY].
        """
        for req, cache_len in zip(batch.reqs, batch.seq_lens_cpu.tolist()):
            info = req.customized_info if req.customized_info is not None else {}
            append_kept_count(info.setdefault(KEPT_INFO_KEY, []), len(req.origin_input_ids), len(req.output_ids),
                              int(cache_len))
            req.customized_info = info

    # ---------------------------------------------------------------------------------------------------------
    # ForwardBatch.init_new: logical positions; a retracted request's dense re-prefill
    # ---------------------------------------------------------------------------------------------------------
    def logical_decode_positions(self, positions: Tensor, reqs: list[Any]) -> Tensor:
        """Decode positions + each request's evicted count (unchanged tensor when nothing was evicted)."""
        evicted = [evicted_count(req) for req in reqs]
        if not any(evicted):
            return positions
        return shift_positions(positions, to_device(evicted, positions.device))

    @staticmethod
    def start_prefill(reqs: list[Any]) -> None:
        """An extend batch: a request that evicted tokens before is a retracted one, re-prefilled densely."""
        for req in reqs:
            if evicted_count(req):
                reset_request(req)


def capture_queries(ring: Tensor, q: Tensor, forward_batch: Any) -> None:
    """Store one attention layer's post-RoPE queries q [tokens, Hq * d] into its ring [rows, window, Hq, d]."""
    mode = forward_batch.forward_mode
    q = q.reshape(q.shape[0], ring.shape[2], ring.shape[3])
    if mode.is_decode():
        write_decode_queries(ring, forward_batch.req_pool_indices, forward_batch.positions, q)
    elif mode.is_extend():
        write_extend_queries(ring, forward_batch.req_pool_indices, forward_batch.positions, forward_batch.seq_lens,
                             forward_batch.extend_seq_lens, q)
    # IDLE (and anything else) carries no tokens of ours


def reset_request(req: Any) -> None:
    """A retracted request is re-prefilled densely from its tokens: it starts again with nothing evicted.

    If it had evicted something, its tokens from now on see a dense cache again, which no eviction record expresses:
    say so on the wire (the client then returns no record for it, and a shadow loss refuses the sample)."""
    if evicted_count(req) > 0:
        append_at(_eviction_history(req), len(req.output_ids), RETRACTED)
    setattr(req, EVICTED_ATTR, 0)


def _eviction_history(req: Any) -> list[Any]:
    if req.customized_info is None:
        req.customized_info = {}
    return req.customized_info.setdefault(EVICTIONS_INFO_KEY, [])


def to_device(values: list, device: torch.device) -> Tensor:
    """Ints (a list or a list of lists) as an int64 tensor on `device`, copied without waiting for the device
    (pinned memory on CUDA: a copy from pageable memory would first wait for every queued kernel)."""
    host = torch.tensor(values, dtype=torch.int64)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def to_host(t: Tensor) -> tuple[Tensor, Any]:
    """A host copy of `t` that does not wait for the device, and the event that marks it done (None off CUDA)."""
    if t.device.type != "cuda":
        return t, None
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return out, ready
