"""A preallocated, budgeted KV cache that plugs into transformers models as `past_key_values`.

Layout (per layer l, allocated once per generate() call, never grown; S_l = the layer's capacity):
    key[l], value[l]  [R, Hkv, S_l, d]    post-RoPE keys and values, model dtype
    positions[l]      [R, Hkv, S_l]       logical position of the token in each slot (int32)
    queries[l]        [R, Hq, window, d]  ring buffer of the last `window` post-RoPE queries (compression on)
    mass[l]           [R, Hkv, S_l]       accumulated attention probability per slot (H2O only, float32)
    fill              [L, R] int64          valid slots of each layer and row (device; `fill_host` mirrors it)
    seen              [R] int64             queries that went through the ring (device; `seen_host` mirrors it)
Row r holds one sequence; in layer l its first fill[l, r] slots are valid, in chronological order, the same count
for every head. Slots past the fill hold stale but finite values and are masked out. A decode step writes at
min(fill, S_l - 1) and leaves fill at most S_l: a live row always has room (the engine sizes and compresses it so),
while a row that holds no live sequence (padding of a captured batch size, a finished row not yet retired) keeps
overwriting its own last slot, so a fixed-shape step never writes out of bounds and never touches a live row.

The host never reads `fill` or `seen` back: every change to them is one the scheduler decides (a step, an
admission, a compression), so it applies the same change to its numpy mirrors and plans with those.

The model calls `update(k, v, layer_idx)` with the post-RoPE keys of the new tokens; we write them where the
current step says (`PrefillPlan` or `DecodeView`) and return views over the rows' first `span` slots. The
attention function in `attention.py` reads its mask from here (`attention_mask`) and records queries and (for
H2O) attention mass here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from transformers.cache_utils import Cache

from .plan import PrefillPlan


@dataclass(frozen=True)
class DecodeView:
    """What a decode step runs over: rows [0, n), each with one new token, attention over slots [0, spans[l])."""

    n: int
    spans: tuple[int, ...]  # per layer
    positions: Tensor  # [n] logical position of each row's new token (a view of the engine's decode state)


class BudgetKVCache(Cache):
    def __init__(
        self,
        *,
        num_rows: int,
        num_kv_heads: int,
        num_q_heads: int,
        head_dim: int,
        capacities: list[int],
        window: int,
        record_queries: bool,
        track_mass: bool,
        device: torch.device,
        dtype: torch.dtype,
        shared_fill: bool = False,
    ) -> None:
        super().__init__(layers=[])  # we keep our own tensors; transformers' per-layer objects are unused
        self.num_layers = len(capacities)
        self.capacities = list(capacities)
        self.window = window
        self.device = device

        def per_layer(shape, dtype_) -> list[Tensor]:
            return [torch.zeros((num_rows, *shape(cap)), device=device, dtype=dtype_) for cap in capacities]

        self.key = per_layer(lambda cap: (num_kv_heads, cap, head_dim), dtype)
        self.value = per_layer(lambda cap: (num_kv_heads, cap, head_dim), dtype)
        self.positions = per_layer(lambda cap: (num_kv_heads, cap), torch.int32)
        self.queries = per_layer(lambda cap: (num_q_heads, window, head_dim), dtype) if record_queries else None
        self.mass = per_layer(lambda cap: (num_kv_heads, cap), torch.float32) if track_mass else None
        self.fill = torch.zeros(self.num_layers, num_rows, dtype=torch.int64, device=device)
        self.seen = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.fill_host = np.zeros((self.num_layers, num_rows), dtype=np.int64)
        self.seen_host = np.zeros(num_rows, dtype=np.int64)
        self._caps = torch.tensor(capacities, dtype=torch.int64, device=device)[:, None]  # [L, 1]
        self._caps_host = np.array(capacities, dtype=np.int64)[:, None]
        self._arange = torch.arange(num_rows, device=device)
        self._slots = torch.arange(max(capacities), device=device)
        self.step: PrefillPlan | DecodeView | None = None
        # one budget for every layer: every layer of a row holds the same fill, so a step's write slots and masks
        # are the same in every layer and are built once (`_shared`)
        self.shared_fill = shared_fill
        self._memo: dict[tuple[str, int], Tensor] = {}

    @property
    def num_rows(self) -> int:
        return self.fill.shape[1]

    # ---- transformers Cache interface (only what Qwen2/Llama use when positions and masks are ours) ----
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Write the new tokens' keys/values, return [n, Hkv, span, d] views of the rows being run."""
        step = self._current()
        key, value = self.key[layer_idx], self.value[layer_idx]
        if isinstance(step, DecodeView):
            rows = self._arange[: step.n]
            slots = self._shared("slots", layer_idx,
                                 lambda: self.fill[layer_idx, : step.n].clamp(max=self.capacities[layer_idx] - 1))
            new_k, new_v, pos = key_states[:, :, 0], value_states[:, :, 0], step.positions
            first = 0
        else:
            rows, slots = step.write_row, self.fill[layer_idx, step.write_row] + step.write_offset
            src_b, src_c = step.write_src
            new_k, new_v, pos = key_states[src_b, :, src_c], value_states[src_b, :, src_c], step.write_pos
            first = step.row_start
        # Advanced indices on dims 0 and 2 around a slice: both sides are [T, Hkv, d].
        key[rows, :, slots] = new_k
        value[rows, :, slots] = new_v
        self.positions[layer_idx][rows, :, slots] = pos.to(torch.int32)[:, None]
        if self.mass is not None:
            self.mass[layer_idx][rows, :, slots] = 0.0  # a new slot starts with no attention mass
        span = step.spans[layer_idx]
        return key[first : first + step.n, :, :span], value[first : first + step.n, :, :span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.fill_host[layer_idx].max(initial=0))

    # ---- hooks for the attention function ----
    def attention_mask(self, layer_idx: int) -> Tensor:
        """[n, 1, C, span] bool: which slots each query of the current step may read (C = 1 when decoding)."""
        return self._shared("mask", layer_idx, lambda: self._mask(layer_idx))

    def _mask(self, layer_idx: int) -> Tensor:
        step = self._current()
        slots = self._slots[: step.spans[layer_idx]]
        if isinstance(step, DecodeView):
            # the new token sits at slot fill: it sees [0, fill]; a row without a sequence sees finite stale slots
            return (slots <= self.fill[layer_idx, : step.n, None])[:, None, None]
        fill = self.fill[layer_idx, step.row_start : step.row_start + step.n]
        # Real token i of a chunk sees the fill old slots plus new tokens 0..i (causal). Padding columns see the
        # whole row, so that no softmax row is empty (an all-masked row gives NaN, and NaN * 0 leaks later).
        return (slots[None, None, :] < (fill[:, None] + step.limit)[:, :, None])[:, None]

    def _shared(self, kind: str, layer_idx: int, build) -> Tensor:
        """`build()` for this layer, or the one built for layer 0 of this step when every layer holds the same fill."""
        key = (kind, 0 if self.shared_fill else layer_idx)
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def record_queries(self, layer_idx: int, query: Tensor) -> None:
        """Keep the post-RoPE queries of each row's newest `window` tokens (query: [n, Hq, C, d])."""
        if self.queries is None:
            return
        step = self._current()
        ring = self.queries[layer_idx]
        if isinstance(step, DecodeView):
            rows = self._arange[: step.n]
            ring[rows, :, self.seen[: step.n] % self.window] = query[:, :, 0]
            return
        slots = (self.seen[step.ring_row] + step.ring_offset) % self.window
        ring[step.ring_row, :, slots] = query[step.ring_src[0], :, step.ring_src[1]]

    @property
    def tracks_mass(self) -> bool:
        return self.mass is not None

    def accumulate_mass(self, layer_idx: int, probs: Tensor) -> None:
        """Add attention probabilities [n, Hkv, group, C, S] of real queries to each slot's mass (H2O).

        Summed over the group's query heads and the chunk's real queries, as H2O accumulates over all queries
        that attended to a key.
        """
        step = self._current()
        if isinstance(step, DecodeView):
            self.mass[layer_idx][: step.n, :, : probs.shape[-1]] += probs.sum(dim=(2, 3))
            return
        weighted = probs * step.query_valid[:, None, None, :, None]
        self.mass[layer_idx][step.row_start : step.row_start + step.n, :, : probs.shape[-1]] += weighted.sum(dim=(2, 3))

    # ---- steps ----
    def begin_prefill(self, plan: PrefillPlan) -> None:
        self.step = plan
        self._memo = {}

    def end_prefill(self, plan: PrefillPlan, chunk_lengths: list[int]) -> None:
        """After the forward of `plan`: its rows now hold their new tokens."""
        rows = slice(plan.row_start, plan.row_start + plan.n)
        lengths = torch.tensor(chunk_lengths, dtype=torch.int64)
        self.fill[:, rows] += lengths.to(self.device, non_blocking=True)
        self.seen[rows] += lengths.to(self.device, non_blocking=True)
        self.fill_host[:, rows] += lengths.numpy()
        self.seen_host[rows] += lengths.numpy()
        self.step = None

    def begin_decode(self, view: DecodeView) -> None:
        self.step = view
        self._memo = {}

    def end_decode(self) -> None:
        """After a decode step: every row of the step advanced by one slot (a full row stays full)."""
        n = self._current().n
        self.fill[:, :n] = torch.minimum(self.fill[:, :n] + 1, self._caps)
        self.seen[:n] += 1
        self.step = None

    def advance_host(self, n: int) -> None:
        """The host side of `end_decode`, for rows [0, n)."""
        np.minimum(self.fill_host[:, :n] + 1, self._caps_host, out=self.fill_host[:, :n])
        self.seen_host[:n] += 1

    def decode_spans(self, n: int, granularity: int) -> tuple[int, ...]:
        """Per layer, how many slots a decode step over rows [0, n) must read: the largest fill + 1 (the new token),
        rounded up to `granularity` (fewer distinct shapes for captured graphs), at most the layer's slots."""
        need = self.fill_host[:, :n].max(axis=1) + 1
        spans = -(-need // granularity) * granularity
        return tuple(int(min(s, cap)) for s, cap in zip(spans, self.capacities))

    # ---- rows ----
    def reset_row(self, row: int) -> None:
        self.fill[:, row] = 0
        self.seen[row] = 0
        self.fill_host[:, row] = 0
        self.seen_host[row] = 0

    def park_row(self, row: int) -> None:
        """A row that holds no sequence: full, so that it only ever overwrites its own last slot."""
        self.fill[:, row] = self._caps[:, 0]
        self.fill_host[:, row] = self._caps_host[:, 0]

    def copy_row(self, src: int, dst: int) -> None:
        """Copy row src into row dst: a prefill shared by the samples of one prompt, or a running row moved into a
        finished one's place (running sequences stay in rows [0, n))."""
        for layer in range(self.num_layers):
            n = int(self.fill_host[layer, src])
            for t in (self.key, self.value, self.positions, self.mass):
                if t is not None:
                    t[layer][dst, :, :n] = t[layer][src, :, :n]
            if self.queries is not None:
                self.queries[layer][dst] = self.queries[layer][src]
        self.fill[:, dst] = self.fill[:, src]
        self.seen[dst] = self.seen[src]
        self.fill_host[:, dst] = self.fill_host[:, src]
        self.seen_host[dst] = self.seen_host[src]

    # ---- compression ----
    def layer_keys(self, rows: Tensor, layer: int, n: int) -> Tensor:
        """[R', Hkv, n, d]: the first n slots of `rows` in `layer`."""
        return self.key[layer][rows, :, :n]

    def layer_mass(self, rows: Tensor, layer: int, n: int) -> Tensor | None:
        return None if self.mass is None else self.mass[layer][rows, :, :n]

    def window_queries(self, rows: Tensor, layer: int, m: int) -> Tensor:
        """[R', Hq, m, d]: each row's last m queries, oldest first (every row must have seen at least m)."""
        if self.queries is None:
            raise RuntimeError("this cache does not record queries (compression is off)")
        order = (self.seen[rows, None] - m + torch.arange(m, device=self.device)) % self.window  # [R', m]
        ring = self.queries[layer][rows]  # [R', Hq, window, d]
        return ring.gather(2, order[:, None, :, None].expand(-1, ring.shape[1], -1, ring.shape[-1]))

    def compact(self, rows: Tensor, rows_host: list[int], kept: list[Tensor]) -> None:
        """Keep slots kept[layer] ([R', Hkv, B_l], sorted) of `rows` (a device tensor; the same rows as `rows_host`)
        at the front of each row, in every layer."""
        for layer, idx in enumerate(kept):
            budget = idx.shape[-1]
            gather_kv = idx[..., None].expand(*idx.shape, self.key[layer].shape[-1])
            # gather() materialises the kept slots first, so overwriting the front of the row is safe
            self.key[layer][rows, :, :budget] = self.key[layer][rows].gather(2, gather_kv)
            self.value[layer][rows, :, :budget] = self.value[layer][rows].gather(2, gather_kv)
            self.positions[layer][rows, :, :budget] = self.positions[layer][rows].gather(2, idx)
            if self.mass is not None:
                self.mass[layer][rows, :, :budget] = self.mass[layer][rows].gather(2, idx)
            self.fill[layer, rows] = budget
            self.fill_host[layer, rows_host] = budget

    def held_positions(self, row: int) -> list[Tensor]:
        """Per layer, [Hkv, fill] logical positions the row holds now (device tensors, copies)."""
        return [self.positions[layer][row, :, : int(self.fill_host[layer, row])].clone()
                for layer in range(self.num_layers)]

    @property
    def kv_bytes(self) -> int:
        """Bytes allocated for keys and values (the KV cache proper)."""
        return sum(k.numel() * k.element_size() * 2 for k in self.key)

    def _current(self) -> PrefillPlan | DecodeView:
        if self.step is None:
            raise RuntimeError("BudgetKVCache used outside a planned forward (begin_prefill / begin_decode first)")
        return self.step
