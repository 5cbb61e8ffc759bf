"""Per-process state of the budgeted KV cache inside one SGLang scheduler process, and the work each hook does.

One scheduler process owns one ModelRunner (TP 1 is a precondition), so one SparseKVRuntime per process: built by
the ModelRunner.alloc_memory_pool hook, used by the ScheduleBatch / ForwardBatch / RadixAttention hooks.

Per-request state lives on SGLang's Req object (attribute EVICTED_ATTR), so it follows the request through
batch filtering and merging, and is reset where SGLang resets a request (retraction).
The objects it touches are duck-typed (only the attributes listed in sglang_patches.contract are used), which is
what lets the tests drive it with SGLang's own pool classes or with layout-identical stand-ins.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from slime_sparse.kv import KVCompressConfig, should_compress

from .compaction import (
    append_kept_count,
    compact_row,
    gather_keys,
    gather_window_queries,
    select_kept_slots,
    shift_positions,
    write_decode_queries,
    write_extend_queries,
)
from .evictions import EVICTIONS_INFO_KEY, RETRACTED, append_at, eviction_entry
from .settings import DENSE_REQUEST_PARAM

logger = logging.getLogger(__name__)

EVICTED_ATTR = "slime_sparse_evicted"  # Req attribute: tokens of this request evicted so far (logical - physical)
KEPT_INFO_KEY = "sparse_kv_kept"  # key in Req.customized_info -> meta_info: cache size per output token


def evicted_count(req: Any) -> int:
    return getattr(req, EVICTED_ATTR, 0)


def wants_dense(req: Any) -> bool:
    """The request opted out of compression (settings.DENSE_REQUEST_PARAM in its sampling_params.custom_params)."""
    custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return isinstance(custom, dict) and bool(custom.get(DENSE_REQUEST_PARAM, False))


@dataclass
class RuntimeCounters:
    compressions: int = 0
    freed_tokens: int = 0


@dataclass
class SparseKVRuntime:
    """The budgeted cache of one scheduler process.

    req_to_token_pool / kv_pool / allocator are SGLang's ReqToTokenPool, MHATokenToKVPool and
    TokenToKVPoolAllocator (page_size 1) of the process's ModelRunner.
    """

    cfg: KVCompressConfig
    req_to_token_pool: Any
    kv_pool: Any
    allocator: Any
    q_buffers: list[Tensor]  # per layer [req_to_token rows, window, Hq, d]
    counters: RuntimeCounters = field(default_factory=RuntimeCounters)

    @classmethod
    def allocate(
        cls,
        cfg: KVCompressConfig,
        req_to_token_pool: Any,
        kv_pool: Any,
        allocator: Any,
        num_q_heads: int,
        dtype: torch.dtype,
        memory_region: Any = None,
    ) -> "SparseKVRuntime":
        """Preallocate the query rings: one row per req_to_token row (the padding row included).

        memory_region: a context manager (SGLang's memory-saver KV-cache region) so the rings are released and
        resumed with the KV cache when a colocated trainer takes the GPU; None = plain allocation.
        """
        rows = req_to_token_pool.req_to_token.shape[0]
        head_dim = kv_pool.head_dim
        device = req_to_token_pool.req_to_token.device
        shape = (rows, cfg.window, num_q_heads, head_dim)
        region = memory_region if memory_region is not None else contextlib.nullcontext()
        with region:
            q_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(kv_pool.layer_num)]
        return cls(cfg, req_to_token_pool, kv_pool, allocator, q_buffers)

    # ---------------------------------------------------------------------------------------------------------
    # RadixAttention.forward: observation queries
    # ---------------------------------------------------------------------------------------------------------
    def capture_queries(self, layer_index: int, q: Tensor, forward_batch: Any) -> None:
        """Store the post-RoPE queries q [tokens, Hq * d] of one attention layer into the ring buffers."""
        mode = forward_batch.forward_mode
        buffer = self.q_buffers[layer_index]
        q = q.reshape(q.shape[0], buffer.shape[2], buffer.shape[3])
        if mode.is_decode():
            write_decode_queries(buffer, forward_batch.req_pool_indices, forward_batch.positions, q)
        elif mode.is_extend():
            write_extend_queries(
                buffer,
                forward_batch.req_pool_indices,
                forward_batch.positions,
                forward_batch.seq_lens,
                forward_batch.extend_seq_lens,
                q,
            )
        # IDLE (and anything else) carries no tokens of ours

    # ---------------------------------------------------------------------------------------------------------
    # ScheduleBatch.prepare_for_decode: compaction before the next slot is allocated
    # ---------------------------------------------------------------------------------------------------------
    def compact_batch(self, batch: Any) -> int:
        """Compress every request of a decode batch whose cache reached budget + buffer (except those that asked
        to stay dense); return how many.

        For each: score the cached tokens (keys from the KV pool, queries from the rings), move the kept slots to
        the front of its req_to_token row, free the others through the allocator, and shrink seq_lens,
        seq_lens_cpu, kv_committed_len and kv_allocated_len to the kept count. The evicted count grows by the
        same amount, so logical positions stay recoverable. Each compression is shipped (record_eviction) so the
        learner can rebuild what every later token attended to.
        """
        seq_lens_cpu = batch.seq_lens_cpu
        new_lens = seq_lens_cpu.clone()
        req_to_token = self.req_to_token_pool.req_to_token
        k_buffers = [self.kv_pool.get_key_buffer(layer) for layer in self._layer_ids()]
        compressed = 0
        for i, req in enumerate(batch.reqs):
            length = int(seq_lens_cpu[i])
            if wants_dense(req) or not should_compress(length, self.cfg, first_decode=len(req.output_ids) == 1):
                continue
            if req.kv_committed_len != length or req.kv_allocated_len != length:
                raise RuntimeError(
                    f"slime_sparse KV compaction: request {req.rid} has seq_len {length} but "
                    f"kv_committed_len={req.kv_committed_len}, kv_allocated_len={req.kv_allocated_len}; "
                    "this happens only under an unsupported scheduler mode (overlap, speculative decoding)"
                )
            row = int(req.req_pool_idx)
            evicted = evicted_count(req)
            slots = req_to_token[row, :length].long()
            keys = gather_keys(k_buffers, slots)
            queries = gather_window_queries(self.q_buffers, row, length + evicted)
            kept = select_kept_slots(self.cfg, keys, queries)
            # the row holds `length` slots = the first length + evicted tokens minus those evicted before
            record_eviction(req, length + evicted, length, kept)
            freed = compact_row(req_to_token, row, length, kept)
            self.allocator.free(freed)

            kept_len = int(kept.numel())
            new_lens[i] = kept_len
            req.kv_committed_len = kept_len
            req.kv_allocated_len = kept_len
            setattr(req, EVICTED_ATTR, evicted + length - kept_len)
            self.counters.compressions += 1
            self.counters.freed_tokens += length - kept_len
            compressed += 1
            logger.debug("compressed request %s: %d -> %d slots", req.rid, length, kept_len)
        if compressed:
            batch.seq_lens_cpu = new_lens
            # copy=True: on a CPU device .to() would alias seq_lens_cpu, and SGLang adds 1 to both in place
            batch.seq_lens = new_lens.to(device=batch.seq_lens.device, dtype=batch.seq_lens.dtype, copy=True)
            batch.seq_lens_sum = None  # ForwardBatch.init_new recomputes it from seq_lens_cpu
        return compressed

    def record_kept(self, batch: Any) -> None:
        """After SGLang's prepare_for_decode (seq_lens already +1): log the cache size the coming step reads.

        Goes to Req.customized_info, which SGLang streams back per output token as meta_info[KEPT_INFO_KEY].
        """
        lengths = batch.seq_lens_cpu.tolist()
        for req, cache_len in zip(batch.reqs, lengths):
            info = req.customized_info if req.customized_info is not None else {}
            history = info.setdefault(KEPT_INFO_KEY, [])
            append_kept_count(history, len(req.origin_input_ids), len(req.output_ids), int(cache_len))
            req.customized_info = info

    # ---------------------------------------------------------------------------------------------------------
    # ForwardBatch.init_new: logical positions
    # ---------------------------------------------------------------------------------------------------------
    def logical_decode_positions(self, positions: Tensor, reqs: list[Any]) -> Tensor:
        """Decode positions + each request's evicted count (unchanged tensor when nothing was evicted)."""
        evicted = [evicted_count(req) for req in reqs]
        if not any(evicted):
            return positions
        return shift_positions(positions, torch.tensor(evicted, dtype=torch.int64))

    # ---------------------------------------------------------------------------------------------------------
    # Scheduler.flush_cache / Req.reset_for_retract
    # ---------------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """After a successful flush_cache (no request alive): clear the rings and the counters."""
        for buf in self.q_buffers:
            buf.zero_()
        self.counters = RuntimeCounters()

    def _layer_ids(self) -> range:
        start = getattr(self.kv_pool, "start_layer", 0) or 0
        return range(start, start + self.kv_pool.layer_num)


def record_eviction(req: Any, start: int, held: int, kept: Tensor) -> None:
    """Ship one compression with the output token its decode step produces (sglang_patches.evictions)."""
    append_at(_eviction_history(req), len(req.output_ids), eviction_entry(start, held, kept))


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

