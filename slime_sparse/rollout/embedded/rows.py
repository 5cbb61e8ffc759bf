"""The engine's rows: the one owner of every per-row quantity, on the host and on the device.

The host's table (`table.RowTable`, numpy) is what the scheduler reads and decides from; the device holds what steps
read (the cache's `fill` and `seen`, the decode state's token, position, stream key and counter of each row). Every
change to a row is a method here, and each method says what happens to both sides:
- changes made between steps (reset, park, share a prefill, move a row, replay a recorded compression, continue a
  sequence) are applied here to both, one after the other;
- changes made by device work (a prefill's forward, a first token's sampling, a decode step, a compaction: captured
  in CUDA graphs, so the device applies its own, in cache.py and step.py) are applied here to the host by `prefilled`,
  `started`, `decoded` and `compacted`, with the same rule as the device code.
`check` reads the device back and raises on any difference (a host sync: only in the debug mode,
SLIME_SPARSE_CHECK_ROWS=1 or `EmbeddedEngine(check_rows=True)`, after every decode window; the tests run it for every
KV method).

Why not upload the host's table into fixed device buffers before each step (nano-vllm's `prepare_decode`): a host-to-
device copy per step (from pinned memory, with a ring of staging buffers, since the host runs up to two readback windows
ahead of the device), where the device's own updates are three in-graph ops at no launch cost; the device's copy then
stays, and this module is where the two are kept equal.
"""
from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor

from .cache import BudgetKVCache
from .step import DecodeState
from .table import RowTable

CHECK_ENV = "SLIME_SPARSE_CHECK_ROWS"  # "1": `check` after every decode window (the debug mode)


def check_rows_default() -> bool:
    return os.environ.get(CHECK_ENV, "") not in ("", "0")


class RowMismatch(AssertionError):
    """The host's table and the device disagree about a row (a change applied to one side only)."""


