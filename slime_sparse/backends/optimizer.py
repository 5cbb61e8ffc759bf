"""The CPU optimizer both learners use: AdamW with Megatron's weight-decay rule.

Megatron's optimizer (the Megatron learner on GPU) exempts biases and every 1-D parameter (norm weights)
from weight decay. The torch AdamW of the embedded learner and of the Megatron learner on CPU follow the
same rule, so `--weight-decay` means the same thing on every backend.
"""
from __future__ import annotations

from typing import Iterable

import torch


def decays(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's default: no weight decay for biases and 1-D parameters."""
    return param.ndim > 1 and not name.endswith(".bias")


def adamw(named_params: Iterable[tuple[str, torch.nn.Parameter]], *, lr: float, betas: tuple[float, float],
          weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, in two groups: decayed (matrices) and not (biases, norms)."""
    groups: dict[bool, list[torch.nn.Parameter]] = {True: [], False: []}
    for name, param in named_params:
        if param.requires_grad:
            groups[decays(name, param)].append(param)
    param_groups = [{"params": groups[True], "weight_decay": weight_decay},
                    {"params": groups[False], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in param_groups if g["params"]], lr=lr, betas=betas)
