"""How a learner's metrics combine: over the micro-batches of a step, the data-parallel ranks of a step, the steps
of a rollout. The rule of every key is declared here, once.

- Summed over micro-batches and ranks (the default): every loss term and loss metric is normalised by the step's
  global counts (`TrainBatch.num_seqs` / `num_tokens`), so the parts add up to the whole-step value.
- `MIN_KEYS`: flags that hold for the step only if they hold for every part.
- `REPLICATED_KEYS`: computed after the gradient all-reduce, equal on every rank: taken once.
- Averaged over the optimizer steps of a rollout (what the loop logs per rollout): every key, over the steps
  that report it.
A step with no micro-batch reports `EMPTY_STEP`. A key missing from a part (an empty shard logs no loss terms)
contributes nothing.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

MIN_KEYS = frozenset({"loss/all_rejected"})
REPLICATED_KEYS = frozenset({"train/grad_norm", "train/lr"})
EMPTY_STEP: Mapping[str, float] = {"train/loss": 0.0, "loss/all_rejected": 1.0}


def merge_parts(parts: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """One step's metrics from its parts' (micro-batches, or the ranks of a data-parallel step)."""
    merged: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            value = float(value)
            if key not in merged:
                merged[key] = value
            elif key in MIN_KEYS:
                merged[key] = min(merged[key], value)
            elif key not in REPLICATED_KEYS:
                merged[key] += value
    return merged


def step_metrics(micro_batches: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """A learner's step metrics from its micro-batches' (EMPTY_STEP's values where none reported a key)."""
    return merge_parts([EMPTY_STEP, *micro_batches])


def mean_over_steps(steps: list[Mapping[str, float]]) -> dict[str, float]:
    """A rollout's metrics from its optimizer steps': each key averaged over the steps that report it."""
    means: dict[str, float] = {}
    for key in sorted({k for m in steps for k in m}):
        values = [m[key] for m in steps if key in m]
        means[key] = sum(values) / len(values)
    return means
