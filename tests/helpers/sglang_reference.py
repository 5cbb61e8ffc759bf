"""The SGLang plugin's compaction as it was before #37, kept as the oracle the batched compaction is tested against
(tests/sglang/test_batched.py) and as the baseline of benchmarks/sglang_compaction_cost.py. Never called by the hooks.

A Python loop over the due requests: per request, its keys gathered layer by layer, one `kv.compress_indices` call,
its kept slots copied to the host for the eviction entry, a boolean-mask gather of the slots to free (both wait for
the device), one allocator free; the lengths copied back to the device at the end. It reads and writes the same state
as `SparseKVRuntime.compact_batch` (the runtime's pools, rings and Req fields), so both run on twin worlds.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sglang_patches.evictions import append_at, eviction_entry
from sglang_patches.runtime import EVICTED_ATTR, SparseKVRuntime, _eviction_history, evicted_count, wants_dense
from slime_sparse.kv import KVCompressConfig, compress_indices, should_compress


def window_ring_slots(logical_len: int, window: int) -> Tensor:
    """Ring slots holding the queries of the last min(window, logical_len) tokens, oldest first."""
    return torch.arange(max(0, logical_len - window), logical_len) % window


def select_kept_slots(cfg: KVCompressConfig, keys: list[Tensor], queries: list[Tensor]) -> Tensor:
    """Sorted cache positions to keep: one set for the whole model."""
    return compress_indices(cfg, keys, queries)[0][0]


def compact_row(req_to_token: Tensor, row: int, length: int, kept: Tensor) -> Tensor:
    """Move the kept entries of req_to_token[row, :length] to its front, in order; return the freed slot ids."""
    slots = req_to_token[row, :length].long()
    keep_mask = torch.zeros(length, dtype=torch.bool, device=slots.device)
    keep_mask[kept] = True
    req_to_token[row, : kept.numel()] = slots[kept].to(req_to_token.dtype)
    return slots[~keep_mask]


def compact_batch_per_request(runtime: SparseKVRuntime, batch: Any) -> int:
    """What SparseKVRuntime.compact_batch did before #37 (same effects, request by request)."""
    cfg = runtime.cfg
    seq_lens_cpu = batch.seq_lens_cpu
    new_lens = seq_lens_cpu.clone()
    req_to_token = runtime.req_to_token
    layers = range(runtime.start_layer, runtime.start_layer + runtime.kv_pool.layer_num)
    k_buffers = [runtime.kv_pool.get_key_buffer(layer) for layer in layers]
    window = runtime.rings.shape[2]
    compressed = 0
    for i, req in enumerate(batch.reqs):
        length = int(seq_lens_cpu[i])
        if wants_dense(req) or not should_compress(length, cfg, first_decode=len(req.output_ids) == 1):
            continue
        row = int(req.req_pool_idx)
        evicted = evicted_count(req)
        slots = req_to_token[row, :length].long()
        keys = [buf[slots].transpose(0, 1) for buf in k_buffers]
        ring = window_ring_slots(length + evicted, window).to(runtime.rings.device)
        queries = [runtime.rings[layer, row, ring].transpose(0, 1) for layer in range(len(k_buffers))]
        kept = select_kept_slots(cfg, keys, queries)
        append_at(_eviction_history(req), len(req.output_ids), eviction_entry(length + evicted, length, kept))
        runtime.allocator.free(compact_row(req_to_token, row, length, kept))
        kept_len = int(kept.numel())
        new_lens[i] = kept_len
        req.kv_committed_len = req.kv_allocated_len = kept_len
        setattr(req, EVICTED_ATTR, evicted + length - kept_len)
        compressed += 1
    if compressed:
        batch.seq_lens_cpu = new_lens
        batch.seq_lens = new_lens.to(device=batch.seq_lens.device, dtype=batch.seq_lens.dtype, copy=True)
        batch.seq_lens_sum = None
    return compressed
