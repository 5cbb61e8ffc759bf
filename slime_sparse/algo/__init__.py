"""The Sparse-RL objective, shared by every backend: pure torch, no engine or learner imports.

- advantages: the estimators (GRPO / Dr.GRPO, GSPO, RLOO, REINFORCE++ and its baseline variant).
- correction: the rollout-correction algebra (weights at token / sequence / geometric level, truncate or mask,
  rejection statistics, veto, OPSM, batch normalisation, bypass) and its presets (ours and verl's).
- loss: clipped PPO surrogate with xi outside the clip, KL and entropy terms, slime's aggregation modes.
- metrics: sampler/learner mismatch diagnostics (total and its sparsity / numeric split), their alarms, KV savings.
"""
from slime_sparse.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageSpec,
    broadcast_to_tokens,
    compute_advantages,
    grpo_advantages,
)
from slime_sparse.algo.correction import (
    ALL_PRESETS,
    PRESETS,
    RS_OPTIONS,
    VERL_PRESETS,
    CorrectionConfig,
    CorrectionResult,
    RowVerdict,
    batch_correction,
    judge_rows,
    sparsity_correction,
)
from slime_sparse.algo.loss import (
    AGG_MODES,
    KL_TYPES,
    LOSS_TYPES,
    LossConfig,
    aggregate,
    categorical_kl,
    kl_estimate,
    policy_loss,
)
from slime_sparse.algo.metrics import (
    MISMATCH_ALARMS,
    crossed_alarms,
    kv_metrics,
    log_ratio_stats,
    mismatch_metrics,
    mismatch_split_metrics,
    mismatch_staleness_metrics,
    shadow_metrics,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "AdvantageSpec",
    "ALL_PRESETS",
    "KL_TYPES",
    "LOSS_TYPES",
    "MISMATCH_ALARMS",
    "PRESETS",
    "RS_OPTIONS",
    "VERL_PRESETS",
    "CorrectionConfig",
    "CorrectionResult",
    "RowVerdict",
    "batch_correction",
    "judge_rows",
    "LossConfig",
    "aggregate",
    "broadcast_to_tokens",
    "categorical_kl",
    "compute_advantages",
    "crossed_alarms",
    "grpo_advantages",
    "kl_estimate",
    "kv_metrics",
    "log_ratio_stats",
    "mismatch_metrics",
    "mismatch_split_metrics",
    "mismatch_staleness_metrics",
    "policy_loss",
    "shadow_metrics",
    "sparsity_correction",
]
