"""Advantages (slime_sparse/algo/advantages.py). GRPO / Dr.GRPO against hand values and a per-group python reference;
the other estimators against their papers' formulas, each written here independently in plain Python, and
their composition with the sparsity correction (through the loop's own chain, and in one short training run).

- RLOO (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740): A_i = R_i - 1/(n-1) sum_{j != i} R_j.
- REINFORCE++ (Hu 2025, arXiv 2501.03262): token rewards r_t = -beta KL_t + R [t = last], returns
  G_t = sum_{s >= t} gamma^(s-t) r_s, normalised over every token of the batch (z-score, unbiased variance).
- REINFORCE++-baseline (same paper): R_i - mean of its group, then the same batch normalisation.
- GSPO (Zheng et al. 2025, arXiv 2507.18071): J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps, 1 + eps) A_i),
  s_i = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|), with GRPO's A_i.
"""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from slime_sparse.algo import (
    ADVANTAGE_ESTIMATORS, AdvantageSpec, CorrectionConfig, LossConfig, broadcast_to_tokens, compute_advantages,
    grpo_advantages, policy_loss,
)
from slime_sparse.algo.advantages import check_composition, whiten_over_tokens
from slime_sparse.rollout.pipeline import prepare_rollout
from slime_sparse.types import KVStats, Sample


# ------------------------------------------------------------------------------------------------------- GRPO / Dr.GRPO
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


# ------------------------------------------------------------------------------------------------- the other estimators
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.3, 0.0, 1.0, 1.0, 1.0, 0.7, 0.0, 0.25]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
LENS = [3, 7, 1, 4, 9, 2, 5, 5, 6, 1, 3, 8]


def ours(estimator: str, rewards=REWARDS, groups=GROUPS, lens=LENS) -> list[float]:
    adv, _ = compute_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), torch.tensor(lens),
                                AdvantageSpec(estimator, whiten=estimator.startswith("reinforce")))
    return adv.tolist()


def members(i: int, groups=GROUPS) -> list[int]:
    return [j for j in range(len(groups)) if groups[j] == groups[i]]


def batch_normalised(token_values: list[list[float]]) -> list[list[float]]:
    """REINFORCE++'s normalisation over every token of the batch: (x - mean) / sqrt(unbiased var + 1e-8)."""
    flat = [x for row in token_values for x in row]
    mu, var = statistics.fmean(flat), statistics.variance(flat)
    return [[(x - mu) / math.sqrt(var + 1e-8) for x in row] for row in token_values]


def reinforce_pp_returns(rewards, lens, kl=None, beta=0.0, gamma=1.0) -> list[list[float]]:
    """G_t of every token: the paper's discounted sum of r_s = -beta KL_s + R [s = last]."""
    out = []
    for i, (reward, n) in enumerate(zip(rewards, lens)):
        r = [-beta * (kl[i][t] if kl else 0.0) + (reward if t == n - 1 else 0.0) for t in range(n)]
        out.append([sum(gamma ** (s - t) * r[s] for s in range(t, n)) for t in range(n)])
    return out


def per_token(adv: list[float], lens=LENS) -> list[list[float]]:
    return [[a] * n for a, n in zip(adv, lens)]


def test_rloo_is_reward_minus_the_mean_of_the_others():
    want = [REWARDS[i] - statistics.fmean(REWARDS[j] for j in members(i) if j != i) for i in range(len(REWARDS))]
    assert ours("rloo") == pytest.approx(want, abs=1e-12)


def test_reinforce_plus_plus_is_the_papers_normalised_return():
    # at the values accepted here (gamma 1, no KL in the reward) every token's return is its sequence's reward
    returns = reinforce_pp_returns(REWARDS, LENS)
    assert returns == per_token(REWARDS)
    want = batch_normalised(returns)
    got = per_token(ours("reinforce_plus_plus"))
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-9)
    # the reference is not trivially constant per sequence: with gamma < 1 it would not be (hence --gamma 1 only)
    assert reinforce_pp_returns(REWARDS, LENS, gamma=0.9)[1] != per_token(REWARDS)[1] or REWARDS[1] == 0.0


def test_reinforce_plus_plus_baseline_is_the_group_centred_reward_normalised_over_the_batch():
    centred = [REWARDS[i] - statistics.fmean(REWARDS[j] for j in members(i)) for i in range(len(REWARDS))]
    want = batch_normalised(per_token(centred))
    for g, w in zip(per_token(ours("reinforce_plus_plus_baseline")), want):
        assert g == pytest.approx(w, abs=1e-9)


def test_whitening_weighs_sequences_by_their_tokens():
    """Two sequences: one of 1 token with A=1, one of 3 with A=0; per-token mean 0.25, not 0.5."""
    out = whiten_over_tokens(torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([1, 3]))
    var = statistics.variance([1.0, 0.0, 0.0, 0.0])
    assert out.tolist() == pytest.approx([0.75 / math.sqrt(var + 1e-8), -0.25 / math.sqrt(var + 1e-8)])


def test_gspo_advantages_are_grpos():
    assert ours("gspo") == ours("grpo")
    assert AdvantageSpec("gspo").sequence_ratio and not AdvantageSpec("grpo").sequence_ratio


