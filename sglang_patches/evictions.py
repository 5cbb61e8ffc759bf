"""A request's eviction events on the wire: what the plugin appends to Req.customized_info, and their decoding into
the slime_sparse.kv.record.EvictionRecord the learner's shadow forward reads (the embedded engine's record).

SGLang streams customized_info[key] by output token (each chunk sends entries [sent tokens, output length)), so the
list is indexed by output token: entry i belongs to the decode step that produced output token i. It is
- [start, held, bits] for a compression right before that step: start = tokens processed before it (the row's
  logical length), held = the row's slots it chose from, bits = base64 of one bit per held slot (kv.record's
  packing), set for the kept ones;
- RETRACTED where a retraction dropped a compressed cache (the request is re-prefilled densely, which no eviction
  record can express);
- 0 elsewhere (SGLang pads with None for chunks where a request had no entries yet: both mean "nothing").
Each entry carries its own start, so decoding does not depend on where the padding fell. In the scheduler a
compression's entry is a `PendingEntry` until SGLang pickles it for the wire (its bits are copied from the device
without waiting); everything past the pickle sees plain lists.

Why the bits are the record's own: the compaction keeps the row in token order, so before compression e the row holds
exactly kv.record's H_e (what compression e-1 kept, then the tokens appended since), and the kept physical slots
index H_e. SGLang keeps one set per request for every layer and head (granularity 'model'): a (1, 1, B) record.

Size: (held / 8) * 4/3 base64 characters + the two ints per compression, plus "0, " per other output token.
"""
from __future__ import annotations

import base64
from typing import Any

import torch
from torch import Tensor

from slime_sparse.kv.record import EvictionRecord, pack_bits, unpack_bits

EVICTIONS_INFO_KEY = "sparse_kv_evictions"  # key in Req.customized_info -> meta_info
RETRACTED = "retracted"


class NotRecordable(ValueError):
    """The request's attention is not an eviction record (a retraction re-prefilled it densely after a compression)."""


def eviction_entry(start: int, held: int, kept: Tensor) -> list[Any]:
    """The JSON-safe entry of one compression from its kept slots (sorted, in [0, held)), encoded on the host: the
    reference for what the plugin ships (`PendingEntry`), and what the test servers send."""
    bits = torch.zeros(held, dtype=torch.bool)
    bits[kept.to("cpu", torch.int64)] = True
    return [int(start), int(held), _b64(pack_bits(bits))]


def _b64(packed: Tensor) -> str:
    return base64.b64encode(packed.numpy().tobytes()).decode("ascii")


class PendingEntry:
    """One compression's entry whose keep bits (packed on the device by `kv.record.pack_rows`) are still on their way
    to the host: `packed` is their row of a pinned buffer the copy fills, `ready` (a device event recorded after the
    copy, None on CPU) says when.

    It becomes the plain [start, held, bits] list when SGLang pickles customized_info to stream it (`__reduce__`):
    by then SGLang has waited for the step's sampled tokens, which the device produced after the copy (same stream),
    so waiting on `ready` first costs nothing; the compaction itself never waits.
    """

    __slots__ = ("_entry", "held", "packed", "ready", "start")

    def __init__(self, start: int, held: int, packed: Tensor, ready: Any = None) -> None:
        self.start, self.held, self.packed, self.ready, self._entry = start, held, packed, ready, None

    def resolve(self) -> list[Any]:
        if self._entry is None:
            if self.ready is not None:
                self.ready.synchronize()
            self._entry = [self.start, self.held, _b64(self.packed[: (self.held + 7) // 8])]
            self.packed = self.ready = None  # the pinned buffer can go
        return self._entry

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (self.resolve(),)

    def __repr__(self) -> str:
        return f"PendingEntry(start={self.start}, held={self.held})"


def append_at(history: list[Any], index: int, entry: Any) -> None:
    """Put `entry` at output-token `index`, padding with 0; an index already taken gets the next one (never
    overwrite: entries carry their own start, so their order is what matters)."""
    history.extend([0] * (index - len(history)))
    history.append(entry)


def decode_evictions(entries: list[Any]) -> EvictionRecord | None:
    """The EvictionRecord of one request's meta_info[EVICTIONS_INFO_KEY] (None: it never compressed).

    The shipped bits are the record's own keep bits (see above), so they are concatenated, not re-derived. Raises
    NotRecordable after a retraction of a compressed cache, ValueError for entries the plugin cannot have sent (a lost
    compression shows up as a held count that does not match kv.record's |H_e|).
    """
    starts: list[int] = []
    bits: list[Tensor] = []
    budget = 0
    for entry in entries:
        if entry is None or entry == 0:
            continue
        if entry == RETRACTED:
            raise NotRecordable("retracted after a compression and re-prefilled densely: its attention is no eviction "
                                "record, so --loss-type shadow/smd cannot train on it (more KV memory avoids retractions)")
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], str)):
            raise ValueError(f"eviction entry {str(entry)[:80]!r} is not [start, held, bits]")
        start, n_held, packed = int(entry[0]), int(entry[1]), entry[2]
        e = len(starts)
        expected = start if e == 0 else budget + start - starts[-1]  # |H_e|: what e - 1 kept + the tokens since
        if n_held != expected:
            raise ValueError(f"compression {e} at {start} tokens chose from {n_held} slots, the events before "
                             f"it leave {expected} (an event was lost)")
        keep = unpack_bits(torch.frombuffer(bytearray(base64.b64decode(packed)), dtype=torch.uint8))
        if keep.numel() != (n_held + 7) // 8 * 8 or bool(keep[n_held:].any()):
            raise ValueError(f"compression {e} at {start} tokens: {keep.numel()} bits for {n_held} slots")
        kept = int(keep.sum())
        if e and kept != budget:
            raise ValueError(f"compression {e} kept {kept} slots, the first {budget} (one budget per server)")
        starts.append(start)
        bits.append(keep[:n_held])
        budget = kept
    if not starts:
        return None
    return EvictionRecord(starts=torch.tensor(starts, dtype=torch.int64), keep_bits=pack_bits(torch.cat(bits)),
                          shape=(1, 1, budget))
