"""A preallocated, budgeted KV cache that plugs into transformers models as `past_key_values`: device tensors only.

Layout (allocated once per runner, never grown; L layers, R rows, S slots per row and layer):
    key, value   [L, R, Hkv, S, d]    post-RoPE keys and values, model dtype
    positions    [L, R, Hkv, S]       logical position of the token in each slot (int32)
    queries      [L, R, Hq, window, d] ring buffer of the last `window` post-RoPE queries (methods that score with them)
    mass         [L, R, Hkv, S]       accumulated attention probability per slot (H2O only, float32)
    fill         [L, R] int64         valid slots of each layer and row
    seen         [R] int64            queries that went through the ring
Row r holds one sequence; in layer l its first fill[l, r] slots are valid, in chronological order, the same count for
every head. Slots past the fill hold stale but finite values and are masked out. A decode step writes at
min(fill, S - 1) and leaves fill at most S: a live row always has room (the scheduler sizes and compresses it so),
while a row that holds no live sequence (padding of a captured batch size, a finished row not yet retired) keeps
overwriting its own last slot, so a fixed-shape step never writes out of bounds and never touches a live row.

The host never reads `fill` or `seen`: every change to them is one the scheduler decides (a step, an admission, a
compression), made through `rows.Rows`, which keeps the host's copy (`table.RowTable`) and checks the two agree.
Every method here is free of host synchronisation and of host data (nothing but device tensors and shapes goes in),
so decode steps and compactions can be captured.

The model calls `update(k, v, layer_idx)` with the post-RoPE keys of the new tokens; we write them where the current
step says (`PrefillPlan` or `DecodeView`) and return views over the rows' first `span` slots. The attention function
in `attention.py` reads its mask from here (`attention_mask`) and records queries and (for H2O) attention mass here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from .plan import PrefillPlan


@dataclass(frozen=True)
class DecodeView:
    """What a decode step runs over: rows [0, n), each with one new token, attention over slots [0, spans[l])."""

    n: int
    spans: tuple[int, ...]  # per layer
    positions: Tensor  # [n] logical position of each row's new token (a view of the decode state)


class BudgetKVCache(Cache):
    def __init__(self, *, num_rows: int, num_layers: int, num_kv_heads: int, num_q_heads: int, head_dim: int,
                 capacity: int, window: int, record_queries: bool, track_mass: bool, device: torch.device,
                 dtype: torch.dtype, shared_fill: bool = True, zeros: Callable[..., Tensor] | None = None) -> None:
        super().__init__(layers=[])  # we keep our own tensors; transformers' per-layer objects are unused
        self.num_layers, self.num_kv_heads, self.capacity, self.window = num_layers, num_kv_heads, capacity, window
        self.device = device
        # zeros(shape, dtype): where the large tensors come from (the runner's arena, which can give them back)
        zeros = zeros or (lambda shape, dt: torch.zeros(shape, device=device, dtype=dt))
        rows_slots = (num_layers, num_rows, num_kv_heads, capacity)
        self.key = zeros((*rows_slots, head_dim), dtype)
        self.value = zeros((*rows_slots, head_dim), dtype)
        self.positions = zeros(rows_slots, torch.int32)
        self.queries = (zeros((num_layers, num_rows, num_q_heads, window, head_dim), dtype)
                        if record_queries else None)
        self.mass = zeros(rows_slots, torch.float32) if track_mass else None
        self.fill = torch.zeros(num_layers, num_rows, dtype=torch.int64, device=device)
        self.seen = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self._arange_rows = torch.arange(num_rows, device=device)
        self._arange_layers = torch.arange(num_layers, device=device)
        self._slots = torch.arange(capacity, device=device)
        self._zero = torch.zeros((), device=device)  # a new slot's attention mass: a device value, no host scalar
        # one budget for every layer: every layer holds the same fill, so a step's masks are built once (`_memoised`)
        self.shared_fill = shared_fill
        self.step: PrefillPlan | DecodeView | None = None
        self.decode_backend = "sdpa"  # how decode attention reads the rows (attention.DECODE_BACKENDS)
        self._memo: dict[tuple[str, int], Tensor] = {}

    @property
    def num_rows(self) -> int:
        return self.fill.shape[1]

    @property
    def kv_bytes(self) -> int:
        """Bytes allocated for keys and values (the KV cache proper)."""
        return self.key.numel() * self.key.element_size() * 2

    @property
    def tracks_mass(self) -> bool:
        return self.mass is not None

    # ---- transformers Cache interface (only what Qwen2/Llama use when positions and masks are ours) ----
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Write the new tokens' keys/values, return [n, Hkv, span, d] views of the rows being run."""
        step = self._current()
        key, value, positions = self.key[layer_idx], self.value[layer_idx], self.positions[layer_idx]
        if isinstance(step, DecodeView):  # positions: every layer's at once, in `begin`
            rows, slots = self._arange_rows[: step.n], self._decode_slots()[layer_idx]
            new_k, new_v = key_states[:, :, 0], value_states[:, :, 0]
            first = 0
        else:
            rows, slots = step.write_row, self.fill[layer_idx, step.write_row] + step.write_offset
            src_b, src_c = step.write_src
            new_k, new_v = key_states[src_b, :, src_c], value_states[src_b, :, src_c]
            positions[rows, :, slots] = step.write_pos.to(torch.int32)[:, None].expand(-1, self.num_kv_heads)
            first = step.row_start
        # Advanced indices on dims 0 and 2 around a slice: both sides are [T, Hkv, d].
        key[rows, :, slots] = new_k
        value[rows, :, slots] = new_v
        if self.mass is not None:
            self.mass[layer_idx][rows, :, slots] = self._zero
        span = step.spans[layer_idx]
        return key[first : first + step.n, :, :span], value[first : first + step.n, :, :span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Some transformers versions derive `cache_position` from it; the engine passes explicit positions and masks,
        # so nothing reads the result. 0 needs no host read of the device fills.
        return 0

    def _decode_slots(self) -> Tensor:
        """[L, n]: the slot each row's new token goes to in each layer, at its fill (a full row: its last slot)."""
        n = self._current().n
        return self._memoised("slots", -1, lambda: self.fill[:, :n].clamp(max=self.capacity - 1))

    # ---- hooks for the attention function ----
    def decode_lengths(self, layer_idx: int) -> Tensor:
        """[n] int32: the slots each row's new token attends to in a decode step, [0, length): its fill and itself (a
        row without a sequence, parked full: its whole span of finite stale slots). What a length-reading kernel
        reads instead of `attention_mask`."""
        step = self._current()
        span = step.spans[layer_idx]
        return self._memoised("lengths", span, lambda: (self.fill[layer_idx, : step.n] + 1).clamp(max=span)
                              .to(torch.int32), layer_idx)

    def attention_mask(self, layer_idx: int) -> Tensor:
        """[n, 1, C, span] bool: which slots each query of the current step may read (C = 1 when decoding)."""
        step = self._current()
        # layers of equal span and fill share one mask per step (every layer, under one budget)
        return self._memoised("mask", step.spans[layer_idx], lambda: self._mask(layer_idx), layer_idx)

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

    def _memoised(self, kind: str, key: int, build, layer_idx: int | None = None) -> Tensor:
        """`build()` once per step and key; per layer too when the layers' fills differ (`shared_fill` False)."""
        memo_key = (kind, key if self.shared_fill or layer_idx is None else (key, layer_idx))
        if memo_key not in self._memo:
            self._memo[memo_key] = build()
        return self._memo[memo_key]

    def record_queries(self, layer_idx: int, query: Tensor) -> None:
        """Keep the post-RoPE queries of each row's newest `window` tokens (query: [n, Hq, C, d])."""
        if self.queries is None:
            return
        step = self._current()
        ring = self.queries[layer_idx]
        if isinstance(step, DecodeView):
            ring_slots = self._memoised("ring", -1, lambda: self.seen[: step.n] % self.window)
            ring[self._arange_rows[: step.n], :, ring_slots] = query[:, :, 0]
            return
        slots = (self.seen[step.ring_row] + step.ring_offset) % self.window
        ring[step.ring_row, :, slots] = query[step.ring_src[0], :, step.ring_src[1]]

    def accumulate_mass(self, layer_idx: int, probs: Tensor) -> None:
        """Add attention probabilities [n, Hkv, group, C, S] of real queries to each slot's mass (H2O).

        Summed over the group's query heads and the chunk's real queries, as H2O accumulates over all queries that
        attended to a key.
        """
        step = self._current()
        if isinstance(step, DecodeView):
            self.mass[layer_idx][: step.n, :, : probs.shape[-1]] += probs.sum(dim=(2, 3))
            return
        weighted = probs * step.query_valid[:, None, None, :, None]
        self.mass[layer_idx][step.row_start : step.row_start + step.n, :, : probs.shape[-1]] += weighted.sum(dim=(2, 3))

    # ---- steps ----
    def begin(self, step: PrefillPlan | DecodeView) -> None:
        self.step = step
        self._memo = {}
        if isinstance(step, DecodeView):  # the new tokens' positions, every layer in one write
            layers, rows = self._arange_layers[:, None], self._arange_rows[None, : step.n]
            self.positions[layers, rows, :, self._decode_slots()] = \
                step.positions.to(torch.int32)[None, :, None].expand(self.num_layers, -1, self.num_kv_heads)

    def end_prefill(self) -> None:
        """After the forward of the current plan: its rows hold their new tokens."""
        plan = self._current()
        rows = slice(plan.row_start, plan.row_start + plan.n)
        self.fill[:, rows] += plan.lengths
        self.seen[rows] += plan.lengths
        self.step = None

    def end_decode(self) -> None:
        """After a decode step: every row of the step advanced by one slot (a full row stays full)."""
        n = self._current().n
        self.fill[:, :n].add_(1).clamp_(max=self.capacity)
        self.seen[:n].add_(1)
        self.step = None

    # ---- rows (eager, between steps; fill_ takes its value as a kernel argument: no host-to-device copy, which from
    # pageable memory would wait for every queued step) ----
    def reset_row(self, row: int) -> None:
        self.fill[:, row].fill_(0)
        self.seen[row].fill_(0)

    def park_row(self, row: int) -> None:
        """A row that holds no sequence: full, so that it only ever overwrites its own last slot."""
        self.fill[:, row].fill_(self.capacity)

    def copy_row(self, src: int, dst: int, held: int) -> None:
        """Copy row src into row dst (`held`: the most slots src holds in a layer): a prefill shared by the samples of
        one prompt, or a running row moved into a finished one's place (running sequences stay in rows [0, n))."""
        for t in (self.key, self.value, self.positions, self.mass):
            if t is not None:
                t[:, dst, :, :held] = t[:, src, :, :held]
        if self.queries is not None:
            self.queries[:, dst] = self.queries[:, src]
        self.fill[:, dst] = self.fill[:, src]
        self.seen[dst] = self.seen[src]

    # ---- compaction (compressor.py) ----
    def gather(self, t: Tensor, layers: Tensor, rows: Tensor, n: int | None = None) -> Tensor:
        """[E, ...] copy of the first n slots (all, for n None) of entries (layers[e], rows[e]) of a cache tensor (both
        [E]): one indexing op that copies only what it returns."""
        if n is not None:
            t = t[:, :, :, :n]
        return t[layers, rows]

    def window_queries(self, layers: Tensor, rows: Tensor, m: int) -> Tensor:
        """[E, Hq, m, d]: the last m queries of entries (layers[e], rows[e]), oldest first (every row has seen at least
        m)."""
        if self.queries is None:
            raise RuntimeError("this cache does not record queries")
        order = (self.seen[rows, None] - m + torch.arange(m, device=self.device)) % self.window  # [E, m]
        ring = self.gather(self.queries, layers, rows)  # [E, Hq, window, d]
        return ring.gather(2, order[:, None, :, None].expand(-1, ring.shape[1], -1, ring.shape[3]))

    def compact(self, layers: Tensor, rows: Tensor, kept: Tensor, fill_after: Tensor) -> None:
        """Move slots kept [L', R', H', W] (sorted; L' and H' may be 1: shared by every layer / head) of `layers`
        (x `rows`) to the front of each row, then set those fills to fill_after [L'']: one gather and one scatter
        per tensor over the flattened cache, reading and writing only the kept slots."""
        n_layers, n_rows = layers.shape[0], rows.shape[0]
        width = kept.shape[-1]
        heads = torch.arange(self.num_kv_heads, device=self.device)
        base = ((layers[:, None, None] * self.num_rows + rows[None, :, None]) * self.num_kv_heads + heads) \
            * self.capacity  # [L', R', Hkv]: flat index of slot 0
        kept = kept.expand(n_layers, n_rows, self.num_kv_heads, width)
        src = (base[..., None] + kept).flatten()
        dst = (base[..., None] + self._slots[:width]).flatten()
        for t in (self.key, self.value, self.positions, self.mass):
            if t is not None:
                flat = t.view(-1, t.shape[-1]) if t.dim() == 5 else t.view(-1)
                flat.index_copy_(0, dst, flat.index_select(0, src))  # index_select copies first: overlap is safe
        self.fill[layers[:, None], rows[None, :]] = fill_after[:, None].expand(n_layers, n_rows)

    def held_positions(self, row: int, fills: list[int]) -> list[Tensor]:
        """Per layer, [Hkv, fill] logical positions the row holds now (fills: the scheduler's count per layer)."""
        return [self.positions[layer, row, :, :fill].clone() for layer, fill in enumerate(fills)]

    def _current(self) -> PrefillPlan | DecodeView:
        if self.step is None:
            raise RuntimeError("BudgetKVCache used outside a planned forward (begin a prefill or decode step first)")
        return self.step
