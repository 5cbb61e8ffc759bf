"""Splitting samples into micro-batches and across data-parallel ranks by token count.

Pure functions over lengths, shared by every learner backend.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class MicroBatching:
    """How a learner splits a step's samples into micro-batches (for training and for the dense log-prob
    recompute), slime's two modes: dynamic (`--use-dynamic-batch-size`), micro-batches of similar length of at most
    `max_tokens` padded tokens (`--max-tokens-per-gpu`; `length_groups`); fixed, `micro_batch_size` samples each
    (`--micro-batch-size`). Gradients are the same either way (the loss is normalised by the step's global counts)."""

    max_tokens: int | None = 16384  # None: fixed micro-batches
    micro_batch_size: int = 1

    def __post_init__(self) -> None:
        if (self.max_tokens is not None and self.max_tokens <= 0) or self.micro_batch_size <= 0:
            raise ValueError(f"micro-batch sizes must be > 0, got {self}")

    def split(self, lengths: list[int]) -> list[list[int]]:
        """Indices of each micro-batch (dynamic: shortest rows first; fixed: in input order)."""
        if self.max_tokens is not None:
            return length_groups(lengths, self.max_tokens * DYNAMIC_OVERHEAD, self.max_tokens)
        size = self.micro_batch_size
        return [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]


# What one more micro-batch costs beyond its tokens (the model's Python, kernel launches), in padded tokens: a split
# pays when it saves more padding than that. Measured for the tiny model on a 2-core CPU (~250 tokens' worth); under
# dynamic batching it scales with the budget, as this share of the default --max-tokens-per-gpu (1/64).
MICRO_BATCH_COST_TOKENS = 256
DYNAMIC_OVERHEAD = MICRO_BATCH_COST_TOKENS / 16384


def length_groups(lengths: Sequence[int], overhead: float, max_tokens: int | None = None) -> list[list[int]]:
    """Row indices split into micro-batches of similar length: rows sorted by length, cut where the padded tokens
    (rows x the longest row of each part) plus `overhead` per part are fewest (dynamic programming over the cuts),
    no part over `max_tokens` padded tokens (a row longer than that gets a part of its own).

    A right-padded batch spends rows x (longest - own length) on padding: on RL responses of mixed length, half of
    it; parts of similar length waste little (the tiny recipe's learner steps: ~40 % less CPU)."""
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    n = len(order)
    best = [0.0] + [math.inf] * n  # best[j]: cheapest split of the j shortest rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]  # the last part holds sorted rows i..j-1, padded to this one
        rows = j if max_tokens is None else max(1, max_tokens // max(1, longest))
        for i in range(max(0, j - rows), j):
            cost = best[i] + (j - i) * longest + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    parts, j = [], n
    while j > 0:
        parts.append(order[cut[j]:j])
        j = cut[j]
    return parts[::-1]


def balance_by_tokens(lengths: list[int], n_parts: int) -> list[list[int]]:
    """Split indices into `n_parts` groups of (near) equal size whose token sums are balanced.

    Longest-processing-time greedy over sorted lengths, with group sizes kept equal (+-1) so every
    data-parallel rank runs the same number of samples. Indices inside a part are sorted.
    """
    if n_parts <= 0:
        raise ValueError(f"n_parts must be > 0, got {n_parts}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    cap = -(-len(lengths) // n_parts)  # ceil
    heap = [(0, p) for p in range(n_parts)]
    parts: list[list[int]] = [[] for _ in range(n_parts)]
    for i in order:
        popped = []
        while True:
            load, p = heapq.heappop(heap)
            if len(parts[p]) < cap:
                break
            popped.append((load, p))
        parts[p].append(i)
        heapq.heappush(heap, (load + lengths[i], p))
        for item in popped:
            heapq.heappush(heap, item)
    return [sorted(p) for p in parts]
