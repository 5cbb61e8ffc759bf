"""How a learner's metrics combine (slime_sparse.backends.metrics): over micro-batches, data-parallel ranks and the
optimizer steps of a rollout. References: the rules written out by hand."""
from __future__ import annotations

import pytest
import torch

from slime_sparse.backends.metrics import EMPTY_STEP, mean_over_steps, merge_parts, step_metrics


def test_merge_rank_metrics_by_hand():
    ranks = [
        {"train/loss": 0.25, "pg_clipfrac": 0.1, "train/grad_norm": 2.0, "train/lr": 1e-3, "loss/all_rejected": 0.0},
        {"train/loss": -0.05, "train/grad_norm": 2.0, "train/lr": 1e-3, "loss/all_rejected": 1.0},  # empty shard
    ]
    assert merge_parts(ranks) == pytest.approx(
        {"train/loss": 0.20, "pg_clipfrac": 0.1, "train/grad_norm": 2.0, "train/lr": 1e-3, "loss/all_rejected": 0.0})


def test_micro_batches_sum_and_an_empty_step_reports_its_defaults():
    micro = [{"train/loss": torch.tensor(0.5), "pg_loss": 0.25, "loss/all_rejected": 1.0},
             {"train/loss": torch.tensor(-0.125), "pg_loss": 0.5, "loss/all_rejected": 0.0}]
    assert step_metrics(micro) == {"train/loss": 0.375, "pg_loss": 0.75, "loss/all_rejected": 0.0}
    assert step_metrics([{"loss/all_rejected": 1.0}]) == {"train/loss": 0.0, "loss/all_rejected": 1.0}
    assert step_metrics([]) == dict(EMPTY_STEP)


def test_steps_are_averaged_over_the_steps_that_report_a_key():
    steps = [{"train/loss": 1.0, "kl_loss": 0.5, "loss/all_rejected": 0.0}, {"train/loss": 2.0, "loss/all_rejected": 1.0}]
    assert mean_over_steps(steps) == {"kl_loss": 0.5, "loss/all_rejected": 0.5, "train/loss": 1.5}
    assert list(mean_over_steps(steps)) == sorted(mean_over_steps(steps))
