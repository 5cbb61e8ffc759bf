"""The Sparse-RL objective, shared by every backend: pure torch, no engine or learner imports.

- advantages: GRPO / Dr.GRPO group-normalised advantages.
- correction: sparsity-consistency weights xi = pi_old / pi_sparse and rejection (presets none/paper/mis).
- loss: clipped PPO surrogate with xi outside the clip, KL and entropy terms, slime's aggregation modes.
- metrics: sampler/learner mismatch diagnostics and KV-cache savings.
"""
from slime_sparse.algo.advantages import broadcast_to_tokens, grpo_advantages
from slime_sparse.algo.correction import PRESETS, CorrectionConfig, CorrectionResult, sparsity_correction
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
from slime_sparse.algo.metrics import kv_metrics, mismatch_metrics, shadow_metrics

__all__ = [
    "AGG_MODES",
    "KL_TYPES",
    "LOSS_TYPES",
    "PRESETS",
    "CorrectionConfig",
    "CorrectionResult",
    "LossConfig",
    "aggregate",
    "broadcast_to_tokens",
    "categorical_kl",
    "grpo_advantages",
    "kl_estimate",
    "kv_metrics",
    "mismatch_metrics",
    "policy_loss",
    "shadow_metrics",
    "sparsity_correction",
]
