"""One forward's work order: which tokens of which cache rows go where, and what attention may read.

A forward runs over a contiguous range of cache rows. Each row contributes a chunk of new tokens
(one token when decoding, up to a whole prompt when prefilling); chunks are left-padded to a common
width C so that column C - 1 is every row's newest token. Padding never reaches the cache: only real
tokens are written, and attention reads keys from the cache alone, so padded columns compute throwaway
outputs without touching any real one.

Everything here is built once per forward and shared by every layer, because after a compression all
heads and layers of a row hold the same number of slots (`fill`), the new chunk sits right after them,
and every kept slot is older than the chunk.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class StepPlan:
    row_start: int  # rows [row_start, row_start + n) take part
    input_ids: Tensor  # [n, C], left-padded (pad id 0)
    position_ids: Tensor  # [n, C]: the logical index of each token in its sequence (0 on padding)
    attn_mask: Tensor  # [n, 1, C, S] bool: column j of row b may read slots [0, limit[b, j])
    span: int  # S: attention reads slots [0, S) of the rows
    write_src: tuple[Tensor, Tensor]  # (batch row, column) of every real token, [T] each
    write_row: Tensor  # [T] cache row of each real token
    write_slot: Tensor  # [T] cache slot of each real token
    write_pos: Tensor  # [T] its logical position
    ring_src: tuple[Tensor, Tensor]  # (batch row, column) of the queries kept for scoring (last `window` per row)
    ring_row: Tensor  # [R] cache row of those queries
    ring_slot: Tensor  # [R] their slot in the per-row ring buffer of `window` queries
    query_valid: Tensor  # [n, C] float32: 1 on real columns (H2O counts attention mass of real queries only)
    decode: bool = False  # C = 1 and every row runs one real token: the new keys/queries need no gather


def build_plan(
    row_start: int,
    chunks: list[list[int]],
    fills: list[int],
    first_positions: list[int],
    queries_seen: list[int],
    window: int,
    device: torch.device,
) -> StepPlan:
    """Plan a forward in which row row_start + b appends chunks[b] (tokens at logical positions
    first_positions[b], ...) after its fills[b] held slots. A row may have an empty chunk (it then only
    rides along); it must already hold at least one slot.
    """
    n = len(chunks)
    lengths = torch.tensor([len(c) for c in chunks], dtype=torch.long)
    fill = torch.tensor(fills, dtype=torch.long)
    first = torch.tensor(first_positions, dtype=torch.long)
    seen = torch.tensor(queries_seen, dtype=torch.long)
    if bool(((lengths == 0) & (fill == 0)).any()):
        raise ValueError("build_plan: a row with an empty chunk must already hold cache slots")
    width = int(lengths.max())
    span = int((fill + lengths).max())

    rel = torch.arange(width)[None, :] - (width - lengths)[:, None]  # index inside the chunk; < 0 on padding
    real = rel >= 0
    input_ids = torch.zeros(n, width, dtype=torch.long)
    input_ids[real] = torch.tensor([t for c in chunks for t in c], dtype=torch.long)
    position_ids = torch.where(real, first[:, None] + rel, 0)
    # Real token i sees the fill old slots plus new tokens 0..i (causal). Padding sees the whole row, so that
    # no softmax row is empty (an all-masked row gives NaN, and NaN * 0 would leak through later matmuls).
    limit = fill[:, None] + torch.where(real, rel + 1, lengths[:, None])
    attn_mask = (torch.arange(span)[None, None, :] < limit[:, :, None])[:, None]

    src_b, src_c = real.nonzero(as_tuple=True)
    ring = real & (rel >= (lengths - window)[:, None])
    ring_b, ring_c = ring.nonzero(as_tuple=True)

    def dev(t: Tensor) -> Tensor:
        return t.to(device, non_blocking=True)

    return StepPlan(
        row_start=row_start,
        input_ids=dev(input_ids),
        position_ids=dev(position_ids),
        attn_mask=dev(attn_mask),
        span=span,
        write_src=(dev(src_b), dev(src_c)),
        write_row=dev(src_b + row_start),
        write_slot=dev(fill[src_b] + rel[src_b, src_c]),
        write_pos=dev(position_ids[src_b, src_c].to(torch.int32)),
        ring_src=(dev(ring_b), dev(ring_c)),
        ring_row=dev(ring_b + row_start),
        ring_slot=dev((seen[ring_b] + rel[ring_b, ring_c]) % window),
        query_valid=dev(real.to(torch.float32)),
    )


def decode_plan(tokens: list[int], fills: list[int], positions: list[int], queries_seen: list[int], window: int,
                device: torch.device) -> StepPlan:
    """The plan of a decode step over rows [0, n): row b appends tokens[b] at logical position positions[b] after
    its fills[b] held slots. What `build_plan` gives for one-token chunks, built with a few small tensors: this
    runs once per generated token."""
    n = len(tokens)
    rows = torch.arange(n)
    col = torch.zeros(n, dtype=torch.long)
    fill = torch.tensor(fills, dtype=torch.long)
    pos = torch.tensor(positions, dtype=torch.long)
    span = max(fills) + 1
    attn_mask = (torch.arange(span)[None, :] <= fill[:, None])[:, None, None]  # the new token sees fill + 1 slots
    ring_slot = torch.tensor([s % window for s in queries_seen], dtype=torch.long)

    def dev(t: Tensor) -> Tensor:
        return t.to(device, non_blocking=True)

    rows, col = dev(rows), dev(col)
    return StepPlan(
        row_start=0,
        input_ids=dev(torch.tensor(tokens, dtype=torch.long)[:, None]),
        position_ids=dev(pos[:, None]),
        attn_mask=dev(attn_mask),
        span=span,
        write_src=(rows, col),
        write_row=rows,
        write_slot=dev(fill),
        write_pos=dev(pos.to(torch.int32)),
        ring_src=(rows, col),
        ring_row=rows,
        ring_slot=dev(ring_slot),
        query_valid=dev(torch.ones(n, 1)),
        decode=True,
    )
