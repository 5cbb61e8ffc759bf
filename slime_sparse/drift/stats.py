"""The drift guard's statistics: how far apart the same policy's answers are, sampled densely and under the run's
compressed KV cache, from the same random streams. Pure Python over plain lists (no torch, nothing of ours).

A probe draws n samples of each held-out prompt twice with the same seed and sample indices (the same random stream
per sample): once dense, once under the run's KV settings. Until the cache first compresses the two arms write the
same tokens, so a pair differs only where compression changed what the sampler wrote, and the paired difference of
rewards measures what compression does to the reward the learner sees, with much less noise than two independent
batches. Pairs of one prompt are not independent of each other, so the standard error is over prompts (each
prompt's mean gap is one observation; the n samples of a prompt weigh equally).

The alarm: the gap is significant (|gap| >= ALARM_Z standard errors) at two consecutive probes, with the same sign.
One probe of 16 prompts has a noisy standard error (a t with 15 degrees of freedom exceeds 2.5 in ~2.5 % of
null probes); two in a row bring a false alarm down to ~1e-3 per pair of probes, while a real gap, which persists,
fires at the second probe that sees it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

ALARM_Z = 2.5  # |gap| / standard error at which one probe counts as significant
ALARM_PROBES = 2  # consecutive significant probes (same sign) that make an alarm


@dataclass(frozen=True)
class Arm:
    """One arm of a probe, one entry per sample (prompt-major, the same order in both arms).

    group: the sample's prompt; compressed_tokens: response tokens generated after the cache's first compression
    (0 when it never compressed; None when unknown: an engine that returned no eviction record)."""

    rewards: Sequence[float]
    lengths: Sequence[int]
    responses: Sequence[Sequence[int]]
    groups: Sequence[int]
    compressed_tokens: Sequence[int | None]


def clustered_mean(values: Sequence[float], groups: Sequence[int]) -> tuple[float, float]:
    """(mean, standard error) of `values` with each group's mean one observation: mean over groups of the group
    means, standard error = their sample standard deviation / sqrt(groups). NaN standard error with one group."""
    if len(values) != len(groups) or not values:
        raise ValueError(f"values ({len(values)}) and groups ({len(groups)}) must be non-empty and of one length")
    sums: dict[int, list[float]] = {}
    for v, g in zip(values, groups):
        sums.setdefault(g, []).append(float(v))
    means = [sum(vs) / len(vs) for vs in sums.values()]
    k = len(means)
    mean = sum(means) / k
    if k < 2:
        return mean, math.nan
    var = sum((m - mean) ** 2 for m in means) / (k - 1)
    return mean, math.sqrt(var / k)


def z_score(gap: float, se: float) -> float:
    """gap / se; 0 for no gap, +-inf for a gap with zero spread, NaN where the spread is unknown."""
    if math.isnan(se):
        return math.nan
    if se == 0.0:
        return 0.0 if gap == 0.0 else math.copysign(math.inf, gap)
    return gap / se


def significance(gap: float, se: float, z: float = ALARM_Z) -> int:
    """+1 / -1: the gap is significant and positive / negative; 0: not significant (or unknown spread)."""
    score = z_score(gap, se)
    if math.isnan(score) or abs(score) < z:
        return 0
    return 1 if score > 0 else -1


def compressed_after(prompt_len: int, response_len: int, first_start: int | None) -> int:
    """Response tokens sampled from a compressed cache: token j is sampled by the forward of position
    prompt_len - 1 + j, which sees a compressed cache once that position is past the first compression's start
    (`EvictionRecord.starts[0]`: tokens [0, start) had gone through the model before it). None: never compressed."""
    if first_start is None:
        return 0
    first = max(0, first_start - (prompt_len - 1))
    return max(0, response_len - first)


def _check_pairs(dense: Arm, comp: Arm) -> int:
    n = len(dense.rewards)
    for arm, name in ((dense, "dense"), (comp, "compressed")):
        sizes = {len(arm.rewards), len(arm.lengths), len(arm.responses), len(arm.groups), len(arm.compressed_tokens)}
        if sizes != {n}:
            raise ValueError(f"the {name} arm's fields have lengths {sorted(sizes)}, expected {n} samples each")
    if list(dense.groups) != list(comp.groups):
        raise ValueError("the two arms must hold the same prompts in the same order (paired samples)")
    if n == 0:
        raise ValueError("a probe needs at least one sample")
    return n


def probe_metrics(dense: Arm, comp: Arm, prefix: str = "drift/") -> dict[str, float]:
    """The probe's comparison of the compressed arm `comp` with the dense arm `dense` (paired by position):

        reward_gap, reward_gap_se   mean reward dense - compressed, and its standard error over prompts
        reward_gap_z                their ratio (0: no gap at all)
        reward_dense, reward_compressed   each arm's mean reward
        length_ratio                mean response length compressed / dense
        compressed_frac             share of the compressed arm's response tokens sampled from a compressed cache
                                    (over the samples whose engine said where the first compression was)
        answer_agreement            share of pairs whose two responses are the same tokens
        reward_agreement            share of pairs with the same reward
    """
    n = _check_pairs(dense, comp)
    gaps = [d - c for d, c in zip(dense.rewards, comp.rewards)]
    gap, se = clustered_mean(gaps, dense.groups)
    known = [(c, length) for c, length in zip(comp.compressed_tokens, comp.lengths) if c is not None]
    known_tokens = sum(length for _, length in known)
    dense_len = sum(dense.lengths) / n
    return {
        f"{prefix}reward_gap": gap,
        f"{prefix}reward_gap_se": se if not math.isnan(se) else 0.0,
        f"{prefix}reward_gap_z": z_score(gap, se) if not math.isnan(se) else 0.0,
        f"{prefix}reward_dense": sum(dense.rewards) / n,
        f"{prefix}reward_compressed": sum(comp.rewards) / n,
        f"{prefix}length_ratio": (sum(comp.lengths) / n) / dense_len if dense_len else 1.0,
        f"{prefix}compressed_frac": sum(c for c, _ in known) / known_tokens if known_tokens else 0.0,
        f"{prefix}answer_agreement": sum(list(a) == list(b) for a, b in zip(dense.responses, comp.responses)) / n,
        f"{prefix}reward_agreement": sum(g == 0.0 for g in gaps) / n,
    }


@dataclass
class Streak:
    """Consecutive probes significant with one sign: `sign` (0: the last probe was not significant) and `count`."""

    sign: int = 0
    count: int = 0

    def update(self, sign: int) -> int:
        """Add one probe's significance (+1 / -1 / 0); returns the streak's length (0 when not significant)."""
        self.count = self.count + 1 if sign != 0 and sign == self.sign else (1 if sign != 0 else 0)
        self.sign = sign
        return self.count

    @property
    def alarmed(self) -> bool:
        return self.count >= ALARM_PROBES

    def state_dict(self) -> dict:
        return {"sign": self.sign, "count": self.count}

    @classmethod
    def from_state(cls, state: dict) -> "Streak":
        return cls(sign=int(state["sign"]), count=int(state["count"]))
