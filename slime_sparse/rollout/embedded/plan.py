"""A prefill forward's work order: which tokens of which cache rows go where, and what attention may read.

A prefill forward runs over a contiguous range of cache rows. Each row contributes a chunk of new tokens (up to a
whole prompt); chunks are left-padded to a common width C so that column C - 1 is every row's newest token.
Padding never reaches the cache: only real tokens are written, and attention reads keys from the cache alone, so
padded columns compute throwaway outputs without touching any real one.

Slots are relative to each layer's fill (a layer's new tokens go right after the slots it holds, and every held
slot is older than the chunk), so one plan serves every layer whatever each one holds; the cache adds its fill.
Decode steps need no plan: every row runs one token at its fill (`cache.DecodeView`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PrefillPlan:
    row_start: int  # rows [row_start, row_start + n) take part
    n: int
    input_ids: Tensor  # [n, C], left-padded (pad id 0)
    position_ids: Tensor  # [n, C]: the logical index of each token in its sequence (0 on padding)
    limit: Tensor  # [n, C]: column j of row b may read slots [0, fill + limit[b, j]) (fill: the layer's, before)
    spans: tuple[int, ...]  # per layer: attention reads slots [0, span) of the rows
    write_src: tuple[Tensor, Tensor]  # (batch row, column) of every real token, [T] each
    write_row: Tensor  # [T] cache row of each real token
    write_offset: Tensor  # [T] its slot relative to the row's fill
    write_pos: Tensor  # [T] its logical position
    ring_src: tuple[Tensor, Tensor]  # (batch row, column) of the queries kept for scoring (last `window` per row)
    ring_row: Tensor  # [Q] cache row of those queries
    ring_offset: Tensor  # [Q] their index relative to the row's queries seen (ring slot = (seen + offset) % window)
    query_valid: Tensor  # [n, C] float32: 1 on real columns (H2O counts attention mass of real queries only)
    lengths: Tensor  # [n] long: each row's chunk length (what its fill and queries seen grow by)


def build_plan(
    row_start: int,
    chunks: list[list[int]],
    fills: list[list[int]],
    first_positions: list[int],
    window: int,
    device: torch.device,
) -> PrefillPlan:
    """Plan a forward in which row row_start + b appends chunks[b] (tokens at logical positions first_positions[b],
    ...) after the fills[l][b] slots it holds in layer l. A row may have an empty chunk (it then only rides along);
    it must already hold at least one slot.
    """
    n = len(chunks)
    lengths = torch.tensor([len(c) for c in chunks], dtype=torch.long)
    first = torch.tensor(first_positions, dtype=torch.long)
    if any(len(c) == 0 and min(layer[b] for layer in fills) == 0 for b, c in enumerate(chunks)):
        raise ValueError("build_plan: a row with an empty chunk must already hold cache slots")
    width = int(lengths.max())
    spans = tuple(max(f + len(c) for f, c in zip(layer, chunks)) for layer in fills)

    rel = torch.arange(width)[None, :] - (width - lengths)[:, None]  # index inside the chunk; < 0 on padding
    real = rel >= 0
    input_ids = torch.zeros(n, width, dtype=torch.long)
    input_ids[real] = torch.tensor([t for c in chunks for t in c], dtype=torch.long)
    position_ids = torch.where(real, first[:, None] + rel, 0)
    limit = torch.where(real, rel + 1, lengths[:, None])  # padding sees the whole row: no empty softmax row

    src_b, src_c = real.nonzero(as_tuple=True)
    ring = real & (rel >= (lengths - window)[:, None])
    ring_b, ring_c = ring.nonzero(as_tuple=True)

    def dev(t: Tensor) -> Tensor:
        return t.to(device, non_blocking=True)

    return PrefillPlan(
        row_start=row_start,
        n=n,
        input_ids=dev(input_ids),
        position_ids=dev(position_ids),
        limit=dev(limit),
        spans=spans,
        write_src=(dev(src_b), dev(src_c)),
        write_row=dev(src_b + row_start),
        write_offset=dev(rel[src_b, src_c]),
        write_pos=dev(position_ids[src_b, src_c]),
        ring_src=(dev(ring_b), dev(ring_c)),
        ring_row=dev(ring_b + row_start),
        ring_offset=dev(rel[ring_b, ring_c]),
        query_valid=dev(real.to(torch.float32)),
        lengths=dev(lengths),
    )
