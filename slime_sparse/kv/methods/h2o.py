"""H2O: heavy hitters, the slots that received the most attention over the whole sequence."""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..ops import causal_window_attention, gqa_reduce, scored_length, with_protected
from .base import KVMethod, ScoreShape, check_gqa, gqa_knob, register


@register
@dataclass(frozen=True)
class H2O(KVMethod):
    """H2O (Zhang et al., arXiv 2306.14048): the attention mass each slot accumulated over every query that saw it
    (the engine tracks it, summed over each KV group's query heads); without a tracked mass, the window-summed causal
    attention of the observed queries, GQA-reduced. No pooling."""

    name = "h2o"
    tracks_mass = True

    gqa_reduce: str = gqa_knob()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_gqa(self.gqa_reduce)

    def score(self, keys: Tensor, queries: Tensor, attn_mass: Tensor | None = None) -> Tensor:
        n_kv_heads, n = keys.shape[-3:-1]
        if attn_mass is None:
            attn_mass = gqa_reduce(causal_window_attention(keys, queries).sum(dim=-2), n_kv_heads, self.gqa_reduce,
                                   dim=-2)
        return with_protected(attn_mass.float()[..., : scored_length(self.window, n)], n, self.sinks)

    def score_bytes(self, s: ScoreShape) -> int:
        """The engines track the mass: the protected scores alone (the window's attention otherwise)."""
        return 4 * s.per_slot
