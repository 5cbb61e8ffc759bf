"""CISPO (`--advantage-estimator cispo`) and IcePop (`--correction-preset icepop` / `decoupled_token_icepop`) against
their reference formulas and against the peers' own tests (slime's tests/test_cispo_loss.py at slime HEAD 2026-08,
verl's tests/trainer/ppo/test_rollout_corr.py at verl HEAD 2026-08: their numbers, transcribed)."""
from __future__ import annotations

import math

import pytest
import torch

from slime_sparse.algo import AdvantageSpec, CorrectionConfig, LossConfig, policy_loss, sparsity_correction
from tests.algo.test_correction import knobs_of, run_against_oracle

ADV = torch.tensor([1.0, -0.5, 2.0, -1.0])
LOGP = torch.tensor([-0.7, -1.2, -0.4, -2.1])
# slime's CLIP_CASES: (eps_clip, eps_clip_high, raw ratios, ratios after the clamp to [1 - eps_clip, 1 + eps_clip_high])
SLIME_CASES = [
    (0.2, 0.28, [1.0, 1.14, 1.56, 0.4], [1.0, 1.14, 1.28, 0.8]),
    (1.0, 4.0, [1.0, 3.0, 9.0, 0.4], [1.0, 3.0, 5.0, 0.4]),
]


def cispo(eps_clip: float, eps_high: float) -> LossConfig:
    cfg = LossConfig(eps_clip=eps_clip, eps_clip_high=eps_high, loss_agg_mode="token-mean", policy_loss_mode="cispo")
    cfg.validate()  # --eps-clip 1.0 (no lower bound, MiniMax-M1's) is valid under CISPO
    return cfg


@pytest.mark.parametrize("eps_clip, eps_high, ratios, clamped", SLIME_CASES)
def test_cispo_matches_slimes_closed_form_and_gradient(eps_clip, eps_high, ratios, clamped):
    """loss_t = -sg(clip(r_t)) A_t log pi_t; d loss / d log pi_t = -clip(r_t) A_t (through log pi only), clipfrac
    counts the tokens the clamp changed. One row of four tokens, token-mean: each term is divided by 4."""
    logp = LOGP.clone()[None].requires_grad_(True)
    old = (LOGP - torch.log(torch.tensor(ratios)))[None]  # r = exp(logp - old) = ratios
    loss, metrics = policy_loss(logp, old, ADV[None], torch.ones(1, 4), cispo(eps_clip, eps_high))
    want = (-torch.tensor(clamped) * ADV * LOGP).mean()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad[0], -torch.tensor(clamped) * ADV / 4, rtol=1e-6, atol=1e-7)
    assert metrics["pg_clipfrac"] == pytest.approx(sum(c != r for c, r in zip(clamped, ratios)) / 4)


def test_cispo_keeps_the_gradient_ppo_clips_away():
    """The token PPO zeroes (A > 0, r above 1 + eps_high) still moves under CISPO, by sg(1 + eps_high) * A."""
    logp = torch.tensor([[-0.5]], requires_grad=True)
    old = torch.tensor([[-0.5 - math.log(1.5)]])  # r = 1.5
    adv = torch.tensor([2.0])
    ppo = LossConfig(eps_clip=0.2, eps_clip_high=0.28)
    loss, _ = policy_loss(logp, old, adv, torch.ones(1, 1), ppo)
    loss.backward()
    assert logp.grad.item() == 0.0  # the clipped branch is constant in theta
    logp.grad = None
    loss, metrics = policy_loss(logp, old, adv, torch.ones(1, 1), LossConfig(eps_clip=0.2, eps_clip_high=0.28,
                                                                             policy_loss_mode="cispo"))
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.28 * 2.0) and metrics["pg_clipfrac"] == 1.0


def test_cispo_composes_with_the_sparsity_weight_and_the_mask():
    """The correction's weight multiplies CISPO's term (slime: pg_loss * tis_weights, verl: * rollout_is_weights);
    rejected tokens leave the denominators as under PPO."""
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=gen) * 2).requires_grad_(True)
    old = logp.detach() + torch.randn(3, 5, generator=gen) * 0.3
    w = torch.rand(3, 5, generator=gen) * 2
    mask = (torch.rand(3, 5, generator=gen) > 0.3).float()
    adv = torch.tensor([1.0, -2.0, 0.5])
    cfg = LossConfig(eps_clip=0.2, eps_clip_high=0.28, loss_agg_mode="seq-mean-token-mean", policy_loss_mode="cispo")
    loss, _ = policy_loss(logp, old, adv, mask, cfg, weights=w)
    r = torch.exp(logp.detach() - old).clamp(0.8, 1.28)
    per_token = -w * r * adv[:, None] * logp
    want = torch.stack([(per_token[i] * mask[i]).sum() / mask[i].sum() for i in range(3) if mask[i].sum() > 0])
    assert loss.item() == pytest.approx((want.sum() / len(want)).item(), rel=1e-6)


