"""What a compressed cache let each token see: the eviction record of one sample, and the attention mask it implies.

An engine compresses a sequence's cache only between forwards. Compression e happens once the first `starts[e]`
tokens (positions [0, starts[e])) went through the model and keeps, per layer and KV head, the logical positions
`kept[e, layer, head]` (all < starts[e]). Every token run after it is appended, so the query at position q saw

    K_e(q)[layer, head]  U  [starts[e(q)], q]      e(q) = the last compression with starts[e] <= q

and, with no compression before it, plainly [0, q]. That is the whole record: the rest follows from causality,
and a learner that rebuilds this mask recomputes the sampler's log-probs in one forward (the "shadow" policy).

Compactness: one bit per slot a compression chose from (`EvictionRecord`); a dimension on which every compression
kept the same positions (all heads of a layer under granularity 'layer', all layers under 'model', every head and
layer for StreamingLLM) is stored once (size 1) instead of once per head / layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class EvictionRecord:
    """The compressions of one sample, encoded as keep bits over what each compression could choose from.

    Before compression e a row holds, per layer and head, H_e = kept_{e-1} U [starts[e-1], starts[e]) (sorted;
    H_0 = [0, starts[0])), and it keeps B of them: one bit per held slot says which. That costs (B + buffer) / 8
    bytes per layer and head per compression instead of 2 * B for the positions themselves (12.8x less at the
    paper's budget 512, buffer 128). `kept_positions()` decodes.

    starts: [E] int64, non-decreasing. keep_bits: uint8, the bits of every compression in order, each [L', H', |H_e|]
    flattened, packed 8 per byte. shape: (L', H', B), L' in {1, L}, H' in {1, Hkv}.
    """

    starts: Tensor
    keep_bits: Tensor
    shape: tuple[int, int, int]

    @classmethod
    def from_events(cls, events: list[tuple[int, Tensor]]) -> "EvictionRecord | None":
        """From (tokens processed before the compression, kept positions [L, Hkv, B]) in order; None if none."""
        if not events:
            return None
        starts = torch.tensor([s for s, _ in events], dtype=torch.int64)
        if bool((starts[1:] < starts[:-1]).any()):
            raise ValueError(f"eviction events out of order: starts {starts.tolist()}")
        kept = torch.stack([k.to("cpu", torch.int64) for _, k in events]).sort(dim=-1).values  # [E, L, H, B]
        for dim in (2, 1):  # heads first: a layer-granular record still differs across layers
            if kept.shape[dim] > 1 and bool((kept == kept.narrow(dim, 0, 1)).all()):
                kept = kept.narrow(dim, 0, 1)
        kept = kept.contiguous()  # searchsorted wants contiguous inputs
        bits = []
        for held, chosen in zip(_held_before(starts, kept), kept):
            slot = torch.searchsorted(held, chosen).clamp(max=held.shape[-1] - 1)
            if not torch.equal(held.gather(-1, slot), chosen):
                raise ValueError("eviction record keeps a position its row did not hold (outside [0, start) "
                                 "or evicted before)")
            bits.append(torch.zeros_like(held, dtype=torch.bool).scatter_(-1, slot, True).flatten())
        return cls(starts=starts, keep_bits=pack_bits(torch.cat(bits)), shape=tuple(kept.shape[1:]))

    def kept_positions(self) -> Tensor:
        """[E, L', H', B] int64: the positions each compression kept."""
        n_layers, n_heads, budget = self.shape
        bits = unpack_bits(self.keep_bits)
        kept, offset = [], 0
        for e in range(self.starts.numel()):
            held = (torch.arange(int(self.starts[0])).expand(n_layers, n_heads, -1) if e == 0 else
                    torch.cat([kept[-1], torch.arange(int(self.starts[e - 1]), int(self.starts[e])).expand(
                        n_layers, n_heads, -1)], dim=-1))
            size = held.numel()
            chosen = bits[offset: offset + size].view(held.shape)
            offset += size
            kept.append(held[chosen].view(n_layers, n_heads, budget))
        return torch.stack(kept)

    @property
    def nbytes(self) -> int:
        """What shipping the record costs (the keep bits + one int32 start per compression)."""
        return self.keep_bits.numel() + self.starts.numel() * 4

    def check(self, num_layers: int, num_kv_heads: int, length: int) -> None:
        """Raise ValueError when the record cannot belong to a model / sequence of these sizes."""
        n_layers, n_heads, _ = self.shape
        if n_layers not in (1, num_layers) or n_heads not in (1, num_kv_heads):
            raise ValueError(f"eviction record has {n_layers} layers x {n_heads} KV heads, "
                             f"the model {num_layers} x {num_kv_heads}")
        if int(self.starts[-1]) > length:
            raise ValueError(f"eviction record compresses after {int(self.starts[-1])} tokens of a {length}-token sequence")


def _held_before(starts: Tensor, kept: Tensor) -> list[Tensor]:
    """H_e [L', H', n_e] for every compression e, from the kept positions of the ones before it."""
    shape = kept.shape[1:3]
    held = [torch.arange(int(starts[0])).expand(*shape, -1).contiguous()]
    for e in range(1, starts.numel()):
        recent = torch.arange(int(starts[e - 1]), int(starts[e])).expand(*shape, -1)
        held.append(torch.cat([kept[e - 1], recent], dim=-1))
    return held


_BIT = 2 ** torch.arange(8, dtype=torch.uint8)


def pack_bits(bits: Tensor) -> Tensor:
    """Flat bits packed 8 per uint8, bit j of a byte worth 2**j; zero-padded to a whole byte."""
    padded = torch.zeros((bits.numel() + 7) // 8 * 8, dtype=torch.uint8)
    padded[: bits.numel()] = bits.to(torch.uint8)
    return (padded.view(-1, 8) * _BIT).sum(dim=-1, dtype=torch.uint8)


def unpack_bits(packed: Tensor) -> Tensor:
    """pack_bits' inverse: [8 * bytes] bool (the padding included)."""
    return ((packed[:, None] & _BIT) > 0).flatten()


def visible_positions(record: EvictionRecord | None, width: int, layer: int) -> Tensor:
    """[H', width, width] bool (H' = 1 without a record): query q may read key j, for one layer.

    Rows past a sample's length are ordinary causal rows (the caller ignores their outputs; a row with nothing
    visible would make softmax NaN).
    """
    if record is None:
        return _causal(width)[None]
    return visible_from_kept(record.starts, record.kept_positions(), width, layer)


def visible_from_kept(starts: Tensor, kept: Tensor, width: int, layer: int) -> Tensor:
    """`visible_positions` from decoded kept positions [E, L', H', B] (decode once, build every layer's mask)."""
    kept = kept[:, layer if kept.shape[1] > 1 else 0]  # [E, H', B]
    n_events, n_heads, _ = kept.shape
    member = torch.zeros(n_events + 1, n_heads, width, dtype=torch.bool)  # event 0 = "no compression yet"
    member[1:].scatter_(-1, kept, True)
    q = torch.arange(width)
    epoch = torch.searchsorted(starts, q, right=True)  # [q]: compressions at or before q
    start = torch.cat([torch.zeros(1, dtype=torch.int64), starts])[epoch]  # [q]
    recent = q[None, :] >= start[:, None]  # [q, j]: run after the last compression
    held = member[epoch].permute(1, 0, 2) | recent[None]  # [H', q, j]
    return held & _causal(width)[None]


def _causal(width: int) -> Tensor:
    q = torch.arange(width)
    return q[None, :] <= q[:, None]  # [q, j]
