"""What a rollout function returns (slime's `slime.rollout.base_types`, with what our pipeline reads besides).

A rollout function (`--rollout-function-path`) has slime's signature,

    fn(cfg, rollout_id: int, data_source, evaluation: bool = False) -> RolloutFnTrainOutput | list[list[Sample]]

and returns the train batch as groups of --n-samples-per-prompt samples with their rewards. `call_rollout_fn`
takes slime's older form (the bare list of groups) too, and fills what the function did not say with the run's
own decisions (`RunConfig.rollout_plan`, the one place a rollout's plan is decided).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from slime_sparse.types import Sample


@dataclass(frozen=True)
class RolloutPlan:
    """What one rollout decides besides its samples, once (RunConfig.rollout_plan), for every step after it."""

    trains_shadow: bool = False  # --loss-type shadow / smd: the PPO term trains the sampler's masked policy
    metrics_due: bool = True  # the mismatch diagnostics that cost an extra forward (--mismatch-metrics-interval)
    # --async: pi_old is recomputed when the rollout is trained (the learner's weights then), not by the rollout
    # function, which runs while the learner trains on the previous rollout
    defer_old: bool = False
    # --mask-offpolicy-in-partial-rollout: a continued sample's tokens from before its last continuation get no loss
    mask_offpolicy: bool = False

    @property
    def mismatch_split(self) -> bool:
        """The mismatch split (and the dense pi_old it reads) is computed: when due, or when it is free (under
        shadow / smd the shadow forward is paid anyway)."""
        return self.metrics_due or self.trains_shadow


@dataclass
class RolloutFnTrainOutput:
    """A rollout function's train output: slime's `samples` (whole groups, rewards set) and `metrics` (logged with
    the rollout's), and ours: `plan` (None: the run's) and `correction`, the `rollout.pipeline.RolloutCorrection`
    of the samples in group order when the function judged them (`correct`: pi_old and the verdict its filters read,
    which the batch then trains with; None: the pipeline judges them, once, when it builds the batch)."""

    samples: list[list[Sample]]
    metrics: dict[str, float] | None = None
    plan: RolloutPlan | None = None
    correction: Any = None


def call_rollout_fn(fn: Callable, cfg, rollout_id: int, data_source) -> RolloutFnTrainOutput:
    """Run a train rollout function; its output as a RolloutFnTrainOutput that carries its plan (the run's,
    `cfg.rollout_plan`, unless the function set one)."""
    output = fn(cfg, rollout_id, data_source, evaluation=False)
    if not isinstance(output, RolloutFnTrainOutput):  # slime's older form: the groups alone
        output = RolloutFnTrainOutput(samples=output)
    if output.plan is None:
        output.plan = cfg.rollout_plan(rollout_id)
    return output
