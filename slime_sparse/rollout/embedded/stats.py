"""What one generate() call did: counters the engine hands out as `EmbeddedEngine.last_stats`."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GenerateStats:
    """What one generate() call did (`EmbeddedEngine.last_stats`)."""

    forwards: int = 0  # model forwards: prefill chunks and decode steps
    prefill_tokens: int = 0  # prompt tokens run through the model
    prefill_tokens_saved: int = 0  # prompt tokens not run: the n samples of a prompt share one prefill
    compressions: int = 0  # cache-row compressions (a shared prefill's compression counts once)
    compaction_calls: int = 0  # batched compaction calls (each compresses one or more rows)
    kv_cache_bytes: int = 0  # keys + values allocated (the cache never grows: its peak)
    rows: int = 0  # cache rows: sequences decoded at once at most
    slots: int = 0  # slots per cache row
    captures: int = 0  # CUDA graphs captured during the call (0 once a runner is warm)
