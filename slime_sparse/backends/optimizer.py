"""What both learners share about optimisation: the optimizer knobs, the learning-rate schedule, the CPU AdamW.

- `OptimConfig`: lr and its schedule, weight decay, Adam betas, gradient clipping (from the `train` section).
- The schedule: Megatron's (`--lr-decay-style constant | linear | cosine`, `--min-lr`, `--lr-decay-iters`,
  `--lr-warmup-iters`; linear warm-up from 0, the first step runs at lr 0; after the decay steps, `--min-lr`),
  taken from the libraries, not written here: the embedded learner steps the transformers scheduler of
  `hf_lr_scheduler`, the Megatron learner Megatron's own `OptimizerParamScheduler` (`megatron_lr_scheduler`). Both
  give the same lr at every step (tests/backends/test_lr_schedule.py checks each against its library and the two against each
  other). One optimizer step is one scheduler step; slime counts samples (global batch size per step), which gives
  the same values.
- Resuming: the scheduler's position is part of a training checkpoint; `check_resumed_schedule` refuses a resume
  whose schedule flags differ from the checkpoint's (Megatron's default rule).
- `adamw`: Megatron's optimizer (the Megatron learner on GPU) exempts biases and every 1-D parameter (norm
  weights) from weight decay; the torch AdamW of the embedded learner and of the Megatron learner on CPU follow
  the same rule, so `--weight-decay` means the same thing on every backend.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from slime_sparse.flags import flag_for

DECAY_STYLES = ("constant", "linear", "cosine")
# transformers' schedule for each of Megatron's styles (see hf_lr_scheduler)
HF_SCHEDULES = {"constant": "constant_with_warmup", "linear": "polynomial", "cosine": "cosine_with_min_lr"}


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_iters: int = 0
    clip_grad: float = 1.0  # 0 disables clipping (the norm is still reported)
    decay_style: str = "constant"
    min_lr: float = 0.0
    decay_iters: int | None = None  # optimizer steps of linear / cosine decay (required by those)

    def __post_init__(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"{_flag('decay_style')}={self.decay_style!r} is invalid: choose one of {DECAY_STYLES}")
        if self.decay_style != "constant" and (self.decay_iters is None or self.decay_iters <= self.warmup_iters):
            raise ValueError(f"{_flag('decay_style')} {self.decay_style} needs {_flag('decay_iters')} above "
                             f"{_flag('warmup_iters')}={self.warmup_iters}, got {self.decay_iters}")

    @property
    def schedule(self) -> dict[str, Any]:
        """What decides the lr at each step (what a resumed run must agree with)."""
        keys = ("lr", "decay_style", "warmup_iters") + (() if self.decay_style == "constant" else ("min_lr", "decay_iters"))
        return {key: getattr(self, key) for key in keys}


def hf_lr_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' scheduler with Megatron's lr at every step: constant_with_warmup; polynomial of power 1 down to
    min_lr (Megatron's linear); cosine_with_min_lr (half a cosine down to min_lr), held at min_lr after decay_iters
    (transformers' cosine would rise again there; Megatron stays at min_lr). Step it once per optimizer step."""
    from transformers import get_scheduler

    kwargs = {"linear": {"lr_end": optim.min_lr, "power": 1.0}, "cosine": {"min_lr": optim.min_lr}}
    scheduler = get_scheduler(HF_SCHEDULES[optim.decay_style], optimizer, num_warmup_steps=optim.warmup_iters,
                              num_training_steps=optim.decay_iters, scheduler_specific_kwargs=kwargs.get(optim.decay_style))
    if optim.decay_style == "cosine":
        decay_iters = optim.decay_iters
        scheduler.lr_lambdas = [lambda step, f=f: f(min(step, decay_iters)) for f in scheduler.lr_lambdas]
    return scheduler


def megatron_lr_scheduler(optimizer: Any, optim: OptimConfig):
    """Megatron's OptimizerParamScheduler over `optimizer` (anything with param_groups), in optimizer steps: warm-up
    from 0, weight decay constant (each group's `wd_mult` applies). Call `.step(1)` after each optimizer step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    # Megatron asserts warm-up < decay steps even for the constant style, which never reads them
    decay_iters = optim.decay_iters if optim.decay_style != "constant" else max(optim.decay_iters or 0, optim.warmup_iters + 1)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=optim.lr, min_lr=optim.min_lr, lr_warmup_steps=optim.warmup_iters,
        lr_decay_steps=decay_iters, lr_decay_style=optim.decay_style, start_wd=optim.weight_decay,
        end_wd=optim.weight_decay, wd_incr_steps=decay_iters, wd_incr_style="constant",
    )


def check_resumed_schedule(saved: dict[str, Any] | None, optim: OptimConfig) -> None:
    """Refuse to resume a checkpoint saved under another lr schedule (`saved`: its `OptimConfig.schedule`; None:
    a checkpoint from before schedules were recorded). Megatron refuses the same by default."""
    if saved is None or saved == optim.schedule:
        return
    changed = {key: (saved.get(key), value) for key, value in optim.schedule.items() if saved.get(key) != value}
    flags = ", ".join(f"{_flag(key)} {old} -> {new}" for key, (old, new) in changed.items())
    raise ValueError(f"the checkpoint was saved with another lr schedule ({flags}): resume with its flags "
                     f"({saved}) or start a new run")


def _flag(name: str) -> str:
    """The flag of OptimConfig field `name` (the train section's field it comes from)."""
    return flag_for("train", {"decay_style": "lr_decay_style", "warmup_iters": "lr_warmup_iters",
                              "decay_iters": "lr_decay_iters"}.get(name, name))


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
    # wd_mult: Megatron's per-group factor, which its scheduler applies when it sets the weight decay
    param_groups = [{"params": groups[True], "weight_decay": weight_decay, "wd_mult": 1.0},
                    {"params": groups[False], "weight_decay": 0.0, "wd_mult": 0.0}]
    return torch.optim.AdamW([g for g in param_groups if g["params"]], lr=lr, betas=betas)
