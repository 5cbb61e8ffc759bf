"""GRPO advantages: one scalar per sampled response, normalised within its prompt group.

    A_i = (R_i - mean_g R) / (std_g R + eps)      (GRPO)
    A_i =  R_i - mean_g R                          (Dr.GRPO, normalize_std=False)

`std_g` is the *unbiased* sample standard deviation (divides by n - 1), which is what slime
(`rewards.std(dim=-1)`) and verl (`torch.std`) compute for GRPO, so our advantages match theirs
number for number.

A group whose rewards are all equal carries no learning signal: its advantages are set to exactly
0.0 (not "tiny", which a float mean/std would give) and the group is counted in
"adv/zero_std_groups" (and "adv/zero_std_frac", the fraction of groups: 1 means no gradient at all). A group of one sample is such a group too (its std is undefined).
"""
from __future__ import annotations

import torch
from torch import Tensor


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, dict[str, float]]:
    """Group-normalised advantages.

    Args:
        rewards: [N] scalar reward of each sample (finite).
        group_ids: [N] integer id of each sample's prompt group; samples of a group need not be
            contiguous.
        normalize_std: divide by the group std (GRPO); False keeps only the mean baseline (Dr.GRPO).
        eps: added to the std before dividing.

    Returns:
        advantages [N] (dtype of `rewards` when floating, else float32) and metrics:
        "adv/groups", "adv/zero_std_groups" (groups with all-equal rewards), "adv/zero_std_frac" (their
        fraction), "adv/abs_mean".
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids shape {tuple(group_ids.shape)} != rewards shape {tuple(rewards.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    out_dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.float32
    if rewards.numel() == 0:
        return rewards.new_zeros(0, dtype=out_dtype), {"adv/groups": 0.0, "adv/zero_std_groups": 0.0,
                                                       "adv/zero_std_frac": 0.0, "adv/abs_mean": 0.0}
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite (got NaN or inf)")

    # float64 internally: group statistics of many 0/1 rewards stay exact enough to compare with references.
    r = rewards.to(torch.float64)
    _, group = torch.unique(group_ids, return_inverse=True)  # dense group index 0..G-1
    num_groups = int(group.max()) + 1
    count = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, group, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, group, r) / count
    centered = r - mean[group]

    # Detect all-equal groups exactly (max == min), not through a float std that may be 1e-17.
    g_max = torch.full_like(count, -torch.inf).scatter_reduce(0, group, r, reduce="amax")
    g_min = torch.full_like(count, torch.inf).scatter_reduce(0, group, r, reduce="amin")
    flat_group = g_max == g_min  # includes groups of size 1

    adv = centered
    if normalize_std:
        sq = torch.zeros_like(count).index_add_(0, group, centered * centered)
        std = torch.sqrt(sq / (count - 1).clamp_min(1.0))  # unbiased, as torch.std
        adv = centered / (std[group] + eps)
    adv = torch.where(flat_group[group], torch.zeros_like(adv), adv)

    metrics = {
        "adv/groups": float(num_groups),
        "adv/zero_std_groups": float(flat_group.sum()),
        "adv/zero_std_frac": float(flat_group.sum()) / num_groups,
        "adv/abs_mean": float(adv.abs().mean()),
    }
    return adv.to(out_dtype), metrics


def broadcast_to_tokens(adv: Tensor, mask: Tensor) -> Tensor:
    """[B] per-sequence advantages -> [B, T] per-token advantages, 0 where `mask` is 0."""
    if adv.dim() != 1 or mask.dim() != 2 or adv.shape[0] != mask.shape[0]:
        raise ValueError(f"expected adv [B] and mask [B, T], got {tuple(adv.shape)} and {tuple(mask.shape)}")
    return torch.where(mask > 0, adv[:, None], torch.zeros((), dtype=adv.dtype, device=adv.device))
