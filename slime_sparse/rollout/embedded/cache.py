"""A preallocated, budgeted KV cache that plugs into transformers models as `past_key_values`.

Layout (one tensor per kind, allocated once per generate() call, never grown):
    key, value  [L, R, Hkv, capacity, d]   post-RoPE keys and values, model dtype
    positions   [L, R, Hkv, capacity]      logical position of the token in each slot (int32)
    queries     [L, R, Hq, window, d]      ring buffer of the last `window` post-RoPE queries (compression on)
    mass        [L, R, Hkv, capacity]      accumulated attention probability per slot (H2O only, float32)
Row r holds one sequence; its first fill[r] slots are valid, in chronological order, identical in count for
every layer and head (a compression keeps exactly `budget` slots everywhere). Slots past fill[r] hold stale
but finite values and are masked out.

The model calls `update(k, v, layer_idx)` with the post-RoPE keys of the new tokens; we write them where
the current `StepPlan` says and return views over the rows' first `span` slots. The attention function in
`attention.py` then records queries and (for H2O) attention mass here.
"""
from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from .plan import StepPlan


class BudgetKVCache(Cache):
    def __init__(
        self,
        *,
        num_layers: int,
        num_rows: int,
        num_kv_heads: int,
        num_q_heads: int,
        head_dim: int,
        capacity: int,
        window: int,
        record_queries: bool,
        track_mass: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(layers=[])  # we keep our own tensors; transformers' per-layer objects are unused
        shape = (num_layers, num_rows, num_kv_heads, capacity, head_dim)
        self.key = torch.zeros(shape, device=device, dtype=dtype)
        self.value = torch.zeros(shape, device=device, dtype=dtype)
        self.positions = torch.zeros(shape[:-1], device=device, dtype=torch.int32)
        self.queries = (
            torch.zeros((num_layers, num_rows, num_q_heads, window, head_dim), device=device, dtype=dtype)
            if record_queries
            else None
        )
        self.mass = torch.zeros(shape[:-1], device=device, dtype=torch.float32) if track_mass else None
        self.capacity = capacity
        self.window = window
        self.num_layers = num_layers
        self.fill = [0] * num_rows  # valid slots per row (host side: the scheduler plans with it)
        self.queries_seen = [0] * num_rows  # tokens whose queries went through the ring, per row
        self.plan: StepPlan | None = None

    # ---- transformers Cache interface (only what Qwen2/Llama use when positions and a 4D mask are given) ----
    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[Tensor, Tensor]:
        """Write the new tokens' keys/values, return [n, Hkv, span, d] views of the rows being run."""
        p = self._current_plan()
        rows, slots = p.write_row, p.write_slot
        # Advanced indices on dims 0 and 2 around a slice: both sides are [T, Hkv, d].
        self.key[layer_idx][rows, :, slots] = _real_tokens(key_states, p)
        self.value[layer_idx][rows, :, slots] = _real_tokens(value_states, p)
        n = key_states.shape[0]
        rs = slice(p.row_start, p.row_start + n)
        return self.key[layer_idx, rs, :, : p.span], self.value[layer_idx, rs, :, : p.span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.fill, default=0)

    # ---- hooks for the attention function ----
    def record_queries(self, layer_idx: int, query: Tensor) -> None:
        """Keep the post-RoPE queries of each row's newest `window` tokens (query: [n, Hq, C, d])."""
        if self.queries is None:
            return
        p = self._current_plan()
        queries = query[:, :, 0] if p.decode else query[p.ring_src[0], :, p.ring_src[1]]
        self.queries[layer_idx][p.ring_row, :, p.ring_slot] = queries

    @property
    def tracks_mass(self) -> bool:
        return self.mass is not None

    def accumulate_mass(self, layer_idx: int, probs: Tensor) -> None:
        """Add attention probabilities [n, Hkv, group, C, S] of real queries to each slot's mass (H2O).

        Summed over the group's query heads and the chunk's real queries, as H2O accumulates over all
        queries that attended to a key.
        """
        p = self._current_plan()
        weighted = probs * p.query_valid[:, None, None, :, None]
        n = probs.shape[0]
        self.mass[layer_idx, p.row_start : p.row_start + n, :, : p.span] += weighted.sum(dim=(2, 3))

    # ---- used by the scheduler ----
    def begin(self, plan: StepPlan) -> None:
        """Start a forward: what is the same in every layer (positions, fresh mass) is written here, once."""
        self.plan = plan
        self.positions[:, plan.write_row, :, plan.write_slot] = plan.write_pos[:, None, None]
        if self.mass is not None:
            self.mass[:, plan.write_row, :, plan.write_slot] = 0.0  # a new slot starts with no attention mass

    def commit(self, chunk_lengths: list[int]) -> None:
        """After the forward of the current plan: the rows now hold their new tokens."""
        p = self._current_plan()
        for b, c in enumerate(chunk_lengths):
            self.fill[p.row_start + b] += c
            self.queries_seen[p.row_start + b] += c
        self.plan = None

    def reset_row(self, row: int) -> None:
        self.fill[row] = 0
        self.queries_seen[row] = 0

    def copy_row(self, src: int, dst: int) -> None:
        """Copy row src into row dst: a prefill shared by the samples of one prompt, or the last running row moved
        into a finished one's place (running sequences stay in contiguous rows)."""
        n = self.fill[src]
        for t in (self.key, self.value, self.positions, self.mass):
            if t is not None:
                t[:, dst, :, :n] = t[:, src, :, :n]
        if self.queries is not None:
            self.queries[:, dst] = self.queries[:, src]
        self.fill[dst], self.queries_seen[dst] = n, self.queries_seen[src]

    def layer_keys(self, row: int) -> list[Tensor]:
        return [self.key[layer, row, :, : self.fill[row]] for layer in range(self.num_layers)]

    def layer_values(self, row: int) -> list[Tensor]:
        return [self.value[layer, row, :, : self.fill[row]] for layer in range(self.num_layers)]

    def layer_mass(self, row: int) -> list[Tensor] | None:
        if self.mass is None:
            return None
        return [self.mass[layer, row, :, : self.fill[row]] for layer in range(self.num_layers)]

    def window_queries(self, row: int) -> list[Tensor]:
        """Per layer, [Hq, m, d]: the row's last m = min(window, seen) queries, oldest first."""
        if self.queries is None:
            raise RuntimeError("this cache does not record queries (compression is off)")
        seen = self.queries_seen[row]
        m = min(self.window, seen)
        ring = torch.tensor([(seen - m + i) % self.window for i in range(m)], device=self.key.device)
        return [self.queries[layer, row][:, ring] for layer in range(self.num_layers)]

    def compact(self, row: int, kept: list[Tensor]) -> None:
        """Keep slots kept[layer][h] (sorted, the same count for every head/layer) at the front of the row."""
        idx = torch.stack(kept).to(self.key.device)  # [L, Hkv, B]
        budget = idx.shape[-1]
        d = self.key.shape[-1]
        gather_kv = idx[..., None].expand(*idx.shape, d)
        # gather() materialises the kept slots first, so overwriting the front of the row is safe.
        self.key[:, row, :, :budget] = self.key[:, row].gather(2, gather_kv)
        self.value[:, row, :, :budget] = self.value[:, row].gather(2, gather_kv)
        self.positions[:, row, :, :budget] = self.positions[:, row].gather(2, idx)
        if self.mass is not None:
            self.mass[:, row, :, :budget] = self.mass[:, row].gather(2, idx)
        self.fill[row] = budget

    def held_positions(self, row: int) -> Tensor:
        """[L, Hkv, fill] logical positions the row holds now (a CPU copy, never a view of the cache)."""
        return self.positions[:, row, :, : self.fill[row]].to("cpu", copy=True)

    @property
    def kv_bytes(self) -> int:
        """Bytes allocated for keys and values (the KV cache proper)."""
        return self.key.numel() * self.key.element_size() * 2

    def _current_plan(self) -> StepPlan:
        if self.plan is None:
            raise RuntimeError("BudgetKVCache used outside a planned forward (call begin(plan) first)")
        return self.plan


def _real_tokens(states: Tensor, plan: StepPlan) -> Tensor:
    """[T, H, d]: the new tokens of [n, H, C, d] that are real (all of them, as a view, when decoding)."""
    if plan.decode:
        return states[:, :, 0]
    src_b, src_c = plan.write_src
    return states[src_b, :, src_c]
