"""Advantage estimators: one scalar per sampled response, from the outcome rewards of a rollout.

slime's `--advantage-estimator` names and semantics (verl's where slime has none), for an outcome reward R_i of
sample i in prompt group g of size n:

    grpo                          A_i = (R_i - mean_g R) / (std_g R + 1e-6)    (Dr.GRPO: without the std)
    gspo                          A_i as grpo; the PPO ratio is per sequence (`LossConfig.ratio_level`)
    cispo                         A_i as grpo; the loss is CISPO's (`LossConfig.policy_loss_mode`, MiniMax-M1): a
                                  clipped, stop-gradient ratio weighs every token's log-prob gradient
    rloo                          A_i = R_i - mean_{j in g, j != i} R_j = n / (n - 1) * (R_i - mean_g R)
    reinforce_plus_plus_baseline  A_i = R_i - mean_g R, then whitened over the batch's response tokens
    reinforce_plus_plus           A_i = G_i = R_i, then whitened over the batch's response tokens

Whitening (REINFORCE++'s "global batch normalisation"; slime's `--normalize-advantages`, which it requires for
both REINFORCE++ estimators and allows for the others): every response token carries its sequence's advantage,
and the advantages are shifted and scaled by the mean and the unbiased variance over all response tokens of the
rollout, A <- (A - mu) / sqrt(var + 1e-8), as slime's `distributed_masked_whiten` and verl's `masked_whiten`.
The tokens are those of the responses as generated, before the sparsity correction rejects any (slime's loss
masks; verl whitens after its rejection).

REINFORCE++'s token return G_t = sum_{s >= t} gamma^(s - t) r_s, with r_s = -kl_coef * KL_s + R * [s = last],
is R at every token for gamma = 1 and kl_coef = 0, the only values accepted here (`--gamma`, `--kl-coef`: a
per-token return would need per-token advantages; the KL goes into the loss instead, `--use-kl-loss`).

`std_g` is the *unbiased* sample standard deviation (divides by n - 1), as slime (`rewards.std(dim=-1)`) and verl
(`torch.std`) compute it. A group whose rewards are all equal carries no learning signal before whitening: its
advantages are exactly 0.0 (not "tiny", which a float mean/std would give; whitening then shifts them like every
other) and it is counted in "adv/zero_std_groups" / "adv/zero_std_frac" (1: no group had a gradient). A group of
one sample is such a group too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo")
WHITENED_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")  # slime requires the whitening
SEQUENCE_RATIO_ESTIMATORS = ("gspo",)  # their PPO ratio is one per sequence (GSPO's s_i)
CISPO_ESTIMATORS = ("cispo",)  # slime's #2067: the estimator names the loss (its advantages are GRPO's)
_WHITEN_EPS = 1e-8  # slime's and verl's


@dataclass(frozen=True)
class AdvantageSpec:
    """How a rollout's rewards become advantages (from `--advantage-estimator`, `--disable-grpo-std-normalization`,
    `--normalize-advantages`)."""

    estimator: str = "grpo"
    std_normalization: bool = True  # grpo / gspo / cispo: divide by the group std
    whiten: bool = False  # over the rollout's response tokens (slime's --normalize-advantages)

    @property
    def sequence_ratio(self) -> bool:
        """The loss's PPO ratio is one per sequence (GSPO)."""
        return self.estimator in SEQUENCE_RATIO_ESTIMATORS

    @property
    def policy_loss_mode(self) -> str:
        """The loss this estimator trains with (`LossConfig.policy_loss_mode`): CISPO's, or PPO's clipped one."""
        return "cispo" if self.estimator in CISPO_ESTIMATORS else "ppo_clip"

    def validate(self) -> None:
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"--advantage-estimator={self.estimator!r} is invalid: choose one of "
                             f"{ADVANTAGE_ESTIMATORS}")
        if self.estimator in WHITENED_ESTIMATORS and not self.whiten:
            raise ValueError(f"--advantage-estimator={self.estimator} needs --normalize-advantages (REINFORCE++'s "
                             "global batch normalisation; slime requires it too)")


