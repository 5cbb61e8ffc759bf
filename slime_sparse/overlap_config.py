"""The `overlap` config section: rollouts that overlap training (slime's train_async.py and --partial-rollout,
AReaL's bound on staleness). The loop is `slime_sparse.train_async`, partial rollouts `slime_sparse.rollout.partial`;
the rules between this section and the others are `slime_sparse.config.RunConfig.validate`'s.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from slime_sparse.flags import flag, non_negative, positive


@dataclass(frozen=True)
class OverlapConfig:
    SECTION: ClassVar[str] = "overlap"

    async_train: bool = field(default=False, metadata={"help": (
        "generate rollout k + 1 while the learner trains on rollout k (slime's train_async.py): the engines sync "
        "every --update-weights-interval rollouts, generation drained first, so a rollout's samples are up to that "
        "many weight versions old; pi_old is recomputed with the learner's weights when a rollout is trained, so the "
        "correction's xi = pi_old / pi_sparse carries staleness and sparsity alike. Needs the engines on their own "
        "devices (not --colocate) and --rm-num-workers >= 1 (rewards are graded beside the learner)")})
    update_weights_interval: int = field(default=1, metadata={"help": (
        "rollouts between weight updates of the engines under --async (slime's); each waits for the generation in "
        "flight, so no update lands mid-generation")})
    max_staleness: int | None = field(default=None, metadata={"help": (
        "the most weight versions a trained token may be older than the learner (AReaL's max_head_offpolicyness): "
        "checked against --update-weights-interval at start, and partial groups that would exceed it are "
        "regenerated from scratch instead of continued; unset: no bound (slime's). Logged per sample in "
        "<run-dir>/samples.jsonl and per rollout as rollout/staleness_*")})
    partial_rollout: bool = field(default=False, metadata={"help": (
        "slime's --partial-rollout: once a rollout holds --rollout-batch-size finished groups, the unfinished "
        "samples are aborted and continued in the next rollout, their eviction record carried across the break (the "
        "continuation's prefill replays the record's compressions, so the shadow recompute still reproduces every "
        "token). Needs --over-sampling-batch-size > --rollout-batch-size and the embedded engine")})
    mask_offpolicy_in_partial_rollout: bool = field(default=False, metadata={"help": (
        "slime's: the tokens a continued sample had before its last continuation get no loss (they leave the "
        "loss's numerators and denominators)")})

    def validate(self) -> None:
        positive(self, "update_weights_interval")
        if self.max_staleness is not None:
            non_negative(self, "max_staleness")
        if self.update_weights_interval > 1 and not self.async_train:
            raise ValueError(f"{flag(self, 'update_weights_interval')}={self.update_weights_interval} needs "
                             f"{flag(self, 'async_train')}: the synchronous loop updates the engines after every "
                             "rollout")
        if self.async_train and self.max_staleness is not None and self.max_staleness < self.update_weights_interval:
            raise ValueError(f"{flag(self, 'max_staleness')}={self.max_staleness} is below "
                             f"{flag(self, 'update_weights_interval')}={self.update_weights_interval}: the last "
                             "rollout before each weight update is that many versions old, so every such rollout "
                             "would break the bound")
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            raise ValueError(f"{flag(self, 'mask_offpolicy_in_partial_rollout')} has no effect without "
                             f"{flag(self, 'partial_rollout')}")
