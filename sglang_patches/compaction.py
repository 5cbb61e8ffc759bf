"""Pure tensor logic of a budgeted SGLang KV cache: the query rings and the batched compaction of req_to_token.

Everything here works on SGLang's pool layout (page_size 1) and nothing else, so it runs on CPU tensors in tests:
- req_to_token: int32 [rows, max_context_len]; row 0 is SGLang's padding row (CUDA-graph padded batches point at
  it), request r owns row r.req_pool_idx and its cached tokens sit at req_to_token[row, :seq_len] in token order;
- K/V buffers: one [slots, Hkv, d] tensor per layer, slot 0 a padding slot; keys are stored post-RoPE;
- query rings (ours): one [layers, rows, window, Hq, d] tensor, indexed by the same row as req_to_token. The query of
  the token at LOGICAL position p sits in ring slot p % window, so the last `window` queries of a request are always
  there whatever was evicted.

"physical" lengths count cache slots (SGLang's seq_lens after compaction); "logical" lengths count tokens of the
sequence (prompt + generated). logical = physical + evicted.

`Compactor` is the embedded engine's compaction (slime_sparse/rollout/embedded/compressor.py) over SGLang's pools:
for R requests that hold n slots each, in one call, every layer at once:
    slots [R, n]                   <- req_to_token[rows, :n]
    keys [L, R, Hkv, n, d]         <- one gather per layer (SGLang keeps one K buffer per layer)
    queries [L, R, Hq, w, d]       <- one gather from the rings
    scores [L, R, Hkv, n]          <- the method's `score`, batched over layers and requests (kv/methods)
    kept [R, B]                    <- `kv.choose_slots`: one set per request (granularity model), sorted
    req_to_token[rows, :B]         <- slots[kept]: the kept slots to the front, in token order, in place
    keep bits [R, bytes], freed [R, n - B]  <- the eviction record (`kv.record`) and the slots to free
Only fixed-shape device work: no host synchronisation, no data-dependent shapes, no host data.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from slime_sparse.kv import KVCompressConfig, choose_slots
from slime_sparse.kv.record import keep_bits, pack_rows


# --------------------------------------------------------------------------------------------------------------
# Observation queries: a ring of the last `window` post-RoPE queries per request and layer
# --------------------------------------------------------------------------------------------------------------
def write_decode_queries(ring: Tensor, req_pool_indices: Tensor, positions: Tensor, q: Tensor) -> None:
    """Decode step: one query per request, q [bs, Hq, d], at logical `positions` [bs] into one layer's ring
    [rows, window, Hq, d]. Fixed-shape indexing only, so the decode CUDA graph records it (padded entries write
    into row 0)."""
    window = ring.shape[1]
    ring[req_pool_indices.long(), positions.long() % window] = q.to(ring.dtype)


def write_extend_queries(ring: Tensor, req_pool_indices: Tensor, positions: Tensor, seq_lens: Tensor,
                         extend_seq_lens: Tensor, q: Tensor) -> None:
    """Prefill (extend) step: q [T, Hq, d] for the T new tokens of all requests, request after request.

    Each request's last `window` tokens (position >= seq_len - window) go to its row; the others go to row 0, the
    padding row no request owns, so no two kept writes target the same ring slot (a duplicate index would make the
    written value undefined on GPU) and nothing waits for the device (no boolean selection).
    """
    window = ring.shape[1]
    tokens = torch.arange(q.shape[0], device=q.device)
    owner = torch.searchsorted(extend_seq_lens.to(q.device).long().cumsum(0), tokens, right=True)  # [T]
    positions = positions.long()
    recent = positions >= seq_lens.to(q.device).long()[owner] - window
    rows = torch.where(recent, req_pool_indices.to(q.device).long()[owner], 0)
    ring[rows, positions % window] = q.to(ring.dtype)


def window_order(logical: Tensor, m: int, window: int) -> Tensor:
    """[R, m]: the ring slots of each request's last m tokens, oldest first (logical [R] lengths, all >= m)."""
    return (logical[:, None] - m + torch.arange(m, device=logical.device)) % window


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


# --------------------------------------------------------------------------------------------------------------
# Batched compaction
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Compaction:
    """What one compaction leaves for the host, on the device: per request (row of the table), its keep bits packed
    (`kv.record.pack_rows`, the eviction record's bits) and the slot ids it evicted, in token order."""

    packed: Tensor  # [R, ceil(n / 8)] uint8
    freed: Tensor  # [R, n - B] int64


class Compactor:
    """Compacts the req_to_token rows of requests that hold the same number of slots, to the budget, in one call.

    key_buffers: SGLang's per-layer K buffers (MHATokenToKVPool.get_key_buffer); rings: our query rings. Every layer
    and head keeps one set per request: the plugin's config is held to granularity 'model' by
    settings.check_sglang_kv_config, the one place of that rule. H2O scores without accumulated mass (SGLang's
    kernels do not expose attention weights): the window approximation of its scorer.
    """

    def __init__(self, cfg: KVCompressConfig, req_to_token: Tensor, key_buffers: list[Tensor], rings: Tensor) -> None:
        self.cfg, self.req_to_token, self.key_buffers, self.rings = cfg, req_to_token, key_buffers, rings
        self.scorer = cfg.scorer
        self.uses_queries = self.scorer.needs_queries or self.scorer.tracks_mass
        self.budgets = (cfg.budget,) * len(key_buffers)
        self._cols = torch.arange(req_to_token.shape[1], device=req_to_token.device)

    def __call__(self, rows: Tensor, logical: Tensor, n: int) -> Compaction:
        """Compact rows [R] (int64, on the device; repeats allowed: they write the same values) whose requests hold
        n > budget slots each and logical [R] tokens (so their last `window` queries are in the rings)."""
        budget = self.cfg.budget
        if n <= budget:
            raise ValueError(f"a compaction needs more than budget={budget} slots per request, got n={n}")
        slots = self.req_to_token[rows, :n].long()  # [R, n]
        keys = torch.stack([buf[slots] for buf in self.key_buffers]).transpose(2, 3)  # [L, R, Hkv, n, d]
        queries = None
        if self.uses_queries:
            order = window_order(logical, self.rings.shape[2], self.rings.shape[2])  # every request holds > window
            queries = self.rings[:, rows[:, None], order].transpose(2, 3)  # [L, R, Hq, w, d]
        scores = self.scorer.score(keys, queries, None)  # [L, R, Hkv, n]
        kept = choose_slots(self.cfg, scores, self.budgets)  # [1, R, 1, B]: one set per request
        bits = keep_bits(kept, n)  # [R, n] 0/1
        kept = kept[0, :, 0]
        self.req_to_token[rows[:, None], self._cols[:budget]] = slots.gather(1, kept).to(self.req_to_token.dtype)
        evicted = bits.argsort(dim=1, stable=True)[:, : n - budget]  # the 0 bits first, in token order
        return Compaction(packed=pack_rows(bits), freed=slots.gather(1, evicted))
