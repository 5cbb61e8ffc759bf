"""The default rollout function (slime's --rollout-function-path): generation rounds with dynamic sampling.

`generate_rollout(cfg, rollout_id, data_source, evaluation=False)` has slime's signature (slime's default lives in
`slime.rollout.sglang_rollout`). `data_source` is the run's Components: its prompt stream (slime's data source), the
engine, tokenizer, reward function and learner a rollout uses (slime's function reaches its SGLang servers through
globals) and the dynamic-sampling filters (`filters`, resolved once at build). Another function given by
--rollout-function-path replaces this one and receives the same; it returns the groups to train on and, if it
judged them, their correction (slime_sparse.rollout.base_types).
"""
from __future__ import annotations

import logging
import time
from collections import Counter

from slime_sparse.rollout.base_types import RolloutFnTrainOutput
from slime_sparse.rollout.filter_hub import round_size, select_groups
from slime_sparse.rollout.partial import partial_round
from slime_sparse.rollout.pipeline import RolloutCorrection, assign_rewards, correct, response_metrics, to_samples
from slime_sparse.rollout.sampling import derive_seed
from slime_sparse.types import Sample

logger = logging.getLogger("slime_sparse.train")


def rollout_seed(cfg, rollout_id: int, round_id: int = 0) -> int:
    """Sampling seed of one generation round of a rollout: a pure function of (seed, rollout id, round), so a
    resumed run draws the same. Round 0 (the only one without dynamic sampling) keeps the plain formula."""
    seed = cfg.train.seed * 1_000_003 + rollout_id
    return seed if round_id == 0 else derive_seed(seed, -round_id)


def generate_rollout(cfg, rollout_id: int, data_source, evaluation: bool = False) -> RolloutFnTrainOutput:
    """Generation rounds until the batch holds --rollout-batch-size groups that pass --dynamic-sampling-filter-path
    (slime's dynamic sampling, DAPO), at most --dynamic-sampling-max-rounds of them. A round draws prompts
    (`round_size`: --over-sampling-batch-size first), generates, scores, takes the correction (`correct`: pi_old and
    the verdict the filters read, which the batch then trains with) and judges its groups in stream order; the groups
    after the last one the batch needed go back to the prompt stream, so every prompt is trained on or dropped
    (counted) exactly once.

    Metrics: rollout/* over every generated sample, dynamic sampling's counts, timings."""
    if evaluation:  # slime routes evaluation through the rollout function; here it is slime_sparse.eval's
        raise ValueError("slime_sparse.rollout.sparse_rollout.generate_rollout generates train rollouts only: evaluation runs "
                         "through slime_sparse.eval")
    n, target = cfg.rollout.n_samples_per_prompt, cfg.rollout.rollout_batch_size
    plan = cfg.rollout_plan(rollout_id)
    out = RolloutFnTrainOutput(samples=[], plan=plan)
    judged: list[tuple[RolloutCorrection, list[int]]] = []  # each round's correction, and the rows the batch keeps
    generated: list[Sample] = []
    counts: Counter = Counter()
    t_rollout = t_recompute = 0.0
    for round_id in range(cfg.rollout.dynamic_sampling_max_rounds):
        kept = len(out.samples)
        size = round_size(cfg.rollout.sampling_batch_size, need=target - kept, kept=kept,
                          judged=kept + counts["rollout/groups_dropped"])
        seed = rollout_seed(cfg, rollout_id, round_id)
        if partial := getattr(data_source, "partial", None):  # --partial-rollout: carried groups first, then fresh
            made = partial_round(cfg, data_source, rollout_id, size, target - kept, seed)
            t_rollout += made.generate_s
            counts.update(made.metrics)
            samples = [s for group in made.complete for s in group.samples()]
        else:
            records = data_source.stream.next_batch(size)
            t0 = time.perf_counter()
            outputs = data_source.engine.generate([r.prompt_ids for r in records for _ in range(n)], cfg.sampling,
                                                  seed=seed)
            t_rollout += time.perf_counter() - t0
            samples = to_samples(records, outputs, n)
            for s in samples:  # the policy version (rollouts trained) of the weights that wrote it: its staleness
                s.segments = [(0, getattr(data_source, "policy_version", 0))]
        if samples:
            counts.update(assign_rewards(samples, data_source.tokenizer, data_source.reward_fn))
        t1 = time.perf_counter()
        # --async: pi_old waits for the learner's weights of the step that trains on it (train_async)
        corrected = None if plan.defer_old or not samples else correct(
            samples, data_source.learner, cfg.correction, advantage_spec=cfg.rollout.advantage_spec, plan=plan)
        t_recompute += time.perf_counter() - t1

        groups = [samples[i:i + n] for i in range(0, len(samples), n)]
        selection = select_groups(groups, data_source.filters, cfg, target - len(out.samples))
        if partial:  # what the batch did not need waits in the buffer, finished or not
            made.carry(partial, selection.judged)
        else:
            data_source.stream.put_back(len(groups) - selection.judged)
        out.samples += [groups[g] for g in selection.kept]
        if corrected is not None:
            judged.append((corrected, [g * n + j for g in selection.kept for j in range(n)]))
        generated += samples
        counts.update({"rollout/groups_generated": len(groups),
                       "rollout/groups_put_back": len(groups) - selection.judged,
                       "rollout/groups_dropped": sum(selection.dropped.values()), "rollout/gen_rounds": 1,
                       **{f"rollout/dynamic_filter/drop_{k}": v for k, v in selection.dropped.items()}})
        if len(out.samples) == target:
            break
    else:
        logger.warning("rollout %d: dynamic sampling kept %d of --rollout-batch-size=%d groups in "
                       "--dynamic-sampling-max-rounds=%d rounds; training on those", rollout_id,
                       len(out.samples), target, cfg.rollout.dynamic_sampling_max_rounds)
    if judged and out.samples:  # --async: none (pi_old waits for the weights that train it; the pipeline judges)
        width = max(len(s.response_ids) for group in out.samples for s in group)
        out.correction = RolloutCorrection.take(judged, width)
    # tokens generated in this rollout (a partial one's: also those of groups it carries on, none it carried in)
    gen_tokens = counts.pop("rollout/partial_new_tokens") if "rollout/partial_new_tokens" in counts else \
        sum(len(s.response_ids) for s in generated)
    train_tokens = sum(len(s.response_ids) for group in out.samples for s in group)
    out.metrics = {
        **(response_metrics(generated) if generated else {}), **{k: float(v) for k, v in counts.items()},
        "rollout/groups_kept": float(len(out.samples)),
        "rollout/dynamic_sampling_exhausted": float(len(out.samples) < target),
        "rollout/gen_tokens": float(gen_tokens),
        "rollout/gen_tokens_per_train_token": gen_tokens / max(train_tokens, 1),
        "perf/rollout_s": t_rollout, "perf/recompute_s": t_recompute,
        "perf/rollout_tokens_per_s": gen_tokens / max(t_rollout, 1e-9),
    }
    return out
