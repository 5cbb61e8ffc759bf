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
from typing import Sequence

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class EvictionRecord:
    """The compressions of one sample, encoded as keep bits over what each compression could choose from.

    Before compression e a row holds, per layer and head, H_e = kept_{e-1} U [starts[e-1], starts[e]) (sorted;
    H_0 = [0, starts[0])), and it keeps B_l of them: one bit per held slot says which. That costs (B + buffer) / 8
    bytes per layer and head per compression instead of 2 * B for the positions themselves (12.8x less at the
    paper's budget 512, buffer 128). `kept_by_layer()` decodes.

    starts: [E] int64, non-decreasing. keep_bits: uint8, the bits of every compression in order, each the
    concatenation over stored layers of that layer's [H', |H_e,l|] bits, packed 8 per byte (under one budget: one
    [L', H', |H_e|] block, the layout of records written before per-layer budgets). shape: (L', H', max_l B_l),
    L' in {1, L}, H' in {1, Hkv}. budgets: B_l per stored layer, or None when every layer keeps shape[2].
    """

    starts: Tensor
    keep_bits: Tensor
    shape: tuple[int, int, int]
    budgets: tuple[int, ...] | None = None

    @property
    def layer_budgets(self) -> tuple[int, ...]:
        """B_l of each stored layer (L' entries)."""
        return self.budgets if self.budgets is not None else (self.shape[2],) * self.shape[0]

    @classmethod
    def from_events(cls, events: list[tuple[int, Tensor | Sequence[Tensor]]]) -> "EvictionRecord | None":
        """From (tokens processed before the compression, kept positions) in order; None if none. (Engines build their
        records from keep bits computed on the device, `from_keep_bits`; this is the reference encoding the tests
        compare them with, and the constructor for positions known on the host.) Kept positions:
        [L, Hkv, B] under one budget, or one [Hkv, k_l] per layer. A layer keeps B_l at every compression but one
        that found fewer slots than that (a prompt shorter than the layer's budget, cut after prefill under per-layer
        budgets: it keeps them all); the keep bits say how many either way."""
        if not events:
            return None
        starts = torch.tensor([s for s, _ in events], dtype=torch.int64)
        if bool((starts[1:] < starts[:-1]).any()):
            raise ValueError(f"eviction events out of order: starts {starts.tolist()}")
        per_event = [_as_layers(k) for _, k in events]  # per event, per layer [H, k], positions sorted
        n_layers = len(per_event[0])
        if any(len(layers) != n_layers for layers in per_event):
            raise ValueError("eviction events cover different numbers of layers")
        kept = [[layers[layer].sort(dim=-1).values for layers in per_event] for layer in range(n_layers)]  # [l][e]
        if all(k.shape[0] > 1 and bool((k == k[:1]).all()) for ks in kept for k in ks):  # heads first: a layer-
            kept = [[k[:1] for k in ks] for ks in kept]                                   # granular record still
        if n_layers > 1 and all(_same(ks, kept[0]) for ks in kept):                       # differs by layer
            kept = kept[:1]
        bits = []
        for e in range(starts.numel()):
            for layer, held in enumerate(_held_from(starts, e, [ks[e - 1] for ks in kept] if e else None, len(kept),
                                                    kept[0][0].shape[0])):
                chosen = kept[layer][e].contiguous()  # searchsorted wants contiguous inputs
                slot = torch.searchsorted(held, chosen).clamp(max=held.shape[-1] - 1)
                if not torch.equal(held.gather(-1, slot), chosen):
                    raise ValueError("eviction record keeps a position its row did not hold (outside [0, start) "
                                     "or evicted before)")
                bits.append(torch.zeros_like(held, dtype=torch.bool).scatter_(-1, slot, True).flatten())
        budgets = tuple(max(k.shape[-1] for k in ks) for ks in kept)
        return cls(starts=starts, keep_bits=pack_bits(torch.cat(bits)),
                   shape=(len(kept), kept[0][0].shape[0], max(budgets)),
                   budgets=None if len(set(budgets)) == 1 else budgets)

    @classmethod
    def from_keep_bits(cls, events: Sequence[tuple[int, np.ndarray, int]], shape: tuple[int, int, int],
                       budgets: tuple[int, ...] | None = None) -> "EvictionRecord | None":
        """From the bits an engine computed on the device (`keep_bits`, packed by `pack_rows`): per compression in
        order, (tokens processed before it, its packed bits as a uint8 array, how many bits). shape and budgets as
        in the record; None if no compression."""
        if not events:
            return None
        starts = torch.tensor([start for start, _, _ in events], dtype=torch.int64)
        if all(nbits % 8 == 0 for _, _, nbits in events):  # whole bytes: the packed events simply follow each other
            packed = np.concatenate([packed[: nbits // 8] for _, packed, nbits in events])
        else:
            bits = np.concatenate([np.unpackbits(packed, count=nbits, bitorder="little") for _, packed, nbits in events])
            packed = np.packbits(bits, bitorder="little")
        return cls(starts=starts, keep_bits=torch.from_numpy(np.ascontiguousarray(packed, dtype=np.uint8)),
                   shape=shape, budgets=budgets)

    def kept_by_layer(self) -> list[Tensor]:
        """Per stored layer, [E, H', B_l] int64: the positions each compression kept. A compression that kept fewer
        (see from_events) repeats its last position up to B_l: a set of positions read as a mask is unchanged."""
        n_layers, n_heads, _ = self.shape
        bits = unpack_bits(self.keep_bits)
        kept: list[list[Tensor]] = [[] for _ in range(n_layers)]
        offset = 0
        for e in range(self.starts.numel()):
            before = [k[-1] for k in kept] if e else None
            for layer, held in enumerate(_held_from(self.starts, e, before, n_layers, n_heads)):
                chosen = bits[offset: offset + held.numel()].view(held.shape)
                offset += held.numel()
                kept[layer].append(held[chosen].view(n_heads, -1))
        return [torch.stack([_pad_to(k, b) for k in ks]) for ks, b in zip(kept, self.layer_budgets)]

    def keep_bits_by_event(self) -> list[tuple[int, list[Tensor]]]:
        """Per compression in order: (tokens run before it, per stored layer its [H', |H_e,l|] bool keep bits over the
        slots it chose from, in position order). What an engine replays to rebuild a cache the record describes
        (a partial rollout's continuation) and what `packed_events` re-packs."""
        n_layers, n_heads, _ = self.shape
        bits = unpack_bits(self.keep_bits)
        out, kept, offset = [], None, 0
        for e in range(self.starts.numel()):
            layers = []
            for layer, held in enumerate(_held_from(self.starts, e, kept, n_layers, n_heads)):
                layers.append(bits[offset: offset + held.numel()].view(held.shape))
                offset += held.numel()
            kept = [held[chosen].view(n_heads, -1) for held, chosen in
                    zip(_held_from(self.starts, e, kept, n_layers, n_heads), layers)]
            out.append((int(self.starts[e]), layers))
        return out

    def packed_events(self) -> list[tuple[int, np.ndarray, int]]:
        """The compressions as `from_keep_bits` takes them, (start, packed bits, how many): a record continued by
        more compressions (a partial rollout's) is rebuilt from these and the new ones."""
        return [(start, np.packbits(torch.cat([b.flatten() for b in layers]).numpy(), bitorder="little"),
                 sum(b.numel() for b in layers)) for start, layers in self.keep_bits_by_event()]

    def kept_positions(self) -> Tensor:
        """[E, L', H', B] int64: the positions each compression kept (one budget for every layer; else see
        `kept_by_layer`)."""
        if self.budgets is not None:
            raise ValueError(f"this record keeps per-layer budgets {self.budgets}: decode it with kept_by_layer()")
        return torch.stack(self.kept_by_layer(), dim=1)

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
        if self.budgets is not None and len(self.budgets) != n_layers:
            raise ValueError(f"eviction record has {len(self.budgets)} layer budgets for {n_layers} layers")
        if int(self.starts[-1]) > length:
            raise ValueError(f"eviction record compresses after {int(self.starts[-1])} tokens of a {length}-token sequence")


def _as_layers(kept: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """An event's kept positions as one [H, B_l] int64 CPU tensor per layer."""
    layers = list(kept.unbind(0)) if isinstance(kept, Tensor) else list(kept)
    return [k.to("cpu", torch.int64) for k in layers]


def _same(a: list[Tensor], b: list[Tensor]) -> bool:
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def _pad_to(kept: Tensor, size: int) -> Tensor:
    """[H', k] -> [H', size], repeating the last position (k < size only when a compression kept every slot)."""
    return kept if kept.shape[-1] == size else torch.cat([kept, kept[:, -1:].expand(-1, size - kept.shape[-1])], -1)


def _held_from(starts: Tensor, e: int, before: list[Tensor] | None, n_layers: int, n_heads: int) -> list[Tensor]:
    """H_e per layer: [0, starts[0]) for e = 0, else what e - 1 kept ([H', B_l] each) then [starts[e-1], starts[e])."""
    if e == 0:
        first = torch.arange(int(starts[0])).expand(n_heads, -1).contiguous()
        return [first] * n_layers
    recent = torch.arange(int(starts[e - 1]), int(starts[e])).expand(n_heads, -1)
    return [torch.cat([k, recent], dim=-1) for k in before]


_BIT = 2 ** torch.arange(8, dtype=torch.uint8)


def pack_bits(bits: Tensor) -> Tensor:
    """Flat bits packed 8 per uint8, bit j of a byte worth 2**j; zero-padded to a whole byte."""
    padded = torch.zeros((bits.numel() + 7) // 8 * 8, dtype=torch.uint8)
    padded[: bits.numel()] = bits.to(torch.uint8)
    return (padded.view(-1, 8) * _BIT).sum(dim=-1, dtype=torch.uint8)


def keep_bits(kept: Tensor, n: int) -> Tensor:
    """The keep bits of one compression of R rows, on their device: kept [L', R, H', W] slots out of the n each layer
    held (sorted; repeats allowed) -> [R, L' * H' * n] uint8 0/1 in the record's order (layer, head, slot)."""
    n_layers, rows, n_heads, _ = kept.shape
    bits = torch.zeros(n_layers, rows, n_heads, n, dtype=torch.uint8, device=kept.device).scatter_(-1, kept, 1)
    return bits.permute(1, 0, 2, 3).reshape(rows, -1)


def pack_rows(bits: Tensor) -> Tensor:
    """[R, N] 0/1 -> [R, ceil(N / 8)] uint8 packed as `pack_bits` packs (bit j of a byte worth 2**j), on the bits'
    device: what an engine copies to the host instead of the bits (8x less)."""
    rows, n = bits.shape
    weights = torch.ones(8, dtype=torch.uint8, device=bits.device).bitwise_left_shift(
        torch.arange(8, dtype=torch.uint8, device=bits.device))
    padded = torch.nn.functional.pad(bits.to(torch.uint8), (0, (-n) % 8))
    return (padded.view(rows, -1, 8) * weights).sum(dim=-1, dtype=torch.uint8)


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
    return visible_from_kept(record.starts, record.kept_by_layer(), width, layer)


def visible_from_kept(starts: Tensor, kept: Tensor | Sequence[Tensor], width: int, layer: int) -> Tensor:
    """`visible_positions` from decoded kept positions: [E, L', H', B] (`kept_positions`) or one [E, H', B_l] per
    stored layer (`kept_by_layer`), so a caller decodes once and builds every layer's mask."""
    n_stored = kept.shape[1] if isinstance(kept, Tensor) else len(kept)
    index = layer if n_stored > 1 else 0
    kept = kept[:, index] if isinstance(kept, Tensor) else kept[index]  # [E, H', B_l]
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
