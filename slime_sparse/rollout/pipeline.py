"""From rollout samples to training batches: rewards -> pi_old and the correction's verdict -> advantages -> batch.

The steps every backend combination shares, as small functions over plain data. The rollout function
(`slime_sparse.rollout.sparse_rollout`) and the training loop (`slime_sparse.train`) string them together; learners
and engines stay unaware of each other.

The sparsity correction is judged once per sample (`correct`, a `RolloutCorrection`): the dynamic-sampling filters
read its verdict (`Sample.rejected`) and `prepare_rollout` trains with the same rows, adding only what depends on the
whole batch (the weights' normalisation, the metrics: `algo.correction.batch_correction`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from slime_sparse.algo import (
    AdvantageSpec,
    CorrectionConfig,
    RowVerdict,
    batch_correction,
    compute_advantages,
    judge_rows,
    kv_metrics,
    mismatch_metrics,
    mismatch_split_metrics,
    shadow_metrics,
)
from slime_sparse.algo.advantages import group_baseline_advantages
from slime_sparse.backends.base import TrainBatch
from slime_sparse.backends.logprobs import pad_right, response_mask
from slime_sparse.rollout.base_types import RolloutPlan
from slime_sparse.types import GenerationOutput, Sample


def to_samples(records: list, outputs: list[GenerationOutput], n_samples: int) -> list[Sample]:
    """Pair engine outputs (prompt-major: n_samples consecutive outputs per record) with their records."""
    if len(outputs) != len(records) * n_samples:
        raise ValueError(f"expected {len(records) * n_samples} outputs for {len(records)} prompts, got {len(outputs)}")
    samples = []
    for j, out in enumerate(outputs):
        rec = records[j // n_samples]
        samples.append(Sample(
            prompt_index=rec.index, prompt_ids=list(out.prompt_ids), response_ids=list(out.response_ids),
            rollout_logprobs=list(out.logprobs), finish_reason=out.finish_reason, label=rec.label, kv=out.kv,
            weight_version=out.weight_version, evictions=out.evictions,
        ))
    return samples


def assign_rewards(samples: list[Sample], tokenizer, reward_fn) -> dict[str, float]:
    """Score `samples` in place; returns the reward function's counters (reward/..., counts: they add up)."""
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    extras = [{"finish_reason": s.finish_reason} for s in samples]  # e.g. "no reward for a truncated answer"
    rewards, counters = reward_fn(texts, [s.label for s in samples], extras)
    for s, r in zip(samples, rewards):
        s.reward = float(r)
    return {f"reward/{k}": float(v) for k, v in counters.items()}


def response_metrics(samples: list[Sample]) -> dict[str, float]:
    """Reward and length statistics of generated samples."""
    lengths = [len(s.response_ids) for s in samples]
    return {
        "rollout/reward_mean": sum(s.reward for s in samples) / len(samples),
        "rollout/response_len_mean": sum(lengths) / len(lengths),
        "rollout/response_len_max": float(max(lengths)),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }


