"""The engine's side of a weight sync in one process: new weights copied into the model's own tensors, in place.

In place, so that everything that holds the tensors keeps reading them: the fused projections of the decode body
(whose views the HF parameters are: decode_body.py), the LM head weight, and the CUDA graphs captured over them.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor, nn


def copy_weights(model: nn.Module, state_dict: Mapping[str, Tensor]) -> None:
    """Copy `state_dict` into `model`'s tensors, cast to their dtype and device. Every parameter / buffer of the model
    must be provided, except aliases of a provided tensor (a tied LM head); ValueError naming what is not, an unknown
    name or a wrong shape, before anything is copied."""
    own = model.state_dict()
    unexpected = sorted(k for k in state_dict if k not in own)
    if unexpected:
        raise ValueError(f"update_weights: unknown weight names {unexpected[:5]} (model has {len(own)} tensors)")
    provided_storage = {own[k].data_ptr() for k in state_dict}
    missing = sorted(k for k, t in own.items() if k not in state_dict and t.data_ptr() not in provided_storage)
    if missing:
        raise ValueError(f"update_weights: missing weights {missing[:5]} ({len(missing)} in all)")
    for name, src in state_dict.items():
        if tuple(src.shape) != tuple(own[name].shape):
            raise ValueError(
                f"update_weights: {name} has shape {tuple(src.shape)}, the model's is {tuple(own[name].shape)}"
            )
    with torch.no_grad():
        for name, src in state_dict.items():
            own[name].copy_(src)  # state_dict() tensors share storage with the model's parameters