class Rows:
    def __init__(self, cache: BudgetKVCache, state: DecodeState, max_new_tokens: int, checked: bool = False) -> None:
        self.cache, self.state = cache, state
        self.table = RowTable.allocate(cache.num_layers, cache.num_rows, max_new_tokens)
        self.capacity = cache.capacity
        self.checked = checked

    # ---- between steps: both sides, here ----
    def reset(self, row: int) -> None:
        """An admitted sequence's row: empty."""
        self.cache.reset_row(row)
        t = self.table
        t.fill[:, row], t.seen[row], t.issued[row] = 0, 0, 0

    def park(self, row: int) -> None:
        """A row that holds no sequence: full, so that a step only ever overwrites its own last slot."""
        self.cache.park_row(row)
        self.table.fill[:, row] = self.capacity

    def share(self, src: int, dst: int) -> None:
        """A prompt's prefill, shared by another sample of it: src's cache into dst (not its decode state)."""
        t = self.table
        self.cache.copy_row(src, dst, int(t.fill[:, src].max()))
        t.fill[:, dst], t.seen[dst] = t.fill[:, src], t.seen[src]

    def move(self, src: int, dst: int) -> None:
        """A running row into a finished one's place (running rows stay in [0, n)): cache, decode state and table."""
        self.cache.copy_row(src, dst, int(self.table.fill[:, src].max()))
        self.state.copy_row(src, dst)
        self.table.move(src, dst)

    def resume(self, row: int, token: int, position: int, key: int, issued: int, limit: int) -> None:
        """A continuation's row, prefilled: it runs its last sampled token next and samples response token `issued`."""
        device = self.cache.device
        index = torch.tensor([row], device=device)
        self.state.set_rows(index, torch.tensor([token], device=device), torch.tensor([position], device=device),
                            torch.tensor([key], device=device))
        self.state.counters[index] = issued
        self.table.issued[row], self.table.limit[row] = issued, limit

    def replay(self, row: int, bits: list[Tensor]) -> None:
        """One recorded compression on `row` (a continuation's prefill): per stored layer (one for all layers, or one
        each), keep the slots whose keep bit is set ([H', n] bits, slots in position order, as the record's are)."""
        cache, t = self.cache, self.table
        layers_all = list(range(cache.num_layers))
        layer_sets = [layers_all] if len(bits) == 1 else [[layer] for layer in layers_all]
        device = cache.device
        for layers, layer_bits in zip(layer_sets, bits):
            held = {int(t.fill[layer, row]) for layer in layers}
            if held != {layer_bits.shape[-1]}:
                raise RuntimeError(f"replaying a compression of {layer_bits.shape[-1]} slots on a row holding "
                                   f"{sorted(held)}: the continuation's prefill left the recorded path")
            kept = torch.stack([head.nonzero().flatten() for head in layer_bits])  # [H', k]: every head keeps k
            cache.compact(torch.tensor(layers, device=device), torch.tensor([row], device=device),
                          kept.to(device)[None, None], torch.full((len(layers),), kept.shape[-1], device=device))
            t.fill[layers, row] = kept.shape[-1]

    # ---- device work applied its own change (cache.py): the host's side, same rule ----
    def prefilled(self, row: int, length: int) -> None:
        """`cache.end_prefill`: the row holds `length` more slots in every layer and has seen as many queries."""
        self.table.fill[:, row] += length
        self.table.seen[row] += length

    def started(self, row: int, limit: int, lead_row: int) -> None:
        """`DecodeState.set_rows` (the runner's first-token sampling): the row sampled response token 0 and samples
        token 1 next; its first token saw the whole prompt `lead_row` prefilled."""
        t = self.table
        t.issued[row], t.limit[row] = 1, limit
        t.kept_log[row, 0], t.peak_log[row, 0] = t.fill[:, lead_row].sum(), t.fill[:, lead_row].max()

    def decoded(self, bucket: int) -> np.ndarray:
        """`cache.end_decode` over rows [0, bucket): one slot more, a full row stays full. Then the live rows' token
        is issued, with the slots its context held; returns those rows."""
        t = self.table
        np.minimum(t.fill[:, :bucket] + 1, self.capacity, out=t.fill[:, :bucket])
        t.seen[:bucket] += 1
        rows = np.flatnonzero(t.live(bucket))
        t.kept_log[rows, t.issued[rows]] = t.fill[:, rows].sum(axis=0)
        t.peak_log[rows, t.issued[rows]] = t.fill[:, rows].max(axis=0)
        t.issued[rows] += 1
        return rows

    def compacted(self, rows: list[int], budgets: np.ndarray) -> None:
        """`cache.compact` (compressor.py): each layer l of the rows keeps min(its slots, budgets[l])."""
        self.table.fill[:, rows] = np.minimum(self.table.fill[:, rows], budgets[:, None])

    # ---- reads ----
    def held_positions(self, row: int) -> list[Tensor]:
        """Per layer, [Hkv, fill] logical positions the row holds now (tracing: reads the device)."""
        return self.cache.held_positions(row, self.table.fill[:, row].tolist())

    def check(self, n: int) -> None:
        """The debug mode's check, after a decode window over rows [0, n): every row's fill on the device equals the
        host's (parked rows' too: steps read them), every running row's seen count too (a parked row's is stale from
        an earlier call, and never read), and every running row that may still sample draws the token the host counts
        it at (its stream counter). A host sync: only when `checked`."""
        if not self.checked:
            return
        fill, seen = self.cache.fill.cpu().numpy(), self.cache.seen.cpu().numpy()
        counters, t = self.state.counters[:n].cpu().numpy(), self.table
        live = np.flatnonzero(t.live(n))
        bad = set(np.flatnonzero((fill != t.fill).any(axis=0))) | set(np.flatnonzero(seen[:n] != t.seen[:n]))
        bad = sorted(int(r) for r in bad | set(live[counters[live] != t.issued[live]]))
        if bad:
            row = bad[0]
            raise RowMismatch(f"rows {bad} (of {n} running): host and device disagree; row {row}: fill host "
                              f"{t.fill[:, row].tolist()} device {fill[:, row].tolist()}, seen host {int(t.seen[row])} "
                              f"device {int(seen[row])}, stream counter host {int(t.issued[row])} "
                            f"device {int(counters[row]) if row < n else '-'}")