def gspo_objective(logp: torch.Tensor, old: list[list[float]], adv: list[float], lens: list[int], eps: float,
                   weights: list[float] | None = None) -> torch.Tensor:
    """-J of the GSPO paper, with s_i from products of probabilities (float64), differentiable in `logp`."""
    terms = []
    for i, n in enumerate(lens):
        ratio_prod = torch.ones((), dtype=torch.float64)
        for t in range(n):
            ratio_prod = ratio_prod * torch.exp(logp[i, t]) / math.exp(old[i][t])
        s = ratio_prod ** (1.0 / n)
        term = torch.minimum(s * adv[i], s.clamp(1 - eps, 1 + eps) * adv[i])
        terms.append(term * (weights[i] if weights else 1.0))
    return -torch.stack(terms).mean()


@pytest.mark.parametrize("with_weights", [False, True])
def test_gspo_loss_and_gradient_match_the_paper(with_weights):
    gen = torch.Generator().manual_seed(3)
    lens = [3, 5, 1, 4]
    b, t = len(lens), max(lens)
    mask = torch.tensor([[1.0 if j < n else 0.0 for j in range(t)] for n in lens], dtype=torch.float64)
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 2 - 1
    # pi_theta moved: sequence 0 (A > 0) above the clip range, sequence 1 (A < 0) below it, the others inside
    shift = torch.tensor([0.4, -0.5, 0.05, -0.1], dtype=torch.float64)[:, None]
    theta = (old + shift + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.1).clamp(max=0.0)
    adv = [1.5, -0.7, 0.4, -2.0]
    seq_w = [0.8, 1.3, 1.0, 0.5]
    weights = torch.tensor(seq_w, dtype=torch.float64)[:, None].expand(b, t) if with_weights else None
    cfg = LossConfig(eps_clip=0.2, ratio_level="sequence")
    logp = theta.clone().requires_grad_(True)
    loss, metrics = policy_loss(logp, old, torch.tensor(adv, dtype=torch.float64), mask, cfg, weights=weights)
    loss.backward()
    ref_logp = theta.clone().requires_grad_(True)
    ref = gspo_objective(ref_logp, old.tolist(), adv, lens, 0.2, seq_w if with_weights else None)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(logp.grad * mask, ref_logp.grad * mask, rtol=1e-9, atol=1e-12)
    s = [math.exp(float(((theta[i] - old[i]) * mask[i]).sum() / lens[i])) for i in range(b)]
    assert s[0] > 1.2 and s[1] < 0.8 and all(0.8 < x < 1.2 for x in s[2:])  # the clip binds on both sides
    assert metrics["pg_clipfrac"] == pytest.approx(0.5)  # two of four sequences, every token of each
    # the token-level loss is another objective on the same batch
    token = policy_loss(theta, old, torch.tensor(adv, dtype=torch.float64), mask, LossConfig(eps_clip=0.2))[0]
    assert token.item() != pytest.approx(loss.item())


def test_gspo_sequence_ratio_reads_the_kept_tokens_only():
    """A token the correction rejected leaves the sequence's mean log-ratio, as it leaves the loss."""
    old = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    theta = torch.tensor([[-0.9, -1.1, -5.0]], dtype=torch.float64)  # the third token moved a lot
    kept = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    cfg = LossConfig(eps_clip=0.5, ratio_level="sequence")
    loss, _ = policy_loss(theta, old, torch.tensor([1.0], dtype=torch.float64), kept, cfg)
    assert loss.item() == pytest.approx(-math.exp(((-0.9 + 1.0) + (-1.1 + 1.0)) / 2))  # s = exp(0) = 1


def test_composition_rules():
    mis = CorrectionConfig.from_preset("mis")
    check_composition(AdvantageSpec("gspo"), LossConfig(), CorrectionConfig.from_preset("mis", is_level="geometric"))
    check_composition(AdvantageSpec("gspo"), LossConfig(), CorrectionConfig.from_preset("decoupled_seq_is"))
    check_composition(AdvantageSpec("gspo"), LossConfig(), CorrectionConfig.from_preset("decoupled_geo_rs"))
    with pytest.raises(ValueError, match="--correction-is-level token .*geometric"):
        check_composition(AdvantageSpec("gspo"), LossConfig(), mis)
    with pytest.raises(ValueError, match="--loss-agg-mode seq-mean-token-mean"):
        check_composition(AdvantageSpec("gspo"), LossConfig(loss_agg_mode="token-mean"),
                          CorrectionConfig.from_preset("mis", is_level="geometric"))
    for name in ADVANTAGE_ESTIMATORS:  # token-level weights compose with every per-token-ratio estimator
        if name != "gspo":
            check_composition(AdvantageSpec(name, whiten=name.startswith("reinforce")), LossConfig(), mis)
    with pytest.raises(ValueError, match="needs --normalize-advantages"):
        AdvantageSpec("reinforce_plus_plus_baseline").validate()
    opsm = CorrectionConfig.from_preset("mis", opsm_delta=1e-4)  # OPSM reads the group-baseline sign
    with pytest.raises(ValueError, match="--opsm-delta with --advantage-estimator=reinforce_plus_plus: .*no group"):
        check_composition(AdvantageSpec("reinforce_plus_plus", whiten=True), LossConfig(), opsm)
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        check_composition(AdvantageSpec(name, whiten=name.startswith("reinforce")), LossConfig(), opsm)


