"""Activation recompute (`--recompute-granularity / --recompute-method / --recompute-num-layers`, Megatron's flags):
keep less for backward, recompute it there. The memory each setting saves: `planner/step_memory.py`.

- full, uniform: every decoder layer keeps only its input; backward reruns the layer's forward (Megatron: chunks of
  `num_layers` layers; the embedded learner: torch's non-reentrant checkpoint around each layer, chunks of 1);
- full, block: only the first `num_layers` layers (of each pipeline stage) are recomputed, the others keep everything;
- selective (Megatron): the core attention alone is recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Recompute:
    granularity: str  # full | selective
    method: str = "uniform"  # uniform | block (full only)
    num_layers: int = 1  # layers per chunk (uniform) or recomputed layers (block)

    @classmethod
    def from_flags(cls, granularity: str | None, method: str | None, num_layers: int | None) -> "Recompute | None":
        """The settings as the flags give them (validated by the train config); None without
        --recompute-granularity."""
        if granularity is None:
            return None
        return cls(granularity, method or "uniform", num_layers or 1)

    def megatron_kwargs(self) -> dict:
        """TransformerConfig's fields for these settings."""
        if self.granularity == "selective":
            return {"recompute_granularity": "selective"}
        return {"recompute_granularity": "full", "recompute_method": self.method,
                "recompute_num_layers": self.num_layers}


def checkpoint_hf_layers(model: torch.nn.Module, recompute: Recompute | None) -> None:
    """Turn on torch's (non-reentrant) activation checkpoint for the decoder layers `recompute` selects, through
    transformers' own switch (each decoder layer is a GradientCheckpointingLayer); None leaves the model as it is."""
    if recompute is None:
        return
    if recompute.granularity != "full" or (recompute.method == "uniform" and recompute.num_layers != 1):
        raise ValueError(f"the embedded learner recomputes whole layers, one at a time or the first N: {recompute}")
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x; gradient_* before
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if recompute.method == "block":
        for i, layer in enumerate(model.base_model.layers):
            layer.gradient_checkpointing = i < recompute.num_layers
