"""StreamingLLM: attention sinks plus the most recent tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..ops import scored_length, with_protected
from .base import KVMethod, ScoreShape, register


@register
@dataclass(frozen=True)
class StreamingLLM(KVMethod):
    """StreamingLLM (Xiao et al., arXiv 2309.17453): the score is the slot index itself (newer = higher), so selection
    keeps the sinks plus the budget - sinks most recent tokens, the same in every head and layer."""

    name = "streaming"
    position_only = True
    default_sinks = 4

    def score(self, keys: Tensor, queries: Tensor | None = None, attn_mass: Tensor | None = None) -> Tensor:
        n = keys.shape[-2]
        m = scored_length(self.window, n)
        recency = torch.arange(m, dtype=torch.float32, device=keys.device)
        return with_protected(recency.expand(*keys.shape[:-2], m), n, self.sinks)

    def score_bytes(self, s: ScoreShape) -> int:
        return 4 * s.per_slot + 4 * s.slots
