"""The rollout's correction contract: pi_old and the correction's verdict are taken once per sample
(`rollout.pipeline.correct`), the dynamic-sampling filters read that verdict, and the batch trains with it."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from slime_sparse.algo import AdvantageSpec, CorrectionConfig, sparsity_correction
from slime_sparse.config import RunConfig
from slime_sparse.rollout import pipeline
from slime_sparse.rollout.base_types import RolloutFnTrainOutput
from slime_sparse.rollout.filter_hub import load_filters, select_groups
from slime_sparse.rollout.pipeline import RolloutCorrection, correct, opsm_advantages, prepare_rollout
from slime_sparse.rollout.sparse_rollout import generate_rollout
from slime_sparse.types import GenerationOutput, Sample

WHITENED = AdvantageSpec(estimator="reinforce_plus_plus_baseline", whiten=True)
OPSM = CorrectionConfig(opsm_delta=0.05)


class KLLearner:
    """pi_old 0.5 nat above pi_sparse on the samples in `far` (OPSM's KL estimate 0.5 > delta), equal elsewhere;
    counts its dense forwards."""

    def __init__(self, far: set[tuple[int, int]]) -> None:
        self.far, self.forwards = far, 0
        self.order: list[tuple[int, int]] = []

    def compute_logprobs(self, tokens, response_lens, ref=False, shadow=None):
        self.forwards += 1
        return [torch.full((n,), -1.0 - (0.5 if key in self.far else 0.0))
                for key, n in zip(self.order, response_lens)]


def make_group(index: int, rewards: list[float], lens: list[int]) -> list[Sample]:
    return [Sample(prompt_index=index, prompt_ids=[1, 2], response_ids=[3] * n, rollout_logprobs=[-1.0] * n,
                   finish_reason="stop", reward=r) for r, n in zip(rewards, lens)]


def judged(learner: KLLearner, samples: list[Sample], spec: AdvantageSpec, cfg: CorrectionConfig):
    learner.order = [(s.prompt_index, j) for j, s in enumerate(samples)]
    return correct(samples, learner, cfg, advantage_spec=spec)


def test_filters_see_exactly_the_rejections_that_train_under_a_whitened_estimator():
    """Two rounds: round 1's groups 0 (mixed rewards, one long winner) and 1 (flat); round 2's group 2 (mixed).
    Whitened over the batch, group 1's zero advantages turn negative (the long winner lifts the token mean), so an
    OPSM that read the whitened sign would reject group 1's far samples in training while the filters, judging a
    round before the batch exists, kept them. The verdict is taken once, on the group baseline, and trains as is."""
    round1 = make_group(0, [1.0, 0.0], [12, 2]) + make_group(1, [1.0, 1.0], [2, 3])
    round2 = make_group(2, [0.0, 1.0], [4, 2])
    far = {(0, 1), (1, 2), (1, 3), (2, 0)}  # sample j of the round, by prompt index
    learner = KLLearner(far)
    first, second = judged(learner, round1, WHITENED, OPSM), judged(learner, round2, WHITENED, OPSM)
    batch = round1 + round2
    filters_saw = [s.rejected for s in batch]
    assert filters_saw == [False, True, False, False, True, False]  # losers with KL > delta; group 1 (0) kept

    whitened, _ = pipeline.group_advantages(batch, WHITENED)
    assert (whitened[2:4] < 0).all() and (opsm_advantages(batch, WHITENED)[2:4] == 0).all()  # the case bites

    corrected = RolloutCorrection.take([(first, [0, 1, 2, 3]), (second, [0, 1])], width=12)
    learner.order = [(s.prompt_index, j) for j, s in enumerate(round1)] + [(2, 0), (2, 1)]
    prepared = prepare_rollout(batch, learner, OPSM, advantage_spec=WHITENED, corrected=corrected)
    trained_rejected = [not bool(m.any()) for m in prepared.batch.loss_masks]
    assert trained_rejected == filters_saw
    # and the batch's numbers are the correction over the batch taken in one piece (the same advantages)
    lens = [len(s.response_ids) for s in batch]
    ref = sparsity_correction(pipeline.pad_right([o for o in corrected.old], 0.0, dtype=torch.float32),
                              pipeline.sampler_logprobs(batch), pipeline.response_mask(lens), OPSM,
                              advantages=opsm_advantages(batch, WHITENED))
    assert {k: prepared.metrics[k] for k in ref.metrics} == ref.metrics
    assert ref.metrics["correction/opsm_seq_frac"] == pytest.approx(2 / 6)
    assert all(torch.equal(w, ref.weights[i, :n]) for i, (w, n) in enumerate(zip(prepared.batch.weights, lens)))


def test_the_group_baseline_sign_is_the_trained_sign_without_whitening():
    """Without --normalize-advantages OPSM reads the very advantages that train (nothing changed for GRPO)."""
    batch = make_group(0, [1.0, 0.0, 0.0], [5, 2, 3]) + make_group(1, [0.3, 0.9], [2, 2])
    for spec in (AdvantageSpec(), AdvantageSpec(estimator="rloo"), AdvantageSpec(std_normalization=False)):
        assert torch.equal(opsm_advantages(batch, spec), pipeline.group_advantages(batch, spec)[0])


def test_a_custom_rollout_function_without_the_verdict_gets_an_error_naming_the_flags():
    """A rollout function that skips `correct` leaves Sample.rejected unset: check_min_kept_samples refuses the
    group instead of keeping every one."""
    groups = [make_group(0, [1.0, 0.0], [2, 2]), make_group(1, [0.0, 1.0], [2, 2])]
    cfg = RunConfig()
    with pytest.raises(ValueError, match="--dynamic-sampling-filter-path check_min_kept_samples .*"
                                         "--rollout-function-path"):
        select_groups(groups, load_filters(["check_min_kept_samples"]), cfg, need=2)
    learner = KLLearner({(0, 1)})
    judged(learner, groups[0] + groups[1], AdvantageSpec(), CorrectionConfig.from_preset("mis"))
    assert select_groups(groups, load_filters(["check_min_kept_samples"]), cfg, need=2).kept == [0, 1]


class _Stream:
    def __init__(self) -> None:
        self.at = 0

    def next_batch(self, size):
        out = [SimpleNamespace(index=self.at + i, label="1", prompt_ids=[1, 2]) for i in range(size)]
        self.at += size
        return out

    def put_back(self, n):
        self.at -= n


class _Engine:  # response lengths and rewards vary by prompt; log-probs constant
    def generate(self, prompts, params, seed=None):
        return [GenerationOutput(prompt_ids=p, response_ids=[3] * (2 + i % 3), logprobs=[-1.0] * (2 + i % 3),
                                 finish_reason="stop") for i, p in enumerate(prompts)]


class _CountingLearner:
    def __init__(self) -> None:
        self.forwards = 0

    def compute_logprobs(self, tokens, response_lens, ref=False, shadow=None):
        self.forwards += 1
        return [torch.full((n,), -1.0 - 0.3 * (n % 2)) for n in response_lens]


def test_the_correction_is_computed_once_per_rollout(monkeypatch):
    """The default rollout function and the batch built from its output: one dense forward, one judgement of the
    rules, over one round's samples (the loop used to take both twice)."""
    from slime_sparse.run import prepare_batch

    calls = []
    real = pipeline.judge_rows
    monkeypatch.setattr(pipeline, "judge_rows", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, rollout_batch_size=2,
                                                                n_samples_per_prompt=3),
                              correction=CorrectionConfig.from_preset("mis"))
    learner = _CountingLearner()
    source = SimpleNamespace(stream=_Stream(), engine=_Engine(), learner=learner, filters=[],
                             tokenizer=SimpleNamespace(batch_decode=lambda ids, **k: ["x"] * len(ids)),
                             reward_fn=lambda texts, labels, extras: ([float(i % 2) for i in range(len(texts))], {}))
    out = generate_rollout(cfg, 0, source)
    assert isinstance(out, RolloutFnTrainOutput) and len(out.correction) == 6
    prepared, metrics = prepare_batch(cfg, SimpleNamespace(learner=learner), out)
    assert calls == [6] and learner.forwards == 1
    assert metrics["correction/seqs"] == 6.0
    # a rollout function that hands on no correction (slime's bare groups): the batch judges it, once
    calls.clear()
    learner.forwards = 0
    prepare_batch(cfg, SimpleNamespace(learner=learner), RolloutFnTrainOutput(samples=out.samples,
                                                                              plan=out.plan))
    assert calls == [6] and learner.forwards == 1
