"""What the host knows of a generate() call's rows: one table of per-row state."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RowTable:
    """The host's copy of every cache row's state (the one place the host keeps it)."""

    fill: np.ndarray  # [L, R] slots each layer holds
    seen: np.ndarray  # [R] queries that went through the ring
    issued: np.ndarray  # [R] response tokens the row has sampled (as far as the host knows: it runs ahead of readback)
    limit: np.ndarray  # [R] response tokens the row may sample
    kept_log: np.ndarray  # [R, T] per sampled token, the slots its context held, summed over layers (KV memory)
    peak_log: np.ndarray  # [R, T] ... and in its fullest layer

    @classmethod
    def allocate(cls, layers: int, rows: int, max_new_tokens: int) -> "RowTable":
        def ints(*shape: int) -> np.ndarray:
            return np.zeros(shape, dtype=np.int64)

        return cls(ints(layers, rows), ints(rows), ints(rows), ints(rows), ints(rows, max_new_tokens),
                   ints(rows, max_new_tokens))

    def move(self, src: int, dst: int) -> None:
        self.fill[:, dst] = self.fill[:, src]
        for column in (self.seen, self.issued, self.limit, self.kept_log, self.peak_log):
            column[dst] = column[src]

    def live(self, n: int) -> np.ndarray:
        """Rows of [0, n) that may still sample."""
        return self.issued[:n] < self.limit[:n]

    def spans(self, n: int, granularity: int, capacity: int) -> tuple[int, ...]:
        """Per layer, how many slots a decode step over rows [0, n) must read: the largest fill + 1 (the new token),
        rounded up to `granularity` (fewer distinct shapes for captured graphs), at most the capacity."""
        need = self.fill[:, :n].max(axis=1) + 1
        return tuple(int(s) for s in np.minimum(-(-need // granularity) * granularity, capacity))