def check_composition(spec: AdvantageSpec, loss, correction) -> None:
    """What an estimator asks of the loss (`LossConfig`) and the sparsity correction (`CorrectionConfig`).

    GSPO's PPO ratio is one per sequence, s_i = exp(mean_t log(pi_theta / pi_old)): its objective is a mean over
    sequences (verl forces seq-mean-token-mean for it), and the importance weight that corrects the sampler must
    be one per sequence too, at the geometric level (GSPO's own length normalisation: exp(mean_t log xi_t)) or the
    sequence level (prod_t xi_t); a token weight would turn the sequence's clipped term into a mean of unrelated
    token ratios. Token-level rejection (token masks, token_k* statistics) composes: a rejected token leaves the
    sequence's mean log-ratio and the loss alike, as in verl (where GSPO reads the mask after rejection).
    Every other estimator composes with every correction: advantages are per sequence and the correction acts on
    the tokens under them. OPSM reads the sign of each sample's advantage before whitening (its group-baseline form,
    what the dynamic-sampling filters can know), so it needs a group baseline: REINFORCE++ has none (its sign is
    that of the raw reward) and is refused with it."""
    if correction.opsm_delta is not None and spec.estimator == "reinforce_plus_plus":
        raise ValueError("--opsm-delta with --advantage-estimator=reinforce_plus_plus: OPSM masks sequences by the sign "
                         "of their advantage before whitening, and REINFORCE++ has no group baseline (the sign would be "
                         "the raw reward's, never negative for rewards >= 0); use reinforce_plus_plus_baseline, grpo or "
                         "rloo, or leave --opsm-delta unset")
    if not spec.sequence_ratio:
        return
    if loss.loss_agg_mode != "seq-mean-token-mean":
        raise ValueError(f"--advantage-estimator={spec.estimator} needs --loss-agg-mode seq-mean-token-mean (GSPO's "
                         f"objective is a mean over sequences), got {loss.loss_agg_mode}")
    if correction.is_weight and correction.is_level == "token":
        raise ValueError(f"--advantage-estimator={spec.estimator} with --correction-is-level token (preset "
                         f"{correction.preset}): GSPO's PPO ratio is one per sequence, so the importance weight must "
                         "be too: add --correction-is-level geometric (GSPO's length-normalised ratio) or sequence")


