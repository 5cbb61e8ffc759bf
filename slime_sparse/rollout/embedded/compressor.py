"""Compaction: the rows that reached their trigger, every layer, in one batched call (or one CUDA graph replay).

A call takes rows that hold the same number of slots n_l in each layer l (rows that reached the trigger together do;
so does one prefilled prompt) and, for each group of layers of equal n (every layer, under one budget):
    keys, queries, mass of those rows   -> cache.gather: [L', R', ...], one copy of what is scored
    scores [L', R', Hkv, n]             -> the method's `score`, batched over layers and rows (kv/methods)
    kept [L', R', H', W]                -> `kv.choose_slots`: granularity, top-k under the protected sinks and window
    the cache                           -> `cache.compact`: kept slots to the front of every row, fills set on device
    keep bits [R', bits]                -> `kv.record.keep_bits` + `pack_rows`: the eviction record, built here
No host synchronisation and no host data: the row numbers arrive as a device tensor, the host learns nothing back but
the packed keep bits, copied to pinned memory without waiting. Decode-time compactions have fixed shapes (rows padded
to a bucket by repeating a due row: identical writes), so on CUDA each (bucket, n, m) is a graph of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from slime_sparse.kv import KVCompressConfig, choose_slots, shares_selection
from slime_sparse.kv.record import keep_bits, pack_rows

from .cache import BudgetKVCache
from .step import CapturedGraphs


@dataclass(frozen=True)
class PackedBits:
    """One compaction's eviction record entries, on their way to the host: row i of `bits` (pinned memory, valid once
    the stream reaches the copy) holds the `nbits` keep bits of the i-th compressed row."""

    bits: Tensor  # [R', ceil(nbits / 8)] uint8
    nbits: int


class Compressor:
    def __init__(self, cache: BudgetKVCache, kv: KVCompressConfig, budgets: tuple[int, ...],
                 graphs: CapturedGraphs | None = None) -> None:
        self.cache, self.kv, self.budgets, self.graphs = cache, kv, budgets, graphs
        self.scorer = kv.scorer
        self.uses_queries = self.scorer.needs_queries or (self.scorer.tracks_mass and cache.mass is None)
        shared_heads, shared_layers = shares_selection(kv)
        # what the eviction record stores: (layers, heads, largest budget), and the budgets when they differ
        self.record_shape = (1 if shared_layers else cache.num_layers, 1 if shared_heads else cache.num_kv_heads,
                             max(budgets))
        self.record_budgets = None if len(set(budgets)) == 1 or shared_layers else budgets
        device = cache.device
        self._budgets = torch.tensor(budgets, device=device)
        self._layer_sets: dict[tuple[int, ...], Tensor] = {}
        self._rows = torch.zeros(cache.num_rows, dtype=torch.int64, device=device)  # graphs read rows from here
        self.compactions = 0

    def __call__(self, rows: list[int], sizes: tuple[int, ...], m: int, bucket: int | None = None) -> PackedBits:
        """Compress `rows` (each holding sizes[l] slots in layer l, scored with their last m queries) to their layer
        budgets. bucket: pad the rows to this many and replay a captured graph (decode compactions on CUDA)."""
        groups: dict[int, list[int]] = {}
        for layer, n in enumerate(sizes):
            groups.setdefault(n, []).append(layer)
        nbits = self.record_shape[1] * sum(sizes[: self.record_shape[0]])  # the stored layers' held slots, per head
        count = len(rows)
        if self.graphs is not None and bucket is not None:
            host = torch.tensor(rows + rows[:1] * (bucket - count), dtype=torch.int64).pin_memory()
            self._rows[:bucket].copy_(host, non_blocking=True)
            packed = self.graphs.run(("compact", bucket, sizes, m), lambda: self._compact(self._rows[:bucket], groups, m))
        else:
            packed = self._compact(to_device(rows, self.cache.device), groups, m)
        self.compactions += 1
        return PackedBits(to_host(packed[:count]), nbits)

    def _layers(self, layers: list[int]) -> Tensor:
        key = tuple(layers)
        if key not in self._layer_sets:
            self._layer_sets[key] = to_device(layers, self.cache.device)
        return self._layer_sets[key]

    def _compact(self, rows: Tensor, groups: dict[int, list[int]], m: int) -> Tensor:
        """The compaction itself, device work only (what a graph captures): packed keep bits [R', bytes]."""
        cache = self.cache
        pieces: dict[int, Tensor] = {}  # stored layer -> its bits [R', H' * n]
        for n, layers in groups.items():
            index = self._layers(layers)
            every = len(layers) == cache.num_layers  # then plain slicing instead of a layer index
            keys = cache.gather(cache.key, None if every else index, rows, n)
            queries = cache.window_queries(None if every else index, rows, m) if self.uses_queries else None
            mass = cache.gather(cache.mass, None if every else index, rows, n) if cache.mass is not None else None
            scores = self.scorer.score(keys, queries, mass)  # [L', R', Hkv, n]
            kept = choose_slots(self.kv, scores, [self.budgets[layer] for layer in layers])  # [L' or 1, R', H', W]
            cache.compact(index, rows, kept, self._budgets[index].clamp(max=n))
            bits = keep_bits(kept, n)  # [R', L'' * H' * n]
            if len(groups) == 1:
                return pack_rows(bits)
            for layer, part in zip(layers, bits.view(bits.shape[0], len(layers), -1).unbind(1)):
                pieces[layer] = part
        return pack_rows(torch.cat([pieces[layer] for layer in sorted(pieces)], dim=-1))


def to_device(values: list[int], device: torch.device) -> Tensor:
    """Ints as an int64 tensor on `device`, copied without waiting for the device (pinned memory on CUDA: a copy from
    pageable memory would first wait for every queued kernel)."""
    index = torch.tensor(values, dtype=torch.int64)
    return index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index.to(device)


def to_host(t: Tensor) -> Tensor:
    """A host copy of `t` that does not wait for the device (pinned memory; valid once the stream gets there)."""
    if t.device.type != "cuda":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)
