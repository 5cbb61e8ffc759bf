"""The shadow forward on megatron-core: each layer's attention gets the mask rebuilt from the samples' eviction
records (`slime_sparse.backends.shadow_attention.ShadowMask`) instead of the causal mask the model was handed.

megatron-core passes one attention mask to every layer; a forward pre-hook on each core attention module swaps in
that layer's mask (Megatron's convention: True = masked), cut to the query heads this tensor-parallel rank holds
(query heads of a KV group are contiguous and rank r holds heads [r * H / TP, (r + 1) * H / TP), as in HF).

Only the local layer spec's DotProductAttention takes an arbitrary per-head mask; Transformer Engine's fused
attention would need its "arbitrary" mask type, untested here (no CUDA), so it is refused with a clear error.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from slime_sparse.backends.shadow_attention import ShadowMask


@contextmanager
def shadow_masks_installed(model: torch.nn.Module, shadow: ShadowMask) -> Iterator[None]:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    attention = [m for m in model.modules() if type(m).__name__.endswith("DotProductAttention")]
    unsupported = sorted({type(m).__name__ for m in attention if not isinstance(m, DotProductAttention)})
    if unsupported or not attention:
        raise ValueError(f"the shadow forward needs megatron-core's local DotProductAttention (the local layer "
                         f"spec), found {unsupported or 'no attention module'}")

    def swap_mask(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        visible = shadow.layer(module.layer_number - 1)  # [B, Hq or 1, W, W], True = may attend
        if visible.shape[1] > 1:
            local = visible.shape[1] // tp_size
            visible = visible[:, tp_rank * local : (tp_rank + 1) * local]
        if "attention_mask" in kwargs:
            kwargs = {**kwargs, "attention_mask": ~visible}
        else:
            args = (*args[:3], ~visible, *args[4:])
        return args, kwargs

    handles = [m.register_forward_pre_hook(swap_mask, with_kwargs=True) for m in attention]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