class FixedLearner:
    """pi_old (and pi_ref) given per sample: the learner's side of prepare_rollout."""

    def __init__(self, old: list[list[float]]) -> None:
        self.old = old

    def compute_logprobs(self, tokens, response_lens, *, ref: bool = False, shadow=None):
        return [torch.tensor(self.old[i][:n], dtype=torch.float32) for i, n in enumerate(response_lens)]


def samples_and_learner():
    gen = torch.Generator().manual_seed(0)
    samples, old = [], []
    for i, (reward, group, n) in enumerate(zip(REWARDS, GROUPS, LENS)):
        o = (-torch.rand(n, generator=gen) * 2).tolist()
        sparse = [x + float(torch.randn((), generator=gen)) * 0.4 for x in o]  # a sparsity mismatch
        if i == 5:  # one token the dense policy finds ~impossible: the veto rejects the sequence
            sparse[0] = min(o[0] + 12.0, 0.0)
            o[0] = sparse[0] - 12.0
        samples.append(Sample(prompt_index=group, prompt_ids=[1, 2], response_ids=[3] * n, rollout_logprobs=sparse,
                              finish_reason="stop", reward=reward,
                              kv=KVStats(dense_kv_tokens=n, kept_kv_tokens=n, peak_kv_tokens=n)))
        old.append(o)
    return samples, FixedLearner(old)


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_each_estimator_composes_with_the_correction(estimator):
    """Through the loop's chain: the advantages are the estimator's (whitened over every generated token, before
    any rejection, as slime), and the correction's mask and weights do not depend on the estimator."""
    samples, learner = samples_and_learner()
    spec = AdvantageSpec(estimator, whiten=estimator.startswith("reinforce"))
    correction = CorrectionConfig.from_preset("mis", **({"is_level": "geometric"} if spec.sequence_ratio else {}))
    check_composition(spec, LossConfig(), correction)
    prepared = prepare_rollout(samples, learner, correction, advantage_spec=spec)
    assert prepared.batch.advantages.tolist() == pytest.approx(ours(estimator), abs=1e-6)
    # the correction did act on this batch: the veto and the token mask
    assert prepared.metrics["correction/seq_reject_rate"] > 0 and prepared.metrics["correction/token_reject_rate"] > 0
    grpo = prepare_rollout(samples, learner, correction)
    assert [m.tolist() for m in prepared.batch.loss_masks] == [m.tolist() for m in grpo.batch.loss_masks]
    assert [w.tolist() for w in prepared.batch.weights] == [w.tolist() for w in grpo.batch.weights]
    # and the loss of the first micro-batch is finite with a gradient
    cfg = LossConfig(ratio_level="sequence" if spec.sequence_ratio else "token")
    pad = lambda xs: torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)  # noqa: E731
    logp = (pad(prepared.batch.old_logprobs) + 0.05).clamp(max=0.0).requires_grad_(True)
    loss, _ = policy_loss(logp, pad(prepared.batch.old_logprobs), prepared.batch.advantages,
                          pad(prepared.batch.loss_masks), cfg, weights=pad(prepared.batch.weights))
    loss.backward()
    assert math.isfinite(loss.item()) and bool(logp.grad.abs().sum() > 0)


def test_one_sample_per_prompt_is_refused_only_where_a_group_baseline_is_used(tmp_path):
    from slime_sparse.config_loader import load_config

    model = tmp_path / "model"
    model.mkdir()
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--n-samples-per-prompt", "1",
            "--rollout-batch-size", "4", "--global-batch-size", "4"]
    assert load_config(base + ["--advantage-estimator", "reinforce_plus_plus"]).rollout.n_samples_per_prompt == 1
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError, match="--n-samples-per-prompt=1"):
            load_config(base + ["--advantage-estimator", name])


@pytest.mark.parametrize("flags", [
    ["--advantage-estimator", "gspo", "--correction-is-level", "geometric"],
    ["--advantage-estimator", "reinforce_plus_plus_baseline"],
    ["--advantage-estimator", "cispo", "--eps-clip", "1.0", "--eps-clip-high", "4.0"],  # MiniMax-M1's band
])
def test_a_training_run_with_the_estimator(tiny_assets, tmp_path, flags):
    """The loop end to end (R-KV rollouts, the mis correction, both learner passes) under the estimator."""
    from slime_sparse.train import main
    from tests.helpers.tiny_runs import rollout_rows, run_args

    run = tmp_path / "run"
    assert main(run_args(tiny_assets(n_train=64), run, 1, *flags)) == 0
    (row,) = rollout_rows(run)
    for key in ("train/loss", "adv/abs_mean", "correction/token_reject_rate", "pg_clipfrac"):
        assert math.isfinite(row[key]), key