def test_cispo_through_the_flags():
    """--advantage-estimator cispo: GRPO's advantages, CISPO's loss; dual clip refused; slime's warning below
    --eps-clip 1."""
    from slime_sparse.config import RunConfig
    from slime_sparse.preflight import start_warnings

    cfg = RunConfig.from_dict({"rollout": {"advantage_estimator": "cispo"}, "loss": {"eps_clip_high": 4.0}})
    assert cfg.loss.policy_loss_mode == "cispo" and cfg.rollout.advantage_spec == AdvantageSpec("cispo")
    assert RunConfig.from_dict({}).loss.policy_loss_mode == "ppo_clip"
    rewards, groups = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 1, 1, 1])
    from slime_sparse.algo import compute_advantages

    lens = torch.ones(6, dtype=torch.long)
    assert compute_advantages(rewards, groups, lens, AdvantageSpec("cispo"))[0].tolist() == \
        compute_advantages(rewards, groups, lens, AdvantageSpec("grpo"))[0].tolist()
    with pytest.raises(ValueError, match="--eps-clip=1.0 is invalid: must lie in \\(0, 1\\) so"):
        RunConfig.from_dict({"loss": {"eps_clip": 1.0}})  # PPO's clip needs 1 - eps_clip > 0
    with pytest.raises(ValueError, match="--eps-clip-c=3.0 is invalid: dual clip"):
        RunConfig.from_dict({"rollout": {"advantage_estimator": "cispo"}, "loss": {"eps_clip_c": 3.0}})
    assert any("CISPO is canonically single-sided" in w for w in start_warnings(cfg, 10))


# ------------------------------------------------------------------------------------------------ IcePop
def test_icepop_matches_verls_test():
    """verl's test_exact_icepop_zeroes_weights_without_changing_mask: raw ratios [0.4, 0.8, 6.0] under "0.5_5.0"
    give weights [0, 0.8, 0], the mask unchanged, oob ratio 2/3, std 0.3771236, ESS 1/3."""
    raw = torch.tensor([[0.4, 0.8, 6.0]])
    res = sparsity_correction(torch.zeros_like(raw), -torch.log(raw), torch.ones_like(raw),
                              CorrectionConfig.from_preset("decoupled_token_icepop"))
    torch.testing.assert_close(res.weights, torch.tensor([[0.0, 0.8, 0.0]]), atol=1e-6, rtol=1e-6)
    assert res.mask.tolist() == [[1.0, 1.0, 1.0]] and res.metrics["correction/token_reject_rate"] == 0.0
    m = res.metrics
    assert m["correction/truncate_frac"] + m["correction/clip_low_frac"] == pytest.approx(2 / 3)
    assert m["correction/is_std"] == pytest.approx(0.3771236, abs=1e-6)
    assert m["correction/is_ess"] == pytest.approx(1 / 3, abs=1e-6)


def test_icepop_presets_are_verls_factory_and_slimes_function():
    """`icepop` = verl's decoupled_token_icepop() at its defaults (rollout_is="token", threshold "0.5_5.0") = slime's
    icepop_function under --tis-clip-low 0.5 --tis-clip 5.0: weight = ratio inside the band, else 0."""
    ours, verls = CorrectionConfig.from_preset("icepop"), CorrectionConfig.from_preset("decoupled_token_icepop")
    assert knobs_of(ours) == knobs_of(verls)
    assert (ours.is_lower, ours.is_upper, ours.is_mode, ours.is_level) == (0.5, 5.0, "icepop", "token")
    xi = torch.tensor([[0.3, 0.5, 1.0, 4.9, 5.0, 5.2]])
    res = sparsity_correction(torch.log(xi), torch.zeros_like(xi), torch.ones_like(xi), ours)
    slime = torch.where((xi >= 0.5) & (xi <= 5.0), xi, torch.zeros_like(xi))  # slime's icepop_function
    torch.testing.assert_close(res.weights, slime)
    assert res.mask.sum() == 6  # nothing rejected


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("seed", range(3))
def test_icepop_mode_matches_the_oracle(level, seed):
    bounds = {"token": (0.5, 5.0), "sequence": (0.5, 2.0), "geometric": (0.95, 1.05)}[level]
    knobs = dict(is_weight=True, is_level=level, is_mode="icepop", is_lower=bounds[0], is_upper=bounds[1])
    for norm in (False, True):
        res, masks = run_against_oracle({**knobs, "batch_normalize": norm}, seed)
        assert all(all(m) for m in masks)  # icepop rejects nothing by itself


def test_icepop_zero_weight_keeps_the_token_in_the_denominator():
    """The difference from mask mode: an out-of-band token weighs 0 but still counts in token-mean's denominator."""
    xi = torch.tensor([[1.0, 10.0]])
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    loss_cfg = LossConfig(loss_agg_mode="token-mean")
    pops = sparsity_correction(torch.log(xi), torch.zeros_like(xi), torch.ones_like(xi),
                               CorrectionConfig.from_preset("icepop"))
    masks = sparsity_correction(torch.log(xi), torch.zeros_like(xi), torch.ones_like(xi),
                                CorrectionConfig(is_weight=True, is_mode="mask", is_lower=0.5, is_upper=5.0))
    adv = torch.tensor([1.0])
    a, _ = policy_loss(logp, logp.detach(), adv, pops.mask, loss_cfg, weights=pops.weights)
    b, _ = policy_loss(logp, logp.detach(), adv, masks.mask, loss_cfg, weights=masks.weights)
    assert a.item() == pytest.approx(-0.5) and b.item() == pytest.approx(-1.0)


def test_icepop_needs_its_bounds():
    with pytest.raises(ValueError, match="icepop mode needs --correction-is-weight and --correction-is-upper"):
        CorrectionConfig(is_weight=True, is_mode="icepop")
