"""GRPO / Dr.GRPO advantages against hand values and a per-group python reference."""
import math
import statistics

import pytest
import torch

from slime_sparse.algo import broadcast_to_tokens, grpo_advantages


def test_hand_computed_group():
    # Group [1, 0, 1]: mean 2/3, unbiased std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3).
    adv, metrics = grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 0]))
    s = math.sqrt(1 / 3)
    expected = [(1 / 3) / (s + 1e-6), (-2 / 3) / (s + 1e-6), (1 / 3) / (s + 1e-6)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert metrics["adv/groups"] == 1.0 and metrics["adv/zero_std_groups"] == 0.0


def test_matches_torch_std_unbiased_like_slime():
    rewards = torch.tensor([[0.3, 1.0, 0.0, 0.7], [2.0, -1.0, 0.5, 0.25]])
    expected = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-6)
    adv, _ = grpo_advantages(rewards.flatten(), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    torch.testing.assert_close(adv, expected.flatten())


def test_interleaved_groups_against_python_reference():
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([7, 3, 7, 9, 3, 7, 9, 3, 9, 9])
    rewards = torch.rand(10, generator=gen)
    for normalize_std in (True, False):
        adv, metrics = grpo_advantages(rewards, ids, normalize_std=normalize_std, eps=1e-6)
        for i in range(10):
            group = [float(rewards[j]) for j in range(10) if ids[j] == ids[i]]
            centered = float(rewards[i]) - statistics.fmean(group)
            want = centered / (statistics.stdev(group) + 1e-6) if normalize_std else centered
            assert float(adv[i]) == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert metrics["adv/groups"] == 3.0


def test_equal_rewards_give_exact_zero_and_are_counted():
    # Float means of equal values are not always exact: in float32, eight 0.7s give
    # (r - mean) / (std + eps) ~ 0.056 per sample with the naive formula.
    rewards = torch.tensor([0.7] * 8 + [1.0, 0.0, 5.0, 0.3, 0.3], dtype=torch.float32)
    ids = torch.tensor([0] * 8 + [1, 1, 2, 3, 3])  # group 2 has a single sample
    naive = (rewards[:8] - rewards[:8].mean()) / (rewards[:8].std() + 1e-6)
    assert naive.abs().max() > 1e-3  # the trap is real
    for normalize_std in (True, False):
        adv, metrics = grpo_advantages(rewards, ids, normalize_std=normalize_std)
        assert adv[[0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12]].tolist() == [0.0] * 11
        assert adv[8] > 0 > adv[9]
        assert metrics["adv/zero_std_groups"] == 3.0
        assert metrics["adv/groups"] == 4.0
    # float64: 0.1 - mean(0.1, 0.1, 0.1) = -1.4e-17, still exactly 0 here.
    adv, _ = grpo_advantages(torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64), torch.tensor([4, 4, 4]))
    assert adv.tolist() == [0.0, 0.0, 0.0] and adv.dtype == torch.float64


def test_dr_grpo_keeps_scale():
    adv, _ = grpo_advantages(torch.tensor([3.0, 1.0, 2.0, 10.0]), torch.tensor([0, 0, 1, 1]), normalize_std=False)
    assert adv.tolist() == [1.0, -1.0, -4.0, 4.0]


def test_integer_rewards_and_empty():
    adv, _ = grpo_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]))
    assert adv.dtype == torch.float32 and adv[0] > 0
    adv, metrics = grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert adv.numel() == 0 and metrics["adv/groups"] == 0.0


@pytest.mark.parametrize(
    "rewards, ids, match",
    [
        (torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long), "rewards must be 1-D"),
        (torch.zeros(3), torch.zeros(2, dtype=torch.long), "group_ids shape"),
        (torch.zeros(2), torch.zeros(2), "integer"),
        (torch.tensor([1.0, float("nan")]), torch.zeros(2, dtype=torch.long), "finite"),
    ],
)
def test_bad_input(rewards, ids, match):
    with pytest.raises(ValueError, match=match):
        grpo_advantages(rewards, ids)


def test_broadcast_to_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]
    with pytest.raises(ValueError):
        broadcast_to_tokens(torch.tensor([1.0]), mask)