def group_advantages(samples: list[Sample], spec: AdvantageSpec) -> tuple[torch.Tensor, dict[str, float]]:
    """The advantages of `samples` (whole groups) under `spec` (--advantage-estimator ...) and their metrics."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    group_ids = torch.tensor([s.prompt_index for s in samples], dtype=torch.long)
    lens = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long)
    return compute_advantages(rewards, group_ids, lens, spec)


def sampler_logprobs(samples: list[Sample]) -> torch.Tensor:
    """[B, T] pi_sparse of the response tokens, right-padded with 0."""
    return pad_right([torch.tensor(s.rollout_logprobs, dtype=torch.float32) for s in samples], 0.0,
                     dtype=torch.float32)


def train_mask(samples: list[Sample], plan: RolloutPlan) -> tuple[torch.Tensor, float | None]:
    """[B, T] the response tokens that train, and (--mask-offpolicy-in-partial-rollout, slime's: only a continued
    sample's last stretch trains) the fraction of response tokens that rule masked (None: off)."""
    mask = response_mask([len(s.response_ids) for s in samples])
    if not plan.mask_offpolicy:
        return mask, None
    last = torch.tensor([s.segments[-1][0] if s.segments else 0 for s in samples])
    offpolicy = torch.arange(mask.shape[1])[None, :] < last[:, None]
    frac = float((offpolicy & (mask > 0)).sum() / mask.sum())
    return mask.masked_fill(offpolicy, 0), frac


def opsm_advantages(samples: list[Sample], spec: AdvantageSpec) -> torch.Tensor:
    """The advantages OPSM (--correction-opsm-delta) reads the sign of: before the batch whitening
    (--normalize-advantages), so each depends on its own group only and a filter judging a round sees the verdict
    that trains. Without whitening they are the trained advantages themselves."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    group_ids = torch.tensor([s.prompt_index for s in samples], dtype=torch.long)
    return group_baseline_advantages(rewards, group_ids, spec.estimator, spec.std_normalization)[0]


@dataclass
class RolloutCorrection:
    """pi_old and the sparsity correction's verdict on samples, judged once (`correct`): what the dynamic-sampling
    filters read and what `prepare_rollout` trains with. A rollout function hands it on in
    `RolloutFnTrainOutput.correction` (rows in the order of its groups' samples)."""

    old: list[torch.Tensor] | None  # the dense pi_old of each sample; None: not needed (bypass, xi = 1)
    verdict: RowVerdict

    def __len__(self) -> int:
        return self.verdict.keep.shape[0]

    @staticmethod
    def take(parts: "list[tuple[RolloutCorrection, list[int]]]", width: int) -> "RolloutCorrection":
        """The rows `rows` of each part, in order (the groups a rollout keeps from its rounds); `width`: the
        longest response among them."""
        old = None if any(p.old is None for p, _ in parts) else [p.old[i] for p, rows in parts for i in rows]
        return RolloutCorrection(old=old, verdict=RowVerdict.take([(p.verdict, rows) for p, rows in parts], width))


def correct(samples: list[Sample], learner, correction: CorrectionConfig, *,
            advantage_spec: AdvantageSpec = AdvantageSpec(), plan: RolloutPlan = RolloutPlan()) -> RolloutCorrection:
    """The one correction call of `samples`: their dense pi_old and the correction's verdict on each (every rule;
    `judge_rows`), and `Sample.rejected` set from it (what dynamic-sampling filters read). Under shadow / smd
    (`plan.trains_shadow`) nothing is rejected (the PPO term trains the sampler's own policy); the verdict is still
    taken, for the metrics (what sparse_rl would have rejected).

    No forward when nothing needs pi_old: under --correction-bypass-mode with no rejection rule on a rollout without
    the mismatch split (`plan.mismatch_split`); only the non-finite rule then rejects (xi = 1)."""
    tokens = [s.prompt_ids + s.response_ids for s in samples]
    response_lens = [len(s.response_ids) for s in samples]
    if min(response_lens) == 0:
        raise ValueError("a sample has an empty response; engines must return at least one token")
    old = learner.compute_logprobs(tokens, response_lens) if correction.needs_dense or plan.mismatch_split else None
    logp_sparse = sampler_logprobs(samples)
    logp_old = logp_sparse if old is None else pad_right(old, 0.0, dtype=torch.float32)  # xi = 1: judges finiteness
    advantages = opsm_advantages(samples, advantage_spec) if correction.opsm_delta is not None else None
    verdict = judge_rows(logp_old, logp_sparse, train_mask(samples, plan)[0], correction, advantages=advantages)
    for s, k in zip(samples, verdict.seq_kept.tolist()):
        s.rejected = not plan.trains_shadow and not k
    return RolloutCorrection(old=old, verdict=verdict)


def shadow_records(samples: list[Sample], trains_shadow: bool) -> list | None:
    """Each sample's eviction record for the shadow forward (None under sparse_rl, which needs none).

    A record of None means a dense sample; one whose cache was compressed must have a record, or its shadow
    log-probs would silently be the dense ones (an SGLang server without the record-shipping plugin, or a request
    retracted after a compression: the engine's log names it).
    """
    if not trains_shadow:
        return None
    for j, s in enumerate(samples):
        if s.evictions is None and s.kv.compressions > 0:
            raise ValueError(f"--loss-type shadow / smd: sample {j} (prompt index {s.prompt_index}) was generated under "
                             f"{s.kv.compressions} cache compressions but came without an eviction record (an SGLang "
                             "server whose plugin ships none, or a request retracted after a compression: see the "
                             "engine's log)")
    return [s.evictions for s in samples]


def shadow_logprobs_for_split(samples: list[Sample], learner, old: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """pi_shadow for the mismatch split: the learner's forward under each sample's eviction record; the dense
    pi_old itself when no sample was compressed (nothing evicted: pi_shadow = pi_old, no forward needed); None when
    a compressed sample has no record (an engine that returns none: the split cannot be made)."""
    if all(s.kv.compressions == 0 for s in samples):
        return old
    if any(s.evictions is None and s.kv.compressions > 0 for s in samples):
        return None
    return learner.compute_logprobs([s.prompt_ids + s.response_ids for s in samples],
                                    [len(s.response_ids) for s in samples], shadow=[s.evictions for s in samples])


@dataclass
class PreparedRollout:
    batch: TrainBatch
    metrics: dict[str, float]


# What the correction can say without pi_old (bypass, between diagnostics): only the non-finite rule rejected.
_COUNTS_WITHOUT_PI_OLD = ("correction/seqs", "correction/seq_reject_rate", "correction/token_reject_rate",
                          "correction/nonfinite_seqs")


def prepare_rollout(
    samples: list[Sample],
    learner,
    correction: CorrectionConfig,
    *,
    advantage_spec: AdvantageSpec = AdvantageSpec(),
    need_ref: bool = False,
    corrected: RolloutCorrection | None = None,
    plan: RolloutPlan = RolloutPlan(),
) -> PreparedRollout:
    """Advantages (`advantage_spec`: --advantage-estimator ...), pi_ref, and the sparsity correction over the whole
    train batch: `corrected` (the rollout function's `correct` of these samples, in this order) finished over the
    batch (the weights' normalisation, the metrics); None: `correct` is called here (--async, where pi_old waits for
    the learner's weights of the step that trains it, or a rollout function that returns none).

    The correction is computed once per rollout, before the optimizer steps: its inputs (pi_old, pi_sparse, the
    advantages OPSM reads) do not change during them.

    --correction-bypass-mode: the PPO anchor is the sampler's own log-prob (no weights); the dense pi_old is
    computed only when a rejection rule reads it or the mismatch split is due.

    `plan` (RunConfig.rollout_plan, carried by the rollout's output): `plan.mismatch_split` (due every
    --mismatch-metrics-interval rollouts): the mismatch split, mismatch/sparsity/* (dense pi_old against
    pi_shadow, the recompute under each sample's eviction record) and mismatch/numeric/* (pi_shadow against the
    sampler), at the cost of one shadow forward under sparse_rl (`perf/mismatch_split_s`); free, so every rollout,
    under shadow / smd.

    `plan.trains_shadow` (--loss-type shadow / smd): the PPO term trains pi_shadow, so pi_old (and pi_ref) are
    recomputed under each sample's eviction record and nothing is corrected or rejected (pi_shadow is the
    sampler's policy). The dense pi_old is
    still computed, for the mismatch metrics (how far the dense policy is from the sampler: what SMD distils) and
    the correction's metrics (what sparse_rl would have rejected); `shadow/*` compares pi_shadow with pi_sparse
    (~0: the recompute is exact up to the learner's numerics).
    """
    if plan.trains_shadow and correction.bypass_mode:
        raise ValueError("--correction-bypass-mode with --loss-type shadow / smd: their PPO anchor is already the "
                         "sampler's own policy (pi_shadow)")
    advantages, adv_metrics = group_advantages(samples, advantage_spec)
    tokens = [s.prompt_ids + s.response_ids for s in samples]
    response_lens = [len(s.response_ids) for s in samples]
    shadow = shadow_records(samples, plan.trains_shadow)
    on_shadow = {} if shadow is None else {"shadow": shadow}  # a sparse_rl learner need not know the keyword
    if corrected is None:
        corrected = correct(samples, learner, correction, advantage_spec=advantage_spec, plan=plan)
    elif len(corrected) != len(samples):
        raise ValueError(f"the rollout's correction judged {len(corrected)} samples, its batch holds {len(samples)}")
    old = corrected.old
    ref = learner.compute_logprobs(tokens, response_lens, ref=True, **on_shadow) if need_ref else None
    logp_sparse = sampler_logprobs(samples)
    logp_old = logp_sparse if old is None else pad_right(old, 0.0, dtype=torch.float32)
    mask, offpolicy_frac = train_mask(samples, plan)
    if offpolicy_frac is not None:
        adv_metrics["rollout/offpolicy_masked_frac"] = offpolicy_frac
    corr = batch_correction(corrected.verdict, correction)
    bounds = correction.diagnostic_bounds()

    metrics = {**adv_metrics, **kv_metrics([s.kv for s in samples])}
    if old is None:
        metrics.update({k: corr.metrics[k] for k in _COUNTS_WITHOUT_PI_OLD})
    else:
        metrics.update({**corr.metrics, **mismatch_metrics(logp_old, logp_sparse, mask, **bounds)})
    # samples that carry a policy gradient: a nonzero advantage and a token the correction kept
    trained = corr.seq_kept if shadow is None else torch.ones_like(corr.seq_kept)  # shadow / smd reject nothing
    metrics["rollout/effective_batch_size"] = float(((advantages != 0) & trained).sum())
    batch = TrainBatch(
        tokens=tokens,
        response_lens=response_lens,
        advantages=advantages,
        loss_masks=[corr.mask[i, :n] for i, n in enumerate(response_lens)],
        old_logprobs=old,
        ref_logprobs=ref,
        weights=[corr.weights[i, :n] for i, n in enumerate(response_lens)],
    )
    if correction.bypass_mode:  # PPO's ratio pi_theta / pi_sparse reweights; no weight may be set
        batch.old_logprobs, batch.weights = [logp_sparse[i, :n] for i, n in enumerate(response_lens)], None
    shadow_old = None
    if shadow is not None:
        shadow_old = learner.compute_logprobs(tokens, response_lens, **on_shadow)
        metrics.update(shadow_metrics(pad_right(shadow_old, 0.0, dtype=torch.float32), logp_sparse, mask))
        batch.old_logprobs, batch.evictions, batch.weights = shadow_old, shadow, None
        batch.loss_masks = [mask[i, :n] for i, n in enumerate(response_lens)]
    if old is not None and plan.mismatch_split:
        t0 = time.perf_counter()
        split = shadow_old if shadow_old is not None else shadow_logprobs_for_split(samples, learner, old)
        if split is not None:
            metrics.update(mismatch_split_metrics(logp_old, pad_right(split, 0.0, dtype=torch.float32), logp_sparse,
                                                  mask, **bounds))
            metrics["perf/mismatch_split_s"] = time.perf_counter() - t0  # ~0 where the shadow forward was paid
    return PreparedRollout(batch=batch, metrics=metrics)


def split_steps(batch: TrainBatch, n_steps: int) -> list[TrainBatch]:
    """Cut a rollout into `n_steps` global batches (in order, like slime), each with its own normalisers: the
    one place the loop sets them (learners and the Ray learner group only read them). A batch that dynamic
    sampling could not fill still takes `n_steps` steps (sizes differing by at most one), so the lr schedule keeps
    its place; fewer only when it holds fewer samples than that (no step is empty)."""
    size, longer = divmod(len(batch), n_steps)
    out, start = [], 0
    for k in range(n_steps):
        end = start + size + (k < longer)
        if end > start:
            part = batch.select(list(range(start, end)))
            part.num_seqs, part.num_tokens = part.kept_counts()
            out.append(part)
        start = end
    return out
