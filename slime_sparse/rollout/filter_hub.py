"""Dynamic-sampling filters (DAPO; slime's `--dynamic-sampling-filter-path`): which generated groups go into the
train batch. Pure functions over `Sample`s, shared by every engine.

A filter is `fn(cfg, samples, **kwargs) -> DynamicFilterOutput | bool`, called once per group (the
--n-samples-per-prompt samples of one prompt, rewards assigned and `Sample.rejected` set by the sparsity
correction: `rollout.pipeline.correct`, whose verdict the batch then trains with); `cfg` is the run config (slime
passes its args). The default rollout function (`rollout.sparse_rollout`) draws
--over-sampling-batch-size prompts in its first round (later ones: `round_size`) and judges their groups in stream
order with `select_groups` until the batch holds --rollout-batch-size kept groups; the groups it did not need go
back to the prompt stream.

Built in (name them in --dynamic-sampling-filter-path by their bare names or full paths; several paths: a group
must pass each):
- `check_reward_nonzero_std` (slime's): drop a group whose rewards are all equal: its GRPO advantages are 0;
- `check_reward_nonzero_std_with_fallback` (slime's): the same, but keep such a group when dropping it would
  leave too few candidates in this round to fill the batch (no extra round is started for it);
- `check_min_kept_samples` (ours): drop a group with fewer than --dynamic-sampling-min-kept-samples samples the
  sparsity correction kept (Sparse-RL rejects whole sequences; a group it emptied carries no gradient).
slime's paths of its two filters (`slime.rollout.filter_hub.dynamic_sampling_filters.*`) name ours.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from slime_sparse.types import Sample
from slime_sparse.utils.imports import load_function

FILTER_FLAG = "--dynamic-sampling-filter-path"
_SLIME_HUB = "slime.rollout.filter_hub.dynamic_sampling_filters."


@dataclass
class DynamicFilterOutput:
    """A filter's verdict on one group (slime's type). keep_when_insufficient: keep it anyway when dropping it
    would leave fewer candidates in the round than the batch still needs."""

    keep: bool
    reason: str | None = None  # why it was dropped: counted under rollout/dynamic_filter/drop_<reason>
    keep_when_insufficient: bool = False


def check_reward_nonzero_std(cfg: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    keep = bool(rewards.std() > 1e-6)
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(float(rewards[0]), 1)}")


def check_reward_nonzero_std_with_fallback(cfg: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    output = check_reward_nonzero_std(cfg, samples, **kwargs)
    output.keep_when_insufficient = True
    return output


def check_min_kept_samples(cfg: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    if any(s.rejected is None for s in samples):  # never a silent keep-all: the verdict was not taken
        raise ValueError(f"{FILTER_FLAG} check_min_kept_samples reads the sparsity correction's verdict on each sample "
                         "(Sample.rejected), but the group of prompt index "
                         f"{samples[0].prompt_index} was not judged: the rollout function (--rollout-function-path) "
                         "must call slime_sparse.rollout.pipeline.correct on a round's samples before its filters, and "
                         "hand the result on in RolloutFnTrainOutput.correction (the default, "
                         "slime_sparse.rollout.sparse_rollout.generate_rollout, does)")
    kept = sum(not s.rejected for s in samples)
    keep = kept >= cfg.rollout.dynamic_sampling_min_kept_samples
    return DynamicFilterOutput(keep=keep, reason=None if keep else "few_kept")


# paths that name a built-in filter besides its own: slime's, and the bare names
BUILT_IN: dict[str, Callable] = {
    **{fn.__name__: fn for fn in (check_reward_nonzero_std, check_reward_nonzero_std_with_fallback,
                                  check_min_kept_samples)},
    _SLIME_HUB + "check_reward_nonzero_std": check_reward_nonzero_std,
    _SLIME_HUB + "check_reward_nonzero_std_with_fallback": check_reward_nonzero_std_with_fallback,
}


def load_filters(paths: Sequence[str]) -> list[Callable]:
    """The filters named by --dynamic-sampling-filter-path (ValueError naming the flag for a bad path)."""
    return [BUILT_IN[p] if p in BUILT_IN else load_function(p, FILTER_FLAG) for p in paths]


def judge(filters: Sequence[Callable], cfg: Any, samples: list[Sample]) -> DynamicFilterOutput:
    """The first verdict that drops the group, else keep. A filter may return a bare bool (slime's old form)."""
    for fn in filters:
        output = fn(cfg, samples)
        if not isinstance(output, DynamicFilterOutput):
            output = DynamicFilterOutput(keep=bool(output))
        if not output.keep:
            return output
    return DynamicFilterOutput(keep=True)


@dataclass
class Selection:
    """What `select_groups` made of one round: `kept` (indices of the groups that go into the batch), `dropped`
    (count per reason), `judged` (groups looked at, from the first: the ones after it were not needed)."""

    kept: list[int] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    judged: int = 0


def select_groups(groups: Sequence[list[Sample]], filters: Sequence[Callable], cfg: Any, need: int) -> Selection:
    """Judge `groups` in order until `need` are kept. A dropped group with keep_when_insufficient is kept when
    it and the groups after it are no more than the batch still needs (slime's rule)."""
    sel = Selection()
    for i, group in enumerate(groups):
        if len(sel.kept) == need:
            break
        sel.judged = i + 1
        verdict = judge(filters, cfg, group)
        candidates = len(sel.kept) + len(groups) - i
        if verdict.keep or (verdict.keep_when_insufficient and candidates <= need):
            sel.kept.append(i)
        else:
            sel.dropped[verdict.reason or "filtered"] += 1
    return sel


def round_size(first: int, need: int, kept: int, judged: int) -> int:
    """Prompts the next generation round draws: `first` (--over-sampling-batch-size) for the first round; after it,
    the groups the batch still `need`s over the pass rate seen so far (`kept` of `judged`), at least `need` and at
    most `first`. slime draws `first` every time, but its rounds are asynchronous and abort what is not needed;
    ours run whole, so a fixed size would generate groups only to put them back."""
    if kept == 0:  # the first round, or nothing passed yet: no rate to go by
        return first
    return min(first, max(need, math.ceil(need * judged / kept)))
