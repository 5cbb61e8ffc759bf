"""Splitting samples into micro-batches and across data-parallel ranks by token count.

Pure functions over lengths, shared by every learner backend.
"""
from __future__ import annotations

import heapq


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
