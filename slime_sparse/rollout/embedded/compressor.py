"""Compaction: the rows that reached their trigger, every layer, in one batched call (or one CUDA graph replay).

A call takes rows that hold the same number of slots n_l in each layer l (rows that reached the trigger together do;
so does one prefilled prompt) and, for each group of layers of equal n (every layer, under one budget):
    keys, queries, mass of (layer, row) -> cache.gather: [E, ...], one copy of what is scored, E entries at a time
    scores [L', R', Hkv, n]             -> the method's `score`, batched over the entries of a chunk (kv/methods)
    kept [L', R'', H', W]               -> `kv.choose_slots`: granularity, top-k under the protected sinks and window
    the cache                           -> `cache.compact`: kept slots to the front of every row, fills set on device
    keep bits [R'', bits]               -> `kv.record.keep_bits` + `pack_rows`: the eviction record, built here
Bounded scratch: scoring runs over chunks of (layer, row) entries and selection + compaction over chunks of rows, each
chunk sized so that its temporaries fit `workspace_bytes` (kv/engine_memory.py counts them, and admission counts the
workspace once); only the fp32 scores of every entry and the packed bits outlive a chunk. The entries are
independent, so the chunking changes no selection.
No host synchronisation and no host data: the row numbers arrive as a device tensor, the host learns nothing back but
the packed keep bits, copied to pinned memory without waiting. Decode-time compactions have fixed shapes (rows padded
to a bucket by repeating a due row: identical writes; the chunks follow from the shapes), so on CUDA each
(bucket, n, m) is a graph of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from slime_sparse.kv import KVCompressConfig, choose_slots, shares_selection
from slime_sparse.kv import engine_memory
from slime_sparse.kv.engine_memory import EntryShape, compaction_chunks
from slime_sparse.kv.record import keep_bits, pack_rows
from slime_sparse.kv.scoring import needs_queries

from .cache import BudgetKVCache
from .graphs import CapturedGraphs
from .transfer import to_device, to_host


@dataclass(frozen=True)
class PackedBits:
    """One compaction's eviction record entries, on their way to the host: row i of `bits` (pinned memory, valid once
    the stream reaches the copy) holds the `nbits` keep bits of the i-th compressed row."""

    bits: Tensor  # [R', ceil(nbits / 8)] uint8
    nbits: int


class Compressor:
    def __init__(self, cache: BudgetKVCache, kv: KVCompressConfig, budgets: tuple[int, ...],
                 graphs: CapturedGraphs | None = None, workspace_bytes: int | None = None) -> None:
        self.cache, self.kv, self.budgets, self.graphs = cache, kv, budgets, graphs
        self.workspace_bytes = workspace_bytes  # None: engine_memory.COMPACTION_WORKSPACE_BYTES when a call runs
        self.entry_shape = EntryShape.of_cache(cache)
        self.scorer = kv.scorer
        self.uses_queries = needs_queries(self.scorer, has_mass=cache.mass is not None)
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
        count = rows.shape[0]
        workspace = self.workspace_bytes or engine_memory.COMPACTION_WORKSPACE_BYTES
        chunks = {n: compaction_chunks(self.kv, self.entry_shape, len(layers), count, n, m,
                                       max(self.budgets[layer] for layer in layers), workspace, rows.device.type)
                  for n, layers in groups.items()}
        scores = {n: self._scores(self._layers(layers), rows, n, m, chunks[n][0]) for n, layers in groups.items()}
        step = min(rows_per_chunk for _, rows_per_chunk in chunks.values())
        if step >= count:
            return self._select_and_compact(rows, groups, scores)
        packed = None
        for start in range(0, count, step):
            part = self._select_and_compact(rows[start : start + step], groups,
                                            {n: s[:, start : start + step] for n, s in scores.items()})
            if packed is None:
                packed = torch.empty(count, part.shape[1], dtype=part.dtype, device=part.device)
            packed[start : start + step] = part
            del part  # not held while the next chunk runs
        return packed

    def _scores(self, index: Tensor, rows: Tensor, n: int, m: int, per_chunk: int) -> Tensor:
        """Scores [L', R', Hkv, n] of layers `index` x `rows`, holding n slots, from their last m queries, scored
        `per_chunk` (layer, row) entries at a time."""
        shape = (index.shape[0], rows.shape[0])
        layer_of = index[:, None].expand(shape).reshape(-1)  # entry e = layer-major (layer, row) pair
        row_of = rows[None, :].expand(shape).reshape(-1)
        entries = layer_of.shape[0]
        if per_chunk >= entries:
            scores = self._score_entries(layer_of, row_of, n, m)
            return scores.view(*shape, *scores.shape[1:])
        out = torch.empty(entries, self.cache.num_kv_heads, n, dtype=torch.float32, device=rows.device)
        for start in range(0, entries, per_chunk):  # a chunk's inputs and temporaries are freed before the next
            end = start + per_chunk
            out[start:end] = self._score_entries(layer_of[start:end], row_of[start:end], n, m)
        return out.view(*shape, *out.shape[1:])

    def _score_entries(self, layers: Tensor, rows: Tensor, n: int, m: int) -> Tensor:
        """Scores [E, Hkv, n] of the entries (layers[e], rows[e])."""
        cache = self.cache
        keys = cache.gather(cache.key, layers, rows, n)
        queries = cache.window_queries(layers, rows, m) if self.uses_queries else None
        mass = cache.gather(cache.mass, layers, rows, n) if cache.mass is not None else None
        return self.scorer.score(keys, queries, mass)

    def _select_and_compact(self, rows: Tensor, groups: dict[int, list[int]], scores: dict[int, Tensor]) -> Tensor:
        """Choose the kept slots of `rows` from their scores [L', R'', Hkv, n] per group, move them to the front of
        each row, and return the rows' packed keep bits [R'', bytes]."""
        pieces: dict[int, Tensor] = {}  # stored layer -> its bits [R'', H' * n]
        for n, layers in groups.items():
            index = self._layers(layers)
            kept = choose_slots(self.kv, scores[n], [self.budgets[layer] for layer in layers])  # [L' or 1, R'', H', W]
            self.cache.compact(index, rows, kept, self._budgets[index].clamp(max=n))
            bits = keep_bits(kept, n)  # [R'', L'' * H' * n]
            if len(groups) == 1:
                return pack_rows(bits)
            for layer, part in zip(layers, bits.view(bits.shape[0], len(layers), -1).unbind(1)):
                pieces[layer] = part
        return pack_rows(torch.cat([pieces[layer] for layer in sorted(pieces)], dim=-1))
