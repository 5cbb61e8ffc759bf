"""From rollout samples to training batches: rewards -> advantages -> dense recompute -> correction.

The steps every backend combination shares, as small functions over plain data. The rollout function
(`slime_sparse.rollout_fn`) and the training loop (`slime_sparse.train`) string them together; learners and
engines stay unaware of each other.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from slime_sparse.algo import (
    AdvantageSpec,
    CorrectionConfig,
    compute_advantages,
    grpo_advantages,
    kv_metrics,
    mismatch_metrics,
    mismatch_split_metrics,
    shadow_metrics,
    sparsity_correction,
)
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


def dense_logprobs(samples: list[Sample], learner, correction: CorrectionConfig, *,
                   plan: RolloutPlan = RolloutPlan()) -> list[torch.Tensor] | None:
    """Dense pi_old of `samples`' response tokens; also marks each sample the sparsity correction rejects whole
    (`Sample.rejected`, what dynamic-sampling filters read: it depends on its own group only). Under shadow / smd
    (`plan.trains_shadow`) nothing is rejected (the PPO term trains the sampler's own policy).

    None, and no forward, when nothing needs pi_old: under --correction-bypass-mode with no rejection rule on a
    rollout without the mismatch split (`plan.mismatch_split`); only the non-finite rule then rejects."""
    tokens = [s.prompt_ids + s.response_ids for s in samples]
    response_lens = [len(s.response_ids) for s in samples]
    if min(response_lens) == 0:
        raise ValueError("a sample has an empty response; engines must return at least one token")
    old = learner.compute_logprobs(tokens, response_lens) if correction.needs_dense or plan.mismatch_split else None
    logp_sparse = sampler_logprobs(samples)
    logp_old = logp_sparse if old is None else pad_right(old, 0.0, dtype=torch.float32)  # xi = 1: judges finiteness
    # OPSM reads only the advantages' signs: those of R - group mean, which the std normalisation (and RLOO's
    # factor) do not change; under the whitened estimators the final sign may differ (prepare_rollout uses it)
    advantages = None
    if correction.opsm_delta is not None:
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        advantages = grpo_advantages(rewards, torch.tensor([s.prompt_index for s in samples]), normalize_std=False)[0]
    kept = sparsity_correction(logp_old, logp_sparse, response_mask(response_lens), correction,
                               advantages=advantages).seq_kept
    for s, k in zip(samples, kept.tolist()):
        s.rejected = not plan.trains_shadow and not k
    return old


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
    old: list[torch.Tensor] | None = None,
    plan: RolloutPlan = RolloutPlan(),
) -> PreparedRollout:
    """Advantages (`advantage_spec`: --advantage-estimator ...), dense pi_old (unless given: the rollout function has
    it from `dense_logprobs`) and pi_ref recompute, and the sparsity correction over the whole train batch.

    The correction (incl. batch normalisation of weights) is computed once per rollout, over all of its samples,
    before the optimizer steps: its inputs (pi_old, pi_sparse, the advantages OPSM reads) do not change during them.

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
    if old is None:
        old = dense_logprobs(samples, learner, correction, plan=plan)
    ref = learner.compute_logprobs(tokens, response_lens, ref=True, **on_shadow) if need_ref else None
    logp_sparse = sampler_logprobs(samples)
    logp_old = logp_sparse if old is None else pad_right(old, 0.0, dtype=torch.float32)
    mask = response_mask(response_lens)
    if plan.mask_offpolicy:  # slime's --mask-offpolicy-in-partial-rollout: only the last stretch is trained
        last = torch.tensor([s.segments[-1][0] if s.segments else 0 for s in samples])
        offpolicy = torch.arange(mask.shape[1])[None, :] < last[:, None]
        adv_metrics["rollout/offpolicy_masked_frac"] = float((offpolicy & (mask > 0)).sum() / mask.sum())
        mask = mask.masked_fill(offpolicy, 0)
    corr = sparsity_correction(logp_old, logp_sparse, mask, correction, advantages=advantages)
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