def _check(rewards: Tensor, group_ids: Tensor) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids shape {tuple(group_ids.shape)} != rewards shape {tuple(rewards.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite (got NaN or inf)")


def _group_stats(r: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dense group index of each sample, group sizes, group means, flat-group flags), float64."""
    _, group = torch.unique(group_ids, return_inverse=True)  # dense group index 0..G-1
    num_groups = int(group.max()) + 1
    count = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, group, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, group, r) / count
    # all-equal groups exactly (max == min), not through a float std that may be 1e-17; size 1 included
    g_max = torch.full_like(count, -torch.inf).scatter_reduce(0, group, r, reduce="amax")
    g_min = torch.full_like(count, torch.inf).scatter_reduce(0, group, r, reduce="amin")
    return group, count, mean, g_max == g_min


def _metrics(adv: Tensor, flat_group: Tensor) -> dict[str, float]:
    groups = flat_group.numel()
    return {"adv/groups": float(groups), "adv/zero_std_groups": float(flat_group.sum()),
            "adv/zero_std_frac": float(flat_group.sum()) / groups if groups else 0.0,
            "adv/abs_mean": float(adv.abs().mean()) if adv.numel() else 0.0}


def group_baseline_advantages(
    rewards: Tensor, group_ids: Tensor, estimator: str = "grpo", normalize_std: bool = True, eps: float = 1e-6,
) -> tuple[Tensor, dict[str, float]]:
    """Advantages before any whitening: each depends on its own group only (what dynamic sampling may read).

    grpo / gspo / cispo: (R - mean) / (std + eps), or R - mean without `normalize_std`; rloo: n / (n - 1) (R - mean);
    reinforce_plus_plus_baseline: R - mean; reinforce_plus_plus: R itself. Float64 inside: group statistics of many
    0/1 rewards stay exact enough to compare with references. Returns the dtype of `rewards` when floating, else
    float32, and the "adv/*" metrics.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"--advantage-estimator={estimator!r} is invalid: choose one of {ADVANTAGE_ESTIMATORS}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    _check(rewards, group_ids)
    out_dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.float32
    if rewards.numel() == 0:
        return rewards.new_zeros(0, dtype=out_dtype), _metrics(rewards.new_zeros(0), torch.zeros(0, dtype=torch.bool))
    r = rewards.to(torch.float64)
    group, count, mean, flat_group = _group_stats(r, group_ids)
    centered = r - mean[group]
    if estimator == "reinforce_plus_plus":
        adv = r
    elif estimator == "rloo":
        n = count[group]
        adv = centered * n / (n - 1).clamp_min(1.0)  # a group of one: flat, so 0 below
    elif estimator == "reinforce_plus_plus_baseline" or not normalize_std:
        adv = centered
    else:
        sq = torch.zeros_like(count).index_add_(0, group, centered * centered)
        std = torch.sqrt(sq / (count - 1).clamp_min(1.0))  # unbiased, as torch.std
        adv = centered / (std[group] + eps)
    if estimator != "reinforce_plus_plus":  # a baseline of equal rewards is exactly their value
        adv = torch.where(flat_group[group], torch.zeros_like(adv), adv)
    return adv.to(out_dtype), _metrics(adv, flat_group)


def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, normalize_std: bool = True, eps: float = 1e-6,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO's group-normalised advantages (Dr.GRPO without `normalize_std`); see `group_baseline_advantages`.

    Args:
        rewards: [N] scalar reward of each sample (finite).
        group_ids: [N] integer id of each sample's prompt group; samples of a group need not be contiguous.
    """
    return group_baseline_advantages(rewards, group_ids, "grpo", normalize_std, eps)


def whiten_over_tokens(adv: Tensor, response_lens: Tensor) -> Tensor:
    """Per-sequence advantages whitened over the batch's tokens: the statistics weigh sequence i by its response
    length (every token carries its sequence's value), mean and unbiased variance as slime / verl compute them,
    (A - mu) / sqrt(var + 1e-8). One token in all: var is taken as 0 (there is nothing to scale)."""
    if response_lens.shape != adv.shape:
        raise ValueError(f"response_lens shape {tuple(response_lens.shape)} != advantages shape {tuple(adv.shape)}")
    if adv.numel() == 0:
        return adv
    if bool((response_lens < 1).any()):
        raise ValueError("every response needs at least one token to be whitened over")
    a, w = adv.to(torch.float64), response_lens.to(torch.float64)
    tokens = w.sum()
    mu = (w * a).sum() / tokens
    var = (w * (a - mu) ** 2).sum() / (tokens - 1) if tokens > 1 else torch.zeros((), dtype=torch.float64)
    return ((a - mu) / torch.sqrt(var + _WHITEN_EPS)).to(adv.dtype)


def compute_advantages(
    rewards: Tensor, group_ids: Tensor, response_lens: Tensor, spec: AdvantageSpec = AdvantageSpec(),
) -> tuple[Tensor, dict[str, float]]:
    """[N] advantages of a rollout under `spec` (module docstring), and the "adv/*" metrics."""
    spec.validate()
    adv, metrics = group_baseline_advantages(rewards, group_ids, spec.estimator, spec.std_normalization)
    if spec.whiten:
        adv = whiten_over_tokens(adv, response_lens)
        metrics["adv/abs_mean"] = float(adv.abs().mean()) if adv.numel() else 0.0
    return adv, metrics


def broadcast_to_tokens(adv: Tensor, mask: Tensor) -> Tensor:
    """[B] per-sequence advantages -> [B, T] per-token advantages, 0 where `mask` is 0."""
    if adv.dim() != 1 or mask.dim() != 2 or adv.shape[0] != mask.shape[0]:
        raise ValueError(f"expected adv [B] and mask [B, T], got {tuple(adv.shape)} and {tuple(mask.shape)}")
    return torch.where(mask > 0, adv[:, None], torch.zeros((), dtype=adv.dtype, device=adv.device))
