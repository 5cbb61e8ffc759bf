"""Pure tensor logic of a budgeted SGLang KV cache: query capture, slot selection, req_to_token compaction.

Everything here works on SGLang's pool layout (page_size 1) and nothing else, so it runs on CPU tensors in tests:
- req_to_token: int32 [rows, max_context_len]; row 0 is SGLang's padding row (CUDA-graph padded batches point at
  it), request r owns row r.req_pool_idx and its cached tokens sit at req_to_token[row, :seq_len] in token order;
- K/V buffers: one [slots, Hkv, d] tensor per layer, slot 0 a padding slot; keys are stored post-RoPE;
- query buffers (ours): one [rows, window, Hq, d] tensor per layer, indexed by the same row as req_to_token. The
  query of the token at LOGICAL position p sits in ring slot p % window, so the last `window` queries of a request
  are always there whatever was evicted.

"physical" lengths count cache slots (SGLang's seq_lens after compaction); "logical" lengths count tokens of the
sequence (prompt + generated). logical = physical + evicted.
"""
from __future__ import annotations

import torch
from torch import Tensor

from slime_sparse.kv import KVCompressConfig, compress_indices

# When to compress is slime_sparse.kv.schedule.should_compress (the embedded engine's rule too), asked by runtime.py.


# --------------------------------------------------------------------------------------------------------------
# Observation queries: a ring of the last `window` post-RoPE queries per request and layer
# --------------------------------------------------------------------------------------------------------------
def window_ring_slots(logical_len: int, window: int, device: torch.device | str = "cpu") -> Tensor:
    """Ring slots holding the queries of the last min(window, logical_len) tokens, oldest first."""
    start = max(0, logical_len - window)
    return torch.arange(start, logical_len, device=device) % window


def write_decode_queries(buffer: Tensor, req_pool_indices: Tensor, positions: Tensor, q: Tensor) -> None:
    """Decode step: one query per request, q [bs, Hq, d], at logical `positions` [bs].

    Only fixed-shape indexing, so it can be recorded in a CUDA graph (padded entries write into row 0).
    """
    window = buffer.shape[1]
    buffer[req_pool_indices.long(), positions.long() % window] = q.to(buffer.dtype)


def write_extend_queries(
    buffer: Tensor,
    req_pool_indices: Tensor,
    positions: Tensor,
    seq_lens: Tensor,
    extend_seq_lens: Tensor,
    q: Tensor,
) -> None:
    """Prefill (extend) step: q [T, Hq, d] for the T new tokens of all requests, request after request.

    Writes only each request's last `window` tokens (position >= seq_len - window), so no two tokens of the batch
    target the same ring slot (a duplicate index would make the written value undefined on GPU).
    """
    window = buffer.shape[1]
    owner = torch.repeat_interleave(
        torch.arange(extend_seq_lens.numel(), device=q.device), extend_seq_lens.to(q.device).long()
    )
    positions = positions.long()
    recent = positions >= seq_lens.to(q.device).long()[owner] - window
    rows = req_pool_indices.to(q.device).long()[owner[recent]]
    buffer[rows, positions[recent] % window] = q[recent].to(buffer.dtype)


def gather_window_queries(q_buffers: list[Tensor], row: int, logical_len: int) -> list[Tensor]:
    """Per layer, the request's observation queries [Hq, w, d] in token order (w = min(window, logical_len))."""
    window = q_buffers[0].shape[1]
    ring = window_ring_slots(logical_len, window, q_buffers[0].device)
    return [buf[row, ring].transpose(0, 1) for buf in q_buffers]


def gather_keys(k_buffers: list[Tensor], slots: Tensor) -> list[Tensor]:
    """Per layer, the keys [Hkv, n, d] of the given cache slots (in the given order)."""
    return [buf[slots].transpose(0, 1) for buf in k_buffers]


# --------------------------------------------------------------------------------------------------------------
# Selection and compaction
# --------------------------------------------------------------------------------------------------------------
def select_kept_slots(cfg: KVCompressConfig, keys: list[Tensor], queries: list[Tensor]) -> Tensor:
    """Sorted cache positions (0..n-1) to keep: ONE set for the whole model (the plugin's config is held to
    granularity "model" by settings.check_sglang_kv_config, the one place of that rule).

    Scores come from slime_sparse.kv.compress_indices, the code the embedded engine runs.
    """
    per_layer = compress_indices(cfg, keys, queries)
    return per_layer[0][0]


def compact_row(req_to_token: Tensor, row: int, length: int, kept: Tensor) -> Tensor:
    """Move the kept entries of req_to_token[row, :length] to its front, in order; return the freed slot ids.

    `kept` holds sorted, distinct positions in [0, length). After the call req_to_token[row, :len(kept)] lists the
    kept slots in token order; entries past len(kept) are stale and never read (SGLang reads up to seq_len and
    frees up to kv_committed_len, both set to len(kept) by the caller). Returns int64 slot ids to give back to
    the allocator: kept + freed is exactly the original row prefix, each slot once.
    """
    slots = req_to_token[row, :length].long()
    keep_mask = torch.zeros(length, dtype=torch.bool, device=slots.device)
    keep_mask[kept] = True
    req_to_token[row, : kept.numel()] = slots[kept].to(req_to_token.dtype)
    return slots[~keep_mask]


def shift_positions(positions: Tensor, evicted: Tensor) -> Tensor:
    """Decode positions computed by SGLang from the compacted seq_lens (physical) made logical again.

    RoPE must see the token's true index in the sequence: position = physical position + tokens evicted so far.
    """
    return positions + evicted.to(device=positions.device, dtype=positions.dtype)


def append_kept_count(history: list[int], prompt_len: int, n_output: int, cache_len: int) -> None:
    """Per-output-token KV accounting: history[i] = cache slots attention read to produce output token i.

    Tokens produced outside our decode hook (the first one, by prefill; one after a retraction's re-prefill) read
    the dense cache: prompt_len + i. Then `cache_len` is appended for the token the coming decode step produces.
    """
    while len(history) < n_output:
        history.append(prompt_len + len(history))
    history.append(cache_len)
