"""The shadow forward: a Hugging Face causal LM run over whole sequences, each token attending to exactly the
positions the sampler's compressed cache held when that token was run (`slime_sparse.kv.record`).

One forward per micro-batch, with gradients: the attention function registered here replaces the model's
causal mask, layer by layer, with the mask rebuilt from each sample's eviction record (per KV head when the
record is). Positions, RoPE and everything outside attention are the dense forward's, as they were at sampling
(our engines keep logical positions: kept keys are never re-rotated).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from slime_sparse.kv.record import EvictionRecord, visible_from_kept

ATTENTION_NAME = "slime_sparse_shadow"
MASK_KWARG = "shadow_mask"  # forward kwarg through which the model hands the ShadowMask to the attention


class ShadowMask:
    """Per-layer boolean masks [B, Hq or 1, W, W] of one micro-batch, built on first use by each layer.

    Layers that share their kept positions (granularity 'model', StreamingLLM, no record at all) share one mask.
    """

    def __init__(self, records: list[EvictionRecord | None], lengths: list[int], num_layers: int,
                 num_kv_heads: int, num_q_heads: int, device: torch.device) -> None:
        for i, (r, n) in enumerate(zip(records, lengths)):
            if r is not None:
                try:
                    r.check(num_layers, num_kv_heads, n)
                except ValueError as exc:
                    raise ValueError(f"sample {i}: {exc}") from None
        self.decoded = [None if r is None else (r.starts, r.kept_by_layer()) for r in records]  # decode once
        self.width = max(lengths)
        self.num_kv_heads = num_kv_heads
        self.group = num_q_heads // num_kv_heads
        self.device = device
        self.per_layer = any(r is not None and r.shape[0] > 1 for r in records)
        self._masks: dict[int, Tensor] = {}

    def layer(self, layer_idx: int) -> Tensor:
        key = layer_idx if self.per_layer else 0
        if key not in self._masks:
            causal = torch.ones(1, self.width, self.width, dtype=torch.bool).tril()  # a row without a record
            masks = [causal if d is None else visible_from_kept(*d, self.width, key) for d in self.decoded]
            heads = max(m.shape[0] for m in masks)
            mask = torch.stack([m.expand(heads, -1, -1) for m in masks])  # [B, H', W, W]
            if mask.shape[1] > 1:  # query head h reads KV head h // group (transformers' repeat_kv layout)
                mask = mask.repeat_interleave(self.group, dim=1)
            self._masks[key] = mask.to(self.device)
        return self._masks[key]


def shadow_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    shadow: ShadowMask | None = kwargs.pop(MASK_KWARG, None)
    if shadow is not None:
        width = query.shape[2]
        if width != shadow.width:
            raise RuntimeError(f"shadow forward over {width} columns, the mask was built for {shadow.width}")
        attention_mask = shadow.layer(module.layer_idx)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register(ATTENTION_NAME, shadow_attention)


@contextmanager
def shadow_forward(model: nn.Module, records: list[EvictionRecord | None], lengths: list[int]) -> Iterator[dict]:
    """Within the block, `model(..., **kwargs)` with the yielded kwargs runs the shadow forward of a micro-batch
    whose row i has lengths[i] real tokens. The model's attention implementation is restored afterwards."""
    cfg = model.config
    mask = ShadowMask(records, lengths, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads,
                      next(model.parameters()).device)
    previous = cfg._attn_implementation
    cfg._attn_implementation = ATTENTION_NAME
    try:
        yield {MASK_KWARG: mask}
    finally:
        cfg._attn_implementation = previous
