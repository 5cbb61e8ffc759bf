"""Fuzz of the objective: adversarial batches through advantages -> correction -> loss -> metrics.

Log-probs with -inf, +inf, NaN, huge and tiny magnitudes, positive values, empty masks, all-rejected and
zero-variance groups, length-1 responses, garbage in the padding. What must hold for every batch:
- no NaN/inf in any loss, gradient or metric;
- every rejection counted: a sequence with a non-finite log-prob (sampler or learner) at a response
  position is rejected whole and counted in correction/nonfinite_seqs (the paper's veto, docs/algorithm.md,
  extended to "cannot be judged"); the rejection rates equal an independent count of the output mask.

The contract on inputs (docstring of algo/correction.py): sampler log-probs may be anything; learner
log-probs (pi_old, pi_theta, pi_ref) come from one log_softmax, so pi_theta is non-finite exactly where
pi_old is (the same model) and pi_ref is finite (the frozen start of that model) but may be far from
pi_theta. Rewards are finite (the reward function checks it) and, for Dr.GRPO's unnormalised advantages, of a
sane magnitude (here up to 1e6: with xi and the PPO ratio each up to e^20 a float32 loss holds |A| up to ~1e21).
A fixed-seed generator makes every case reproducible: `pytest -k "fuzz and seed"`.
The pipeline cases cycle through every advantage estimator (GSPO with a geometric-level weight).
The default run checks FAST_CASES batches at the algorithm level and through pipeline.prepare_rollout;
`-m slow` runs FULL_CASES of each.
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import pytest
import torch

from slime_sparse.algo import (
    ADVANTAGE_ESTIMATORS, AGG_MODES, KL_TYPES, PRESETS, AdvantageSpec, CorrectionConfig, LossConfig, grpo_advantages,
    mismatch_metrics, policy_loss, sparsity_correction,
)
from slime_sparse.algo.advantages import check_composition
from slime_sparse.algo.loss import RATIO_LEVELS
from slime_sparse.backends.base import microbatch_loss
from slime_sparse.rollout.pipeline import prepare_rollout, split_steps
from slime_sparse.types import KVStats, Sample

FAST_CASES = 200
FULL_CASES = 1200

INF, NAN = float("inf"), float("nan")
# sampler-side specials: anything a broken engine could return
SAMPLER_SPECIALS = [-INF, INF, NAN, -1e30, -3e38, -1e4, -100.0, -1e-45, -1e-30, 0.0, 1e-30, 5.0, 3e38]
# learner-side specials (one float32 log_softmax of finite logits): -inf for a token the model rules out, NaN
# for a broken forward, and extreme but finite values down to LEARNER_FLOOR
LEARNER_FLOOR = -1e4
LEARNER_SPECIALS = [-INF, NAN, LEARNER_FLOOR, -100.0, -1e-45, 0.0]


@dataclass
class Case:
    logp_old: torch.Tensor  # [B, T] float32
    logp_sparse: torch.Tensor
    logp_ref: torch.Tensor
    mask: torch.Tensor  # [B, T] 0/1
    lengths: list[int]
    rewards: torch.Tensor  # [B]
    group_ids: torch.Tensor  # [B]
    noise: torch.Tensor  # pi_theta = pi_old + noise


def adversarial_case(seed: int, *, min_len: int = 0) -> Case:
    """One adversarial batch; the kind of trouble it holds is drawn from the seed."""
    rng = random.Random(seed)
    groups, per_group = rng.randint(1, 4), rng.choice([1, 1, 2, 4, 8])
    b = groups * per_group
    t = rng.choice([1, 1, 2, 5, 17])
    lengths = [rng.choice([t, rng.randint(min_len, t), 1 if t >= 1 else 0]) for _ in range(b)]
    lengths = [max(min_len, min(t, n)) for n in lengths]

    old = [[-rng.expovariate(rng.choice([0.3, 1.0, 10.0])) for _ in range(t)] for _ in range(b)]
    spread = rng.choice([0.0, 0.01, 0.3, 3.0, 30.0])
    sparse = [[o + rng.gauss(0.0, spread) for o in row] for row in old]
    p_sampler, p_learner = rng.choice([0.0, 0.02, 0.2, 1.0]), rng.choice([0.0, 0.0, 0.02, 0.2])
    for i in range(b):
        for j in range(t):
            if rng.random() < p_learner:
                old[i][j] = rng.choice(LEARNER_SPECIALS)
            if rng.random() < p_sampler:
                sparse[i][j] = rng.choice(SAMPLER_SPECIALS)
    kind = rng.choice(["clean", "all_nonfinite", "all_vetoed", "identical", "huge"])
    if kind == "all_nonfinite":
        sparse = [[rng.choice([-INF, NAN, INF]) for _ in range(t)] for _ in range(b)]
    elif kind == "all_vetoed":  # pi_old finds every sample (near) impossible: the veto rejects all
        sparse = [[o + 50.0 for o in row] for row in old]
    elif kind == "identical":
        sparse = [list(row) for row in old]
    elif kind == "huge":
        old = [[LEARNER_FLOOR * rng.random() for _ in range(t)] for _ in range(b)]
        big = rng.choice([1e4, 1e30, 3e38])
        sparse = [[-big * rng.random() for _ in range(t)] for _ in range(b)]

    garbage = rng.choice([0.0, NAN, -INF, INF, 1e38])  # what sits in the padding
    mask = torch.tensor([[1.0 if j < n else 0.0 for j in range(t)] for n in lengths])
    as_t = lambda rows: torch.where(mask > 0, torch.tensor(rows, dtype=torch.float32),  # noqa: E731
                                    torch.tensor(garbage, dtype=torch.float32))
    logp_old, logp_sparse = as_t(old), as_t(sparse)
    ref_spread = rng.choice([0.0, 0.5, 5.0, 100.0])
    ref = [[(o if math.isfinite(o) else -1.0) + rng.gauss(0.0, ref_spread) for o in row] for row in old]
    logp_ref = as_t([[min(r, 0.0) for r in row] for row in ref])

    reward_kind = rng.choice(["binary", "all_equal", "group_equal", "continuous", "extreme"])
    if reward_kind == "binary":
        rewards = [float(rng.random() < 0.5) for _ in range(b)]
    elif reward_kind == "all_equal":
        rewards = [rng.choice([0.0, 1.0, -3.0])] * b
    elif reward_kind == "group_equal":
        rewards = [float(g % 2) for g in range(groups) for _ in range(per_group)]
    elif reward_kind == "continuous":
        rewards = [rng.gauss(0.0, 1.0) for _ in range(b)]
    else:
        rewards = [rng.choice([0.0, 1e6, -1e6, 1e-30]) for _ in range(b)]
    group_ids = [g for g in range(groups) for _ in range(per_group)]
    perm = list(range(b))
    rng.shuffle(perm)  # groups need not be contiguous
    noise_scale = rng.choice([0.0, 0.05, 1.0, 50.0])
    noise = torch.tensor([[rng.gauss(0.0, noise_scale) for _ in range(t)] for _ in range(b)], dtype=torch.float32)
    return Case(logp_old[perm], logp_sparse[perm], logp_ref[perm], mask[perm], [lengths[i] for i in perm],
                torch.tensor(rewards, dtype=torch.float32)[perm], torch.tensor(group_ids)[perm], noise)


def loss_configs(seed: int) -> list[LossConfig]:
    rng = random.Random(seed + 7919)
    out = []
    for kl in KL_TYPES:
        mode = rng.choice(AGG_MODES)
        out.append(LossConfig(
            eps_clip=rng.choice([0.2, 0.1]), eps_clip_high=rng.choice([None, 0.28]), eps_clip_c=rng.choice([None, 3.0]),
            loss_agg_mode=mode, use_kl_loss=True, kl_loss_coef=rng.choice([1e-4, 1.0]), kl_loss_type=kl,
            entropy_coef=rng.choice([0.0, 0.01]),
            norm_len=rng.randint(1, 32) if mode == "seq-mean-token-sum-norm" else None,
            ratio_level=rng.choice(RATIO_LEVELS),  # GSPO's sequence ratio too
        ))
    return out


def assert_finite(metrics: dict, where: str) -> None:
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    assert not bad, f"{where}: non-finite metrics {bad}"


def check_rejections_counted(case: Case, corr, preset: str, where: str) -> None:
    """Independent count of what the correction rejected, against its metrics and its output mask."""
    orig = case.mask > 0
    nonfinite = (orig & ~torch.isfinite(case.logp_old - case.logp_sparse)).any(dim=-1)
    has = orig.any(dim=-1)
    kept = (corr.mask > 0) & orig
    assert not bool(((corr.mask > 0) & ~orig).any()), f"{where}: a padding token is kept"
    assert not bool(kept[nonfinite].any()), f"{where}: a sequence with a non-finite log-prob kept a token"
    m = corr.metrics
    assert m["correction/nonfinite_seqs"] == int((nonfinite & has).sum()), where
    rejected_seqs = int((has & ~kept.any(dim=-1)).sum())
    assert m["correction/seqs"] == int(has.sum()), where
    assert m["correction/seq_reject_rate"] * max(int(has.sum()), 1) == pytest.approx(rejected_seqs, abs=1e-3), where
    rejected_tokens = int(orig.sum()) - int(kept.sum())
    token_rate = m["correction/token_reject_rate"]
    assert token_rate * max(int(orig.sum()), 1) == pytest.approx(rejected_tokens, abs=1e-3), where
    if preset == "none":  # nothing but the non-finite sequences may go
        assert rejected_seqs == int((nonfinite & has).sum()), where
    assert torch.isfinite(corr.weights).all(), f"{where}: non-finite weights"


def run_case(seed: int) -> int:
    """Everything one adversarial batch goes through at the algorithm level; returns how many losses it checked."""
    case = adversarial_case(seed)
    where = f"seed {seed}"
    adv, adv_metrics = grpo_advantages(case.rewards, case.group_ids, normalize_std=seed % 2 == 0)
    assert torch.isfinite(adv).all(), f"{where}: non-finite advantages {adv}"
    assert_finite(adv_metrics, where)
    assert_finite(mismatch_metrics(case.logp_old, case.logp_sparse, case.mask), f"{where} mismatch")
    checked = 0
    for preset in PRESETS:
        corr = sparsity_correction(case.logp_old, case.logp_sparse, case.mask, CorrectionConfig.from_preset(preset))
        assert_finite(corr.metrics, f"{where} {preset}")
        check_rejections_counted(case, corr, preset, f"{where} {preset}")
        for cfg in loss_configs(seed):
            logp = (case.logp_old + case.noise).clamp(max=0.0).requires_grad_(True)
            entropy = torch.rand_like(logp)
            loss, metrics = policy_loss(logp, case.logp_old, adv, corr.mask, cfg, weights=corr.weights,
                                        logp_ref=case.logp_ref, entropy=entropy)
            loss.backward()
            tag = f"{where} {preset} {cfg.kl_loss_type} {cfg.loss_agg_mode}"
            assert math.isfinite(loss.item()), f"{tag}: loss {loss.item()}"
            assert torch.isfinite(logp.grad).all(), f"{tag}: non-finite gradient"
            assert_finite(metrics, tag)
            assert metrics["loss/all_rejected"] == float(not bool((corr.mask > 0).any())), tag
            checked += 1
    return checked


class StubLearner:
    """compute_logprobs hands back the case's adversarial pi_old / pi_ref rows (the learner's side)."""

    def __init__(self, case: Case) -> None:
        self.case = case

    def compute_logprobs(self, tokens, response_lens, *, ref: bool = False):
        src = self.case.logp_ref if ref else self.case.logp_old
        return [src[i, :n].clone() for i, n in enumerate(response_lens)]


def run_pipeline_case(seed: int) -> None:
    """The same through the loop's own chain: prepare_rollout -> split_steps -> each learner micro-batch loss."""
    case = adversarial_case(seed, min_len=1)  # engines return at least one token (prepare_rollout checks it)
    where = f"pipeline seed {seed}"
    samples = [
        Sample(prompt_index=int(case.group_ids[i]), prompt_ids=[1, 2], response_ids=[3] * n,
               rollout_logprobs=case.logp_sparse[i, :n].tolist(), finish_reason="stop", reward=float(case.rewards[i]),
               kv=KVStats(dense_kv_tokens=n, kept_kv_tokens=n, peak_kv_tokens=n))
        for i, n in enumerate(case.lengths)
    ]
    preset = list(PRESETS)[seed % len(PRESETS)]
    estimator = ADVANTAGE_ESTIMATORS[(seed // len(PRESETS)) % len(ADVANTAGE_ESTIMATORS)]
    spec = AdvantageSpec(estimator, std_normalization=seed % 2 == 0, whiten=estimator.startswith("reinforce"))
    correction = CorrectionConfig.from_preset(preset)
    cfg = loss_configs(seed)[seed % len(KL_TYPES)]
    if spec.sequence_ratio:  # GSPO: a sequence-level weight and a mean over sequences (check_composition)
        if correction.is_weight:
            correction = CorrectionConfig.from_preset(preset, is_level="geometric")
        cfg = dataclasses.replace(cfg, ratio_level="sequence", loss_agg_mode="seq-mean-token-mean", norm_len=None)
    if spec.policy_loss_mode == "cispo":  # CISPO's loss: a per-token ratio, no dual clip (RunConfig refuses one)
        cfg = dataclasses.replace(cfg, policy_loss_mode="cispo", ratio_level="token", eps_clip_c=None)
    check_composition(spec, cfg, correction)
    prepared = prepare_rollout(samples, StubLearner(case), correction, advantage_spec=spec, need_ref=True)
    assert torch.isfinite(prepared.batch.advantages).all(), f"{where} {estimator}: non-finite advantages"
    assert_finite(prepared.metrics, where)
    nonfinite = sum(any(not math.isfinite(o - s) for o, s in zip(case.logp_old[i, :n].tolist(),
                                                                  case.logp_sparse[i, :n].tolist()))
                    for i, n in enumerate(case.lengths))
    assert prepared.metrics["correction/nonfinite_seqs"] == nonfinite, where
    steps = [d for d in (1, 2, 4) if len(samples) % d == 0]
    for part in split_steps(prepared.batch, random.Random(seed).choice(steps)):
        logp = (torch.nn.utils.rnn.pad_sequence(part.old_logprobs, batch_first=True)
                + case.noise[: len(part), : max(part.response_lens)]).clamp(max=0.0).requires_grad_(True)
        loss, metrics = microbatch_loss(logp, torch.rand_like(logp), part, cfg, part.num_seqs, part.num_tokens)
        loss.backward()
        assert math.isfinite(loss.item()), f"{where}: loss {loss.item()}"
        assert torch.isfinite(logp.grad).all(), f"{where}: non-finite gradient"
        assert_finite(metrics, where)


@pytest.mark.parametrize("block", range(4))
def test_fuzz_objective(block):
    n = FAST_CASES // 4
    checked = sum(run_case(seed) for seed in range(block * n, (block + 1) * n))
    assert checked == n * len(PRESETS) * len(KL_TYPES)


@pytest.mark.parametrize("block", range(4))
def test_fuzz_pipeline(block):
    n = FAST_CASES // 4
    for seed in range(block * n, (block + 1) * n):
        run_pipeline_case(seed)


@pytest.mark.slow
def test_fuzz_objective_full():
    checked = sum(run_case(seed) for seed in range(FULL_CASES))
    for seed in range(FULL_CASES):
        run_pipeline_case(seed)
    assert checked == FULL_CASES * len(PRESETS) * len(KL_TYPES)
