"""Splitting samples into micro-batches and across data-parallel ranks by token count.

Pure functions over lengths, shared by every learner backend.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class MicroBatching:
    """How a learner splits a step's samples into micro-batches (for training and for the dense log-prob
    recompute), slime's two modes: dynamic (`--use-dynamic-batch-size`), greedy packs of at most `max_tokens`
    padded tokens (`--max-tokens-per-gpu`); fixed, `micro_batch_size` samples each (`--micro-batch-size`).
    Gradients are the same either way (the loss is normalised by the step's global counts)."""

    max_tokens: int | None = 16384  # None: fixed micro-batches
    micro_batch_size: int = 1

    def __post_init__(self) -> None:
        if (self.max_tokens is not None and self.max_tokens <= 0) or self.micro_batch_size <= 0:
            raise ValueError(f"micro-batch sizes must be > 0, got {self}")

    def split(self, lengths: list[int]) -> list[list[int]]:
        """Indices of each micro-batch, in input order."""
        if self.max_tokens is not None:
            return pack_by_tokens(lengths, self.max_tokens)
        size = self.micro_batch_size
        return [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]


def pack_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy micro-batches (in input order) whose padded size `len(batch) * max(len)` fits `max_tokens`.

    A sample longer than the budget gets a micro-batch of its own rather than being dropped.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, n) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    return batches


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
