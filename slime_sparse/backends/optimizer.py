"""What both learners share about optimisation: the optimizer knobs, the learning-rate schedule, the CPU AdamW.

- `OptimConfig`: lr, weight decay, Adam betas, warm-up, gradient clipping (from the `train` section).
- The schedule, one function for every learner: `lr_scale(step, optim)` multiplies the peak lr at optimizer step
  `step` (the embedded learner hands it to torch's LambdaLR; the Megatron learner sets `lr_at` on its optimizer
  each step). Today: linear warm-up over `warmup_iters` steps, then constant. Another schedule (decay styles,
  a minimum lr) changes this function and OptimConfig, and nothing else.
- `adamw`: Megatron's optimizer (the Megatron learner on GPU) exempts biases and every 1-D parameter (norm
  weights) from weight decay; the torch AdamW of the embedded learner and of the Megatron learner on CPU follow
  the same rule, so `--weight-decay` means the same thing on every backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_iters: int = 0
    clip_grad: float = 1.0  # 0 disables clipping (the norm is still reported)


def lr_scale(step: int, optim: OptimConfig) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warm-up, then constant."""
    return min(1.0, (step + 1) / optim.warmup_iters) if optim.warmup_iters > 0 else 1.0


def lr_at(step: int, optim: OptimConfig) -> float:
    """The learning rate of optimizer step `step`."""
    return optim.lr * lr_scale(step, optim)


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
