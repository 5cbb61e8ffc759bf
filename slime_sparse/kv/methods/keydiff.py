"""KeyDiff: keep the keys least like the average key."""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from ..ops import scored_length, with_protected
from .base import KVMethod, ScoreShape, register
from .rkv import COSINE_EPS


@register
@dataclass(frozen=True)
class KeyDiff(KVMethod):
    """KeyDiff (Park et al., arXiv 2504.15364): minus the cosine similarity of each key to the anchor, the mean of the
    layer's unit-norm keys (every slot, window included, as kvpress's KeyDiffPress).

    Why this second decode-time method: it reads keys only, so it needs no observation queries (no query ring in
    SGLang, no capture in the attention), works whatever attention kernel computes the logits, and costs one pass
    over the keys instead of R-KV's n x n similarity; its paper evaluates it under exactly our setting, a fixed budget
    refilled block by block, and it is a kvpress press, so kvpress in its own environment is its oracle.
    """

    name = "keydiff"

    def score(self, keys: Tensor, queries: Tensor | None = None, attn_mass: Tensor | None = None) -> Tensor:
        n = keys.shape[-2]
        unit = F.normalize(keys.float(), p=2, dim=-1, eps=COSINE_EPS)
        anchor = unit.mean(dim=-2, keepdim=True)  # [..., Hkv, 1, d]
        score = -F.cosine_similarity(keys.float(), anchor, dim=-1, eps=COSINE_EPS)  # [..., Hkv, n]
        return with_protected(score[..., : scored_length(self.window, n)], n, self.sinks)

    def score_bytes(self, s: ScoreShape) -> int:
        """The unit keys (beside an fp32 copy of half keys), then the unit keys, the anchor, a second fp32 copy and
        the cosines (what `cosine_similarity` allocates inside is not counted: torch's CPU allocator hides it)."""
        anchor = 4 * s.entries * s.heads * s.head_dim
        return max((s.upcast + 4) * s.keys + 4 * s.per_slot,
                   4 * s.keys + anchor + max(s.upcast * s.keys + 4 * s.per_slot, 8 * s.per_slot))
